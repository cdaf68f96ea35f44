"""The exact linear's cached kernel call (jetflow.precision.exact): outside autograd on the CPU, an exact
linear keeps its GEMM call prepared per weight version (the weight's checks done once). It must give
the general path's bits (the same call with no cache), follow weight updates, keep tensor-parallel
`groups` / `combine` working, and leave NaN reporting to the activation quantizer."""

from __future__ import annotations

import pytest
import torch

from jetflow.kernels import canonical
from jetflow.precision import QuantRecipe, NonFiniteError
from jetflow.precision.exact import ExactCache, exact_linear
from jetflow.precision.family import quantize_weight_for_recipe


def _operands(kind: str, n: int = 72, k: int = 512, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w, b = torch.randn(n, k, generator=gen) / 8, torch.randn(n, generator=gen)
    recipe = QuantRecipe() if kind == "fp8" else None
    return w, b, recipe


def _wq(w, recipe):
    return quantize_weight_for_recipe(w, recipe, "w") if recipe is not None else None


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
def test_cached_call_equals_the_general_path_and_follows_weight_updates(kind):
    w, b, recipe = _operands(kind)
    cache = ExactCache()
    with torch.no_grad():
        for step in range(2):
            wq = _wq(w, recipe)
            for x in (torch.randn(2, 5, 512) * 3, torch.randn(16, 512), torch.randn(1, 1, 512)):
                want = exact_linear(x, w, b, kind, recipe=recipe, wq=wq, cache=None)  # no cache: the general path
                got = exact_linear(x, w, b, kind, recipe=recipe, wq=wq, cache=cache)
                assert got.shape == want.shape and torch.equal(got, want), (kind, step, tuple(x.shape))
            held = cache.call
            exact_linear(torch.randn(3, 512), w, b, kind, recipe=recipe, wq=wq, cache=cache)
            assert cache.call is held  # kept while the weight stays
            w.mul_(1.5)  # in place: a new weight version (and a new quantized weight)
        assert not torch.equal(exact_linear(x, w, b, kind, recipe=recipe, wq=_wq(w, recipe), cache=cache), got)


@pytest.mark.parametrize("kind", ["fp32", "fp8"])
def test_cached_call_of_tensor_parallel_shards_combines_into_the_full_result(kind):
    """Two row-parallel shards (half of K each, groups = G / 2, the tree finished by `combine`) through
    their cached calls give the unsharded layer's bits."""
    w, b, recipe = _operands(kind, k=1024)
    x = torch.randn(6, 1024)
    groups = canonical.tree_width(1024) // 2
    shard = [(x[:, i * 512:(i + 1) * 512], w[:, i * 512:(i + 1) * 512].contiguous()) for i in range(2)]
    with torch.no_grad():
        full = exact_linear(x, w, b, kind, recipe=recipe, wq=_wq(w, recipe), cache=ExactCache())
        (x0, w0), (x1, w1) = shard
        partial1 = exact_linear(x1, w1, None, kind, recipe=recipe, wq=_wq(w1, recipe), cache=ExactCache(), groups=groups)
        # rank 0's view: its subtree, the other rank's partial gathered, the tree finished, then the epilogue
        got = exact_linear(x0, w0, b, kind, recipe=recipe, wq=_wq(w0, recipe), cache=ExactCache(), groups=groups,
                           combine=lambda y: canonical.tree_sum([y, partial1]))
    assert torch.equal(got, full)


def test_cached_fp8_call_leaves_nan_to_the_quantizer():
    w, b, recipe = _operands("fp8")
    wq, cache = _wq(w, recipe), ExactCache()
    x = torch.randn(3, 512)
    with torch.no_grad():
        exact_linear(x, w, b, "fp8", recipe=recipe, wq=wq, cache=cache, name="probe")
        x[1, 7] = float("nan")
        with pytest.raises(NonFiniteError, match="probe.input"):
            exact_linear(x, w, b, "fp8", recipe=recipe, wq=wq, cache=cache, name="probe")
