"""The run's precision, resolved once: one immutable `Precision` that every side is handed.

The config's precision section names a mode, a recipe family and `numerics=auto|exact|fast`; what they
mean on this machine (which GEMM kind each side's linears run, whether `auto` is exact here, which
fingerprint payloads carry) is worked out here, once, by `Precision.resolve` (called by
jetflow.config.derive), and the questions are asked of the object rather than of strings: the native
build, the Megatron and FSDP policies, the rollout engines and the vLLM side read the same answers.

A linear's own state (its kind, its numerics) stays a string of the vocabulary (jetflow.precision.modes):
it is what that module runs, not what the run asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jetflow.kernels.support import exact_kernels_missing, unsplit_row_parallel_k
from jetflow.precision.kv import KVQuantizer
from jetflow.precision.modes import NUMERICS, PrecisionMode
from jetflow.precision.recipe import QuantRecipe

Side = Literal["trainer", "rollout"]


@dataclass(frozen=True)
class Precision:
    """What a run computes in, resolved (`resolve`): handed to each side, never recomputed."""

    mode: PrecisionMode
    recipe: QuantRecipe
    """The run's recipe (its family: fp8_block, mxfp8 or nvfp4), whichever side quantizes with it."""
    numerics: str = "fast"
    """NUMERICS, `auto` resolved: exact wherever the batch-invariant kernels run (see `resolve`)."""
    gemm_backend: str = "auto"
    """The FP8 GEMM backend the linears ask for (jetflow.precision.gemm)."""
    kv_cache_fp8: bool = False
    """FP8 (E4M3) K/V in the rollout engine (and the trainer's calibration of its scales)."""
    exact_blocker: str | None = None
    """Why exact numerics cannot run here, or None."""

    def __post_init__(self) -> None:
        if self.numerics not in NUMERICS:
            raise ValueError(f"Precision numerics={self.numerics!r}: valid values are {NUMERICS}")

    @classmethod
    def resolve(cls, mode: PrecisionMode | str, recipe: QuantRecipe, numerics: str = "auto", gemm_backend: str = "auto",
                kv_cache_fp8: bool = False, device: str = "cpu", row_parallel_ks: tuple[int, ...] = (),
                tensor_parallel_size: int = 1) -> "Precision":
        """The precision of a run on `device`. `numerics="auto"` is exact where the exact kernels run and
        fast elsewhere, and fast on CUDA (there exact is asked for by name: the Triton kernels are
        unmeasured on a GPU yet). `row_parallel_ks`: the Ks a Megatron trainer splits over
        `tensor_parallel_size` ranks (known before the model loads: the tiny model's)."""
        blocker = exact_blocker(device, row_parallel_ks, tensor_parallel_size)
        if numerics == "auto":
            numerics = "fast" if blocker or device.startswith("cuda") else "exact"
        return cls(PrecisionMode(mode), recipe, numerics, gemm_backend, kv_cache_fp8, blocker)

    # The questions each side asks ------------------------------------------------------------------
    @property
    def trainer_kind(self) -> str:
        """The GEMM kind (LINEAR_KINDS) of the trainer's linears."""
        return self.mode.trainer_kind

    @property
    def rollout_kind(self) -> str:
        """The GEMM kind of the rollout engine's linears."""
        return self.mode.rollout_kind

    def linear_kind(self, side: Side) -> str:
        """The GEMM kind of `side`'s linears."""
        return self.trainer_kind if side == "trainer" else self.rollout_kind

    @property
    def trainer_quantizes(self) -> bool:
        """The trainer computes with the recipe's quantized bytes (unified)."""
        return self.trainer_kind == "fp8"

    @property
    def rollout_quantizes(self) -> bool:
        """The rollout engine computes with the recipe's quantized bytes (mixed, unified)."""
        return self.rollout_kind == "fp8"

    @property
    def quantizes(self) -> bool:
        """Some side quantizes: weight payloads carry the recipe's fingerprint."""
        return self.mode.quantizes

    @property
    def off_policy_by_design(self) -> bool:
        """The rollout computes with other weights than the trainer (mixed): a correction is due."""
        return self.mode.off_policy_by_design

    @property
    def is_exact(self) -> bool:
        """Every side computes each token with the batch-invariant kernels (bit-for-bit on-policy)."""
        return self.numerics == "exact"

    @property
    def fingerprint(self) -> str | None:
        """The recipe fingerprint weight payloads carry (modes that quantize), else None."""
        return self.recipe.fingerprint() if self.quantizes else None

    @property
    def shipped_recipe(self) -> QuantRecipe | None:
        """The recipe a rollout engine is handed (modes that quantize), else None."""
        return self.recipe if self.quantizes else None

    def quantizes_kv(self, side: Side) -> bool:
        """Under kv_cache_fp8 the rollout always quantizes its K/V; the trainer too under unified (otherwise it
        only observes K/V amax to calibrate the rollout's scales)."""
        return side == "rollout" or self.trainer_quantizes

    def kv_quantizer(self, side: Side, num_layers: int) -> KVQuantizer | None:
        """Under kv_cache_fp8, `side`'s FP8 K/V quantizer (applied, or only observing amax: quantizes_kv);
        otherwise None (K/V stay as the mode rounds them)."""
        if not self.kv_cache_fp8:
            return None
        return KVQuantizer(num_layers, margin=self.recipe.margin, apply=self.quantizes_kv(side))


def exact_blocker(device: str, row_parallel_ks: tuple[int, ...] = (), tensor_parallel_size: int = 1) -> str | None:
    """Why exact numerics cannot run on `device` with a Megatron trainer splitting `row_parallel_ks` over
    `tensor_parallel_size` ranks, or None (what `auto` resolves by; asking for `exact` anyway is refused by
    jetflow.run.validate). A checkpoint's Ks are checked when the Megatron policy is built."""
    if why := exact_kernels_missing(device):
        return why
    if k := unsplit_row_parallel_k(row_parallel_ks, tensor_parallel_size):
        return (f"train.backend=megatron with train.tensor_parallel_size={tensor_parallel_size} cannot split "
                f"a row-parallel K of {k} into whole canonical 128-block groups (jetflow.kernels.canonical)")
    return None
