#!/usr/bin/env bash
# Peak RSS of each configuration in its own process (`jetflow bench train-step`, one mode; `jetflow train`
# and short `jetflow train` runs, each under /usr/bin/time -v), one at a time under the shared bench lock.
# Writes runs/<name>.time (and the bench's runs/<name>.{json,md}).
# Usage: bash results/memory-estimate/measure.sh [NAME ...]   (default: every configuration below)
#        LOCKED=1 flock /tmp/jetflow-bench.lock bash results/memory-estimate/measure.sh NAME ...   (one lock for all)
set -u
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
PY=${PY:-/work/main/.venv/bin/python}
OUT=results/memory-estimate/runs
mkdir -p "$OUT"
WIDE="model.tiny.hidden_size=512 model.tiny.intermediate_size=1536 model.tiny.num_layers=4 model.tiny.num_heads=8 model.tiny.num_kv_heads=2 model.tiny.max_position=4096 run.num_threads=2"
BEFORE="train.logprob_chunk_tokens=0 train.activation_checkpointing=false"
AFTER="train.logprob_chunk_tokens=512 train.activation_checkpointing=true"
declare -A CMD=(
  [tiny-fp32-short]="bench train-step --model tiny --modes fp32 --batch 16 --prompt-len 64 --response-len 192 --warmup 1 --reps 1 $WIDE $BEFORE"
  [tiny-unified-short]="bench train-step --model tiny --modes unified --batch 16 --prompt-len 64 --response-len 192 --warmup 1 --reps 1 $WIDE $BEFORE"
  [tiny-fp32-long]="bench train-step --model tiny --modes fp32 --batch 4 --prompt-len 64 --response-len 1984 --warmup 1 --reps 1 $WIDE $BEFORE"
  [tiny-unified-long-savers]="bench train-step --model tiny --modes unified --batch 4 --prompt-len 64 --response-len 1984 --warmup 1 --reps 1 $WIDE $AFTER"
  [smollm2-unified-short]="bench train-step --model smollm2 --modes unified --batch 2 --prompt-len 64 --response-len 256 --warmup 1 --reps 1 run.num_threads=2 $BEFORE"
  [smollm2-fp32-short]="bench train-step --model smollm2 --modes fp32 --batch 2 --prompt-len 64 --response-len 256 --warmup 1 --reps 1 run.num_threads=2 $BEFORE"
  [smollm2-fp32-long]="bench train-step --model smollm2 --modes fp32 --batch 1 --prompt-len 64 --response-len 1024 --warmup 1 --reps 1 run.num_threads=2 $BEFORE"
  [smollm2-unified-long-savers]="bench train-step --model smollm2 --modes unified --batch 1 --prompt-len 64 --response-len 1024 --warmup 1 --reps 1 run.num_threads=2 $AFTER"
  [floor-tiny]="bench train-step --model tiny --modes fp32 --batch 2 --prompt-len 16 --response-len 16 --warmup 1 --reps 1 run.num_threads=2"
  [run-smollm2-unified]="train train.steps=1 eval.num_prompts=0 run.num_threads=2 run.out_dir=/tmp/jetflow-memory-estimate run.name=unified"
  [run-smollm2-fp32]="train precision.mode=fp32 train.steps=1 eval.num_prompts=0 run.num_threads=2 run.out_dir=/tmp/jetflow-memory-estimate run.name=fp32"
)
ORDER=(tiny-fp32-short tiny-unified-short tiny-fp32-long tiny-unified-long-savers smollm2-unified-short smollm2-fp32-short smollm2-fp32-long smollm2-unified-long-savers)
for name in "${@:-${ORDER[@]}}"; do
  echo "== $name: jetflow ${CMD[$name]}"
  args=(${CMD[$name]})
  [[ ${args[0]} == bench ]] && args+=(--out-dir "$OUT" --name "$name")
  [[ ${args[0]} == train ]] && rm -rf "/tmp/jetflow-memory-estimate/${name#run-smollm2-}"
  LOCK=(flock /tmp/jetflow-bench.lock); [[ -n ${LOCKED:-} ]] && LOCK=()  # LOCKED=1: the caller holds the lock
  "${LOCK[@]}" /usr/bin/time -v -o "$OUT/$name.time" $PY -m jetflow.cli "${args[@]}" 2>&1 | tail -3
  grep -E "Maximum resident|Elapsed" "$OUT/$name.time"
done
