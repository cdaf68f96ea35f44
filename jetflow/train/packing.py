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

What is the same bits as the padded path under exact numerics (tests/unit/test_sequence_packing.py):
every log-prob and entropy (the canonical GEMMs, norms and RoPE are row-local; attention runs per
sequence with the kernel the padded forward calls, whose query results do not depend on the other rows
or the key count). What is not: the parameter gradients, which are sums over tokens. Packing removes the
padding rows from those sums (wgrad GEMMs over tokens, RMSNorm weights, the embedding's index_add, the
lm_head's groups of 256 positions; under unified also the FP8 wgrad's 128-token quantization groups, which
held padding tokens), so their rounding changes: measured 4e-8 (fp32) and 4e-3 (unified) of the gradient's
norm, less than changing train.micro_batch_size moves the padded path's own gradient; the test states the
bound it checks. Bit-for-bit gradients would need every reduction over tokens done per sequence in a fixed
order on both paths (or the padded path computing packed rows itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn
from torch import Tensor

from jetflow.config import TrainConfig
from jetflow.model.chunked_logprobs import chunked_token_logprobs
from jetflow.model.decoder import Decoder
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
    lengths: list[int] = field(default_factory=list)  # tokens of each sequence, prompt + response (sum N)
    predict_at: Tensor | None = None  # (M,) columns of the packed row whose hidden state predicts a response token
    response_at: Tensor | None = None  # (M,) the same tokens' flat index into (b, R)
    packed_routing: Tensor | None = None  # (1, N, L_moe, K) routing replay in the packed columns


def pack_batch(exp: Experience) -> PackedBatch:
    """All of exp's sequences packed into one row."""
    mask = exp.attention_mask  # (b, P + R) one contiguous run of real tokens per row
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: sequence by sequence, columns ascending
    lengths = mask.sum(-1)  # (b,)
    first = mask.long().argmax(-1)  # (b,) each sequence's first real column
    seg_start = lengths.cumsum(0) - lengths  # (b,) its first column in the packed row
    b, R = exp.response_mask.shape
    seq, t = exp.response_mask.nonzero(as_tuple=True)  # response tokens (seq, t), sequence by sequence
    # response token t of sequence j sits at padded column P + t, packed column seg_start + P - first + t;
    # the hidden state one column earlier predicts it
    predict_at = seg_start[seq] + exp.prompt_len - first[seq] + t - 1  # (M,)
    routing = None if exp.routed_experts is None else exp.routed_experts[rows, cols][None]  # (1, N, L, K)
    return PackedBatch(**{f: getattr(exp, f) for f in Experience.__dataclass_fields__},
                       packed_ids=exp.input_ids[rows, cols][None], lengths=lengths.tolist(),
                       predict_at=predict_at, response_at=seq * R + t, packed_routing=routing)


def micro_batches(exp: Experience, cfg: TrainConfig) -> list[Experience]:
    """exp's micro-batches: packed rows of at most cfg.max_tokens_per_micro_batch tokens, or (packing off)
    cfg.micro_batch_size padded sequences each."""
    if not cfg.max_tokens_per_micro_batch:
        return exp.micro_batches(cfg.micro_batch_size)
    rows = pack_rows(exp.attention_mask.sum(-1).tolist(), cfg.max_tokens_per_micro_batch)
    return [pack_batch(exp.select(slice(r[0], r[-1] + 1))) for r in rows]


def packed_response_logprobs(model: nn.Module, mb: PackedBatch, temperature: float = 1.0, with_entropy: bool = False,
                             chunk_tokens: int = 0) -> Tensor | tuple[Tensor, Tensor]:
    """`jetflow.train.trainer.response_logprobs` of a packed micro-batch: (b, R) fp32 log-probs [and
    entropies], 0 at padding; only the M response positions go through lm_head."""
    if not isinstance(model, Decoder):
        raise ValueError(f"train.max_tokens_per_micro_batch: {type(model).__name__} has no packed forward (the "
                         "native Decoder has); use train.backend=native or train.max_tokens_per_micro_batch=0")
    replay = {} if mb.packed_routing is None else {"routed_experts": mb.packed_routing}
    hidden = model.forward_packed(mb.packed_ids, mb.lengths, **replay)[0]  # (N, C)
    tokens = mb.response_ids.reshape(-1)[mb.response_at]  # (M,)
    out = chunked_token_logprobs(model.lm_head, hidden[mb.predict_at], tokens, temperature, chunk_tokens,
                                 with_entropy)  # (M,) [, (M,)]
    b, R = mb.response_ids.shape

    def scatter(x: Tensor) -> Tensor:
        return x.new_zeros(b * R).index_copy(0, mb.response_at, x).view(b, R)  # (b, R)

    return (scatter(out[0]), scatter(out[1])) if with_entropy else scatter(out)
