"""What the RL loop asks of the trainer side, declared once (the rollout side's is
jetflow.rollout.types.RolloutEngineSide).

`PolicyTrainer` is jetflow's `Trainer` in this process, or a group of trainer workers elsewhere (the Ray
placement's `TrainerGroup`); `KVCalibration` is the trainer's FP8 KV quantizer (precision.kv_cache_fp8):
jetflow.precision.kv.KVQuantizer, its model-parallel reduction, or the Ray workers' quantizers driven
together. The loop (jetflow.run.loop.RLLoop) depends on these two names only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

from jetflow.rl.experience import Experience

if TYPE_CHECKING:
    from jetflow.sync import WeightUpdate


class PolicyTrainer(Protocol):
    version: int
    """Optimizer steps applied: the weight version rollouts must have been sampled with."""

    def compute_logprobs(self, exp: Experience, temperature: float = 1.0, reference: bool = False,
                         policy: Any = None) -> Tensor: ...
    """log pi_old of the rollout tokens under the current weights, no grad: (B, R); with `reference`,
    log pi_ref under the frozen reference policy (algo.kl_coef > 0 or algo.log_ref_kl); with `policy`, under
    that copy of the policy (jetflow.run.staleness_split's, in the trainer's process)."""

    def train_step(self, exp: Experience, temperature: float = 1.0) -> dict[str, float]: ...
    """One optimizer step of the policy loss against exp.old_logprobs and exp.is_weights; its metrics."""

    def train_step_on_policy(self, exp: Experience, temperature: float, correction: str,
                             correction_params: Any = None) -> tuple[dict[str, float], Tensor]: ...
    """One optimizer step whose own forward gives pi_old (ppo_epochs = 1, a row-local correction):
    (metrics, old_logprobs (B, R))."""

    def weight_update(self, mode: str, fingerprint: str | None, kv_scales: dict | None = None) -> "WeightUpdate": ...
    """The payload for the rollout engines at the current weight version (jetflow.sync)."""

    def reference_bytes(self) -> int: ...
    """Bytes the reference policy holds (one process's: under model parallelism its shard)."""


class KVCalibration(Protocol):
    calibrated: bool
    """Scales were set at least once."""
    calibrating: bool
    """Observe K/V amax in the next trainer forwards."""

    def recalibrate(self, dp: Any = None) -> dict: ...
    """New per-layer scales from the amax observed (max-reduced over the data-parallel ranks `dp`)."""
