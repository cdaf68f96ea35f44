"""oneDNN-prepacked weights for the CPU rollout's fp32 GEMMs.

A decode step multiplies a few rows (the batch) by every weight matrix. `F.linear` (MKL) repacks
each weight into its blocked GEMM layout on every call, which at M = 16 costs about as much as the
products themselves. oneDNN can pack a weight once (`_reorder_linear_weight`) and multiply many
times (`_linear_pointwise`): the same products with fp32 accumulation, in another summation order
(results agree to ~1e-6 relative). Measured on SmolLM2-135M, batch 16, 2 cores: results/bench.

The packed copies cost one more fp32 copy of every packed weight, and are repacked whenever a
weight changes (tensor, in-place version counter, or the engine's weight_version), i.e. once per
weight update. Only plain fp32 linears are packed: bf16 / FP8 recipe linears run as the modules
they are, so the rollout policy stays the model's own.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from jetflow.precision.linear import PrecisionLinear


def packable(module: nn.Module) -> bool:
    """A plain fp32 linear on the CPU (nn.Linear, or a PrecisionLinear of kind fp32 under fast numerics:
    under exact numerics the linear runs its own batch-invariant GEMM, which oneDNN's is not)."""
    return (isinstance(module, nn.Linear) and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32
            and (type(module) is nn.Linear
                 or (isinstance(module, PrecisionLinear) and module.kind == "fp32" and module.numerics == "fast")))


class PackedLinears:
    """Packed copies of a model's fp32 linears, swapped in for the duration of `applied()`."""

    def __init__(self, model: nn.Module, batch: int):
        self.model, self.batch = model, batch
        self._packed: dict[nn.Module, tuple[tuple, torch.Tensor]] = {}  # module -> (weight key, packed)

    @staticmethod
    def available() -> bool:
        return torch.backends.mkldnn.is_available()

    def packed_bytes(self) -> int:
        return sum(m.weight.numel() * 4 for m in self._packed)

    def _weight(self, module: nn.Linear, weight_version: int) -> torch.Tensor:
        w = module.weight
        key = (w.data_ptr(), w._version, weight_version)
        cached = self._packed.get(module)
        if cached is None or cached[0] != key:
            cached = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), self.batch))
            self._packed[module] = cached
        return cached[1]

    def _linear(self, module: nn.Linear, weight_version: int, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._weight(module, weight_version), module.bias, "none", [], "")

    @contextmanager
    def applied(self, weight_version: int):
        """Within the block, every packable linear of the model computes on its packed weight."""
        modules = [m for m in self.model.modules() if packable(m)]
        current = set(modules)
        self._packed = {m: v for m, v in self._packed.items() if m in current}  # drop replaced modules
        for m in modules:
            m.forward = lambda x, m=m: self._linear(m, weight_version, x)  # an instance attribute shadows the class's
        try:
            yield
        finally:
            for m in modules:
                m.__dict__.pop("forward", None)
