"""Block-scaled FP8 quantization: the numerical truth that every other path must reproduce.

One function, `quantize_blocks`, handles every granularity of the recipe by its block shape:
  weights      (N, K)  blocks (128, 128)
  activations  (M, K)  blocks (1, 128)   1x128 groups along the contraction dim
  columns      (M, K)  blocks (128, 1)   the weight-gradient GEMM's second operand
Partial blocks at the edges (576 = 4.5 x 128) are allowed: each edge block gets its own scale from
the values it really holds.

Scales follow vLLM's FP8 kernel contract (`per_token_group_quant_fp8`), so that a rollout engine
running vLLM's kernels quantizes activations to the very bytes the trainer does:
  absmax    = max(amax, 1e-10)                     (the reduction is seeded with eps)
  scale_inv = absmax * 2**margin / fp8_max         (fp32, a division; margin 0 in vLLM)
  pow2:       scale_inv = 2**ceil(log2(max(scale_inv, 1e-10)))
  data      = clamp(x / scale_inv, -fp8_max, fp8_max) cast with round to nearest even
so value = data * scale_inv. An all-zero block gets scale_inv = 1e-10 / fp8_max and exact zeros; a
block of tiny values (below 1e-10) quantizes to zeros. log2 is evaluated in fp64 and rounded once to
fp32 (a correctly rounded log2f up to double rounding), so the power of two does not depend on which
SIMD path evaluates it. A NaN or Inf anywhere is an error naming the tensor: the FP8 cast alone would
silently turn inf into 448.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from jetflow.kernels import invariant
from jetflow.precision.recipe import FP8_DTYPES, FP8_MAX


class NonFiniteError(ValueError):
    """A tensor offered for FP8 quantization holds NaN or Inf."""


@dataclass
class NonFiniteRecord:
    """What `defer_nonfinite` saw: the first quantizer's message, None while every tensor was finite."""

    message: str | None = None


_deferred: list[NonFiniteRecord] = []  # active defer_nonfinite records, innermost last (module state, not
# thread-local: autograd may run a backward's quantizers on another thread)


@contextmanager
def defer_nonfinite() -> Iterator[NonFiniteRecord]:
    """A quantizer meeting NaN/Inf records it here instead of raising NonFiniteError, and goes on (the
    NaN flows on through the computation). For a forward whose layers run collectives (expert
    parallelism's token dispatch): a rank that stopped at its first NaN would leave the others waiting in
    the next collective, so it finishes the step and the ranks then agree that the step was bad."""
    record = NonFiniteRecord()
    _deferred.append(record)
    try:
        yield record
    finally:
        _deferred.remove(record)


def _nonfinite(message: str) -> None:
    """Raise NonFiniteError(message), or record it under `defer_nonfinite`."""
    if not _deferred:
        raise NonFiniteError(message)
    if _deferred[-1].message is None:
        _deferred[-1].message = message


