"""Per-seed table of the grid: held-out pass@1 at RL step 0 (the shared warm-up's end: one value per seed)
and each arm's mean over its last 5 evaluations (steps 220-300) and last evaluation.

    python scripts/analysis/learning_length_per_seed.py [results/learning-length] [len16] [configs/ablations/learning-length.yaml]
        [bf16_engine_eval.json]

With the fourth argument (scripts/reeval_heldout.py --all-arms --out FILE) each arm's cell is its last-5 mean and,
after a slash, its final weights' pass@1 decoded by that one engine (the two figures the READMEs quote per seed).
"""
import json
import sys
from pathlib import Path

from jetflow.ablate.grid import load_ablation
from jetflow.ablate.length_study import gather
from jetflow.ablate.archive import metrics_rows

out = Path(sys.argv[1] if len(sys.argv) > 1 else "results/learning-length")
setting = sys.argv[2] if len(sys.argv) > 2 else "len16"
ablation = Path(sys.argv[3] if len(sys.argv) > 3 else "configs/ablations/learning-length.yaml")
engine = json.load(open(sys.argv[4])) if len(sys.argv) > 4 else None
ab = load_ablation(ablation, out)
results = gather(ab)
arms = [arm for (s, arm) in results if s == setting]
seeds = sorted({seed for arm in arms for seed in results[(setting, arm)]})


def cell(arm: str, key: tuple[int, int]) -> str:
    """One arm's figures at one seed: its last-5 mean, then its final weights on the one engine (or its last)."""
    c = results[(setting, arm)].get(key)
    if c is None:
        return ""
    if engine:
        return f"{c.late:.3f} / {engine[f'seed{key[0]}-{setting}-{arm}']['in_mode']:.3f}"
    return f"{c.late:.3f} ({c.final:.2f})"


what = "last 5 / one engine" if engine else "last 5 (last)"
print("| seed | start (step 0) | " + " | ".join(f"{a}: {what}" for a in arms) + " |")
print("|---" * (len(arms) + 2) + "|")
for key in seeds:  # (run.seed, RL draw): the grid has no draw axis, so the draw is the seed
    seed = key[0]
    first = next(out / "runs" / f"seed{seed}-{setting}-{a}" for a in arms if key in results[(setting, a)])
    start = next(r["eval/pass@1"] for r in metrics_rows(first, "eval"))
    print(f"| {seed} | {start:.2f} | " + " | ".join(cell(a, key) for a in arms) + " |")
