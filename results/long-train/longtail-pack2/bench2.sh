cd /work/wt-pack
while kill -0 5579 2>/dev/null; do sleep 2; done
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
COMMON="bench train-step --model smollm2 --modes unified --batch 8 --prompt-len 64 --lengths longtail \
  --reps 1 --warmup 0 --out-dir /tmp/pack2/bench train.logprob_chunk_tokens=1024 \
  train.activation_checkpointing=true train.micro_batch_size=8 model.cache_dir=/work/main/.cache/models"
date -u; (cd /work/main && PYTHONPATH=/work/main /work/main/.venv/bin/python -m jetflow.cli $COMMON --response-len 256 --max-tokens-per-micro-batch 1024 --name longtail-r256-packed-main)
date -u; PYTHONPATH=/work/wt-pack /work/main/.venv/bin/python -m jetflow.cli $COMMON --response-len 256 --max-tokens-per-micro-batch 1280 --name longtail-r256-packed-grid-2
date -u; PYTHONPATH=/work/wt-pack /work/main/.venv/bin/python -m jetflow.cli $COMMON --response-len 1024 --max-tokens-per-micro-batch 3072 --name longtail-r1024-packed-grid
date -u; (cd /work/main && PYTHONPATH=/work/main /work/main/.venv/bin/python -m jetflow.cli $COMMON --response-len 1024 --max-tokens-per-micro-batch 3072 --name longtail-r1024-packed-main)
date -u
