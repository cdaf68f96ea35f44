"""Rollout correction: per-token weights for the rollout / trainer policy mismatch.

The rollout engine samples from pi_rollout (logprobs ``rollout_logprobs``); the trainer, under the
same weights, computes pi_old (``old_logprobs``). Numerics (FP8 vs BF16 kernels, KV-cache
quantisation, batch-dependent reductions) make them differ, so the PPO gradient, which assumes
samples from pi_old, is biased. Each mode returns a weight per token that multiplies the per-token
policy-gradient loss (``policy_loss(..., is_weights=weights)``).

The token importance ratio is ``w = pi_old / pi_rollout = exp(old - rollout)``; samples come from
pi_rollout, so E[w] = 1 when both see the same distribution.

Modes (``CORRECTIONS``):
- ``none``: w = 1.
- ``token_tis``: min(w, cap) -- truncated IS (Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"; FP8-RL, arXiv 2601.18150).
- ``token_mis``: w if lo <= w <= hi else 0 -- masked IS: tokens with outlying ratios are dropped.
- ``seq_tis`` / ``seq_mis``: the same on the sequence ratio exp(sum_t (old - rollout)), computed in
  log space, one weight broadcast to all tokens of the sequence.
- ``ais``: adaptive mix of uncorrected and truncated-IS weights; see ``ais`` below.

Weights outside the mask are finite (token modes use ratio 1 there, sequence modes the sequence
weight) and carry no meaning; the loss masks them out. Metrics are computed on masked tokens and
named ``correction/...``.

AIS -- OUR formulation. AIS (Zhou et al., arXiv 2605.13907) mixes the uncorrected and fully
importance-weighted gradients with a per-batch coefficient built from three diagnostics: weight
reliability, divergence severity and variance amplification. The paper's exact formulas were not
available to us; what follows is our own design with the same ingredients. On the n masked tokens,
with w = exp(old - rollout):

    ess   = (sum w)^2 / (n * sum w^2)           in (0, 1]; 1 iff all w are equal  (reliability)
    kl    = mean(w - 1 - log w)                 k3 estimate of KL(rollout || old), >= 0  (severity)
    chi2  = max(mean(w^2) - 1, 0)               estimate of chi^2(old || rollout) = E_roll[w^2] - 1
                                                (variance amplification; E[w^2], not the
                                                 self-normalised mean(w^2)/mean(w)^2, which is
                                                 exactly 1/ess - 1 and would repeat ess)
    agree = exp(-(kl / kl_scale + chi2 / chi2_scale)) * ess ** ess_power      in (0, 1]
    lam   = 1 - agree                                                          in [0, 1]
    weight = (1 - lam) * 1 + lam * min(w, cap)

Intuition. When the policies agree, the uncorrected gradient is unbiased and has the lowest
variance, so any IS weighting only adds noise: lam = 0 exactly when rollout == old (w = 1, so
kl = chi2 = 0 and ess = 1). As they diverge, the uncorrected gradient's bias grows and the
truncated-IS gradient is needed: lam -> 1. ``agree`` is a product of agreement scores, each 1 on
agreement and falling with mismatch, so lam is monotone: it rises when kl or chi2 rise or ess
falls, and any one diagnostic can push the batch toward correction.

kl and chi2 measure the *size* of the mismatch (they also see a uniform shift of all log-ratios),
in units set by ``kl_scale`` / ``chi2_scale``. ESS is scale-free and measures *dispersion*:
how far the rollout samples stand in for the trainer's distribution. It tempers the trust placed
in the uncorrected gradient, capping 1 - lam at ess ** ess_power: a batch whose weights
concentrate on a few tokens is never treated as on-policy, however mild its average KL looks or
however loose the scales are. It deliberately does NOT lower lam: low ESS means strong mismatch,
exactly when correction is needed; the variance of the corrected gradient is bounded by the
truncation at ``cap``, not by backing off the correction.

Default scales: for log-ratios ~ N(0, s^2), kl ~ s^2/2 and chi2 ~ 2 s^2, so kl_scale = 0.01 and
chi2_scale = 0.05 give the two terms similar weight and put lam ~ 0.02 at KL ~ 1e-4, ~ 0.17 at
KL ~ 1e-3 and ~ 0.84 at KL ~ 1e-2. These are starting points, not tuned values: calibrate them
against the measured ``mismatch/kl_k3`` of the bf16 / mixed / unified runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable, Mapping

import torch
from torch import Tensor

# Clamp log-ratios before exp(): exp(20) ~ 5e8 is far beyond any cap, and its square still fits
# in float32, so no inf can reach the weights or the metrics.
_MAX_LOG_RATIO = 20.0


@dataclass
class CorrectionResult:
    weights: Tensor  # (B, T) detached; multiplies the per-token policy-gradient loss
    metrics: dict[str, float]  # "correction/..." scalars


def _token_log_ratio(rollout_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log(pi_old / pi_rollout) on masked tokens, 0 elsewhere, clamped. (B, T) float32+."""
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    diff = old_logprobs.to(dtype) - rollout_logprobs.to(dtype)  # (B, T)
    lr = torch.where(mask > 0, diff, torch.zeros_like(diff))
    return lr.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1.0))


