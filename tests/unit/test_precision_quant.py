"""Block quantizers against a plain fp32 reference."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jetflow.precision import NonFiniteError, defer_nonfinite, dequantize, quantize_blocks
from jetflow.precision.quant import compute_scale_inv

E4M3_REL = 2.0**-4  # half an ulp with 3 mantissa bits
E4M3_SUBNORMAL_STEP = 2.0**-9  # smallest subnormal of E4M3, in units of scale_inv
E5M2_REL = 2.0**-3
E5M2_SUBNORMAL_STEP = 2.0**-16

BLOCKS = {"weight": (128, 128), "rowwise": (1, 128), "colwise": (128, 1)}


def reference_blocks(x: torch.Tensor, block):
    """Plain loops over blocks: amax per block and the scale rule, in fp32."""
    rows, cols = x.shape
    nr, nc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    amax = torch.zeros(nr, nc)
    for i in range(nr):
        for j in range(nc):
            amax[i, j] = x[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].abs().max()
    return amax


def assert_within_bound(x, q, rel, sub_step):
    full_scale = q.scale_inv.repeat_interleave(q.block[0], 0).repeat_interleave(q.block[1], 1)
    full_scale = full_scale[: x.shape[0], : x.shape[1]]
    err = (dequantize(q) - x).abs()
    bound = torch.maximum(x.abs() * rel, full_scale * sub_step / 2) * (1 + 1e-6)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("kind", list(BLOCKS))
@pytest.mark.parametrize("shape", [(576, 1536), (1, 100), (256, 384), (130, 7)])
def test_round_trip_within_e4m3_bound(kind, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape) * torch.logspace(-3, 3, shape[1])  # wide dynamic range across columns
    q = quantize_blocks(x, BLOCKS[kind])
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == x.shape
    assert q.scale_inv.shape == (math.ceil(shape[0] / q.block[0]), math.ceil(shape[1] / q.block[1]))
    torch.testing.assert_close(q.scale_inv, reference_blocks(x, q.block) / 448.0, rtol=0, atol=0)
    assert_within_bound(x, q, E4M3_REL, E4M3_SUBNORMAL_STEP)


def test_block_max_is_represented_exactly():
    torch.manual_seed(1)
    x = torch.randn(300, 260)
    q = quantize_blocks(x, (128, 128))
    d = dequantize(q)
    for i in range(3):
        for j in range(3):
            blk = x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            idx = blk.abs().argmax()
            assert d[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].flatten()[idx] == pytest.approx(
                blk.flatten()[idx].item(), rel=1e-6)


@pytest.mark.parametrize("rule", ["fp32", "pow2"])
def test_values_on_the_grid_are_exact(rule):
    torch.manual_seed(2)
    x = torch.randn(256, 384)
    on_grid = dequantize(quantize_blocks(x, (128, 128), scale_rule=rule))
    again = dequantize(quantize_blocks(on_grid, (128, 128), scale_rule=rule))
    assert torch.equal(on_grid, again)


def test_pow2_scales_are_exact_powers_of_two_and_round_up():
    torch.manual_seed(3)
    x = torch.randn(200, 300) * 37.0
    q = quantize_blocks(x, (1, 128), scale_rule="pow2")
    mantissa, _ = torch.frexp(q.scale_inv)
    assert bool((mantissa == 0.5).all())
    exact = reference_blocks(x, (1, 128)) / 448.0
    assert bool((q.scale_inv >= exact).all()) and bool((q.scale_inv < 2 * exact).all())
    assert_within_bound(x, q, E4M3_REL, E4M3_SUBNORMAL_STEP)


def test_pow2_keeps_exact_powers_of_two():
    amax = torch.tensor([448.0, 448.0 * 2**-5, 448.0 * 3])
    s = compute_scale_inv(amax, "e4m3", "pow2")
    assert s.tolist() == [1.0, 2.0**-5, 4.0]


def test_margin_adds_headroom():
    x = torch.full((1, 128), 448.0)
    q = quantize_blocks(x, (1, 128), margin=1)
    assert q.scale_inv.item() == 2.0 and q.data.float().max().item() == 224.0


def test_zero_blocks_get_finite_scale_and_exact_zeros():
    x = torch.zeros(130, 260)
    x[:128, :128] = torch.randn(128, 128)
    q = quantize_blocks(x, (128, 128))
    assert bool(torch.isfinite(q.scale_inv).all())
    eps_scale = torch.tensor(1e-10) / 448  # vLLM's eps-seeded absmax, in fp32
    assert q.scale_inv[1, 1].item() == eps_scale.item() and q.scale_inv[0, 1].item() == eps_scale.item()
    assert bool((dequantize(q)[:, 128:] == 0).all()) and bool((dequantize(q)[128:] == 0).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises_naming_the_tensor(bad):
    x = torch.randn(4, 256)
    x[2, 200] = bad
    with pytest.raises(NonFiniteError, match="layers.3.mlp.up_proj.input"):
        quantize_blocks(x, (1, 128), name="layers.3.mlp.up_proj.input")


def test_deferred_non_finite_is_recorded_once_and_the_bytes_of_finite_blocks_are_unchanged():
    """defer_nonfinite (an expert-parallel step that must reach every collective): no raise, the first
    tensor's message kept, the finite blocks quantized as without NaN elsewhere, raising again after."""
    x = torch.randn(4, 256)
    clean = quantize_blocks(x, (1, 128))
    x[2, 200] = float("nan")
    with defer_nonfinite() as record:
        q = quantize_blocks(x, (1, 128), name="first")
        quantize_blocks(x, (1, 128), name="second")
    assert record.message.startswith("first: NaN or Inf in block (2, 1)")
    finite = torch.ones(4, 2, dtype=torch.bool)
    finite[2, 1] = False
    assert torch.equal(q.scale_inv[finite], clean.scale_inv[finite])
    assert torch.equal(q.data.view(torch.uint8)[:2], clean.data.view(torch.uint8)[:2])
    with defer_nonfinite() as finite_only:
        quantize_blocks(torch.randn(4, 256), (1, 128))
    assert finite_only.message is None
    with pytest.raises(NonFiniteError, match="second"):
        quantize_blocks(x, (1, 128), name="second")


def test_e5m2_gradients_round_trip_and_do_not_overflow():
    torch.manual_seed(4)
    g = torch.randn(64, 256) * 1e4
    q = quantize_blocks(g, (1, 128), fmt="e5m2")
    assert q.data.dtype == torch.float8_e5m2
    assert bool(torch.isfinite(dequantize(q)).all())
    assert_within_bound(g, q, E5M2_REL, E5M2_SUBNORMAL_STEP)


def test_transpose_is_exact():
    torch.manual_seed(5)
    q = quantize_blocks(torch.randn(200, 300), (128, 128))
    assert torch.equal(dequantize(q.t()), dequantize(q).t())


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 300), log_scale=st.floats(-6, 6),
       block=st.sampled_from(list(BLOCKS.values())), rule=st.sampled_from(["fp32", "pow2"]),
       seed=st.integers(0, 2**16))
def test_property_round_trip(rows, cols, log_scale, block, rule, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * (10.0**log_scale)
    q = quantize_blocks(x, block, scale_rule=rule)
    assert q.data.shape == x.shape
    assert bool(torch.isfinite(q.scale_inv).all()) and bool((q.scale_inv > 0).all())
    assert_within_bound(x, q, E4M3_REL, E4M3_SUBNORMAL_STEP)
