"""Activation checkpointing per decoder layer (train.activation_checkpointing): the forward keeps each
layer's input only, and the backward recomputes the layer (torch.utils.checkpoint, use_reentrant=False).

    enable_activation_checkpointing(model)     # a Decoder: its `layer_call` hook

Why the gradients stay the same bits: under exact numerics the recomputed forward runs the same kernels on
the same inputs and weights (FP8 quantization included: the weights' bytes are cached per weight version,
activations requantized by the same function), so it equals the first forward bit for bit
(tests/unit/test_activation_checkpointing.py).

Side effects of a layer's forward that the recomputation would repeat:
- the MoE blocks' records (`last_router_logits`, `last_topk_ids`, `last_replay_flips`, `last_replayed`:
  the load-balancing loss and the replay metrics read them after the forward): every `last_*` attribute
  of the layer's modules is put back after a recomputation, so they keep the first forward's values
  (and the recomputation's graph is not kept alive by them);
- the FP8 KV quantizer's amax calibration: a running max of the same values, unchanged by a repeat;
- non-finite checks: a NaN that raises, raises in the first forward (no backward follows);
- the decoder's `last_token_mask` is set outside the layers, once per forward.
"""

from __future__ import annotations

import functools

import torch.nn as nn
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from jetflow.host_memory import release_freed_memory
from jetflow.model import Decoder


def _records(layer: nn.Module) -> list[tuple[nn.Module, str, object]]:
    """(module, name, value) of every `last_*` attribute of the layer's modules."""
    return [(m, k, v) for m in layer.modules() for k, v in vars(m).items() if k.startswith("last_")]


def checkpointed_layer_call(layer: nn.Module, *args, release_host_memory: bool = True):
    """layer(*args) under non-reentrant checkpointing; a recomputation leaves the layer's records as the
    first forward set them. With `release_host_memory`, the heap's freed pages go back to the OS after the
    layer's forward and after its backward (jetflow.host_memory: the layer's working set is freed then)."""
    first = [True]

    def run(*a):
        if first[0]:
            first[0] = False
            return layer(*a)
        kept = _records(layer)
        try:
            return layer(*a)
        finally:
            for module, name, value in kept:
                setattr(module, name, value)

    hidden = args[0]  # (B, T, C): its gradient is complete once the layer's backward has run
    if release_host_memory and hidden.requires_grad:
        hidden.register_hook(_release_after_backward)
    out = checkpoint(run, *args, use_reentrant=False)
    if release_host_memory:
        release_freed_memory()
    return out


def _release_after_backward(grad: Tensor) -> Tensor:
    release_freed_memory()
    return grad


def enable_activation_checkpointing(model: nn.Module, release_host_memory: bool = True) -> None:
    """Checkpoint each decoder layer of `model` (a Decoder, whose forward calls its layers through
    `layer_call`) in forwards with grad enabled and no KV cache (train.release_host_memory: see
    `checkpointed_layer_call`)."""
    if not isinstance(model, Decoder):
        raise ValueError(f"train.activation_checkpointing: {type(model).__name__} has no per-layer hook "
                         "(the native Decoder has); use train.backend=native")
    model.layer_call = functools.partial(checkpointed_layer_call, release_host_memory=release_host_memory)
