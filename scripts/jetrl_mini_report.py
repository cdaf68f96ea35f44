"""Tables and the plot of the Jet-RL mini study on SmolLM2 (results/jetrl-mini/), from the JSON that
`jetflow bench mismatch --ignore-eos` wrote for each response length:

    for n in 64 256 512; do
      jetflow bench mismatch --prompts 2 --group-size 2 --ignore-eos --out-dir results/jetrl-mini \\
          --name smollm2-len$n rollout.max_new_tokens=$n run.num_threads=1
    done
    python scripts/jetrl_mini_report.py results/jetrl-mini
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

BINS = [(0, 64), (64, 128), (128, 256), (256, 512)]


def load(out: Path) -> dict[int, dict]:
    runs = {}
    for path in sorted(out.glob("smollm2-len*.json")):
        runs[int(path.stem.split("len")[1])] = json.loads(path.read_text())
    if not runs:
        raise SystemExit(f"no smollm2-len*.json in {out}: run the bench commands in this file's docstring first")
    return runs


def binned(curve: list[float], lo: int, hi: int) -> float:
    """Mean of a per-position curve over [lo, hi) (every response runs to its full length here)."""
    part = np.asarray(curve[lo:hi], dtype=np.float64)
    return float(part.mean()) if part.size else float("nan")


def main(out: Path) -> None:
    runs = load(out)
    lines = ["# Jet-RL mini study: SmolLM2-135M-Instruct, mismatch vs response length", "",
             "Made by `python scripts/jetrl_mini_report.py results/jetrl-mini` from the runs its docstring lists "
             "(`jetflow bench mismatch --ignore-eos`, 2 prompts x 2 samples, temperature 1, the same seeds in every "
             "mode; responses run to the full length). Machine: " + next(iter(runs.values()))["environment"].get(
                 "machine", "cpu") + ".", "",
             "Mean per-token KL (k3) between the rollout engine's and the trainer's log-probs of the same tokens:", "",
             "| response length | bf16 | mixed | unified | mixed / unified |", "|---|---|---|---|---|"]
    for n, run in sorted(runs.items()):
        kl = {r["mode"]: r["kl_k3"] for r in run["rows"]}
        lines.append(f"| {n} | {kl['bf16']:.3g} | {kl['mixed']:.3g} | {kl['unified']:.3g} | "
                     f"{kl['mixed'] / kl['unified']:.2f} |")
    longest = max(runs)
    rows = {r["mode"]: r for r in runs[longest]["rows"]}
    lines += ["", f"By position in the response (the {longest}-token run), mean KL (k3) over each range:", "",
              "| positions | bf16 | mixed | unified |", "|---|---|---|---|"]
    for lo, hi in BINS:
        if lo >= longest:
            break
        vals = [binned(rows[m]["curve_kl_k3"], lo, hi) for m in ("bf16", "mixed", "unified")]
        lines.append(f"| {lo}-{hi} | " + " | ".join(f"{v:.3g}" for v in vals) + " |")

    from matplotlib.figure import Figure
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    window = 16
    for mode in ("bf16", "mixed", "unified"):
        curve = np.asarray(rows[mode]["curve_kl_k3"], dtype=np.float64)
        smooth = np.convolve(curve, np.ones(window) / window, mode="valid")
        ax.plot(np.arange(len(smooth)) + window // 2, smooth, label=mode)
    ax.set_yscale("log")
    ax.set_xlabel("position in the response (tokens)")
    ax.set_ylabel(f"KL k3 (moving mean over {window})")
    ax.set_title(f"SmolLM2-135M rollout vs trainer mismatch, {longest}-token responses")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "mismatch_vs_position.png", dpi=110)
    lines += ["", "![mismatch vs position](mismatch_vs_position.png)", ""]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "results/jetrl-mini"))
