"""kl/ref per step of several runs (the first without the penalty), and whether each later run's stays
below the first's at every step where the runs can differ (from step 2: steps 0 and 1 are equal by
construction, see README.md).

    python scripts/analysis/kl_reference_kl_per_step.py RUN_WITHOUT RUN_WITH [RUN_WITH ...]
"""

import json
import sys


def rows(run_dir: str) -> list[dict]:
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r.get("phase", "rl") == "rl"]


def main(runs: list[str]) -> None:
    table = [rows(r) for r in runs]
    steps = min(len(t) for t in table)
    coefs = [run.rstrip("/").rsplit("kl", 1)[-1] for run in runs]  # the runs are named kl<coef>
    print("| step | " + " | ".join(f"kl/ref, kl_coef={c}" for c in coefs) + " | equal_frac | reward/mean |")
    print("|---" * (len(runs) + 3) + "|")
    for s in range(steps):
        kls = " | ".join(f"{t[s]['kl/ref']:.6g}" for t in table)
        eq = " / ".join(str(t[s]["mismatch/equal_frac"]) for t in table)
        rw = " / ".join(f"{t[s]['reward/mean']:.3f}" for t in table)
        print(f"| {table[0][s]['step']} | {kls} | {eq} | {rw} |")
    for c, t in zip(coefs[1:], table[1:]):
        above = [s for s in range(2, steps) if t[s]["kl/ref"] >= table[0][s]["kl/ref"]]
        mean = sum(r["kl/ref"] for r in t[1:steps]) / max(1, steps - 1)
        print(f"\nkl_coef={c}: below the run without it at every step 2..{steps - 1}: {not above}"
              f" (not at steps {above}); mean kl/ref over steps 1..{steps - 1}: {mean:.6g}")
    base = sum(r["kl/ref"] for r in table[0][1:steps]) / max(1, steps - 1)
    print(f"without: mean kl/ref over steps 1..{steps - 1}: {base:.6g}")


if __name__ == "__main__":
    main(sys.argv[1:])
