"""Ablations: a grid of training runs from one YAML file (grid), run one after another (runner),
reported in one table and a few plots (report)."""

from jetflow.ablate.grid import Ablation, Cell, expand_grid, format_value, load_ablation, resolve_cells, select
from jetflow.ablate.runner import run_ablation

__all__ = ["Ablation", "Cell", "expand_grid", "format_value", "load_ablation", "run_ablation", "resolve_cells", "select"]
