#!/bin/bash
# Peak RSS and trained tokens/s of one train step (issue 39's Must-show table), SmolLM2 unified exact, 64-token
# prompts, chunked log-probs + activation checkpointing + packing. Run from the repository root, whole under
#   flock /tmp/jetflow-bench.lock bash results/long-train/peak/run.sh
# Measured from an export of commit 8fc7502 (the code of this branch that these runs used), each configuration in
# a fresh process, a 10 s sampler of the process's VmHWM / VmRSS beside it (<name>.rss).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
OUT=results/long-train/peak
for RB in 1024:8 2048:8 256:8 4096:2; do
  R=${RB%:*}; B=${RB#*:}; NAME=peak-b$B-r$R-after
  python -m jetflow.cli bench train-step --model smollm2 --modes unified --batch $B --prompt-len 64 \
    --response-len $R --lengths fixed --reps 1 --warmup 0 --out-dir $OUT --name $NAME \
    --max-tokens-per-micro-batch 4352 train.logprob_chunk_tokens=1024 train.activation_checkpointing=true \
    model.cache_dir=/work/main/.cache/models > $OUT/$NAME.log 2>&1 &
  P=$!
  while kill -0 $P 2>/dev/null; do
    echo $(date -u +%T) $(grep -E 'VmHWM|VmRSS' /proc/$P/status 2>/dev/null | tr -s ' ' | tr '\n' ' ') >> $OUT/$NAME.rss
    sleep 10
  done
done
