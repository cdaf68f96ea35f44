"""The user's own reward functions: found by name, called in batches, and what they return checked.

A reward function has the signature of TRL's ``reward_funcs``::

    def my_reward(prompts, completions, **columns) -> list[float]

``prompts[i]`` is the prompt as the data file holds it (text, or a list of chat messages),
``completions[i]`` the generated text (for a chat prompt, TRL's ``[{"role": "assistant", "content":
text}]``), and every other column of the data file arrives as a keyword list aligned with them
(``columns["answer"][i]``), everything by keyword as TRL passes it (a function may leave out the
prompts: ``def f(completions, answer, **kwargs)``). An ``async def`` function is run with asyncio. It is named in
``task.params.reward`` as ``module:function`` (importable from the current directory) or
``path/to/file.py:function``.

A function may return ``None`` for a completion it does not apply to (TRL's convention for multi-task
data): that completion's reward is the weighted sum of the other functions' values, the function's logged
mean leaves it out, and a completion that no function (and no environment) scores is an error naming its
row. A local Hugging Face sequence-classification model scores as a function does: ``model:DIR``
(jetflow.tasks.reward_model).

Anything wrong is one line (RewardError) naming the function and, once it runs, the data row: an
import that fails, a signature that cannot take the call, an exception (the row is found by calling
the function again on one completion at a time), a result of the wrong length, a value that is not a
finite number.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from jetflow.errors import UserError

SIGNATURE = "def {name}(prompts, completions, **kwargs)"


class RewardError(UserError, ValueError):
    """A reward function of the user's cannot be loaded, cannot be called, or returned a bad value."""


def first_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@contextmanager
def _on_path(directory: str):
    """``directory`` first on sys.path while importing (a user's module beside their data)."""
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        if directory in sys.path:
            sys.path.remove(directory)


def load_function(spec: str, key: str = "task.params.reward") -> Callable:
    """The function ``spec`` names: ``module:function`` or ``path/to/file.py:function`` (``key``: the config
    key that names it, for the error)."""
    where, sep, name = str(spec).rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise RewardError(f"{key}={spec!r}: expected module:function or path/to/file.py:function")
    try:
        if where.endswith(".py"):
            module = _import_file(Path(where), spec)
        else:
            with _on_path(os.getcwd()):
                module = importlib.import_module(where)
    except RewardError:
        raise
    except BaseException as e:  # SyntaxError, ImportError, anything the module raises at import (SystemExit too)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise RewardError(f"reward {spec}: importing {where} failed ({first_line(e)})") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise RewardError(f"reward {spec}: {where} has no function {name!r}")
    if not callable(fn):
        raise RewardError(f"reward {spec}: {where}.{name} is a {type(fn).__name__}, not a function")
    return fn


def _import_file(path: Path, spec: str):
    if not path.is_file():
        raise RewardError(f"reward {spec}: no file {path} (a path is read from the current directory, {os.getcwd()})")
    resolved = path.resolve()
    # one module per file, whatever its name: two reward files may both be called rewards.py
    module_name = f"jetflow_reward_{hashlib.sha1(str(resolved).encode()).hexdigest()[:10]}_{path.stem}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    file_spec = importlib.util.spec_from_file_location(module_name, resolved)
    assert file_spec is not None and file_spec.loader is not None, resolved  # a .py path always has a loader
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up there
    try:
        with _on_path(str(resolved.parent)):  # its sibling modules import
            file_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


class Scorer(Protocol):
    """What the custom task calls for each of its rewards: a RewardFunction, or a RewardModel."""

    spec: str
    weight: float

    @property
    def name(self) -> str: ...

    def check_signature(self, columns: list[str]) -> None: ...

    def __call__(self, prompts: list, completions: list, columns: dict[str, list], rows: list[str]
                 ) -> list[float | None]: ...


