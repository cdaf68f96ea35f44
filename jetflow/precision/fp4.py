"""E2M1 (FP4) codes: rounding to them, packing two per byte, and back.

E2M1 has one sign bit, two exponent bits and one mantissa bit; its eight magnitudes are

    code  0    1    2    3    4    5    6    7
    value 0    0.5  1    1.5  2    3    4    6

and code | 8 is the negative of code (8 is -0). Rounding to nearest, ties to the even code (the one
whose mantissa bit is 0: codes 0, 2, 4, 6), as `cvt.rn.satfinite.e2m1x2.f32` and TE's reference
quantizer (transformer_engine custom_recipes `cast_to_fp4x2`) do:

    |x| <= 0.25 -> 0     0.25 < |x| < 0.75 -> 0.5   0.75 <= |x| <= 1.25 -> 1   1.25 < |x| < 1.75 -> 1.5
    1.75 <= |x| <= 2.5 -> 2   2.5 < |x| < 3.5 -> 3   3.5 <= |x| <= 5 -> 4   |x| > 5 -> 6 (saturating)

A value is negative when x < 0 (so -0.0 gives code 0 and -0.1 code 8, as TE's reference). Stochastic
rounding picks the upper neighbour with probability (|x| - lo) / (hi - lo), so its expectation is |x|
(unbiased); its uniform draws come from a caller's torch.Generator.

Packing (vLLM's, ModelOpt's and `tl.dot_scaled`'s layout): element 2j in the low nibble of byte j and
element 2j + 1 in the high nibble, along the last dim (an odd length is padded with a zero code).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_GRID = torch.tensor(E2M1_VALUES)
_ROUND_DOWN_AT = torch.tensor([0.25, 1.25, 2.5, 5.0])  # ties between an even code and the odd one above
_ROUND_UP_AT = torch.tensor([0.75, 1.75, 3.5])  # ties between an odd code and the even one above


def _with_sign(magnitude_codes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (magnitude_codes | ((x < 0).to(torch.uint8) << 3)).to(torch.uint8)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0..15) of x (fp32) rounded to nearest even, saturating at +-6; x must be finite."""
    a = x.float().abs().unsqueeze(-1)
    code = (a > _ROUND_DOWN_AT.to(a.device)).sum(-1) + (a >= _ROUND_UP_AT.to(a.device)).sum(-1)
    return _with_sign(code.to(torch.uint8), x)


def round_e2m1_stochastic(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Codes of x rounded stochastically between its two E2M1 neighbours (unbiased), saturating at +-6."""
    a = x.float().abs().clamp(max=E2M1_MAX)
    grid = _GRID.to(a.device)
    lo_code = (torch.bucketize(a, grid, right=True) - 1).clamp(0, 6)  # grid[lo] <= a < grid[lo + 1] (6: the top)
    lo, hi = grid[lo_code], grid[lo_code + 1]
    u = torch.rand(a.shape, generator=generator, device=a.device)
    up = u < (a - lo) / (hi - lo)
    return _with_sign((lo_code + up.long()).to(torch.uint8), x)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (uint8, 0..15)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=codes.device)
    return table[codes.long()]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """(..., C) codes -> (..., ceil(C / 2)) bytes, the even element in the low nibble."""
    if codes.shape[-1] % 2:
        codes = F.pad(codes, (0, 1))
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """(..., ceil(cols / 2)) bytes -> (..., cols) codes."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)
    return codes[..., :cols]
