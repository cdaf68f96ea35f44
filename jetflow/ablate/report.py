"""The report of an ablation (`jetflow ablate`), rebuilt from the run directories on disk.

<out_dir>/summary.md     one row per cell, the exact command and the machine, the plots
<out_dir>/summary.json   the same numbers, plus each cell's overrides and the environment
<out_dir>/metrics.jsonl  every cell's metric rows (SFT and RL phases), each with a `cell` field
<out_dir>/reward.png, entropy.png, mismatch_kl.png, mismatch_position.png
<out_dir>/.gitignore     keeps the runs' checkpoints out of git (the rest of runs/ is small)

Per cell: final reward = mean `reward/mean` over the last 3 RL steps, best = its maximum; mismatch KL
= `mismatch/kl_k3` (KL(rollout || trainer) on the sampled tokens) mean and max over steps; equal =
mean `mismatch/equal_frac` (share of tokens whose two log-probs are bitwise equal); entropy = the
policy's entropy on the trainer side (`policy/entropy`), mean of the first and of the last 3 steps,
beside the rollout's own log-perplexity (`policy/rollout_log_ppl`) of the last 3; times =
mean seconds per step of each phase; tokens/s = mean of `throughput/tokens_per_s` (prompt + response
tokens through the whole step) and `throughput/rollout_tokens_per_s` (generated tokens / rollout time).

The position plot reads each run's `mismatch_positions.jsonl` (one row per RL step: mean k3 per
response index and the token count there, written by jetflow.run.files) and pools all steps,
weighting each index by its token count. Cells without that file are left out of that plot.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jetflow.bench.common import environment, markdown_table
from jetflow.metrics_log import METRICS_FILE, read_jsonl
from jetflow.run.files import ERROR_FILE, POSITIONS_FILE, run_status

if TYPE_CHECKING:
    from jetflow.ablate.grid import Ablation

TIME_KEYS = ("time/rollout", "time/old_logprobs", "time/train", "time/sync")
COLUMNS = {  # summary.json key -> summary.md column
    "cell": "cell", "status": "status", "steps": "steps", "reward_final": "final reward",
    "reward_best": "best reward", "kl_k3_mean": "KL k3 mean", "kl_k3_max": "KL k3 max",
    "equal_frac_mean": "equal", "entropy_first": "entropy first", "entropy_final": "entropy last",
    "rollout_log_ppl_final": "rollout log-ppl last", "response_length_mean": "resp len", "time_rollout": "rollout s", "time_old_logprobs": "old logp s",
    "time_train": "train s", "time_sync": "sync s", "tokens_per_s": "tok/s", "rollout_tokens_per_s": "rollout tok/s",
}


def _mean(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def cell_summary(cell_id: str, status: str, run_dir: Path, overrides: list[str]) -> dict:
    rl = [r for r in read_jsonl(run_dir / METRICS_FILE) if r.get("phase") == "rl"]

    def col(key: str) -> list[Any]:
        return [r.get(key) for r in rl]

    rewards = [v for v in col("reward/mean") if v is not None]
    kl = [v for v in col("mismatch/kl_k3") if v is not None]
    row = {
        "cell": cell_id, "status": status, "steps": len(rl),
        "reward_final": _mean(rewards[-3:]), "reward_first": _mean(rewards[:3]),
        "reward_best": max(rewards) if rewards else None,
        "accuracy_final": _mean(col("reward/accuracy")[-3:]),
        "kl_k3_mean": _mean(kl), "kl_k3_max": max(kl) if kl else None,
        "equal_frac_mean": _mean(col("mismatch/equal_frac")),
        "entropy_first": _mean(col("policy/entropy")[:3]), "entropy_final": _mean(col("policy/entropy")[-3:]),
        "rollout_log_ppl_final": _mean(col("policy/rollout_log_ppl")[-3:]),
        "response_length_mean": _mean(col("response/length_mean")),
        "response_length_max": max((v for v in col("response/length_max") if v is not None), default=None),
        "truncated_frac": _mean(col("response/truncated_frac")),
        **{"time_" + k.split("/", 1)[1]: _mean(col(k)) for k in TIME_KEYS},
        "time_step": _mean(col("time/step")),
        "tokens_per_s": _mean(col("throughput/tokens_per_s")),
        "rollout_tokens_per_s": _mean(col("throughput/rollout_tokens_per_s")),
        "overrides": overrides,
        "run_dir": str(run_dir),
    }
    error = run_dir / ERROR_FILE
    if status == "failed" and error.exists():
        lines = [line for line in error.read_text().splitlines() if line.strip()]
        row["error"] = lines[-1] if lines else "unknown error"
    return row


def position_curve(run_dir: Path) -> tuple[list[int], list[float]] | None:
    """Mean k3 per response index pooled over all RL steps (count-weighted), or None if not logged."""
    by_step = {r["step"]: r for r in read_jsonl(run_dir / POSITIONS_FILE)}  # a resumed step: the last row
    if not by_step:
        return None
    total: list[float] = []
    count: list[float] = []
    for r in by_step.values():
        for t, (k3, n) in enumerate(zip(r["kl_k3"], r["count"])):
            if t >= len(total):
                total.append(0.0)
                count.append(0.0)
            total[t] += k3 * n
            count[t] += n
    xs = [t for t in range(len(total)) if count[t] > 0]
    return xs, [total[t] / count[t] for t in xs]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _plot(path: Path, title: str, ylabel: str, xlabel: str, series: list[tuple[str, list, list]],
          log_y: bool = False) -> None:
    """One line per series; on a log axis, points <= 0 are dropped (an exact 0 has no place there)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state (Agg canvas)
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(9, 5), dpi=110)
    ax = fig.subplots()
    colors = _colors(len(series))
    for (label, xs, ys), color in zip(series, colors):
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None and (y > 0 or not log_y)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, color=color, lw=1.2,
                    marker="." if len(pts) < 30 else None)
    if log_y and ax.has_data():
        ax.set_yscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize=6 if len(series) > 12 else 8, loc="center left", bbox_to_anchor=(1.01, 0.5),
                  ncol=1 + len(series) // 24)
    else:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)


