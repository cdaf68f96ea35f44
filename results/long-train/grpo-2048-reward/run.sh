# GRPO, 2048-token responses, rewards that differ (results/long-train/README.md, section after "GRPO run with
# 2048-token responses"). Run from the repository root under the bench lock:
#   flock /tmp/jetflow-bench.lock nice -n 5 bash results/long-train/grpo-2048-reward/run.sh > /tmp/long-measure/grpo.log 2>&1
# (copied here as run.log)
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
OUT=/tmp/long-measure/runs; D=results/long-train/grpo-2048-reward
rm -rf $OUT/grpo-2048-reward $D/logs
date -u +"start %FT%TZ"; uptime
/usr/bin/time -v /work/main/.venv/bin/python scripts/analysis/long_train_grpo_2048.py --config $D/grpo.yaml --log-dir $D/logs \
  run.out_dir=$OUT
date -u +"end %FT%TZ"; uptime
cp $OUT/grpo-2048-reward/{config.yaml,metrics.jsonl,mismatch_positions.jsonl,summary.json} $D/
cp $OUT/grpo-2048-reward/report/* $D/ 2>/dev/null
