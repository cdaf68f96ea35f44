"""The mxfp8 and nvfp4 recipe families (`MXFP8`, `NVFP4`: their strategies, jetflow.precision.family):
the recipe's three GEMMs as Transformer Engine defines them, and the exact forward that every side
computes under `precision.numerics=exact`.

    fprop  Y  = X  @ W^T   X: activation blocks along K          W: the weight's blocks
    dgrad  dX = dY @ W     dY: gradient blocks along N           W^T: mxfp8 requantized in blocks along N
                                                                      (TE's columnwise copy); nvfp4 the
                                                                      same 16x16 bytes, transposed
    wgrad  dW = dY^T @ X   both along the tokens (M)             nvfp4: both through hadamard16 first
Gradients round stochastically under nvfp4, from a torch.Generator seeded by a hash of the gradient's
own bits and the layer's name (`sr_generator`): the same inputs give the same draws, so a run stays
reproducible and resumes bit for bit without any generator state in its checkpoints, and data
parallel ranks draw independently for their different gradients.

Exact forward (`MicroscaledFamily.exact_product`, and the linear's fprop under exact numerics: both
`product(..., numerics="exact")`): each operand's values are exact in fp32 (MXFP8:
E4M3 times a power of two; NVFP4: E2M1 times its E4M3 block scale), so the product is the canonical
fp32 GEMM (jetflow.kernels.invariant: 128-K block chains, groups, the pairwise tree) on them, the
weight's panels packed once per weight version (`panels` of MXTensor / NVFP4Tensor). NVFP4 then multiplies each output
row by alpha = fp32(d_x[m] * d_w), its two tensor scales, once: the cuBLAS / vLLM epilogue's alpha.
A row's bits thus depend on the row and the weight only. A row-parallel shard's `combine` (the TP
tree over the ranks' partial sums) runs before alpha, so that TP = T multiplies the same full sum.
Backward GEMMs are torch's fp32 matmuls on the dequantized operands (only the forward must be exact).
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

from jetflow.kernels import invariant
from jetflow.precision import modelopt
from jetflow.precision.mx import MXTensor, quantize_mx
from jetflow.precision.nvfp4 import NVFP4_BLOCK, NVFP4Tensor, hadamard16, quantize_nvfp4
from jetflow.precision.recipe import QuantRecipe

Microscaled = MXTensor | NVFP4Tensor


def sr_generator(t: torch.Tensor, name: str) -> torch.Generator:
    """A generator seeded by `name`, t's shape and an exact, order-free digest of t's fp32 bits (an
    integer sum: the same on every thread count), mixed by sha256 (torch's CPU generator keeps only a
    seed's low 32 bits)."""
    bits = t.detach().float().contiguous().view(torch.int32)
    digest = int(bits.sum(dtype=torch.int64))
    key = hashlib.sha256(f"{name}:{tuple(t.shape)}:{digest}".encode()).digest()
    return torch.Generator(device=t.device).manual_seed(int.from_bytes(key[:8], "little") & 0x7FFFFFFFFFFFFFFF)


def _tokens_padded(t2: torch.Tensor) -> torch.Tensor:
    """t2 (M, C) -> (C, M') transposed, M zero-padded to whole 16-token Hadamard runs."""
    return F.pad(t2.t(), (0, -t2.shape[0] % NVFP4_BLOCK))


def values(q: Microscaled) -> torch.Tensor:
    """A quantized operand's exact fp32 values before any tensor scale: (R, C)."""
    return q.dequantize() if isinstance(q, MXTensor) else q.block_values()


def product(aq: Microscaled, bq: Microscaled, numerics: str = "fast", groups: int | None = None,
            packed: torch.Tensor | None = None, combine=None) -> torch.Tensor:
    """aq (M, K) @ bq (N, K)^T -> (M, N) fp32: the exact values' product (exact: the canonical GEMM on
    `packed`, bq's panels), `combine` (a row-parallel shard's TP tree), then NVFP4's alpha = d_a * d_b
    (per row of aq when aq has row scales)."""
    if numerics == "exact" and aq.data.is_cuda:
        invariant.check_device(aq.data.device)
        return _cuda_product(aq, bq, groups, combine)
    a = values(aq)
    if numerics == "exact":
        invariant.check_device(a.device)
        y = invariant.gemm(a, packed if packed is not None else bq.panels(), bq.shape[0], groups=groups)
    else:
        y = a @ values(bq).t()
    if combine is not None:
        y = combine(y)
    return _times_alpha(y, aq, bq)


def _times_alpha(y: torch.Tensor, aq: Microscaled, bq: Microscaled) -> torch.Tensor:
    """NVFP4: y * fp32(d_a * d_b) (per row of aq when it has row scales); MXFP8: y."""
    if isinstance(aq, NVFP4Tensor):
        alpha = aq.tensor_scale * bq.tensor_scale  # () or (M,), fp32: one rounding
        y = y * (alpha[:, None] if alpha.dim() else alpha)
    return y


def _cuda_product(aq: Microscaled, bq: Microscaled, groups: int | None, combine) -> torch.Tensor:
    """The exact product on CUDA: jetflow's Triton GEMM on the codes and scales (jetflow.kernels.triton.
    microscaled), the same structure; NVFP4's alpha in the kernel, or after `combine` when there is one."""
    from jetflow.kernels.triton import microscaled as kernels

    if isinstance(aq, MXTensor):
        y = kernels.mx_gemm(aq.data, aq.scale, bq.data, bq.scale, groups=groups)
        return y if combine is None else combine(y)
    ones = torch.ones((), device=aq.data.device)
    da, db = (aq.tensor_scale, bq.tensor_scale) if combine is None else (ones, ones)
    y = kernels.nvfp4_gemm(aq.data, aq.scale, da, bq.data, bq.scale, db, aq.shape[1], bq.block[0], groups=groups)
    return y if combine is None else _times_alpha(combine(y), aq, bq)


class _MicroscaledLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, wq, recipe: QuantRecipe, family: "MicroscaledFamily", name: str, save_input: bool,
                numerics: str, groups: int | None, combine):
        x2 = x.reshape(-1, x.shape[-1]).float()  # (M, K)
        y = product(family.quantize_activation(x2, recipe, name), wq, numerics, groups, combine=combine)  # (M, N) fp32
        if numerics != "exact":  # exact: fp32 out, the caller's epilogue adds the bias and casts
            y = y.to(x.dtype)
            if bias is not None:
                y = y + bias.to(y.dtype)
        ctx.saved_x = family.quantize_wgrad_operand(x2, recipe, "activation", f"{name}.input") if save_input else None
        ctx.weight, ctx.wq, ctx.recipe, ctx.family, ctx.name = weight, wq, recipe, family, name
        ctx.x_shape, ctx.x_dtype, ctx.weight_dtype, ctx.has_bias = x.shape, x.dtype, weight.dtype, bias is not None
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        recipe, family, name = ctx.recipe, ctx.family, ctx.name
        g2 = grad_out.reshape(-1, grad_out.shape[-1]).float()  # (M, N)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = family.dgrad(g2, ctx.weight, ctx.wq, recipe, name).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.saved_x is not None and ctx.needs_input_grad[1]:
            gq = family.quantize_wgrad_operand(g2, recipe, "gradient", f"{name}.grad_output")  # (N, M')
            grad_w = product(gq, ctx.saved_x).to(ctx.weight_dtype)  # (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(ctx.weight_dtype)
        ctx.saved_x = ctx.weight = ctx.wq = ctx.family = None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None


