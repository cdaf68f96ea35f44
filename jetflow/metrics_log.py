"""Metrics of a run: one JSON line per step in metrics.jsonl, and TensorBoard event files."""

from __future__ import annotations

import json
import math
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True):
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # tensorboard is a core dependency
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float], phase: str = "rl") -> None:
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, "phase": phase, **clean}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in clean.items():
                if v is not None:
                    self._tb.add_scalar(f"{phase}/{k}" if phase != "rl" else k, v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a JSON-lines file (none if it does not exist). A torn last line, what a kill in the
    middle of a write leaves, is dropped; a bad line anywhere else is an error naming it."""
    path = Path(path)
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON ({e})") from None
    return rows


def read_metrics(run_dir: str | Path, phase: str = "rl") -> list[dict]:
    return [r for r in read_jsonl(Path(run_dir) / METRICS_FILE) if r.get("phase") == phase]
