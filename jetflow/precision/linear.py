"""Linear layers under a precision mode, and the converter that puts them into a model.

`PrecisionLinear` replaces `nn.Linear` with the same parameter names (state dicts do not change) and
computes in one of three ways:
  fp32  plain F.linear.
  bf16  a bf16 GEMM (see gemm.bf16_linear).
  fp8   the recipe's FP8 GEMMs for fprop, dgrad and wgrad:
          fprop  Y  = X  @ W^T    X: 1x128 groups (E4M3)       W: 128x128 blocks (E4M3)
          dgrad  dX = dY @ W      dY: 1x128 groups             W^T: the same blocks, transposed
          wgrad  dW = dY^T @ X    dY^T: 1x128 along tokens     X^T: 1x128 along tokens (= X in 128x1)
        Gradients are E5M2 under the `hybrid` format. X is saved for backward in FP8 (its 128x1
        quantization), never in high precision.

The quantized weight is cached per weight version (the tensor's in-place version counter, which an
optimizer step bumps), so each weight is quantized once per optimizer step and those same bytes serve
every forward of the step and every export to a rollout engine. A rollout-side layer can instead be
handed quantized bytes directly (`load_quantized`), which it then uses as they are.

`numerics="exact"` runs every forward product on the batch-invariant GEMM (jetflow.kernels.invariant)
on weight panels packed once per weight version: a row's output is then the same bits whether the
row is one of 16 decode rows or of 9,600 trainer rows. Backward GEMMs stay torch's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from jetflow.kernels import invariant
from jetflow.precision.gemm import NUMERICS, bf16_linear, fp8_matmul, resolve_backend
from jetflow.precision.quant import QuantizedTensor, quantize_blocks
from jetflow.precision.recipe import FP8Recipe

LINEAR_KINDS = ("fp32", "bf16", "fp8")


def quantize_weight_for_recipe(weight: torch.Tensor, recipe: FP8Recipe, name: str = "weight") -> QuantizedTensor:
    return quantize_blocks(weight.detach(), recipe.weight_block, recipe.forward_format, recipe.scale_rule,
                           recipe.margin, name)


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, wq: QuantizedTensor, recipe: FP8Recipe, backend: str, name: str,
                save_input: bool, numerics: str):
        in_features = x.shape[-1]
        x2 = x.reshape(-1, in_features)  # (M, K)
        group, rule, margin = recipe.group_size, recipe.scale_rule, recipe.margin
        xq = quantize_blocks(x2, (1, group), recipe.forward_format, rule, margin, f"{name}.input")
        y = fp8_matmul(xq, wq, out_dtype=x.dtype, backend=backend, numerics=numerics)  # (M, N)
        if bias is not None:
            y = y + bias.to(y.dtype)
        if save_input:
            # Saved in FP8 for the wgrad GEMM: X quantized in 128 x 1 groups (along tokens).
            xq_col = quantize_blocks(x2, (group, 1), recipe.forward_format, rule, margin, f"{name}.input")
            ctx.saved_x = xq_col
        ctx.saved_w = wq
        ctx.recipe, ctx.backend, ctx.name = recipe, backend, name
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.has_bias, ctx.weight_dtype = bias is not None, weight.dtype
        ctx.weight_requires_grad = save_input
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        recipe, backend, name = ctx.recipe, ctx.backend, ctx.name
        group, rule, margin, gfmt = recipe.group_size, recipe.scale_rule, recipe.margin, recipe.grad_format
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (M, N)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            gq = quantize_blocks(g2, (1, group), gfmt, rule, margin, f"{name}.grad_output")
            grad_x = fp8_matmul(gq, ctx.saved_w.t(), out_dtype=ctx.x_dtype, backend=backend)  # (M, K)
            grad_x = grad_x.reshape(ctx.x_shape)
        if ctx.weight_requires_grad and ctx.needs_input_grad[1]:
            gq_col = quantize_blocks(g2, (group, 1), gfmt, rule, margin, f"{name}.grad_output")
            grad_w = fp8_matmul(gq_col.t(), ctx.saved_x.t(), out_dtype=ctx.weight_dtype, backend=backend)  # (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(ctx.weight_dtype)
        ctx.saved_x = ctx.saved_w = None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wq: QuantizedTensor,
               recipe: FP8Recipe, backend: str = "auto", name: str = "linear", numerics: str = "fast") -> torch.Tensor:
    """Functional FP8 linear with FP8 fprop, dgrad and wgrad. `wq` is `weight` quantized by the recipe."""
    # The 128x1 copy of the input is only needed for the weight gradient of a graph being recorded.
    save_input = torch.is_grad_enabled() and weight.requires_grad
    return _FP8LinearFunction.apply(x, weight, bias, wq, recipe, backend, name, save_input, numerics)


class PrecisionLinear(nn.Linear):
    """nn.Linear that computes in fp32, bf16 or the FP8 recipe; parameter names are unchanged."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, kind: str = "fp32",
                 recipe: FP8Recipe | None = None, gemm_backend: str = "auto", name: str = "linear",
                 numerics: str = "fast", device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if kind not in LINEAR_KINDS:
            raise ValueError(f"PrecisionLinear kind={kind!r}: valid kinds are {LINEAR_KINDS}")
        if numerics not in NUMERICS:
            raise ValueError(f"PrecisionLinear numerics={numerics!r}: valid modes are {NUMERICS}")
        self.numerics = numerics
        self._pack_key: tuple | None = None
        self._packed: torch.Tensor | None = None  # exact numerics: panels of the (fp32 | bf16-grid) weight
        if kind == "fp8" and recipe is None:
            raise ValueError(f"{name}: an fp8 linear needs an FP8Recipe")
        self.kind, self.recipe, self.gemm_backend, self.name = kind, recipe, gemm_backend, name
        self._cache_key: tuple | None = None
        self._cached: QuantizedTensor | None = None
        self._loaded: QuantizedTensor | None = None  # bytes handed in by a trainer (rollout side)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "PrecisionLinear":
        new = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        new.weight = linear.weight
        if linear.bias is not None:
            new.bias = linear.bias
        return new

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kind={self.kind}, numerics={self.numerics}"

    # The quantized weight ----------------------------------------------------------------------
    def quantized_weight(self) -> QuantizedTensor:
        """This step's quantized weight: loaded bytes if any, else quantized once per weight version."""
        if self._loaded is not None:
            return self._loaded
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if key != self._cache_key:
            wq = quantize_weight_for_recipe(w, self.recipe, f"{self.name}.weight")
            if resolve_backend(self.gemm_backend, w.device) == "emulate":
                wq.with_dequantized_cache()
            self._cached, self._cache_key = wq, key
        return self._cached

    def _bf16_weight(self) -> torch.Tensor:
        """The weight rounded to the bf16 grid (kept in fp32 for the CPU GEMM), once per weight version."""
        w = self.weight
        key = ("bf16", w.data_ptr(), w._version, w.dtype, w.device)
        if key != self._cache_key:
            self._cached, self._cache_key = w.detach().bfloat16().float(), key
        return self._cached

    def _packed_weight(self) -> torch.Tensor:
        """Exact numerics: panels of the weight this kind multiplies by (fp32, or its bf16 grid), once per
        weight version."""
        w = self.weight
        key = (self.kind, w.data_ptr(), w._version, w.dtype, w.device)
        if key != self._pack_key:
            self._packed = invariant.pack_weight(self._bf16_weight() if self.kind == "bf16" else w)
            self._pack_key = key
        return self._packed

    def load_quantized(self, wq: QuantizedTensor) -> None:
        """Use these FP8 bytes as they are (rollout side of `unified`): no requantization."""
        if tuple(wq.shape) != (self.out_features, self.in_features):
            raise ValueError(f"{self.name}: quantized weight shape {tuple(wq.shape)} != "
                             f"{(self.out_features, self.in_features)}")
        if tuple(wq.block) != tuple(self.recipe.weight_block):
            raise ValueError(f"{self.name}: weight block {wq.block} != recipe {self.recipe.weight_block}")
        if resolve_backend(self.gemm_backend, wq.data.device) == "emulate":
            wq.with_dequantized_cache()
        self._loaded = wq

    def clear_loaded(self) -> None:
        self._loaded = None

    # Forward -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        exact = self.numerics == "exact"
        if self.kind == "fp32":
            if exact:
                y = invariant.matmul(x, self.weight, self._packed_weight())
                return y if self.bias is None else y + self.bias
            return F.linear(x, self.weight, self.bias)
        if self.kind == "bf16":
            packed = self._packed_weight() if exact else None
            if x.is_cuda or torch.is_grad_enabled():
                return bf16_linear(x, self.weight, self.bias, packed=packed)
            return bf16_linear(x, self._bf16_weight(), self.bias, weight_on_grid=True,
                               packed=packed)  # rounded once per version
        return fp8_linear(x, self.weight, self.bias, self.quantized_weight(), self.recipe, self.gemm_backend,
                          self.name, self.numerics)


