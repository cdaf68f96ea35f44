"""The fp8_block recipe family: its weight quantizer, its linear's autograd function (the recipe's FP8
GEMMs for fprop, dgrad and wgrad) and its exact forward.

    fprop  Y  = X  @ W^T    X: 1x128 groups (E4M3)       W: 128x128 blocks (E4M3)
    dgrad  dX = dY @ W      dY: 1x128 groups             W^T: the same blocks, transposed
    wgrad  dW = dY^T @ X    dY^T: 1x128 along tokens     X^T: 1x128 along tokens (= X in 128x1)
Gradients are E5M2 under the `hybrid` format. X is saved for backward in FP8 (its 128x1 quantization),
never in high precision, unless the recipe keeps the wgrad in bf16 (`wgrad="bf16"`: X saved in bf16, the
GEMM on bf16 operands with fp32 accumulation); `dgrad="bf16"` likewise multiplies dY and the
high-precision weight rounded to bf16. Both: FP8 in the forward alone.

Exact forward (`exact_fprop`, the one route every exact fp8_block forward takes: the trainer's with a
graph, the rollout's and the no-grad log-probs' without, one linear or sibling linears side by side):
the canonical FP8 GEMM (jetflow.kernels.canonical: each 128-K block's chain over the raw FP8 values
times the two block scales, groups, a pairwise tree) of x quantized in 1x128 groups and the weight's
128x128-block E4M3 bytes, on the CPU (jetflow.kernels.invariant, the activation quantizer fused into the
GEMM's call) and on CUDA (the Triton kernel; cuBLAS picks kernels by shape, split-K for small M, so
scaled_mm cannot promise this). A row's result then depends neither on how many rows share the call nor
on how K is sharded over tensor-parallel ranks (`groups`). Other block sizes of the recipe (32-wide
groups and blocks, say: no FP8 kernel here reads them) run on their values: each operand dequantized
(fp8 * its block's scale_inv, one fp32 rounding an element), then the canonical fp32 GEMM (the same
function of the bytes on every side, so the rollout and the trainer still agree bit for bit).

`FP8Block` is the family's strategy (jetflow.precision.family); the mxfp8 and nvfp4 families are
jetflow.precision.microscaled's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from jetflow.kernels import invariant
from jetflow.precision.exact_cache import ExactCache
from jetflow.precision.gathered import GatheredFP8Weight
from jetflow.precision.gemm import fp8_kernel_matmul, fp8_matmul
from jetflow.precision.quant import QuantizedTensor, quantize_blocks
from jetflow.precision.recipe import QuantRecipe

SCALE_SUFFIX = ".weight_scale_inv"
"""The fp8_block checkpoint layout's scale beside `<module>.weight` (vLLM / DeepSeek FP8)."""


def quantize_weight(weight: torch.Tensor, recipe: QuantRecipe, name: str = "weight") -> QuantizedTensor:
    """The weight's E4M3 bytes in the recipe's blocks (128x128 by default), one scale per block."""
    return quantize_blocks(weight.detach(), recipe.weight_block, recipe.forward_format, recipe.scale_rule,
                           recipe.margin, name)


