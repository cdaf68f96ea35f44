"""The Decoder's attention: RoPE helpers, the per-forward `AttentionPlan` (which K/V slots are written
and which each query sees) and the `Attention` module, which dispatches to torch's SDPA (fast
numerics) or to the batch-invariant kernel (exact numerics, jetflow.kernels.invariant).

Numerics follow transformers' implementation (RoPE cos/sin in fp32 then cast to the activation dtype,
HF's "rotate half" convention). Module and parameter names mirror Hugging Face (`self_attn.q_proj`, ...)
and every projection is a plain `nn.Linear` that is *called* (see jetflow.model.decoder).

Shapes: B batch, T new tokens in this forward, S key slots attended (T, or cache.length + T),
C hidden size, H query heads, H_kv key/value heads, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from jetflow.kernels import invariant
from jetflow.model import paged_attention
from jetflow.model.kv_cache import KVCache
from jetflow.model.layers import RMSNorm
from jetflow.model.paged_cache import PagedKVCache
from jetflow.precision.linear import sibling_linears

if TYPE_CHECKING:
    from jetflow.model.model_config import ModelConfig


def rope_inv_freq(config: ModelConfig, device=None) -> torch.Tensor:
    """Inverse frequencies (D/2,) in fp32, including Llama 3.1's frequency-dependent scaling."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    # llama3: long wavelengths are slowed down by `factor`, short ones kept, the middle band blended
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (..., D) for token positions (...): angles in fp32, then cast to the activation dtype (as
    transformers does). The one definition of the tables, for the Decoder and for the vLLM plugin."""
    freqs = positions[..., None].float() * inv_freq  # (..., D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D); cos, sin (B, 1, T, D). HF's "rotate half" convention (not interleaved pairs)."""
    return x * cos + rotate_half(x) * sin


@dataclass
class AttentionPlan:
    """How every layer of one forward attends (built once per forward by `Decoder.forward_hidden`)."""

    exact: bool
    positions: torch.Tensor  # (B, T) position of each new token
    mask: torch.Tensor | None = None  # fast path: bool (B|1, 1, T, S) for SDPA, or None
    is_causal: bool = False  # fast path: SDPA's own causal mask is exact here
    start: int | None = None  # cache writes: slots [start, start + T) of every row ...
    row_slots: torch.Tensor | None = None  # ... or slot row_slots[b] of row b (one token per row)
    end: int | None = None  # key slots [0, end) after the write
    segments: list[tuple[int, int]] | None = None  # packed rows: columns [a, b) of the one row are a sequence


def attention_plan(positions: torch.Tensor, attention_mask: torch.Tensor | None,
                   cache: KVCache | PagedKVCache | None, exact: bool) -> AttentionPlan:
    """Where this forward's K/V go and which slots each query sees (see Decoder.forward_hidden)."""
    B, T = positions.shape
    device = positions.device
    plan = AttentionPlan(exact=exact, positions=positions)
    if cache is not None and cache.k_transposed != exact:
        raise ValueError(f"this KV cache was made for {'exact' if cache.k_transposed else 'fast'} numerics, "
                         f"the model runs {'exact' if exact else 'fast'}: make it with model.new_cache")
    if isinstance(cache, PagedKVCache):  # slot = position in each row's own pages
        if attention_mask is not None:
            raise ValueError("a paged KV cache takes right-padded rows with position_ids, not an attention_mask")
        plan.end = int(positions.max()) + 1
        cache.check_end(plan.end)
        return plan
    if cache is not None and attention_mask is not None:  # left padding: contiguous slots, masked
        L = cache.length
        plan.start, plan.end = L, L + T
        cache.check_end(plan.end)
        q_slot = torch.arange(L, L + T, device=device)[:, None]  # (T, 1)
        k_slot = torch.arange(L + T, device=device)[None, :]  # (1, S)
        mask = (k_slot <= q_slot)[None] & attention_mask[:, None, :]
        plan.mask = (mask | (k_slot == q_slot))[:, None]  # (B, 1, T, S)
        return plan
    if cache is not None:  # slot = position
        uniform = bool((positions == positions[:1]).all())
        first = int(positions[0, 0])
        contiguous = uniform and (T == 1 or bool((positions[0, 1:] - positions[0, :-1] == 1).all()))
        if contiguous:
            plan.start, plan.end = first, max(cache.length, first + T)
        elif T == 1:
            plan.row_slots = positions[:, 0]
            plan.end = max(cache.length, int(plan.row_slots.max()) + 1)
        else:
            raise ValueError("with a KV cache, position_ids must be one contiguous range shared by every row "
                             "(a prefill), or one token per row (a decode step)")
        cache.check_end(plan.end)
        S = plan.end
    else:
        S = T
    if exact:
        return plan
    if attention_mask is not None:  # no cache, padded rows: real slots at or before the query
        q_slot = torch.arange(T, device=device)[:, None]
        k_slot = torch.arange(T, device=device)[None, :]
        mask = (k_slot <= q_slot)[None] & attention_mask[:, None, :]
        plan.mask = (mask | (k_slot == q_slot))[:, None]  # (B, 1, T, T)
    elif cache is None or (plan.start == 0 and plan.end == T):
        plan.is_causal = T > 1  # a plain causal square
    elif not (T == 1 and bool((positions[:, 0] == S - 1).all())):  # else one token sees every slot
        k_slot = torch.arange(S, device=device)
        plan.mask = (k_slot[None, None, :] <= positions[:, :, None])[:, None]  # (B, 1, T, S)
    return plan


