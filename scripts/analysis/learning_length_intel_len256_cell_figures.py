"""The figures of this folder's README that the grid's scripts do not print: each len256 warm-up's loss (mean of its
last 50 steps) against the start it gives (its final held-out pass@1: the figure every arm's RL step 0 repeats), both
machine kinds, so a seed shows here once its warm-up is done, before its arms run; and per
Intel cell its held-out curve, mismatch KL per token and policy entropy (first 20 RL steps -> steps 200-299), and for
unified the largest |KL| and the smallest equal share over all RL steps.

    python scripts/analysis/learning_length_intel_len256_cell_figures.py
"""
import statistics
from pathlib import Path

from jetflow.ablate.archive import listdir, metrics_rows

HERE = Path(__file__).resolve().parents[2] / "results" / "learning-length" / "intel-len256"
KINDS = {"AMD Zen 5": HERE.parent, "Intel Xeon": HERE}


def evals(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["eval/pass@1"]) for r in rows if r.get("phase") == "eval"]


def warmup_loss_and_start(root: Path, seed: int) -> tuple[float, float] | None:
    """A warm-up's loss (mean of its last 50 steps) and its last held-out pass@1 (the start once the warm-up has
    finished: a stopped one prints its latest evaluation); None before its first evaluation."""
    rows = metrics_rows(root / "warmups" / f"seed{seed}-len256-bf16")
    losses = [r["loss/sft"] for r in rows if "loss/sft" in r]
    curve = evals(rows)
    return (statistics.fmean(losses[-50:]), curve[-1][1]) if curve else None


def first_and_late(rows: list[dict], key: str) -> str:
    vals = [r[key] for r in rows if key in r]  # one per RL step
    return f"{statistics.fmean(vals[:20]):.2e} -> {statistics.fmean(vals[200:300]):.2e}"


print("| kind | seed | warm-up loss (last 50 steps) | start (step 0, bf16 engine) |")
print("|---|---|---|---|")
for kind, root in KINDS.items():
    for seed in range(10):
        if (warmup := warmup_loss_and_start(root, seed)) is not None:
            print(f"| {kind} | {seed} | {warmup[0]:.3f} | {warmup[1]:.2f} |")

for name in listdir(HERE / "runs"):
    rows = metrics_rows(HERE / "runs" / name)
    print(f"\n{name}: held-out {evals(rows)}")
    print(f"  mismatch KL per token {first_and_late(rows, 'mismatch/kl_k3')}, "
          f"entropy {first_and_late(rows, 'policy/entropy')}")
    if name.endswith("unified"):
        kl = [abs(r["mismatch/kl_k3"]) for r in rows if "mismatch/kl_k3" in r]
        eq = [r["mismatch/equal_frac"] for r in rows if "mismatch/equal_frac" in r]
        print(f"  {len(kl)} RL steps: max |KL| {max(kl)}, min equal share {min(eq)}")
