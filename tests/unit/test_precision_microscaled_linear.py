"""The mxfp8 / nvfp4 recipes: the recipe family, their GEMMs against fp64 references of the same
arithmetic, the linear's fprop / dgrad / wgrad, the exact forward's invariance, weight sync (issue 28)."""

import pickle

import pytest
import torch
import torch.nn as nn

from jetflow.config import ConfigError, load_config
from jetflow.kernels import invariant
from jetflow.kernels.canonical import tree_sum
from jetflow.precision import QuantRecipe, PrecisionLinear, apply_precision
from jetflow.precision import microscaled as ms
from jetflow.precision.family import family_of
from jetflow.precision.mx import MXTensor, quantize_mx
from jetflow.precision.nvfp4 import NVFP4Tensor, hadamard16, quantize_nvfp4
from jetflow.sync import CorruptWeightsError, apply_update, build_update

FAMILIES = ["mxfp8", "nvfp4"]


# -- the recipe family ----------------------------------------------------------------------------
def test_fp8_block_fingerprints_are_those_of_earlier_runs():
    """Values computed by the recipe before families existed (git 62f5b0e): a run's checkpoints and
    payloads keep pairing with it."""
    assert QuantRecipe().fingerprint() == "3ceda4903d9a"
    assert QuantRecipe(scale_rule="pow2", fmt="hybrid").fingerprint() == "74dff70e3e1d"
    assert "family" not in QuantRecipe().to_dict()


@pytest.mark.parametrize("family,block,group", [("mxfp8", (1, 32), 32), ("nvfp4", (16, 16), 16)])
def test_families_take_their_own_blocks_and_refuse_fields_they_do_not_use(family, block, group):
    r = QuantRecipe(family=family)
    assert r.weight_block == block and r.group_size == group
    assert QuantRecipe.from_dict(r.to_dict()) == r and r.fingerprint() != QuantRecipe().fingerprint()
    with pytest.raises(ValueError, match="scale_rule='pow2' does not apply"):
        QuantRecipe(family=family, scale_rule="pow2")
    with pytest.raises(ValueError, match="weight blocks are"):
        QuantRecipe(family=family, weight_block=(64, 64))


def test_operand_specs_are_te_recipes():
    nv = QuantRecipe(family="nvfp4")
    assert (nv.operand("weight").element, nv.operand("weight").block, nv.operand("weight").scale) == \
        ("e2m1", (16, 16), "e4m3+fp32")
    grad = nv.operand("gradient")
    assert grad.rounding == "stochastic" and grad.hadamard and nv.operand("activation").rounding == "nearest_even"
    mx = QuantRecipe(family="mxfp8", fmt="hybrid")
    assert [mx.operand(r).element for r in ("weight", "activation", "gradient")] == ["e4m3", "e4m3", "e5m2"]
    assert all(mx.operand(r).block == (1, 32) and mx.operand(r).scale == "e8m0" for r in ("weight", "gradient"))
    assert QuantRecipe().operand("weight").block == (128, 128)


def test_config_selects_the_family_and_lists_the_valid_names():
    assert load_config(None, ["precision.family=mxfp8"]).precision.recipe().family == "mxfp8"
    with pytest.raises(ConfigError, match=r"precision.family='fp4' is not valid; choose one of \['fp8_block', "
                                          r"'mxfp8', 'nvfp4'\]"):
        load_config(None, ["precision.family=fp4"])


# -- GEMMs ----------------------------------------------------------------------------------------
def quantized_pair(family: str, m: int = 24, k: int = 320, n: int = 40, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None]
    w = torch.randn(n, k, generator=gen) * 0.05
    recipe = QuantRecipe(family=family)
    return family_of(recipe).quantize_activation(x, recipe), family_of(recipe).quantize_weight(w, recipe)


