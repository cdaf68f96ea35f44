"""GEMM weight packing: an (N, K) weight -> the CPU GEMMs' panels of NR columns (NR = `panel_width`), once
per weight version, and the check that a packed weight fits a GEMM's K and N."""

from __future__ import annotations

import torch
from torch import Tensor

from jetflow.kernels.invariant._lib import isa, library, ptr


def panel_width(variant: str = "native") -> int:
    return library(variant).jf_panel_width()


WEIGHT_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.int32: 3}
"""Packed weight dtype -> the kernels' format code; int32 = bf16 pairs (`pack_weight` on AVX512_BF16)."""


def pack_weight(w: Tensor, variant: str = "native") -> Tensor:
    """(N, K) weight -> (ceil(N / NR), K, NR) panels (zero-padded columns) in the weight's own format:
    float32, bfloat16 or float8_e4m3fn (FP8 bytes): the GEMM reads those bytes and converts them in
    registers. Where the build uses AVX512_BF16's vdpbf16ps, E4M3 and bf16 weights are packed instead as
    the instruction's operand, bf16 pairs: (ceil(N / NR), ceil(K / 2), NR) int32, each the bf16 values of
    k = 2i and 2i + 1 (E4M3: 2i in the low half; bf16: swapped, so the chain runs in order; exact: every
    E4M3 value is a bf16 value; 2 bytes a weight, half of fp32), converted once per weight version instead of
    per call. The result is opaque: pass it to `gemm` (bf16 weights) or `fp8_gemm` (E4M3 weights). On CUDA the
    Triton GEMMs read the (N, K) weight itself (returned as it is)."""
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        raise ValueError(f"pack_weight: float32, bfloat16 or float8_e4m3fn weights, got {w.dtype}")
    w = w.detach()
    if w.is_cuda:
        return w.contiguous()
    lib = library(variant)
    nr = lib.jf_panel_width()
    n, k = w.shape
    p = -(-n // nr)
    bits = w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w  # any strides (W^T views too)
    panels = torch.empty(p, k, nr, dtype=bits.dtype)  # columns past N: zero bytes, 0.0 in every format
    lib.jf_pack_panels(ptr(bits), bits.element_size(), n, k, bits.stride(0), bits.stride(1), ptr(panels))
    if w.dtype != torch.float32 and isa(variant) == "avx512_bf16":
        pairs = torch.empty(p, -(-k // 2), nr, dtype=torch.int32)
        if lib.jf_pack_pairs(ptr(panels), WEIGHT_FORMATS[w.dtype], p, k, ptr(pairs)) == 0:
            return pairs  # else a bf16 weight with a value below 2^-56: the FMA path reads the bf16 panels
    return panels.view(w.dtype) if w.dtype == torch.float8_e4m3fn else panels


def check_packed(lib, packed: Tensor, k: int, n: int, dtypes: tuple, what: str) -> int:
    """The kernels' format code of `packed` after checking it fits K and N."""
    rows = -(-k // 2) if packed.dtype == torch.int32 else k
    if packed.dtype not in dtypes or packed.dim() != 3 or packed.shape[1] != rows \
            or packed.shape[2] != lib.jf_panel_width() or packed.shape[0] * packed.shape[2] < n:
        raise ValueError(f"packed weight {tuple(packed.shape)} {packed.dtype} does not fit {what} and N={n} "
                         "(pack it with pack_weight, same variant)")
    return WEIGHT_FORMATS[packed.dtype]
