"""The reference policy of a KL penalty (algo.kl_coef > 0, or algo.log_ref_kl): the policy's weights at
the start of RL, frozen, computing under the trainer's precision.

`freeze_reference` takes a copy of the trainer's model already under the trainer's precision mode
(jetflow.run.sides builds it). Under an FP8 trainer kind (precision.mode=unified) each FP8 linear's
weight is quantized once by the recipe, exactly as the trainer's linear quantizes its own weight
(PrecisionLinear.quantized_weight), and handed to the layer as fixed bytes (`load_quantized`, the
rollout side's path); the layer's high-precision weight is then replaced by a zero-stride placeholder of
its shape (one element of storage): an FP8 forward without autograd reads only the bytes
(jetflow.precision.exact, fp8_function). Embeddings, norms and any linear the recipe keeps in high
precision stay in the master dtype.

On the Megatron backend the reference is a second MegatronPolicy of the same TP / PP / EP layout (each
rank keeps its own shard of it, jetflow.run.megatron_side builds it); its parallel linears keep their FP8
segments' bytes the same way (`freeze_quantized`, jetflow.train.megatron.linear). On the FSDP backend it
is a second FSDPPolicy of the policy's sharding: each rank keeps its shards, and under unified its FP8
weights' rows as bytes quantized once (with the whole weights' scales) in place of their fp32 rows, which
the all-gather sends as it sends the policy's (`freeze_as_reference`, jetflow.train.fsdp.policy).

The reference does not quantize K/V (precision.kv_cache_fp8 applies to the policy and its rollout).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn

from jetflow.precision.linear import PrecisionLinear


@runtime_checkable
class FreezableLinear(Protocol):
    """A linear that is no PrecisionLinear but keeps fixed FP8 bytes when asked (the Megatron backend's
    parallel linears)."""

    def freeze_quantized(self) -> None: ...

    def held_tensors(self) -> list[torch.Tensor]: ...


@runtime_checkable
class FreezablePolicy(Protocol):
    """A sharded policy that freezes itself as a reference (the FSDP backend's: each rank its shards)."""

    def freeze_as_reference(self) -> None: ...

    def held_tensors(self) -> list[torch.Tensor]: ...


def freeze_reference(model: nn.Module) -> nn.Module:
    """Freeze `model` in place as a reference policy (see the module docstring); returns it."""
    if isinstance(model, FreezablePolicy):
        model.freeze_as_reference()
        return model
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.modules():
        if isinstance(layer, PrecisionLinear) and layer.kind == "fp8":
            layer.keep_bytes_only()  # the recipe's bytes of the initial weight, quantized once
        elif isinstance(layer, FreezableLinear):
            layer.freeze_quantized()
    return model


def reference_nbytes(model: nn.Module) -> int:
    """Bytes the reference holds: its parameters and buffers (each storage once: tied weights and the
    placeholders' single elements), the FP8 bytes and scales, and any GEMM panels cached on them."""
    storages: dict[int, int] = {}

    def add(t: torch.Tensor | None) -> None:
        if t is not None:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()

    if isinstance(model, FreezablePolicy):
        for t in model.held_tensors():
            add(t)
        return sum(storages.values())
    for t in list(model.parameters()) + list(model.buffers()):
        add(t)
    for layer in model.modules():
        if isinstance(layer, (PrecisionLinear, FreezableLinear)):
            add(layer.weight)
            for t in layer.held_tensors():
                add(t)
    return sum(storages.values())
