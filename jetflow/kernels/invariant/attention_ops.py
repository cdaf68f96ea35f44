"""Batch-invariant causal attention by position: `attention` (the kernel forward, its autograd function
`_Attention` with a blockwise backward), `decode_attention` (a decode step's RoPE, KV-cache write and
attention, fused) and `reference_attention` (the same function in plain torch ops). One chain per query:
csrc/attention.cpp and csrc/rope.cpp on the CPU, the fixed-block online-softmax Triton kernel on CUDA."""

from __future__ import annotations

import torch
from torch import Tensor

from jetflow.kernels.invariant._lib import check_device, cuda_kernels, library, ptr


def reference_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, scale: float) -> Tensor:
    """The same function in plain torch ops (differentiable; the backward of `attention` and the
    tests' reference): q (B, H, T, D), k and v (B, H_kv, S, D), pos (B, T)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, T, S)
    future = torch.arange(k.shape[2], device=q.device)[None, None, None, :] > pos[:, None, :, None]
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v  # (B, H, T, D)


ATTENTION_BACKWARD_ROWS = 128
"""Query rows per block of the attention backward: a block's scores (B, H, 128, S) are the largest tensor
it holds, instead of the whole layer's (B, H, T, S)."""


class _Attention(torch.autograd.Function):
    """The exact kernel forward; the backward differentiates `reference_attention` a block of
    ATTENTION_BACKWARD_ROWS query rows at a time (each against the keys up to the block's last position):
    dq's rows written per block, dk and dv summed over the blocks in order in fp32. The blocks depend on
    the shapes and positions only, so the gradients are the same bits on every run (and with activation
    checkpointing on or off)."""

    @staticmethod
    def forward(ctx, q, kt, v, pos, scale, variant):
        ctx.save_for_backward(q, kt, v, pos)
        ctx.scale = scale
        return _attention_values(q, kt, v, pos, scale, variant)

    @staticmethod
    def backward(ctx, grad):
        q, kt, v, pos = ctx.saved_tensors  # (B, H, T, D), (B, Hkv, D, S), (B, Hkv, S, D), (B, T)
        need = ctx.needs_input_grad[:3]
        dq = torch.empty_like(q) if need[0] else None
        dkt = torch.zeros(kt.shape, dtype=torch.float32, device=kt.device) if need[1] else None
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device) if need[2] else None
        for t0 in range(0, q.shape[2] if any(need) else 0, ATTENTION_BACKWARD_ROWS):
            t1 = min(t0 + ATTENTION_BACKWARD_ROWS, q.shape[2])
            s = int(pos[:, t0:t1].max()) + 1  # keys past it get no weight from this block: exact zeros
            with torch.enable_grad():
                qb = q[:, :, t0:t1].detach().requires_grad_(need[0])  # (B, H, b, D)
                ktb = kt[..., :s].detach().requires_grad_(need[1])  # (B, Hkv, D, s)
                vb = v[:, :, :s].detach().requires_grad_(need[2])  # (B, Hkv, s, D)
                out = reference_attention(qb, ktb.transpose(-1, -2), vb, pos[:, t0:t1], ctx.scale)  # (B, H, b, D)
                wrt = [t for t in (qb, ktb, vb) if t.requires_grad]
                grads = iter(torch.autograd.grad(out, wrt, grad[:, :, t0:t1]))
            if need[0]:
                dq[:, :, t0:t1] = next(grads)
            if need[1]:
                dkt[..., :s] += next(grads)
            if need[2]:
                dv[:, :, :s] += next(grads)
        return (dq, None if dkt is None else dkt.to(kt.dtype), None if dv is None else dv.to(v.dtype),
                None, None, None)


def _positions(pos: Tensor, slots: int, what: str) -> Tensor:
    """Query positions as the kernels read them (int64, contiguous), each a key slot in [0, slots)."""
    pos = pos.to(torch.int64).contiguous()
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= slots):
        raise ValueError(f"{what}: query positions must lie in [0, {slots}) (the key slots given), "
                         f"got {int(pos.min())}..{int(pos.max())}")
    return pos


