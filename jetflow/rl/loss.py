"""PPO-clip policy loss for GRPO, with asymmetric clipping, a token- or sequence-level importance ratio
(GSPO) and an optional KL penalty to a reference policy (jetflow.rl.kl's estimators).

Shapes: B sequences, T response positions. ``mask`` (B, T) marks response tokens (1) vs padding (0).

Rollout correction (TIS / MIS / AIS) is not computed here: it arrives as ``is_weights`` from
``jetflow.rl.correction`` and simply multiplies the per-token policy-gradient loss.

Micro-batch accumulation: every aggregation divides by a micro-batch quantity (its number of
tokens, or of sequences), so ``token_mean`` over a micro-batch is the *micro-batch* mean. To
reproduce the full-batch loss when accumulating gradients, the caller scales each micro-batch loss
by ``agg_denominator(mask_micro, agg) / sum of agg_denominator over all micro-batches`` and sums.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .kl import kl_estimate

# Log-ratios are clamped before exp() so that a wild token cannot overflow to inf (and inf * 0 to
# NaN). exp(20) ~ 5e8 is far outside any clip range, so the clamp never changes a clipped loss.
_MAX_LOG_RATIO = 20.0


def _seq_token_counts(mask: Tensor) -> Tensor:
    return mask.sum(dim=-1)  # (B,)


def _token_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _seq_mean_token_mean(x: Tensor, mask: Tensor) -> Tensor:
    counts = _seq_token_counts(mask)  # (B,)
    per_seq = (x * mask).sum(dim=-1) / counts.clamp(min=1.0)  # (B,)
    return per_seq.sum() / (counts > 0).sum().clamp(min=1)


def _seq_mean_token_sum(x: Tensor, mask: Tensor) -> Tensor:
    counts = _seq_token_counts(mask)  # (B,)
    per_seq = (x * mask).sum(dim=-1)  # (B,)
    return per_seq.sum() / (counts > 0).sum().clamp(min=1)


def _seq_mean_token_sum_norm(x: Tensor, mask: Tensor, scale: float) -> Tensor:
    return _seq_mean_token_sum(x, mask) / scale


AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    # sum over all masked tokens / number of masked tokens (long answers weigh more)
    "token_mean": _token_mean,
    # mean over tokens of each sequence, then mean over sequences (original GRPO)
    "seq_mean_token_mean": _seq_mean_token_mean,
    # sum over tokens of each sequence, then mean over sequences
    "seq_mean_token_sum": _seq_mean_token_sum,
    # the same divided by a constant length (Dr. GRPO; verl's seq-mean-token-sum-norm, whose
    # loss_scale_factor is `scale`): no sequence's tokens are averaged by its own length
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


def aggregate(x: Tensor, mask: Tensor, agg: str = "token_mean", scale: float | None = None) -> Tensor:
    """Reduce a per-token quantity ``x`` (B, T) to a scalar over the masked tokens.

    Sequence-level modes average over sequences with at least one response token; an all-zero
    mask gives 0 (never NaN). ``scale``: the constant divisor of ``seq_mean_token_sum_norm`` (the
    longest response a run allows, rollout.max_new_tokens); None: the mask's width T, as verl's
    default (which then varies from batch to batch).
    """
    try:
        fn = AGGREGATIONS[agg]
    except KeyError:
        raise ValueError(
            f"unknown loss aggregation {agg!r}; valid: {', '.join(AGGREGATIONS)}"
        ) from None
    if agg == "seq_mean_token_sum_norm":
        return fn(x, mask.to(x.dtype), float(scale if scale is not None else mask.shape[-1]))
    return fn(x, mask.to(x.dtype))


def agg_denominator(mask: Tensor, agg: str = "token_mean") -> float:
    """What ``aggregate`` divides by for this mask: the number of masked tokens for
    ``token_mean``, the number of non-empty sequences for the sequence modes.

    Used to weight micro-batches so that their scaled losses sum to the full-batch loss.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}; valid: {', '.join(AGGREGATIONS)}")
    if agg == "token_mean":
        return float(mask.sum())
    return float((_seq_token_counts(mask) > 0).sum())


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask_f: Tensor, ratio_level: str) -> Tensor:
    """(B, T) log pi_theta / pi_old of each token (`token`), or each token carrying its sequence's mean
    log-ratio with the gradient of lp_t / |y_i| (`sequence`, GSPO: see policy_loss); 0 on padding."""
    valid = mask_f > 0  # (B, T)
    zeros = torch.zeros_like(logprobs)
    # where(), not multiplication by the mask: padding may hold -inf / garbage logprobs.
    log_ratio = torch.where(valid, logprobs - old_logprobs.detach(), zeros)  # (B, T)
    if ratio_level == "sequence":
        seq_log_ratio = log_ratio.detach().sum(dim=-1) / mask_f.sum(dim=-1).clamp(min=1.0)  # (B,)
        lp = torch.where(valid, logprobs, zeros)  # (B, T)
        log_ratio = torch.where(valid, lp - lp.detach() + seq_log_ratio[:, None], zeros)  # (B, T)
    elif ratio_level != "token":
        raise ValueError(f"unknown ratio_level {ratio_level!r}; valid: token, sequence")
    return log_ratio


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    agg: str = "token_mean",
    is_weights: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    ratio_level: str = "token",
    scale: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with clip-higher (DAPO), optional IS weights and KL penalty.

    Args:
        logprobs: (B, T) log pi_theta(a_t|s_t) of the current policy; carries the gradient.
        old_logprobs: (B, T) log pi_old(a_t|s_t), trainer logprobs at rollout time (detached).
        advantages: (B,) one advantage per sequence, broadcast over its tokens.
        mask: (B, T) float or bool, 1 on response tokens.
        clip_low, clip_high: ratio clipped to [1 - clip_low, 1 + clip_high].
        agg: one of ``AGGREGATIONS``.
        is_weights: (B, T) rollout-correction weights, detached here; multiply the per-token
            policy-gradient loss (not the KL term).
        ref_logprobs: (B, T) log pi_ref; with ``kl_coef > 0`` adds ``kl_coef`` times the
            aggregated per-token ``kl_estimator`` of KL(pi_theta || pi_ref) (jetflow.rl.kl).
        ratio_level: ``token``: one importance ratio pi_theta / pi_old per token (PPO / GRPO).
            ``sequence`` (GSPO, arXiv 2507.18071; verl's ``gspo`` policy loss): one ratio per
            sequence, s_i = exp(mean over its tokens of (lp - old)), clipped per sequence; each
            token carries s_i's value with the gradient of s_i * lp_t / |y_i| (verl's
            ``lp - lp.detach() + mean log-ratio``), so ``seq_mean_token_mean`` gives grad s_i.
        scale: the constant of ``seq_mean_token_sum_norm`` (see ``aggregate``).

    Returns:
        (loss scalar with grad, metrics). Metrics: ``loss/policy`` (aggregated PG term, after IS
        weights), ``loss/clip_frac`` (share of tokens whose clipped branch is active, i.e. zero
        gradient), ``loss/ratio_mean``, and ``loss/kl`` when the KL term is used.
    """
    mask_f = mask.to(logprobs.dtype)  # (B, T)
    valid = mask_f > 0  # (B, T)
    zeros = torch.zeros_like(logprobs)

    ratio = torch.exp(_log_ratio(logprobs, old_logprobs, mask_f, ratio_level).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    adv = advantages.detach().to(logprobs.dtype)[:, None]  # (B, 1)

    pg_unclipped = -adv * ratio  # (B, T)
    pg_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    clipped = pg_clipped > pg_unclipped  # (B, T) the pessimistic branch is the clipped constant
    pg = torch.where(clipped, pg_clipped, pg_unclipped)  # (B, T)
    if is_weights is not None:
        pg = pg * is_weights.detach().to(pg.dtype)

    pg_loss = aggregate(pg, mask_f, agg, scale)
    loss = pg_loss
    metrics = {
        "loss/policy": pg_loss.item(),
        "loss/clip_frac": aggregate(clipped.to(mask_f.dtype), mask_f, "token_mean").item(),
        "loss/ratio_mean": aggregate(ratio.detach(), mask_f, "token_mean").item(),
    }

    if ref_logprobs is not None and kl_coef != 0.0:
        # where(), not a product with the mask: padding may hold -inf log-probs
        lp = torch.where(valid, logprobs, zeros)  # (B, T)
        ref = torch.where(valid, ref_logprobs.detach().to(lp.dtype), zeros)  # (B, T)
        kl = torch.where(valid, kl_estimate(lp, ref, kl_estimator), zeros)  # (B, T)
        kl_loss = aggregate(kl, mask_f, agg, scale)
        loss = loss + kl_coef * kl_loss
        metrics["loss/kl"] = kl_loss.item()

    return loss, metrics