class MicroscaledFamily:
    """What the mxfp8 and nvfp4 families share (jetflow.precision.family.RecipeFamily): the linear's
    autograd function and the exact product; each family brings its quantizers and its dgrad."""

    name = ""
    gathers_in_fp8 = False  # FSDP's all-gather moves their weights in fp32
    static_input_scales = False
    exact_reads_bytes = False  # the exact product multiplies the values: a dequantized copy is kept

    def quantize_weight(self, w: torch.Tensor, recipe: QuantRecipe, name: str = "weight") -> Microscaled:
        raise NotImplementedError

    def quantize_activation(self, x2: torch.Tensor, recipe: QuantRecipe, name: str = "linear") -> Microscaled:
        """The fprop's input x2 (M, K) in blocks along K."""
        raise NotImplementedError

    def quantize_wgrad_operand(self, t2: torch.Tensor, recipe: QuantRecipe, role: str, name: str) -> Microscaled:
        """An operand of wgrad, t2 (M, C) (the input X or the gradient dY), as (C, M) in blocks along the tokens."""
        raise NotImplementedError

    def dgrad(self, g2: torch.Tensor, weight: torch.Tensor, wq: Microscaled, recipe: QuantRecipe,
              name: str) -> torch.Tensor:
        """dX = dY @ W: g2 (M, N) -> (M, K) fp32, both operands in blocks along N."""
        raise NotImplementedError

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wq: Microscaled,
               recipe: QuantRecipe, backend: str = "auto", name: str = "linear", numerics: str = "fast",
               groups: int | None = None, combine=None) -> torch.Tensor:
        """The recipe's linear with its fprop, dgrad and wgrad; `wq` is `weight` quantized by the recipe
        (`backend` is fp8_block's: these GEMMs multiply values). numerics="exact": the fprop is the exact
        product (fp32 out, no bias: jetflow.precision.exact adds the epilogue; `combine`, a row-parallel
        shard's TP tree, applied inside, before NVFP4's alpha, its backward the identity as
        jetflow.train.megatron.reduce's); otherwise x's dtype with the bias."""
        save_input = torch.is_grad_enabled() and weight.requires_grad
        return _MicroscaledLinearFunction.apply(x, weight, bias, wq, recipe, self, name, save_input, numerics, groups,
                                                combine)

    def exact_product(self, x2: torch.Tensor, wq: Microscaled, recipe: QuantRecipe, name: str = "linear",
                      groups: int | None = None, combine=None, cache=None) -> torch.Tensor:
        """The exact fprop without autograd (rollout, no-grad forwards): x2 (M, K) -> (M, N) fp32."""
        return product(self.quantize_activation(x2, recipe, name), wq, "exact", groups, combine=combine)

    @staticmethod
    def all_backends_read(recipe: QuantRecipe) -> bool:
        return True

    def quantization_config(self, recipe: QuantRecipe, ignored_layers=()) -> dict:
        """ModelOpt's (jetflow.precision.modelopt)."""
        return modelopt.quantization_config(recipe, ignored_layers)

    @staticmethod
    def checkpoint_tensors(module: str, q: Microscaled, input_scale: float = 1.0) -> dict[str, torch.Tensor]:
        return modelopt.to_tensors(module, q, input_scale)

    @staticmethod
    def held_bytes_per_weight(numerics: str, cuda: bool, trainer: bool) -> float:
        """Counted as FP8 bytes plus a dequantized fp32 copy."""
        return 5.0


