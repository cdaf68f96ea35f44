"""Exact linears that share their input (q / k / v, gate / up) computed by one GEMM
(jetflow.precision.linear.sibling_linears -> jetflow.precision.exact.exact_linears): the same bits as
calling each linear, one kernel call instead of several, weight updates seen, autograd left alone."""

from __future__ import annotations

import pytest
import torch

from jetflow.kernels import invariant
from jetflow.precision import QuantRecipe, PrecisionLinear
from jetflow.precision.linear import sibling_linears
from jetflow.precision.quant import quantize_weight


def _linears(kind: str, seed: int = 0) -> tuple[PrecisionLinear, ...]:
    """Three linears of one input, widths not multiples of the kernel's panel width, one without bias."""
    torch.manual_seed(seed)
    recipe = QuantRecipe() if kind == "fp8" else None
    return tuple(PrecisionLinear(384, n, bias=n != 72, kind=kind, recipe=recipe, numerics="exact", name=f"p{n}")
                 for n in (40, 72, 128))


def _count_kernel_calls(monkeypatch) -> dict:
    """Counts the GEMM kernels' calls (the library's entry points, however a linear reaches them)."""
    calls = {"n": 0}
    real = invariant.load_library()

    class Counted:
        def __getattr__(self, name):
            fn = getattr(real, name)
            if name not in ("jf_gemm", "jf_gemm_fp8", "jf_linear_fp8"):
                return fn

            def counted(*args):
                calls["n"] += 1
                return fn(*args)
            return counted
    monkeypatch.setattr(invariant, "load_library", lambda variant="native": Counted())
    return calls


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
def test_one_gemm_gives_each_linears_bits(kind, monkeypatch):
    linears = _linears(kind)
    calls = _count_kernel_calls(monkeypatch)
    with torch.no_grad():
        for x in (torch.randn(2, 5, 384) * 3, torch.randn(16, 384), torch.randn(1, 1, 384)):
            want = [m(x) for m in linears]
            calls["n"] = 0
            got = sibling_linears(x, linears)
            assert calls["n"] == 1
            for g, w in zip(got, want):
                assert g.shape == w.shape and torch.equal(g, w)
        fused = linears[0]._exact_cache.siblings.packed
        sibling_linears(torch.randn(3, 384), linears)
        assert linears[0]._exact_cache.siblings.packed is fused  # kept between calls


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_a_weight_update_is_seen(kind):
    linears = _linears(kind, seed=1)
    x = torch.randn(4, 384)
    with torch.no_grad():
        before = sibling_linears(x, linears)
        linears[1].weight.mul_(1.5)  # in place: a new weight version
        after = sibling_linears(x, linears)
        assert torch.equal(after[0], before[0]) and not torch.equal(after[1], before[1])
        assert torch.equal(after[1], linears[1](x))


def test_loaded_fp8_bytes_are_used_as_they_are():
    trainer, rollout = _linears("fp8", seed=2), _linears("fp8", seed=3)
    for t, r in zip(trainer, rollout):
        r.load_quantized(quantize_weight(t.weight.detach()))
        if t.bias is not None:
            r.bias.data.copy_(t.bias.data)
    x = torch.randn(6, 384)
    with torch.no_grad():
        for g, w in zip(sibling_linears(x, rollout), (t(x) for t in trainer)):
            assert torch.equal(g, w)


def test_a_recorded_graph_and_fast_numerics_call_each_linear(monkeypatch):
    linears = _linears("fp8", seed=4)
    calls = _count_kernel_calls(monkeypatch)
    x = torch.randn(4, 384, requires_grad=True)
    outs = sibling_linears(x, linears)  # grad enabled, weights require grad: each module, with autograd
    assert calls["n"] == 3 and all(o.requires_grad for o in outs)
    sum(o.sum() for o in outs).backward()
    assert x.grad is not None
    for m in linears:
        m.numerics = "fast"
    calls["n"] = 0
    with torch.no_grad():
        sibling_linears(x, linears)
    assert calls["n"] == 0  # fast numerics: torch's kernels, one module at a time


def test_a_bf16_weight_off_the_pair_layout_runs_alone_with_the_same_bits():
    """A bf16 weight holding a value below 2^-56 keeps bf16 panels where the others are packed as bf16
    pairs (AVX512_BF16): the panels cannot sit side by side, so each linear runs alone, same bits."""
    linears = _linears("bf16", seed=6)
    with torch.no_grad():
        linears[1].weight[3, 5] = 2.0 ** -70
        x = torch.randn(5, 384)
        for g, w in zip(sibling_linears(x, linears), [m(x) for m in linears]):
            assert torch.equal(g, w)