def reads_fp8_bytes(recipe: QuantRecipe, wq: QuantizedTensor) -> bool:
    """The exact forward reads `wq`'s E4M3 bytes in the canonical GEMM (128x128 E4M3 blocks, 1x128 groups);
    other blocks run on their values."""
    return recipe.canonical_blocks and wq.block == (128, 128) and wq.fmt == "e4m3"


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, wq: QuantizedTensor, recipe: QuantRecipe, backend: str, name: str,
                save_input: bool, numerics: str, groups: int | None):
        in_features = x.shape[-1]
        x2 = x.reshape(-1, in_features)  # (M, K)
        if numerics == "exact":  # the canonical product in fp32 (the caller's epilogue casts it)
            y = exact_fprop(x2, wq, recipe, name, groups)  # (M, N)
        else:
            y = fp8_matmul(quantize_input(x2, recipe, name), wq, out_dtype=x.dtype, backend=backend)  # (M, N)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.saved_xt = ctx.saved_x_bf16 = None
        if save_input and recipe.wgrad == "bf16":
            ctx.saved_x_bf16 = x2.detach().bfloat16()  # (M, K)
        elif save_input:
            # Saved in FP8 for the wgrad GEMM: X quantized in 128 x 1 groups (along tokens), kept as
            # X^T (K, M) in 1 x 128 groups, the operand the wgrad GEMM reads.
            ctx.saved_xt = quantize_rows(x2.t(), recipe, recipe.forward_format, f"{name}.input", numerics)
        ctx.saved_w = wq
        if recipe.dgrad == "bf16":  # the high-precision weight (FSDP's FP8 all-gather brings none: its bytes')
            ctx.save_for_backward(weight if not isinstance(weight, GatheredFP8Weight) else None)
        ctx.recipe, ctx.backend, ctx.name, ctx.numerics = recipe, backend, name, numerics
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.has_bias, ctx.weight_dtype = bias is not None, weight.dtype
        ctx.weight_requires_grad = save_input
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        recipe, backend, name = ctx.recipe, ctx.backend, ctx.name
        gfmt = recipe.grad_format
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (M, N)
        grad_x = grad_w = grad_b = None
        numerics = ctx.numerics
        if ctx.needs_input_grad[0] and recipe.dgrad == "bf16":
            (weight,) = ctx.saved_tensors
            w = ctx.saved_w.dequantize() if weight is None else weight  # (N, K)
            grad_x = bf16_product(g2, w.detach(), ctx.x_dtype).reshape(ctx.x_shape)  # (M, N) @ (N, K)
        elif ctx.needs_input_grad[0]:
            gq = quantize_rows(g2, recipe, gfmt, f"{name}.grad_output", numerics)
            grad_x = _backward_matmul(gq, ctx.saved_w.t(), ctx.x_dtype, backend, numerics, ctx.saved_w)  # (M, K)
            grad_x = grad_x.reshape(ctx.x_shape)
        if ctx.weight_requires_grad and ctx.needs_input_grad[1] and recipe.wgrad == "bf16":
            grad_w = bf16_product(g2.t(), ctx.saved_x_bf16, ctx.weight_dtype)  # (N, M) @ (M, K) -> (N, K)
        elif ctx.weight_requires_grad and ctx.needs_input_grad[1]:
            gq_t = quantize_rows(g2.t(), recipe, gfmt, f"{name}.grad_output", numerics)  # dY^T (N, M), 1x128 along M
            grad_w = _backward_matmul(gq_t, ctx.saved_xt, ctx.weight_dtype, backend, numerics)  # (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(ctx.weight_dtype)
        ctx.saved_xt = ctx.saved_w = ctx.saved_x_bf16 = None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