def _layer_index(module_name: str) -> int | None:
    parts = module_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def apply_precision(model: nn.Module, kind: str, recipe: FP8Recipe | None = None,
                    gemm_backend: str = "auto", num_layers: int | None = None, numerics: str = "fast") -> nn.Module:
    """Swap every nn.Linear of `model` for a PrecisionLinear of `kind` and `numerics`, in place.

    Under kind="fp8", modules the recipe keeps in high precision (embeddings, lm_head, norms, routers,
    first/last N layers) become bf16 linears instead. Parameters are shared, not copied.
    """
    if kind not in LINEAR_KINDS:
        raise ValueError(f"apply_precision kind={kind!r}: valid kinds are {LINEAR_KINDS}")
    if kind == "fp8" and recipe is None:
        raise ValueError("apply_precision: kind='fp8' needs an FP8Recipe")
    if num_layers is None:
        indices = [_layer_index(n) for n, _ in model.named_modules()]
        num_layers = max((i for i in indices if i is not None), default=-1) + 1
    replacements = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        module_kind = kind
        if kind == "fp8" and recipe.keeps_in_high_precision(name, _layer_index(name), num_layers):
            module_kind = "bf16"
        replacements.append((name, module, module_kind))
    for name, module, module_kind in replacements:
        if isinstance(module, PrecisionLinear):
            if numerics not in NUMERICS:
                raise ValueError(f"apply_precision numerics={numerics!r}: valid modes are {NUMERICS}")
            module.kind, module.recipe, module.gemm_backend, module.numerics = module_kind, recipe, gemm_backend, numerics
            module._cache_key = module._cached = module._loaded = module._pack_key = module._packed = None
            continue
        new = PrecisionLinear.from_linear(module, kind=module_kind, recipe=recipe, gemm_backend=gemm_backend,
                                          name=name, numerics=numerics)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    return model


def fp8_linears(model: nn.Module) -> dict[str, PrecisionLinear]:
    """The FP8 linear layers of a model by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, PrecisionLinear) and m.kind == "fp8"}
