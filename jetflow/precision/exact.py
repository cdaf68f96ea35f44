"""The exact linear: the one function every side calls under `precision.numerics=exact`.

    y = exact_linear(x, weight, bias, kind, recipe=recipe, wq=wq, cache=cache)

The native model's PrecisionLinear, the Megatron trainer's parallel linears and the vLLM plugin's
linear method all compute a linear layer through this function, so the rollout engine and the trainer
produce a token's row with the same operations whichever engine or trainer runs it:

    product   the canonical GEMM (jetflow.kernels.canonical: 128-K block chains, `groups` groups, a
              pairwise tree) on the kind's operands, fp32 out:
                fp32  x and the fp32 weight;
                bf16  x and the weight rounded to bf16 (the weight read as bf16 bytes);
                fp8   x quantized in 1x128 groups (the recipe's activation quantizer) and the weight's
                      128x128-block E4M3 bytes `wq` (this step's bytes, or the bytes a trainer shipped);
                      under the mxfp8 / nvfp4 recipe families the canonical fp32 GEMM on both operands'
                      exact values, then NVFP4's tensor-scale alpha (jetflow.precision.microscaled);
    combine   optional, on the fp32 product: a row-parallel layer's shards exchange their subtrees
              and finish the tree (Megatron's tensor parallelism);
    epilogue  bias, the bf16 kind's rounding of the output, the output dtype (`linear_epilogue`).

Differentiable in x and weight: backward runs torch's GEMMs (fp32 / bf16) or the recipe's FP8 dgrad and
wgrad; only the forward must be exact. `cache` is an `ExactCache` the caller keeps per layer: the packed
weight panels live there (fp32 / bf16), rebuilt when the weight's version changes; FP8 panels live on `wq`
(`QuantizedTensor.panels`). Outside autograd on the CPU the cache also keeps the product's
kernel call prepared for those panels (`invariant.prepare_gemm`: the weight's checks once per version,
not once per call, which a decode step's small GEMMs would pay four times a layer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from jetflow.kernels import invariant
from jetflow.precision import microscaled
from jetflow.precision.modes import LINEAR_KINDS
from jetflow.precision.fp8_function import exact_fp8_fprop, exact_fp8_product, fp8_linear
from jetflow.precision.quant import QuantizedTensor
from jetflow.precision.recipe import QuantRecipe

@dataclass
class SiblingPanels:
    """What `exact_linears` keeps between calls for one group of sibling linears (q / k / v, gate / up):
    their panels side by side, rebuilt when any linear's own panels change."""
    parts: list[Tensor] = field(default_factory=list)  # each linear's panels: views into `packed`
    packed: Tensor | None = None  # (sum P_i, K or K/2, NR) the siblings' panels side by side
    scales: Tensor | None = None  # FP8: (sum P_i * NR, K / 128) each weight row's block scale
    call: Callable | None = None  # the prepared kernel call for `packed` (CPU), or None


@dataclass
class ExactCache:
    """What `exact_linear` keeps for one weight between calls (its caller holds one per layer)."""
    key: tuple | None = None  # (kind, data_ptr, version, dtype, device, shape) of the weight `packed` was made from
    packed: Tensor | None = None  # the canonical GEMM's panels of the weight as the kind reads it (fp32 / bf16)
    call: Callable | None = None  # the product's prepared kernel call (CPU, outside autograd) ...
    call_operands: tuple = ()  # ... for these (panels, weight scales, groups), compared by identity
    siblings: SiblingPanels = field(default_factory=SiblingPanels)  # exact_linears, when this layer leads a group

    def clear(self) -> None:
        """Forget everything (the weight changed in a way its version counter does not show)."""
        self.key = self.packed = self.call = None
        self.call_operands, self.siblings = (), SiblingPanels()


def _weight_key(weight: Tensor) -> tuple:
    return weight.data_ptr(), weight._version, weight.dtype, weight.device, tuple(weight.shape)