def packed_plan(lengths: list[int], exact: bool, device=None) -> AttentionPlan:
    """The plan of one packed row (B = 1, no cache): sequences of `lengths` tokens side by side, each at
    its own positions 0..n-1 (RoPE from 0) and attending only to itself, so its KV blocks start at its
    first token as in the rollout engine's cache (a sequence shifted inside a block changes its bits)."""
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]  # (1, N)
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return AttentionPlan(exact=exact, positions=positions,
                         segments=[(e - n, e) for n, e in zip(lengths, ends)])


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)  # the softmax scale of the exact kernel
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Optional FP8 K/V quantizer (jetflow.precision.kv), applied after RoPE in the full forward and
        # in cached decoding alike, so trainer and rollout see the same K/V values.
        self.kv_quantizer = None

    def forward(self, x, cos, sin, plan: AttentionPlan, cache: KVCache | PagedKVCache | None):
        B, T, _ = x.shape
        q, k, v = sibling_linears(x, (self.q_proj, self.k_proj, self.v_proj))  # one GEMM where exact
        q = q.view(B, T, self.num_heads, self.head_dim)  # (B, T, H, D)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, H_kv, D)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, H_kv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if isinstance(cache, PagedKVCache):
            y = paged_attention.fused_decode(self, q, k, v, cos, sin, plan, cache) if T == 1 else None
            if y is not None:
                return self.o_proj(y)  # (B, 1, C)
        elif self._fused_decode(plan, cache, q, k, v, cos):  # RoPE, the cache write and attention: 2 kernel calls
            y = invariant.decode_attention(q[:, 0], k[:, 0], v[:, 0], cos[:, 0, 0], sin[:, 0, 0], plan.positions[:, 0],
                                           cache.k[self.layer_idx], cache.v[self.layer_idx], plan.end, self.scale)
            return self.o_proj(y.view(B, T, self.num_heads * self.head_dim))  # (B, 1, C)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|H_kv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(cache, PagedKVCache):  # the quantizer, the pages' write and attention
            y = paged_attention.attend(self, q, k, v, plan, cache)  # (B, H, T, D)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))
        if self.kv_quantizer is not None:
            k, v = self.kv_quantizer(self.layer_idx, k, v)
        if plan.segments is not None:  # packed sequences: each one's own attention, as if it were alone
            y = torch.cat([self._attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], plan.positions[:, a:b], plan.exact)
                           for a, b in plan.segments], dim=2)  # (1, H, N, D)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))
        if cache is not None:
            # (B, H_kv, S, D); K is (B, H_kv, D, S) in an exact-numerics cache
            k, v = cache.update(self.layer_idx, k, v, plan.start, plan.row_slots, plan.end)
            k, v = k.to(q.dtype), v.to(q.dtype)
        if plan.exact:
            kt = k if cache is not None else k.transpose(-1, -2).contiguous()  # (B, H_kv, D, S)
            y = invariant.attention(q, kt, v, plan.positions, self.scale)  # (B, H, T, D)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=plan.mask, is_causal=plan.is_causal,
                enable_gqa=self.num_kv_heads != self.num_heads)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)  # (B, T, H*D)
        return self.o_proj(y)  # (B, T, C)

    def _attend(self, q, k, v, positions, exact: bool):
        """One whole sequence without a cache, q (B, H, T, D), k and v (B, H_kv, T, D) at positions 0..T-1:
        the kernel the unpadded forward calls (exact: the invariant kernel, whose query results do not depend
        on T or the other rows; fast: SDPA's causal square)."""
        if exact:
            return invariant.attention(q, k.transpose(-1, -2).contiguous(), v, positions, self.scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1,
                                              enable_gqa=self.num_kv_heads != self.num_heads)

    def _fused_decode(self, plan: AttentionPlan, cache: KVCache | None, q, k, v, cos) -> bool:
        """A CPU decode step under exact numerics (one token per row, fp32, an fp32 cache, no K/V
        quantizer, no graph to record) runs `invariant.decode_attention`: the same bits as the steps below.
        (An exact plan's cache keeps K transposed: `attention_plan` refuses any other.)"""
        return (plan.exact and cache is not None and q.shape[1] == 1 and self.kv_quantizer is None
                and cache.quantize_kv is None and not q.is_cuda
                and q.dtype == k.dtype == v.dtype == cos.dtype == cache.k[self.layer_idx].dtype == torch.float32
                and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and self.head_dim <= 512
                and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)))


GRAD_BLOCK = 128
"""Token rows per block of the exact weight gradients' sums on sequence packing's grid
(jetflow.kernels.invariant.weight_grad, jetflow.train.packing): each sequence starts on a multiple of it in
packed and padded rows alike, so both layouts put the same tokens in the same blocks."""


def align_rows(attention_mask: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact numerics on padded rows: slot = position. attention_mask (B, T) bool with one contiguous run
    of real tokens per row (left-padded prompt, right-padded response) -> shift (B, width or T), back (B, T):
    aligned column j holds original column shift[b, j] (each row's real tokens start at slot 0, as in
    the rollout engine's cache; columns from T on repeat the last one); original column j holds aligned
    column back[b, j]."""
    B, T = attention_mask.shape
    cols = torch.arange(T, device=attention_mask.device)
    start = attention_mask.long().argmax(-1)  # (B,) first real token
    count = attention_mask.sum(-1)  # (B,)
    run = (cols[None] >= start[:, None]) & (cols[None] < (start + count)[:, None])
    if not torch.equal(run, attention_mask):
        raise ValueError("exact numerics need each row's real tokens to be one contiguous run "
                         "(left-padded prompt, right-padded response)")
    wide = torch.arange(width or T, device=attention_mask.device).clamp(max=T - 1)
    return (start[:, None] + wide[None]) % T, (cols[None] - start[:, None]) % T
