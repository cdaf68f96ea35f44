"""A stale batch's mismatch split into numerics and staleness (rollout.split_mismatch under rollout.max_staleness > 0,
issue 72; the math: jetflow.rl.mismatch.split_mismatch).

`mismatch/*` compares the behaviour log-probs (the engine's, under the version that sampled) with the trainer's under
its current weights: numerics and staleness together. Splitting them needs a third set, the trainer's log-probs under
the version that sampled, whose weights the trainer no longer has. So each weight update the trainer sends is kept
(a copy: the trainer trains on) while a batch of its version may still come (the newest k + 1 versions), and a stale
batch is scored by a copy of the trainer's model (built as the reference policy is, once) with that update loaded:
the trainer's own forward under the sampling version's exact values (FP8 bytes and scales, bf16 matrices, vectors).
A batch of the current version needs nothing: its proximal log-probs are the sampling version's.

Not split (no keys logged): a batch sampled before a resume (its version's weights went with the process that sent
them). Runs whose updates do not carry the whole model (LoRA's adapters alone) or carry FP8 K/V scales are refused
with the split in one line before the model loads (jetflow.run.feature_checks.check_staleness).
"""

from __future__ import annotations

from typing import Any

import torch

from jetflow.config import Config, Derived
from jetflow.rl import split_mismatch
from jetflow.rl.experience import Experience
from jetflow.run.build import copy_model
from jetflow.run.megatron_side import build_trainer_model
from jetflow.sync import WeightUpdate, apply_update
from jetflow.train.protocol import PolicyTrainer


def _copy(q: Any) -> Any:
    """A quantized tensor's copy, its raw parts cloned and no cache (each family pickles as its parts)."""
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in q.__getstate__().items()}
    out = object.__new__(type(q))
    out.__setstate__(state)
    return out


def snapshot(update: WeightUpdate) -> WeightUpdate:
    """The update with every tensor copied: what the trainer's version was, whatever it does to its weights next."""
    return WeightUpdate(update.version, update.mode, update.fingerprint,
                        {k: _copy(q) for k, q in update.quantized.items()},
                        {k: v.detach().clone() for k, v in update.tensors.items()},
                        adapters={k: v.detach().clone() for k, v in update.adapters.items()}, base=update.base)


class MismatchSplit:
    def __init__(self, cfg: Config, derived: Derived, trainer: PolicyTrainer):
        self.cfg, self.derived, self.trainer, self.k = cfg, derived, trainer, cfg.rollout.max_staleness
        self.kept: dict[int, WeightUpdate] = {}  # version -> the update sent for it
        self._policy: torch.nn.Module | None = None  # the copy of the trainer's model that scores stale batches
        self._loaded = -1  # the version the copy holds

    def keep(self, update: WeightUpdate) -> None:
        """After a weight update was built for the engine: keep a copy while batches of its version may come."""
        if not update.base or update.kv_scales is not None:
            self.kept.clear()  # not split (module docstring)
            return
        self.kept[update.version] = snapshot(update)
        for version in [v for v in self.kept if v < update.version - self.k]:
            del self.kept[version]

    def metrics(self, exp: Experience, sampled_under: int, current: int) -> dict[str, float]:
        """The split of the step's batch, sampled under version `sampled_under` and scored (exp.old_logprobs) under
        `current`; {} when its version's weights are not kept."""
        assert exp.old_logprobs is not None
        if sampled_under == current:
            sampling = exp.old_logprobs
        elif sampled_under in self.kept:
            sampling = self.trainer.compute_logprobs(exp, self.cfg.rollout.temperature, policy=self._at(sampled_under))
        else:
            return {}
        return split_mismatch(exp.rollout_logprobs, sampling, exp.old_logprobs, exp.response_mask)

    def _at(self, version: int) -> torch.nn.Module:
        """The trainer's model under `version`'s weights."""
        if self._policy is None:
            source = self.trainer.model  # type: ignore[attr-defined]  # the native trainer's (the only one async runs)
            cuda = [torch.cuda.current_device()] if torch.device(self.cfg.model.device).type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):  # the copy's init draws: the run's RNG goes on as without it
                self._policy = build_trainer_model(self.cfg, self.derived, copy_model(source))[0]
            self._policy.requires_grad_(False)
        if self._loaded != version:
            update = self.kept[version]
            apply_update(self._policy, update, -1, update.fingerprint)  # any version: checked when it was sent
            self._loaded = version
        return self._policy