def packed_weight(cache: ExactCache | None, weight: Tensor, kind: str) -> Tensor:
    """The canonical GEMM's panels of `weight` as `kind` reads it (fp32, or its bf16 bytes), once per
    weight version when a cache is given."""
    key = (kind, *_weight_key(weight))
    if cache is not None and cache.key == key:
        return cache.packed
    w = weight.detach().float() if kind == "fp32" else weight.detach().bfloat16()
    packed = invariant.pack_weight(w)
    if cache is not None:
        cache.key, cache.packed = key, packed
    return packed


class _BF16Grid(torch.autograd.Function):
    """t.bfloat16().float() for fp32 t, forward and backward (whose gradient is rounded to bf16 too, as
    through the two casts), each one pass of `invariant.round_to_bf16`."""

    @staticmethod
    def forward(ctx, t):
        return invariant.round_to_bf16(t)

    @staticmethod
    def backward(ctx, grad):
        return invariant.round_to_bf16(grad)


def bf16_grid(t: Tensor) -> Tensor:
    """t rounded to the bf16 grid, as fp32 (t.bfloat16().float()): the bf16 kind's operands and output.
    For a large lm_head weight or a batch's logits, one pass each way instead of two casts (which a
    profile of a SmolLM2 training step found among its lm_head's costs)."""
    t = t.float()
    return _BF16Grid.apply(t) if torch.is_grad_enabled() and t.requires_grad else invariant.round_to_bf16(t)


def linear_epilogue(y: Tensor, bias: Tensor | None, kind: str, dtype: torch.dtype) -> Tensor:
    """After the full product (fp32): the bias, then the bf16 kind's rounding to bf16 (bias on the bf16
    grid first), and the output dtype."""
    if kind == "bf16":
        if bias is not None:
            y = y + bf16_grid(bias)
        return bf16_grid(y) if dtype == torch.float32 else y.bfloat16().to(dtype)
    y = y.to(dtype)
    return y if bias is None else y + bias.to(dtype)


def exact_product(x: Tensor, weight: Tensor, kind: str, *, recipe: QuantRecipe | None = None,
                  wq: QuantizedTensor | None = None, cache: ExactCache | None = None, groups: int | None = None,
                  name: str = "linear") -> Tensor:
    """The canonical product of x (..., K) and weight (N, K) under `kind`: (..., N) fp32, no bias."""
    return _combined_product(x, weight, kind, recipe, wq, cache, groups, None, name)


def _combined_product(x: Tensor, weight: Tensor, kind: str, recipe: QuantRecipe | None, wq, cache: ExactCache | None,
                      groups: int | None, combine, name: str, ordered_wgrad: bool = False) -> Tensor:
    """exact_product, then `combine`; the mxfp8 / nvfp4 products apply it themselves (NVFP4's tensor-scale
    alpha must multiply the combined sum, jetflow.precision.microscaled)."""
    if kind == "fp8" and recipe is not None and recipe.family != "fp8_block":
        if wq is None:
            raise ValueError(f"{name}: an exact {recipe.family} product needs the quantized weight")
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return microscaled.microscaled_linear(x.float(), weight, None, wq, recipe, name, "exact", groups, combine)
        y = microscaled.exact_product(x.reshape(-1, x.shape[-1]).float(), wq, recipe, name, groups, combine)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    y = _product(x, weight, kind, recipe, wq, cache, groups, name, ordered_wgrad)
    return y if combine is None else combine(y)


def _product(x: Tensor, weight: Tensor, kind: str, recipe: QuantRecipe | None, wq, cache: ExactCache | None,
             groups: int | None, name: str, ordered_wgrad: bool = False) -> Tensor:
    if kind == "fp32":
        return invariant.matmul(x.float(), weight, packed_weight(cache, weight, "fp32"), groups=groups,
                                ordered_wgrad=ordered_wgrad)
    if kind == "bf16":
        # the bf16 grid in fp32 storage, for the backward only (the product reads the packed bf16 bytes)
        w = bf16_grid(weight) if torch.is_grad_enabled() and weight.requires_grad else weight
        return invariant.matmul(bf16_grid(x), w, packed_weight(cache, weight, "bf16"), groups=groups,
                                ordered_wgrad=ordered_wgrad)
    if kind == "fp8":
        if recipe is None or wq is None:
            raise ValueError(f"{name}: an exact fp8 product needs the recipe and the quantized weight")
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return fp8_linear(x.float(), weight, None, wq, recipe, name=name, numerics="exact", groups=groups)
        y = exact_fp8_product(x.reshape(-1, x.shape[-1]).float(), wq, recipe, name, groups)  # no autograd graph
        return y.reshape(*x.shape[:-1], y.shape[-1])
    raise ValueError(f"exact linear kind {kind!r}: valid kinds are {LINEAR_KINDS}")


