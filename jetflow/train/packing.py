"""Sequence packing (train.max_tokens_per_micro_batch): each micro-batch is one row of whole sequences
(prompt + response) side by side without padding, up to a token budget, so no padding is computed.

    micro = micro_batches(exp, cfg.train)          # PackedBatch rows, or exp's padded micro-batches
    logp = packed_response_logprobs(model, mb, ...)  # (b, R) in mb's padded layout, 0 on padding

Grouping: next-fit in batch order (a sequence joins the current row while the row stays within the
budget, else opens the next row; one longer than the budget has a row to itself). The sequences keep the
batch order across micro-batches, so the trainer's per-micro-batch results concatenate back into the
batch's (B, R) as with padded micro-batches, and the loss terms are added in the same sequence order.

Each PackedBatch is also an Experience of its own sequences in the padded layout (`Experience.select`):
the policy loss, its `algo.loss_agg` denominators and the micro-batch weights read those (B, R) masks
unchanged, so the loss means exactly what it means unpacked. Only the forward differs: the packed row
through `Decoder.forward_packed` (each sequence at its own positions 0..n-1, attending to itself alone,
its KV blocks starting at its first token), and the lm_head on the response positions only.

What is the same bits under exact numerics (tests/unit/test_sequence_packing.py): every log-prob and
entropy, against any padded forward (the canonical GEMMs, norms and RoPE are row-local; attention runs per
sequence with the kernel the padded forward calls). The gradients and updated weights are the same bits
as the padded step's *on packing's grid* (`use_packing_grid`, which the Trainer turns on with packing under
exact numerics; the test runs the padded step on it too), for micro-batches holding the same sequences.
Gradients are sums over tokens, and the grid makes both layouts sum alike:
- every exact weight gradient (linears, RMSNorm weights) sums tokens in one order, 128-token blocks each a
  chain from 0, the blocks added in order (`invariant.weight_grad`; the FP8 wgrad already did), in which a
  token with a zero output gradient (padding) adds exact zeros;
- each sequence starts on a 128-token boundary (GRAD_BLOCK) in both layouts: a packed sequence is followed
  by its own padding up to a multiple of 128, the columns its aligned padded row holds there (the same
  tokens at the same positions, attending the same keys), and the padded forward widens its rows to a
  multiple of 128; so a sequence's blocks hold the same rows in both (under unified the FP8 wgrad's 1x128
  / 128x1 quantization groups along tokens too), blocks of padding alone add zeros, and the attention
  backward's query blocks get the same shapes;
- the lm_head sees the real response positions only, sequence by sequence, on both (`head_logprobs`), so
  the head's weight gradient sums the same groups of 256 positions.
Off the grid (packing off, the default: the padded step exactly as without this module) the padded step's
gradients differ from the packed one's in summation order only (BLAS's blocking of the token sums, autograd's
RMSNorm reduction, padding positions in the head's groups, the FP8 wgrad's blocks and scales holding other
tokens): measured in the test's tolerance test. Cost of the grid: up to 127 padding columns per sequence
(3% at 2112 tokens, 20% at 320), and the fp32 / bf16 weight gradients (unified: the bf16 lm_head's) on the
canonical kernel instead of BLAS (results/long-train/). Not shown equal: models with biases (autograd's
sum over tokens) and MoE layers (tokens sent per expert).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch import Tensor

from jetflow.config import TrainConfig
from jetflow.model.chunked_logprobs import chunked_token_logprobs
from jetflow.model.decoder import GRAD_BLOCK, Decoder, align_rows
from jetflow.rl.experience import Experience


def pack_rows(lengths: list[int], budget: int) -> list[list[int]]:
    """Sequence indices per packed row: next-fit in order, each row's lengths summing to at most `budget`
    (a sequence longer than the budget alone in its row)."""
    rows: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if rows and used + n <= budget:
            rows[-1].append(i)
            used += n
        else:
            rows.append([i])
            used = n
    return rows


@dataclass
class PackedBatch(Experience):
    """A micro-batch of b sequences: their padded Experience fields (for the loss) and the packed row."""

    packed_ids: Tensor | None = None  # (1, N) the sequences' real tokens side by side
    lengths: list[int] = field(default_factory=list)  # columns of each sequence, prompt + response + padding (sum N)
    real: Tensor | None = None  # (1, N) bool: the sequences' real tokens (not their padding)
    predict_at: Tensor | None = None  # (M,) columns of the packed row whose hidden state predicts a response token
    response_at: Tensor | None = None  # (M,) the same tokens' flat index into (b, R)
    packed_routing: Tensor | None = None  # (1, N, L_moe, K) routing replay in the packed columns


def pack_batch(exp: Experience, block: int = 1) -> PackedBatch:
    """All of exp's sequences packed into one row, each followed by its own padding up to a multiple of
    `block` tokens (GRAD_BLOCK on packing's grid: the widened padded forward's columns, so both layouts put
    the same tokens in the weight gradients' token blocks; 1: no padding)."""
    mask = exp.attention_mask  # (b, P + R) one contiguous run of real tokens per row
    lengths = mask.sum(-1)  # (b,)
    seg = -(-lengths // block) * block  # (b,) each sequence's columns in the packed row
    width = int(seg.max())
    shift, _ = align_rows(mask, width)  # (b, width): aligned column j holds column shift[:, j], real tokens first
    cols = torch.arange(width, device=mask.device)[None]  # (1, width)
    keep = cols < seg[:, None]  # (b, width) the columns each sequence takes into the row, in row-major order
    first = mask.long().argmax(-1)  # (b,) each sequence's first real column
    seg_start = seg.cumsum(0) - seg  # (b,) its first column in the packed row
    b, R = exp.response_mask.shape
    seq, t = exp.response_mask.nonzero(as_tuple=True)  # response tokens (seq, t), sequence by sequence
    # response token t of sequence j sits at padded column P + t, aligned column P - first + t, packed column
    # seg_start + P - first + t; the hidden state one column earlier predicts it
    predict_at = seg_start[seq] + exp.prompt_len - first[seq] + t - 1  # (M,)
    routing = None
    if exp.routed_experts is not None:  # (b, P + R, L, K) -> (1, N, L, K)
        routing = exp.routed_experts.gather(1, shift[..., None, None].expand(-1, -1, *exp.routed_experts.shape[2:]))
        routing = routing[keep][None]
    return PackedBatch(**{f: getattr(exp, f) for f in Experience.__dataclass_fields__},
                       packed_ids=exp.input_ids.gather(1, shift)[keep][None], lengths=seg.tolist(),
                       real=(cols < lengths[:, None])[keep][None], predict_at=predict_at, response_at=seq * R + t,
                       packed_routing=routing)


def use_packing_grid(model: nn.Module) -> None:
    """Put an exact native Decoder on packing's grid (GRAD_BLOCK; see the module docstring): the Trainer
    does with train.max_tokens_per_micro_batch set. Any other model keeps torch's own gradient sums."""
    if isinstance(model, Decoder) and model.numerics == "exact":
        model.use_grad_block(GRAD_BLOCK)


def on_grid(model: nn.Module) -> bool:
    return isinstance(model, Decoder) and model.grad_block > 1


def micro_batches(exp: Experience, cfg: TrainConfig, model: nn.Module | None = None) -> list[Experience]:
    """exp's micro-batches: packed rows of at most cfg.max_tokens_per_micro_batch tokens (each sequence
    counted with its padding to the grid when `model` is on it), or (packing off) cfg.micro_batch_size
    padded sequences each."""
    if not cfg.max_tokens_per_micro_batch:
        return exp.micro_batches(cfg.micro_batch_size)
    block = model.grad_block if isinstance(model, Decoder) else 1
    lengths = (-(-exp.attention_mask.sum(-1) // block) * block).tolist()
    rows = pack_rows(lengths, cfg.max_tokens_per_micro_batch)
    return [pack_batch(exp.select(slice(r[0], r[-1] + 1)), block) for r in rows]


def packed_response_logprobs(model: nn.Module, mb: PackedBatch, temperature: float = 1.0, with_entropy: bool = False,
                             chunk_tokens: int = 0) -> Tensor | tuple[Tensor, Tensor]:
    """`jetflow.train.trainer.response_logprobs` of a packed micro-batch: (b, R) fp32 log-probs [and
    entropies], 0 at padding; only the M response positions go through lm_head."""
    if not isinstance(model, Decoder):
        raise ValueError(f"train.max_tokens_per_micro_batch: {type(model).__name__} has no packed forward (the "
                         "native Decoder has); use train.backend=native or train.max_tokens_per_micro_batch=0")
    replay = {} if mb.packed_routing is None else {"routed_experts": mb.packed_routing}
    hidden = model.forward_packed(mb.packed_ids, mb.lengths, real=mb.real, **replay)[0]  # (N, C)
    return head_logprobs(model.lm_head, hidden[mb.predict_at], mb, temperature, chunk_tokens, with_entropy,
                         mb.response_at)


def head_logprobs(head: nn.Module, hidden: Tensor, exp: Experience, temperature: float, chunk_tokens: int,
                  with_entropy: bool, at: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """(b, R) fp32 log-probs [and entropies] of exp's response tokens through `head`, 0 at padding. hidden:
    the (M, C) states that predict them, sequence by sequence, `at` their flat index into (b, R) (a packed
    row), or the padded (b, R, C) ones (at None), of which only the M real positions go through the head.
    Both layouts so give the head the same rows in the same order: the same groups in its weight gradient."""
    b, R = exp.response_ids.shape
    if at is None:
        real = exp.response_mask.bool()  # (b, R)
        hidden, at = hidden[real], real.reshape(-1).nonzero()[:, 0]  # (M, C), (M,)
    out = chunked_token_logprobs(head, hidden, exp.response_ids.reshape(-1)[at], temperature, chunk_tokens,
                                 with_entropy)  # (M,) [, (M,)]

    def scatter(x: Tensor) -> Tensor:
        return x.new_zeros(b * R).index_copy(0, at, x).view(b, R)  # (b, R)

    return (scatter(out[0]), scatter(out[1])) if with_entropy else scatter(out)
