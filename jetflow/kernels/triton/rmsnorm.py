"""Row-invariant RMSNorm for CUDA: jetflow.model.layers.RMSNorm's formula, one program per row.

    y = rms_norm(x, weight, eps)     # x (..., C) -> weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)

Why: torch's CUDA reduction picks its thread layout from the number of rows (for C >= 512, fewer than
16 rows spread a row over more threads), so `x.pow(2).mean(-1)` can give a row other bits when it is
one of 3 decode rows than when it is one of 3,000 trainer rows. Here each row is summed by the same
fixed tree over BLOCK_C = next_pow2(C) lanes whatever M is. Not torch's bits (its tree and rsqrt
differ), but the same on both sides of the exact mode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetflow.kernels.triton._bits import round_to_bf16

FP_FUSION = False


@triton.jit(do_not_specialize=["M", "C"])
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, M, C, stride_xm, stride_ym, eps, BLOCK_C: tl.constexpr,
                     X_BF16: tl.constexpr, OUT_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    ok = cols < C
    x = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)  # (C,)
    mean = tl.math.div_rn(tl.sum(x * x, axis=0), C.to(tl.float32))
    y = x * tl.math.rsqrt(mean + eps)
    if X_BF16:  # .to(x.dtype) before the weight, as the module does
        y = round_to_bf16(y).to(tl.float32)
    y = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32) * y
    if OUT_BF16:
        tl.store(y_ptr + row * stride_ym + cols, round_to_bf16(y), mask=ok)
    else:
        tl.store(y_ptr + row * stride_ym + cols, y, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., C) fp32 / bf16, weight (C,) -> (..., C) in promote_types(weight, x) (fp32 or bf16)."""
    c = x.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if x.dtype not in (torch.float32, torch.bfloat16) or out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"rms_norm: x {x.dtype}, weight {weight.dtype}; float32 or bfloat16")
    x2 = x.reshape(-1, c)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, x2.shape[0], c, x2.stride(0), y.stride(0),
                                         float(eps), BLOCK_C=triton.next_power_of_2(c),
                                         X_BF16=x.dtype == torch.bfloat16, OUT_BF16=out_dtype == torch.bfloat16,
                                         num_warps=4, enable_fp_fusion=FP_FUSION)
    return y.reshape(x.shape)