def exact_linear(x: Tensor, weight: Tensor, bias: Tensor | None, kind: str, *, recipe: QuantRecipe | None = None,
                 wq: QuantizedTensor | None = None, cache: ExactCache | None = None, groups: int | None = None,
                 combine=None, name: str = "linear", ordered_wgrad: bool = False) -> Tensor:
    """x (..., K) -> (..., N) in x's dtype: product, optional combine, epilogue (see the module docstring).

    groups: canonical groups in this call's K range (default tree_width(K)); a row-parallel shard of
    a layer sharded T ways passes tree_width(K_full) // T and a `combine` that finishes the tree.
    combine: fn(fp32 (..., N)) -> fp32 (..., N), applied to the product before the epilogue.
    ordered_wgrad: the fp32 / bf16 weight gradient summed over tokens in one order (invariant.weight_grad;
    sequence packing's grid, jetflow.train.packing); the FP8 wgrad sums in that order already."""
    call = _cached_call(x, weight, kind, recipe, wq, cache, groups)
    if call is not None:
        y = call(x.reshape(-1, x.shape[-1]))
        if y is not None:  # else an FP8 input group holds NaN / Inf: the general path reports it
            y = y.reshape(*x.shape[:-1], y.shape[-1])
            return linear_epilogue(y if combine is None else combine(y), bias, kind, x.dtype)
    y = _combined_product(x, weight, kind, recipe, wq, cache, groups, combine, name, ordered_wgrad)
    return linear_epilogue(y, bias, kind, x.dtype)


