"""Rollout corrections (TIS, MIS, sequence variants, AIS) against hand-computed values."""

import math

import pytest
import torch

from jetflow.rl.correction import CORRECTIONS, ais_diagnostics, apply_correction

F64 = torch.float64

# Token ratios w = pi_old / pi_rollout. Row 0 has 3 response tokens, row 1 has 2 (+ 1 padding,
# where the rollout logprob is -inf: it must not leak into weights or metrics).
#   row 0: [0.25, 1.0, 3.0]  sequence ratio 0.75
#   row 1: [1.5,  1.6, pad]  sequence ratio 2.4
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
RATIOS = torch.tensor([[0.25, 1.0, 3.0], [1.5, 1.6, 1.0]], dtype=F64)
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.1, -math.inf]], dtype=F64)
OLD = torch.where(MASK > 0, ROLLOUT + RATIOS.log(), torch.tensor(-3.0, dtype=F64))


def _correct(name, **params):
    return apply_correction(name, ROLLOUT, OLD, MASK, **params)


def test_none_is_all_ones():
    res = _correct("none")
    torch.testing.assert_close(res.weights, torch.ones(2, 3, dtype=F64))
    assert res.metrics["correction/weight_mean"] == 1.0


def test_token_tis_truncates_at_cap():
    res = _correct("token_tis", cap=2.0)
    # 3.0 -> 2.0; padding ratio counts as 1
    expected = torch.tensor([[0.25, 1.0, 2.0], [1.5, 1.6, 1.0]], dtype=F64)
    torch.testing.assert_close(res.weights, expected)
    assert res.metrics["correction/truncated_frac"] == pytest.approx(1 / 5)
    # (0.25 + 1 + 2 + 1.5 + 1.6) / 5 = 6.35 / 5
    assert res.metrics["correction/weight_mean"] == pytest.approx(1.27)
    assert res.metrics["correction/weight_max"] == pytest.approx(2.0)


def test_token_mis_masks_outside_bounds():
    res = _correct("token_mis", lo=0.5, hi=2.0)
    # 0.25 < 0.5 and 3.0 > 2 are zeroed; kept tokens keep their ratio
    expected = torch.tensor([[0.0, 1.0, 0.0], [1.5, 1.6, 1.0]], dtype=F64)
    torch.testing.assert_close(res.weights, expected)
    assert res.metrics["correction/masked_frac"] == pytest.approx(2 / 5)
    assert res.metrics["correction/weight_mean"] == pytest.approx(4.1 / 5)


def test_seq_tis_broadcasts_truncated_sequence_ratio():
    res = _correct("seq_tis", cap=2.0)
    # row 0: 0.25 * 1 * 3 = 0.75 on every token; row 1: 1.5 * 1.6 = 2.4 -> 2.0
    expected = torch.tensor([[0.75] * 3, [2.0] * 3], dtype=F64)
    torch.testing.assert_close(res.weights, expected)
    assert res.metrics["correction/seq_truncated_frac"] == pytest.approx(0.5)


def test_seq_mis_masks_whole_sequences():
    res = _correct("seq_mis", lo=0.5, hi=2.0)
    # row 0: 0.75 kept; row 1: 2.4 > 2 -> whole sequence 0
    expected = torch.tensor([[0.75] * 3, [0.0] * 3], dtype=F64)
    torch.testing.assert_close(res.weights, expected)
    assert res.metrics["correction/seq_masked_frac"] == pytest.approx(0.5)
    assert res.metrics["correction/masked_frac"] == pytest.approx(2 / 5)
    # raising lo above 0.75 masks row 0 too
    torch.testing.assert_close(_correct("seq_mis", lo=0.8).weights, torch.zeros(2, 3, dtype=F64))


def test_seq_modes_do_not_overflow_on_long_sequences():
    # 50 tokens each off by a log-ratio of +5 / -5: sequence log-ratio +-250, exp would overflow
    mask = torch.ones(2, 50)
    rollout = torch.zeros(2, 50)
    old = torch.cat([torch.full((1, 50), 5.0), torch.full((1, 50), -5.0)])
    tis = apply_correction("seq_tis", rollout, old, mask, cap=2.0).weights
    assert torch.isfinite(tis).all()
    assert tis[0].eq(2.0).all() and tis[1].lt(1e-30).all()  # exp(-250) underflows to 0 in fp32
    mis = apply_correction("seq_mis", rollout, old, mask).weights
    torch.testing.assert_close(mis, torch.zeros(2, 50))


