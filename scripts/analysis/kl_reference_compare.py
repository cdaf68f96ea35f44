"""Print the per-step table of results/kl-reference/README.md from the two runs' metrics.jsonl.

    python scripts/analysis/kl_reference_compare.py RUN_WITHOUT RUN_WITH
"""

import json
import sys


def rows(run_dir: str) -> list[dict]:
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r.get("phase", "rl") == "rl"]


def main(without: str, with_kl: str) -> None:
    a, b = rows(without), rows(with_kl)
    print("| step | kl/ref, kl_coef=0 | kl/ref, kl_coef=0.05 | loss/kl (0.05) | equal_frac (0 / 0.05) | "
          "mismatch kl_k3 (0 / 0.05) | reward/mean (0 / 0.05) | time/ref_logprobs s (0.05) | time/step s (0.05) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x, y in zip(a, b):
        print(f"| {x['step']} | {x['kl/ref']:.6g} | {y['kl/ref']:.6g} | {y.get('loss/kl', 0):.6g} | "
              f"{x['mismatch/equal_frac']} / {y['mismatch/equal_frac']} | {x['mismatch/kl_k3']} / {y['mismatch/kl_k3']} | "
              f"{x['reward/mean']:.3f} / {y['reward/mean']:.3f} | {y['time/ref_logprobs']:.1f} | {y['time/step']:.1f} |")
    print(f"\nref/bytes: {b[0]['ref/bytes']:.0f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
