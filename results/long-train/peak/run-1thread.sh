export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD OMP_NUM_THREADS=1
OUT=results/long-train/peak
R=4096; B=8; NAME=peak-b$B-r$R-after
date -u +"start %T load $(cut -d' ' -f1 /proc/loadavg)" > $OUT/$NAME.rss
python -m jetflow.cli bench train-step --model smollm2 --modes unified --batch $B --prompt-len 64 \
  --response-len $R --lengths fixed --reps 1 --warmup 0 --out-dir $OUT --name $NAME \
  --max-tokens-per-micro-batch 4352 train.logprob_chunk_tokens=1024 train.activation_checkpointing=true \
  run.num_threads=1 model.cache_dir=/work/main/.cache/models > $OUT/$NAME.log 2>&1 &
P=$!
while kill -0 $P 2>/dev/null; do
  echo $(date -u +%T) $(grep -E 'VmHWM|VmRSS' /proc/$P/status 2>/dev/null | tr -s ' ' | tr '\n' ' ') >> $OUT/$NAME.rss
  sleep 10
done
date -u +"end %T load $(cut -d' ' -f1 /proc/loadavg)" >> $OUT/$NAME.rss
