"""Exact attention over a paged KV cache (jetflow.model.paged_cache), on the CPU.

    o = paged_attention(q, k_pages, v_pages, table, pos, scale, k_scale, v_scale)
    o = decode_attention_paged(q, k, v, cos, sin, pos, k_pages, v_pages, table, scale, k_scale, v_scale)

A page holds 64 key slots, the block of the exact attention; row b's slot j lives in page
table[b, j // 64] at offset j % 64. The kernel (csrc/attention.cpp's jf_attention_paged) visits keys in
slot order, one page pointer per 64-slot block, so it computes the bits of `invariant.attention` on
the same values laid out densely. Pages hold fp32, bf16 or E4M3 bytes; E4M3 codes are converted in
registers and multiplied by their fp32 per-layer scale (value = code * scale: the bits the FP8 KV
fake-quantizer, jetflow.precision.kv, produces), so FP8 storage keeps the log-probs of an fp32 cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jetflow.kernels.cpu_build import load_library

PAGE = 64
"""Key slots per page: the exact attention's KV block."""

FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
"""Page dtype -> the kernels' storage code."""


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


def _check_pages(k_pages: Tensor, v_pages: Tensor, hkv: int, d: int, table: Tensor, need: int) -> None:
    """k_pages (N, H_kv, D, 64), v_pages (N, H_kv, 64, D), one storage dtype, the last dim contiguous (the
    kernel takes the other strides: vLLM's cache interleaves K and V blocks); table (B, nb) int32 with
    nb * 64 >= need slots and page ids in [0, N)."""
    n = k_pages.shape[0]
    if k_pages.dtype not in FORMATS or v_pages.dtype != k_pages.dtype or k_pages.is_cuda \
            or tuple(k_pages.shape) != (n, hkv, d, PAGE) or tuple(v_pages.shape) != (n, hkv, PAGE, d) \
            or k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        raise ValueError(f"pages: K {tuple(k_pages.shape)} {k_pages.dtype}, V {tuple(v_pages.shape)} "
                         f"{v_pages.dtype}; want CPU (N, {hkv}, {d}, {PAGE}) and (N, {hkv}, {PAGE}, {d}), "
                         "the last dim contiguous")
    if table.dtype != torch.int32 or table.dim() != 2 or not table.is_contiguous() or table.shape[1] * PAGE < need:
        raise ValueError(f"block table {tuple(table.shape)} {table.dtype}: contiguous int32 (B, >= {-(-need // PAGE)})")
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= n):
        raise ValueError(f"block table holds page ids outside [0, {n})")


def paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, table: Tensor, pos: Tensor, scale: float,
                    k_scale: float = 1.0, v_scale: float = 1.0, variant: str = "native") -> Tensor:
    """Causal attention by position over paged K/V: query (b, t) sees slots 0..pos[b, t] of row b.

    q (B, H, T, D); k_pages (N, H_kv, D, 64) (K transposed inside a page), v_pages (N, H_kv, 64, D);
    table (B, nb) int32 page ids; pos (B, T). k_scale / v_scale: the E4M3 pages' scales (ignored
    otherwise). Returns (B, H, T, D) in q's dtype. No autograd (rollout)."""
    B, H, T, D = q.shape
    hkv = k_pages.shape[1]
    if H % hkv or pos.shape != (B, T) or table.shape[0] != B:
        raise ValueError(f"paged_attention shapes: q {tuple(q.shape)}, pages {tuple(k_pages.shape)}, "
                         f"table {tuple(table.shape)}, pos {tuple(pos.shape)}")
    pos = pos.to(torch.int64).contiguous()
    need = int(pos.max()) + 1 if pos.numel() else 0
    if pos.numel() and int(pos.min()) < 0:
        raise ValueError("paged_attention: negative query positions")
    _check_pages(k_pages, v_pages, hkv, D, table, need)
    dtype = q.dtype
    q = q.float().contiguous()
    out = torch.empty(B, H, T, D, dtype=torch.float32)
    load_library(variant).jf_attention_paged(
        _ptr(q), FORMATS[k_pages.dtype], _ptr(k_pages), *k_pages.stride()[:3], _ptr(v_pages), *v_pages.stride()[:3],
        float(k_scale), float(v_scale), _ptr(table), table.stride(0), _ptr(pos), _ptr(out), B, H, hkv, T, D,
        float(scale))
    return out.to(dtype)


def decode_attention_paged(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor,
                           k_pages: Tensor, v_pages: Tensor, table: Tensor, scale: float, k_scale: float = 1.0,
                           v_scale: float = 1.0, variant: str = "native") -> Tensor:
    """One exact decode step over a paged cache: `invariant.decode_attention`'s RoPE and cache write (row
    b's new K/V at slot pos[b]: page table[b, pos[b] // 64]), E4M3 pages storing the codes of
    rope(k) / k_scale and v / v_scale, then `paged_attention`. q (B, H, D), k and v (B, H_kv, D) fp32
    rows of heads D apart; cos, sin (B, D); pos (B,). fp32 or E4M3 pages. Returns (B, H, D) fp32."""
    B, H, D = q.shape
    hkv = k.shape[1]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float32 or t.stride(2) != 1 or t.stride(1) != D:
            raise ValueError(f"decode_attention_paged: {name} {tuple(t.shape)} must be fp32 rows of heads D apart")
    if D % 2 or D > 512 or k.shape != (B, hkv, D) or v.shape != (B, hkv, D) or H % hkv or table.shape[0] != B \
            or k_pages.dtype == torch.bfloat16:
        raise ValueError(f"decode_attention_paged shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, table {tuple(table.shape)}, pages {k_pages.dtype}")
    pos = pos.to(torch.int64).contiguous()
    if pos.numel() and int(pos.min()) < 0:
        raise ValueError("decode_attention_paged: negative positions")
    _check_pages(k_pages, v_pages, hkv, D, table, int(pos.max()) + 1 if pos.numel() else 0)
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    lib = load_library(variant)
    fmt = FORMATS[k_pages.dtype]
    q_rot = torch.empty(B, H, 1, D, dtype=torch.float32)
    lib.jf_rope_decode_paged(_ptr(q), q.stride(0), _ptr(k), k.stride(0), _ptr(v), v.stride(0), _ptr(cos), _ptr(sin), D,
                             _ptr(pos), _ptr(q_rot), fmt, _ptr(k_pages), *k_pages.stride()[:3], _ptr(v_pages),
                             *v_pages.stride()[:3], float(k_scale), float(v_scale), _ptr(table), table.stride(0),
                             B, H, hkv, D)
    out = torch.empty(B, H, 1, D, dtype=torch.float32)
    lib.jf_attention_paged(_ptr(q_rot), fmt, _ptr(k_pages), *k_pages.stride()[:3], _ptr(v_pages), *v_pages.stride()[:3],
                           float(k_scale), float(v_scale), _ptr(table), table.stride(0), _ptr(pos[:, None]),
                           _ptr(out), B, H, hkv, 1, D, float(scale))
    return out.view(B, H, D)
