"""A run's report: `<run>/report/report.md` (a summary table) and its plots, rebuilt from the files of
the run directory alone, so it can be written at the end of a run and again at any time
(`jetflow report RUN`), also for an unfinished or stopped run.

    report/report.md              header (mode, model, task, status), the summary table, time split
    (the directory is written under a temporary name and renamed into place: whole or not at all)
    report/reward.png             training reward per RL step (raw and smoothed) and accuracy
    report/heldout.png            held-out greedy pass@1 and mean reward (eval rows)
    report/mismatch_kl.png        KL(rollout || trainer) per step, log axis (exact zeros said in words)
    report/mismatch_position.png  that KL by response token index, all steps pooled
    report/time_split.png         seconds per step: rollout, old log-probs, train, weight sync, other
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from jetflow import plots
from jetflow.errors import UserError
from jetflow.metrics_log import read_jsonl, read_metrics
from jetflow.run.files import CONFIG_FILE, POSITIONS_FILE, run_status
from jetflow.trackers import publish_report
from jetflow.writes import write_error

REPORT_DIR = "report"
REPORT_FILE = "report.md"
TIME_PARTS = {"time/rollout": "rollout", "time/reward": "reward", "time/old_logprobs": "old log-probs",
              "time/train": "train", "time/sync": "weight sync"}
PLOTS = ("reward", "heldout", "mismatch_kl", "mismatch_position", "time_split")


class ReportError(UserError, ValueError):
    pass


def mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


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


def column(rows: list[dict], key: str) -> list[Any]:
    return [r.get(key) for r in rows]


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3g}" if v != 0 else "0"
    return str(v)


def summary_rows(rl: list[dict], evals: list[dict]) -> list[tuple[str, Any, Any, Any]]:
    """(quantity, first, last, other) rows of the report's table; first/last = mean of 3 steps."""
    def first_last(key: str, k: int = 3):
        vals = [v for v in column(rl, key) if v is not None]
        return mean(vals[:k]), mean(vals[-k:])

    rows = []
    reward = [v for v in column(rl, "reward/mean") if v is not None]
    rows.append(("training reward (mean of 3 steps)", *first_last("reward/mean"),
                 f"best {_fmt(max(reward))}" if reward else ""))
    if any(v is not None for v in column(rl, "reward/accuracy")):
        rows.append(("training accuracy", *first_last("reward/accuracy"), ""))
    if evals:
        n = int(evals[-1].get("eval/num_prompts") or 0)
        rows.append((f"held-out pass@1 (greedy, {n} prompts)", evals[0].get("eval/pass@1"),
                     evals[-1].get("eval/pass@1"), f"at steps {evals[0]['step']} and {evals[-1]['step']}"))
        rows.append(("held-out mean reward", evals[0].get("eval/reward"), evals[-1].get("eval/reward"), ""))
    kl = [v for v in column(rl, "mismatch/kl_k3") if v is not None]
    if kl:
        rows.append(("mismatch KL k3 (rollout vs trainer)", *first_last("mismatch/kl_k3"),
                     f"max {_fmt(max(kl))}" + (" (exactly 0 on every step)" if max(kl) == 0 else "")))
    equal = column(rl, "mismatch/equal_frac")
    if any(v is not None for v in equal):
        rows.append(("tokens with bitwise-equal log-probs", *first_last("mismatch/equal_frac"),
                     f"mean {_fmt(mean(equal))}"))
    rows.append(("policy entropy (trainer, nats/token)", *first_last("policy/entropy"), ""))
    rows.append(("response length (tokens)", *first_last("response/length_mean"),
                 f"truncated {_fmt(mean(column(rl, 'response/truncated_frac')))}"))
    rows.append(("tokens/s (whole step)", *first_last("throughput/tokens_per_s"), ""))
    return rows


def time_rows(rl: list[dict], evals: list[dict]) -> list[tuple[str, float, float]]:
    """(phase, mean seconds per RL step, share of the step) incl. `other`, and evaluation's total."""
    step = mean(column(rl, "time/step")) or 0.0
    out = []
    for key, name in TIME_PARTS.items():
        s = mean(column(rl, key)) or 0.0
        out.append((name, s, s / step if step else 0.0))
    other = max(step - sum(r[1] for r in out), 0.0)
    out.append(("other (advantages, logging)", other, other / step if step else 0.0))
    out.append(("whole RL step", step, 1.0))
    return out


