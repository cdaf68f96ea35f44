"""PPO clipped loss, aggregation, IS weights and KL penalty against hand-computed values."""

import math

import pytest
import torch

from jetflow.rl.loss import agg_denominator, aggregate, policy_loss

F64 = torch.float64


def _logprobs(old, ratios):
    """Current-policy logprobs giving the wanted ratios, as a leaf that records grad."""
    return (old + torch.log(ratios)).clone().requires_grad_(True)


def test_clipped_loss_value_and_grad_both_bounds_both_signs():
    # clip range [1 - 0.2, 1 + 0.28] = [0.8, 1.28]
    ratios = torch.tensor([[1.5, 0.7, 1.1], [1.5, 0.7, 1.1]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -3.0]], dtype=F64)
    lp = _logprobs(old, ratios)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    mask = torch.ones(2, 3)
    # A = +1: r=1.5 -> max(-1.5, -1.28) = -1.28 clipped; r=0.7 -> max(-0.7, -0.8) = -0.7;
    #         r=1.1 -> -1.1 (inside)
    # A = -1: r=1.5 -> max(1.5, 1.28) = 1.5;  r=0.7 -> max(0.7, 0.8) = 0.8 clipped; r=1.1 -> 1.1
    # token_mean = (-1.28 - 0.7 - 1.1 + 1.5 + 0.8 + 1.1) / 6 = 0.32 / 6
    loss, metrics = policy_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx(0.32 / 6, abs=1e-12)
    assert metrics["loss/policy"] == pytest.approx(0.32 / 6, abs=1e-12)
    assert metrics["loss/clip_frac"] == pytest.approx(2 / 6)
    assert metrics["loss/ratio_mean"] == pytest.approx(1.1)
    assert "loss/kl" not in metrics

    loss.backward()
    # d(-A * r)/d lp = -A * r where unclipped, 0 where the clipped constant is active; / 6 tokens
    expected = torch.tensor([[0.0, -0.7, -1.1], [1.5, 0.0, 1.1]], dtype=F64) / 6
    torch.testing.assert_close(lp.grad, expected)


def test_clip_high_is_asymmetric():
    # r = 1.25 is inside clip-higher's 1.28 but outside a symmetric 1.2: loss -1.25 vs -1.2
    old = torch.zeros(1, 1, dtype=F64)
    lp = _logprobs(old, torch.tensor([[1.25]], dtype=F64))
    adv, mask = torch.tensor([1.0], dtype=F64), torch.ones(1, 1)
    loss, _ = policy_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx(-1.25)
    loss_sym, m = policy_loss(lp, old, adv, mask, clip_high=0.2)
    assert loss_sym.item() == pytest.approx(-1.2)
    assert m["loss/clip_frac"] == 1.0


# Uneven mask: row 0 has 3 response tokens, row 1 has 1. Ratio 1 everywhere, so the per-token loss
# is -A: row 0 -> [-1, -1, -1], row 1 -> [2].
UNEVEN_MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
UNEVEN_ADV = torch.tensor([1.0, -2.0], dtype=F64)


@pytest.mark.parametrize(
    "agg, expected, grad_row0, grad_row1",
    [
        # (-1 - 1 - 1 + 2) / 4 tokens; d/dlp = -A * r / 4
        ("token_mean", -0.25, -1 / 4, 2 / 4),
        # (mean(-1, -1, -1) + mean(2)) / 2 sequences; row 0 tokens get -1 / 3 / 2
        ("seq_mean_token_mean", 0.5, -1 / 6, 2 / 2),
        # (sum(-1, -1, -1) + 2) / 2 sequences
        ("seq_mean_token_sum", -0.5, -1 / 2, 2 / 2),
    ],
)
def test_aggregations_on_uneven_mask(agg, expected, grad_row0, grad_row1):
    old = torch.tensor([[-1.0, -1.0, -1.0, -math.inf], [-2.0, -math.inf, 0.0, 0.0]], dtype=F64)
    lp = torch.tensor([[-1.0, -1.0, -1.0, -5.0], [-2.0, 7.0, 0.0, 0.0]], dtype=F64)
    lp.requires_grad_(True)
    loss, _ = policy_loss(lp, old, UNEVEN_ADV, UNEVEN_MASK, agg=agg)
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    expected_grad = torch.tensor(
        [[grad_row0] * 3 + [0.0], [grad_row1, 0.0, 0.0, 0.0]], dtype=F64
    )  # padding (including the -inf old logprobs) gets exactly zero gradient, no NaN
    torch.testing.assert_close(lp.grad, expected_grad)


