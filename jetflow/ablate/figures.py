"""An ablation's figures: one panel per setting, one line per variant, seeds pooled.

A cell's grid labels decide where it is drawn (jetflow.ablate.grid names the axes; its place_cells
applies these rules):
- the line (variant): its precision mode, recipe family and rollout correction (`precision.mode`,
  `precision.family`, `algo.correction`); a grid without them draws the first axis that is not the seed;
- the panel: every other axis except the seed (e.g. the response length); a cell that a conditional
  panel axis skipped (`only_when`) is drawn in every panel of that axis (e.g. bf16 beside each recipe
  family of mixed and unified);
- `run.seed`: pooled. A line is the mean over seeds per step, smoothed (the raw mean faint beneath),
  with a band from the lowest to the highest seed.
Colours follow the precision mode in every figure (jetflow.plots.MODE_COLORS); several variants of one
mode (mixed with each correction) share its colour and differ in line style.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from jetflow import plots
from jetflow.ablate import archive
from jetflow.ablate.grid import Ablation, Placed, place_cells
from jetflow.run.files import POSITIONS_FILE


def panel_columns(placed: list[Placed], default: int = 3) -> int:
    """Columns of a figure: with two or more panel axes, one column per label of the last (a row per
    combination of the others, e.g. a setting per row and its recipe families side by side)."""
    keys = list(dict.fromkeys(p.panel_key for p in placed))
    if keys and len(keys[0]) >= 2:
        return max(1, len({k[-1] for k in keys}))
    return default


def _styles(placed: list[Placed]) -> dict[str, tuple[str, object]]:
    """line -> (colour, line style): the mode's colour, one style per variant within a mode."""
    styles: dict[str, tuple[str, object]] = {}
    per_mode: dict[str | None, int] = {}
    others = 0
    for p in placed:
        if p.line in styles:
            continue
        if p.mode in plots.MODE_COLORS:
            i = per_mode.get(p.mode, 0)
            per_mode[p.mode] = i + 1
            styles[p.line] = (plots.color_for(p.mode), plots.LINE_STYLES[i % len(plots.LINE_STYLES)])
        else:
            styles[p.line] = (plots.color_for(None, others), "-")
            others += 1
    return styles


def pooled(series: list[dict[float, float]]) -> tuple[list, list, list, list]:
    """Per x over the seeds' series: (xs, mean, min, max); an x some seeds lack uses the others."""
    xs = sorted({x for s in series for x in s})
    mean, lo, hi = [], [], []
    for x in xs:
        vals = [s[x] for s in series if x in s and s[x] is not None]
        mean.append(sum(vals) / len(vals) if vals else None)
        lo.append(min(vals) if vals else None)
        hi.append(max(vals) if vals else None)
    return xs, mean, lo, hi


Series = Callable[[Path], dict[float, float]]


def metric_series(key: str, phase: str = "rl") -> Series:
    def read(run_dir: Path) -> dict[float, float]:
        rows = archive.metrics_rows(run_dir, phase)
        return {r["step"]: r.get(key) for r in rows if r.get(key) is not None}  # a redone step: the last row
    return read


def position_series(run_dir: Path) -> dict[float, float]:
    """Mean k3 per response index pooled over all RL steps, each index weighted by its token count (as
    jetflow.run.report.position_curve, from the run's mismatch_positions.jsonl loose or archived)."""
    by_step = {r["step"]: r for r in archive.read_rows(run_dir / POSITIONS_FILE)}  # a resumed step: the last row
    total: dict[int, float] = {}
    count: dict[int, float] = {}
    for r in by_step.values():
        for t, (k3, n) in enumerate(zip(r["kl_k3"], r["count"])):
            total[t] = total.get(t, 0.0) + k3 * n
            count[t] = count.get(t, 0.0) + n
    return {t: total[t] / count[t] for t in sorted(total) if count[t] > 0}


