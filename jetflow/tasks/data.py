"""Tasks read from the user's data file: the readers and the row-walking base class.

Files: ``.jsonl`` (one JSON object per line; blank lines are skipped), ``.parquet`` (pyarrow), or a
directory written by ``datasets``' ``save_to_disk`` (a Dataset, or a DatasetDict whose ``split`` is
read). Every row is checked when the task is built, so bad data fails before training starts, in one
line naming the file and the 1-based row (for jsonl, the line number): DataError.

Order: epoch ``e`` of stream ``seed`` visits the rows in a permutation seeded by ``(seed, e)``, so
problem ``index`` is row ``perm(seed, index // rows)[index % rows]``.

Held-out split: by rows, once (the prompt's hash, as for every task): training walks the rest,
evaluation the held-out rows in file order.
"""

from __future__ import annotations

import json
import random
from abc import abstractmethod
from pathlib import Path
from typing import Callable

from jetflow.errors import MissingDependencyError, UserError
from jetflow.tasks.base import Problem, Task

DATA_INSTALL_HINT = "pip install -e '.[data]' (pyarrow and datasets)"


class DataError(UserError, ValueError):
    """A data file (or one of its rows) the task cannot read."""


class DataFileNotFound(DataError, FileNotFoundError):
    """The data file is not there."""


def _read_jsonl(path: Path) -> list[tuple[int, object]]:
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise DataError(f"{path}: row {line}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for number, row_text in enumerate(text.split("\n"), start=1):  # not splitlines: JSON strings may hold U+2028
        if not row_text.strip():
            continue
        try:
            rows.append((number, json.loads(row_text)))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: row {number}: invalid JSON ({e.msg} at column {e.colno})") from None
    return rows


def _read_parquet(path: Path) -> list[tuple[int, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise MissingDependencyError(f"reading {path} needs pyarrow: pip install pyarrow, or {DATA_INSTALL_HINT}") from None
    try:
        records = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow's ArrowInvalid & co: a damaged or non-parquet file
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {_first_line(e)})") from None
    return list(enumerate(records, start=1))


def _read_hf_dir(path: Path, split: str) -> list[tuple[int, object]]:
    try:
        import datasets
    except ImportError:
        raise MissingDependencyError(f"reading the dataset directory {path} needs datasets: {DATA_INSTALL_HINT}") \
            from None
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as e:  # FileNotFoundError for a directory save_to_disk did not write, and the like
        raise DataError(f"{path}: not a dataset directory written by datasets' save_to_disk "
                        f"({type(e).__name__}: {_first_line(e)})") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise DataError(f"{path}: no split {split!r} (splits: {', '.join(data)}); set task.params.split")
        data = data[split]
    return list(enumerate(data.to_list(), start=1))


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def read_rows(path: str | Path, split: str = "train") -> list[tuple[int, dict]]:
    """[(1-based row number, row)] of a data file; each row a dict (else DataError naming the row)."""
    path = Path(path)
    if path.is_dir():
        rows = _read_hf_dir(path, split)
    elif not path.is_file():
        raise DataFileNotFound(f"data file not found: {path}")
    elif path.suffix == ".jsonl":
        rows = _read_jsonl(path)
    elif path.suffix == ".parquet":
        rows = _read_parquet(path)
    else:
        raise DataError(f"{path}: unsupported file type; use .jsonl, .parquet or a directory written by datasets' "
                        "save_to_disk")
    for number, row in rows:
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {number}: expected a JSON object, got {type(row).__name__}")
    if not rows:
        raise DataError(f"{path} has no rows")
    return [(number, row) for number, row in rows if isinstance(row, dict)]  # all of them, checked above


def field(path: Path, number: int, row: dict, key: str, param: str) -> object:
    """``row[key]``, or a DataError naming the file, the row, the fields it has and the task.params key
    (``param``) that names the field."""
    if key not in row:
        raise DataError(f"{path}: row {number}: missing field {key!r} (fields: {', '.join(row)}); a data file "
                        f"whose rows hold it under another name: set task.params.{param}")
    return row[key]


class DataTask(Task):
    """A task over the rows of a data file. Subclasses set ``self.path`` and ``self.all_rows`` (a
    list of ``(row number, Problem)``) in ``__init__`` and implement ``score`` / ``score_batch``."""

    path: Path
    all_rows: list[tuple[int, Problem]]

    def _set_rows(self, rows: list[tuple[int, Problem]]) -> None:
        self.all_rows = self.rows = rows  # rows: the training split
        self.held_rows: list[tuple[int, Problem]] = []
        self._last_order: tuple[tuple[int, int] | None, list[int]] = (None, [])

    def set_held_out(self, fraction: float) -> None:
        super().set_held_out(fraction)
        self._split()

    def _split(self) -> None:
        held = {n for n, p in self.all_rows if self.is_held_out(p)}
        self.rows = [r for r in self.all_rows if r[0] not in held]
        self.held_rows = [r for r in self.all_rows if r[0] in held]
        if self.held_out and not self.rows:
            raise DataError(f"{self.name}: every row of {self.path} is held out; lower eval.held_out")
        self._last_order = (None, [])

    def dataset_problems(self) -> list[Problem]:
        """Every row's problem, training and held-out, in file order."""
        return [p for _, p in self.all_rows]

    def drop_rows(self, keep: Callable[[Problem], bool]) -> list[int]:
        """Keep the rows whose problem passes ``keep``; returns the row numbers dropped (DataError when
        none is left)."""
        dropped = [n for n, p in self.all_rows if not keep(p)]
        if len(dropped) == len(self.all_rows):
            raise DataError(f"{self.name}: every row of {self.path} was dropped")
        self.all_rows = [r for r in self.all_rows if r[0] not in set(dropped)]
        self._split()
        return dropped

    def held_out_problems(self, n: int, seed: int | None = None) -> list[Problem]:
        """The first ``n`` held-out rows, in file order."""
        return [p for _, p in self.held_rows[:n]]

    def _order(self, seed: int, epoch: int) -> list[int]:
        """The row order of one epoch; the latest one is cached (batches walk epochs in order)."""
        if self._last_order[0] != (seed, epoch):
            order = list(range(len(self.rows)))
            random.Random(f"{self.name}:{seed}:{epoch}").shuffle(order)
            self._last_order = ((seed, epoch), order)
        return self._last_order[1]

    def _problem(self, index: int, seed: int) -> Problem:
        epoch, offset = divmod(index, len(self.rows))
        problem = self.rows[self._order(seed, epoch)[offset]][1]
        return Problem(problem.prompt, problem.answer, {**problem.meta, "epoch": epoch, "index": index, "seed": seed})

    @abstractmethod
    def score(self, problem: Problem, completion: str):
        """See Task.score."""
