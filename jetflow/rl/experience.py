"""One RL batch packed for the trainer (OpenRLHF's `Experience`, in our shapes).

B sequences; P = longest prompt, R = longest response. Prompts are left-padded and responses
right-padded, so every response starts at column P and the logits that predict response token r sit
at column P - 1 + r. Positions come from the attention mask, exactly as in the rollout engine.

A multi-turn trajectory is one sequence too: its response holds the model's turns and the observations
between them (tool results, environment answers) as the engine appended them; `response_mask` is 1 on
the model's tokens only, so the loss, the mismatch metrics and the corrections count those, and an
observation token's rollout log-prob (0.0) is never read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor


@dataclass
class Experience:
    input_ids: Tensor  # (B, P + R) left-padded prompt, then right-padded response
    attention_mask: Tensor  # (B, P + R) bool, True on real tokens
    response_ids: Tensor  # (B, R) sampled tokens a_t (pad after the end)
    response_mask: Tensor  # (B, R) float, 1 on the tokens the model sampled (0 on padding and observations)
    rollout_logprobs: Tensor  # (B, R) log pi_rollout(a_t | s_t), from the rollout engine
    rewards: Tensor  # (B,)
    advantages: Tensor  # (B,)
    prompt_len: int  # P
    old_logprobs: Tensor | None = None  # (B, R) log pi_trainer(a_t | s_t) under the rollout's weights
    is_weights: Tensor | None = None  # (B, R) rollout-correction weights (detached)
    ref_logprobs: Tensor | None = None  # (B, R) log pi_ref(a_t | s_t) of the reference policy (a KL penalty)
    routed_experts: Tensor | None = None  # (B, P + R, L_moe, K) routing replay: the rollout's expert ids, -1 elsewhere

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: slice | Tensor) -> "Experience":
        """Rows of the batch (a micro-batch); the prompt length stays P."""
        values: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            values[f.name] = v[index] if isinstance(v, Tensor) else v
        return Experience(**values)

    def micro_batches(self, size: int) -> list["Experience"]:
        return [self.select(slice(i, i + size)) for i in range(0, self.batch_size, size)]


def pack_experience(prompts: list[list[int]], responses: list[list[int]], rollout_logprobs: list[list[float]],
                    rewards: Tensor, advantages: Tensor, pad_id: int, device: torch.device | str = "cpu",
                    routed_experts: list[Tensor] | None = None,
                    token_masks: list[list[int]] | None = None) -> Experience:
    """Build an Experience from per-sequence token lists (one response per prompt entry).

    token_masks: multi-turn responses, per sequence 1 on each token the model sampled and 0 on each
    observation token (the response mask); None: every response token is the model's.

    routed_experts: per sequence the rollout's expert ids at its first positions, (n, L_moe, K) with
    n <= len(prompt) + len(response) (`RolloutOutput.routed_experts`), placed at the same columns as
    the tokens; the trainer replays them."""
    if not (len(prompts) == len(responses) == len(rollout_logprobs) == len(rewards) == len(advantages)):
        raise ValueError("pack_experience: prompts, responses, logprobs, rewards and advantages differ in length")
    for i, (resp, lps) in enumerate(zip(responses, rollout_logprobs)):
        if len(resp) != len(lps) or (token_masks is not None and len(token_masks[i]) != len(resp)):
            raise ValueError(f"sequence {i}: {len(resp)} response tokens but {len(lps)} logprobs"
                             + ("" if token_masks is None else f" and {len(token_masks[i])} mask entries"))
    B = len(prompts)
    P = max(len(p) for p in prompts)
    R = max(1, max(len(r) for r in responses))
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, P + R, dtype=torch.bool)
    response_ids = torch.full((B, R), pad_id, dtype=torch.long)
    response_mask = torch.zeros(B, R)
    logprobs = torch.zeros(B, R)
    for i, (prompt, resp, lps) in enumerate(zip(prompts, responses, rollout_logprobs)):
        input_ids[i, P - len(prompt):P] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[i, P - len(prompt):P + len(resp)] = True
        if resp:
            input_ids[i, P:P + len(resp)] = torch.tensor(resp, dtype=torch.long)
            response_ids[i, :len(resp)] = torch.tensor(resp, dtype=torch.long)
            response_mask[i, :len(resp)] = 1.0 if token_masks is None else torch.tensor(token_masks[i], dtype=torch.float32)
            logprobs[i, :len(resp)] = torch.tensor(lps, dtype=torch.float32)
    dev = torch.device(device)
    exp = Experience(input_ids.to(dev), attention_mask.to(dev), response_ids.to(dev), response_mask.to(dev),
                     logprobs.to(dev), rewards.float().to(dev), advantages.float().to(dev), P)
    if routed_experts is not None:
        exp.routed_experts = _pack_routing(prompts, responses, routed_experts, P, R).to(dev)
    return exp


def _pack_routing(prompts: list[list[int]], responses: list[list[int]], routing: list[Tensor], P: int,
                  R: int) -> Tensor:
    """Per-sequence expert ids (n, L, K) -> (B, P + R, L, K) long at the tokens' columns, -1 elsewhere."""
    if len(routing) != len(prompts):
        raise ValueError(f"pack_experience: {len(routing)} routing records for {len(prompts)} sequences")
    L, K = routing[0].shape[1:]
    out = torch.full((len(prompts), P + R, L, K), -1, dtype=torch.long)
    for i, (prompt, resp, ids) in enumerate(zip(prompts, responses, routing)):
        if ids.shape[0] > len(prompt) + len(resp) or tuple(ids.shape[1:]) != (L, K):
            raise ValueError(f"sequence {i}: routing record {tuple(ids.shape)} does not fit its "
                             f"{len(prompt) + len(resp)} tokens and ({L}, {K})")
        start = P - len(prompt)
        out[i, start:start + ids.shape[0]] = ids.long()
    return out
