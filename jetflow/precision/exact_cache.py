"""What an exact linear keeps between calls (its caller holds one `ExactCache` per layer).

The exact forward's weight operand is packed into the canonical GEMM's panels once per weight version
(fp32 / bf16 panels live here, FP8 panels on the QuantizedTensor: `QuantizedTensor.panels`), and the
product's kernel call is prepared once for those panels (`prepared`: the weight's checks once per
version, not once per call, which a decode step's small GEMMs would pay four times a layer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class SiblingPanels:
    """What `exact_linears` keeps between calls for one group of sibling linears (q / k / v, gate / up):
    their panels side by side, rebuilt when any linear's own panels change."""
    parts: list[Tensor] = field(default_factory=list)  # each linear's panels: views into `packed`
    packed: Tensor | None = None  # (sum P_i, K or K/2, NR) the siblings' panels side by side
    scales: Tensor | None = None  # FP8: (sum P_i * NR, K / 128) each weight row's block scale
    call: Callable | None = None  # the prepared product for `packed`


@dataclass
class ExactCache:
    """What `exact_linear` keeps for one weight between calls."""
    key: tuple | None = None  # (kind, data_ptr, version, dtype, device, shape) of the weight `packed` was made from
    packed: Tensor | None = None  # the canonical GEMM's panels of the weight as the kind reads it (fp32 / bf16)
    call: Callable | None = None  # the product's prepared call ...
    call_operands: tuple = ()  # ... for these (panels, weight scales, groups)
    siblings: SiblingPanels = field(default_factory=SiblingPanels)  # exact_linears, when this layer leads a group

    def prepared(self, operands: tuple, prepare: Callable[[], Callable]) -> Callable:
        """The call `prepare()` made for `operands` (panels, scales, groups: tensors compared by identity),
        made again when any of them changed."""
        held, call = self.call_operands, self.call
        same = len(held) == len(operands) and all(
            a is b if isinstance(a, Tensor) or a is None else a == b for a, b in zip(held, operands))
        if call is None or not same:
            call = self.call = prepare()
            self.call_operands = operands
        return call

    def clear(self) -> None:
        """Forget everything (the weight changed in a way its version counter does not show)."""
        self.key = self.packed = self.call = None
        self.call_operands, self.siblings = (), SiblingPanels()
