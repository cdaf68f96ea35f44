#!/usr/bin/env bash
# The tracker timings of results/trackers/README.md: a tiny jetflow train with run.loggers=[], [tensorboard], [wandb, mlflow].
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD
PY=${PYTHON:-.venv/bin/python}
A="--config configs/tiny.yaml train.sft_warmup_steps=2 train.prompts_per_step=2 rollout.group_size=2 train.steps=2 eval.num_prompts=0 run.progress=false run.num_threads=1 run.out_dir=/tmp/trackers-bench"
rm -rf /tmp/trackers-bench
uptime
for i in 1 2; do
/usr/bin/time -f "loggers=[] run $i: %e s" $PY -m jetflow.cli train $A run.name=none$i 'run.loggers=[]' > /dev/null 2>/tmp/trackers-bench.err; tail -1 /tmp/trackers-bench.err
/usr/bin/time -f "loggers=[tensorboard] run $i: %e s" $PY -m jetflow.cli train $A run.name=tb$i > /dev/null 2>/tmp/trackers-bench.err; tail -1 /tmp/trackers-bench.err
/usr/bin/time -f "loggers=[wandb,mlflow] run $i: %e s" $PY -m jetflow.cli train $A run.name=both$i 'run.loggers=[wandb,mlflow]' > /dev/null 2>/tmp/trackers-bench.err; tail -1 /tmp/trackers-bench.err
done
for m in wandb mlflow; do /usr/bin/time -f "import $m: %e s" $PY -c "import $m" ; done
uptime
