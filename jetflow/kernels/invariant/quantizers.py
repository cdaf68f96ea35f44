"""The CPU kernels' quantizers and conversions (csrc/quant.cpp): an activation's 1x128 E4M3 quantization,
rounding to the bf16 grid, and E4M3 bytes to fp32."""

from __future__ import annotations

import torch
from torch import Tensor

from jetflow.kernels import canonical
from jetflow.kernels.invariant._lib import library, ptr


def quantize_1x128(x2: Tensor, scale_rule: str = "fp32", margin: int = 0,
                   variant: str = "native") -> tuple[Tensor, Tensor, int]:
    """x2 (M, K) fp32 -> (codes (M, K) float8_e4m3fn, scale_inv (M, ceil(K/128)) fp32, number of groups
    holding NaN / Inf): the bytes of jetflow.precision.quant.quantize_blocks(x2, (1, 128)) in one pass
    (csrc/quant.cpp; a group with NaN / Inf gets a NaN scale, and the caller raises)."""
    if scale_rule not in ("fp32", "pow2"):
        raise ValueError(f"scale_rule={scale_rule!r}: 'fp32' or 'pow2'")
    m, k = x2.shape
    x2 = x2.float()  # any strides: a transposed view (the wgrad's 128 x 1 groups) is read as it is, not copied
    codes = torch.empty(m, k, dtype=torch.uint8)
    scales = torch.empty(m, -(-k // canonical.BLOCK_K), dtype=torch.float32)
    bad = library(variant).jf_quantize_1x128(ptr(x2), m, k, x2.stride(0), x2.stride(1), int(scale_rule == "pow2"),
                                             float(2.0**margin), ptr(codes), ptr(scales))
    return codes.view(torch.float8_e4m3fn), scales, int(bad)


def round_to_bf16(t: Tensor, variant: str = "native") -> Tensor:
    """t rounded to the bf16 grid, in t's dtype: t.bfloat16().to(t.dtype), the same bits (round to nearest
    even); fp32 on the CPU in one pass (csrc/quant.cpp) instead of two casts and a bf16 intermediate."""
    if t.is_cuda or t.dtype != torch.float32:
        return t.bfloat16().to(t.dtype)
    t = t.contiguous()
    out = torch.empty_like(t)
    library(variant).jf_round_to_bf16(ptr(t), t.numel(), ptr(out))
    return out


def e4m3_to_float(codes: Tensor, variant: str = "native") -> Tensor:
    """The kernels' own conversion of E4M3 bytes to fp32 (for tests: it must equal torch's)."""
    codes = codes.contiguous().view(torch.uint8).reshape(-1)
    out = torch.empty(codes.numel(), dtype=torch.float32)
    library(variant).jf_e4m3_to_f32(ptr(codes), codes.numel(), ptr(out))
    return out
