"""Verifiable tasks for RL: problem generators / readers with exact verifiers.

``make_task(name, **options)`` builds one; ``task.problems(start, n)`` yields batches by position
and ``task.score_batch(problems, completions)`` returns their Rewards. Built in: arithmetic and
countdown (generated), math (a data file, math-verify); ``custom`` is a researcher's own data file
and reward functions or reward models. This package imports nothing of jetflow but jetflow.errors.
"""

from jetflow.tasks.base import (
    Problem,
    Reward,
    Task,
    make_task,
    reward_part_means,
    register_task,
    task_names,
    task_options,
)
from jetflow.tasks.arithmetic import ArithmeticTask
from jetflow.tasks.countdown import CountdownTask
from jetflow.tasks.math import MathTask
from jetflow.tasks.custom import CustomTask
from jetflow.tasks.data import DataError, DataTask
from jetflow.tasks.rewards import RewardError

__all__ = [
    "ArithmeticTask",
    "CountdownTask",
    "CustomTask",
    "DataError",
    "DataTask",
    "MathTask",
    "Problem",
    "Reward",
    "RewardError",
    "Task",
    "make_task",
    "reward_part_means",
    "register_task",
    "task_names",
    "task_options",
]
