"""MXFP8: E4M3 (or E5M2) values in 1x32 blocks with one E8M0 power-of-two scale per block.

The recipe of Transformer Engine's MXFP8BlockScaling (OCP Microscaling formats v1.0), with vLLM's
activation contract (vllm/model_executor/layers/quantization/utils/mxfp8_utils.py), per block:

    ratio  = max(amax, FLT_MIN) / fp8_max             (fp32, a division, as vLLM; 448 for E4M3)
    e      = ceil(log2(ratio)), taken on the bits      (exact: ratio's exponent, + 1 unless a power of two)
    biased = clamp(e + 127, 0, 254)                   (the E8M0 byte; 255 would be NaN)
    codes  = fp8(clamp(x * 2^(127 - biased), +-fp8_max)), round to nearest even
    value  = codes * 2^(biased - 127)                  (exact in fp32)

Rounding the scale up means the block's amax never saturates. The exact ceil(log2) is what the
hardware conversion `cvt.rp.satfinite.ue8m0x2.f32` (TE, flashinfer) computes; vLLM's torch fallback
takes a float log2, which can land on the power of two for a ratio a hair above it (one binade lower:
its amax then saturates at fp8_max). An all-zero block gets biased exponent 0 and zero codes. NaN /
Inf anywhere is NonFiniteError naming the tensor (or a record under `defer_nonfinite`).

Blocks are (1, 32) for every operand as its GEMM reads it (along the contraction dim) and (32, 1)
for the columnwise copies of the backward GEMMs (dgrad's W, wgrad's operands along the tokens);
partial edge blocks are allowed (zero padding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from jetflow.kernels import invariant
from jetflow.precision.quant import checked_blocks, expand_scales
from jetflow.precision.recipe import FP8_DTYPES, FP8_MAX

MX_BLOCK = 32
FLT_MIN = torch.finfo(torch.float32).tiny


def e8m0_exponent(amax: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """The biased E8M0 exponent (uint8) of each block's scale, from its amax (see the module docstring)."""
    ratio = amax.float().clamp(min=FLT_MIN) / FP8_MAX[fmt]
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return (ceil_log2 + 127).clamp(0, 254).to(torch.uint8)


def e8m0_values(biased: torch.Tensor) -> torch.Tensor:
    """2^(biased - 127) in fp32 (2^-127 is an fp32 subnormal: exact)."""
    return torch.ldexp(torch.ones(biased.shape, device=biased.device), biased.to(torch.int32) - 127)


@dataclass
class MXTensor:
    """FP8 codes plus one E8M0 scale byte per block; value = codes * 2^(scale - 127)."""

    data: torch.Tensor  # (R, C) float8_e4m3fn or float8_e5m2
    scale: torch.Tensor  # (ceil(R / br), ceil(C / bc)) uint8, biased exponents
    block: tuple[int, int]  # (1, 32) or (32, 1)
    dequantized: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """Optional cached fp32 values (the exact GEMM's operand; kept with a weight for a step)."""
    packed: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """Cached panels of the dequantized weight for the canonical GEMM (`panels`)."""

    kind = "mxfp8"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def fmt(self) -> str:
        return "e5m2" if self.data.dtype == torch.float8_e5m2 else "e4m3"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.dequantized is None:
            scales = expand_scales(e8m0_values(self.scale), self.block, tuple(self.data.shape))
            return (self.data.float() * scales).to(dtype)
        return self.dequantized.to(dtype)

    def with_dequantized_cache(self) -> "MXTensor":
        if self.dequantized is None:
            self.dequantized = self.dequantize()
        return self

    def panels(self) -> torch.Tensor:
        """The canonical GEMM's panels of the exact fp32 values (jetflow.precision.microscaled), packed once."""
        if self.packed is None:
            self.packed = invariant.pack_weight(self.with_dequantized_cache().dequantize())
        return self.packed

    def t(self) -> "MXTensor":
        """The same bytes and scales, transposed (blocks transposed with them)."""
        cached = None if self.dequantized is None else self.dequantized.t()
        return MXTensor(self.data.t(), self.scale.t(), (self.block[1], self.block[0]), cached)

    def parts(self) -> dict[str, torch.Tensor]:
        """The raw tensors that define it (checksums, pickling)."""
        return {"data": self.data.contiguous().view(torch.uint8), "scale": self.scale.contiguous()}

    def scale_error(self) -> str | None:
        """What is wrong with its scales, or None: every byte is a valid E8M0 exponent but 255 (NaN)."""
        return "an E8M0 scale byte 255 (NaN)" if bool((self.scale == 255).any()) else None

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel()

    def __getstate__(self) -> dict:
        return {**self.parts(), "dtype": str(self.data.dtype).split(".")[-1], "block": self.block}

    def __setstate__(self, state: dict) -> None:
        self.data = state["data"].view(getattr(torch, state["dtype"]))
        self.scale, self.block = state["scale"], tuple(state["block"])
        self.dequantized = self.packed = None


def quantize_mx(x: torch.Tensor, block: tuple[int, int] = (1, MX_BLOCK), fmt: str = "e4m3",
                name: str = "tensor", check_finite: bool = True) -> MXTensor:
    """A 2-D tensor in (1, 32) or (32, 1) MXFP8 blocks."""
    if x.dim() != 2:
        raise ValueError(f"{name}: quantize_mx expects a 2-D tensor, got shape {tuple(x.shape)}")
    if fmt not in FP8_DTYPES:
        raise ValueError(f"{name}: fmt={fmt!r}; valid formats are {tuple(FP8_DTYPES)}")
    rows, cols = x.shape
    blocks, nr, nc, amax = checked_blocks(x, block, name, "MXFP8", check_finite)
    biased = e8m0_exponent(amax, fmt)  # (nr, nc)
    inverse = torch.ldexp(torch.ones(biased.shape, device=x.device), 127 - biased.to(torch.int32))  # exact
    top = FP8_MAX[fmt]
    scaled = (blocks * inverse[:, None, :, None]).clamp_(-top, top)
    data = scaled.to(FP8_DTYPES[fmt]).reshape(nr * block[0], nc * block[1])[:rows, :cols]
    return MXTensor(data.contiguous(), biased, tuple(block))
