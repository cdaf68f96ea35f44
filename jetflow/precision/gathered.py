"""The unsharded weight of an FP8 linear when a sharded trainer all-gathers its FP8 bytes instead of its
fp32 values (train.backend=fsdp under `unified`: jetflow.train.fsdp.gather makes it). It lives here, beside
the linear that reads it, so that PrecisionLinear recognizes it by type."""

from __future__ import annotations

import torch

from jetflow.precision.quant import QuantizedTensor

aten = torch.ops.aten


class GatheredFP8Weight(torch.Tensor):
    """The fp32 weight's shape and dtype holding the gathered FP8 bytes and scales (`gathered_fp8`). Only a
    PrecisionLinear reads it, through `gathered_fp8`; any other op on its values is an error (there are no
    fp32 values here to compute with)."""

    @staticmethod
    def __new__(cls, wq: QuantizedTensor, dtype: torch.dtype, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(cls, wq.shape, dtype=dtype, device=wq.data.device,
                                                   requires_grad=requires_grad)

    def __init__(self, wq: QuantizedTensor, dtype: torch.dtype, requires_grad: bool = False):
        self.gathered_fp8: QuantizedTensor = wq

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # torch's own off switch

    def __repr__(self) -> str:  # type: ignore[override]  # without Tensor.__repr__'s tensor_contents
        return f"GatheredFP8Weight({tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        src = args[0]
        same = func in (aten.detach.default, aten.alias.default) or (
            func in (aten.as_strided.default, aten.view.default) and tuple(args[1]) == tuple(src.shape))
        if same:  # FSDP's as_strided to the weight's shape, nn.Parameter's detach
            return GatheredFP8Weight(src.gathered_fp8, src.dtype, False)
        raise NotImplementedError(f"{func} on an FP8-gathered weight (train.backend=fsdp, precision.mode=unified): "
                                  "only its FP8 bytes were all-gathered; read them through `gathered_fp8`")
