"""Rollout / trainer mismatch metrics on the sampled tokens.

With delta = trainer - rollout log-probs of the sampled token and r = exp(delta) =
pi_train / pi_rollout (samples come from the rollout, so E[r] = 1 when the two agree):

    kl_k1              mean(-delta)                  KL(rollout || train), unbiased, can be < 0
    kl_k3              mean(r - 1 - delta)           KL(rollout || train), unbiased, >= 0 per token
    chi2               mean(r^2) - 1                 chi^2(train || rollout): IS variance blow-up
    ess                (sum r)^2 / (n sum r^2)       normalised effective sample size, (0, 1]
    abs_delta_mean/max mean / max |delta|
    exp_abs_delta_mean mean exp(|delta|)             >= 1; the typical multiplicative error
    ratio_outside_frac share of r outside [0.5, 2]
    equal_frac         share of tokens whose two log-probs are exactly equal (1 under exact numerics)
    num_tokens         n

Each metric is also reported per response-position bin: ``mismatch/<name>/pos_<i>of<K>``. Bins
split the absolute token index t in [0, T) of the (B, T) *response* tensors (t = 0 is the first
generated token, right padding) into K equal-width bins, bin = floor(t * K / T). Long rollouts
are where FP8 mismatch compounds, so the late bins are the ones to watch.

An empty mask (or bin) gives 0 for every metric and ``num_tokens`` 0, never NaN.
Computed in float64 under no_grad: these are diagnostics, never part of the loss.

Low-probability tokens (``low_prob_metrics``): a sampled token whose rollout probability (of the
distribution it was sampled from, temperature applied) is below ``LOW_PROB_THRESHOLD`` = 0.1.
The rollout/trainer gap of a token's log-prob shrinks with its probability (about (1 - p) times the
logit error), so the mismatch sits in the tail, and the reports of RL collapse under a mismatch
("When Speed Kills Stability", Liu, Li et al. 2025; "Taming the Tail", arXiv 2512.23087) trace the
exploding gradients to sampled low-probability tokens. Keys:

    policy/low_prob_frac       share of response tokens with p_rollout < LOW_PROB_THRESHOLD
    mismatch/kl_k3/low_prob    mean k3 over those tokens (0 when there are none)
    mismatch/kl_k3/high_prob   mean k3 over the other response tokens (0 when there are none)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# exp() of a log-ratio beyond +-20 would dominate every mean anyway; clamping keeps r^2 finite.
_MAX_LOG_RATIO = 20.0
_OUTSIDE_LO, _OUTSIDE_HI = 0.5, 2.0
LOW_PROB_THRESHOLD = 0.1
"""A sampled token is a low-probability one when its rollout probability is below this."""


def _stats(delta: Tensor) -> dict[str, float]:
    """All metrics for a flat (n,) tensor of masked log-ratio differences."""
    n = delta.numel()
    if n == 0:
        names = ("kl_k1", "kl_k3", "chi2", "ess", "abs_delta_mean", "abs_delta_max",
                 "exp_abs_delta_mean", "ratio_outside_frac", "equal_frac", "num_tokens")
        return {k: 0.0 for k in names}
    d = delta.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # (n,)
    r = torch.exp(d)  # (n,)
    r2_sum = (r * r).sum()
    return {
        "kl_k1": float((-delta).mean()),
        "kl_k3": float((r - 1.0 - d).mean()),
        "chi2": float(r2_sum / n - 1.0),
        "ess": float(r.sum() ** 2 / (n * r2_sum)),
        "abs_delta_mean": float(delta.abs().mean()),
        "abs_delta_max": float(delta.abs().max()),
        "exp_abs_delta_mean": float(torch.exp(d.abs()).mean()),
        "ratio_outside_frac": float(((r < _OUTSIDE_LO) | (r > _OUTSIDE_HI)).double().mean()),
        "equal_frac": float((delta == 0).double().mean()),
        "num_tokens": float(n),
    }


@torch.no_grad()
def mismatch_metrics(
    rollout_logprobs: Tensor, trainer_logprobs: Tensor, mask: Tensor, num_position_bins: int = 4
) -> dict[str, float]:
    """Whole-batch and per-position-bin mismatch metrics, keys ``mismatch/...``.

    Args:
        rollout_logprobs: (B, T) log pi_rollout of the sampled tokens.
        trainer_logprobs: (B, T) log pi_train of the same tokens, same weights.
        mask: (B, T) float or bool, 1 on response tokens.
        num_position_bins: K >= 1 equal-width bins over the response index.
    """
    if num_position_bins < 1:
        raise ValueError(f"num_position_bins must be >= 1, got {num_position_bins}")
    delta = trainer_logprobs.double() - rollout_logprobs.double()  # (B, T)
    valid = mask > 0  # (B, T)
    T = delta.shape[-1]
    K = num_position_bins

    out = {f"mismatch/{k}": v for k, v in _stats(delta[valid]).items()}
    pos_bin = torch.arange(T, device=delta.device) * K // T  # (T,) in [0, K)
    for i in range(K):
        in_bin = valid & (pos_bin == i)[None, :]  # (B, T)
        for k, v in _stats(delta[in_bin]).items():
            out[f"mismatch/{k}/pos_{i}of{K}"] = v
    return out


@torch.no_grad()
def mismatch_position_curves(
    rollout_logprobs: Tensor, trainer_logprobs: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """Per-response-index curves for plotting: each (T,) float64, 0 where no token.

    Keys: ``kl_k3`` (mean k3 at index t), ``abs_delta`` (mean |delta| at t), ``count`` (tokens
    at t).
    """
    delta = trainer_logprobs.double() - rollout_logprobs.double()  # (B, T)
    m = (mask > 0).double()  # (B, T)
    delta = torch.where(m > 0, delta, torch.zeros_like(delta))  # padding may be -inf
    d = delta.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    k3 = torch.exp(d) - 1.0 - d  # (B, T)
    count = m.sum(dim=0)  # (T,)
    denom = count.clamp(min=1.0)
    return {
        "kl_k3": (k3 * m).sum(dim=0) / denom,
        "abs_delta": (delta.abs() * m).sum(dim=0) / denom,
        "count": count,
    }


@torch.no_grad()
def low_prob_metrics(rollout_logprobs: Tensor, trainer_logprobs: Tensor, mask: Tensor,
                     threshold: float = LOW_PROB_THRESHOLD) -> dict[str, float]:
    """The share of sampled low-probability tokens and the mismatch on them (module docstring).

    Args:
        rollout_logprobs: (B, T) log pi_rollout of the sampled tokens (the sampling distribution).
        trainer_logprobs: (B, T) log pi_train of the same tokens.
        mask: (B, T) float or bool, 1 on response tokens.
        threshold: probability below which a sampled token counts as low-probability, in (0, 1].
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    valid = mask > 0  # (B, T)
    rollout = rollout_logprobs.double()
    low = valid & (rollout < math.log(threshold))  # (B, T)
    high = valid & ~low
    delta = torch.where(valid, trainer_logprobs.double() - rollout, torch.zeros_like(rollout))
    d = delta.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    k3 = torch.exp(d) - 1.0 - d  # (B, T)
    n, n_low, n_high = int(valid.sum()), int(low.sum()), int(high.sum())
    return {
        "policy/low_prob_frac": n_low / n if n else 0.0,
        "mismatch/kl_k3/low_prob": float(k3[low].sum()) / n_low if n_low else 0.0,
        "mismatch/kl_k3/high_prob": float(k3[high].sum()) / n_high if n_high else 0.0,
    }


