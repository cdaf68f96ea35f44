"""The task interface: problems, rewards, and the registry that builds tasks by name.

A task is an indexed stream of problems plus an exact verifier. Problem ``index`` of stream ``seed``
is a pure function of ``(seed, index)``, so a training loop only has to remember an integer position
to resume exactly where it stopped: ``task.problems(start=position, n=batch)``.

Held-out split: with ``task.set_held_out(f)`` the prompts whose hash falls below ``f`` are kept for
evaluation (``held_out_problems``) and never drawn for training: a training draw that lands on one
is replaced by a redraw of the same index, so the stream stays a pure function of ``(seed, index)``.
The split depends on the prompt text only, so it is the same in every run, rank and seed.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class Problem:
    """One prompt and its reference answer.

    prompt: the user's text, without any chat template (the rollout side applies one when
        ``task.chat`` is true, and feeds the text raw otherwise); or a conversation, a list of
        ``{"role": ..., "content": ...}`` messages, which is always rendered by the chat template.
    answer: the reference answer as text (for display and logging; the verifier may use ``meta``).
    meta: task-specific facts (operands, target, source row, index, seed, ...).
    """

    prompt: str | list[dict]
    answer: str
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Reward:
    """The verifier's verdict on one completion.

    total: the scalar reward, ``1.0 * correct + format_weight * format_ok``.
    correct: the answer is right.
    format_ok: the answer was given in the requested shape (tags, a bare number, ...).
    """

    total: float
    correct: bool
    format_ok: bool
    parts: dict[str, float] = field(default_factory=dict, compare=False)
    """The reward's named terms before weighting (a custom task's reward functions), for the logs."""


def reward_part_means(scores: list[Reward]) -> dict[str, float]:
    """``reward/fn/<name>``: each named term's mean over the completions it scored (a reward function's
    None leaves the completion out, as TRL's nanmean does; a term that scored none is not logged)."""
    names = list(dict.fromkeys(name for s in scores for name in s.parts))
    means = {}
    for name in names:
        values = [s.parts[name] for s in scores if name in s.parts]
        means[f"reward/fn/{name}"] = sum(values) / len(values)
    return means


def rng_for(task_name: str, seed: int, index: int) -> random.Random:
    """A generator private to problem ``index`` of stream ``seed``.

    Seeding with a string hashes it with SHA-512, so the stream is the same in every process and
    independent of PYTHONHASHSEED; distinct (seed, index) pairs never share a seed.
    """
    return random.Random(f"{task_name}:{seed}:{index}")


