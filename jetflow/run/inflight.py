"""In-flight weight updates (rollout.inflight_updates, issue 72): a batch generated ahead takes the next weight update
half way, as PipelineRL's and NeMo-RL's engines do, instead of being generated entirely under one version.

The swap point is fixed by the schedule, not by the clock: the batch of step s + k (submitted after step s's sync,
jetflow.run.ahead) is generated under the weights of step s for its first `swap_step` decode steps
(rollout.inflight_swap_step, by default ceil(max_new_tokens / 2)); the engine then pauses it (its pages held) and
finishes it under the next update the trainer sends, step s + 1's (jetflow.run.engine_process.ProcessRollout). Where
PipelineRL swaps when the update happens to arrive, this rule makes the same run produce the same tokens at any speed,
so that a run stays a function of its seed and a resume reproduces it bit for bit. A checkpoint between steps s and s +
1 hands the paused batch its update first (RLLoop.sync_paused: the bytes step s + 1's sync sends), so the batch it keeps
is the one the run trains on, stopped there or not. A batch that gets no update before it is taken or another is
submitted (a skipped step leaves the version unchanged) finishes under its version: also fixed by the config. At step 0
only the batch of step k is started so (those of steps 1..k - 1 are generated whole under step 0's weights, as without
the option).

Each token carries the version that sampled it (Rollouts.token_versions): a request running at the swap has tokens of
versions s and s + 1 (k and k - 1 versions old when trained at step s + k); one admitted after it has only s + 1's.
`reprefill` recomputes every running request's prefix under the new weights at the swap, so every token's behaviour
log-prob is its version's policy given its prefix, exactly; `keep_kv` keeps the pages computed under the old weights
(the post-swap tokens then come from no single version's policy; the gap is measured in results/async).

The decoupled-PPO update needs nothing more: it takes the behaviour log-prob per token (Experience.rollout_logprobs),
whichever version made it, and weights each token by pi_proximal / pi_behaviour.
"""

from __future__ import annotations

import torch

from jetflow.config import Config
from jetflow.rl import mismatch_metrics
from jetflow.rollout.types import Rollouts


def swap_step(cfg: Config) -> int | None:
    """The decode step of a batch generated ahead at which it takes the next weight update; None: off."""
    r = cfg.rollout
    if r.inflight_updates == "off":
        return None
    return r.inflight_swap_step or -(-r.max_new_tokens // 2)


def token_versions(out: Rollouts) -> torch.Tensor:
    """The version that sampled each generated token of the batch, flat (N,): Rollouts.token_versions, or the batch's
    weight_version on every token where the engine does not tag them."""
    if out.token_versions is None:
        return torch.full((sum(len(t) for t in out.token_ids),), out.weight_version, dtype=torch.long)
    return torch.tensor([v for vs in out.token_versions for v in vs], dtype=torch.long)


def staleness_metrics(trainer_version: int, out: Rollouts, inflight: bool) -> dict[str, float]:
    """Per token: how many versions older than the trainer's each sampled token is (mean, max, share > 0); with
    in-flight updates, the share of tokens sampled after the batch's swap. (Without them every token of a batch has
    its version: the per-batch values of before, exactly.)"""
    versions = token_versions(out)  # (N,)
    staleness = (trainer_version - versions).double()  # (N,)
    metrics = {"async/staleness_mean": float(staleness.mean()), "async/staleness_max": float(staleness.max()),
               "async/stale_frac": float((staleness > 0).double().mean())}
    if inflight:
        metrics["async/swapped_frac"] = float((versions > out.weight_version).double().mean())
    return metrics


def version_grid(out: Rollouts, width: int) -> torch.Tensor:
    """Rollouts.token_versions laid out as jetflow.rl.experience.pack_experience lays out the responses (left-aligned,
    (B, width)), -1 past each response."""
    grid = torch.full((len(out.token_ids), width), -1, dtype=torch.long)  # (B, width)
    for i, vs in enumerate(out.token_versions or []):
        grid[i, :len(vs)] = torch.tensor(vs, dtype=torch.long)
    return grid


def swap_gap_metrics(out: Rollouts, behaviour: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor,
                     trainer_version: int) -> dict[str, float]:
    """How far the tokens sampled after the swap are from the policy of their version: over those sampled under the
    trainer's current weights (k = 1: every post-swap token), the behaviour log-probs (B, T) against the trainer's
    (B, T) under those weights, given the same prefix. 0 under `reprefill` and exact numerics; under `keep_kv` the
    gap that the pages kept from the older weights make. Nothing when no such token (k > 1)."""
    versions = version_grid(out, behaviour.shape[1]).to(mask.device)  # (B, T)
    swapped = (mask > 0) & (versions == trainer_version) & (versions > out.weight_version)  # (B, T)
    if not bool(swapped.any()):
        return {}
    gap = mismatch_metrics(behaviour, trainer, swapped, num_position_bins=1)
    return {"async/swapped_kl_k3": gap["mismatch/kl_k3"], "async/swapped_abs_dlogp_max": gap["mismatch/abs_delta_max"]}
