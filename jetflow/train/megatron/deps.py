"""Megatron-Core as a lazy dependency: the install hint, the config error, and Megatron on the CPU.

Megatron-Core is imported lazily, only inside this package (`pip install megatron-core==0.16.1`);
`_require_megatron` is the one gate that turns a missing install into an ImportError with the hint.
On the CPU two of its calls assume CUDA; `patch_megatron_for_cpu()` replaces them (see its docstring).
"""

from __future__ import annotations

import contextlib
import math

import torch

from jetflow.errors import MissingDependencyError
from jetflow.model.decoder import UnsupportedModelError

INSTALL_HINT = "pip install megatron-core==0.16.1"


class MegatronConfigError(UnsupportedModelError):
    """The model or parallel layout cannot be expressed on the Megatron backend."""


def _require_megatron():
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(f"train.backend=megatron needs Megatron-Core: {INSTALL_HINT} ({e})") from None


def patch_megatron_for_cpu() -> None:
    """Replace Megatron-Core's two CUDA-only calls on the forward path by CPU equivalents (process-wide).

    1. `GlobalMemoryBuffer.get_tensor` allocates its scratch buffer (the `baddbmm` input of
       DotProductAttention) on `torch.cuda.current_device()`: here it allocates on the CPU.
    2. `CudaRNGStatesTracker.fork` swaps the CUDA RNG state around attention dropout: here it swaps the
       CPU generator's state with the tracker's named state (registered by `_seed_cpu_rng_tracker`).
    Only applied when a policy is built for the CPU; idempotent. Megatron-Core 0.16.1.
    """
    from megatron.core import utils as mcore_utils
    from megatron.core.tensor_parallel import random as mcore_random

    if getattr(mcore_utils.GlobalMemoryBuffer.get_tensor, "_jetflow_cpu", False):
        return

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        required = math.prod(tensor_shape)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < required:
            buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
        return buf[:required].view(*tensor_shape)

    @contextlib.contextmanager
    def fork(self, name=mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise RuntimeError(f"CPU rng state {name!r} was not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

    get_tensor._jetflow_cpu = True
    mcore_utils.GlobalMemoryBuffer.get_tensor = get_tensor
    mcore_random.CudaRNGStatesTracker.fork = fork


def _seed_cpu_rng_tracker(seed: int) -> None:
    """The CPU counterpart of `model_parallel_cuda_manual_seed`: one named CPU state per TP rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mcore_random

    tracker = mcore_random.get_cuda_rng_tracker()
    name = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME
    if name not in tracker.states_:
        gen = torch.Generator().manual_seed(seed + 2718 + ps.get_tensor_model_parallel_rank())
        tracker.states_[name] = gen.get_state()
