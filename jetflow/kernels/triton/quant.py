"""1x128 activation quantization (E4M3), byte-identical to the CPU quantizer.

    data, scale_inv = quantize_1x128(x)        # x (M, K) -> (M, K) float8_e4m3fn, (M, ceil(K/128)) fp32

Per 1x128 group of a row, the contract of jetflow.precision.quant (vLLM's per_token_group_quant_fp8):
  absmax    = max(max|x|, 1e-10)
  scale_inv = absmax * 2^margin / 448                     (fp32, IEEE division)
  pow2:       scale_inv = 2^ceil(fp32(log2(scale_inv)))   (log2 in fp64)
  data      = e4m3(clamp(x / scale_inv, -448, 448))       (IEEE division, round to nearest even)
Divisions use `div_rn` (Triton's `/` is div.full.f32 on NVIDIA, up to 2 ulp off) and the E4M3 cast
rounds by bits (see _bits.py), so the bytes equal the CPU's. A group holding NaN or Inf gets a NaN
scale_inv, which the caller turns into an error (the FP8 cast alone would hide it). Each group is
computed on its own: a row's bytes never depend on the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetflow.kernels.triton._bits import fp32_to_e4m3, pow2_at_or_above

GROUP = 128
E4M3_MAX = tl.constexpr(448.0)  # a constexpr: kernels may read it
BLOCK_M = 16  # rows per program
FP_FUSION = False  # no a*b+c -> fma contraction: the interpreter (numpy) never fuses


@triton.jit(do_not_specialize=["M"])
def _quantize_1x128_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                           MARGIN_SCALE: tl.constexpr, POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                           GROUP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)  # (G,)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # (BM, G)
    ax = tl.abs(x)
    amax = tl.max(ax, axis=1)  # (BM,)
    bad = tl.max(((ax != ax) | (ax == float("inf"))).to(tl.int32), axis=1)  # NaN (x != x) or Inf in the group
    scale = tl.math.div_rn(tl.maximum(amax, 1e-10) * MARGIN_SCALE, E4M3_MAX)
    if POW2:
        scale = pow2_at_or_above(tl.maximum(scale, 1e-10))
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -E4M3_MAX), E4M3_MAX)
    tl.store(q_ptr + r64[:, None] * stride_qm + cols[None, :], fp32_to_e4m3(y), mask=mask)
    scale = tl.where(bad != 0, float("nan"), scale)
    tl.store(s_ptr + r64 * stride_sm + g, scale, mask=row_ok)


def quantize_1x128(x: torch.Tensor, scale_rule: str = "fp32", margin: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) fp32 / bf16 / fp16 -> (data (M, K) float8_e4m3fn, scale_inv (M, ceil(K/128)) fp32);
    NaN in scale_inv marks a group that held NaN or Inf."""
    if x.dim() != 2:
        raise ValueError(f"quantize_1x128 expects a 2-D tensor, got shape {tuple(x.shape)}")
    if scale_rule not in ("fp32", "pow2"):
        raise ValueError(f"scale_rule={scale_rule!r}: valid rules are ('fp32', 'pow2')")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    groups = triton.cdiv(k, GROUP)
    data = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m and k:
        grid = (triton.cdiv(m, BLOCK_M), groups)
        _quantize_1x128_kernel[grid](x, data, scale, m, k, x.stride(0), data.stride(0), scale.stride(0),
                                     MARGIN_SCALE=float(2.0**margin), POW2=scale_rule == "pow2", BLOCK_M=BLOCK_M,
                                     GROUP=GROUP, num_warps=4, enable_fp_fusion=FP_FUSION)
    return data, scale
