#!/bin/bash
# One SmolLM2-135M-Instruct GRPO step (unified) scored by a SmolLM2-sized reward model (issue 74).
set -euo pipefail
python scripts/analysis/reward_model_smollm2_rm.py runs/reward_model/smollm2-rm
/usr/bin/time -v jetflow train --config examples/own_task/config.yaml model.path=smollm2 train.sft_warmup_steps=0 \
  task.params.reward=[model:runs/reward_model/smollm2-rm] task.params.reward_weights=[1.0] \
  train.steps=2 train.prompts_per_step=4 rollout.group_size=4 rollout.max_new_tokens=32 eval.num_prompts=0 \
  run.out_dir=${1:-runs/reward-model-smollm2} run.name=step run.progress=false run.num_threads=2