def bf16_product(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a (M, K) @ b (K, N) as a bf16 GEMM computes it: both operands rounded to bf16, fp32 accumulation
    (on the CPU the bf16 values multiplied in fp32: bf16 matmul is a slow fallback there, FACTS.md). The
    recipe's `dgrad="bf16"` / `wgrad="bf16"` backward GEMMs."""
    if a.is_cuda:  # cuBLAS: fp32 accumulation, bf16 out
        return (a.bfloat16() @ b.bfloat16()).to(out_dtype)
    return (a.bfloat16().float() @ b.bfloat16().float()).to(out_dtype)


def quantize_input(x2: torch.Tensor, recipe: QuantRecipe, name: str, numerics: str = "fast") -> QuantizedTensor:
    """The fprop's activation quantization: x2 (M, K) in 1 x group_size E4M3 groups (`quantize_rows`)."""
    return quantize_rows(x2, recipe, recipe.forward_format, f"{name}.input", numerics)


def quantize_rows(t: torch.Tensor, recipe: QuantRecipe, fmt: str, name: str, numerics: str = "fast") -> QuantizedTensor:
    """t (R, C) in 1 x group_size groups along C (t may be a transposed view: the 128 x 1 groups of its
    transpose). Under exact numerics on the CPU, E4M3 in 1x128 groups: the fused C++ quantizer (the same
    bytes as quantize_blocks, one pass instead of a dozen torch ops: what a decode step pays per linear);
    quantize_blocks itself where a group holds NaN / Inf (its error, or its record under
    defer_nonfinite) and everywhere else."""
    if numerics == "exact" and fmt == "e4m3" and not t.is_cuda and recipe.group_size == 128:
        data, scale_inv, bad = invariant.quantize_1x128(t, recipe.scale_rule, recipe.margin)
        if not bad:
            return QuantizedTensor(data, scale_inv, (1, 128))
    if t.stride(0) == 1 and t.stride(1) != 1:  # a transposed view: quantize the original in group x 1
        q = quantize_blocks(t.t(), (recipe.group_size, 1), fmt, recipe.scale_rule, recipe.margin, name)
        return q.t()
    return quantize_blocks(t, (1, recipe.group_size), fmt, recipe.scale_rule, recipe.margin, name)


def _backward_matmul(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, backend: str,
                     numerics: str, transposed_of: QuantizedTensor | None = None) -> torch.Tensor:
    """a @ b.T for dgrad / wgrad. The backward of an exact linear on the CPU runs on the canonical FP8
    kernels (E4M3 operands): gradients need not be exact, but the kernels that read the FP8 bytes are the
    fastest FP8 GEMM this CPU has. Elsewhere (and for E5M2 gradients) the recipe's `backend`."""
    if numerics == "exact" and not a.data.is_cuda and a.fmt == b.fmt == "e4m3" and a.block == (1, 128):
        packed = transposed_of.panels_t() if transposed_of is not None else None
        return fp8_kernel_matmul(a, b, packed).to(out_dtype)
    return fp8_matmul(a, b, out_dtype=out_dtype, backend=backend)


def exact_fprop(x2: torch.Tensor, wq: QuantizedTensor, recipe: QuantRecipe, name: str = "linear",
                groups: int | None = None, cache: ExactCache | None = None) -> torch.Tensor:
    """The exact fprop (see the module docstring): x2 (M, K) -> (M, N) fp32, no bias. `cache` keeps the
    prepared call for wq's panels (`prepare_exact_fprop`: the weight's checks once per weight version)."""
    if not reads_fp8_bytes(recipe, wq):  # blocks no FP8 kernel reads: the canonical fp32 GEMM on their values
        invariant.check_device(x2.device)
        xq = quantize_input(x2, recipe, name, "exact")
        return invariant.gemm(xq.dequantize(), wq.value_panels(), wq.shape[0], groups=groups)
    packed, sw = wq.panels(), wq.scale_inv

    def prepare() -> Callable[[torch.Tensor], torch.Tensor]:
        return prepare_exact_fprop(recipe, packed, sw, wq.shape[0], wq.shape[1], groups, name=name)
    return (cache.prepared((packed, sw, groups), prepare) if cache is not None else prepare())(x2)


def prepare_exact_fprop(recipe: QuantRecipe, packed: torch.Tensor, sw: torch.Tensor, n: int, k: int,
                        groups: int | None = None, weight_rows_per_scale: int = 128,
                        name: str = "linear") -> Callable[[torch.Tensor], torch.Tensor]:
    """fn(x2 (M, K)) -> (M, N) fp32: x2 quantized by `quantize_input` times an E4M3 weight's panels `packed`
    with its scales sw (`invariant.fp8_gemm`'s operands; `weight_rows_per_scale=1`: one scale per weight
    row, sibling linears side by side). On the CPU one prepared kernel call does both (the same bytes and
    bits as the two steps; the weight's checks done here, once); on CUDA, and where an input group holds
    NaN / Inf (the fused call then computes nothing), the quantizer and the GEMM one after the other:
    the quantizer reports the NaN (NonFiniteError, or its record under defer_nonfinite)."""
    fused = None
    if not packed.is_cuda and recipe.group_size == 128:
        fused = invariant.prepare_quantized_fp8_gemm(recipe.scale_rule, recipe.margin, packed, sw, n, k, groups=groups,
                                                     weight_rows_per_scale=weight_rows_per_scale)

    def run(x2: torch.Tensor) -> torch.Tensor:
        invariant.check_device(x2.device)
        y = fused(x2) if fused is not None and not x2.is_cuda else None
        if y is None:
            xq = quantize_input(x2.float(), recipe, name, "exact")
            y = invariant.fp8_gemm(xq.data, xq.scale_inv, packed, sw, n, groups=groups,
                                   weight_rows_per_scale=weight_rows_per_scale)
        return y
    return run


def block_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wq: QuantizedTensor,
                 recipe: QuantRecipe, backend: str = "auto", name: str = "linear", numerics: str = "fast",
                 groups: int | None = None, combine=None) -> torch.Tensor:
    """Functional fp8_block linear with FP8 fprop, dgrad and wgrad. `wq` is `weight` quantized by the recipe.
    numerics="exact": the fprop is `exact_fprop` (`groups` canonical groups over K, see
    jetflow.kernels.canonical), the result fp32 without the bias (jetflow.precision.exact applies the
    epilogue) and `combine` (a row-parallel shard's tree over the ranks) applied to it."""
    # The 128x1 copy of the input is only needed for the weight gradient of a graph being recorded.
    save_input = torch.is_grad_enabled() and weight.requires_grad
    y = _FP8LinearFunction.apply(x, weight, bias, wq, recipe, backend, name, save_input, numerics, groups)
    return y if combine is None else combine(y)


