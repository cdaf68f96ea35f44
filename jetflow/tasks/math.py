"""Math word problems from the user's file, scored with math-verify.

The file is ``.jsonl`` (one JSON object per line; blank lines are skipped) or ``.parquet`` (needs
pyarrow). Every row is checked when the task is built, so bad data fails before training starts:
errors name the file and the 1-based row (for jsonl, the line number).

Order: epoch ``e`` of stream ``seed`` visits the rows in a permutation seeded by ``(seed, e)``, so
problem ``index`` is row ``perm(seed, index // rows)[index % rows]``.

Scoring: ``gold = parse(answer)``, ``pred = parse(completion)``, ``correct = verify(gold, pred)``.
``format_ok`` when the completion contains ``\\boxed{``. math-verify enforces its time limits with
SIGALRM, which only works in the main thread; elsewhere the limits are turned off.
"""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

from jetflow.errors import MissingDependencyError
from jetflow.tasks.base import Problem, Reward, Task, register_task

ANSWER_EXTRACTORS = ("gsm8k",)
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_TIMEOUT_S = 5


def _timeout() -> int | None:
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _read_jsonl(path: Path) -> list[tuple[int, object]]:
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}: row {line}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: row {number}: invalid JSON ({e.msg})") from None
    return rows


def _read_parquet(path: Path) -> list[tuple[int, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    if pq is not None:
        records = pq.read_table(path).to_pylist()
    else:
        try:
            import pandas as pd
        except ImportError:
            raise MissingDependencyError(f"reading {path} needs pyarrow: pip install pyarrow") from None
        records = pd.read_parquet(path).to_dict("records")  # pandas needs pyarrow or fastparquet
    return list(enumerate(records, start=1))


def _gsm8k_answer(text: str) -> str:
    """'... #### 1,000' -> '1000'; '' when there is no '####'."""
    if "####" not in text:
        return ""
    return text.rsplit("####", 1)[1].strip().replace(",", "")


@register_task
class MathTask(Task):
    """Problems read from ``path``.

    question_field, answer_field: the row keys holding the question and the reference answer.
    answer_extract: None (the answer field is the answer) or "gsm8k" (the answer is what follows
        "####", thousands separators removed).
    instruction: appended to the question, on its own line ("" for none).
    """

    name = "math"

    def __init__(
        self,
        path: str,
        question_field: str = "question",
        answer_field: str = "answer",
        answer_extract: str | None = None,
        instruction: str = DEFAULT_INSTRUCTION,
        seed: int = 0,
        format_weight: float = 0.0,
    ):
        super().__init__(seed=seed, format_weight=format_weight)
        if answer_extract is not None and answer_extract not in ANSWER_EXTRACTORS:
            raise ValueError(
                f"math: unknown answer_extract {answer_extract!r}; valid: None, "
                + ", ".join(ANSWER_EXTRACTORS)
            )
        self.path = Path(path)
        self.question_field = question_field
        self.answer_field = answer_field
        self.answer_extract = answer_extract
        self.instruction = instruction
        self.all_rows = self.rows = self._load()  # [(row number, question, answer)]; rows: the training split
        self.held_rows: list[tuple[int, str, str]] = []
        self._gold_cache: dict[str, list] = {}
        self._last_order: tuple[tuple[int, int] | None, list[int]] = (None, [])

    def _load(self) -> list[tuple[int, str, str]]:
        path = self.path
        if not path.is_file():
            raise FileNotFoundError(f"math: data file not found: {path}")
        readers = {".jsonl": _read_jsonl, ".parquet": _read_parquet}
        if path.suffix not in readers:
            kinds = ", ".join(readers)
            raise ValueError(f"math: {path}: unsupported file type; use one of {kinds}")
        rows = []
        for number, row in readers[path.suffix](path):
            where = f"{path}: row {number}"
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            for key in (self.question_field, self.answer_field):
                if key not in row:
                    raise ValueError(f"{where}: missing field {key!r} (fields: {', '.join(row)})")
            question, answer = (
                "" if row[key] is None else str(row[key]).strip()
                for key in (self.question_field, self.answer_field)
            )
            if self.answer_extract == "gsm8k":
                answer = _gsm8k_answer(answer)
            if not question:
                raise ValueError(f"{where}: empty question in field {self.question_field!r}")
            if not answer:
                raise ValueError(f"{where}: empty answer in field {self.answer_field!r}")
            rows.append((number, question, answer))
        if not rows:
            raise ValueError(f"math: {path} has no rows")
        return rows

    def set_held_out(self, fraction: float) -> None:
        """A data file is split once, by rows: training walks the rest, evaluation the held-out rows."""
        super().set_held_out(fraction)
        held = {r[0] for r in self.all_rows if self.is_held_out(self._row_problem(r))}
        self.rows = [r for r in self.all_rows if r[0] not in held]
        self.held_rows = [r for r in self.all_rows if r[0] in held]
        if fraction and not self.rows:
            raise ValueError(f"math: every row of {self.path} is held out; lower eval.held_out")
        self._last_order = (None, [])

    def held_out_problems(self, n: int, seed: int | None = None) -> list[Problem]:
        """The first ``n`` held-out rows, in file order."""
        return [self._row_problem(r) for r in self.held_rows[:n]]

    def _row_problem(self, row: tuple[int, str, str], **meta) -> Problem:
        number, question, answer = row
        prompt = f"{question}\n{self.instruction}" if self.instruction else question
        return Problem(prompt=prompt, answer=answer, meta={"path": str(self.path), "row": number, **meta})

    def _order(self, seed: int, epoch: int) -> list[int]:
        """The row order of one epoch; the latest one is cached (batches walk epochs in order)."""
        if self._last_order[0] != (seed, epoch):
            order = list(range(len(self.rows)))
            random.Random(f"{self.name}:{seed}:{epoch}").shuffle(order)
            self._last_order = ((seed, epoch), order)
        return self._last_order[1]

    def _problem(self, index: int, seed: int) -> Problem:
        epoch, offset = divmod(index, len(self.rows))
        return self._row_problem(self.rows[self._order(seed, epoch)[offset]], epoch=epoch, index=index, seed=seed)

    def _gold(self, problem: Problem) -> list:
        from math_verify import parse

        answer = problem.answer
        if answer not in self._gold_cache:
            # Bare LaTeX such as "x^2+1" parses only inside math delimiters.
            gold = parse(answer, parsing_timeout=_timeout()) or parse(
                f"${answer}$", parsing_timeout=_timeout()
            )
            if not gold:
                where = f"{problem.meta.get('path')}: row {problem.meta.get('row')}"
                raise ValueError(f"{where}: math-verify cannot parse the answer {answer!r}")
            self._gold_cache[answer] = gold
        return self._gold_cache[answer]

    def score(self, problem: Problem, completion: str) -> Reward:
        from math_verify import parse, verify

        gold = self._gold(problem)
        pred = parse(completion, parsing_timeout=_timeout())
        correct = bool(pred) and verify(gold, pred, timeout_seconds=_timeout())
        return self.reward(correct, "\\boxed{" in completion)