def test_ais_diagnostics_and_weights_by_hand():
    # masked w = [1, 1, 2, 0.5]
    rollout = torch.zeros(1, 5, dtype=F64)
    old = torch.tensor([[0.0, 0.0, math.log(2), math.log(0.5), 9.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    ess, kl, chi2 = ais_diagnostics(rollout, old, mask)
    # ess = (1 + 1 + 2 + 0.5)^2 / (4 * (1 + 1 + 4 + 0.25)) = 20.25 / 25
    assert ess == pytest.approx(0.81)
    # k3 per token: [0, 0, 2 - 1 - ln 2, 0.5 - 1 + ln 2] -> sum 0.5, mean 0.125
    assert kl == pytest.approx(0.125)
    # mean w^2 - 1 = 6.25 / 4 - 1
    assert chi2 == pytest.approx(0.5625)

    res = apply_correction(
        "ais", rollout, old, mask, cap=1.5, kl_scale=1.0, chi2_scale=1.0, ess_power=1.0
    )
    lam = 1 - math.exp(-(0.125 + 0.5625)) * 0.81  # = 0.5927
    assert res.metrics["correction/ais_lambda"] == pytest.approx(lam)
    assert res.metrics["correction/ais_ess"] == pytest.approx(0.81)
    assert res.metrics["correction/ais_kl"] == pytest.approx(0.125)
    assert res.metrics["correction/ais_chi2"] == pytest.approx(0.5625)
    # weight = (1 - lam) + lam * min(w, 1.5); padding w = 1 -> 1
    expected = torch.tensor([[1.0, 1.0, 1 + 0.5 * lam, 1 - 0.5 * lam, 1.0]], dtype=F64)
    torch.testing.assert_close(res.weights, expected)


def test_ais_lambda_zero_when_policies_agree():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 16, generator=g) * 3
    res = apply_correction("ais", old.clone(), old, torch.ones(4, 16))
    assert abs(res.metrics["correction/ais_lambda"]) < 1e-6
    torch.testing.assert_close(res.weights, torch.ones(4, 16), atol=1e-6, rtol=0)


def test_ais_lambda_increases_with_mismatch():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(8, 256, generator=g, dtype=F64) * 3
    z = torch.randn(8, 256, generator=g, dtype=F64)
    z = (z - z.mean()) / z.std()
    mask = torch.ones(8, 256)
    lams = [
        apply_correction("ais", old + std * z, old, mask).metrics["correction/ais_lambda"]
        for std in (0.01, 0.1, 0.3, 1.0)
    ]
    assert all(a < b for a, b in zip(lams, lams[1:])), lams
    assert 0 < lams[0] < 0.05
    assert lams[-1] > 0.99


def test_ais_kl_sees_a_uniform_shift_that_ess_cannot():
    # every log-ratio = 0.1: all weights equal, so ess = 1, but kl = e^0.1 - 1.1 > 0
    old = torch.zeros(2, 4, dtype=F64)
    res = apply_correction("ais", old - 0.1, old, torch.ones(2, 4), kl_scale=1.0, chi2_scale=1.0)
    kl = math.exp(0.1) - 1.1
    chi2 = math.exp(0.2) - 1
    assert res.metrics["correction/ais_ess"] == pytest.approx(1.0)
    assert res.metrics["correction/ais_kl"] == pytest.approx(kl)
    assert res.metrics["correction/ais_lambda"] == pytest.approx(1 - math.exp(-(kl + chi2)))


def test_registry_errors_detach_and_empty_mask():
    with pytest.raises(ValueError, match="none, token_tis, token_mis, seq_tis, seq_mis, ais"):
        apply_correction("tis", ROLLOUT, OLD, MASK)
    old = OLD.clone().requires_grad_(True)
    assert not apply_correction("token_tis", ROLLOUT, old, MASK).weights.requires_grad
    for name in CORRECTIONS:
        res = apply_correction(name, ROLLOUT, OLD, torch.zeros(2, 3))
        assert torch.isfinite(res.weights).all(), name
        assert all(math.isfinite(v) for v in res.metrics.values()), name
