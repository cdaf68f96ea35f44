"""Shared supervised warm-ups: one warm-up per group of cells that would each run the same one.

In a study such as configs/ablations/learning-length.yaml the supervised warm-up is most of a cell's time,
and arms repeat it: the three mixed arms differ only in their correction, an RL-only key. The ablation file
names the keys the warm-up does not read:

    shared_warmup:
      ignore: [algo.correction]

(bf16 and mixed do not share one by themselves: both train in bf16, but the bf16 mode also rounds K/V to
bf16 on both sides and mixed does not, so their warm-ups differ in the last bits from the first step.)

A study that compares RL recipes from one starting point also ignores `precision.mode`: every arm then
starts RL from the group's first cell's warm-up (configs/ablations/learning-length.yaml: the bf16 arm's),
as the arms of the papers' ablations start from one pretrained model, and the other arms are no longer
what they would be run whole: only their RL steps differ. RL replicates of one start are a `run.rl_seed` axis
(the RL phase's draws; jetflow.config.RunConfig) that `ignore` lists.

Cells whose settings agree once those keys are dropped form a group. The group's
warm-up runs once, as its own run: <out_dir>/warmups/<the group's first cell id>/, the first cell's config
with train.steps=0 (resumable like any run). Each cell of the group then starts
from it: its run directory gets the warm-up's end checkpoint (step_000000, where a run resumed after its
warm-up starts RL: weights, AdamW state, RNG) and the warm-up's metric rows, and the cell runs with
run.resume=true. A cell started this way is bit for bit the cell run whole when the warm-up is the one it
would have run (tests/unit/test_ablation_warmups.py checks it against a cell run without sharing).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetflow.config import ConfigError
from jetflow.metrics_log import read_metrics, write_jsonl
from jetflow.run.files import CHECKPOINTS_DIR, COMPLETE, METRICS_FILE
from jetflow.train.checkpoint import RESUME_HINT, checkpoint_name, list_checkpoints
from jetflow.writes import atomic_write_text

WARMUPS = "warmups"
WARMUP_END = checkpoint_name(0)  # the checkpoint a run writes when its supervised warm-up ends (jetflow.run.sequence)


@dataclass
class SharedWarmup:
    ignore: list[str] = field(default_factory=list)
    """Config keys the supervised warm-up does not read."""

    def key(self, settings: dict[str, Any]) -> str:
        """What tells a cell's warm-up apart: its settings less the ignored keys."""
        return json.dumps({k: v for k, v in settings.items() if k not in self.ignore}, sort_keys=True, default=str)

    def groups(self, cells: list) -> dict[str, str]:
        """cell id -> its group's warm-up name: the id of the group's first cell (cells in grid order)."""
        first: dict[str, str] = {}
        return {cell.id: first.setdefault(self.key(cell.settings), cell.id) for cell in cells}


def parse_shared_warmup(spec: Any, path: Path) -> SharedWarmup | None:
    if spec is None:
        return None
    ignore = spec.get("ignore") if isinstance(spec, dict) and set(spec) == {"ignore"} else None
    if not isinstance(ignore, list) or not ignore or not all(isinstance(k, str) for k in ignore):
        raise ConfigError(f"{path}: shared_warmup takes `ignore`, a list of the config keys the supervised warm-up "
                          f"does not read (e.g. [algo.correction]); got {spec!r}")
    return SharedWarmup(list(ignore))


def needs_warmup_start(run_dir: Path) -> bool:
    """A cell that holds no checkpoint yet (not started, or stopped while it was being given one)."""
    return not list_checkpoints(run_dir / CHECKPOINTS_DIR)


def start_from_warmup(warmup: Path, run_dir: Path) -> None:
    """Give a cell that has not started the group's warm-up: its end checkpoint and its metric rows. The
    checkpoint is copied under a temporary name and renamed whole, and `latest` is written last, so a cell
    stopped in the middle holds no checkpoint and is given one again."""
    if not (warmup / COMPLETE).exists():
        raise RuntimeError(f"the shared warm-up {warmup} has not completed")
    source = warmup / CHECKPOINTS_DIR / WARMUP_END
    if not source.is_dir():
        raise RuntimeError(f"the shared warm-up {warmup} has no {WARMUP_END} checkpoint (its warm-up end)")
    checkpoints = run_dir / CHECKPOINTS_DIR
    checkpoints.mkdir(parents=True, exist_ok=True)
    tmp = checkpoints / f".{WARMUP_END}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    os.replace(tmp, checkpoints / WARMUP_END)
    write_jsonl(run_dir / METRICS_FILE, read_metrics(warmup, "sft"))
    atomic_write_text(checkpoints / "latest", WARMUP_END, "the checkpoint pointer", after=RESUME_HINT)
