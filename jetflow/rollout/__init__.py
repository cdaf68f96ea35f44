"""Rollout: the native batched generator (KV cache, sampling, rollout log-probs).

Never imports `jetflow.train` (trainer and rollout meet in `jetflow.run.loop` / `jetflow.sync`)."""

from jetflow.rollout.engine import FINISH_REASONS, RolloutEngine, RolloutOutput
from jetflow.rollout.sampling import SamplingParams
from jetflow.rollout.sampling import filter_logits, greedy, sample, top_k_filter, top_p_filter

__all__ = [
    "FINISH_REASONS", "RolloutEngine", "RolloutOutput", "SamplingParams",
    "filter_logits", "greedy", "sample", "top_k_filter", "top_p_filter",
]
