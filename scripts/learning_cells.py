"""The bf16 and mixed (fp8_block, no correction) arms of configs/learning-sum3.yaml at the given seeds:
the final held-out pass@1 of each and their gap, the same runs as tests/integration/test_learning_effect.py.

    python scripts/learning_cells.py [--out /tmp/learning-cells] SEED [SEED ...]

results/learning/README.md ("How fragile the 300-step outcome is") has one use: the cells rerun after a
last-bit change in the bf16 GEMM. About 20 s a cell on the 2-core machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jetflow.config import load_config
from jetflow.run.files import SUMMARY_FILE
from jetflow.run.runner import train

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"bf16": ("precision.mode=bf16",),
        "mixed": ("precision.mode=mixed", "precision.family=fp8_block", "algo.correction=none")}


def final_heldout(out: Path, seed: int, overrides: tuple[str, ...]) -> float:
    name = f"s{seed}-" + "-".join(o.split("=")[1] for o in overrides)
    cfg = load_config(ROOT / "configs/learning-sum3.yaml", [f"run.out_dir={out}", f"run.name={name}", f"run.seed={seed}",
                                                             "run.progress=false", "run.tensorboard=false", *overrides])
    return json.loads((train(cfg) / SUMMARY_FILE).read_text())["heldout_pass1_end"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("seeds", type=int, nargs="+")
    ap.add_argument("--out", default="/tmp/learning-cells")
    args = ap.parse_args()
    for seed in args.seeds:
        ends = {arm: final_heldout(Path(args.out), seed, overrides) for arm, overrides in ARMS.items()}
        print(f"seed {seed}: bf16 {ends['bf16']} mixed {ends['mixed']} gap {ends['bf16'] - ends['mixed']:+.2f}",
              flush=True)


if __name__ == "__main__":
    main()
