"""Mismatch metrics against a hand-computed example."""

import math

import pytest
import torch

from jetflow.rl.mismatch import LOW_PROB_THRESHOLD, low_prob_metrics, mismatch_metrics, mismatch_position_curves

F64 = torch.float64
LN = math.log

# Response tokens at (row, t): (0, 0), (0, 1), (0, 2), (1, 0), with ratios
# r = pi_train / pi_rollout = 1, 3, 0.25, 1.5, i.e. delta = [0, ln 3, -ln 4, ln 1.5].
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
R = torch.tensor([[1.0, 3.0, 0.25, 1.0], [1.5, 1.0, 1.0, 1.0]], dtype=F64)
ROLLOUT = torch.tensor([[-0.5, -2.0, -1.0, -math.inf], [-1.3, -7.0, 0.0, 0.0]], dtype=F64)
TRAINER = torch.where(MASK > 0, ROLLOUT + R.log(), torch.tensor(-50.0, dtype=F64))


def test_whole_batch_metrics_by_hand():
    m = mismatch_metrics(ROLLOUT, TRAINER, MASK, num_position_bins=2)
    # k1 = mean(-delta) = -(ln 3 - ln 4 + ln 1.5) / 4 = -ln(1.125) / 4
    assert m["mismatch/kl_k1"] == pytest.approx(-LN(1.125) / 4)  # -0.0294457
    # k3 = mean(r - 1 - delta) = ((0 + 2 - 0.75 + 0.5) - ln 1.125) / 4
    assert m["mismatch/kl_k3"] == pytest.approx((1.75 - LN(1.125)) / 4)  # 0.408054
    # chi2 = mean(r^2) - 1 = (1 + 9 + 0.0625 + 2.25) / 4 - 1
    assert m["mismatch/chi2"] == pytest.approx(2.078125)
    # ess = (1 + 3 + 0.25 + 1.5)^2 / (4 * 12.3125) = 33.0625 / 49.25
    assert m["mismatch/ess"] == pytest.approx(33.0625 / 49.25)  # 0.671320
    # |delta| = [0, ln 3, ln 4, ln 1.5]: mean ln(18) / 4, max ln 4
    assert m["mismatch/abs_delta_mean"] == pytest.approx(LN(18) / 4)
    assert m["mismatch/abs_delta_max"] == pytest.approx(LN(4))
    # exp|delta| = [1, 3, 4, 1.5]
    assert m["mismatch/exp_abs_delta_mean"] == pytest.approx(9.5 / 4)
    # outside [0.5, 2]: 3 and 0.25
    assert m["mismatch/ratio_outside_frac"] == pytest.approx(0.5)
    # exactly equal log-probs: the r = 1 token (delta 0) of the four
    assert m["mismatch/equal_frac"] == 0.25
    assert m["mismatch/num_tokens"] == 4


def test_position_bins_by_hand():
    m = mismatch_metrics(ROLLOUT, TRAINER, MASK, num_position_bins=2)
    # T = 4, 2 bins: t in {0, 1} -> r = 1, 3, 1.5 ; t in {2, 3} -> r = 0.25
    assert m["mismatch/num_tokens/pos_0of2"] == 3
    assert m["mismatch/kl_k1/pos_0of2"] == pytest.approx(-LN(4.5) / 3)
    assert m["mismatch/abs_delta_max/pos_0of2"] == pytest.approx(LN(3))
    assert m["mismatch/ratio_outside_frac/pos_0of2"] == pytest.approx(1 / 3)
    assert m["mismatch/num_tokens/pos_1of2"] == 1
    assert m["mismatch/kl_k3/pos_1of2"] == pytest.approx(0.25 - 1 + LN(4))  # 0.636294
    assert m["mismatch/chi2/pos_1of2"] == pytest.approx(0.0625 - 1)
    assert m["mismatch/ess/pos_1of2"] == pytest.approx(1.0)
    assert m["mismatch/ratio_outside_frac/pos_1of2"] == 1.0
    assert m["mismatch/equal_frac/pos_0of2"] == pytest.approx(1 / 3)
    # 10 metrics, whole batch + 2 bins
    assert len(m) == 10 * 3


def test_empty_bin_and_empty_mask_are_zero_not_nan():
    m = mismatch_metrics(ROLLOUT, TRAINER, MASK, num_position_bins=4)
    # bin 3 holds t = 3 only, which is padding in both rows
    assert m["mismatch/num_tokens/pos_3of4"] == 0
    assert m["mismatch/kl_k3/pos_3of4"] == 0.0
    assert m["mismatch/kl_k3/pos_2of4"] == pytest.approx(0.25 - 1 + LN(4))
    empty = mismatch_metrics(ROLLOUT, TRAINER, torch.zeros(2, 4))
    assert all(v == 0.0 for v in empty.values())
    assert "mismatch/num_tokens" in empty and "mismatch/ess/pos_0of4" in empty


