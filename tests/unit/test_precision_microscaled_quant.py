"""E2M1 codes, MXFP8 and NVFP4 quantizers against hand-computed cases (issue 28)."""

import math

import pytest
import torch

from jetflow.precision import NonFiniteError, defer_nonfinite
from jetflow.precision import fp4
from jetflow.precision.mx import e8m0_exponent, e8m0_values, quantize_mx
from jetflow.precision.nvfp4 import hadamard16, quantize_nvfp4

U8 = torch.uint8
VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def up(v: float) -> float:
    """The next fp32 above v."""
    return torch.nextafter(torch.tensor(v), torch.tensor(math.inf)).item()


def down(v: float) -> float:
    return torch.nextafter(torch.tensor(v), torch.tensor(-math.inf)).item()


# -- E2M1 ---------------------------------------------------------------------------------------
def test_every_e2m1_value_is_its_own_code_and_back():
    x = torch.tensor(VALUES + [-v for v in VALUES[1:]])
    codes = fp4.round_e2m1(x)
    assert codes.tolist() == list(range(8)) + list(range(9, 16))
    assert torch.equal(fp4.e2m1_values(codes), x)


@pytest.mark.parametrize("tie,code", [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)])
def test_every_tie_rounds_to_the_even_code_and_a_hair_either_side_to_the_nearest(tie, code):
    """Ties between neighbours go to the code with mantissa bit 0 (0, 2, 4, 6), as
    cvt.rn.satfinite.e2m1x2 and TE's reference cast_to_fp4x2; just below / above the tie they go to the
    lower / upper neighbour; negatives the same with the sign bit (8)."""
    below, above = [i for i, v in enumerate(VALUES) if v < tie][-1], [i for i, v in enumerate(VALUES) if v > tie][0]
    x = torch.tensor([tie, down(tie), up(tie), -tie, -down(tie), -up(tie)])
    assert fp4.round_e2m1(x).tolist() == [code, below, above, code | 8, below | 8, above | 8]


def test_e2m1_saturates_and_signs_zero_as_te():
    x = torch.tensor([6.0, up(6.0), 7.0, 1e30, -100.0, 0.0, -0.0, -1e-30, 1e-30])
    assert fp4.round_e2m1(x).tolist() == [7, 7, 7, 7, 15, 0, 0, 8, 0]


def test_pack_puts_the_even_element_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 3], [15, 8, 7]], dtype=U8)
    packed = fp4.pack(codes)
    assert packed.tolist() == [[0x21, 0x03], [0x8F, 0x07]]
    assert torch.equal(fp4.unpack(packed, 3), codes)


def test_stochastic_rounding_is_unbiased_and_stays_between_neighbours():
    """2.6 lies between 2 and 3 (p(3) = 0.6): the mean of 200k draws is 2.6 within 5 standard errors
    (0.49 / sqrt(200k) = 0.0011); grid values never move; 6.5 saturates to 6."""
    gen = torch.Generator().manual_seed(0)
    draws = fp4.e2m1_values(fp4.round_e2m1_stochastic(torch.full((200_000,), 2.6), gen))
    assert set(draws.unique().tolist()) == {2.0, 3.0}
    assert abs(draws.mean().item() - 2.6) < 5 * 0.49 / math.sqrt(200_000)
    grid = torch.tensor(VALUES + [-v for v in VALUES] + [6.5, -9.0])
    codes = fp4.round_e2m1_stochastic(grid, gen)
    assert torch.equal(fp4.e2m1_values(codes), grid.clamp(-6, 6))


