"""The objective variants against hand-computed cases: the KL estimators (k1 / k2 / k3 / low_var_kl), the
KL term in the loss, GSPO's sequence-level ratio, Dr. GRPO's constant aggregation, DAPO's overlong
punishment and dynamic sampling's group filter."""

import math

import pytest
import torch

from jetflow.rl import group_advantages
from jetflow.rl.kl import kl_estimate
from jetflow.rl.loss import agg_denominator, aggregate, policy_loss
from jetflow.rl.shaping import informative_groups, overlong_penalty

F64 = torch.float64


# KL estimators -----------------------------------------------------------------------------------------

LP = torch.tensor([-1.0, -0.5, -2.0, -1.0], dtype=F64)
REF = torch.tensor([-1.5, -0.5, -0.2, -31.0], dtype=F64)
# lp - ref = [0.5, 0, -1.8, 30]; ref - lp = [-0.5, 0, 1.8, -30] (clamped to -20 before exp)


@pytest.mark.parametrize("estimator,expected", [
    ("k1", [0.5, 0.0, -1.8, 30.0]),
    ("k2", [0.125, 0.0, 0.5 * 1.8 ** 2, 450.0]),
    ("k3", [math.exp(-0.5) + 0.5 - 1, 0.0, math.exp(1.8) - 1.8 - 1, math.exp(-20) + 20 - 1]),
    ("low_var_kl", [math.exp(-0.5) + 0.5 - 1, 0.0, math.exp(1.8) - 1.8 - 1, 10.0]),  # 19.0 clamped to 10
])
def test_kl_estimators_against_hand_values(estimator, expected):
    torch.testing.assert_close(kl_estimate(LP, REF, estimator), torch.tensor(expected, dtype=F64))


def test_low_var_kl_clamps_a_large_positive_estimate_too_and_an_unknown_estimator_is_refused():
    # ref - lp = 3: k3 = e^3 - 3 - 1 = 16.09, low_var_kl 10
    lp, ref = torch.tensor([-4.0], dtype=F64), torch.tensor([-1.0], dtype=F64)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(math.exp(3) - 4)
    assert kl_estimate(lp, ref, "low_var_kl").item() == 10.0
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_estimate(lp, ref, "k4")


