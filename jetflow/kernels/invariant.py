"""Batch-invariant GEMM and attention: each row's result is one fixed sequence of floating-point
operations, whatever else is in the call (the exact numerics mode, `precision.numerics=exact`).

    packed = pack_weight(w)                       # (N, K) -> panels, once per weight version
    y = matmul(x, w, packed)                      # x (..., K) -> (..., N), rows independent of M
    o = attention(q, kt, v, pos, scale)           # each query sees key slots 0..pos, one order

Why: BLAS picks kernels by shape (gemv for one row, other blockings for other M; measured here: MKL's
fp32 rows differ between M = 1..128 and large M on one shape, and vary with the ISA), and SDPA's
reduction order depends on the sequence length, so a token decoded from a KV cache and the same
token inside the trainer's full forward come out a few ulps apart, which FP8 rounding then
amplifies. These kernels define every output element as one chain of correctly rounded FMAs in a
fixed order (see csrc/invariant_cpu.cpp), so the rollout engine and the trainer compute the same bits.

Gradients: backward passes use torch's ordinary kernels (the values of the gradients need not be
exact, only the forward that produces log-probs).

CUDA: the same contract on jetflow's Triton kernels (jetflow.kernels.triton): `pack_weight` keeps the
(N, K) weight as it is, `matmul` / `gemm` run the dense batch-invariant GEMM and `attention` the
fixed-block online-softmax kernel. They are not the CPU's bits (other hardware, other reduction
shapes), but on the GPU a row again comes out the same whatever M, the batch or the KV cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from jetflow.kernels import triton as cuda_kernels  # imports no triton until a kernel is used
from jetflow.kernels.cpu_build import KernelBuildError, load_library

__all__ = ["KernelBuildError", "attention", "check_device", "matmul", "pack_weight", "panel_width",
           "reference_attention"]


def check_device(device: torch.device | str) -> None:
    """The exact kernels run on the CPU (C++) and on CUDA (Triton: MissingDependencyError without it)."""
    kind = torch.device(device).type
    if kind == "cuda":
        cuda_kernels.require()
    elif kind != "cpu":
        raise NotImplementedError(
            f"precision.numerics=exact runs on the CPU and on CUDA (got device {device}): use "
            "precision.numerics=fast here")


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


def panel_width(variant: str = "native") -> int:
    return load_library(variant).jf_panel_width()


def pack_weight(w: Tensor, variant: str = "native") -> Tensor:
    """(N, K) weight -> (ceil(N / NR), K, NR) fp32 panels (zero-padded columns), the GEMM's layout.
    On CUDA the Triton GEMM reads the (N, K) fp32 weight itself (no copy when it already is one)."""
    if w.is_cuda:
        return w.detach().float().contiguous()
    nr = panel_width(variant)
    n, k = w.shape
    p = -(-n // nr)
    w = w.detach().float()
    if p * nr != n:
        w = F.pad(w, (0, 0, 0, p * nr - n))
    return w.view(p, nr, k).transpose(1, 2).contiguous()


def gemm(x2: Tensor, packed: Tensor, n: int, variant: str = "native") -> Tensor:
    """x2 (M, K) fp32 @ W^T -> (M, N) fp32, W given as `pack_weight(W)`; no autograd."""
    if x2.is_cuda:
        return cuda_kernels.dense_gemm(x2, packed[:n], "fp32")
    lib = load_library(variant)
    m, k = x2.shape
    if packed.shape[1] != k or packed.shape[2] != lib.jf_panel_width() or packed.shape[0] * packed.shape[2] < n:
        raise ValueError(f"packed weight {tuple(packed.shape)} does not fit x {tuple(x2.shape)} and N={n}")
    x2 = x2.float()
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    lib.jf_gemm(_ptr(x2), m, k, x2.stride(0), _ptr(packed), n, _ptr(out), n)
    return out


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, packed, dot):
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.is_cuda:
            y = cuda_kernels.dense_gemm(x2, packed, dot)
        else:
            y = gemm(x2, packed, weight.shape[0])
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (g2 @ weight.to(g2.dtype)).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (g2.t() @ x.reshape(-1, x.shape[-1]).to(g2.dtype)).to(weight.dtype)
        return grad_x, grad_w, None, None


def matmul(x: Tensor, weight: Tensor, packed: Tensor, dot: str = "fp32") -> Tensor:
    """x (..., K) @ weight^T (weight (N, K), `packed = pack_weight(weight)`): every output element is
    an FMA chain over k in order from 0, so a row's result does not depend on the other rows.
    Differentiable in x and weight (backward through torch's matmul). `dot="bf16"` says both operands
    lie on the bf16 grid: on CUDA the product then runs on bf16 tensor cores (the same products, fp32
    accumulation); the CPU computes it as it computes fp32."""
    check_device(x.device)
    return _Matmul.apply(x, weight, packed, dot)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, scale: float) -> Tensor:
    """The same function in plain torch ops (differentiable; the backward of `attention` and the
    tests' reference): q (B, H, T, D), k and v (B, H_kv, S, D), pos (B, T)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, T, S)
    future = torch.arange(k.shape[2], device=q.device)[None, None, None, :] > pos[:, None, :, None]
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v  # (B, H, T, D)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kt, v, pos, scale, variant):
        ctx.save_for_backward(q, kt, v, pos)
        ctx.scale = scale
        return _attention_values(q, kt, v, pos, scale, variant)

    @staticmethod
    def backward(ctx, grad):
        q, kt, v, pos = ctx.saved_tensors
        with torch.enable_grad():
            q_, kt_, v_ = (t.detach().requires_grad_(t.requires_grad) for t in (q, kt, v))
            out = reference_attention(q_, kt_.transpose(-1, -2), v_, pos, ctx.scale)
            wrt = [t for t in (q_, kt_, v_) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wrt, grad) if wrt else ())
        return (*(next(grads) if t.requires_grad else None for t in (q_, kt_, v_)), None, None, None)


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
    pos = pos.to(torch.int64).contiguous()
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= S):
        raise ValueError(f"attention: query positions must lie in [0, {S}) (the key slots given), "
                         f"got {int(pos.min())}..{int(pos.max())}")
    out = torch.empty(B, H, T, D, dtype=torch.float32)
    load_library(variant).jf_attention(_ptr(q), _ptr(kt), kt.stride(0), kt.stride(1), kt.stride(2), _ptr(v),
                                    v.stride(0), v.stride(1), v.stride(2), _ptr(pos), _ptr(out), B, H, Hkv, T, D,
                                    float(scale))
    return out.to(dtype)


def attention(q: Tensor, kt: Tensor, v: Tensor, pos: Tensor, scale: float, variant: str = "native") -> Tensor:
    """Causal attention by position: query (b, t) at position pos[b, t] attends key slots 0..pos[b, t]
    of its own row (slot = position: sequences start at slot 0).

    q (B, H, T, D); kt (B, H_kv, D, S): keys transposed, unit stride along S (a KV cache keeps K this
    way); v (B, H_kv, S, D), unit stride along D; pos (B, T). Returns (B, H, T, D). A query's result
    is the same bits whatever B, T, S or the other queries are (two-pass softmax: the max over the
    query's keys, then exp, the sum and the weighted sum of V in key order)."""
    check_device(q.device)
    return _Attention.apply(q, kt, v, pos, float(scale), variant)
