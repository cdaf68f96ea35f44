"""Sampling functions against hand-written logits and an independent reference (transformers' logits
warpers), and the sampled distribution against the probabilities it claims."""

from __future__ import annotations

import math

import pytest
import torch

from jetflow.model.logprobs import tempered, token_logprobs
from jetflow.rollout.sampling import TOP_P_CANDIDATES, filter_logits, greedy, sample, top_k_filter, top_p_filter

NEG = float("-inf")


def kept(x: torch.Tensor) -> list[bool]:
    return torch.isfinite(x).tolist()


def test_greedy_picks_argmax_with_log_softmax_logprob():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.0, -2.0]])
    tokens, lp = greedy(logits)
    assert tokens.tolist() == [1, 0]
    for b, t in enumerate(tokens.tolist()):
        row = logits[b].tolist()
        ref = row[t] - math.log(sum(math.exp(v) for v in row))
        assert lp[b].item() == pytest.approx(ref, abs=1e-6)
    # temperature 0 through sample() is greedy too
    t2, lp2 = sample(logits, temperature=0.0, top_k=1, top_p=0.1)
    assert t2.tolist() == [1, 0] and torch.allclose(lp2, lp)


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    assert tempered(logits, 0.5).tolist() == [[2.0, 4.0, 8.0]]
    assert tempered(logits, 1.0).tolist() == logits.tolist()
    with pytest.raises(ValueError):
        tempered(logits, 0.0)


def test_top_k_hand_written():
    logits = torch.tensor([[1.0, 3.0, 2.0, 5.0], [0.0, 1.0, 1.0, -1.0]])
    out = top_k_filter(logits, 2)
    assert kept(out) == [[False, True, False, True], [False, True, True, False]]
    assert out[0, 1].item() == 3.0 and out[0, 3].item() == 5.0  # kept values are untouched
    # ties at the k-th value are kept (as transformers does)
    assert kept(top_k_filter(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), 2)) == [[True, True, True, False]]
    assert top_k_filter(logits, 0) is logits and top_k_filter(logits, 4) is logits


def test_top_p_hand_written():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    # descending order 0.5, 0.3, 0.15, 0.05; keep a token while the mass ahead of it is < p
    assert kept(top_p_filter(logits, 0.4)) == [[False, True, False, False]]
    assert kept(top_p_filter(logits, 0.75)) == [[False, True, False, True]]
    assert kept(top_p_filter(logits, 0.85)) == [[False, True, True, True]]
    assert kept(top_p_filter(logits, 0.99)) == [[True, True, True, True]]
    assert top_p_filter(logits, 1.0) is logits


def _hf_reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    x = logits.clone()
    x = TemperatureLogitsWarper(temperature)(None, x)
    if top_k > 0:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    return x


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 0.9), (0.7, 50, 1.0), (1.3, 40, 0.8), (0.5, 0, 0.95)])
@pytest.mark.parametrize("shape", ["peaked", "flat"])
def test_filters_match_transformers_warpers(temperature, top_k, top_p, shape):
    """`flat` logits put less than top_p mass in the top TOP_P_CANDIDATES: the full-sort path."""
    g = torch.Generator().manual_seed(0)
    V = 4 * TOP_P_CANDIDATES
    logits = torch.randn(6, V, generator=g) * (4.0 if shape == "peaked" else 0.05)
    ours = filter_logits(logits, temperature, top_k, top_p)
    ref = _hf_reference(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(ours[fin], ref[fin])
    if shape == "flat" and top_p < 1.0 and top_k == 0:
        assert int(fin.sum(-1).min()) > TOP_P_CANDIDATES  # the fallback really ran


def test_sample_logprobs_are_of_the_filtered_renormalised_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]] * 3)
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    tokens, lp = sample(logits, temperature=0.5, top_k=3, generators=gens)
    kept_logits = [2.0 / 0.5, 1.0 / 0.5, 0.5 / 0.5]  # the top 3 after temperature
    z = math.log(sum(math.exp(v) for v in kept_logits))
    for t, l in zip(tokens.tolist(), lp.tolist()):
        assert t in (0, 1, 2)
        assert l == pytest.approx(kept_logits[t] - z, abs=1e-5)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.8), (1.5, 3, 1.0)])
def test_sampled_frequencies_match_the_distribution(temperature, top_k, top_p):
    """Draw 40k tokens; the empirical frequencies match softmax(filter(logits / T)) computed by hand."""
    base = [1.0, 0.2, -0.5, 0.7, -2.0]
    n = 40_000
    logits = torch.tensor([base] * n)
    torch.manual_seed(0)
    tokens, lp = sample(logits, temperature, top_k, top_p)
    scaled = [v / temperature for v in base]
    keep = set(range(len(base)))
    order = sorted(range(len(base)), key=lambda i: -scaled[i])
    if top_k:
        keep = set(order[:top_k])
    if top_p < 1.0:
        z = sum(math.exp(scaled[i]) for i in keep)
        mass, nucleus = 0.0, set()
        for i in [i for i in order if i in keep]:
            if mass < top_p:
                nucleus.add(i)
            mass += math.exp(scaled[i]) / z
        keep = nucleus
    z = sum(math.exp(scaled[i]) for i in keep)
    probs = [math.exp(scaled[i]) / z if i in keep else 0.0 for i in range(len(base))]
    freq = torch.bincount(tokens, minlength=len(base)).double() / n
    for i, p in enumerate(probs):
        assert abs(freq[i].item() - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-9, (i, freq[i].item(), p)
    # every returned log-prob is log of the claimed probability of its token
    expected = torch.tensor([math.log(probs[t]) for t in tokens[:200].tolist()])
    torch.testing.assert_close(lp[:200], expected.float(), atol=1e-5, rtol=0)


def test_per_row_generators_make_rows_independent_of_the_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 100, generator=g)

    def draw(rows, seeds, steps=20):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return torch.stack([sample(logits[rows], 1.0, generators=gens)[0] for _ in range(steps)], 1)  # (B, steps)

    alone = draw([1], [42])
    together = draw([0, 1, 2], [7, 42, 9])
    assert torch.equal(alone[0], together[1])
    assert not torch.equal(draw([1], [43])[0], alone[0])  # the seed matters
    with pytest.raises(ValueError, match="one generator per row"):
        sample(logits, 1.0, generators=[torch.Generator()])


def test_token_logprobs_matches_log_softmax():
    logits = torch.randn(4, 37)
    tokens = torch.tensor([0, 5, 36, 12])
    ref = torch.log_softmax(logits.double(), -1)[torch.arange(4), tokens].float()
    torch.testing.assert_close(token_logprobs(logits, tokens), ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("u", [0.0, 1.0 - 2.0**-24])
def test_extreme_uniforms_never_pick_a_filtered_token(monkeypatch, u):
    """The inverse CDF at u = 0 and at the largest float32 below 1 lands on the first / last token
    that survived the filters, never on a zero-probability one next to it."""
    import jetflow.rollout.sampling as sampling

    monkeypatch.setattr(sampling, "row_uniforms", lambda gens, b, device: torch.full((b, 1), u, dtype=torch.float64))
    logits = torch.tensor([[-9.0, 5.0, 1.0, 4.0, 3.0, -9.0], [9.0, -9.0, 2.0, -1.0, 8.0, 0.0]])
    tokens, lp = sampling.sample(logits, temperature=1.0, top_k=3)
    # kept: row 0 -> {1, 3, 4}, row 1 -> {0, 2, 4}
    assert tokens.tolist() == ([1, 0] if u == 0.0 else [4, 4])
    assert torch.isfinite(lp).all()