def draw(path: Path, title: str, ylabel: str, xlabel: str, placed: list[Placed], series: Series,
         log_y: bool = False, smoothed: bool = True, ylim: tuple[float, float] | None = None) -> None:
    """One panel per setting, one pooled line per variant (see the module docstring)."""
    panels = list(dict.fromkeys(p.panel for p in placed))
    styles = _styles(placed)
    fig, axes = plots.figure(len(panels), max_cols=panel_columns(placed))
    seeds = max((sum(1 for q in placed if q.panel == p.panel and q.line == p.line) for p in placed), default=1)
    for ax, panel in zip(axes, panels):
        zero, drawn, counts = [], False, set()
        for line in dict.fromkeys(p.line for p in placed if p.panel == panel):
            runs = [series(p.run_dir) for p in placed if p.panel == panel and p.line == line]
            runs = [r for r in runs if r]
            if not runs:
                continue
            xs, mean, lo, hi = pooled(runs)
            color, style = styles[line]
            counts.add(len(runs))
            if plots.line(ax, xs, mean, color=color, linestyle=style, label=line, log_y=log_y, smoothed=smoothed):
                drawn = True
                if len(runs) > 1:
                    plots.band(ax, xs, [v if not log_y or (v or 0) > 0 else None for v in lo],
                               [v if not log_y or (v or 0) > 0 else None for v in hi], color=color)
            elif log_y and all(v == 0 for v in mean if v is not None):
                zero.append(line)
        fewer = sorted(c for c in counts if c < seeds)
        plots.style_axis(ax, panel + (f" ({'/'.join(map(str, fewer))} of {seeds} seeds for some lines)"
                                      if fewer else ""), xlabel, ylabel)
        if drawn and log_y:
            ax.set_yscale("log")
        if drawn and ylim:
            ax.set_ylim(*ylim)
        if zero:
            ax.text(0.02, 0.02, "exactly 0 (not on a log axis): " + ", ".join(zero), transform=ax.transAxes,
                    fontsize=7, color="0.3", va="bottom")
        elif not drawn:
            plots.note(ax, "no data yet")
    pooled_note = f"mean over {seeds} seeds, band: lowest to highest" if seeds > 1 else "one seed per line"
    fig.suptitle(f"{title} ({pooled_note}{'; faint: unsmoothed' if smoothed else ''})", fontsize=11)
    plots.legend(fig, axes)
    plots.save(fig, path)


FIGURES = {  # file -> (title, y label, x label, series, log_y, smoothed, ylim)
    "reward.png": ("training reward", "reward/mean", "RL step", metric_series("reward/mean"), False, True, None),
    "heldout.png": ("held-out pass@1 (greedy)", "eval/pass@1", "RL step", metric_series("eval/pass@1", "eval"),
                    False, False, (-0.03, 1.03)),
    "entropy.png": ("policy entropy (trainer side)", "nats/token", "RL step", metric_series("policy/entropy"),
                    False, True, None),
    "mismatch_kl.png": ("rollout vs trainer mismatch", "KL k3 (log axis)", "RL step",
                        metric_series("mismatch/kl_k3"), True, True, None),
    "mismatch_position.png": ("mismatch by response position, all steps pooled", "mean KL k3 per token (log axis)",
                              "response token index", position_series, True, True, None),
}


# Drawn only when some cell logged the metric (runs made before it existed have none).
EXTRA_FIGURES = {
    "grad_norm.png": ("gradient norm before clipping", "train/grad_norm (log axis)", "RL step",
                      metric_series("train/grad_norm"), True, True, None),
    "low_prob.png": ("share of sampled tokens with rollout p < 0.1", "policy/low_prob_frac", "RL step",
                     metric_series("policy/low_prob_frac"), False, True, None),
    "response_length.png": ("response length", "tokens", "RL step", metric_series("response/length_mean"),
                            False, True, None),
}


def draw_all(ab: Ablation) -> dict[str, str]:
    """Every figure of the ablation into its out_dir; returns {name: file}."""
    placed = place_cells(ab)
    figures = dict(FIGURES)
    for file, spec in EXTRA_FIGURES.items():
        if any(spec[3](p.run_dir) for p in placed):
            figures[file] = spec
    for file, (title, ylabel, xlabel, series, log_y, smoothed, ylim) in figures.items():
        draw(ab.out_dir / file, f"{ab.name}: {title}", ylabel, xlabel, placed, series, log_y, smoothed, ylim)
    return {file.removesuffix(".png"): file for file in figures}
