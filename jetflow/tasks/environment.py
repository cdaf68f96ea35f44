"""The user's environment for multi-turn rollouts: a class the model talks to turn by turn.

    task:
      name: custom
      params:
        env: my_env:GuessNumber          # module:Class or path/to/file.py:Class

    class GuessNumber:
        def __init__(self, row: dict): ...                      # one per conversation, with its data row
        def step(self, completion: str) -> tuple[str | None, float, bool]:
            ...                                                 # (observation, reward, done)

``step`` gets the model's latest turn as text and returns the observation (appended as the next user
message through the chat template, or as raw text without one; None ends the conversation), this turn's
reward (summed over the turns into the trajectory's reward, beside the reward functions') and whether the
conversation is over. ``step`` may be ``async def``.

An environment is the user's code that the run cannot do without: a constructor or a ``step`` that raises,
or a ``step`` that returns anything but that triple, ends the run in one line naming the class and the
row (EnvError, a RewardError: the run keeps the step's starting state in a checkpoint, and the same
command resumes once the class is fixed).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from typing import Any

from jetflow.tasks.rewards import RewardError, first_line, load_function


class EnvError(RewardError):
    """The user's environment class cannot be loaded, built or stepped, or returned the wrong shape."""


class Environment:
    """One conversation's environment: the user's object and where its errors point."""

    def __init__(self, spec: str, cls: type, row: dict, row_name: str):
        self.spec, self.row_name = spec, row_name
        try:
            self.env = cls(row)
        except Exception as e:
            raise EnvError(f"env {spec}: {cls.__name__}(row) raised {first_line(e)} on {row_name}") from None

    def step(self, completion: str) -> tuple[str | None, float, bool]:
        """The environment's answer to one model turn, checked."""
        try:
            out: Any = self.env.step(completion)
            if inspect.isawaitable(out):
                async def wait():
                    return await out
                out = asyncio.run(wait())
        except Exception as e:
            raise EnvError(f"env {self.spec}: step raised {first_line(e)} on {self.row_name}") from None
        if not (isinstance(out, tuple) and len(out) == 3):
            raise EnvError(f"env {self.spec}: step returned {type(out).__name__} {str(out)[:60]!r} on {self.row_name}; "
                           "it must return (observation: str | None, reward: float, done: bool)")
        observation, reward, done = out
        if observation is not None and not isinstance(observation, str):
            raise EnvError(f"env {self.spec}: step's observation is a {type(observation).__name__} on {self.row_name}; "
                           "it must be text or None")
        if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise EnvError(f"env {self.spec}: step's reward {reward!r} on {self.row_name} is not a finite number")
        if not isinstance(done, (bool, numbers.Integral)):
            raise EnvError(f"env {self.spec}: step's done {done!r} on {self.row_name} is not a bool")
        return observation, float(reward), bool(done)


def load_environment(spec: str) -> type:
    """The class task.params.env names, checked to have a ``step`` method."""
    try:
        cls = load_function(str(spec), key="task.params.env")
    except RewardError as e:
        raise EnvError(str(e).replace("reward ", "env ", 1)) from None
    if not inspect.isclass(cls):
        raise EnvError(f"env {spec}: {spec.rpartition(':')[2]} is a {type(cls).__name__}, not a class with "
                       "__init__(self, row) and step(self, completion)")
    if not callable(getattr(cls, "step", None)):
        raise EnvError(f"env {spec}: class {cls.__name__} has no step(self, completion) method")
    return cls
