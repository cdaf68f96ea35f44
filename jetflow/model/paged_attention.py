"""The Decoder's attention over a paged KV cache (jetflow.model.paged_cache): RoPE, the FP8 K/V
quantizer, the write into the pages and attention, for `Attention.forward` when its cache is paged.

Exact numerics: the paged kernels (jetflow.kernels.paged), the same bits as the dense cache's path
(`invariant.attention` / `decode_attention`); a CPU decode step in fp32 runs fused (RoPE, the write
and attention in two kernel calls), E4M3 pages included. On CUDA the trainer's Triton kernel
(jetflow.kernels.triton.attn, online softmax) reads the pages through the block table (E4M3 codes times
their scales in registers): the bits of the same values gathered densely. kernels/triton/paged_exact.py
(the CPU kernel's arithmetic on a GPU, bit for bit) is not used here: the CUDA trainer computes the
online-softmax order. Fast numerics: the pages gathered into dense K/V and torch's SDPA (simple rather
than fast: a copy of the attended slots per layer and step).

E4M3 pages store the attached FP8 K/V quantizer's codes (it must be calibrated); fp32 / bf16 pages store
its rounded values when one is attached, as the dense cache does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jetflow.kernels import paged
from jetflow.kernels import triton as triton_kernels  # imports no triton until a kernel is used
from jetflow.model.paged_cache import PagedKVCache


def _scales(attn, cache: PagedKVCache) -> tuple[bool, float, float]:
    """(E4M3 pages?, k_scale, v_scale) of this layer, refusing E4M3 pages without a ready quantizer."""
    quantizer = attn.kv_quantizer
    fp8 = cache.pool.dtype == torch.float8_e4m3fn
    if fp8 and (quantizer is None or not quantizer.ready):
        raise ValueError("an E4M3 paged KV cache needs a calibrated FP8 K/V quantizer attached to the model "
                         "(precision.kv_cache_fp8); use an fp32 pool before the first calibration")
    ks, vs = quantizer.layer_scales(attn.layer_idx) if fp8 else (1.0, 1.0)
    return fp8, ks, vs


def fused_decode(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 plan, cache: PagedKVCache) -> torch.Tensor | None:
    """An exact CPU decode step in two kernel calls, or None where it does not apply. q (B, 1, H, D), k and
    v (B, 1, H_kv, D) before RoPE; cos, sin (B, 1, 1, D). Returns (B, 1, H*D)."""
    fp8, ks, vs = _scales(attn, cache)
    if not _fused(plan, q, k, v, cos, attn.kv_quantizer, fp8, cache):
        return None
    B, _, H, D = q.shape
    y = paged.decode_attention_paged(q[:, 0], k[:, 0], v[:, 0], cos[:, 0, 0], sin[:, 0, 0], plan.positions[:, 0],
                                     cache.pool.k[attn.layer_idx], cache.pool.v[attn.layer_idx], cache.table,
                                     attn.scale, ks, vs)  # (B, H, D)
    return y.view(B, 1, H * D)


def attend(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan, cache: PagedKVCache) -> torch.Tensor:
    """q (B, H, T, D), k and v (B, H_kv, T, D) after RoPE: quantize, write, attend. Returns (B, H, T, D)."""
    layer, quantizer = attn.layer_idx, attn.kv_quantizer
    fp8, ks, vs = _scales(attn, cache)
    if fp8:
        k, v = quantizer.encode(layer, k, v)  # E4M3 codes
    elif quantizer is not None:
        k, v = quantizer(layer, k, v)
    cache.write(layer, k, v, plan.positions)
    if plan.exact and q.is_cuda:  # the Triton kernel on the pages: the bits of a dense cache
        dtype = q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32  # invariant.attention's
        kp, vp = cache.pool.k[layer], cache.pool.v[layer]  # (N, H_kv, D, 64) K^T pages, (N, H_kv, 64, D)
        return triton_kernels.attention(q.to(dtype), kp.transpose(-1, -2), vp, plan.positions, attn.scale,
                                        block_table=cache.table, k_scale=ks if fp8 else None,
                                        v_scale=vs if fp8 else None).to(q.dtype)
    if plan.exact:
        return paged.paged_attention(q, cache.pool.k[layer], cache.pool.v[layer], cache.table, plan.positions,
                                     attn.scale, ks, vs)
    kd, vd = cache.gather(layer, plan.end, q.dtype, ks, vs)  # (B, H_kv, S, D): slots [0, plan.end)
    mask = torch.arange(plan.end, device=q.device)[None, None, :] <= plan.positions[:, :, None]  # (B, T, S)
    return F.scaled_dot_product_attention(q, kd, vd, attn_mask=mask[:, None],
                                          enable_gqa=attn.num_kv_heads != attn.num_heads)  # (B, H, T, D)


def _fused(plan, q, k, v, cos, quantizer, fp8: bool, cache: PagedKVCache) -> bool:
    """A CPU decode step under exact numerics (one token per row, fp32, fp32 or E4M3 pages whose
    quantizer is not calibrating, no graph to record): `decode_attention_paged`, the same bits."""
    return (plan.exact and q.shape[1] == 1 and not q.is_cuda and cache.pool.dtype in (torch.float32, torch.float8_e4m3fn)
            and (quantizer is None or fp8) and not (quantizer is not None and quantizer.calibrating)
            and q.dtype == k.dtype == v.dtype == cos.dtype == torch.float32
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and q.shape[-1] <= 512
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)))