def prompt_key(prompt: str | list[dict]) -> str:
    """A prompt as one string (a conversation as canonical JSON): what the held-out split hashes."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def held_out_bucket(prompt: str | list[dict]) -> float:
    """A stable number in [0, 1) per prompt; a held-out fraction f keeps the prompts below f."""
    return int.from_bytes(hashlib.sha256(prompt_key(prompt).encode()).digest()[:8], "big") / 2**64


REDRAW_STRIDE = 1 << 40  # a training draw on a held-out problem redraws index + k * REDRAW_STRIDE
MAX_REDRAWS = 1000


class Task(ABC):
    """Base class of all tasks.

    Subclasses set ``name``, implement ``_problem(index, seed)`` and ``score`` (and ``score_batch``
    where the reward is computed in batches), and take every option as an explicit keyword argument
    of ``__init__`` (``make_task`` checks keys against it). Tasks read from a data file derive from
    jetflow.tasks.data.DataTask (math, custom); the others generate their problems (arithmetic,
    countdown).

    chat: whether prompts are meant for a chat template (False for raw character-level prompts).
    stop: strings that end a completion; the rollout engine may stop generating at them.
    """

    name: ClassVar[str] = ""
    chat: bool = True
    stop: tuple[str, ...] = ()

    def __init__(self, seed: int = 0, format_weight: float = 0.0):
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if not (math.isfinite(format_weight) and format_weight >= 0):
            raise ValueError(f"format_weight must be a finite number >= 0, got {format_weight!r}")
        self.seed = seed
        self.format_weight = float(format_weight)
        self.held_out = 0.0

    def uses_chat(self, chat_template: bool) -> bool:
        """Whether this task's text prompts go through the tokenizer's chat template in a run whose
        model.chat_template is `chat_template`: both the run and the task's style ask for it."""
        return bool(chat_template and self.chat)

    def set_held_out(self, fraction: float) -> None:
        """Keep the prompts whose hash is below ``fraction`` out of training (for evaluation)."""
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"the held-out fraction must be in [0, 1), got {fraction!r}")
        self.held_out = float(fraction)

    def is_held_out(self, problem: Problem) -> bool:
        return held_out_bucket(problem.prompt) < self.held_out

    def problem(self, index: int, seed: int | None = None) -> Problem:
        """Training problem ``index`` of stream ``seed`` (the task's own seed when None); never a
        held-out one."""
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"problem index must be an int >= 0, got {index!r}")
        seed = self.seed if seed is None else seed
        for k in range(MAX_REDRAWS):
            problem = self._problem(index + k * REDRAW_STRIDE, seed)
            if not (self.held_out and self.is_held_out(problem)):
                return problem
        raise ValueError(f"task {self.name!r}: {MAX_REDRAWS} draws in a row were held out; lower eval.held_out")

    def held_out_problems(self, n: int, seed: int | None = None) -> list[Problem]:
        """Up to ``n`` distinct held-out problems, a deterministic function of ``seed``; fewer when
        the task's problem space holds fewer (the scan stops after ``200 * n`` draws)."""
        seed = self.seed if seed is None else seed
        found: dict[str, Problem] = {}
        for index in range(200 * n):
            problem = self._problem(index, seed)
            if self.is_held_out(problem) and prompt_key(problem.prompt) not in found:
                found[prompt_key(problem.prompt)] = problem
                if len(found) == n:
                    break
        return list(found.values())

    def problems(self, start: int, n: int, seed: int | None = None) -> list[Problem]:
        """Problems ``start .. start + n - 1``: one batch of a run that tracks its position."""
        return [self.problem(i, seed) for i in range(start, start + n)]

    def sample(self, n: int, seed: int) -> list[Problem]:
        """``n`` problems, a deterministic function of ``seed`` (the first ``n`` of that stream)."""
        return self.problems(0, n, seed)

    def reward(self, correct: bool, format_ok: bool) -> Reward:
        """Build a Reward with this task's format weight."""
        total = float(correct) + (self.format_weight if format_ok else 0.0)
        return Reward(total=total, correct=bool(correct), format_ok=bool(format_ok))

    @abstractmethod
    def _problem(self, index: int, seed: int) -> Problem:
        """Problem ``index`` of stream ``seed``; must depend on nothing else."""

    @abstractmethod
    def score(self, problem: Problem, completion: str) -> Reward:
        """Verify ``completion`` (generated text only, without the prompt) against ``problem``."""

    def score_batch(self, problems: list[Problem], completions: list[str]) -> list[Reward]:
        """The rewards of ``completions[i]`` for ``problems[i]``: what the training loop and the
        held-out evaluation call (once per step). Per completion by default; a task whose reward
        functions take batches (the custom task) overrides it."""
        return [self.score(p, c) for p, c in zip(problems, completions, strict=True)]

    def row_of(self, problem: Problem) -> tuple[dict, str]:
        """The problem as a data row (what a multi-turn environment is built with) and a name for it."""
        return {"prompt": problem.prompt, "answer": problem.answer, **problem.meta}, f"a problem of task {self.name!r}"

    def dataset_problems(self) -> list[Problem] | None:
        """Every problem of a task read from a data file, in file order (the length checks read them
        all); None for a generated task (its problem space has no end)."""
        return None


_TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: make ``cls`` buildable by ``make_task(cls.name, ...)``."""
    if not cls.name or cls.name in _TASKS:
        raise ValueError(f"task class {cls.__name__} needs a unique name, got {cls.name!r}")
    _TASKS[cls.name] = cls
    return cls


def task_names() -> list[str]:
    """Names accepted by ``make_task``."""
    return sorted(_TASKS)


def task_options(name: str) -> list[str]:
    """The keyword options of task ``name``."""
    params = inspect.signature(_lookup(name)).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _lookup(name: str) -> type[Task]:
    try:
        return _TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(task_names())}") from None


def make_task(name: str, **kwargs) -> Task:
    """Build task ``name`` with its options, e.g. ``make_task("arithmetic", digits=2)``.

    An unknown name or option raises ValueError listing the valid ones.
    """
    cls = _lookup(name)
    valid = task_options(name)
    bad = sorted(set(kwargs) - set(valid))
    if bad:
        raise ValueError(
            f"task {name!r}: unknown option(s) {', '.join(bad)}; valid options: {', '.join(valid)}"
        )
    return cls(**kwargs)
