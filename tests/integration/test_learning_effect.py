"""Issue 29's finding at the scale of a test: on configs/learning-sum3.yaml (tiny from scratch,
3-operand sums, temperature 0.5, 300 GRPO steps) the common recipe, a bf16 trainer with an FP8
rollout and no correction (`mixed`), ends with a lower held-out pass@1 than the same bf16 trainer with
a bf16 rollout: the same weights, warm-up and sampling random numbers at a seed, so the difference is
the rollout's precision alone. results/learning/README.md has the whole grid (every arm, 4 seeds:
mixed FP8 ended below bf16 on each, by 0.19 to 0.64); these are two of its cells, so each number here
is one the grid logged.
"""

import json
from pathlib import Path

import pytest

from jetflow.config import load_config
from jetflow.run.files import SUMMARY_FILE
from jetflow.run.runner import train

ROOT = Path(__file__).resolve().parents[2]
SEEDS = (1,)  # the grid logged bf16 0.76, mixed 0.47 at this seed


def final_heldout(tmp_path: Path, seed: int, *overrides: str) -> float:
    cfg = load_config(ROOT / "configs/learning-sum3.yaml",
                      [f"run.out_dir={tmp_path}", f"run.name=s{seed}-" + "-".join(o.split("=")[1] for o in overrides),
                       f"run.seed={seed}", "run.progress=false", "run.tensorboard=false", *overrides])
    return json.loads((train(cfg) / SUMMARY_FILE).read_text())["heldout_pass1_end"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_an_fp8_rollout_behind_a_bf16_trainer_ends_below_bf16(tmp_path, seed):
    mixed = final_heldout(tmp_path, seed, "precision.mode=mixed", "precision.family=fp8_block",
                          "algo.correction=none")
    bf16 = final_heldout(tmp_path, seed, "precision.mode=bf16")
    assert bf16 > mixed + 0.1, (bf16, mixed)
