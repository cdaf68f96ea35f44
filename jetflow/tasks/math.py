"""Math word problems from the user's file, scored with math-verify.

The file and its rows: jetflow.tasks.data (jsonl, parquet or a ``save_to_disk`` directory; errors name
the file and the 1-based row).

Scoring: ``gold = parse(answer)``, ``pred = parse(completion)``, ``correct = verify(gold, pred)``.
``format_ok`` when the completion contains ``\\boxed{``. math-verify enforces its time limits with
SIGALRM, which only works in the main thread; elsewhere the limits are turned off.
"""

from __future__ import annotations

import threading
from pathlib import Path

from jetflow.tasks.base import Problem, Reward, register_task
from jetflow.tasks.data import DataError, DataTask, field, read_rows

ANSWER_EXTRACTORS = ("gsm8k",)
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_TIMEOUT_S = 5


def _timeout() -> int | None:
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _gsm8k_answer(text: str) -> str:
    """'... #### 1,000' -> '1000'; '' when there is no '####'."""
    if "####" not in text:
        return ""
    return text.rsplit("####", 1)[1].strip().replace(",", "")


@register_task
class MathTask(DataTask):
    """Problems read from ``path``.

    question_field, answer_field: the row keys holding the question and the reference answer.
    answer_extract: None (the answer field is the answer) or "gsm8k" (the answer is what follows
        "####", thousands separators removed).
    instruction: appended to the question, on its own line ("" for none).
    split: the split of a DatasetDict directory.
    """

    name = "math"

    def __init__(
        self,
        path: str,
        question_field: str = "question",
        answer_field: str = "answer",
        answer_extract: str | None = None,
        instruction: str = DEFAULT_INSTRUCTION,
        split: str = "train",
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
        self._set_rows(self._load(split))
        self._gold_cache: dict[str, list] = {}

    def _load(self, split: str) -> list[tuple[int, Problem]]:
        path, rows = self.path, []
        for number, row in read_rows(path, split):
            where = f"{path}: row {number}"
            question, answer = (
                "" if value is None else str(value).strip()
                for value in (field(path, number, row, self.question_field, "question_field"),
                              field(path, number, row, self.answer_field, "answer_field"))
            )
            if self.answer_extract == "gsm8k":
                answer = _gsm8k_answer(answer)
            if not question:
                raise DataError(f"{where}: empty question in field {self.question_field!r}")
            if not answer:
                raise DataError(f"{where}: empty answer in field {self.answer_field!r}")
            prompt = f"{question}\n{self.instruction}" if self.instruction else question
            rows.append((number, Problem(prompt, answer, {"path": str(path), "row": number})))
        return rows

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
                raise DataError(f"{where}: math-verify cannot parse the answer {answer!r}")
            self._gold_cache[answer] = gold
        return self._gold_cache[answer]

    def score(self, problem: Problem, completion: str) -> Reward:
        from math_verify import parse, verify

        gold = self._gold(problem)
        pred = parse(completion, parsing_timeout=_timeout())
        correct = bool(pred) and verify(gold, pred, timeout_seconds=_timeout())
        return self.reward(correct, "\\boxed{" in completion)
