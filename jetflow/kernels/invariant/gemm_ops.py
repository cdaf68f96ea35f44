"""The batch-invariant GEMMs: fp32 / bf16 (`gemm`, `prepare_gemm`), FP8 (`fp8_gemm`, and fused with the
activation's 1x128 quantization `quantized_fp8_gemm`, `prepare_quantized_fp8_gemm`), the differentiable
`matmul` (its autograd function `_Matmul`) and the weight gradient in one order (`weight_grad`). Every
output element is the canonical reduction of jetflow.kernels.canonical: csrc/gemm.cpp on the CPU, the
Triton GEMMs (jetflow.kernels.triton) on CUDA."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from jetflow.kernels import canonical
from jetflow.kernels.invariant._lib import check_device, cuda_kernels, library, ptr
from jetflow.kernels.invariant.packing import check_packed, pack_weight


def _groups(k: int, groups: int | None) -> int:
    groups = canonical.tree_width(k) if groups is None else int(groups)
    canonical.check_groups(k, groups)
    return groups


def gemm(x2: Tensor, packed: Tensor, n: int, variant: str = "native", groups: int | None = None) -> Tensor:
    """x2 (M, K) fp32 @ W^T -> (M, N) fp32, the canonical reduction (jetflow.kernels.canonical) with
    `groups` groups (default tree_width(K)); W given as `pack_weight(W)` (fp32 or bf16); no autograd."""
    if x2.is_cuda:
        dot = "bf16" if packed.dtype == torch.bfloat16 else "fp32"
        return cuda_kernels.dense_gemm(x2, packed[:n], dot, groups=_groups(x2.shape[1], groups))
    return prepare_gemm(packed, n, x2.shape[1], variant, groups)(x2)


def prepare_gemm(packed: Tensor, n: int, k: int, variant: str = "native",
                 groups: int | None = None) -> Callable[[Tensor], Tensor]:
    """`gemm(x2, packed, n, variant, groups)` on the CPU with the weight's checks done once: a function
    of x2 (M, K) that allocates the output and calls the kernel. An exact linear keeps one per weight
    version (jetflow.precision.exact) instead of repeating the checks on each of a decode step's four GEMM
    calls a layer."""
    lib = library(variant)
    groups = _groups(k, groups)
    wfmt = check_packed(lib, packed, k, n, (torch.float32, torch.bfloat16, torch.int32), f"K={k}")
    kernel = lib.jf_gemm

    def run(x2: Tensor) -> Tensor:
        m = _rows(x2, k)
        x2 = x2.float()
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        kernel(ptr(x2), m, k, x2.stride(0), ptr(packed), wfmt, n, ptr(out), n, groups)
        return out
    return run


def _rows(x2: Tensor, k: int) -> int:
    """M of a CPU GEMM's x2 (M, K), refusing any other K (the kernel would read past x2)."""
    if x2.dim() != 2 or x2.shape[1] != k or x2.is_cuda:
        raise ValueError(f"x {tuple(x2.shape)} on {x2.device}: a CPU (M, {k}) tensor expected")
    return x2.shape[0]


