"""The multi-turn examples' learning: held-out pass@1 before RL and after, per seed, with a plot (issue 69).

    python scripts/multiturn_report.py RUNS_DIR OUT_DIR
RUNS_DIR holds run directories (jetflow train ... run.out_dir=RUNS_DIR); each run's metrics.jsonl gives its
held-out evaluations (eval/pass@1) and its RL steps (mismatch KL, equal share, multiturn/*). Writes
OUT_DIR/learning.json and OUT_DIR/learning.png, and prints a Markdown table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    rl = [r for r in rows if r.get("phase") == "rl"]
    return {"run": run.name, "evals": evals, "before": evals[0][1] if evals else None,
            "after": evals[-1][1] if evals else None, "rl_steps": len(rl),
            "kl_k3_max": max((r["mismatch/kl_k3"] for r in rl), default=None),
            "equal_frac_min": min((r["mismatch/equal_frac"] for r in rl), default=None),
            "turns_mean": sum(r["multiturn/turns_mean"] for r in rl) / max(len(rl), 1),
            "tool_calls_mean": sum(r["multiturn/tool_calls_mean"] for r in rl) / max(len(rl), 1),
            "retokenize_mismatch_frac": sum(r["multiturn/retokenize_mismatch_frac"] for r in rl) / max(len(rl), 1),
            "complete": (run / "COMPLETE").exists()}


def main() -> None:
    runs_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    runs = [r for r in (read(d) for d in sorted(runs_dir.iterdir()) if (d / "metrics.jsonl").is_file()) if r["rl_steps"]]
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning.json").write_text(json.dumps(runs, indent=1) + "\n")
    print("| run | held-out pass@1 before | after | RL steps | max mismatch KL | min equal share | turns | tool calls "
          "| re-tokenization differs |\n|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['run']} | {r['before']} | {r['after']} | {r['rl_steps']} | {r['kl_k3_max']} | {r['equal_frac_min']} "
              f"| {r['turns_mean']:.2f} | {r['tool_calls_mean']:.2f} | {r['retokenize_mismatch_frac']:.3f} |")
    groups: dict[str, list[dict]] = {}
    for r in runs:  # one example's seeds: runs named <example>-seed<N>
        groups.setdefault(r["run"].rsplit("-seed", 1)[0], []).append(r)
    print()
    for name, rs in groups.items():
        pairs = [(r["before"], r["after"]) for r in rs if r["before"] is not None]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        print(f"{name}: {len(pairs)} seeds, held-out pass@1 before {mean([b for b, _ in pairs]):.3f}, after "
              f"{mean([a for _, a in pairs]):.3f}; {sum(a > b for b, a in pairs)} of {len(pairs)} seeds rose")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.5), squeeze=False)
    for ax, (name, rs) in zip(axes[0], groups.items()):
        for r in rs:
            ax.plot([s for s, _ in r["evals"]], [p for _, p in r["evals"]], marker="o", label=r["run"])
        ax.set_title(name)
        ax.set_xlabel("RL step")
        ax.set_ylabel("held-out pass@1 (greedy)")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "learning.png", dpi=120)


if __name__ == "__main__":
    main()
