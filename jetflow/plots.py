"""The figure style of every jetflow report (a run's report and an ablation's): one colour per
precision mode everywhere, raw points drawn faint under a smoothed curve, a band for the spread over
seeds, exact zeros said in words on log axes (where they have no place).

matplotlib is a core dependency; it is imported here only, lazily, through its object API (no pyplot:
no global backend or figure state, so drawing works in a headless process and in a thread).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Sequence

MODE_COLORS = {"bf16": "#1f77b4", "mixed": "#d62728", "unified": "#2ca02c"}
"""Blue, red, green: bf16 is the reference, mixed the common recipe, unified jetflow's."""
LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1)))
"""For several variants of one mode (e.g. mixed with each rollout correction): one style each."""
OTHER_COLORS = ("#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#ff7f0e")


def color_for(mode: str | None, index: int = 0) -> str:
    """The mode's colour; for something that is not a precision mode, the index-th of a palette."""
    if mode in MODE_COLORS:
        return MODE_COLORS[mode]
    return OTHER_COLORS[index % len(OTHER_COLORS)]


def smooth(ys: Sequence[float | None], weight: float = 0.7) -> list[float | None]:
    """Exponential moving average (TensorBoard's, debiased), skipping missing points."""
    out: list[float | None] = []
    avg, norm = 0.0, 0.0
    for y in ys:
        if y is None or not math.isfinite(y):
            out.append(None)
            continue
        avg = weight * avg + (1 - weight) * y
        norm = weight * norm + (1 - weight)
        out.append(avg / norm)
    return out


def figure(panels: int, width: float = 4.6, height: float = 3.4, max_cols: int = 3):
    """A figure with `panels` axes in rows of at most `max_cols`; returns (fig, [ax, ...])."""
    from matplotlib.figure import Figure

    cols = min(panels, max_cols) or 1
    rows = max(1, math.ceil(panels / cols))
    fig = Figure(figsize=(width * cols + 1.6, height * rows + 0.6), dpi=110)
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[panels:]:
        ax.set_visible(False)
    return fig, axes[:panels]


def style_axis(ax, title: str, xlabel: str, ylabel: str, integer_x: bool = True) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.tick_params(labelsize=8)
    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _points(xs, ys, log_y: bool) -> tuple[list, list]:
    pts = [(x, y) for x, y in zip(xs, ys)
           if y is not None and math.isfinite(y) and (y > 0 or not log_y)]
    return [p[0] for p in pts], [p[1] for p in pts]


def line(ax, xs, ys, *, color: str, label: str, linestyle="-", smoothed: bool = True,
         log_y: bool = False, markers: bool = False) -> bool:
    """Raw points faint and (if `smoothed`) their moving average on top; returns whether anything was
    drawn (on a log axis, points <= 0 are left out)."""
    px, py = _points(xs, ys, log_y)
    if not px:
        return False
    if smoothed and len(px) > 3:
        ax.plot(px, py, color=color, alpha=0.2, lw=0.6, linestyle=linestyle)
        sx, sy = _points(xs, smooth(ys) if not log_y else _smooth_log(ys), log_y)
        ax.plot(sx, sy, color=color, lw=1.8, linestyle=linestyle, label=label)
    else:
        ax.plot(px, py, color=color, lw=1.6, linestyle=linestyle, label=label,
                marker="o" if markers or len(px) < 12 else None, ms=3.5)
    return True


def _smooth_log(ys):
    """Smooth on a log axis in log space (zeros stay out)."""
    logs = [math.log(y) if y is not None and y > 0 else None for y in ys]
    return [math.exp(v) if v is not None else None for v in smooth(logs)]


def band(ax, xs, lows, highs, *, color: str) -> None:
    """The spread over seeds (min to max) as a shaded band."""
    pts = [(x, lo, hi) for x, lo, hi in zip(xs, lows, highs) if lo is not None and hi is not None]
    if pts:
        ax.fill_between([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts], color=color,
                        alpha=0.08, lw=0)


def note(ax, text: str) -> None:
    """Words in the panel, for what a plot cannot show (no data, a KL exactly 0)."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="0.35",
            wrap=True)


def legend(fig, axes) -> None:
    """One legend for the figure, right of the panels, from the labelled lines of all axes."""
    seen: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="center left", bbox_to_anchor=(1.0, 0.5),
                   fontsize=8, frameon=False)


def save(fig, path: Path) -> None:
    """Write the PNG atomically (a reader never sees half a file)."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, format="png", bbox_inches="tight")
    os.replace(tmp, path)
