"""Log-probs (and entropy) of chosen tokens through the lm_head a chunk of positions at a time, so the
(tokens x vocab) logits never exist whole, neither in the forward nor in the backward.

    logp = chunked_token_logprobs(model.lm_head, hidden, tokens, temperature, chunk_tokens=1024)
    logp, entropy = chunked_token_logprobs(..., with_entropy=True)     # hidden (..., C) -> (...) each
    logp = chunked_token_logprobs(model.lm_head, hidden, tokens, temperature, chunk_tokens=0)  # one chunk

The trainer computes every log-prob through this function, chunking on (train.logprob_chunk_tokens > 0)
or off (0: all positions in one forward chunk), so that both settings are one computation.

Forward: for each chunk of `chunk_tokens` positions, the head module itself (a plain nn.Linear or a
jetflow precision linear: called, never `F.linear` on its weight) and `token_logprobs` /
`token_logprobs_and_entropy` of jetflow.model.logprobs, the rollout engine's functions: only the chunk's
logits (chunk, V) live at a time. Backward: whatever the forward's chunk, the positions are regrouped
into fixed groups of GROUP positions; each group's logits are recomputed with grad enabled and that group
alone is backpropagated, its hidden-state gradient written into its rows, the head's parameter gradients
summed over the groups in group order.

Why fixed groups: the head's weight gradient (and a tied embedding's, which includes it) is a sum over
positions. Summed per forward chunk, its rounding would follow the chunk setting (and under the bf16
kind each call's wgrad is rounded to bf16 before the sum); summed over groups that depend only on the
number of positions, it is the same bits with chunking on, off or at any chunk size.

What is equal across chunk settings (tests/unit/test_chunked_logprobs.py, fp32 / bf16 / unified):
- exact numerics: the log-probs and entropies, bit for bit (the canonical GEMM computes a row from that
  row alone; log_softmax is row-local); every gradient, the head's included (the backward above does not
  read the chunk); so the updated weights after a train step.
- fast numerics: the same structure, but the forward's logits come from BLAS, whose rows match across
  calls of >= 12 rows on the machines measured (FACTS), not by construction: equal where that holds. The
  backward is the same groups in both settings (the hidden-state gradient's rows come from BLAS calls of
  >= MIN_ROWS rows).
Cost: the backward recomputes the head's forward (one more (N, C) x (C, V) GEMM and log_softmax), also
with chunking off; in exchange no (N, V) logits or logit gradient are kept.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from jetflow.model.logprobs import token_logprobs, token_logprobs_and_entropy


MIN_ROWS = 16
"""The fewest rows a chunk sends through the head: BLAS (the fp32 / bf16 backward's dgrad, fast numerics'
forward) computes a row differently in calls of fewer than 12 rows (FACTS; 16 as in the exact GEMM)."""

GROUP = 256
"""Positions per backward group (the last one shorter, borrowing earlier rows with zero output gradient
up to MIN_ROWS: zeros add exactly): the head's parameter gradients are summed over these groups in order,
whatever the forward's chunk, so that sum's rounding does not depend on the chunk setting. 256 rows keep
a group's logits at 256 x V fp32 (48 MiB for a 49152 vocabulary), twice over in log_softmax's backward."""


def chunk_spans(n: int, chunk: int):
    """(lo, i, j) per chunk of n rows: rows [i, j) are the chunk's, computed in a call over rows [lo, j),
    lo <= i, so that each call has max(chunk, MIN_ROWS) rows, or n when fewer (a short last chunk
    takes real rows before it along, whose results are dropped)."""
    size = max(chunk, MIN_ROWS)
    for i in range(0, n, size):
        j = min(i + size, n)
        yield max(0, min(i, j - MIN_ROWS)), i, j


class _ChunkedLogprobs(torch.autograd.Function):
    """(h (N, C), tokens (N,)) -> (logp (N,), entropy (N,) or empty); parameters of `head` as trailing
    inputs so autograd hands their gradients back."""

    @staticmethod
    def forward(ctx, h, tokens, head, temperature, chunk, with_entropy, *params):
        N = h.shape[0]
        logp = torch.empty(N, dtype=torch.float32, device=h.device)  # (N,)
        entropy = torch.empty(N if with_entropy else 0, dtype=torch.float32, device=h.device)
        for lo, i, j in chunk_spans(N, chunk):
            logits = head(h[lo:j])[i - lo:]  # (j - i, V): the only logits alive
            if with_entropy:
                logp[i:j], entropy[i:j] = token_logprobs_and_entropy(logits, tokens[i:j], temperature)
            else:
                logp[i:j] = token_logprobs(logits, tokens[i:j], temperature)
            del logits
        ctx.save_for_backward(h, tokens)
        ctx.head, ctx.temperature = head, temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        h, tokens = ctx.saved_tensors
        params = [p for p in ctx.head.parameters() if p.requires_grad]
        want_h = ctx.needs_input_grad[0]
        grad_h = torch.zeros_like(h) if want_h else None  # (N, C)
        grads: list[Tensor | None] = [None] * len(params)
        for lo, i, j in chunk_spans(h.shape[0], GROUP):  # fixed groups, not the forward's chunks
            grad = torch.zeros(j - lo, dtype=grad_logp.dtype, device=grad_logp.device)  # (c,): 0 on rows < i
            grad[i - lo:] = grad_logp[i:j]
            with torch.enable_grad():
                hc = h[lo:j].detach().requires_grad_(want_h)  # (c, C)
                logp = token_logprobs(ctx.head(hc), tokens[lo:j], ctx.temperature)  # (c,)
                inputs = ([hc] if want_h else []) + params
                got = torch.autograd.grad(logp, inputs, grad, allow_unused=True)
            if want_h:
                grad_h[i:j] = got[0][i - lo:]
                got = got[1:]
            for k, g in enumerate(got):  # in group order
                if g is not None:
                    grads[k] = g if grads[k] is None else grads[k] + g
        return (grad_h, None, None, None, None, None, *grads)


def chunked_token_logprobs(head: nn.Module, hidden: Tensor, tokens: Tensor, temperature: float = 1.0,
                           chunk_tokens: int = 1024, with_entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """log_softmax(head(hidden) / temperature)[tokens]: hidden (..., C), tokens (...) -> (...) fp32,
    `chunk_tokens` positions through `head` at a time (0: all of them at once); with `with_entropy`, also
    the entropy (...) in nats, detached. Differentiable in hidden and in the head's parameters, the same
    gradients whatever `chunk_tokens` (see the module docstring)."""
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0 (0: one chunk), got {chunk_tokens}")
    shape = tokens.shape
    h = hidden.reshape(-1, hidden.shape[-1])  # (N, C)
    chunk_tokens = chunk_tokens or h.shape[0]
    params = [p for p in head.parameters() if p.requires_grad]
    logp, entropy = _ChunkedLogprobs.apply(h, tokens.reshape(-1), head, temperature, chunk_tokens,
                                           with_entropy, *params)  # (N,), (N,) or (0,)
    if with_entropy:
        return logp.reshape(shape), entropy.reshape(shape)
    return logp.reshape(shape)