def _masked_max(x: Tensor, mask: Tensor) -> float:
    if not bool((mask > 0).any()):
        return 0.0
    return float(x[mask > 0].max())


def _weight_metrics(weights: Tensor, mask: Tensor) -> dict[str, float]:
    return {
        "correction/weight_mean": _masked_mean(weights, mask),
        "correction/weight_max": _masked_max(weights, mask),
    }


# The parameters of each correction, typed: `correction_parameters` reads them from a mapping (the
# config's algo.correction_params) and refuses a key the correction does not take, by name.

@dataclass(frozen=True)
class NoParameters:
    """`none` takes no parameters."""

    def check(self) -> None:
        pass


@dataclass(frozen=True)
class TruncationParameters:
    """`token_tis`, `seq_tis`: weights truncated at `cap`."""
    cap: float = 2.0
    """The largest weight a token (or a sequence) keeps: min(w, cap); > 0."""

    def check(self) -> None:
        if not self.cap > 0:
            raise ValueError(f"cap={self.cap} must be > 0")


@dataclass(frozen=True)
class MaskParameters:
    """`token_mis`, `seq_mis`: tokens (sequences) whose ratio leaves [lo, hi] get weight 0."""
    lo: float = 0.5
    hi: float = 2.0
    """The kept ratios: 0 <= lo < hi."""

    def check(self) -> None:
        if not 0 <= self.lo < self.hi:
            raise ValueError(f"lo={self.lo}, hi={self.hi}: need 0 <= lo < hi")


@dataclass(frozen=True)
class AISParameters:
    """`ais`: see the module docstring."""
    cap: float = 2.0
    """Truncation of the importance weights it mixes in; > 0."""
    kl_scale: float = 0.01
    """The KL (k3) at which the severity term reaches 1/e; > 0."""
    chi2_scale: float = 0.05
    """The chi-square at which the variance term reaches 1/e; > 0."""
    ess_power: float = 1.0
    """Exponent of the ESS cap on trusting the uncorrected gradient; >= 0."""

    def check(self) -> None:
        TruncationParameters(self.cap).check()
        if self.kl_scale <= 0 or self.chi2_scale <= 0 or self.ess_power < 0:
            raise ValueError(f"kl_scale={self.kl_scale}, chi2_scale={self.chi2_scale}, ess_power={self.ess_power}: "
                             "need kl_scale > 0, chi2_scale > 0, ess_power >= 0")