@dataclass
class QuantizedTensor:
    """FP8 bytes plus one fp32 scale_inv per block; value = data * scale_inv (block-broadcast)."""

    data: torch.Tensor  # (R, C) float8
    scale_inv: torch.Tensor  # (ceil(R / br), ceil(C / bc)) float32
    block: tuple[int, int]  # (br, bc)
    dequantized: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """Optional cached fp32 dequantization (the CPU emulation of a GEMM reads it instead of
    dequantizing the same weight again for every call)."""
    packed: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """Cached panels of the FP8 bytes for the canonical GEMM (exact numerics: `panels`)."""
    packed_t: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """Cached panels of the transposed bytes (the dgrad GEMM of an exact linear: `panels_t`)."""
    packed_values: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """Cached fp32 panels of the dequantized values (exact numerics on blocks no FP8 kernel reads: `value_panels`)."""

    kind = "fp8_block"
    """The recipe family whose bytes these are (jetflow.precision.mx.MXTensor and
    jetflow.precision.nvfp4.NVFP4Tensor carry mxfp8 / nvfp4 and the same methods)."""

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def parts(self) -> dict[str, torch.Tensor]:
        """The raw tensors that define it (checksums)."""
        return {"data": self.data.contiguous().view(torch.uint8), "scale_inv": self.scale_inv.contiguous()}

    def scale_error(self) -> str | None:
        """What is wrong with its scales, or None (a zero, negative or non-finite scale_inv is damage:
        users of FP8 RL report all-zero and stale scales after a weight sync)."""
        if not bool(torch.isfinite(self.scale_inv).all()) or bool((self.scale_inv <= 0).any()):
            return "zero, negative or non-finite scale_inv"
        return None

    @property
    def fmt(self) -> str:
        return "e5m2" if self.data.dtype == torch.float8_e5m2 else "e4m3"

    def panels(self) -> torch.Tensor:
        """The canonical GEMM's panels of the bytes (jetflow.kernels.invariant.pack_weight), packed once:
        a weight's QuantizedTensor lives one weight version (PrecisionLinear caches it per version, a
        rollout keeps the shipped one)."""
        if self.packed is None:
            self.packed = invariant.pack_weight(self.data)
        return self.packed

    def panels_t(self) -> torch.Tensor:
        """The panels of the transposed bytes (the dgrad GEMM's weight), packed once."""
        if self.packed_t is None:
            self.packed_t = invariant.pack_weight(self.data.t())
        return self.packed_t

    def value_panels(self) -> torch.Tensor:
        """The canonical fp32 GEMM's panels of the dequantized values, packed once (the exact product of
        block sizes other than 128x128, jetflow.precision.gemm.fp8_matmul)."""
        if self.packed_values is None:
            self.packed_values = invariant.pack_weight(dequantize(self, torch.float32))
        return self.packed_values

    def share_panels(self, view: torch.Tensor) -> None:
        """Use `view` (its panels, already packed, inside a larger tensor: the sibling linears' panels
        side by side, jetflow.precision.exact.exact_linears) instead of a copy of its own."""
        self.packed = view

    def __getstate__(self) -> dict:
        """Pickle (Ray's object store, torch.save) as raw bytes: float8 storages do not unpickle in every
        path (Ray fails on them), and the fp32 dequantized cache stays behind: only FP8 bytes and scales
        travel."""
        return {"bytes": self.data.contiguous().view(torch.uint8), "dtype": str(self.data.dtype).split(".")[-1],
                "scale_inv": self.scale_inv, "block": self.block}

    def __setstate__(self, state: dict) -> None:
        self.data = state["bytes"].view(getattr(torch, state["dtype"]))
        self.scale_inv, self.block, self.dequantized = state["scale_inv"], tuple(state["block"]), None
        self.packed = self.packed_t = self.packed_values = None

    def t(self) -> "QuantizedTensor":
        """Transpose: the same bytes and scales, blocks transposed (exact, no requantization)."""
        cached = None if self.dequantized is None else self.dequantized.t()
        return QuantizedTensor(self.data.t(), self.scale_inv.t(), (self.block[1], self.block[0]), cached)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.dequantized is not None:
            return self.dequantized.to(dtype)
        return dequantize(self, dtype)

    def with_dequantized_cache(self) -> "QuantizedTensor":
        """Store the fp32 dequantization alongside the bytes (for the CPU emulation path)."""
        if self.dequantized is None:
            self.dequantized = dequantize(self, torch.float32)
        return self

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale_inv.numel() * 4


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


AMAX_EPS = 1e-10
"""vLLM's eps: the seed of the group absmax reduction (and the floor of log2's argument under pow2)."""


def compute_scale_inv(amax: torch.Tensor, fmt: str, scale_rule: str = "fp32", margin: int = 0) -> torch.Tensor:
    """Per-block scale_inv (fp32) from per-block amax, by vLLM's contract (see the module docstring)."""
    absmax = amax.float().clamp(min=AMAX_EPS)
    scale_inv = absmax * (2.0**margin) / FP8_MAX[fmt]
    if scale_rule == "pow2":
        log2 = torch.log2(scale_inv.clamp(min=AMAX_EPS).double()).float()  # fp32 log2, rounded once
        scale_inv = torch.ldexp(torch.ones_like(scale_inv), torch.ceil(log2).int())  # 2**ceil(...), exact
    elif scale_rule != "fp32":
        raise ValueError(f"scale_rule={scale_rule!r}: valid rules are ('fp32', 'pow2')")
    return scale_inv


