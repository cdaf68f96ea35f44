"""What the trainer, weight sync and checkpoints ask of a policy model, declared once.

`TrainablePolicy` is every trainer model: jetflow's `Decoder`, or a model that holds a Decoder's
weights in another layout (the Megatron backend's `MegatronPolicy`). `ShardedPolicy` is the second
kind: its weights are not its `state_dict` (other names, tensor-parallel shards), so it gives them
HF-named and gathered, and owns the operations that span its shards. Code that needs the weights asks
`isinstance(model, ShardedPolicy)` instead of probing for methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from jetflow.model.model_config import ModelConfig
    from jetflow.precision import QuantizedTensor


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


@runtime_checkable
class ShardedPolicy(TrainablePolicy, Protocol):
    tp_size: int
    tp_rank: int

    def hf_state_dict(self) -> dict[str, torch.Tensor]: ...
    """HF-named full weights (a collective under tensor parallelism: every rank calls it)."""

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None: ...

    def quantized_weights(self) -> dict[str, "QuantizedTensor"]: ...
    """The FP8 bytes its linears compute with, per HF module name (gathered)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor: ...
    """Clip by the global gradient norm over all shards; returns that norm."""


def hf_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A policy's HF-named weights: a sharded policy's gathered ones, else its state_dict."""
    return model.hf_state_dict() if isinstance(model, ShardedPolicy) else model.state_dict()


def tensor_parallel_size(model: torch.nn.Module) -> int:
    return model.tp_size if isinstance(model, ShardedPolicy) else 1
