#!/bin/bash
# The 1B-shaped rows of results/fsdp/README.md: TinyLlama-1.1B's decoder (hidden 2048, 22 layers, 32 heads,
# 4 KV heads, intermediate 5632) with the tiny model's character vocabulary (19 ids): 0.97B parameters,
# random init from run.seed. Run from a checkout of jetflow (PYTHONPATH set to it).
# MALLOC_MMAP_THRESHOLD_: see the README (glibc keeps freed 8-32 MB tensors in its heap otherwise).
set -u
W="model.tiny.hidden_size=2048 model.tiny.num_layers=22 model.tiny.num_heads=32 model.tiny.num_kv_heads=4 model.tiny.intermediate_size=5632"
C="--config configs/tiny.yaml train.backend=fsdp run.num_threads=1 train.sft_warmup_steps=2 train.sft_batch_size=4 $W"
export OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536
for job in "2 unified" "4 unified" "2 bf16"; do
  set -- $job
  echo "== $1 ranks, $2 $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  /usr/bin/time -f "wall %e s, max RSS of one rank %M KB" python -m torch.distributed.run --nproc_per_node $1 \
      -m jetflow.bench.fsdp_memory $C precision.mode=$2 2>&1 | grep -E '^\{|wall|Error|error'
done