def _padded_blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """View a 2-D tensor as (nr, br, nc, bc) blocks, zero-padding partial edge blocks."""
    rows, cols = x.shape
    br, bc = block
    nr, nc = _ceil_div(rows, br), _ceil_div(cols, bc)
    if nr * br != rows or nc * bc != cols:
        x = F.pad(x, (0, nc * bc - cols, 0, nr * br - rows))
    return x.reshape(nr, br, nc, bc), nr, nc


def checked_blocks(x: torch.Tensor, block: tuple[int, int], name: str, target: str,
                   check_finite: bool = True) -> tuple[torch.Tensor, int, int, torch.Tensor]:
    """x (R, C) -> its fp32 blocks (nr, br, nc, bc), nr, nc and each block's amax (nr, nc); a NaN or
    Inf (when `check_finite`) is a NonFiniteError naming the tensor, the block and `target` (the format
    it was to be quantized to)."""
    blocks, nr, nc = _padded_blocks(x.float(), block)  # (nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3))  # (nr, nc)
    if check_finite and not bool(torch.isfinite(amax).all()):
        bad = (~torch.isfinite(amax)).nonzero()[0].tolist()
        _nonfinite(f"{name}: NaN or Inf in block {tuple(bad)} (block size {block}) of a tensor of shape "
                   f"{tuple(x.shape)}; refusing to quantize it to {target} (the cast would hide it)")
    return blocks, nr, nc, amax


def quantize_blocks(x: torch.Tensor, block: tuple[int, int], fmt: str = "e4m3", scale_rule: str = "fp32",
                    margin: int = 0, name: str = "tensor", check_finite: bool = True) -> QuantizedTensor:
    """Quantize a 2-D tensor with one scale per (br, bc) block."""
    if x.dim() != 2:
        raise ValueError(f"{name}: quantize_blocks expects a 2-D tensor, got shape {tuple(x.shape)}")
    if fmt not in FP8_DTYPES:
        raise ValueError(f"{name}: fmt={fmt!r}; valid formats are {tuple(FP8_DTYPES)}")
    if x.is_cuda and tuple(block) == (1, 128) and fmt == "e4m3":
        return _quantize_1x128_cuda(x, scale_rule, margin, name, check_finite)
    rows, cols = x.shape
    blocks, nr, nc, amax = checked_blocks(x, block, name, "FP8", check_finite)
    scale_inv = compute_scale_inv(amax, fmt, scale_rule, margin)  # (nr, nc)
    fp8_max = FP8_MAX[fmt]
    scaled = (blocks / scale_inv[:, None, :, None]).clamp_(-fp8_max, fp8_max)
    data = scaled.to(FP8_DTYPES[fmt]).reshape(nr * block[0], nc * block[1])
    if data.shape != (rows, cols):
        data = data[:rows, :cols].contiguous()
    return QuantizedTensor(data, scale_inv, tuple(block))


def row_shard_amax(rows: torch.Tensor, row_offset: int, total_rows: int, block: tuple[int, int],
                   name: str = "tensor") -> torch.Tensor:
    """The per-block amax (nr, nc) of a (R, C) tensor's rows [row_offset, row_offset + r) given as `rows`
    (r, C): the blocks those rows touch hold their part's amax, the others 0. The elementwise MAX of every
    row shard's grid is the whole tensor's block amax, from which each shard quantizes its own rows to the
    bytes `quantize_blocks` gives the whole tensor (`quantize_row_shard`): a block's scale depends on the
    block alone, so shards need agree only on the amax of the blocks they split."""
    br, bc = block
    nr, nc = _ceil_div(total_rows, br), _ceil_div(rows.shape[1], bc)
    amax = torch.zeros(nr, nc, dtype=torch.float32, device=rows.device)
    if rows.shape[0] == 0:
        return amax
    first = row_offset // br
    top = row_offset - first * br  # rows of the first block above this shard
    padded = F.pad(rows.float(), (0, 0, top, 0))  # (top + r, C): starts on a block boundary
    _, _, _, part = checked_blocks(padded, block, name, "FP8")  # (blocks touched, nc)
    amax[first:first + part.shape[0]] = part
    return amax


