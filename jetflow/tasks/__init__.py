"""Verifiable tasks for RL: problem generators / readers with exact verifiers.

``make_task(name, **options)`` builds one; ``task.problems(start, n)`` yields batches by position
and ``task.score(problem, completion)`` returns a Reward. This package imports nothing else of
jetflow.
"""

from jetflow.tasks.base import (
    Problem,
    Reward,
    Task,
    make_task,
    register_task,
    task_names,
    task_options,
)
from jetflow.tasks.arithmetic import ArithmeticTask
from jetflow.tasks.countdown import CountdownTask
from jetflow.tasks.math import MathTask

__all__ = [
    "ArithmeticTask",
    "CountdownTask",
    "MathTask",
    "Problem",
    "Reward",
    "Task",
    "make_task",
    "register_task",
    "task_names",
    "task_options",
]