def _colors(n: int) -> list:
    from matplotlib import colormaps
    cmap = colormaps["tab10" if n <= 10 else "tab20" if n <= 20 else "turbo"]
    return [cmap(i if n <= 20 else i / max(n - 1, 1)) for i in range(n)]


def _fmt_env(env: dict) -> str:
    return (f"{env['device']} ({env['cpu']}, {env['cpu_count']} CPU cores, {env['torch_threads']} torch threads), "
            f"python {env['python']}, torch {env['torch']}, CUDA {env['cuda']}")


def write_report(ab: "Ablation", command: str) -> Path:
    """Rebuild every report file of `ab` from its run directories; returns summary.md's path."""
    out = ab.out_dir
    out.mkdir(parents=True, exist_ok=True)
    # results/ is committed; the runs' checkpoints (megabytes each, kept for resuming and for looking
    # at the final policies) are not
    if not (out / ".gitignore").exists():
        (out / ".gitignore").write_text("runs/*/checkpoints/\n")
    env = environment()
    rows, all_metrics, rewards, entropies, kls, positions = [], [], [], [], [], []
    for cell in ab.cells:
        run_dir = ab.run_dir(cell)
        rows.append(cell_summary(cell.id, run_status(run_dir), run_dir, cell.overrides))
        metrics = read_jsonl(run_dir / METRICS_FILE)
        all_metrics += [{"cell": cell.id, **r} for r in metrics]
        rl = [r for r in metrics if r.get("phase") == "rl"]
        rewards.append((cell.id, [r["step"] for r in rl], [r.get("reward/mean") for r in rl]))
        entropies.append((cell.id, [r["step"] for r in rl], [r.get("policy/entropy") for r in rl]))
        kls.append((cell.id, [r["step"] for r in rl], [r.get("mismatch/kl_k3") for r in rl]))
        curve = position_curve(run_dir)
        if curve is not None:
            positions.append((cell.id, *curve))

    plots = {"reward": "reward.png", "entropy": "entropy.png", "mismatch_kl": "mismatch_kl.png", "mismatch_position": "mismatch_position.png"}
    _plot(out / plots["reward"], f"{ab.name}: reward", "reward/mean", "RL step", rewards)
    _plot(out / plots["entropy"], f"{ab.name}: policy entropy (trainer side)", "policy/entropy (nats/token)",
          "RL step", entropies)
    _plot(out / plots["mismatch_kl"], f"{ab.name}: rollout vs trainer mismatch", "mismatch KL k3 (log)", "RL step",
          kls, log_y=True)
    _plot(out / plots["mismatch_position"], f"{ab.name}: mismatch by response position (all steps pooled)",
          "mean KL k3 per token (log)", "response token index", positions, log_y=True)

    _atomic_write(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in all_metrics))
    generated = time.strftime("%Y-%m-%dT%H:%M:%S")
    summary = {
        "name": ab.name, "ablation_file": str(ab.source), "command": command, "environment": env,
        "base_config": str(ab.base_config) if ab.base_config else None, "overrides": ab.overrides,
        "grid": ab.grid, "out_dir": str(out), "generated": generated, "cells": rows, "plots": plots,
    }
    _atomic_write(out / "summary.json", json.dumps(summary, indent=2) + "\n")

    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    table_rows = [{COLUMNS[k]: ("" if r.get(k) is None else r[k]) for k in COLUMNS} for r in rows]
    failed = [f"- `{r['cell']}`: {r['error']}" for r in rows if r.get("error")]
    no_pos = [r["cell"] for r in rows if r["steps"] and r["cell"] not in {p[0] for p in positions}]
    md = [
        f"# Ablation: {ab.name}", "",
        f"Command: `{command}`  ",
        f"Ablation file: `{ab.source}`; base config: `{ab.base_config or '(defaults)'}`  ",
        f"Common overrides: `{' '.join(ab.overrides) or '(none)'}`  ",
        f"Machine: {_fmt_env(env)}  ",
        f"Generated: {generated}; cells: {len(rows)} ({', '.join(f'{n} {s}' for s, n in sorted(counts.items()))})",
        "",
        markdown_table(table_rows, list(COLUMNS.values())), "",
        "Final reward: mean `reward/mean` over the last 3 RL steps; best: its maximum. KL k3: "
        "`mismatch/kl_k3`, KL(rollout || trainer) on the sampled tokens, mean and max over steps; equal: "
        "mean share of tokens whose rollout and trainer log-probs are bitwise equal. entropy: the policy's "
        "entropy per token on the trainer side (`policy/entropy`), first and last 3 steps; rollout log-ppl: "
        "the rollout's own mean -log p of its tokens, last 3 steps. "
        "resp len: mean generated tokens. Times: mean seconds per step (rollout, trainer old log-probs, "
        "train, weight sync). tok/s: prompt + response tokens per step second; rollout tok/s: generated "
        "tokens per rollout second. Per-step rows of every cell: `metrics.jsonl`.", "",
    ]
    if failed:
        md += ["Failed cells (details in `runs/<cell>/error.txt`):", *failed, ""]
    md += ["![reward](reward.png)", "", "![entropy](entropy.png)", "", "![mismatch KL](mismatch_kl.png)", "",
           "Log axes leave out exact zeros (a step with no mismatch at all).", "",
           "![mismatch by position](mismatch_position.png)", ""]
    if no_pos:
        md += [f"No per-position data (`{POSITIONS_FILE}`) for: {', '.join(no_pos)}.", ""]
    md += ["## Cells", "", markdown_table([{"cell": r["cell"], "overrides": "`" + " ".join(r["overrides"]) + "`"}
                                           for r in rows], ["cell", "overrides"]), ""]
    _atomic_write(out / "summary.md", "\n".join(md))
    return out / "summary.md"
