cd /work/wt-pack
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=/work/wt-pack
date -u; git -C /work/wt-pack log --oneline -1
timeout 560 /work/main/.venv/bin/python -m jetflow.cli bench train-step --model smollm2 --modes unified --batch 8 --prompt-len 64 --lengths longtail \
  --reps 1 --warmup 0 --out-dir /tmp/pack2/bench train.logprob_chunk_tokens=1024 \
  train.activation_checkpointing=true train.micro_batch_size=8 model.cache_dir=/work/main/.cache/models --response-len 1024 --max-tokens-per-micro-batch 3072 --name longtail-r1024-packed-grid-quiet
date -u