def report_at_end(run_dir: Path) -> Path | None:
    """The report at the end of a run, its figures sent to the run's W&B / MLflow runs too: a plotting
    or tracker failure is one warning line, never a failed run (summary.json and COMPLETE are written
    before it)."""
    try:
        report = write_run_report(run_dir)
        publish_report(run_dir, sorted(report.parent.glob("*.png")) + [report])  # to W&B / MLflow (trackers.json)
        return report
    except Exception as e:  # noqa: BLE001 - the run's results are safe; only its pictures are missing
        why = write_error(e, run_dir / REPORT_DIR, "the run report") if isinstance(e, OSError) else e
        print(f"[jetflow] warning: the run report could not be written ({type(why).__name__}: {why}); "
              f"retry with `jetflow report {run_dir}`", file=sys.stderr)
        return None


def write_run_report(run_dir: str | Path) -> Path:
    """Write <run>/report/ (see the module docstring) from the run's files; returns report.md's path."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise ReportError(f"{run_dir} is not a run directory (no {CONFIG_FILE}); pass the directory a "
                          "`jetflow train` run wrote, e.g. runs/default")
    cfg = yaml.safe_load((run_dir / CONFIG_FILE).read_text()) or {}
    rl, evals, sft = read_metrics(run_dir), read_metrics(run_dir, "eval"), read_metrics(run_dir, "sft")
    final = run_dir / REPORT_DIR
    out = run_dir / f".tmp-{REPORT_DIR}-{os.getpid()}"  # written whole, then put in place of the old one
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        _write(run_dir, out, cfg, rl, evals, sft)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    old = run_dir / f".old-{REPORT_DIR}-{os.getpid()}"
    if final.exists():
        os.rename(final, old)
    os.rename(out, final)
    shutil.rmtree(old, ignore_errors=True)
    return final / REPORT_FILE


def _write(run_dir: Path, out: Path, cfg: dict, rl: list[dict], evals: list[dict], sft: list[dict]) -> None:
    mode = (cfg.get("precision") or {}).get("mode")
    steps_planned = (cfg.get("train") or {}).get("steps")

    _plot_reward(out / "reward.png", rl, mode)
    _plot_heldout(out / "heldout.png", evals, mode)
    _plot_mismatch(out / "mismatch_kl.png", rl, mode)
    _plot_positions(out / "mismatch_position.png", position_curve(run_dir), mode)
    _plot_time(out / "time_split.png", rl)

    model = (cfg.get("model") or {}).get("path")
    task = (cfg.get("task") or {}).get("name")
    wall = sum(v or 0.0 for v in column(rl, "time/step")) + sum(v or 0.0 for v in column(evals, "time/eval"))
    md = [
        f"# Run report: {run_dir.name}", "",
        f"Run directory: `{run_dir}`  ",
        f"Precision mode: `{mode}`; model: `{model}`; task: `{task}`  ",
        f"Status: {run_status(run_dir)}; RL steps logged: {len(rl)} of {steps_planned}"
        + (f"; supervised warm-up steps: {len(sft)}" if sft else "") + "  ",
        f"Time in RL steps and evaluations: {wall:.0f} s  ",
        f"Generated: {time.strftime('%Y-%m-%dT%H:%M:%S')} (rewrite it: `jetflow report {run_dir}`)", "",
    ]
    if not rl:
        md += ["No RL step has been logged yet.", ""]
    else:
        md += ["| quantity | first | last | |", "|---|---|---|---|"]
        md += [f"| {q} | {_fmt(a)} | {_fmt(b)} | {c} |" for q, a, b, c in summary_rows(rl, evals)]
        md += ["", "First / last: mean over the first / last 3 RL steps (held-out: the first and last "
               "evaluation). Mismatch KL k3: KL(rollout || trainer) estimated on the sampled tokens.", "",
               "| phase | seconds per RL step | share |", "|---|---|---|"]
        md += [f"| {name} | {s:.3g} | {share:.0%} |" for name, s, share in time_rows(rl, evals)]
        if not any(column(rl, "time/old_logprobs")):
            md += ["| (old log-probs 0: with one update per batch, the training forward gives pi_old itself) | | |"]
        if evals:
            md += [f"| held-out evaluation (total, {len(evals)} evaluations) | "
                   f"{sum(v or 0.0 for v in column(evals, 'time/eval')):.3g} s | |"]
        md += [""]
    md += [f"![{name}]({name}.png)\n" for name in PLOTS]
    (out / REPORT_FILE).write_text("\n".join(md))


def _steps(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows]


def _plot_reward(path: Path, rl: list[dict], mode: str | None) -> None:
    accuracy = column(rl, "reward/accuracy")
    second = None  # the accuracy line, unless it equals the reward (it would hide it)
    same = all(a is None or b is None or abs(a - b) < 1e-6 for a, b in zip(accuracy, column(rl, "reward/mean")))
    if any(v is not None for v in accuracy) and not same:
        second = ("reward/accuracy", "accuracy")
    _two_lines(path, rl, mode, ("reward/mean", "reward (mean)"), second, smoothed=True,
               title=f"training reward [{mode}] (faint: per step; line: smoothed)", xlabel="RL step",
               ylabel="reward", empty="no RL step logged yet")


def _plot_heldout(path: Path, evals: list[dict], mode: str | None) -> None:
    _two_lines(path, evals, mode, ("eval/pass@1", "pass@1 (greedy)"), ("eval/reward", "mean reward"),
               smoothed=False, title=f"held-out evaluation [{mode}]", xlabel="RL step (evaluated before it)",
               ylabel="held-out score", empty="no held-out evaluation (eval.num_prompts=0)", ylim=(-0.03, 1.03))


def _two_lines(path: Path, rows: list[dict], mode: str | None, first: tuple[str, str], second, *, smoothed: bool,
               title: str, xlabel: str, ylabel: str, empty: str, ylim=None) -> None:
    """A metric in the mode's colour and optionally a second one (key, label) dashed grey."""
    fig, (ax,) = plots.figure(1, width=6.5)
    drawn = plots.line(ax, _steps(rows), column(rows, first[0]), color=plots.color_for(mode), label=first[1],
                       smoothed=smoothed, markers=not smoothed)
    if second is not None:
        plots.line(ax, _steps(rows), column(rows, second[0]), color="0.3", linestyle="--", label=second[1],
                   smoothed=smoothed, markers=not smoothed)
    plots.style_axis(ax, title, xlabel, ylabel)
    if drawn:
        if ylim:
            ax.set_ylim(*ylim)
        ax.legend(fontsize=8)
    else:
        plots.note(ax, empty)
    plots.save(fig, path)


