"""Per-token estimators of KL(pi_theta || pi_ref) from the log-probs of sampled tokens (Schulman,
"Approximating KL divergence", 2020), under verl's names (`kl_penalty` in verl/trainer/ppo/core_algos.py):

    k1          lp - ref                          unbiased, can be negative
    k2          0.5 (lp - ref)^2                  biased, >= 0; its gradient is the KL's
    k3          exp(ref - lp) - (ref - lp) - 1    unbiased, >= 0
    low_var_kl  k3 clamped to [-10, 10]           verl's default for the KL loss

ref - lp is clamped to [-20, 20] before exp() in k3 / low_var_kl (as verl does), so a token the
reference finds far likelier cannot overflow to inf. verl treats `k3` as another name of low_var_kl
(both clamped to [-10, 10]); here k3 is the estimator itself and low_var_kl the clamped one.
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")

_MAX_LOG_RATIO = 20.0  # the clamp of ref - lp before exp() (verl's)
_LOW_VAR_BOUND = 10.0  # low_var_kl's clamp of the estimate (verl's)


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log pi and log pi_ref of the sampled tokens:
    same shape as the inputs (B, T). Differentiable in `logprobs`; the caller masks padding."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    if estimator in ("k3", "low_var_kl"):
        d = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl = torch.exp(d) - d - 1.0
        return kl.clamp(-_LOW_VAR_BOUND, _LOW_VAR_BOUND) if estimator == "low_var_kl" else kl
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