def fp8_gemm(xq: Tensor, sx: Tensor, packed: Tensor, sw: Tensor, n: int, variant: str = "native",
             groups: int | None = None, weight_rows_per_scale: int = 128) -> Tensor:
    """xq (M, K) E4M3 with sx (M, ceil(K/128)) @ W^T -> (M, N) fp32, W (N, K) E4M3 given as
    `pack_weight(W)` with its block scales sw: (ceil(N/128), ceil(K/128)) for 128x128 blocks, or
    (N, ceil(K/128)) for 1x128 groups (`weight_rows_per_scale=1`: the weight-gradient GEMM's second
    operand). Each 128-K block's chain over the raw FP8 values times sx * sw, then the groups and the
    tree (jetflow.kernels.canonical)."""
    m, k = xq.shape
    if xq.dtype != torch.float8_e4m3fn or packed.dtype not in (torch.float8_e4m3fn, torch.int32):
        raise ValueError(f"fp8_gemm: E4M3 operands, got {xq.dtype} and {packed.dtype}")
    if tuple(sx.shape) != (m, -(-k // canonical.BLOCK_K)):
        raise ValueError(f"fp8_gemm scales: sx {tuple(sx.shape)} for x {tuple(xq.shape)}")
    if xq.is_cuda:
        groups = _groups(k, groups)
        _check_weight_scales(k, sw, n, weight_rows_per_scale)
        return cuda_kernels.fp8_gemm(xq, sx, packed[:n], sw, weight_rows_per_scale, torch.float32, groups=groups)
    lib = library(variant)
    wfmt, sw, sw_ld, groups = _fp8_weight_args(lib, k, packed, sw, n, groups, weight_rows_per_scale)
    if xq.stride(1) != 1:
        xq = xq.contiguous()
    sx = sx.float().contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    lib.jf_gemm_fp8(ptr(xq), m, k, xq.stride(0), ptr(sx), sx.shape[1], ptr(packed), wfmt, ptr(sw), sw_ld,
                    weight_rows_per_scale, n, ptr(out), n, groups)
    return out


def quantized_fp8_gemm(x2: Tensor, scale_rule: str, margin: int, packed: Tensor, sw: Tensor, n: int,
                       variant: str = "native", groups: int | None = None,
                       weight_rows_per_scale: int = 128) -> Tensor | None:
    """fp8_gemm(*quantize_1x128(x2, scale_rule, margin)[:2], packed, sw, n, ...) on the CPU, the same bits
    in one kernel call (an exact FP8 linear's fprop: a decode step pays it per linear); None, computing
    nothing, when a 1x128 group of x2 holds NaN / Inf (the caller's quantizer reports it)."""
    return prepare_quantized_fp8_gemm(scale_rule, margin, packed, sw, n, x2.shape[1], variant, groups,
                                      weight_rows_per_scale)(x2)


def prepare_quantized_fp8_gemm(scale_rule: str, margin: int, packed: Tensor, sw: Tensor, n: int, k: int,
                               variant: str = "native", groups: int | None = None,
                               weight_rows_per_scale: int = 128) -> Callable[[Tensor], Tensor | None]:
    """`quantized_fp8_gemm(x2, scale_rule, margin, packed, sw, n, ...)` with the weight's checks done once
    (as `prepare_gemm`): a function of x2 (M, K)."""
    if scale_rule not in ("fp32", "pow2"):
        raise ValueError(f"scale_rule={scale_rule!r}: 'fp32' or 'pow2'")
    lib = library(variant)
    wfmt, sw, sw_ld, groups = _fp8_weight_args(lib, k, packed, sw, n, groups, weight_rows_per_scale)
    kernel, pow2, margin_scale = lib.jf_linear_fp8, int(scale_rule == "pow2"), float(2.0**margin)

    def run(x2: Tensor) -> Tensor | None:
        m = _rows(x2, k)
        x2 = x2.float()
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        bad = kernel(ptr(x2), m, k, x2.stride(0), pow2, margin_scale, ptr(packed), wfmt, ptr(sw), sw_ld,
                     weight_rows_per_scale, n, ptr(out), n, groups)
        return None if bad else out
    return run


def _check_weight_scales(k: int, sw: Tensor, n: int, weight_rows_per_scale: int) -> None:
    if weight_rows_per_scale not in (1, canonical.BLOCK_K):
        raise ValueError(f"weight_rows_per_scale={weight_rows_per_scale}: 1 or {canonical.BLOCK_K}")
    if sw.shape[1] != -(-k // canonical.BLOCK_K) or sw.shape[0] * weight_rows_per_scale < n:
        raise ValueError(f"fp8_gemm scales: sw {tuple(sw.shape)} for K={k}, N={n}")


def _fp8_weight_args(lib, k: int, packed: Tensor, sw: Tensor, n: int, groups: int | None,
                     weight_rows_per_scale: int) -> tuple[int, Tensor, int, int]:
    """The CPU FP8 GEMM's weight arguments after checking them: (format code, scales as the kernel reads
    them, their row stride, groups)."""
    groups = _groups(k, groups)
    _check_weight_scales(k, sw, n, weight_rows_per_scale)
    wfmt = check_packed(lib, packed, k, n, (torch.float8_e4m3fn, torch.int32), f"K={k}")
    if weight_rows_per_scale == 1:  # (nb, P * NR): the scales of a panel's columns are one vector load
        width = packed.shape[0] * packed.shape[2]
        sw = sw.float().t()  # no copy for a caller that keeps them so: the transpose of (nb, width) rows
        if sw.shape[1] != width:
            sw = F.pad(sw, (0, width - sw.shape[1]))
        sw, sw_ld = sw.contiguous(), width
    else:
        sw, sw_ld = sw.float().contiguous(), sw.shape[1]
    return wfmt, sw, sw_ld, groups


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, packed, groups, ordered_wgrad):
        ctx.save_for_backward(x, weight)
        ctx.ordered_wgrad = ordered_wgrad
        x2 = x.reshape(-1, x.shape[-1])
        y = gemm(x2, packed, weight.shape[0], groups=groups)
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])  # (M, N), (M, K)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (g2 @ weight.to(g2.dtype)).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (weight_grad(g2, x2) if ctx.ordered_wgrad else g2.t() @ x2.to(g2.dtype)).to(weight.dtype)
        return grad_x, grad_w, None, None, None


def weight_grad(g2: Tensor, x2: Tensor) -> Tensor:
    """g2^T @ x2: (M, N), (M, K) -> (N, K) fp32 over the M tokens in the FP8 wgrad's order (128-token blocks, chains
    from 0, added in order): a zero row of g2 adds exact zeros, so only which tokens share a block counts."""
    return gemm(g2.float().t(), pack_weight(x2.float().t()), x2.shape[1], groups=1)


def matmul(x: Tensor, weight: Tensor, packed: Tensor, groups: int | None = None, ordered_wgrad: bool = False) -> Tensor:
    """x (..., K) @ weight^T (weight (N, K), `packed = pack_weight(weight)` or of its bf16 copy): the canonical
    reduction (jetflow.kernels.canonical), so a row's result depends neither on the other rows nor on how K is
    sharded. Differentiable in x and weight (backward through torch's matmul; `ordered_wgrad`: the weight's by
    `weight_grad`). Operands on the bf16 grid: pack the weight as bfloat16 (half the bytes; on CUDA the
    product then runs on bf16 tensor cores: `gemm` reads the packed dtype)."""
    check_device(x.device)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _Matmul.apply(x, weight, packed, groups, ordered_wgrad)
    y = gemm(x.reshape(-1, x.shape[-1]), packed, weight.shape[0], groups=groups)  # no graph to record
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