class FP8Block:
    """The fp8_block family's strategy (jetflow.precision.family.RecipeFamily)."""

    name = "fp8_block"
    gathers_in_fp8 = True  # FSDP's all-gather moves its bytes (jetflow.train.fsdp.gather)
    static_input_scales = False
    exact_reads_bytes = True  # the exact GEMMs read the FP8 bytes: no dequantized fp32 copy is kept
    quantize_weight = staticmethod(quantize_weight)
    linear = staticmethod(block_linear)

    @staticmethod
    def exact_product(x2: torch.Tensor, wq: QuantizedTensor, recipe: QuantRecipe, name: str = "linear",
                      groups: int | None = None, combine=None, cache: ExactCache | None = None) -> torch.Tensor:
        y = exact_fprop(x2, wq, recipe, name, groups, cache)  # (M, N) fp32
        return y if combine is None else combine(y)

    @staticmethod
    def all_backends_read(recipe: QuantRecipe) -> bool:
        """vLLM's FP8 payload, Megatron-Core's fused weights and FSDP's FP8 all-gather lay out 128-row blocks."""
        return recipe.canonical_blocks

    @staticmethod
    def quantization_config(recipe: QuantRecipe, ignored_layers=()) -> dict:
        return recipe.vllm_quantization_config(ignored_layers)

    @staticmethod
    def checkpoint_tensors(module: str, q: QuantizedTensor, input_scale: float = 1.0) -> dict[str, torch.Tensor]:
        """`<module>.weight` float8 (N, K) and `<module>.weight_scale_inv` fp32 (ceil(N/128), ceil(K/128))."""
        return {f"{module}.weight": q.data.contiguous(), f"{module}{SCALE_SUFFIX}": q.scale_inv.contiguous()}

    @staticmethod
    def held_bytes_per_weight(numerics: str, cuda: bool, trainer: bool) -> float:
        """Bytes a linear keeps per weight element beside the weight itself: exact numerics the FP8 bytes (1)
        and their panels (1), the trainer also the transposed panels of the dgrad (1); fast numerics on
        Hopper's scaled_mm the bytes alone, in the CPU emulation a dequantized fp32 copy (4) beside them."""
        if numerics == "exact":
            return 3.0 if trainer else 2.0
        return 1.0 if cuda else 5.0
