# usage: run.sh NAME R B [env...]   one bench train step, 1 thread, VmHWM sampled
NAME=$1; R=$2; B=$3; shift 3
OUT=/tmp/mem
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=${CODE:-/work/main} OMP_NUM_THREADS=1
date -u +"start %T load $(cut -d' ' -f1 /proc/loadavg)" > $OUT/$NAME.rss
env "$@" /work/main/.venv/bin/python ${PYMOD:--m jetflow.cli} bench train-step --model smollm2 --modes unified --batch $B --prompt-len 64 \
  --response-len $R --lengths fixed --reps 1 --warmup 0 --out-dir $OUT --name $NAME \
  --max-tokens-per-micro-batch 4352 train.logprob_chunk_tokens=1024 train.activation_checkpointing=true \
  run.num_threads=1 model.cache_dir=/work/main/.cache/models > $OUT/$NAME.log 2>&1 &
P=$!
while kill -0 $P 2>/dev/null; do
  echo $(date -u +%T) $(grep -E 'VmHWM|VmRSS' /proc/$P/status 2>/dev/null | tr -s ' ' | tr '\n' ' ') minflt_utime_stime $(awk '{print $10, $14, $15}' /proc/$P/stat 2>/dev/null) >> $OUT/$NAME.rss
  sleep 5
done
date -u +"end %T load $(cut -d' ' -f1 /proc/loadavg)" >> $OUT/$NAME.rss
