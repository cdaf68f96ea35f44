"""A researcher's own task: their data file and their reward functions (``task.name=custom``).

    task:
      name: custom
      params:
        path: data.jsonl            # .jsonl, .parquet, or a datasets save_to_disk directory
        prompt_key: prompt          # text, or a list of {"role", "content"} chat messages
        answer_key: answer          # optional: the reference answer (the supervised warm-up's target)
        reward: [my_rewards:exact, rewards/style.py:short]   # module:function or file.py:function
        reward_weights: [1.0, 0.2]
        # a reward model: reward: [model:path/to/rm, ...]; reward_model_dtype: float32 | bfloat16
        tools: [my_tools:multiply]  # multi-turn (rollout.max_turns > 1): functions the model may call
        env: my_env:GuessNumber     # or an environment that answers each turn (reward optional then)

The rows and their errors: jetflow.tasks.data. The reward functions, their signature and their
errors: jetflow.tasks.rewards; reward models (``model:DIR``): jetflow.tasks.reward_model. A completion's
reward is the weighted sum of the functions' values, a function's None left out (TRL's convention; a
completion no reward scores is an error naming its row); ``correct`` (reward/accuracy, eval/pass@1) when
that sum reaches ``pass_threshold``. Each function's own mean over the completions it scored is logged
as reward/fn/<name>.

Multi-turn (jetflow.rollout.conversation): the tools (jetflow.tasks.tools) and the environment class
(jetflow.tasks.environment, built per conversation with the data row) are loaded here, with the rewards.
A conversation's completion, as the reward functions get it, is its messages after the prompt (assistant,
tool and user messages, as TRL gives a conversational completion), or its text for a raw-text prompt; the
environment's rewards, summed over the turns, are added to the functions' weighted sum (reward/fn/env).
"""

from __future__ import annotations

import math
from pathlib import Path

from jetflow.tasks.base import Problem, Reward, register_task
from jetflow.tasks.data import DataError, DataTask, field, read_rows
from jetflow.tasks.environment import load_environment
from jetflow.tasks.reward_model import DEFAULT_DTYPE, RewardModel
from jetflow.tasks.rewards import RewardError, Scorer, load_rewards, weighted_sum
from jetflow.tasks.tools import load_tools

COLUMNS = "columns"  # Problem.meta key of the row's other columns


