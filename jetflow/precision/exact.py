"""The exact linear: the one function every side calls under `precision.numerics=exact`.

    y = exact_linear(x, weight, bias, kind, recipe=recipe, wq=wq, cache=cache)

The native model's PrecisionLinear, the Megatron trainer's parallel linears and the vLLM plugin's
linear method all compute a linear layer through this function, so the rollout engine and the trainer
produce a token's row with the same operations whichever engine or trainer runs it:

    product   the canonical GEMM (jetflow.kernels.canonical: 128-K block chains, `groups` groups, a
              pairwise tree) on the kind's operands, fp32 out:
                fp32  x and the fp32 weight;
                bf16  x and the weight rounded to bf16 (the weight read as bf16 bytes);
                fp8   the recipe family's exact product (jetflow.precision.family) of x and the weight's
                      bytes `wq` (this step's bytes, or the bytes a trainer shipped): fp8_block's
                      `exact_fprop` (x in 1x128 groups times the 128x128-block E4M3 bytes), or under
                      mxfp8 / nvfp4 the canonical fp32 GEMM on both operands' exact values, then NVFP4's
                      tensor-scale alpha (jetflow.precision.microscaled);
    combine   optional, on the fp32 product: a row-parallel layer's shards exchange their subtrees
              and finish the tree (Megatron's tensor parallelism);
    epilogue  bias, the bf16 kind's rounding of the output, the output dtype (`linear_epilogue`).

Differentiable in x and weight: backward runs torch's GEMMs (fp32 / bf16) or the recipe's FP8 dgrad and
wgrad; only the forward must be exact. `cache` is an `ExactCache` (jetflow.precision.exact_cache) the
caller keeps per layer: the packed weight panels live there (fp32 / bf16), rebuilt when the weight's
version changes; FP8 panels live on `wq` (`QuantizedTensor.panels`). Outside autograd the cache also
keeps the product's call prepared for those panels (the weight's checks once per version).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from jetflow.kernels import invariant
from jetflow.precision.exact_cache import ExactCache, SiblingPanels
from jetflow.precision.family import family_of
from jetflow.precision.fp8_function import prepare_exact_fprop
from jetflow.precision.modes import LINEAR_KINDS
from jetflow.precision.quant import QuantizedTensor
from jetflow.precision.recipe import QuantRecipe

__all__ = ["ExactCache", "SiblingPanels", "bf16_grid", "exact_linear", "exact_linears", "exact_product",
           "linear_epilogue", "packed_weight"]


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


def _recording(x: Tensor, weight: Tensor) -> bool:
    """A graph is being recorded through x or the weight (a trainer's forward)."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def exact_product(x: Tensor, weight: Tensor, kind: str, *, recipe: QuantRecipe | None = None,
                  wq: QuantizedTensor | None = None, cache: ExactCache | None = None, groups: int | None = None,
                  combine=None, name: str = "linear", ordered_wgrad: bool = False) -> Tensor:
    """The canonical product of x (..., K) and weight (N, K) under `kind`, then `combine`: (..., N) fp32,
    no bias."""
    if kind == "fp8":
        if recipe is None or wq is None:
            raise ValueError(f"{name}: an exact fp8 product needs the recipe and the quantized weight")
        family = family_of(recipe)
        if _recording(x, weight):
            return family.linear(x.float(), weight, None, wq, recipe, name=name, numerics="exact", groups=groups,
                                 combine=combine)
        y = family.exact_product(x.reshape(-1, x.shape[-1]).float(), wq, recipe, name, groups, combine, cache)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if kind not in LINEAR_KINDS:
        raise ValueError(f"exact linear kind {kind!r}: valid kinds are {LINEAR_KINDS}")
    y = _dense_product(x, weight, kind, cache, groups, ordered_wgrad)
    return y if combine is None else combine(y)


