"""The exactness check the LoRA tests share: a rollout's sampled tokens' log-probs against the trainer's
recomputation of the same tokens, `torch.equal` (the native engine and the vLLM plugin alike)."""

from __future__ import annotations

import torch

from jetflow.rl.experience import pack_experience
from jetflow.run.loop import request_seed


def assert_rollout_logprobs_equal_the_trainers(side, rollout, cfg) -> list[list[int]]:
    """Sample 6 held-out-range problems on `rollout` (seeded requests) and check that the trainer of `side`
    (a jetflow.run.sides.TrainerSide) recomputes every response token's log-prob bit for bit; the prompts."""
    problems = side.task.problems(1000, 6, cfg.run.seed)
    prompts = [side.encode(p) for p in problems]
    out = rollout.generate(prompts, [request_seed(cfg.run.seed, 99, i) for i in range(len(prompts))])
    zeros = torch.zeros(len(prompts))
    exp = pack_experience(prompts, out.token_ids, out.logprobs, zeros, zeros, side.tokenizer.pad_token_id, "cpu")
    trainer_lp = side.trainer.compute_logprobs(exp, cfg.rollout.temperature)  # (B, T)
    mask = exp.response_mask > 0
    assert int(mask.sum()) > 0
    assert torch.equal(exp.rollout_logprobs[mask], trainer_lp[mask])
    return prompts