def _check_prompt(value: object, where: str, key: str) -> str | list[dict]:
    """Text, or a non-empty list of {"role": str, "content": str} messages."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: empty prompt in field {key!r}")
        return value
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(f"{where}: the prompt field {key!r} holds {type(value).__name__} {str(value)[:60]!r}; expected "
                    'text or a list of {"role": ..., "content": ...} chat messages')


@register_task
class CustomTask(DataTask):
    """Prompts from ``path``, scored by the user's reward functions (see the module docstring).

    path: the data file. prompt_key: the field holding the prompt. answer_key: the field holding the
    reference answer, or None. reward: one function spec or a list (optional with an environment).
    reward_weights: one weight per function (default 1 each). pass_threshold: the weighted reward that
    counts as correct. split: the split of a DatasetDict directory. tools: functions the model may call
    (module:function or file.py:function). env: an environment class (module:Class or file.py:Class).
    reward_model_dtype / reward_model_batch_size: how the ``model:DIR`` rewards score (float32 or bfloat16;
    completions a forward).
    """

    name = "custom"

    def __init__(
        self,
        path: str,
        reward: str | list[str] | None = None,
        prompt_key: str = "prompt",
        answer_key: str | None = None,
        reward_weights: list[float] | None = None,
        pass_threshold: float = 1.0,
        split: str = "train",
        tools: str | list[str] | None = None,
        env: str | None = None,
        seed: int = 0,
        format_weight: float = 0.0,
        reward_model_dtype: str = DEFAULT_DTYPE,
        reward_model_batch_size: int = 16,
    ):
        super().__init__(seed=seed, format_weight=format_weight)
        if format_weight:
            raise ValueError(f"custom: task.format_weight={format_weight} has no meaning here; weigh your own format "
                             "reward with task.params.reward_weights")
        if not (isinstance(pass_threshold, (int, float)) and math.isfinite(pass_threshold)):
            raise ValueError(f"custom: pass_threshold must be a finite number, got {pass_threshold!r}")
        self.path, self.prompt_key, self.answer_key = Path(path), prompt_key, answer_key
        self.pass_threshold = float(pass_threshold)
        rows = read_rows(self.path, split)
        # every field but the prompt reaches the rewards (a row without one gets None, as in datasets)
        self.columns = [k for k in dict.fromkeys(k for _, row in rows for k in row) if k != prompt_key]
        self._set_rows([(number, self._row_problem(number, row)) for number, row in rows])
        self.tools = load_tools(tools)
        self.env, self.env_class = env, (load_environment(env) if env else None)
        def reward_model(spec: str, weight: float) -> RewardModel:
            return RewardModel(spec, weight, reward_model_dtype, reward_model_batch_size)

        self.rewards: list[Scorer] = [] if (reward is None and env) else load_rewards(
            reward or [], reward_weights, self.columns, reward_model)
        names = [f.name for f in self.rewards]  # the logs' reward/fn/<name>: the spec where two share a name
        self.part_names = [f.name if names.count(f.name) == 1 else f.spec for f in self.rewards]

    def _row_problem(self, number: int, row: dict) -> Problem:
        where = f"{self.path}: row {number}"
        prompt = _check_prompt(field(self.path, number, row, self.prompt_key, "prompt_key"), where, self.prompt_key)
        answer = ""
        if self.answer_key is not None:
            value = field(self.path, number, row, self.answer_key, "answer_key")
            answer = "" if value is None else str(value)
        columns = {k: row.get(k) for k in self.columns}
        return Problem(prompt, answer, {"path": str(self.path), "row": number, COLUMNS: columns})

    def row_name(self, problem: Problem) -> str:
        return f"row {problem.meta['row']} of {self.path}"

    def row_of(self, problem: Problem) -> tuple[dict, str]:
        """The data row an environment is built with (every field, the prompt's too) and its name."""
        return {self.prompt_key: problem.prompt, **problem.meta[COLUMNS]}, self.row_name(problem)

    def score(self, problem: Problem, completion: str) -> Reward:
        return self.score_batch([problem], [completion])[0]

    def score_batch(self, problems: list[Problem], completions: list, env_rewards: list[float] | None = None
                    ) -> list[Reward]:
        """Each reward function once over the batch (TRL's calling convention), then the weighted sum, plus
        each conversation's environment rewards. A completion is text, or (a conversation) its messages."""
        prompts = [p.prompt for p in problems]
        shaped = [c if isinstance(p.prompt, str) or isinstance(c, list) else [{"role": "assistant", "content": c}]
                  for p, c in zip(problems, completions, strict=True)]
        columns = {k: [p.meta[COLUMNS][k] for p in problems] for k in self.columns}
        rows = [self.row_name(p) for p in problems]
        values = [f(prompts, shaped, columns, rows) for f in self.rewards]
        weights = [f.weight for f in self.rewards]
        rewards = []
        for i in range(len(problems)):
            parts = {name: value for name, v in zip(self.part_names, values) if (value := v[i]) is not None}
            total = weighted_sum([v[i] for v in values], weights)
            if self.env_class is not None:
                env = env_rewards[i] if env_rewards is not None else 0.0
                parts["env"], total = env, (total or 0.0) + env
            if total is None:
                raise RewardError(f"every reward returned None for the completion of {rows[i]} "
                                  f"({', '.join(f.spec for f in self.rewards)}): at least one must score each "
                                  "completion")
            rewards.append(Reward(total, total >= self.pass_threshold, False, parts))
        return rewards
