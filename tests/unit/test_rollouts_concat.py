"""Rollouts.concat, the one join of several generate() calls' batches (the RL loop's dynamic-sampling rounds,
the Ray placement's per-engine chunks): every per-request field, in order; a field no part has stays None."""

import torch

from jetflow.rollout.types import Rollouts


def part(first: int, n: int, turns: bool) -> Rollouts:
    rows = range(first, first + n)
    return Rollouts(token_ids=[[i, i + 1] for i in rows], logprobs=[[-0.5 * i, -1.0] for i in rows],
                    texts=[f"t{i}" for i in rows], finish_reasons=["eos" if i % 2 else "length" for i in rows],
                    weight_version=3, routed_experts=[torch.full((2, 1, 1), i) for i in rows],
                    token_masks=[[1, 0]] * n if turns else None, completions=[f"c{i}" for i in rows] if turns else None,
                    env_rewards=[float(i) for i in rows] if turns else None,
                    turn_stats=[{"turns": float(i)} for i in rows] if turns else None)


def test_concat_joins_every_per_request_field_in_order():
    for turns in (False, True):
        whole = part(0, 5, turns)
        joined = Rollouts.concat([whole.select([0, 1]), whole.select([2]), whole.select([3, 4])])
        for name in ("token_ids", "logprobs", "texts", "finish_reasons", "token_masks", "completions", "env_rewards",
                     "turn_stats"):
            assert getattr(joined, name) == getattr(whole, name), name
        assert all(torch.equal(a, b) for a, b in zip(joined.routed_experts, whole.routed_experts))
        assert joined.weight_version == 3
