#!/bin/bash
# The tiny reward-model run at 4 seeds (issue 74): the reward model trained once (seed 0), the policy's
# warm-up and RL at run.seed 0-3. Writes runs to $1 (default runs/reward-model-seeds).
set -euo pipefail
out=${1:-runs/reward-model-seeds}
python examples/reward_model/make_reward_model.py runs/reward_model/rm --steps 400 --seed 0
for seed in 0 1 2 3; do
  jetflow train --no-report --config examples/reward_model/config.yaml run.out_dir=$out run.name=seed$seed \
    run.seed=$seed run.progress=false run.num_threads=1
done
python scripts/analysis/reward_model_summarize.py $out > results/reward-model/seeds.md
