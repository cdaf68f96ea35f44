"""NVFP4: E2M1 values in 16-element blocks, an E4M3 scale per block and an fp32 scale above them.

Transformer Engine's NVFP4BlockScaling, quantized with the arithmetic of TE's reference quantizer
(transformer_engine/pytorch/custom_recipes/quantization_ref_nvfp4.py), all in fp32:

    S_enc   = min(448 * 6 / amax_t, FLT_MAX)            amax_t: the tensor's amax, or its row's (below)
    s_b     = e4m3(clamp(amax_b * (S_enc * fp32(1/6)), +-448))    the block's E4M3 decode scale (RNE)
    enc_b   = min(1 / (s_b * (1 / S_enc)), FLT_MAX)
    codes   = e2m1(clamp(x * enc_b, +-6))               round to nearest even (jetflow.precision.fp4),
                                                        or stochastically (gradients)
and the value of a code is   code * s_b * d,   d = amax_t / (6 * 448)   (fp32, one division): the
tensor scale ModelOpt stores (`weight_scale_2`, `input_scale`) and vLLM multiplies in its GEMM
epilogue, alpha = d_x * d_w. TE's epilogue takes alpha = amax_x * amax_w / (6 * 6 * 448 * 448)
instead, within two ulps of it; jetflow keeps the checkpoint's d so that an export computes what
the trainer computed. code * s_b is exact in fp32 (a 2-bit by 4-bit significand), so the exact
GEMM (jetflow.precision.microscaled) multiplies `block_values()` exactly and rounds once by alpha.

Blocks: (16, 16) for weights (one scale per 16x16 tile, so W and W^T are the same bytes: dgrad
reads `t()`), (1, 16) along the contraction dim for activations and gradients. Tensor scales: one
per tensor for weights and gradients (TE), one per token row for the forward's activations (TE's
`row_scaled_nvfp4` option), so that a token's bytes do not depend on the other tokens of its batch:
with one amax over the batch, a decode step and the trainer's full forward would quantize the same
token differently. The wgrad GEMM's operands pass a 16-point random Hadamard transform along the
tokens first (`hadamard16`, TE's matrix and sign vector): it spreads outliers, and the same
orthogonal transform on both operands leaves dY^T X unchanged up to quantization.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from jetflow.kernels import invariant
from jetflow.precision import fp4
from jetflow.precision.quant import _nonfinite, expand_scales

NVFP4_BLOCK = 16
E4M3_MAX = 448.0
TENSOR_SCALE_DIVISOR = E4M3_MAX * fp4.E2M1_MAX  # 2688: amax_t / 2688 is the tensor (decode) scale
FLT_MAX = torch.finfo(torch.float32).max
WGRAD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""TE's fixed random sign vector of the wgrad Hadamard transform (get_wgrad_sign_vector)."""


