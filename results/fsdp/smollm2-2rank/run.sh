C="--config configs/default.yaml train.steps=3 train.prompts_per_step=4 rollout.group_size=4 run.progress=false run.tensorboard=false run.num_threads=1 eval.num_prompts=0 --no-report run.out_dir=/tmp/smol2"
export OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536
for job in "fsdp fp32" "native fp32" "fsdp bf16" "fsdp unified"; do
  set -- $job
  echo "== $1 $2 $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  /usr/bin/time -f "wall %e s, max RSS of one rank %M KB" python -m jetflow.launch.torchrun --nproc-per-node 2 -m jetflow.cli train $C train.backend=$1 precision.mode=$2 run.name=$1-$2 > /tmp/smol2-$1-$2.log 2>&1
  echo "rc=$?"; tail -2 /tmp/smol2-$1-$2.log
done
