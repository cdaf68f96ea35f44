"""Transformer Engine adapter, a library component (`jetflow train` computes with jetflow's own GEMMs and does
not call it): jetflow's QuantRecipe as TE's `Float8BlockScaling`, and TE's block-scaled weight layout <->
jetflow's / vLLM's checkpoint layout.

Transformer Engine is imported lazily, only in this module, and only by the TE-bound functions
(`make_te_recipe`, `te_autocast`, `build_te_linear`, `te_quantize_weight`, `to_te_tensor`):
`pip install transformer-engine[pytorch]` on a CUDA machine. The recipe mapping and the layout
conversion are pure and run anywhere.

The recipe (TE source: transformer_engine/common/recipe/__init__.py, class Float8BlockScaling):
  - fixed 128-element blocks: 1x128 activations and gradients (`x_block_scaling_dim=1`,
    `grad_block_scaling_dim=1`), 128x128 weights (`w_block_scaling_dim=2`); 128x1 for the
    wgrad operand comes from the columnwise 1-D quantization. No other block or group size.
  - `fp8_format` E4M3 (jetflow `e4m3`) or HYBRID (E4M3 forward, E5M2 backward: jetflow `hybrid`).
  - no `margin` field (only DelayedScaling / MXFP8BlockScaling have one): margin != 0 is refused.
  - scales are powers of two unless env `NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`, which TE reads once,
    when `transformer_engine.common.recipe` is imported (the QParams defaults are class attributes).
  TE computes scale = fp8_max / amax and stores scale_inv = 1 / scale (common/recipe/recipe_common.cuh,
  compute_scale_from_amax; pow2 truncates the scale's mantissa), jetflow scale_inv = amax / fp8_max.
  Under `pow2` the two agree exactly; under `fp32` they can differ in the last bit of scale_inv.

The layout (TE source: transformer_engine/pytorch/tensor/float8_blockwise_tensor.py,
Float8BlockQuantizer.get_scale_shape, and tensor/storage/float8_blockwise_tensor_storage.py
(tensor/_internal/float8_blockwise_tensor_base.py in older releases), dequantize / _create_columnwise).
A weight (N, K) quantized with 2-D (128x128) block scaling, as a Float8BlockwiseQTensor:
  rowwise_data          (N, K) uint8, the FP8 bits
  rowwise_scale_inv     (ceil(N/128), round_up(ceil(K/128), 4)) fp32; columns past ceil(K/128) are
                        GEMM alignment padding (uninitialized memory in TE)
  columnwise_data       (K, N) uint8 = rowwise_data transposed (for 2-D scaling, exactly)
  columnwise_scale_inv  (ceil(K/128), round_up(ceil(N/128), 4)) fp32 = rowwise scales transposed, padded
jetflow / vLLM / DeepSeek: `weight` (N, K) float8_e4m3fn + `weight_scale_inv` (ceil(N/128), ceil(K/128)) fp32.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from jetflow.errors import MissingDependencyError
from jetflow.precision import QuantRecipe, QuantizedTensor

INSTALL_HINT = "pip install transformer-engine[pytorch]  (on a CUDA machine)"
FP32_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
BLOCK = 128  # TE's Float8BlockQuantizer.block_len, fixed


class TERecipeError(ValueError):
    """The QuantRecipe cannot be represented by TE's Float8BlockScaling."""


def _import_te():
    try:
        import transformer_engine.pytorch as te  # noqa: F401
        import transformer_engine.common.recipe as te_recipe
    except ImportError as e:
        raise MissingDependencyError(f"jetflow.train.te needs Transformer Engine: {INSTALL_HINT} ({e})") from None
    return te, te_recipe


# ------------------------------------------------------------------------------------------------
# The recipe


def te_recipe_kwargs(recipe: QuantRecipe) -> dict:
    """Float8BlockScaling constructor arguments for `recipe` (fp8_format as the Format member's name).

    Raises TERecipeError listing every field TE cannot represent."""
    problems = []
    if tuple(recipe.weight_block) != (BLOCK, BLOCK):
        problems.append(f"weight_block={tuple(recipe.weight_block)}: TE's weight blocks are fixed at 128x128")
    if recipe.group_size != BLOCK:
        problems.append(f"group_size={recipe.group_size}: TE's activation/gradient groups are fixed at 1x128")
    if recipe.margin != 0:
        problems.append(f"margin={recipe.margin}: Float8BlockScaling has no margin (scale = fp8_max / amax)")
    if recipe.fmt not in ("e4m3", "hybrid"):
        problems.append(f"fmt={recipe.fmt!r}: TE supports E4M3 and HYBRID")
    if problems:
        raise TERecipeError("QuantRecipe cannot run on Transformer Engine's Float8BlockScaling: "
                            + "; ".join(problems) + " (jetflow's own GEMMs run it)")
    return {"fp8_format": "HYBRID" if recipe.fmt == "hybrid" else "E4M3",
            "x_block_scaling_dim": 1, "w_block_scaling_dim": 2, "grad_block_scaling_dim": 1}


