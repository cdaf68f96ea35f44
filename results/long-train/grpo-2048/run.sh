cd /work/wt-pack
export PYTHONPATH=/work/wt-pack HF_HUB_OFFLINE=1
date -u +"start %FT%TZ"; uptime
/usr/bin/time -v /work/main/.venv/bin/python scripts/analysis/long_train_grpo_2048.py model.tiny.max_position=2176 \
  rollout.max_new_tokens=2048 rollout.group_size=4 train.prompts_per_step=2 train.steps=4 train.sft_warmup_steps=0 \
  train.max_tokens_per_micro_batch=4352 train.logprob_chunk_tokens=512 train.activation_checkpointing=true \
  eval.num_prompts=0 run.num_threads=2 run.progress=false run.tensorboard=false \
  run.out_dir=/tmp/pack2/runs run.name=grpo-2048
date -u +"end %FT%TZ"; uptime