def _attention_values(q: Tensor, kt: Tensor, v: Tensor, pos: Tensor, scale: float, variant: str) -> Tensor:
    B, H, T, D = q.shape
    Hkv, S = kt.shape[1], kt.shape[3]
    if kt.shape != (B, Hkv, D, S) or v.shape != (B, Hkv, S, D) or pos.shape != (B, T) or H % Hkv:
        raise ValueError(f"attention shapes: q {tuple(q.shape)}, kt {tuple(kt.shape)}, v {tuple(v.shape)}, "
                         f"pos {tuple(pos.shape)}")
    if q.is_cuda:  # Triton; query positions past the slots given see every slot (no sync to check them)
        dtype = q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32
        k, v = kt.transpose(-1, -2).to(dtype), v.to(dtype)  # (B, H_kv, S, D) views when dtypes agree
        return cuda_kernels.attention(q.to(dtype), k, v, pos, scale).to(q.dtype)
    dtype = q.dtype
    q = q.float().contiguous()
    if kt.dtype != torch.float32 or kt.stride(3) != 1:
        kt = kt.float().contiguous()
    if v.dtype != torch.float32 or v.stride(3) != 1:
        v = v.float().contiguous()
    pos = _positions(pos, S, "attention")
    out = torch.empty(B, H, T, D, dtype=torch.float32)
    library(variant).jf_attention(ptr(q), ptr(kt), kt.stride(0), kt.stride(1), kt.stride(2), ptr(v),
                                  v.stride(0), v.stride(1), v.stride(2), ptr(pos), ptr(out), B, H, Hkv, T, D,
                                  float(scale))
    return out.to(dtype)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, kt_cache: Tensor,
                     v_cache: Tensor, end: int, scale: float, variant: str = "native") -> Tensor:
    """One decode step of exact attention on the CPU, one new token per row: the bits of `apply_rope` on q
    and k, the KV-cache write (`KVCache.update` at slot pos[b]) and `attention`, in two kernel calls
    instead of ~25 torch ops (csrc/rope.cpp, then jf_attention).

    q (B, H, D), k and v (B, H_kv, D): unit stride along D, heads D apart (views of the projections'
    rows); cos, sin (B, D); pos (B,) int64, each row's position = its slot; kt_cache (B, H_kv, D, max_len)
    and v_cache (B, H_kv, max_len, D) one layer's fp32 cache (K transposed), written at slot pos[b]; `end`:
    key slots [0, end) are attended. Returns (B, H, D) fp32. No autograd (a decode step)."""
    B, H, D = q.shape
    Hkv = k.shape[1]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float32 or t.stride(2) != 1 or t.stride(1) != D:
            raise ValueError(f"decode_attention: {name} {tuple(t.shape)} must be fp32 rows of heads D apart")
    if D % 2 or D > 512 or k.shape != (B, Hkv, D) or v.shape != (B, Hkv, D) or H % Hkv \
            or kt_cache.shape[:3] != (B, Hkv, D) or v_cache.shape[:2] != (B, Hkv) or kt_cache.stride(3) != 1 \
            or v_cache.stride(3) != 1 or end > min(kt_cache.shape[3], v_cache.shape[2]):
        raise ValueError(f"decode_attention shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"caches {tuple(kt_cache.shape)} {tuple(v_cache.shape)}, end {end}")
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    pos = _positions(pos, end, "decode_attention")
    lib = library(variant)
    q_rot = torch.empty(B, H, 1, D, dtype=torch.float32)
    lib.jf_rope_decode(ptr(q), q.stride(0), ptr(k), k.stride(0), ptr(v), v.stride(0), ptr(cos), ptr(sin), D,
                       ptr(pos), ptr(q_rot), ptr(kt_cache), *kt_cache.stride()[:3], ptr(v_cache),
                       *v_cache.stride()[:3], B, H, Hkv, D)
    out = torch.empty(B, H, 1, D, dtype=torch.float32)
    lib.jf_attention(ptr(q_rot), ptr(kt_cache), *kt_cache.stride()[:3], ptr(v_cache), *v_cache.stride()[:3],
                     ptr(pos), ptr(out), B, H, Hkv, 1, D, float(scale))
    return out.view(B, H, D)


def attention(q: Tensor, kt: Tensor, v: Tensor, pos: Tensor, scale: float, variant: str = "native") -> Tensor:
    """Causal attention by position: query (b, t) at position pos[b, t] attends key slots 0..pos[b, t]
    of its own row (slot = position: sequences start at slot 0).
    q (B, H, T, D); kt (B, H_kv, D, S): keys transposed, unit stride along S (a KV cache keeps K this
    way); v (B, H_kv, S, D), unit stride along D; pos (B, T). Returns (B, H, T, D). A query's result
    is the same bits whatever B, T, S or the other queries are (two-pass softmax: the max over the
    query's keys, then exp, the sum and the weighted sum of V in key order)."""
    check_device(q.device)
    if torch.is_grad_enabled() and (q.requires_grad or kt.requires_grad or v.requires_grad):
        return _Attention.apply(q, kt, v, pos, float(scale), variant)
    return _attention_values(q, kt, v, pos, float(scale), variant)  # no graph to record (a decode step)
