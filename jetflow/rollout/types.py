"""What a rollout engine hands the RL loop, and what the loop asks of an engine.

Every engine (jetflow's native one, vLLM, a Ray group of either) implements `RolloutEngineSide` and
returns `Rollouts`; the loop depends on these two names only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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


class RolloutEngineSide(Protocol):
    """A rollout engine as the loop sees it: weights in (verified against the recipe), samples out."""
    weight_version: int

    def load_weights(self, update: WeightUpdate) -> None: ...

    def generate(self, prompts: list[list[int]], seeds: list[int], greedy: bool = False) -> Rollouts:
        """Sample each prompt once with its seed (`greedy`: argmax, for evaluation)."""