@dataclass
class NVFP4Tensor:
    """Packed E2M1 codes, E4M3 block scales and the fp32 tensor scale(s); value = code * scale * d."""

    data: torch.Tensor  # (R, ceil(C / 2)) uint8, two codes per byte along C (low nibble first)
    scale: torch.Tensor  # (ceil(R / br), ceil(C / 16)) float8_e4m3fn
    tensor_scale: torch.Tensor  # () fp32 d, or (R,) one per row (row-scaled activations)
    block: tuple[int, int]  # (16, 16) weights, (1, 16) activations and gradients
    cols: int  # C
    values: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """Optional cached code * block scale in fp32 (exact): the exact GEMM's operand."""
    packed: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """Cached panels of `values` for the canonical GEMM (`panels`)."""

    kind = "nvfp4"
    fmt = "e2m1"

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.cols))

    def codes(self) -> torch.Tensor:
        """(R, C) uint8 codes, unpacked."""
        return fp4.unpack(self.data, self.cols)

    def block_values(self) -> torch.Tensor:
        """(R, C) fp32 code * block scale: exact (the tensor scale not applied)."""
        if self.values is not None:
            return self.values
        scales = expand_scales(self.scale.float(), self.block, tuple(self.shape))
        return fp4.e2m1_values(self.codes()) * scales

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        d = self.tensor_scale if self.tensor_scale.dim() == 0 else self.tensor_scale[:, None]
        return (self.block_values() * d).to(dtype)

    def with_dequantized_cache(self) -> "NVFP4Tensor":
        if self.values is None:
            self.values = self.block_values()
        return self

    def panels(self) -> torch.Tensor:
        """The canonical GEMM's panels of `block_values` (jetflow.precision.microscaled), packed once."""
        if self.packed is None:
            self.packed = invariant.pack_weight(self.with_dequantized_cache().block_values())
        return self.packed

    def t(self) -> "NVFP4Tensor":
        """W^T with the same codes and scales (16x16 blocks: each tile's scale serves both)."""
        if self.block[0] != self.block[1] or self.tensor_scale.dim():
            raise ValueError(f"an NVFP4 tensor in {self.block} blocks with a per-row scale has no transpose")
        cached = None if self.values is None else self.values.t()
        return NVFP4Tensor(fp4.pack(self.codes().t()), self.scale.t(), self.tensor_scale, self.block,
                           self.data.shape[0], cached)

    def parts(self) -> dict[str, torch.Tensor]:
        """The raw tensors that define it (checksums, pickling)."""
        return {"data": self.data.contiguous(), "scale": self.scale.contiguous().view(torch.uint8),
                "tensor_scale": self.tensor_scale.reshape(-1).contiguous()}  # (1,) or (R,)

    def scale_error(self) -> str | None:
        """What is wrong with its scales, or None (a zero block scale is an all-zero block: valid)."""
        s = self.scale.float()
        if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
            return "a NaN or negative E4M3 block scale"
        d = self.tensor_scale
        if not bool(torch.isfinite(d).all()) or bool((d < 0).any()):
            return "a non-finite or negative tensor scale"
        return None

    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel() + self.tensor_scale.numel() * 4

    def __getstate__(self) -> dict:
        return {**self.parts(), "block": self.block, "cols": self.cols, "per_row": self.tensor_scale.dim() == 1}

    def __setstate__(self, state: dict) -> None:
        self.data, self.scale = state["data"], state["scale"].view(torch.float8_e4m3fn)
        d = state["tensor_scale"]
        self.tensor_scale = d if state["per_row"] else d.reshape(())
        self.block, self.cols = tuple(state["block"]), state["cols"]
        self.values = self.packed = None


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(R, C) zero-padded to whole blocks, viewed (nr, br, nc, bc)."""
    rows, cols = x.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    return F.pad(x, (0, nc * bc - cols, 0, nr * br - rows)).reshape(nr, br, nc, bc)


def quantize_nvfp4(x: torch.Tensor, block: tuple[int, int] = (1, NVFP4_BLOCK), per_row: bool = False,
                   generator: torch.Generator | None = None, name: str = "tensor",
                   check_finite: bool = True) -> NVFP4Tensor:
    """A 2-D tensor (R, C) in NVFP4: `block` (1, 16) or (16, 16); `per_row`: one tensor scale per row
    ((1, 16) blocks only); `generator`: stochastic rounding from it (else round to nearest even)."""
    if x.dim() != 2:
        raise ValueError(f"{name}: quantize_nvfp4 expects a 2-D tensor, got shape {tuple(x.shape)}")
    if block not in ((1, NVFP4_BLOCK), (NVFP4_BLOCK, NVFP4_BLOCK)) or (per_row and block[0] != 1):
        raise ValueError(f"{name}: NVFP4 blocks are (1, 16) or (16, 16) (per_row with (1, 16)), got {block}")
    rows, cols = x.shape
    x = x.float()
    amax_t = x.abs().amax(dim=1) if per_row else x.abs().amax()  # (R,) or ()
    if rows * cols == 0:
        amax_t = torch.zeros(rows) if per_row else torch.zeros(())
    if check_finite and not bool(torch.isfinite(amax_t).all()):
        where = f" in row {int((~torch.isfinite(amax_t.reshape(-1))).nonzero()[0])}" if per_row else ""
        _nonfinite(f"{name}: NaN or Inf{where} of a tensor of shape {tuple(x.shape)}; refusing to quantize it "
                   "to NVFP4 (the cast would hide it)")
    s_enc = torch.clamp(TENSOR_SCALE_DIVISOR / amax_t, max=FLT_MAX)
    s_enc = torch.where(s_enc == 0, torch.ones_like(s_enc), s_enc)
    global_decode = 1.0 / s_enc
    blocks = _blocks(x, block)  # (nr, br, nc, bc)
    amax_b = blocks.abs().amax(dim=(1, 3))  # (nr, nc)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # a tensor-scale quantity broadcast over (nr, nc)
        return t[:, None] if per_row else t

    multiplier = s_enc * torch.tensor(1.0 / 6.0, dtype=torch.float32)
    scale = (amax_b * per_block(multiplier)).clamp(max=FLT_MAX).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    encode = torch.clamp(1.0 / (scale.float() * per_block(global_decode)), max=FLT_MAX)  # (nr, nc)
    scaled = (blocks * encode[:, None, :, None]).clamp(-fp4.E2M1_MAX, fp4.E2M1_MAX)
    scaled = scaled.reshape(blocks.shape[0] * block[0], -1)[:rows, :cols]
    codes = fp4.round_e2m1(scaled) if generator is None else fp4.round_e2m1_stochastic(scaled, generator)
    d = amax_t / TENSOR_SCALE_DIVISOR
    return NVFP4Tensor(fp4.pack(codes), scale, d, tuple(block), cols)


def hadamard16(x: torch.Tensor) -> torch.Tensor:
    """x (..., L), L a multiple of 16: each run of 16 along the last dim times TE's wgrad transform
    diag(WGRAD_SIGNS) @ H16 / 4 (H16 Sylvester's Hadamard matrix: the transform is orthogonal)."""
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"hadamard16: last dim {x.shape[-1]} is not a multiple of 16")
    h = torch.ones(1, 1)
    while h.shape[0] < NVFP4_BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    transform = (torch.tensor(WGRAD_SIGNS, dtype=torch.float32)[:, None] * h * 0.25).to(x.device)
    return (x.float().reshape(-1, NVFP4_BLOCK) @ transform).reshape(x.shape)