def quantize_row_shard(rows: torch.Tensor, row_offset: int, scale_inv: torch.Tensor, block: tuple[int, int],
                       fmt: str = "e4m3") -> torch.Tensor:
    """`rows` (r, C), rows [row_offset, row_offset + r) of a tensor whose block scales are `scale_inv`
    (nr, nc), to FP8 (r, C): each element divided by its block's scale, clamped and cast, as
    `quantize_blocks` does, so the shards' bytes stacked are the whole tensor's bytes."""
    br, bc = block
    first = row_offset // br
    last = _ceil_div(row_offset + rows.shape[0], br)
    s = scale_inv[first:last].repeat_interleave(br, 0).repeat_interleave(bc, 1)  # (blocks * br, nc * bc)
    top = row_offset - first * br
    s = s[top:top + rows.shape[0], :rows.shape[1]]  # (r, C)
    fp8_max = FP8_MAX[fmt]
    return (rows.float() / s).clamp_(-fp8_max, fp8_max).to(FP8_DTYPES[fmt])


def _quantize_1x128_cuda(x: torch.Tensor, scale_rule: str, margin: int, name: str,
                         check_finite: bool) -> QuantizedTensor:
    """Activations on CUDA: jetflow's Triton kernel, byte-identical to the computation above (one
    launch instead of a chain of torch ops whose reductions CUDA may order by shape)."""
    from jetflow.kernels.triton import quantize_1x128
    data, scale_inv = quantize_1x128(x, scale_rule, margin)  # (M, K) e4m3, (M, ceil(K/128)); NaN: bad group
    if check_finite and not bool(torch.isfinite(scale_inv).all()):
        bad = (~torch.isfinite(scale_inv)).nonzero()[0].tolist()
        _nonfinite(f"{name}: NaN or Inf in block {tuple(bad)} (block size (1, 128)) of a tensor of shape "
                   f"{tuple(x.shape)}; refusing to quantize it to FP8 (the cast would hide it)")
    return QuantizedTensor(data, scale_inv, (1, 128))


def expand_scales(scale_inv: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Broadcast per-block scales to a full (R, C) tensor."""
    full = scale_inv.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[: shape[0], : shape[1]]


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    rows, cols = q.data.shape
    br, bc = q.block
    nr, nc = q.scale_inv.shape
    if nr * br == rows and nc * bc == cols:
        blocks = q.data.float().reshape(nr, br, nc, bc) * q.scale_inv[:, None, :, None]
        return blocks.reshape(rows, cols).to(dtype)
    return (q.data.float() * expand_scales(q.scale_inv, q.block, (rows, cols))).to(dtype)


def quantize_weight(w: torch.Tensor, block: tuple[int, int] = (128, 128), fmt: str = "e4m3",
                    scale_rule: str = "fp32", margin: int = 0, name: str = "weight") -> QuantizedTensor:
    """(N, K) weight with one scale per 128x128 block."""
    return quantize_blocks(w, block, fmt, scale_rule, margin, name)


def quantize_rowwise_groups(x: torch.Tensor, group: int = 128, fmt: str = "e4m3", scale_rule: str = "fp32",
                            margin: int = 0, name: str = "activation") -> QuantizedTensor:
    """1 x group scaling along the last dim; leading dims are flattened to rows: (..., K) -> (M, K)."""
    return quantize_blocks(x.reshape(-1, x.shape[-1]), (1, group), fmt, scale_rule, margin, name)


def quantize_colwise_groups(x: torch.Tensor, group: int = 128, fmt: str = "e4m3", scale_rule: str = "fp32",
                            margin: int = 0, name: str = "activation") -> QuantizedTensor:
    """group x 1 scaling (groups run along the rows): (..., K) -> (M, K) with (128, 1) blocks."""
    return quantize_blocks(x.reshape(-1, x.shape[-1]), (group, 1), fmt, scale_rule, margin, name)


def fake_quantize(x: torch.Tensor, block: tuple[int, int], fmt: str = "e4m3", scale_rule: str = "fp32",
                  margin: int = 0, name: str = "tensor") -> torch.Tensor:
    """Quantize then dequantize, in x's dtype: the value an FP8 GEMM actually sees."""
    shape = x.shape
    q = quantize_blocks(x.reshape(-1, shape[-1]), block, fmt, scale_rule, margin, name)
    return dequantize(q, x.dtype).reshape(shape)
