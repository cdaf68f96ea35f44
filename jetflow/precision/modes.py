"""The precision vocabulary, defined here once: the modes of a run (one enum, read by the config (its
choices), the builders (the GEMM kind of each side's linears), weight sync (what is shipped) and the
loop (its default correction)), the linear kinds and the numerics."""

from __future__ import annotations

from enum import Enum

LINEAR_KINDS = ("fp32", "bf16", "fp8")
"""The GEMM kind of a linear layer: fp32, bf16, or the run's recipe (`fp8` also under the mxfp8 and
nvfp4 recipe families: the recipe, not the kind, names the family). Every kind has an exact form."""

NUMERICS = ("fast", "exact")
"""fast: torch's / vLLM's kernels (SDPA, BLAS). exact: the batch-invariant kernels (jetflow.kernels.invariant),
so a token's row comes out bit for bit the same in a full forward, a prefill and a cached decode, whatever
else is in the batch and whichever side (native, Megatron, vLLM's plugin) computes it."""


class PrecisionMode(str, Enum):
    FP32 = "fp32"
    """the reference: fp32 train and rollout."""
    BF16 = "bf16"
    """bf16 train and rollout."""
    MIXED = "mixed"
    """bf16 train, FP8 rollout (the rollout side quantizes the synced bf16 weights itself)."""
    UNIFIED = "unified"
    """FP8 train forward/backward and FP8 rollout from the very same quantized bytes."""

    @property
    def trainer_kind(self) -> str:
        """The GEMM kind of the trainer's linears (LINEAR_KINDS)."""
        return {"fp32": "fp32", "bf16": "bf16", "mixed": "bf16", "unified": "fp8"}[self.value]

    @property
    def rollout_kind(self) -> str:
        """The GEMM kind of the rollout engine's linears."""
        return {"fp32": "fp32", "bf16": "bf16", "mixed": "fp8", "unified": "fp8"}[self.value]

    @property
    def quantizes(self) -> bool:
        """Some side computes in FP8: payloads carry the recipe's fingerprint."""
        return "fp8" in (self.trainer_kind, self.rollout_kind)

    @property
    def off_policy_by_design(self) -> bool:
        """The rollout computes with other weights than the trainer (mixed): a correction is due."""
        return self.trainer_kind != self.rollout_kind


PRECISION_MODES = tuple(m.value for m in PrecisionMode)