def te_env(recipe: QuantRecipe) -> dict[str, str]:
    """Environment TE must see *before it is imported* for this recipe's scale rule."""
    return {FP32_SCALES_ENV: "1" if recipe.scale_rule == "fp32" else "0"}


def apply_te_env(recipe: QuantRecipe) -> None:
    """Set `te_env(recipe)` in os.environ; refuse a conflicting value already set by the user, and
    refuse to change it after TE's recipe module was imported (TE would not see the change)."""
    for key, want in te_env(recipe).items():
        have = os.environ.get(key)
        if have is not None and (have == "1") != (want == "1"):
            raise TERecipeError(f"{key}={have} contradicts recipe.scale_rule={recipe.scale_rule!r} "
                                f"(needs {key}={want}); unset it or change the recipe")
        if have is None and "transformer_engine.common.recipe" in sys.modules and want == "1":
            raise TERecipeError(f"transformer_engine was imported before {key}=1 was set; TE reads it once at "
                                f"import. Set {key}=1 in the environment before starting the process.")
        os.environ.setdefault(key, want)


def make_te_recipe(recipe: QuantRecipe):
    """TE's Float8BlockScaling for `recipe` (imports TE; sets the scale env var first)."""
    kwargs = te_recipe_kwargs(recipe)
    apply_te_env(recipe)
    _, te_recipe = _import_te()
    fmt = getattr(te_recipe.Format, kwargs.pop("fp8_format"))
    out = te_recipe.Float8BlockScaling(fp8_format=fmt, **kwargs)
    pow2 = recipe.scale_rule == "pow2"
    for qp in (out.fp8_quant_fwd_inp, out.fp8_quant_fwd_weight, out.fp8_quant_bwd_grad):
        if qp.power_2_scale != pow2 or qp.amax_epsilon != 0.0:
            raise TERecipeError(f"TE built scales with power_2_scale={qp.power_2_scale}, amax_epsilon="
                                f"{qp.amax_epsilon}, but the recipe's scale_rule is {recipe.scale_rule!r}; set "
                                f"{FP32_SCALES_ENV} before transformer_engine is imported")
    return out


def te_autocast(recipe: QuantRecipe, enabled: bool = True):
    """TE's FP8 autocast context under this recipe (`te.autocast` in TE >= 2.8, else `fp8_autocast`)."""
    te, _ = _import_te()
    te_rec = make_te_recipe(recipe)
    if hasattr(te, "autocast"):
        return te.autocast(enabled=enabled, recipe=te_rec)
    return te.fp8_autocast(enabled=enabled, fp8_recipe=te_rec)


def build_te_linear(in_features: int, out_features: int, bias: bool = True,
                    params_dtype: torch.dtype = torch.float32, device: str | torch.device = "cuda"):
    """A `transformer_engine.pytorch.Linear` (run it under `te_autocast(recipe)` for FP8)."""
    te, _ = _import_te()
    return te.Linear(in_features, out_features, bias=bias, params_dtype=params_dtype, device=device)


# ------------------------------------------------------------------------------------------------
# The weight layout (pure)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def te_scale_shape(shape: tuple[int, int], columnwise: bool = False) -> tuple[int, int]:
    """TE's scale_inv shape for 2-D block scaling of a (N, K) tensor (Float8BlockQuantizer.get_scale_shape)."""
    n, k = shape
    if columnwise:
        return _ceil(k, BLOCK), _ceil(_ceil(n, BLOCK), 4) * 4
    return _ceil(n, BLOCK), _ceil(_ceil(k, BLOCK), 4) * 4