def test_stochastic_rounding_is_reproducible_from_its_seed():
    x = torch.randn(4096) * 3
    a = fp4.round_e2m1_stochastic(x, torch.Generator().manual_seed(7))
    b = fp4.round_e2m1_stochastic(x, torch.Generator().manual_seed(7))
    c = fp4.round_e2m1_stochastic(x, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


# -- MXFP8 --------------------------------------------------------------------------------------
def test_e8m0_scale_rounds_amax_over_448_up_to_a_power_of_two():
    """biased = ceil(log2(amax / 448)) + 127, exact at and around powers of two, 0 for zero and
    subnormal amax; E5M2 divides by 57344."""
    amax = torch.tensor([448.0, up(448.0), 449.0, 224.0, 56.0, 1000.0, 0.0, 1e-40, 3e38])
    assert e8m0_exponent(amax).tolist() == [127, 128, 128, 126, 124, 129, 0, 0, 247]
    assert e8m0_exponent(torch.tensor([57344.0, 57345.0]), "e5m2").tolist() == [127, 128]
    assert e8m0_values(torch.tensor([0, 127, 130], dtype=U8)).tolist() == [2.0**-127, 1.0, 8.0]


def test_mx_block_hand_computed():
    """Block 0 (amax 1000, scale 4): 1000 / 4 = 250 rounds to E4M3 256 (step 16 in [128, 256)), 3 -> 0.75
    exactly. Block 1 (amax 448, scale 1): 2^-10 is a tie between 0 and E4M3's least subnormal 2^-9 and
    goes to 0 (even), 3 * 2^-10 a tie between 2^-9 and 2^-8 and goes to 2^-8 (even). Block 2 is zero."""
    x = torch.zeros(1, 96)
    x[0, 0], x[0, 1] = 1000.0, 3.0
    x[0, 32], x[0, 33], x[0, 34] = 448.0, 2.0**-10, 3 * 2.0**-10
    q = quantize_mx(x)
    assert q.scale.tolist() == [[129, 127, 0]] and q.data.dtype == torch.float8_e4m3fn
    d = q.dequantize()
    assert d[0, :2].tolist() == [1024.0, 3.0]
    assert d[0, 32:35].tolist() == [448.0, 0.0, 2.0**-8]
    assert not d[0, 64:].any() and bool(torch.isfinite(d).all())


def test_mx_values_on_the_grid_are_exact_and_partial_blocks_get_their_own_scale():
    torch.manual_seed(0)
    x = torch.randn(5, 40) * torch.logspace(-3, 3, 40)  # K = 40: a full block and a partial one
    q = quantize_mx(x)
    assert q.scale.shape == (5, 2)
    on_grid = q.dequantize()
    assert torch.equal(quantize_mx(on_grid).dequantize(), on_grid)  # (a block's scale may drop a binade)
    scale = e8m0_values(q.scale).repeat_interleave(32, 1)[:, :40]  # (5, 40)
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)  # half an E4M3 ulp, or half its least subnormal
    assert bool(((on_grid - x).abs() <= bound * (1 + 1e-6)).all())


def test_mx_columnwise_blocks_are_rowwise_blocks_of_the_transpose():
    x = torch.randn(70, 9)
    col, row = quantize_mx(x, (32, 1)), quantize_mx(x.t().contiguous(), (1, 32))
    assert torch.equal(col.data.view(U8).t(), row.data.view(U8)) and torch.equal(col.scale.t(), row.scale)
    assert torch.equal(col.t().dequantize(), row.dequantize())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_mx_refuses_non_finite_and_defers_like_the_fp8_quantizer(bad):
    x = torch.randn(3, 64)
    x[1, 40] = bad
    with pytest.raises(NonFiniteError, match=r"layers.0.q_proj.input: NaN or Inf in block \(1, 1\)"):
        quantize_mx(x, name="layers.0.q_proj.input")
    with defer_nonfinite() as record:
        quantize_mx(x, name="first")
    assert record.message.startswith("first")


# -- NVFP4 --------------------------------------------------------------------------------------
def test_nvfp4_two_level_scales_hand_computed():
    """One row of six 16-blocks, amax_t = 2688 so S_enc = 448 * 6 / 2688 = 1 and d = 1: each block's
    E4M3 scale is e4m3(amax_b / 6): 2688 -> 448; 1000 -> 166.7 -> 160 (step 16); 342 -> 57 -> 56 (step 4,
    then 342 / 56 = 6.1 saturates at 6); 354 -> 59 -> 60; 0.03 -> 0.005 -> 3 * 2^-9 (a subnormal scale);
    1e-3 -> 1.7e-4 -> 0 (below half of 2^-9: the block's values become 0)."""
    x = torch.zeros(1, 96)
    for b, v in enumerate([2688.0, 1000.0, 342.0, 354.0, 0.03, 1e-3]):
        x[0, 16 * b] = v
    x[0, 17], x[0, 18] = 500.0, -250.0
    q = quantize_nvfp4(x)
    assert q.tensor_scale.item() == 1.0 and q.data.shape == (1, 48) and q.scale.shape == (1, 6)
    assert q.scale.float().tolist() == [[448.0, 160.0, 56.0, 60.0, 3 * 2.0**-9, 0.0]]
    d = q.dequantize()
    # 1000/160 = 6.25 -> 6; 500/160 = 3.125 -> 3; -250/160 = -1.5625 -> -1.5; 342/56 -> 6 (saturated); 354/60 = 5.9 -> 6
    assert d[0, [0, 16, 17, 18, 32, 48]].tolist() == [2688.0, 960.0, 480.0, -240.0, 336.0, 360.0]
    assert d[0, 64].item() == 6 * 3 * 2.0**-9 and d[0, 80].item() == 0.0  # 0.03 / 0.00586 = 5.1 -> 6


