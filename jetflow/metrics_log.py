"""Metrics of a run: one JSON line per step in metrics.jsonl, handed on to the trackers of run.loggers.

Every key a row holds is documented in jetflow.metrics_registry; one it does not document is logged all the
same, with a warning (once per key and phase) that names it.

These files are derived: the checkpoints are the run's truth. A damaged line never stops a reader or
a resume: it is skipped with a warning that names it (a resume sets it aside, `set_aside_bad_lines`),
and a tracker that cannot write (jetflow.trackers) is turned off with a warning."""

from __future__ import annotations

import gzip
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from jetflow.metrics_registry import undocumented
from jetflow.trackers import TENSORBOARD_DIR, Trackers
from jetflow.writes import guarded

METRICS_FILE = "metrics.jsonl"
DAMAGED_SUFFIX = ".damaged"
RESUME_HINT = "the same command with run.resume=true continues the run from its last checkpoint"


def warn(message: str) -> None:
    print(f"[jetflow] warning: {message}", file=sys.stderr)


def set_aside(path: Path) -> Path:
    """Move a damaged file or directory out of the way (to <name>.damaged, numbered if taken)."""
    target, n = path.with_name(path.name + DAMAGED_SUFFIX), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{DAMAGED_SUFFIX}{n}")
    os.rename(path, target)
    return target


class MetricsLogger:
    """metrics.jsonl, and every tracker of run.loggers (jetflow.trackers: TensorBoard, W&B, MLflow).
    A disk that fails a row's write is one WriteError naming the file, after the row's partial line
    is cut off (a resume redoes the steps after the last checkpoint)."""

    def __init__(self, run_dir: str | Path, loggers: Sequence[str] = (), config: dict | None = None,
                 project: str = "jetflow", mlflow_tracking_uri: str = ""):
        self.path = Path(run_dir) / METRICS_FILE
        with guarded(self.path, "the metrics file", after=RESUME_HINT):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists() and not self.path.is_file():  # e.g. a directory where the file belongs
                warn(f"{self.path} is not a file; set aside as {set_aside(self.path).name}")
            self._file = self.path.open("ab", buffering=0)  # unbuffered: a failed row is cut off at once
        tb_dir = Path(run_dir) / TENSORBOARD_DIR
        if "tensorboard" in loggers and tb_dir.exists() and not tb_dir.is_dir():
            warn(f"{tb_dir} is not a directory; set aside as {set_aside(tb_dir).name}")
        self.trackers = Trackers(run_dir, loggers, config, project, mlflow_tracking_uri=mlflow_tracking_uri)
        self._checked: set[tuple[str, str]] = set()  # (phase, key) pairs looked up in the registry

    def log(self, step: int, metrics: dict[str, float], phase: str = "rl") -> None:
        self._check(metrics, phase)
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
        line = (json.dumps({"step": step, "phase": phase, **clean}) + "\n").encode()
        end = self._file.tell()
        with guarded(self.path, "the metrics file", partial=lambda: self._cut(end), after=RESUME_HINT):
            view = memoryview(line)
            while view:  # a raw write may take part of the row
                view = view[self._file.write(view):]
        self.trackers.log(step, clean, phase)

    def _check(self, metrics: dict[str, float], phase: str) -> None:
        """A key the registry does not document (for this phase): one warning, the first time it is logged."""
        for key in metrics:
            if (phase, key) not in self._checked:
                self._checked.add((phase, key))
                if why := undocumented(key, phase):
                    warn(f"metric {key!r} ({phase} row): {why}; it is logged all the same (document it in "
                         "jetflow/metrics_registry.py)")

    def _cut(self, size: int) -> None:
        """Drop a partial row: the file back to `size` bytes (best effort: the disk is failing)."""
        try:
            self._file.truncate(size)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
        self.trackers.close()


@dataclass
class BadLine:
    number: int  # 1-based
    text: bytes
    why: str

    def describe(self, path: Path) -> str:
        return f"{path.name} line {self.number} ({self.why})"