@dataclass
class TEBlockwiseLayout:
    """The buffers of TE's Float8BlockwiseQTensor for a weight (N, K) with 128x128 block scaling."""

    shape: tuple[int, int]  # (N, K)
    fp8_dtype: torch.dtype  # torch.float8_e4m3fn | torch.float8_e5m2
    rowwise_data: torch.Tensor | None = None  # (N, K) uint8
    rowwise_scale_inv: torch.Tensor | None = None  # (ceil(N/128), round_up(ceil(K/128), 4)) fp32
    columnwise_data: torch.Tensor | None = None  # (K, N) uint8
    columnwise_scale_inv: torch.Tensor | None = None  # (ceil(K/128), round_up(ceil(N/128), 4)) fp32


def te_to_vllm(layout: TEBlockwiseLayout, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """TE layout -> (weight (N, K) fp8, weight_scale_inv (ceil(N/128), ceil(K/128)) fp32).

    Reads the rowwise buffers when present, else the columnwise ones (transposed back). With both and
    `check`, verifies they hold the same bytes and scales (as TE's 2-D `_create_columnwise` makes them)."""
    n, k = layout.shape
    nb, kb = _ceil(n, BLOCK), _ceil(k, BLOCK)
    out = None
    if layout.rowwise_data is not None:
        _check_shapes("rowwise", layout.rowwise_data, (n, k), layout.rowwise_scale_inv, te_scale_shape((n, k)))
        out = (layout.rowwise_data.view(layout.fp8_dtype), layout.rowwise_scale_inv[:, :kb].float().contiguous())
    if layout.columnwise_data is not None and (out is None or check):
        _check_shapes("columnwise", layout.columnwise_data, (k, n), layout.columnwise_scale_inv,
                      te_scale_shape((n, k), columnwise=True))
        col = (layout.columnwise_data.view(layout.fp8_dtype).t().contiguous(),
               layout.columnwise_scale_inv[:, :nb].t().float().contiguous())
        if out is None:
            out = col
        elif not (torch.equal(out[0].view(torch.uint8), col[0].view(torch.uint8)) and torch.equal(out[1], col[1])):
            raise ValueError("TE layout: rowwise and columnwise buffers disagree (not a 2-D block-scaled weight?)")
    if out is None:
        raise ValueError("TE layout has neither rowwise nor columnwise data")
    return out


def _check_shapes(which: str, data: torch.Tensor, data_shape, scale: torch.Tensor, scale_shape) -> None:
    if tuple(data.shape) != tuple(data_shape) or scale is None or tuple(scale.shape) != tuple(scale_shape):
        raise ValueError(f"TE {which} buffers: data {tuple(data.shape)} (expected {tuple(data_shape)}), scale_inv "
                         f"{None if scale is None else tuple(scale.shape)} (expected {tuple(scale_shape)})")


def vllm_to_te(weight: torch.Tensor, scale_inv: torch.Tensor, rowwise: bool = True, columnwise: bool = True,
               pad_value: float = 1.0) -> TEBlockwiseLayout:
    """(weight (N, K) fp8, weight_scale_inv (ceil(N/128), ceil(K/128))) -> TE layout; the scale padding
    that TE leaves uninitialized is filled with `pad_value`."""
    n, k = weight.shape
    if tuple(scale_inv.shape) != (_ceil(n, BLOCK), _ceil(k, BLOCK)):
        raise ValueError(f"weight_scale_inv {tuple(scale_inv.shape)} does not match weight {(n, k)} in 128x128 blocks")
    layout = TEBlockwiseLayout((n, k), weight.dtype)
    bits = weight.contiguous().view(torch.uint8)
    s = scale_inv.float()
    if rowwise:
        layout.rowwise_data = bits
        layout.rowwise_scale_inv = F.pad(s, (0, te_scale_shape((n, k))[1] - s.shape[1]), value=pad_value)
    if columnwise:
        layout.columnwise_data = bits.t().contiguous()
        st = s.t()
        layout.columnwise_scale_inv = F.pad(st, (0, te_scale_shape((n, k), True)[1] - st.shape[1]), value=pad_value)
    return layout


def to_quantized(layout: TEBlockwiseLayout) -> QuantizedTensor:
    """TE layout -> jetflow's QuantizedTensor (the bytes and scales the rollout engine receives)."""
    data, scale = te_to_vllm(layout)
    return QuantizedTensor(data, scale, (BLOCK, BLOCK))


def dequantize_te_layout(layout: TEBlockwiseLayout, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, K) values, computed the way TE's Float8BlockwiseQTensorStorage.dequantize does for 2-D
    scaling: drop the scale padding, zero-pad the data to whole tiles, multiply tile by scale.
    A CPU reference for TE's own dequantization (TE itself cannot run here)."""
    n, k = layout.shape
    if layout.rowwise_data is not None:
        q, scale, transpose = layout.rowwise_data, layout.rowwise_scale_inv, False
    else:
        q, scale, transpose = layout.columnwise_data, layout.columnwise_scale_inv, True
    rows, cols = q.shape
    scale = scale[:, :_ceil(cols, BLOCK)]  # format_scale_as_logical_shape
    mt, kt = scale.shape
    padded = torch.zeros(mt * BLOCK, kt * BLOCK, dtype=torch.uint8)
    padded[:rows, :cols] = q
    tiles = padded.view(layout.fp8_dtype).float().view(mt, BLOCK, kt, BLOCK) * scale.float().view(mt, 1, kt, 1)
    out = tiles.view(mt * BLOCK, kt * BLOCK)[:rows, :cols].to(dtype)
    return out.t().contiguous() if transpose else out


# ------------------------------------------------------------------------------------------------
# TE tensors (TE-bound)


def from_te_tensor(t) -> QuantizedTensor:
    """A TE Float8BlockwiseQTensor (2-D scaled) -> QuantizedTensor. Reads its buffers by attribute
    (`_rowwise_data`, `_rowwise_scale_inv`, `_columnwise_data`, `_columnwise_scale_inv`, `_fp8_dtype`)."""
    if not getattr(t, "_is_2D_scaled", True):
        raise ValueError("from_te_tensor: a 1x128 (1-D) block-scaled tensor is not a weight in 128x128 blocks")
    name = str(t._fp8_dtype)
    fp8 = torch.float8_e5m2 if "E5M2" in name.upper() else torch.float8_e4m3fn
    data = t._rowwise_data if t._rowwise_data is not None else t._columnwise_data
    shape = tuple(data.shape) if t._rowwise_data is not None else tuple(data.shape[::-1])
    layout = TEBlockwiseLayout(shape, fp8, t._rowwise_data, t._rowwise_scale_inv, t._columnwise_data,
                               t._columnwise_scale_inv)
    return to_quantized(layout)


def te_quantize_weight(weight: torch.Tensor, recipe: QuantRecipe) -> QuantizedTensor:
    """Quantize (N, K) with TE's own Float8BlockQuantizer (128x128) -> QuantizedTensor (CUDA, needs TE);
    compare with `jetflow.precision.quantize_weight` to check that both sides make the same bytes."""
    te_recipe_kwargs(recipe)
    _import_te()
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    quantizer = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False, amax_epsilon=0.0,
                                     force_pow_2_scales=recipe.scale_rule == "pow2", block_scaling_dim=2)
    return from_te_tensor(quantizer(weight))