def reference_product(xq, wq) -> torch.Tensor:
    """fp64 product of the exact values, then the tensor-scale alpha as the recipe defines it (fp32)."""
    y = (ms.values(xq).double() @ ms.values(wq).double().t())
    if isinstance(xq, NVFP4Tensor):
        y = y * (xq.tensor_scale * wq.tensor_scale).double()[:, None]
    return y


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_product_equals_the_fp64_product_of_the_same_values_within_fp32_summation(family, numerics):
    xq, wq = quantized_pair(family)
    y = ms.product(xq, wq, numerics)
    ref = reference_product(xq, wq)
    absref = ms.values(xq).double().abs() @ ms.values(wq).double().abs().t()
    if isinstance(xq, NVFP4Tensor):
        absref = absref * (xq.tensor_scale * wq.tensor_scale).double()[:, None]
    bound = (xq.shape[1] + 2) * 2.0**-24 * absref  # a chain of K fp32 additions and one alpha rounding
    assert bool(((y.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_product_rows_do_not_depend_on_the_batch(family):
    xq, wq = quantized_pair(family)
    recipe = QuantRecipe(family=family)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(33, 320, generator=gen)
    full = family_of(recipe).exact_product(x, wq, recipe)
    for i in (0, 17, 32):
        assert torch.equal(family_of(recipe).exact_product(x[i:i + 1], wq, recipe)[0], full[i])


def _columns(q, lo: int, hi: int):
    """Columns [lo, hi) of a quantized tensor in (1, b) blocks (lo, hi multiples of the block)."""
    b = q.block[1]
    if isinstance(q, MXTensor):
        return MXTensor(q.data[:, lo:hi], q.scale[:, lo // b:hi // b], q.block)
    return NVFP4Tensor(q.data[:, lo // 2:hi // 2], q.scale[:, lo // b:hi // b], q.tensor_scale, q.block, hi - lo)


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_halves_combined_by_the_tree_equal_the_whole_product(family):
    """K = 512 in 4 canonical groups: two K halves of 2 groups each, the second half's partial combined
    with the first's by tree_sum (the `combine` of a row-parallel shard), give the unsharded product bit
    for bit: NVFP4's alpha multiplies the combined sum, not each half."""
    recipe = QuantRecipe(family=family)
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 512, generator=gen), torch.randn(48, 512, generator=gen)
    xq, wq = family_of(recipe).quantize_activation(x, recipe), quantize_mx(w, (1, 32)) if family == "mxfp8" else \
        quantize_nvfp4(w, (1, 16))
    halves = [(_columns(xq, a, a + 256), _columns(wq, a, a + 256)) for a in (0, 256)]
    second = invariant.gemm(ms.values(halves[1][0]), invariant.pack_weight(ms.values(halves[1][1])), 48, groups=2)
    sharded = ms.product(*halves[0], "exact", groups=2, packed=invariant.pack_weight(ms.values(halves[0][1])),
                         combine=lambda first: tree_sum([first, second]))
    assert torch.equal(sharded, ms.product(xq, wq, "exact"))


# -- the linear -----------------------------------------------------------------------------------
def make_linear(family: str, numerics: str = "fast", in_f: int = 256, out_f: int = 96):
    torch.manual_seed(3)
    ref = nn.Linear(in_f, out_f)
    return ref, PrecisionLinear.from_linear(ref, kind="fp8", recipe=QuantRecipe(family=family), name="proj",
                                           numerics=numerics)


def fq_mx(t: torch.Tensor) -> torch.Tensor:
    return quantize_mx(t, (1, 32)).dequantize()


def test_mxfp8_forward_and_backward_equal_te_gemms_on_fake_quantized_operands():
    """fprop X(1x32) W(1x32)^T, dgrad dY(1x32 along N) W(32x1), wgrad dY^T(1x32 along M) X(1x32 along M):
    each the plain fp32 product of the MXFP8 values."""
    _, layer = make_linear("mxfp8")
    x = torch.randn(64, 256, requires_grad=True)
    y = layer(x)
    gy = torch.randn_like(y)
    y.backward(gy)
    w = layer.weight.detach()
    torch.testing.assert_close(y.detach(), fq_mx(x.detach()) @ fq_mx(w).t() + layer.bias.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(x.grad, fq_mx(gy) @ fq_mx(w.t().contiguous()).t(), rtol=1e-6, atol=1e-5)
    dw = fq_mx(gy.t().contiguous()) @ fq_mx(x.detach().t().contiguous()).t()
    torch.testing.assert_close(layer.weight.grad, dw, rtol=1e-6, atol=1e-4)


def test_nvfp4_backward_is_reproducible_seeded_and_close_to_fp32():
    """dgrad and wgrad round the gradient stochastically from generators seeded by the gradient's bits:
    the same backward twice gives the same bits, another layer name other draws; the gradients stay
    near fp32's (4-bit operands: a cosine above 0.95)."""
    ref, layer = make_linear("nvfp4")
    x, gy = torch.randn(64, 256), torch.randn(64, 96)
    grads = []
    for name in ("proj", "proj", "other"):
        layer.name, layer.weight.grad = name, None
        xi = x.clone().requires_grad_()
        layer(xi).backward(gy)
        grads.append((xi.grad, layer.weight.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert not torch.equal(grads[0][1], grads[2][1])
    cos = torch.nn.functional.cosine_similarity
    assert cos(grads[0][0].flatten(), (gy @ ref.weight.detach()).flatten(), dim=0) > 0.95
    assert cos(grads[0][1].flatten(), (gy.t() @ x).flatten(), dim=0) > 0.95


def test_nvfp4_wgrad_operands_pass_the_hadamard_transform():
    """The wgrad GEMM reads H(dY^T) and H(X^T) along the tokens: its X operand is the 1x16 NVFP4 of
    hadamard16(X^T) (tokens padded to 16), not of X^T."""
    recipe = QuantRecipe(family="nvfp4")
    x = torch.randn(40, 32)
    q = family_of(recipe).quantize_wgrad_operand(x, recipe, "activation", "x")
    padded = torch.nn.functional.pad(x.t(), (0, 8))
    assert torch.equal(q.data, quantize_nvfp4(hadamard16(padded)).data)
    assert not torch.equal(q.data, quantize_nvfp4(padded).data)


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_linear_equals_fast_within_bound_and_no_grad_equals_grad_path(family):
    ref, fast = make_linear(family)
    _, exact = make_linear(family, "exact")
    x = torch.randn(20, 256)
    with torch.no_grad():
        y_exact = exact(x)
    y_grad = exact(x.clone().requires_grad_())  # the trainer's path (autograd function)
    assert torch.equal(y_grad.detach(), y_exact)
    torch.testing.assert_close(y_exact, fast(x).detach(), rtol=1e-5, atol=1e-5)


# -- bytes across sides ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_weights_pickle_as_their_bytes(family):
    _, wq = quantized_pair(family)
    back = pickle.loads(pickle.dumps(wq.with_dequantized_cache()))
    assert all(torch.equal(a, b) for a, b in zip(wq.parts().values(), back.parts().values()))
    assert torch.equal(back.dequantize(), wq.dequantize())


@pytest.mark.parametrize("family", FAMILIES)
def test_sync_ships_the_trainers_bytes_and_checks_their_scales(family):
    recipe = QuantRecipe(family=family)
    torch.manual_seed(4)
    trainer = apply_precision(nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32)), "fp8", recipe, numerics="exact")
    rollout = apply_precision(nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32)), "fp8", recipe, numerics="exact")
    update = build_update(trainer, "unified", 1, recipe.fingerprint(), with_checksum=True)
    assert apply_update(rollout, update, 0, recipe.fingerprint()) == 1
    for name in ("0", "1"):
        sent, got = trainer.get_submodule(name).quantized_weight(), rollout.get_submodule(name).quantized_weight()
        assert got is update.quantized[name] and all(torch.equal(a, b) for a, b in zip(sent.parts().values(),
                                                                                        got.parts().values()))
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(trainer(x), rollout(x))
    bad = build_update(trainer, "unified", 2, recipe.fingerprint())
    q = bad.quantized["0"]
    if family == "mxfp8":
        q.scale[0, 0] = 255  # E8M0's NaN
    else:
        q.scale.view(torch.uint8)[0, 0] = 0x7F  # E4M3's NaN
    with pytest.raises(CorruptWeightsError, match="0: "):
        apply_update(rollout, bad, 1, recipe.fingerprint())


def test_a_linear_refuses_bytes_of_another_family():
    layer = make_linear("nvfp4")[1]
    with pytest.raises(ValueError, match="mxfp8 bytes offered to a linear running the nvfp4 recipe"):
        layer.load_quantized(quantize_mx(layer.weight.detach(), (1, 32)))
