"""The FP8 linear's autograd function: the recipe's FP8 GEMMs for fprop, dgrad and wgrad.

    fprop  Y  = X  @ W^T    X: 1x128 groups (E4M3)       W: 128x128 blocks (E4M3)
    dgrad  dX = dY @ W      dY: 1x128 groups             W^T: the same blocks, transposed
    wgrad  dW = dY^T @ X    dY^T: 1x128 along tokens     X^T: 1x128 along tokens (= X in 128x1)
Gradients are E5M2 under the `hybrid` format. X is saved for backward in FP8 (its 128x1 quantization),
never in high precision, unless the recipe keeps the wgrad in bf16 (`wgrad="bf16"`: X saved in bf16, the
GEMM on bf16 operands with fp32 accumulation); `dgrad="bf16"` likewise multiplies dY and the
high-precision weight rounded to bf16. Both: FP8 in the forward alone.
Used by PrecisionLinear (jetflow.precision.linear), the exact linear (jetflow.precision.exact) and
Megatron's parallel linears. The mxfp8 and nvfp4 recipe families run
jetflow.precision.microscaled instead: `quantize_weight_for_recipe` and `fp8_linear` hand them over.
"""

from __future__ import annotations

import torch

from jetflow.kernels import invariant
from jetflow.precision import microscaled
from jetflow.precision.gathered import GatheredFP8Weight
from jetflow.precision.gemm import fp8_kernel_matmul, fp8_matmul
from jetflow.precision.quant import QuantizedTensor, quantize_blocks
from jetflow.precision.recipe import QuantRecipe


def quantize_weight_for_recipe(weight: torch.Tensor, recipe: QuantRecipe, name: str = "weight"):
    """The weight's bytes under `recipe`: a QuantizedTensor (fp8_block), an MXTensor or an NVFP4Tensor."""
    if recipe.family != "fp8_block":
        return microscaled.quantize_weight(weight, recipe, name)
    return quantize_blocks(weight.detach(), recipe.weight_block, recipe.forward_format, recipe.scale_rule,
                           recipe.margin, name)


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, wq: QuantizedTensor, recipe: QuantRecipe, backend: str, name: str,
                save_input: bool, numerics: str, groups: int | None):
        in_features = x.shape[-1]
        x2 = x.reshape(-1, in_features)  # (M, K)
        xq = quantize_input(x2, recipe, name, numerics)
        # exact: the canonical product in fp32 (the caller's epilogue casts it); fast: x's dtype
        out_dtype = torch.float32 if numerics == "exact" else x.dtype
        y = fp8_matmul(xq, wq, out_dtype=out_dtype, backend=backend, numerics=numerics, groups=groups)  # (M, N)
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
    """The fprop's activation quantization, 1 x group_size E4M3 groups (x2 (M, K)). Under exact
    numerics on the CPU the fused C++ quantizer (the same bytes as quantize_blocks, one pass instead of a
    dozen torch ops: what a decode step pays per linear); quantize_blocks itself where a group holds
    NaN / Inf (its error, or its record under defer_nonfinite) and everywhere else."""
    if numerics == "exact" and not x2.is_cuda and recipe.group_size == 128:
        data, scale_inv, bad = invariant.quantize_1x128(x2, recipe.scale_rule, recipe.margin)
        if not bad:
            return QuantizedTensor(data, scale_inv, (1, 128))
    return quantize_blocks(x2, (1, recipe.group_size), recipe.forward_format, recipe.scale_rule, recipe.margin,
                           f"{name}.input")


def quantize_rows(t: torch.Tensor, recipe: QuantRecipe, fmt: str, name: str, numerics: str = "fast") -> QuantizedTensor:
    """t (R, C) in 1 x group_size groups along C (t may be a transposed view: the 128 x 1 groups of its
    transpose). Under exact numerics on the CPU the fused quantizer for E4M3 (the same bytes)."""
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


def exact_fp8_product(x2: torch.Tensor, wq: QuantizedTensor, recipe: QuantRecipe, name: str = "linear",
                      groups: int | None = None) -> torch.Tensor:
    """The exact fprop without autograd (rollout, no-grad forwards): x2 (M, K) -> (M, N) fp32."""
    if wq.block == (128, 128) and wq.fmt == "e4m3" and recipe.group_size == 128:
        return exact_fp8_fprop(x2, recipe, name, wq.panels(), wq.scale_inv, wq.shape[0], groups)
    return fp8_matmul(quantize_input(x2, recipe, name, "exact"), wq, torch.float32, numerics="exact", groups=groups)


def exact_fp8_fprop(x2: torch.Tensor, recipe: QuantRecipe, name: str, packed: torch.Tensor, sw: torch.Tensor, n: int,
                    groups: int | None = None, weight_rows_per_scale: int = 128) -> torch.Tensor:
    """x2 (M, K) quantized by `quantize_input`, times an E4M3 weight's panels `packed` with its scales sw
    (`invariant.fp8_gemm`'s operands) -> (M, N) fp32. On the CPU one kernel call does both (the same bytes
    and bits, one call and no QuantizedTensor instead of two; four calls a layer in a decode step); a group
    holding NaN / Inf takes quantize_input, which reports it."""
    invariant.check_device(x2.device)
    if not x2.is_cuda and recipe.group_size == 128:
        y = invariant.quantized_fp8_gemm(x2, recipe.scale_rule, recipe.margin, packed, sw, n, groups=groups,
                                         weight_rows_per_scale=weight_rows_per_scale)
        if y is not None:
            return y
    xq = quantize_input(x2.float(), recipe, name, "exact")
    return invariant.fp8_gemm(xq.data, xq.scale_inv, packed, sw, n, groups=groups,
                              weight_rows_per_scale=weight_rows_per_scale)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wq: QuantizedTensor,
               recipe: QuantRecipe, backend: str = "auto", name: str = "linear", numerics: str = "fast",
               groups: int | None = None) -> torch.Tensor:
    """Functional FP8 linear with FP8 fprop, dgrad and wgrad. `wq` is `weight` quantized by the recipe.
    numerics="exact": the fprop is the canonical FP8 GEMM (`groups` canonical groups over K, see
    jetflow.kernels.canonical) and the result is fp32 (jetflow.precision.exact applies the epilogue)."""
    if recipe.family != "fp8_block":
        return microscaled.microscaled_linear(x, weight, bias, wq, recipe, name, numerics, groups)
    # The 128x1 copy of the input is only needed for the weight gradient of a graph being recorded.
    save_input = torch.is_grad_enabled() and weight.requires_grad
    return _FP8LinearFunction.apply(x, weight, bias, wq, recipe, backend, name, save_input, numerics, groups)
