"""Roundings done on the bits (Triton device functions).

Why by bits: the kernels must compute the same values under TRITON_INTERPRET=1 (the CPU tests) as on
the GPU, and the interpreter's casts are wrong (triton 3.6 and 3.9): fp32 -> bf16 truncates, and
fp32 -> fp8 rounds ties away from zero and mishandles the carry into the exponent (triton PR #11897).
Integer arithmetic is the same everywhere, so these helpers give round-to-nearest-even on both, and
on the GPU they equal the hardware conversions (cvt.rn.bf16.f32, cvt.rn.satfinite.e4m3x2.f32) for
finite inputs: tests/gpu checks that.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_bf16(x):
    """fp32 -> bf16, round to nearest even (finite values and inf; NaN stays NaN)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def to_bf16(x):
    """A bf16 tensor as it is; anything else through fp32, rounded to nearest even."""
    if x.dtype == tl.bfloat16:
        return x
    return round_to_bf16(x.to(tl.float32))


@triton.jit
def fp32_to_e4m3(x):
    """fp32 in [-448, 448] -> float8_e4m3fn, round to nearest even (torch's `.to(float8_e4m3fn)`).

    Normal results (|x| >= 2^-6): the 23-bit mantissa is rounded to 3 bits on the integer bits and
    the exponent rebiased from 127 to 7 (a carry out of the mantissa lands in the exponent, as it
    should). Subnormal results (|x| < 2^-6, multiples of 2^-9): |x| * 512 is exact, and adding then
    subtracting 2^23 rounds it to an integer, to nearest even, in fp32 arithmetic.
    """
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    a = mag.to(tl.float32, bitcast=True)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(mag < 0x3C800000, sub, normal) | sign  # 0x3C800000 = 2^-6
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def pow2_at_or_above(s):
    """2^ceil(log2(s)) for positive normal fp32 s, log2 taken in fp64 and rounded once to fp32: the
    CPU quantizer's power-of-two scale rule (jetflow.precision.quant.compute_scale_inv), including
    its rounding (s just above 2^e can give 2^e when log2 rounds down to e)."""
    e = tl.math.ceil(tl.math.log2(s.to(tl.float64)).to(tl.float32)).to(tl.int32)
    return ((e + 127) << 23).to(tl.float32, bitcast=True)