class MXFP8(MicroscaledFamily):
    """TE's MXFP8BlockScaling: E4M3 values (E5M2 gradients under `hybrid`) in 1x32 blocks, E8M0 scales."""

    name = "mxfp8"

    def quantize_weight(self, w, recipe, name="weight"):
        """(1, 32) blocks along K."""
        return quantize_mx(w.detach(), recipe.weight_block, recipe.forward_format, name)

    def quantize_activation(self, x2, recipe, name="linear"):
        return quantize_mx(x2, (1, recipe.group_size), recipe.forward_format, f"{name}.input")

    def quantize_wgrad_operand(self, t2, recipe, role, name):
        spec = recipe.operand(role)
        return quantize_mx(t2.t(), (1, spec.block[1]), spec.element, name)

    def dgrad(self, g2, weight, wq, recipe, name):
        """W^T requantized in blocks along N (TE's columnwise copy)."""
        spec = recipe.operand("gradient")
        gq = quantize_mx(g2, (1, spec.block[1]), spec.element, f"{name}.grad_output")
        wt = quantize_mx(weight.detach().t(), (1, spec.block[1]), recipe.forward_format, f"{name}.weight")  # (K, N)
        return product(gq, wt)


class NVFP4(MicroscaledFamily):
    """TE's NVFP4BlockScaling: E2M1 values, E4M3 block scales under an fp32 tensor scale."""

    name = "nvfp4"
    static_input_scales = True  # its export carries each linear's input scale (vLLM's W4A4 kernels read it)

    def quantize_weight(self, w, recipe, name="weight"):
        """16x16 blocks under one tensor scale (W and W^T share bytes)."""
        return quantize_nvfp4(w.detach(), recipe.weight_block, name=name)

    def quantize_activation(self, x2, recipe, name="linear"):
        """One tensor scale per row."""
        return quantize_nvfp4(x2, (1, NVFP4_BLOCK), per_row=True, name=f"{name}.input")

    def quantize_wgrad_operand(self, t2, recipe, role, name):
        """After hadamard16, 1x16, one tensor scale, gradients rounded stochastically."""
        spec = recipe.operand(role)
        ht = hadamard16(_tokens_padded(t2.float()))  # (C, M')
        gen = sr_generator(t2, name) if spec.rounding == "stochastic" else None
        return quantize_nvfp4(ht, (1, NVFP4_BLOCK), generator=gen, name=name)

    def dgrad(self, g2, weight, wq, recipe, name):
        """The same 16x16 bytes, transposed."""
        spec = recipe.operand("gradient")
        gen = sr_generator(g2, f"{name}.dgrad") if spec.rounding == "stochastic" else None
        return product(quantize_nvfp4(g2, spec.block, generator=gen, name=f"{name}.grad_output"), wq.t())

    def quantization_config(self, recipe, ignored_layers=()):
        return {**modelopt.quantization_config(recipe, ignored_layers), "group_size": NVFP4_BLOCK}
