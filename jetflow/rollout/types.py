"""What a rollout engine hands the RL loop, and what the loop asks of an engine.

Every engine (jetflow's native one, vLLM, a Ray group of either) implements `RolloutEngineSide` and
returns `Rollouts`; the loop depends on these two names only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from jetflow.sync import WeightUpdate


@dataclass
class Rollouts:
    token_ids: list[list[int]]  # generated tokens per request
    logprobs: list[list[float]]  # log pi_rollout of each generated token
    texts: list[str]
    finish_reasons: list[str]
    weight_version: int  # the weights every request was sampled with
    routed_experts: list[torch.Tensor] | None = None  # routing replay: (positions, L_moe, K) per request
    # multi-turn conversations (rollout.max_turns > 1; None for one turn): token_ids then hold every token after
    # the prompt, the model's and the observations', and logprobs 0.0 at the observations'
    token_masks: list[list[int]] | None = None  # 1 on a token the model sampled, 0 on an observation's
    completions: list | None = None  # what the reward functions get: the messages after the prompt (or the text)
    env_rewards: list[float] | None = None  # the environment's rewards, summed over each conversation's turns
    turn_stats: list[dict[str, float]] | None = None  # per conversation: turns, tool_calls, tool_errors, retokenize_differs
    # the weight version that sampled each generated token (None: every token weight_version's, as an engine that
    # does not tag them says); an in-flight update (rollout.inflight_updates) gives a request two
    token_versions: list[list[int]] | None = None

    def select(self, rows: list[int]) -> "Rollouts":
        """The requests `rows`, in that order."""
        def pick(xs: list | None) -> Any:
            return None if xs is None else [xs[i] for i in rows]
        return Rollouts(pick(self.token_ids), pick(self.logprobs), pick(self.texts), pick(self.finish_reasons),
                        self.weight_version, pick(self.routed_experts), pick(self.token_masks), pick(self.completions),
                        pick(self.env_rewards), pick(self.turn_stats), pick(self.token_versions))

    @staticmethod
    def concat(parts: list["Rollouts"]) -> "Rollouts":
        """One batch of several generate() calls' requests (one weight version: the first's)."""
        def join(name: str) -> Any:
            return None if getattr(parts[0], name) is None else [x for p in parts for x in getattr(p, name)]
        return Rollouts(join("token_ids"), join("logprobs"), join("texts"), join("finish_reasons"),
                        parts[0].weight_version, join("routed_experts"), join("token_masks"), join("completions"),
                        join("env_rewards"), join("turn_stats"), join("token_versions"))


class RolloutEngineSide(Protocol):
    """A rollout engine as the loop sees it: weights in (verified against the recipe), samples out."""
    weight_version: int

    def load_weights(self, update: WeightUpdate) -> None: ...

    def generate(self, prompts: list[list[int]], seeds: list[int], greedy: bool = False,
                 problems: list | None = None) -> Rollouts:
        """Sample each prompt once with its seed (`greedy`: argmax, for evaluation). `problems` (one per
        prompt): a multi-turn run's problems, whose conversations the engine's driver holds."""
