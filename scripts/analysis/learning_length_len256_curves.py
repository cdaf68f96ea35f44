"""len256's cells over RL steps, one row of panels per seed: held-out greedy pass@1 (the run's own engine),
training accuracy of the sampled chains, policy entropy and mismatch KL per token (20-step means), per arm.

    python scripts/analysis/learning_length_len256_curves.py [RUNS_DIR] [len256] [OUT.png]
        # default: results/learning-length/runs -> results/learning-length/len256_curves.png
        # results/learning-length/replicate-len256 replicate-len256/curves.png: seed 1's RL replicates
"""
import sys
from fnmatch import fnmatch
from pathlib import Path

from jetflow import plots
from jetflow.ablate.archive import exists, listdir, metrics_rows

ARMS = {"bf16": ("bf16", "-"), "mixed-none": ("mixed", "-"), "mixed-token_tis": ("mixed", "--"),
        "mixed-ais": ("mixed", ":"), "unified": ("unified", "-")}
PANELS = [("eval/pass@1", "held-out pass@1 (own engine)"), ("reward/accuracy", "training accuracy (sampled)"),
          ("policy/entropy", "policy entropy (nats/token)"), ("mismatch/kl_k3", "mismatch KL per token (bf16, unified: 0)")]

runs = Path(sys.argv[1] if len(sys.argv) > 1 else "results/learning-length/runs")
setting = sys.argv[2] if len(sys.argv) > 2 else "len256"
png = Path(sys.argv[3]) if len(sys.argv) > 3 else runs.parent / f"{setting}_curves.png"
seeds = sorted({d.split("-")[0] for d in listdir(runs) if fnmatch(d, f"seed*-{setting}-*")})  # seed1, seed1r11, ...
fig, axes = plots.figure(len(PANELS) * len(seeds), width=3.6, height=2.8, max_cols=len(PANELS))
for row, seed in enumerate(seeds):
    for arm, (mode, style) in ARMS.items():
        run = runs / f"{seed}-{setting}-{arm}"
        if not exists(run / "metrics.jsonl"):
            continue
        rows = metrics_rows(run)
        evals = [r for r in rows if r.get("phase") == "eval"]
        rl = [r for r in rows if r.get("phase") == "rl"]
        for col, (key, title) in enumerate(PANELS):
            ax = axes[row * len(PANELS) + col]
            if key == "eval/pass@1":
                xs, ys = [r["step"] for r in evals], [r[key] for r in evals]
            else:  # 20-step means
                chunks = [rl[i:i + 20] for i in range(0, len(rl), 20)]
                xs = [c[0]["step"] + 10 for c in chunks]
                ys = [sum(r.get(key, 0.0) for r in c) / len(c) for c in chunks]
            plots.line(ax, xs, ys, color=plots.color_for(mode), label=arm, linestyle=style, smoothed=False,
                       log_y=key == "mismatch/kl_k3", markers=True)
            if key == "mismatch/kl_k3":
                ax.set_yscale("log")
            plots.style_axis(ax, f"{seed}: {title}", "RL step", "")
plots.legend(fig, axes)
plots.save(fig, png)
print(png)