def test_nvfp4_tensor_scale_is_amax_over_2688_and_multiplies_the_block_values():
    """amax_t = 6: S_enc = 448, the block with amax 6 gets scale 448 and codes equal to x (values on the
    E2M1 grid); d = 6 / 2688 (fp32 division): value = code * 448 * d."""
    x = torch.tensor([[6.0, -3.0, 0.5, 1.5] + [0.0] * 12])
    q = quantize_nvfp4(x)
    d = torch.tensor(6.0) / 2688.0
    assert q.tensor_scale.item() == d.item() and q.scale.float().item() == 448.0
    assert q.codes()[0, :4].tolist() == [7, 13, 1, 3]
    assert torch.equal(q.block_values()[0, :4], torch.tensor([2688.0, -1344.0, 224.0, 672.0]))
    assert torch.equal(q.dequantize(), q.block_values() * d)


def test_nvfp4_zeros_stay_zero_without_nan():
    q = quantize_nvfp4(torch.zeros(3, 32))
    assert q.tensor_scale.item() == 0.0 and not q.data.any() and not q.scale.float().any()
    assert torch.equal(q.dequantize(), torch.zeros(3, 32))


def test_nvfp4_row_scales_make_a_row_independent_of_its_batch():
    torch.manual_seed(1)
    x = torch.randn(6, 64) * torch.tensor([1e-3, 1, 10, 100, 1e3, 1e4])[:, None]
    q = quantize_nvfp4(x, per_row=True)
    assert torch.equal(q.tensor_scale, x.abs().amax(1) / 2688.0)
    alone = quantize_nvfp4(x[3:4], per_row=True)
    assert torch.equal(alone.data, q.data[3:4]) and torch.equal(alone.scale.view(U8), q.scale[3:4].view(U8))
    rel = ((q.dequantize() - x).abs() / x.abs().amax(1, keepdim=True)).max().item()
    assert rel <= 1 / 6 + 1e-6  # half a step at the top of the grid (4 -> 6), relative to the row's amax


def test_nvfp4_16x16_weight_blocks_transpose_to_the_same_bytes():
    torch.manual_seed(2)
    w = torch.randn(40, 48)
    q = quantize_nvfp4(w, (16, 16))
    assert q.scale.shape == (3, 3)
    qt = q.t()
    assert qt.shape == (48, 40) and torch.equal(qt.dequantize(), q.dequantize().t())
    assert torch.equal(qt.scale.view(U8), q.scale.t().view(U8))


def test_nvfp4_refuses_non_finite_naming_the_tensor_and_row():
    x = torch.randn(4, 32)
    x[2, 5] = float("nan")
    with pytest.raises(NonFiniteError, match="mlp.up_proj.input: NaN or Inf in row 2"):
        quantize_nvfp4(x, per_row=True, name="mlp.up_proj.input")
    with pytest.raises(NonFiniteError, match="weight"):
        quantize_nvfp4(x, (16, 16), name="weight")


def test_nvfp4_stochastic_rounding_is_unbiased_over_draws():
    """With the scales fixed by the tensor, the mean of 400 stochastically rounded copies approaches x:
    its error shrinks like 1/sqrt(draws) and is far below round-to-nearest's."""
    torch.manual_seed(3)
    x = torch.randn(8, 64)
    nearest = quantize_nvfp4(x).dequantize()
    mean = torch.stack([quantize_nvfp4(x, generator=torch.Generator().manual_seed(s)).dequantize()
                        for s in range(400)]).mean(0)
    assert (mean - x).abs().mean() < 0.2 * (nearest - x).abs().mean()


def test_hadamard16_is_orthogonal_and_preserves_products_along_the_tokens():
    torch.manual_seed(4)
    a, b = torch.randn(5, 32).double(), torch.randn(7, 32).double()
    ha, hb = hadamard16(a.float()).double(), hadamard16(b.float()).double()
    torch.testing.assert_close(ha @ hb.t(), a @ b.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ha.norm(dim=1), a.norm(dim=1), rtol=1e-5, atol=1e-6)
    assert hadamard16(torch.eye(16))[0].abs().tolist() == [0.25] * 16