def _cached_call(x: Tensor, weight: Tensor, kind: str, recipe: QuantRecipe | None, wq, cache: ExactCache | None,
                 groups: int | None):
    """The product's prepared kernel call (`_prepare_call`), kept in `cache` per weight version, where the
    product runs on the CPU outside autograd (a rollout's decode step, no-grad log-probs); None elsewhere.
    The same kernel on the same operands as `_product`: it only skips the checks of each call."""
    if cache is None or x.is_cuda or kind not in LINEAR_KINDS or \
            (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return None
    if kind == "fp8":
        if recipe is None or wq is None or not recipe.canonical_blocks \
                or wq.block != (128, 128) or wq.fmt != "e4m3":
            return None
        packed, sw = wq.panels(), wq.scale_inv
    else:
        packed, sw = packed_weight(cache, weight, kind), None
    held = cache.call_operands
    if cache.call is None or held[0] is not packed or held[1] is not sw or held[2] != groups:
        cache.call = _prepare_call(kind, recipe, packed, sw, weight.shape[0], weight.shape[1], groups)
        cache.call_operands = (packed, sw, groups)
    return cache.call


def _prepare_call(kind: str, recipe: QuantRecipe | None, packed: Tensor, sw: Tensor | None, n: int, k: int,
                  groups: int | None = None, weight_rows_per_scale: int = 128):
    """fn(x2 (M, K)) -> the canonical product (M, N) fp32 under `kind` on the CPU, the weight's checks done
    once (jetflow.kernels.invariant.prepare_gemm); for FP8, None when an input group holds NaN / Inf."""
    if kind == "fp8":
        return invariant.prepare_quantized_fp8_gemm(recipe.scale_rule, recipe.margin, packed, sw, n, k, groups=groups,
                                                    weight_rows_per_scale=weight_rows_per_scale)
    run = invariant.prepare_gemm(packed, n, k, groups=groups)
    return run if kind == "fp32" else lambda x2: run(bf16_grid(x2))


def exact_linears(x: Tensor, weights: list[Tensor], biases: list[Tensor | None], kind: str, *,
                  recipe: QuantRecipe | None = None, wqs: list[QuantizedTensor] | None = None,
                  caches: list[ExactCache] | None = None, fused: SiblingPanels | None = None,
                  name: str = "linear") -> list[Tensor]:
    """Several exact linears of one input (q / k / v, gate / up) by one GEMM: [exact_linear(x, w_i, b_i,
    kind, ...) for each i], bit for bit, without autograd (rollout, no-grad log-probs).

    Why equal: the canonical GEMM computes each output column from its own weight row and the row of x
    alone, so laying the weights' panels side by side changes no column's arithmetic; FP8 weights keep
    their own block scales (passed per column: sx * sw, then times the block partial, as per block).
    What it saves: x is quantized (FP8) and packed once instead of once per linear, and one kernel call
    replaces several. `fused` keeps the side-by-side panels between calls (rebuilt when a weight's
    panels change). Panels of different layouts (a bf16 weight with values below the pair layout's
    range) cannot sit side by side: then each linear runs alone."""
    x2 = x.reshape(-1, x.shape[-1])
    if kind == "fp8":
        panels = [wq.panels() for wq in wqs]
    else:
        panels = [packed_weight(cache, w, kind) for w, cache in zip(weights, caches)]
    if len({(p.dtype, p.shape[1:]) for p in panels}) > 1:  # e.g. a bf16 weight too tiny for the pair layout
        return [exact_linear(x, w, b, kind, recipe=recipe, wq=wqs[i] if wqs else None, cache=caches[i], name=name)
                for i, (w, b) in enumerate(zip(weights, biases))]
    if fused is not None and len(fused.parts) == len(panels) and all(a is b for a, b in zip(fused.parts, panels)):
        packed, scales, call = fused.packed, fused.scales, fused.call
    else:
        packed = torch.cat(panels)  # (sum P_i, K or K/2, NR)
        panels = list(torch.split(packed, [p.shape[0] for p in panels]))  # each linear's panels: views, no 2nd copy
        for i, view in enumerate(panels):
            if kind == "fp8":
                wqs[i].share_panels(view)
            else:
                caches[i].packed = view
        scales = None
        if kind == "fp8":  # (sum P_i * NR, K / 128): weight row n's block scale, zero in padded columns, kept
            # as the transpose of (K / 128, sum P_i * NR) rows, the layout fp8_gemm reads (no copy per call)
            scales = torch.cat([F.pad(wq.scale_inv.float().repeat_interleave(128, 0)[:wq.shape[0]],
                                      (0, 0, 0, p.shape[0] * p.shape[2] - wq.shape[0])) for wq, p in zip(wqs, panels)])
            scales = scales.t().contiguous().t()
        call = None
        if not x2.is_cuda and (kind != "fp8" or recipe.group_size == 128):
            call = _prepare_call(kind, recipe, packed, scales, packed.shape[0] * packed.shape[2], x2.shape[1],
                                 weight_rows_per_scale=1)
        if fused is not None:
            fused.parts, fused.packed, fused.scales, fused.call = panels, packed, scales, call
    width = packed.shape[0] * packed.shape[2]
    y = call(x2) if call is not None else None
    if y is None and kind == "fp8":  # CUDA, or an input group with NaN / Inf, which quantize_input reports
        y = exact_fp8_fprop(x2, recipe, name, packed, scales, width, weight_rows_per_scale=1)
    elif y is None:
        y = invariant.gemm(x2.float() if kind == "fp32" else bf16_grid(x2), packed, width)
    outs, start = [], 0
    for w, b, p in zip(weights, biases, panels):
        y_i = y[:, start:start + w.shape[0]].reshape(*x.shape[:-1], w.shape[0])  # (..., N_i)
        outs.append(linear_epilogue(y_i, b, kind, x.dtype))
        start += p.shape[0] * p.shape[2]
    return outs