def no_correction(rollout_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> CorrectionResult:
    weights = torch.ones_like(old_logprobs)  # (B, T)
    return CorrectionResult(weights, _weight_metrics(weights, mask.to(weights.dtype)))


def token_tis(
    rollout_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, *, cap: float = 2.0
) -> CorrectionResult:
    TruncationParameters(cap).check()
    ratio = torch.exp(_token_log_ratio(rollout_logprobs, old_logprobs, mask))  # (B, T)
    weights = ratio.clamp(max=cap)  # (B, T)
    m = mask.to(weights.dtype)
    metrics = _weight_metrics(weights, m)
    metrics["correction/truncated_frac"] = _masked_mean((ratio > cap).to(m.dtype), m)
    return CorrectionResult(weights, metrics)


def token_mis(
    rollout_logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    *,
    lo: float = 0.5,
    hi: float = 2.0,
) -> CorrectionResult:
    MaskParameters(lo, hi).check()
    ratio = torch.exp(_token_log_ratio(rollout_logprobs, old_logprobs, mask))  # (B, T)
    keep = (ratio >= lo) & (ratio <= hi)  # (B, T)
    weights = torch.where(keep, ratio, torch.zeros_like(ratio))  # (B, T)
    m = mask.to(weights.dtype)
    metrics = _weight_metrics(weights, m)
    metrics["correction/masked_frac"] = _masked_mean((~keep).to(m.dtype), m)
    return CorrectionResult(weights, metrics)


def _seq_log_ratio(rollout_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log of the sequence ratio prod_t pi_old / pi_rollout over response tokens. (B,)"""
    return _token_log_ratio(rollout_logprobs, old_logprobs, mask).sum(dim=-1)


def _seq_metrics(weights: Tensor, mask: Tensor, flagged: Tensor, name: str) -> dict[str, float]:
    """Token-level weight metrics plus the share of non-empty sequences ``flagged`` (B,)."""
    m = mask.to(weights.dtype)
    metrics = _weight_metrics(weights, m)
    nonempty = (m.sum(dim=-1) > 0).to(m.dtype)  # (B,)
    metrics[f"correction/seq_{name}_frac"] = _masked_mean(flagged.to(m.dtype), nonempty)
    return metrics


def seq_tis(
    rollout_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, *, cap: float = 2.0
) -> CorrectionResult:
    TruncationParameters(cap).check()
    log_seq = _seq_log_ratio(rollout_logprobs, old_logprobs, mask)  # (B,)
    seq_w = torch.exp(log_seq.clamp(max=math.log(cap)))  # (B,) min(ratio, cap), no overflow
    weights = seq_w[:, None].expand_as(old_logprobs).contiguous()  # (B, T)
    metrics = _seq_metrics(weights, mask, log_seq > math.log(cap), "truncated")
    return CorrectionResult(weights, metrics)


def seq_mis(
    rollout_logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    *,
    lo: float = 0.5,
    hi: float = 2.0,
) -> CorrectionResult:
    MaskParameters(lo, hi).check()
    log_seq = _seq_log_ratio(rollout_logprobs, old_logprobs, mask)  # (B,)
    log_lo = math.log(lo) if lo > 0 else -math.inf
    keep = (log_seq >= log_lo) & (log_seq <= math.log(hi))  # (B,)
    # exp() only of kept sequences: their log-ratio is in [log lo, log hi], so it cannot overflow.
    seq_w = torch.where(keep, torch.exp(log_seq.clamp(max=math.log(hi))), torch.zeros_like(log_seq))
    weights = seq_w[:, None].expand_as(old_logprobs).contiguous()  # (B, T)
    metrics = _seq_metrics(weights, mask, ~keep, "masked")
    metrics["correction/masked_frac"] = _masked_mean(
        (weights == 0).to(weights.dtype), mask.to(weights.dtype)
    )
    return CorrectionResult(weights, metrics)


def ais_diagnostics(
    rollout_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor
) -> tuple[float, float, float]:
    """(ess, kl, chi2) of the token ratios w = exp(old - rollout) on masked tokens; see module doc.

    Computed in float64 so that lam is exactly 0 on agreement and resolves small mismatches.
    An empty mask gives (1, 0, 0): no evidence of mismatch.
    """
    lr = _token_log_ratio(rollout_logprobs, old_logprobs, mask).double()  # (B, T)
    lr = lr[mask > 0]  # (n,)
    n = lr.numel()
    if n == 0:
        return 1.0, 0.0, 0.0
    w = torch.exp(lr)  # (n,)
    ess = float(w.sum() ** 2 / (n * (w * w).sum()))
    kl = float((w - 1.0 - lr).mean())
    chi2 = max(float((w * w).mean()) - 1.0, 0.0)
    return ess, kl, chi2


def ais(
    rollout_logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    *,
    cap: float = 2.0,
    kl_scale: float = 0.01,
    chi2_scale: float = 0.05,
    ess_power: float = 1.0,
) -> CorrectionResult:
    """Adaptive IS (our formulation, see module docstring): 1 - lam of the uncorrected weight 1
    plus lam of the truncated weight min(w, cap), with one lam per batch."""
    AISParameters(cap, kl_scale, chi2_scale, ess_power).check()
    ess, kl, chi2 = ais_diagnostics(rollout_logprobs, old_logprobs, mask)
    agree = math.exp(-(kl / kl_scale + chi2 / chi2_scale)) * ess**ess_power
    lam = 1.0 - agree

    tis = torch.exp(_token_log_ratio(rollout_logprobs, old_logprobs, mask)).clamp(max=cap)  # (B, T)
    weights = (1.0 - lam) + lam * tis  # (B, T)
    metrics = _weight_metrics(weights, mask.to(weights.dtype))
    metrics.update(
        {
            "correction/ais_lambda": lam,
            "correction/ais_ess": ess,
            "correction/ais_kl": kl,
            "correction/ais_chi2": chi2,
        }
    )
    return CorrectionResult(weights, metrics)


CORRECTIONS: dict[str, Callable[..., CorrectionResult]] = {
    "none": no_correction,
    "token_tis": token_tis,
    "token_mis": token_mis,
    "seq_tis": seq_tis,
    "seq_mis": seq_mis,
    "ais": ais,
}


PARAMETERS: dict[str, type] = {
    "none": NoParameters,
    "token_tis": TruncationParameters,
    "token_mis": MaskParameters,
    "seq_tis": TruncationParameters,
    "seq_mis": MaskParameters,
    "ais": AISParameters,
}
"""Each correction's parameters (the keyword arguments of its function)."""


def correction_parameters(name: str, given: Mapping[str, float]):
    """Correction `name`'s typed parameters from `given` (missing keys take their defaults). ValueError
    naming the key for a key the correction does not take (with the ones it does) or a value out of
    range."""
    kind = PARAMETERS.get(name)
    if kind is None:
        raise ValueError(f"unknown rollout correction {name!r}; valid: {', '.join(CORRECTIONS)}")
    valid = {f.name: f.default for f in fields(kind)}
    unknown = [k for k in given if k not in valid]
    if unknown:
        takes = ", ".join(f"{k} (default {v})" for k, v in valid.items()) if valid else "none, it takes no parameters"
        raise ValueError(f"{', '.join(map(str, unknown))} {'is not a parameter' if len(unknown) == 1 else 'are not parameters'} "
                         f"of {name}; valid keys: {takes}")
    params = kind(**{k: float(v) for k, v in given.items()})
    try:
        params.check()
    except ValueError as e:
        raise ValueError(f"{e} ({name})") from None
    return params


ROW_LOCAL = ("none", "token_tis", "token_mis", "seq_tis", "seq_mis")
"""Corrections whose weights for a sequence depend on that sequence alone (`ais` needs the batch)."""


@torch.no_grad()
def apply_correction(
    name: str, rollout_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, **params: float
) -> CorrectionResult:
    """Weights and metrics of correction ``name`` (a key of ``CORRECTIONS``).

    Args:
        rollout_logprobs: (B, T) log pi_rollout of the sampled tokens.
        old_logprobs: (B, T) log pi_old, the trainer's logprobs under the rollout weights.
        mask: (B, T) float or bool, 1 on response tokens.
        **params: the mode's parameters (``PARAMETERS``: ``cap``; ``lo``, ``hi``; AIS scales), checked by
            ``correction_parameters``.
    """
    checked = correction_parameters(name, params)
    result = CORRECTIONS[name](rollout_logprobs.detach(), old_logprobs.detach(), mask, **vars(checked))
    return CorrectionResult(result.weights.detach(), result.metrics)