def parse_jsonl(path: str | Path, required: tuple[str, ...] = ()) -> tuple[list[dict], list[BadLine], bool]:
    """(rows, bad lines, torn): every line that is a JSON object holding the `required` keys is a row;
    any other line is bad, except a torn last line (what a kill in the middle of a write leaves:
    no newline at its end), which is only reported as `torn`."""
    path = Path(path)
    if not path.is_file():
        return [], [], False
    return _parse_lines(path.read_bytes(), required)


def _parse_lines(data: bytes, required: tuple[str, ...]) -> tuple[list[dict], list[BadLine], bool]:
    lines = data.split(b"\n")
    last = len(lines) - 1  # the text after the last newline: empty unless the last line is torn
    rows, bad, torn = [], [], False
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        why = _row_problem(raw, required)
        if why is None:
            rows.append(json.loads(raw))
        elif i == last:
            torn = True
        else:
            bad.append(BadLine(i + 1, raw, why))
    return rows, bad, torn


def _row_problem(raw: bytes, required: tuple[str, ...]) -> str | None:
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return f"not UTF-8 text: {e.reason} at byte {e.start}"
    except json.JSONDecodeError as e:
        return f"not JSON: {e.msg} at column {e.colno}"
    if not isinstance(row, dict):
        return f"not a JSON object but a {type(row).__name__}"
    missing = [k for k in required if k not in row]
    if missing:
        return f"no {', '.join(missing)}"
    if "step" in required and (not isinstance(row["step"], int) or isinstance(row["step"], bool)):
        return f"step {row['step']!r} is not a whole number"
    return None


def read_jsonl(path: str | Path, required: tuple[str, ...] = ()) -> list[dict]:
    """The rows of a JSON-lines file (none if it does not exist). A torn last line is dropped; a bad
    line anywhere else is skipped with a warning naming it. Where the file is absent and `<name>.gz`
    is there (how results/ archives a finished run's per-step files), that one is read."""
    path = Path(path)
    archived = path.with_name(path.name + ".gz")
    if not path.exists() and archived.is_file():
        rows, bad, _ = _parse_lines(gzip.decompress(archived.read_bytes()), required)
    else:
        rows, bad, _ = parse_jsonl(path, required)
    if bad:
        warn(f"skipped {_describe(path, bad)}")
    return rows


def set_aside_bad_lines(path: str | Path, required: tuple[str, ...] = ()) -> list[dict]:
    """Rewrite a JSON-lines file with its good rows only (a resume appends to it): bad lines are
    appended to <name>.damaged with their line numbers, and a warning names them; a torn last line is
    dropped. A path that is not a file is set aside whole. Returns the rows."""
    path = Path(path)
    if path.exists() and not path.is_file():
        warn(f"{path} is not a file; set aside as {set_aside(path).name}")
        return []
    rows, bad, torn = parse_jsonl(path, required)
    if bad:
        damaged = path.with_name(path.name + DAMAGED_SUFFIX)
        with open(damaged, "ab") as f:
            for line in bad:
                f.write(f"# line {line.number}: {line.why}\n".encode() + line.text + b"\n")
        warn(f"{_describe(path, bad)}: set aside in {damaged.name}; the run goes on without it")
    if bad or torn:
        write_jsonl(path, rows)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Replace `path` with `rows`, atomically."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with guarded(path, "the metrics file", partial=tmp, after=RESUME_HINT):
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, path)


def _describe(path: Path, bad: list[BadLine]) -> str:
    shown = "; ".join(line.describe(path) for line in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return f"{len(bad)} damaged line(s) in {path}: {shown}{more}"


METRIC_KEYS = ("step", "phase")  # what every metrics row holds


def read_metrics(run_dir: str | Path, phase: str = "rl") -> list[dict]:
    return [r for r in read_jsonl(Path(run_dir) / METRICS_FILE, METRIC_KEYS) if r.get("phase") == phase]
