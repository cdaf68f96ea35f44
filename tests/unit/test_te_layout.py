"""Transformer Engine adapter: recipe mapping, and TE's block-scaled weight layout <-> vLLM layout.

TE cannot run on these CPU machines, so the TE-layout tensors are built here by hand from the layout
TE's source defines (Float8BlockQuantizer.get_scale_shape; Float8BlockwiseQTensorStorage.dequantize
and _create_columnwise), with garbage in the scale padding the way TE leaves it uninitialized. The
references below are written independently of jetflow/train/te.py: explicit per-block loops.
"""

import importlib.util
import math

import pytest
import torch

from jetflow.precision import QuantRecipe, QuantizedTensor, dequantize, quantize_weight
from jetflow.train import te as jte

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def te_shapes(n, k):
    """Scale shapes per TE's get_scale_shape (2-D): (rowwise, columnwise)."""
    up4 = lambda x: 4 * math.ceil(x / 4)  # noqa: E731
    return (math.ceil(n / 128), up4(math.ceil(k / 128))), (math.ceil(k / 128), up4(math.ceil(n / 128)))


def make_te_layout(n, k, seed=0, rowwise=True, columnwise=True):
    """A weight in TE's layout: random FP8 bits, random scales, NaN in the scale padding."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(n, k, generator=g) * 100
    bits = values.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.rand(math.ceil(n / 128), math.ceil(k / 128), generator=g) + 0.01  # logical (nb, kb)
    (rs, cs) = te_shapes(n, k)
    row_scale = torch.full(rs, float("nan"))
    row_scale[:, :scales.shape[1]] = scales
    col_scale = torch.full(cs, float("nan"))
    col_scale[:, :scales.shape[0]] = scales.t()
    layout = jte.TEBlockwiseLayout((n, k), torch.float8_e4m3fn,
                                   bits if rowwise else None, row_scale if rowwise else None,
                                   bits.t().contiguous() if columnwise else None, col_scale if columnwise else None)
    return layout, bits, scales


def loop_dequantize(bits, scales, fp8=torch.float8_e4m3fn):
    """Reference: every element times the scale of its 128x128 block (plain loops over blocks)."""
    x = bits.view(fp8).float()
    out = torch.empty_like(x)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            out[blk] = x[blk] * scales[i, j]
    return out


@pytest.mark.parametrize("n,k", [(200, 576), (256, 128), (64, 130)])
def test_te_layout_to_vllm_rowwise_columnwise_and_both(n, k):
    layout, bits, scales = make_te_layout(n, k)
    for row, col in ((True, False), (False, True), (True, True)):
        part, _, _ = make_te_layout(n, k, rowwise=row, columnwise=col)
        w, s = jte.te_to_vllm(part)
        assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == (n, k)
        assert tuple(s.shape) == (math.ceil(n / 128), math.ceil(k / 128)) and s.dtype == torch.float32
        assert torch.equal(w.view(torch.uint8), bits)
        assert torch.equal(s, scales)  # the NaN padding never leaks into the vLLM scales


@pytest.mark.parametrize("n,k", [(200, 576), (384, 256)])
def test_round_trip_and_dequantization_agree(n, k):
    layout, bits, scales = make_te_layout(n, k, seed=3)
    w, s = jte.te_to_vllm(layout)
    back = jte.vllm_to_te(w, s)
    rs, cs = te_shapes(n, k)
    assert tuple(back.rowwise_scale_inv.shape) == rs and tuple(back.columnwise_scale_inv.shape) == cs
    assert torch.equal(back.rowwise_data, layout.rowwise_data)
    assert torch.equal(back.columnwise_data, layout.columnwise_data)
    assert torch.equal(back.rowwise_scale_inv[:, :s.shape[1]], layout.rowwise_scale_inv[:, :s.shape[1]])
    assert torch.equal(back.columnwise_scale_inv[:, :s.shape[0]], layout.columnwise_scale_inv[:, :s.shape[0]])
    w2, s2 = jte.te_to_vllm(back)
    assert torch.equal(w2.view(torch.uint8), bits) and torch.equal(s2, scales)

    ref = loop_dequantize(bits, scales)
    vllm_dq = dequantize(QuantizedTensor(w, s, (128, 128)))  # jetflow's / vLLM's dequantization
    te_row = jte.dequantize_te_layout(jte.TEBlockwiseLayout((n, k), w.dtype, layout.rowwise_data,
                                                            layout.rowwise_scale_inv))
    te_col = jte.dequantize_te_layout(jte.TEBlockwiseLayout((n, k), w.dtype, None, None, layout.columnwise_data,
                                                            layout.columnwise_scale_inv))
    assert torch.equal(vllm_dq, ref) and torch.equal(te_row, ref) and torch.equal(te_col, ref)


def test_jetflow_quantized_weight_round_trips_through_te_layout():
    w = torch.randn(300, 200) * torch.logspace(-3, 2, 300)[:, None]
    q = quantize_weight(w, scale_rule="pow2")
    layout = jte.vllm_to_te(q.data, q.scale_inv)
    back = jte.to_quantized(layout)
    assert torch.equal(back.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(back.scale_inv, q.scale_inv) and back.block == (128, 128)


def test_from_te_tensor_reads_te_attributes():
    layout, bits, scales = make_te_layout(130, 260)

    class FakeTE:  # the attributes a Float8BlockwiseQTensor carries
        _rowwise_data, _rowwise_scale_inv = layout.rowwise_data, layout.rowwise_scale_inv
        _columnwise_data, _columnwise_scale_inv = layout.columnwise_data, layout.columnwise_scale_inv
        _fp8_dtype, _is_2D_scaled = "DType.kFloat8E4M3", True

    q = jte.from_te_tensor(FakeTE())
    assert torch.equal(q.data.view(torch.uint8), bits) and torch.equal(q.scale_inv, scales)


def test_inconsistent_or_misshapen_layouts_are_refused():
    layout, _, _ = make_te_layout(200, 300)
    layout.columnwise_data = layout.columnwise_data.clone()
    layout.columnwise_data[0, 0] ^= 1
    with pytest.raises(ValueError, match="disagree"):
        jte.te_to_vllm(layout)
    layout, _, _ = make_te_layout(200, 300)
    layout.rowwise_scale_inv = layout.rowwise_scale_inv[:, :3]  # unpadded: not TE's layout
    with pytest.raises(ValueError, match="expected"):
        jte.te_to_vllm(layout)


def test_recipe_mapping():
    assert jte.te_recipe_kwargs(QuantRecipe()) == {"fp8_format": "E4M3", "x_block_scaling_dim": 1,
                                                 "w_block_scaling_dim": 2, "grad_block_scaling_dim": 1}
    assert jte.te_recipe_kwargs(QuantRecipe(fmt="hybrid"))["fp8_format"] == "HYBRID"
    assert jte.te_env(QuantRecipe(scale_rule="fp32")) == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    assert jte.te_env(QuantRecipe(scale_rule="pow2")) == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"}


@pytest.mark.parametrize("recipe,what", [
    (QuantRecipe(weight_block=(64, 64)), "weight_block"),
    (QuantRecipe(group_size=64), "group_size"),
    (QuantRecipe(margin=1), "margin"),
])
def test_unrepresentable_recipes_are_refused(recipe, what):
    with pytest.raises(jte.TERecipeError, match=what):
        jte.te_recipe_kwargs(recipe)


def test_conflicting_scale_env_is_refused(monkeypatch):
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0")
    with pytest.raises(jte.TERecipeError, match="contradicts"):
        jte.apply_te_env(QuantRecipe(scale_rule="fp32"))
    jte.apply_te_env(QuantRecipe(scale_rule="pow2"))  # agrees: fine


@pytest.mark.skipif(HAVE_TE, reason="Transformer Engine is installed: the missing-TE message cannot show")
def test_missing_te_says_what_to_install(monkeypatch):
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    with pytest.raises(ImportError, match=r"pip install transformer-engine\[pytorch\]"):
        jte.make_te_recipe(QuantRecipe())


@pytest.mark.skipif(not (HAVE_TE and torch.cuda.is_available()),
                    reason="needs Transformer Engine and a CUDA GPU (pip install transformer-engine[pytorch])")
@pytest.mark.parametrize("scale_rule", ["pow2"])
def test_te_quantizer_bytes_equal_jetflow(scale_rule):
    recipe = QuantRecipe(scale_rule=scale_rule)
    te_recipe = jte.make_te_recipe(recipe)
    assert te_recipe.fp8_quant_fwd_weight.power_2_scale
    w = torch.randn(384, 576, device="cuda")
    mine = quantize_weight(w, scale_rule=scale_rule)
    theirs = jte.te_quantize_weight(w, recipe)
    assert torch.equal(mine.data.view(torch.uint8), theirs.data.view(torch.uint8))
    assert torch.equal(mine.scale_inv, theirs.scale_inv)