def _plot_mismatch(path: Path, rl: list[dict], mode: str | None) -> None:
    fig, (ax,) = plots.figure(1, width=6.5)
    kl = column(rl, "mismatch/kl_k3")
    plots.style_axis(ax, f"rollout vs trainer mismatch [{mode}]", "RL step", "KL k3 (log axis)")
    if plots.line(ax, _steps(rl), kl, color=plots.color_for(mode), label="KL k3", log_y=True):
        ax.set_yscale("log")
    elif any(v == 0 for v in kl):  # nothing for a log axis: draw the zeros on a linear one and say so
        _zeros(ax, _steps(rl), kl, mode, "KL exactly 0 on every step:\nrollout and trainer log-probs agree")
    else:
        plots.note(ax, "no RL step logged yet")
    plots.save(fig, path)


def _plot_positions(path: Path, curve, mode: str | None) -> None:
    fig, (ax,) = plots.figure(1, width=6.5)
    plots.style_axis(ax, "mismatch by response position (all steps pooled)", "response token index",
                     "mean KL k3 per token (log axis)")
    if curve is None:
        plots.note(ax, f"no per-position data ({POSITIONS_FILE})")
    elif plots.line(ax, *curve, color=plots.color_for(mode), label="KL k3", log_y=True, smoothed=False):
        ax.set_yscale("log")
    else:
        _zeros(ax, *curve, mode, "KL exactly 0 at every position")
    plots.save(fig, path)


def _zeros(ax, xs, ys, mode: str | None, text: str) -> None:
    plots.line(ax, xs, ys, color=plots.color_for(mode), label="KL k3", smoothed=False, markers=True)
    ax.set_ylabel("KL k3")
    ax.set_ylim(-0.05, 1.0)
    ax.text(0.5, 0.6, text, ha="center", va="center", transform=ax.transAxes, fontsize=10, color="0.3")


def _plot_time(path: Path, rl: list[dict]) -> None:
    fig, (ax,) = plots.figure(1, width=6.5)
    plots.style_axis(ax, "where a step's time goes", "RL step", "seconds")
    if not rl:
        plots.note(ax, "no RL step logged yet")
        plots.save(fig, path)
        return
    steps = _steps(rl)
    bottom = [0.0] * len(rl)
    colors = ("#4c72b0", "#937860", "#dd8452", "#55a868", "#c44e52", "#8c8c8c")
    for (key, name), color in zip(TIME_PARTS.items(), colors):
        vals = [r.get(key) or 0.0 for r in rl]
        ax.bar(steps, vals, bottom=bottom, color=color, label=name, width=0.8)
        bottom = [b + v for b, v in zip(bottom, vals)]
    other = [max((r.get("time/step") or 0.0) - b, 0.0) for r, b in zip(rl, bottom)]
    ax.bar(steps, other, bottom=bottom, color=colors[-1], label="other", width=0.8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    plots.save(fig, path)
