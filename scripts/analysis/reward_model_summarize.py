"""The tiny reward-model runs' held-out reward-model score before and after RL, per seed and mean ± SE.

    python scripts/analysis/reward_model_summarize.py RUNS_DIR > results/reward-model/seeds.md
"""

import json
import statistics
import sys
from pathlib import Path


def main(runs: Path) -> None:
    print("| seed | held-out RM score, step 0 | last step | change | steps | mismatch KL k3 (max) | equal share (min) "
          "| reward time share |")
    print("|---|---|---|---|---|---|---|---|")
    changes = []
    for run in sorted(runs.glob("seed*")):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if r["phase"] == "eval"]
        rl = [r for r in rows if r["phase"] == "rl"]
        before, after = evals[0]["eval/reward"], evals[-1]["eval/reward"]
        changes.append(after - before)
        share = sum(r["time/reward"] for r in rl) / sum(r["time/step"] for r in rl)
        print(f"| {run.name[4:]} | {before:.3f} | {after:.3f} | {after - before:+.3f} | {evals[-1]['step']} | "
              f"{max(r['mismatch/kl_k3'] for r in rl):.3g} | {min(r['mismatch/equal_frac'] for r in rl):.3f} | "
              f"{share:.1%} |")
    se = statistics.stdev(changes) / len(changes) ** 0.5 if len(changes) > 1 else float("nan")
    print(f"\nMean change over {len(changes)} seeds: {statistics.mean(changes):+.3f} ± {se:.3f} (SE); "
          f"{sum(c > 0 for c in changes)} of {len(changes)} rise.")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
