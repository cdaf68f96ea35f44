"""Log-probabilities of chosen tokens: the one function the rollout engine and the trainer both call,
so that, given the same logits, both report the same bits (exact numerics relies on it).

    logp = token_logprobs(logits, tokens, temperature)   # logits (..., V), tokens (...) -> (...) fp32

log pi(a) = log_softmax(logits / temperature)[a] in fp32 (temperature 1: no division). torch's
log_softmax computes each row on its own (measured row-invariant for 1..333 rows, AVX-512 and AVX2).
"""

from __future__ import annotations

import torch
from torch import Tensor


def tempered(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """logits / temperature in fp32 (temperature 1: the logits as they are)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to scale logits (0 means greedy), got {temperature}")
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / temperature)[token] per position: logits (..., V), tokens (...) -> (...) fp32."""
    logp = torch.log_softmax(tempered(logits, temperature), dim=-1)  # (..., V)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def token_logprobs_and_entropy(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """`token_logprobs` (the same operations, differentiable) and the entropy of softmax(logits /
    temperature) at each position in nats (no gradient: a diagnostic), from one log_softmax."""
    logp = torch.log_softmax(tempered(logits, temperature), dim=-1)  # (..., V)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy_from_logp(logp)


@torch.no_grad()
def entropy_from_logp(logp: Tensor, rows_per_chunk: int = 32) -> Tensor:
    """-sum p log p over the last dim of log-probabilities (..., V) -> (...) fp32, `rows_per_chunk`
    positions at a time so the temporaries stay small: a 32 x 49152 chunk's 6 MB are reused from the
    heap, where 1024 rows' 200 MB are fresh pages each time (measured, 640 rows of SmolLM2's vocabulary,
    2 threads: 75 ms in chunks of 1024 rows, 14 ms in chunks of 32, the same bits)."""
    flat = logp.detach().reshape(-1, logp.shape[-1])  # (N, V)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logp.device)
    for i in range(0, flat.shape[0], rows_per_chunk):
        chunk = flat[i:i + rows_per_chunk]
        out[i:i + rows_per_chunk] = -(chunk.exp() * chunk).sum(-1)
    return out.reshape(logp.shape[:-1])