@torch.no_grad()
def split_mismatch(behaviour_logprobs: Tensor, sampling_logprobs: Tensor, current_logprobs: Tensor,
                   mask: Tensor) -> dict[str, float]:
    """A stale batch's mismatch split into numerics and staleness (rollout.max_staleness > 0, issue 72).

    The gap between the behaviour log-probs (the engine's, under the weight version that sampled) and the
    trainer's under its current weights (pi_proximal: what `mismatch/*` compares) is two gaps in a row:
    numerics, behaviour against the trainer's recomputation under the sampling version (0 under exact
    numerics), then staleness, that recomputation against the current weights. Per token the log-ratios add up
    (delta = delta_numerics + delta_staleness), so the two k1 estimates add up to `mismatch/kl_k1`; the k3
    estimates do not add exactly (k3 is convex in delta).

    Args:
        behaviour_logprobs: (B, T) log pi_behaviour of the sampled tokens (the engine's).
        sampling_logprobs: (B, T) the trainer's log-probs of them under the version that sampled them.
        current_logprobs: (B, T) the trainer's under its current weights (pi_old, the proximal policy).
        mask: (B, T) float or bool, 1 on response tokens.
    """
    valid = mask > 0  # (B, T)
    sampling = sampling_logprobs.double()
    numerics = _stats((sampling - behaviour_logprobs.double())[valid])
    staleness = _stats((current_logprobs.double() - sampling)[valid])
    return {"mismatch/numerics_kl_k1": numerics["kl_k1"], "mismatch/numerics_kl_k3": numerics["kl_k3"],
            "mismatch/numerics_equal_frac": numerics["equal_frac"],
            "mismatch/staleness_kl_k1": staleness["kl_k1"], "mismatch/staleness_kl_k3": staleness["kl_k3"]}