def _dense_product(x: Tensor, weight: Tensor, kind: str, cache: ExactCache | None, groups: int | None,
                   ordered_wgrad: bool) -> Tensor:
    """The fp32 / bf16 kind's product: invariant.matmul (differentiable), or outside autograd on the CPU
    with a cache, the same kernel through the call the cache keeps prepared for the weight's panels."""
    packed = packed_weight(cache, weight, kind)
    if cache is not None and not x.is_cuda and not _recording(x, weight):
        run = cache.prepared((packed, None, groups), lambda: _prepare_dense(kind, packed, weight.shape[0],
                                                                            weight.shape[1], groups))
        y = run(x.reshape(-1, x.shape[-1]))
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if kind == "fp32":
        return invariant.matmul(x.float(), weight, packed, groups=groups, ordered_wgrad=ordered_wgrad)
    # the bf16 grid in fp32 storage, for the backward only (the product reads the packed bf16 bytes)
    w = bf16_grid(weight) if torch.is_grad_enabled() and weight.requires_grad else weight
    return invariant.matmul(bf16_grid(x), w, packed, groups=groups, ordered_wgrad=ordered_wgrad)


def _prepare_dense(kind: str, packed: Tensor, n: int, k: int, groups: int | None = None) -> Callable[[Tensor], Tensor]:
    """fn(x2 (M, K)) -> the canonical product (M, N) fp32 of the fp32 / bf16 kind on the CPU, the weight's
    checks done once (jetflow.kernels.invariant.prepare_gemm)."""
    run = invariant.prepare_gemm(packed, n, k, groups=groups)
    return run if kind == "fp32" else lambda x2: run(bf16_grid(x2))


def exact_linear(x: Tensor, weight: Tensor, bias: Tensor | None, kind: str, *, recipe: QuantRecipe | None = None,
                 wq: QuantizedTensor | None = None, cache: ExactCache | None = None, groups: int | None = None,
                 combine=None, name: str = "linear", ordered_wgrad: bool = False) -> Tensor:
    """x (..., K) -> (..., N) in x's dtype: product, optional combine, epilogue (see the module docstring).

    groups: canonical groups in this call's K range (default tree_width(K)); a row-parallel shard of
    a layer sharded T ways passes tree_width(K_full) // T and a `combine` that finishes the tree.
    combine: fn(fp32 (..., N)) -> fp32 (..., N), applied to the product before the epilogue.
    ordered_wgrad: the fp32 / bf16 weight gradient summed over tokens in one order (invariant.weight_grad;
    sequence packing's grid, jetflow.train.packing); the FP8 wgrad sums in that order already."""
    y = exact_product(x, weight, kind, recipe=recipe, wq=wq, cache=cache, groups=groups, combine=combine, name=name,
                      ordered_wgrad=ordered_wgrad)
    return linear_epilogue(y, bias, kind, x.dtype)


def exact_linears(x: Tensor, weights: list[Tensor], biases: list[Tensor | None], kind: str, *,
                  recipe: QuantRecipe | None = None, wqs: list[QuantizedTensor] | None = None,
                  caches: list[ExactCache] | None = None, fused: SiblingPanels | None = None,
                  name: str = "linear") -> list[Tensor]:
    """Several exact linears of one input (q / k / v, gate / up) by one GEMM: [exact_linear(x, w_i, b_i,
    kind, ...) for each i], bit for bit, without autograd on the CPU (rollout, no-grad log-probs), for
    fp32 / bf16 linears or fp8_block ones in the canonical blocks (jetflow.precision.linear.sibling_linears).

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
        width = packed.shape[0] * packed.shape[2]
        if kind == "fp8":  # fp8_block's exact fprop, one weight row per scale
            call = prepare_exact_fprop(recipe, packed, scales, width, x2.shape[1], weight_rows_per_scale=1, name=name)
        else:
            call = _prepare_dense(kind, packed, width, x2.shape[1])
        if fused is not None:
            fused.parts, fused.packed, fused.scales, fused.call = panels, packed, scales, call
    y = call(x2)  # (M, sum N_i) and padding columns
    outs, start = [], 0
    for w, b, p in zip(weights, biases, panels):
        y_i = y[:, start:start + w.shape[0]].reshape(*x.shape[:-1], w.shape[0])  # (..., N_i)
        outs.append(linear_epilogue(y_i, b, kind, x.dtype))
        start += p.shape[0] * p.shape[2]
    return outs