def test_aggregate_excludes_empty_sequences_and_empty_mask_is_zero():
    x = torch.tensor([[2.0, 4.0, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert aggregate(x, mask, "token_mean").item() == pytest.approx(3.0)
    assert aggregate(x, mask, "seq_mean_token_mean").item() == pytest.approx(3.0)
    assert aggregate(x, mask, "seq_mean_token_sum").item() == pytest.approx(6.0)
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        assert aggregate(x, torch.zeros(2, 3), agg).item() == 0.0
    with pytest.raises(ValueError, match="token_mean, seq_mean_token_mean, seq_mean_token_sum"):
        aggregate(x, mask, "sum")
    with pytest.raises(ValueError, match="valid"):
        policy_loss(x, x, torch.zeros(2), mask, agg="mean")


def test_kl_penalty_k3_value_and_grad():
    lp = torch.tensor([[-1.0, -0.5]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -0.5]], dtype=F64)
    adv = torch.zeros(1, dtype=F64)  # isolate the KL term: the policy term is 0
    # d = ref - lp = [-0.5, 0]; k3 = exp(d) - d - 1 = [exp(-0.5) - 0.5, 0] = [0.1065307, 0]
    # token_mean k3 = 0.0532653; loss = 0.1 * 0.0532653
    loss, metrics = policy_loss(
        lp, lp.detach(), adv, torch.ones(1, 2), ref_logprobs=ref, kl_coef=0.1
    )
    k3 = math.exp(-0.5) - 0.5
    assert metrics["loss/kl"] == pytest.approx(k3 / 2)
    assert loss.item() == pytest.approx(0.1 * k3 / 2)
    loss.backward()
    # d k3 / d lp = 1 - exp(ref - lp) = [1 - exp(-0.5), 0], times 0.1 / 2 tokens
    expected = torch.tensor([[0.1 * (1 - math.exp(-0.5)) / 2, 0.0]], dtype=F64)
    torch.testing.assert_close(lp.grad, expected)


def test_is_weights_multiply_per_token_loss_and_are_detached():
    old = torch.zeros(1, 2, dtype=F64)
    lp = old.clone().requires_grad_(True)  # ratio 1
    w = torch.tensor([[2.0, 0.5]], dtype=F64, requires_grad=True)
    # per-token loss -A * r * w = [-2, -0.5]; token_mean -1.25
    loss, metrics = policy_loss(lp, old, torch.ones(1, dtype=F64), torch.ones(1, 2), is_weights=w)
    assert loss.item() == pytest.approx(-1.25)
    assert metrics["loss/policy"] == pytest.approx(-1.25)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -0.25]], dtype=F64))
    assert w.grad is None


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_microbatch_scaling_reproduces_full_batch(agg):
    # mask token counts per row: 3, 1, 2 -> micro-batches {row 0} and {rows 1, 2}
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -9.0, -9.0], [-1.0, -0.7, -9.0]], dtype=F64)
    ratios = torch.tensor([[1.5, 0.9, 1.1], [0.6, 1.0, 1.0], [1.2, 1.3, 1.0]], dtype=F64)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=F64)
    full, _ = policy_loss(old + ratios.log(), old, adv, mask, agg=agg)

    assert agg_denominator(mask, "token_mean") == 6.0
    assert agg_denominator(mask, "seq_mean_token_mean") == 3.0
    parts = [slice(0, 1), slice(1, 3)]
    total = sum(agg_denominator(mask[s], agg) for s in parts)
    acc = 0.0
    for s in parts:
        micro, _ = policy_loss((old + ratios.log())[s], old[s], adv[s], mask[s], agg=agg)
        acc += micro.item() * agg_denominator(mask[s], agg) / total
    assert acc == pytest.approx(full.item())