def to_te_tensor(q: QuantizedTensor, dtype: torch.dtype = torch.bfloat16):
    """QuantizedTensor (128x128 blocks) -> TE Float8BlockwiseQTensor with rowwise and columnwise buffers
    (needs TE; constructor as in TE 2.x Float8BlockQuantizer.make_empty)."""
    if tuple(q.block) != (BLOCK, BLOCK):
        raise ValueError(f"to_te_tensor: TE weights use 128x128 blocks, got {q.block}")
    _import_te()
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer, Float8BlockwiseQTensor

    te_dtype = tex.DType.kFloat8E5M2 if q.data.dtype == torch.float8_e5m2 else tex.DType.kFloat8E4M3
    layout = vllm_to_te(q.data, q.scale_inv)
    quantizer = Float8BlockQuantizer(te_dtype, rowwise=True, columnwise=True, block_scaling_dim=2)
    return Float8BlockwiseQTensor(shape=layout.shape, dtype=dtype, fp8_dtype=te_dtype,
                                  rowwise_data=layout.rowwise_data, rowwise_scale_inv=layout.rowwise_scale_inv,
                                  columnwise_data=layout.columnwise_data,
                                  columnwise_scale_inv=layout.columnwise_scale_inv, quantizer=quantizer,
                                  is_2D_scaled=True, requires_grad=False)


__all__ = [
    "BLOCK", "FP32_SCALES_ENV", "TERecipeError", "TEBlockwiseLayout", "te_recipe_kwargs", "te_env", "apply_te_env",
    "make_te_recipe", "te_autocast", "build_te_linear", "te_scale_shape", "te_to_vllm", "vllm_to_te", "to_quantized",
    "dequantize_te_layout", "from_te_tensor", "te_quantize_weight", "to_te_tensor",
]