def test_uneven_bins():
    # T = 5, 2 bins: bin = floor(t * 2 / 5) -> t = 0, 1, 2 in bin 0; t = 3, 4 in bin 1
    m = mismatch_metrics(torch.zeros(1, 5), torch.zeros(1, 5), torch.ones(1, 5), 2)
    assert m["mismatch/num_tokens/pos_0of2"] == 3
    assert m["mismatch/num_tokens/pos_1of2"] == 2
    assert m["mismatch/kl_k3"] == 0.0 and m["mismatch/ess"] == 1.0
    with pytest.raises(ValueError):
        mismatch_metrics(torch.zeros(1, 5), torch.zeros(1, 5), torch.ones(1, 5), 0)


def test_position_curves_by_hand():
    c = mismatch_position_curves(ROLLOUT, TRAINER, MASK)
    torch.testing.assert_close(c["count"], torch.tensor([2.0, 1.0, 1.0, 0.0], dtype=F64))
    # t = 0: r = 1 and 1.5 ; t = 1: r = 3 ; t = 2: r = 0.25 ; t = 3: none
    abs_delta = torch.tensor([LN(1.5) / 2, LN(3), LN(4), 0.0], dtype=F64)
    torch.testing.assert_close(c["abs_delta"], abs_delta)
    k3 = torch.tensor([(0.5 - LN(1.5)) / 2, 2 - LN(3), 0.25 - 1 + LN(4), 0.0], dtype=F64)
    torch.testing.assert_close(c["kl_k3"], k3)


def test_low_prob_tokens_by_hand():
    # ROLLOUT's response tokens: p = e^-0.5 = 0.61, e^-2 = 0.135, e^-1 = 0.37 (row 0), e^-1.3 = 0.27
    # (row 1): none below 0.1. A threshold of 0.3 takes e^-2 (r = 3) and e^-1.3 (r = 1.5): half of them.
    m = low_prob_metrics(ROLLOUT, TRAINER, MASK, threshold=0.3)
    assert m["policy/low_prob_frac"] == 0.5
    assert m["mismatch/kl_k3/low_prob"] == pytest.approx(((3 - 1 - LN(3)) + (1.5 - 1 - LN(1.5))) / 2)  # 0.3420
    # the other two: r = 1 (k3 0) and r = 0.25 (k3 0.25 - 1 + ln 4)
    assert m["mismatch/kl_k3/high_prob"] == pytest.approx((0.25 - 1 + LN(4)) / 2)  # 0.3181
    assert low_prob_metrics(ROLLOUT, TRAINER, MASK) == {  # the default 0.1: no low-probability token here
        "policy/low_prob_frac": 0.0, "mismatch/kl_k3/low_prob": 0.0,
        "mismatch/kl_k3/high_prob": pytest.approx(mismatch_metrics(ROLLOUT, TRAINER, MASK)["mismatch/kl_k3"])}


def test_low_prob_default_threshold_and_padding():
    assert LOW_PROB_THRESHOLD == 0.1
    # p = 0.05, 0.099, 0.1, 0.5 sampled; the padded position's -inf is never counted or used
    rollout = torch.tensor([[LN(0.05), LN(0.099), LN(0.1), LN(0.5), -math.inf]], dtype=F64)
    trainer = torch.tensor([[LN(0.1), LN(0.099), LN(0.1), LN(0.5), 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    m = low_prob_metrics(rollout, trainer, mask)
    assert m["policy/low_prob_frac"] == 0.5  # 0.05 and 0.099 (0.1 itself is not below the threshold)
    # r = 2 on the first token, 1 on the second: k3 = (2 - 1 - ln 2 + 0) / 2
    assert m["mismatch/kl_k3/low_prob"] == pytest.approx((1 - LN(2)) / 2)
    assert m["mismatch/kl_k3/high_prob"] == 0.0
    empty = low_prob_metrics(rollout, trainer, torch.zeros(1, 5))
    assert empty == {"policy/low_prob_frac": 0.0, "mismatch/kl_k3/low_prob": 0.0, "mismatch/kl_k3/high_prob": 0.0}
    with pytest.raises(ValueError):
        low_prob_metrics(rollout, trainer, mask, threshold=0.0)