def test_kl_term_in_the_loss_with_k2_value_and_grad_and_padding_ignored():
    lp = torch.tensor([[-1.0, -0.5, float("-inf")]], dtype=F64, requires_grad=True)  # padding may be -inf
    ref = torch.tensor([[-1.5, -0.5, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # k2 = 0.5 (lp - ref)^2 = [0.125, 0]; token mean 0.0625; loss 0.1 * 0.0625 (the policy term is 0: A = 0)
    loss, m = policy_loss(lp, lp.detach(), torch.zeros(1, dtype=F64), mask, ref_logprobs=ref, kl_coef=0.1,
                          kl_estimator="k2")
    assert m["loss/kl"] == pytest.approx(0.0625) and loss.item() == pytest.approx(0.00625)
    loss.backward()
    # d k2 / d lp = lp - ref = 0.5 on the first token; times 0.1 / 2 tokens
    torch.testing.assert_close(lp.grad, torch.tensor([[0.025, 0.0, 0.0]], dtype=F64))


# GSPO ----------------------------------------------------------------------------------------------------

def test_gspo_sequence_ratio_value_clip_and_grad():
    old = torch.zeros(3, 3, dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    # per-token log-ratios: seq 0 [0.3, -0.1, 0.1] (mean 0.1), seqs 1 and 2 [0.6, 0.4] (mean 0.5)
    lp = torch.tensor([[0.3, -0.1, 0.1], [0.6, 0.4, 9.0], [0.6, 0.4, 9.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=F64)
    s0, s1 = math.exp(0.1), math.exp(0.5)  # 1.105 (inside [0.8, 1.28]), 1.649 (above)
    # seq 0, A = +1: -s0 per token; seq 1, A = -1: max(s1, 1.28) = s1 (unclipped);
    # seq 2, A = +1: max(-s1, -1.28) = -1.28 (clipped); seq_mean_token_mean = the mean of the three
    loss, m = policy_loss(lp, old, adv, mask, ratio_level="sequence", agg="seq_mean_token_mean")
    assert loss.item() == pytest.approx((-s0 + s1 - 1.28) / 3)
    assert m["loss/clip_frac"] == pytest.approx(2 / 7)  # seq 2's two tokens of seven
    loss.backward()
    # grad of s_i through each token: s_i * d lp_t / |y_i| (times -A_i), / 3 sequences; clipped: 0
    expected = torch.tensor([[-s0 / 9] * 3, [s1 / 6, s1 / 6, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(lp.grad, expected)


def test_gspo_differs_from_the_token_ratio_where_tokens_disagree():
    old = torch.zeros(1, 2, dtype=F64)
    lp = torch.tensor([[0.5, -0.5]], dtype=F64)  # token ratios e^0.5 (clipped at 1.28), e^-0.5; sequence ratio 1
    adv = torch.ones(1, dtype=F64)
    seq, _ = policy_loss(lp, old, adv, torch.ones(1, 2), ratio_level="sequence", agg="seq_mean_token_mean")
    tok, _ = policy_loss(lp, old, adv, torch.ones(1, 2), agg="seq_mean_token_mean")
    assert seq.item() == pytest.approx(-1.0)
    assert tok.item() == pytest.approx((-1.28 - math.exp(-0.5)) / 2)


# Dr. GRPO ------------------------------------------------------------------------------------------------

def test_seq_mean_token_sum_norm_divides_token_sums_by_a_constant():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # an empty sequence is not counted
    # sums 6 and 9, each / 4, mean over the two non-empty sequences
    assert aggregate(x, mask, "seq_mean_token_sum_norm", scale=4).item() == pytest.approx((6 / 4 + 9 / 4) / 2)
    # verl's default divisor: the mask's width T = 3
    assert aggregate(x, mask, "seq_mean_token_sum_norm").item() == pytest.approx((6 / 3 + 9 / 3) / 2)


def test_dr_grpo_loss_hand_case_and_micro_batches_sum_to_the_full_batch():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = group_advantages(rewards, 4, "mean")  # no std division: [0.75, -0.25, -0.25, -0.25]
    assert adv.tolist() == [0.75, -0.25, -0.25, -0.25]
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    lp = torch.zeros(4, 3, dtype=F64, requires_grad=True)  # ratio 1: per-token loss -A
    # token sums -1.5, 0.25, 0.75 (the empty sequence is not counted), each / 8, mean over 3
    full, _ = policy_loss(lp, lp.detach(), adv, mask, agg="seq_mean_token_sum_norm", scale=8)
    assert full.item() == pytest.approx((-1.5 + 0.25 + 0.75) / 8 / 3)
    total = agg_denominator(mask, "seq_mean_token_sum_norm")
    assert total == 3.0
    parts = [policy_loss(lp[i:j], lp[i:j].detach(), adv[i:j], mask[i:j], agg="seq_mean_token_sum_norm", scale=8)[0]
             * agg_denominator(mask[i:j], "seq_mean_token_sum_norm") / total for i, j in ((0, 1), (1, 4))]
    assert sum(p.item() for p in parts) == pytest.approx(full.item())


# DAPO ----------------------------------------------------------------------------------------------------

def test_overlong_penalty_hand_case():
    # max_new_tokens 10, buffer 4: free up to 6 tokens, then -factor * (length - 6) / 4
    lengths = torch.tensor([5, 6, 8, 10])
    assert overlong_penalty(lengths, 10, 4, 1.0).tolist() == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(lengths, 10, 4, 0.5).tolist() == [0.0, 0.0, -0.25, -0.5]
    with pytest.raises(ValueError, match="overlong buffer 11"):
        overlong_penalty(lengths, 10, 11, 1.0)


def test_informative_groups_drops_groups_whose_rewards_are_all_equal():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.25])
    assert informative_groups(rewards, 3).tolist() == [False, True, False, True]