@dataclass
class RewardFunction:
    """One reward function of the task, with its weight. ``spec``: as task.params.reward names it."""

    spec: str
    fn: Callable
    weight: float = 1.0

    @property
    def name(self) -> str:
        return self.spec.rpartition(":")[2]

    def check_signature(self, columns: list[str]) -> None:
        """The function can be called as ``fn(prompts, completions, **columns)``."""
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):  # a builtin without a signature: its first call tells
            return
        try:
            sig.bind(prompts=[], completions=[], **{c: [] for c in columns})
        except TypeError as e:
            cols = ", ".join(columns) or "none"
            raise RewardError(f"reward {self.spec}: its signature {self.name}{sig} cannot take (prompts=, completions=, "
                              f"**columns) with the data's columns ({cols}): {e}; write it as "
                              f"{SIGNATURE.format(name=self.name)}") from None

    def __call__(self, prompts: list, completions: list, columns: dict[str, list], rows: list[str]
                 ) -> list[float | None]:
        """The function's values for a batch, each a finite number or None (the function does not apply);
        ``rows[i]`` names completion i's data row for the error messages."""
        try:
            out = _invoke(self.fn, prompts, completions, columns)
        except Exception as e:
            raise RewardError(self._raised(e, prompts, completions, columns, rows)) from None
        if hasattr(out, "tolist"):  # a numpy array or a torch tensor
            out = out.tolist()
        if not isinstance(out, (list, tuple)):
            raise RewardError(f"reward {self.spec} returned a {type(out).__name__} for the batch of {_some(rows)}; it "
                              f"must return a list of floats, one per completion")
        if len(out) != len(completions):
            raise RewardError(f"reward {self.spec} returned {len(out)} values for {len(completions)} completions "
                              f"(the batch of {_some(rows)}); it must return one float per completion")
        return checked_values(self.spec, list(out), rows)

    def _raised(self, e: Exception, prompts, completions, columns, rows) -> str:
        """The error message for an exception: the first row whose completion alone raises too."""
        for i in range(len(completions)):
            try:
                _invoke(self.fn, prompts[i:i + 1], completions[i:i + 1], {k: v[i:i + 1] for k, v in columns.items()})
            except Exception as single:
                return f"reward {self.spec} raised {first_line(single)} on {rows[i]}"
        return f"reward {self.spec} raised {first_line(e)} on the batch of {_some(rows)} (each row alone passes)"


def checked_values(spec: str, out: list, rows: list[str]) -> list[float | None]:
    """A reward's values as floats, None kept (TRL's "does not apply"); anything else that is not a finite
    number is a RewardError naming the row."""
    values: list[float | None] = []
    for value, row in zip(out, rows):
        if value is None:
            values.append(None)
            continue
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(f"reward {spec} returned {value!r} for the completion of {row}; every value must be a "
                              "finite number (or None where the reward does not apply)")
        values.append(float(value))
    return values


def weighted_sum(values: list[float | None], weights: list[float]) -> float | None:
    """TRL's total of one completion: the weighted sum of the values that are not None (None where every
    value is None)."""
    present = [w * v for v, w in zip(values, weights) if v is not None]
    return sum(present) if present else None


def _invoke(fn: Callable, prompts, completions, columns):
    out = fn(prompts=prompts, completions=completions, **columns)  # by keyword, as TRL calls them
    if inspect.isawaitable(out):  # an async def (or a function that returns a coroutine)
        out = _run(out)
    return out


def _run(awaitable):
    async def wait():
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # the usual case: no event loop in this thread
        return asyncio.run(wait())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from inside a running loop (a notebook)
        return pool.submit(asyncio.run, wait()).result()


def _some(rows: list[str], n: int = 4) -> str:
    unique = list(dict.fromkeys(rows))
    more = f" and {len(unique) - n} more" if len(unique) > n else ""
    return ", ".join(unique[:n]) + more


MODEL_PREFIX = "model:"
"""A task.params.reward entry that names a reward model's directory (jetflow.tasks.reward_model)."""


def is_reward_model(spec: object) -> bool:
    """True for a ``task.params.reward`` entry that names a reward model (``model:DIR``)."""
    return isinstance(spec, str) and spec.startswith(MODEL_PREFIX)


def load_rewards(specs: str | list[str], weights: list[float] | None, columns: list[str],
                 reward_model: Callable[[str, float], Scorer] | None = None) -> list[Scorer]:
    """task.params.reward and reward_weights as RewardFunctions, each imported and its signature checked;
    a ``model:DIR`` entry is what ``reward_model(spec, weight)`` builds (a RewardModel)."""
    specs = [specs] if isinstance(specs, str) else list(specs or [])
    if not specs:
        raise RewardError("task.params.reward: name at least one reward function (module:function or "
                          "path/to/file.py:function) or reward model (model:DIR)")
    if weights is None:
        weights = [1.0] * len(specs)
    if isinstance(weights, (int, float)) or len(weights) != len(specs):
        raise RewardError(f"task.params.reward_weights={weights!r}: give one weight per reward function "
                          f"({len(specs)}: {', '.join(map(str, specs))})")
    if not all(isinstance(w, numbers.Real) and math.isfinite(w) for w in weights):
        raise RewardError(f"task.params.reward_weights={weights!r}: every weight must be a finite number")
    if reward_model is None and any(is_reward_model(s) for s in specs):
        raise RewardError("task.params.reward: a reward model (model:DIR) is taken by the custom task only")
    functions: list[Scorer] = [reward_model(str(s), float(w)) if is_reward_model(s) and reward_model is not None
                 else RewardFunction(str(s), load_function(s), float(w)) for s, w in zip(specs, weights)]
    for f in functions:
        f.check_signature(columns)
    return functions
