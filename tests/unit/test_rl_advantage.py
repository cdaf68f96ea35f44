"""GRPO group advantages against hand-computed values."""

import math

import pytest
import torch

from jetflow.rl.advantage import group_advantages

# 2 prompts x 3 samples.
#   group 0: [1, 0, 0.5]  mean 0.5, deviations [0.5, -0.5, 0],
#            population var (0.25 + 0.25 + 0) / 3 = 1/6, std = 0.4082483
#   group 1: [0, 3, 0]    mean 1,   deviations [-1, 2, -1],
#            population var (1 + 4 + 1) / 3 = 2, std = sqrt(2) = 1.4142136
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 3.0, 0.0])


def test_mean_std_2x3_by_hand():
    s0, s1 = math.sqrt(1 / 6), math.sqrt(2)
    expected = torch.tensor([0.5 / s0, -0.5 / s0, 0.0, -1 / s1, 2 / s1, -1 / s1])
    # = [1.2247449, -1.2247449, 0, -0.7071068, 1.4142136, -0.7071068]
    adv = group_advantages(REWARDS, group_size=3)
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    assert adv[0].item() == pytest.approx(1.2247449, abs=1e-5)


def test_mean_only_and_none():
    adv = group_advantages(REWARDS, group_size=3, norm="mean")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, -1.0, 2.0, -1.0]))
    raw = group_advantages(REWARDS, group_size=3, norm="none")
    torch.testing.assert_close(raw, REWARDS)
    raw[0] = 42.0  # a copy, not a view of the caller's tensor
    assert REWARDS[0].item() == 1.0


def test_uniform_group_gives_zero_not_nan():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0]), group_size=3)
    # group 1 = [0, 1, 0]: mean 1/3, std sqrt(2/9) = 0.4714045
    expected = torch.tensor([0.0, 0.0, 0.0, -0.7071068, 1.4142136, -0.7071068])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_group_size_one_and_int_rewards():
    torch.testing.assert_close(group_advantages(torch.tensor([3.0, -1.0]), 1), torch.zeros(2))
    adv = group_advantages(torch.tensor([1, 0]), group_size=2, norm="mean")
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5]))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(5), group_size=3)
    with pytest.raises(ValueError, match="mean_std, mean, none"):
        group_advantages(torch.zeros(6), group_size=3, norm="zscore")
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 3), group_size=3)
