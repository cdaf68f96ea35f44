"""What the trainer, weight sync and checkpoints ask of a policy model, declared once.

`TrainablePolicy` is every trainer model: jetflow's `Decoder`, or a model that holds a Decoder's
weights in another layout (the Megatron backend's `MegatronPolicy`, the FSDP backend's `FSDPPolicy`). Every
one answers the Trainer's questions itself (gradient reduction and norm, collective forwards, the router
loss), a sharded one over its shards. `ShardedPolicy` is the second kind: its weights are not its
`state_dict` (other names, tensor-parallel shards), so it gives them HF-named and gathered, and owns the
operations that span its shards (the optimizer state of each part, the FP8 K/V quantizer's reduction).
Code asks `isinstance(model, ShardedPolicy)` instead of probing for methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from jetflow.model.model_config import ModelConfig
    from jetflow.precision import QuantRecipe, QuantizedTensor


@runtime_checkable
class TrainablePolicy(Protocol):
    config: "ModelConfig"

    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       **kwargs: Any) -> torch.Tensor: ...
    """(B, T) token ids -> (B, T, H) final hidden states (after the last norm)."""

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor: ...
    """(B, T, H) -> (B, T, V) logits."""

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    def num_params(self) -> int: ...

    # The Trainer's questions (jetflow.train.trainer), each policy's own answer.
    @property
    def collective_forward(self) -> bool: ...
    """A forward is a collective of ranks holding different data (expert parallelism, FSDP's all-gathers):
    every rank must run every micro-batch, one without response tokens included."""

    def load_balancing_loss(self) -> torch.Tensor | None: ...
    """The router load-balancing loss of the last forward (None for a dense model)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor: ...
    """Clip by the global gradient norm over all shards; returns that norm."""

    def reduce_data_parallel_grads(self, dp: Any) -> None: ...
    """Sum the gradients over the data-parallel ranks `dp` (jetflow.distributed.DataParallel), each
    parameter over the group that holds it (an expert's: its expert-data-parallel group)."""


@runtime_checkable
class ShardedPolicy(TrainablePolicy, Protocol):
    tp_size: int
    tp_rank: int

    kind: str
    """The GEMM kind its linears run (jetflow.precision.modes.LINEAR_KINDS)."""
    recipe: "QuantRecipe | None"
    """The recipe its fp8 linears run (None when none is given): `quantized_weights` are its bytes."""

    def hf_state_dict(self) -> dict[str, torch.Tensor]: ...
    """HF-named full weights (a collective under tensor parallelism: every rank calls it)."""

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None: ...

    def quantized_weights(self) -> dict[str, "QuantizedTensor"]: ...
    """The FP8 bytes its linears compute with, per HF module name (gathered)."""

    mp_size: int
    """Ranks that hold one copy of the model between them (tensor x pipeline parallel)."""
    state_size: int
    """Ranks whose trainer state differs (model parts, expert-parallel ranks): a checkpoint holds one
    optimizer state per rank of `state_group`."""
    state_rank: int
    state_group: Any

    def attach_kv_quantizer(self, quantizer: Any) -> Any: ...
    """Apply the FP8 K/V quantizer in its own attention; returns the quantizer the run drives."""


def hf_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A policy's HF-named weights: a sharded policy's gathered ones, else its state_dict."""
    return model.hf_state_dict() if isinstance(model, ShardedPolicy) else model.state_dict()


@runtime_checkable
class ShardedAdapters(Protocol):
    """A policy whose LoRA adapters are sharded (the Megatron trainer's TP split): it gives them whole."""

    def adapter_state_dict(self) -> dict[str, torch.Tensor]: ...
    """Its LoRA adapters whole, in the native names ({} without LoRA; a collective under TP)."""

    def load_adapter_state_dict(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def lora_names(self) -> list[str]: ...
    """The HF names of its adapted linears."""

    def lora_base_digest(self) -> str: ...
    """The sha256 of the native frozen base it was made from (jetflow.precision.lora.base_digest)."""


def adapter_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A policy's LoRA adapters in the native names (`<linear>.lora.A`): a sharded policy's gathered whole (a
    collective under tensor parallelism), else its adapter parameters ({} without LoRA)."""
    if isinstance(model, ShardedAdapters):
        return model.adapter_state_dict()
    from jetflow.precision.lora import adapter_parameters
    return dict(adapter_parameters(model))


def lora_base_digest(model: torch.nn.Module) -> str:
    """The sha256 of a LoRA policy's frozen base as the native trainer holds it (jetflow.precision.lora.base_digest):
    a sharded policy's is the Decoder's it was made from, so a checkpoint's digest does not depend on the layout."""
    if isinstance(model, ShardedAdapters):
        return model.lora_base_digest()
    from jetflow.precision.lora import base_digest
    return base_digest(model)


def lora_names(model: torch.nn.Module, targets: list[str] | tuple[str, ...]) -> list[str]:
    """The names of a LoRA policy's adapted linears (model.lora.targets matched on its own linears)."""
    if isinstance(model, ShardedAdapters):
        return model.lora_names()
    from jetflow.precision.lora import lora_targets
    return list(lora_targets(model, targets))


def tensor_parallel_size(model: torch.nn.Module) -> int:
    return model.tp_size if isinstance(model, ShardedPolicy) else 1


def model_parallel_size(model: torch.nn.Module) -> int:
    """Ranks that hold one model between them: TP x PP for a sharded policy, else 1."""
    return model.mp_size if isinstance(model, ShardedPolicy) else 1


def state_parts(model: torch.nn.Module) -> int:
    """Ranks with different trainer state: a sharded policy's `state_size`, else 1."""
    return model.state_size if isinstance(model, ShardedPolicy) else 1
