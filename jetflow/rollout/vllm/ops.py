"""vLLM's element-wise custom ops, computed by jetflow's functions in an exact engine (`register()`
installs them with `CustomOp.register_oot`, so every RMSNorm / SiluAndMul / RotaryEmbedding vLLM builds
in this process is one of these classes; in an engine that is not exact they run vLLM's own code).

    RMSNorm        the policy's RMSNorm module of the same name (bound by serve.bind after vLLM built
                   the model); vLLM's fused residual add is the Decoder's `x = x + sublayer(...)`
    SiluAndMul     silu_exact(gate) * up, the Decoder's MLP
    RotaryEmbedding (and Llama3RotaryEmbedding)
                   rope_tables from the policy's rope_inv_freq, then apply_rope: the Decoder's tables
                   and rotation. vLLM caches rotary modules by their parameters and shares them
                   between engines, so this one asks at each call whether the running engine is exact.

Shapes: N tokens, H heads, D head dim.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding

from jetflow.model.attention import apply_rope, rope_tables
from jetflow.model.layers import silu_exact
from jetflow.rollout.vllm.attention import running_metadata
from jetflow.rollout.vllm.policies import UnservedError, exact_policy


class ExactRMSNorm(RMSNorm):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.exact = exact_policy(get_current_vllm_config()) is not None
        self._norm: tuple[torch.nn.Module] | None = None  # in a tuple: not a submodule of vLLM's model
        if self.exact:
            if not self.has_weight or self.variance_size_override is not None:
                raise UnservedError("exact vLLM plugin: cannot serve an RMSNorm without weight or with a "
                                    "variance size override")
            self._forward_method = self.forward_exact

    def bind(self, norm: torch.nn.Module) -> None:
        """Compute with `norm`, the policy's jetflow RMSNorm (its weight and eps)."""
        self._norm = (norm,)

    @property
    def bound(self) -> bool:
        return self._norm is not None

    def forward_exact(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x (N, C) or (N, H, D); with `residual` (the stream), vLLM's fused add: returns (norm(x + residual), x + residual)."""
        if self._norm is None:  # vLLM's start-up warm-up runs before serve.bind; their outputs are discarded
            return self.forward_native(x, residual)
        norm = self._norm[0]
        if residual is None:
            return norm(x)
        x = x + residual  # the Decoder's residual stream, x = x + sublayer(...)
        return norm(x), x


class ExactSiluAndMul(SiluAndMul):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.exact = exact_policy(get_current_vllm_config()) is not None
        if self.exact:
            self._forward_method = self.forward_exact

    @staticmethod
    def forward_exact(x: torch.Tensor) -> torch.Tensor:
        """x (N, 2I) = [gate | up] -> (N, I): the Decoder's MLP, silu_exact(gate(x)) * up(x)."""
        d = x.shape[-1] // 2
        return silu_exact(x[..., :d]) * x[..., d:]


class ExactRotary:
    """The exact rotation, for vLLM's rotary classes (mixed in before them)."""

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        step = running_metadata()
        if step is None:
            return super().forward(positions, query, key)  # an engine that is not exact: vLLM's own
        if self.rotary_dim != self.head_size or not self.is_neox_style:
            raise UnservedError(f"exact vLLM plugin: cannot serve a partial ({self.rotary_dim} of {self.head_size}) "
                                "or interleaved rotary embedding")
        n = positions.numel()
        tables = (positions.data_ptr(), n, query.dtype)  # every layer of a step rotates the same positions
        if tables not in step.rope:
            cos, sin = rope_tables(positions.reshape(n), step.policy.rope_inv_freq, query.dtype)  # (N, D) each
            step.rope[tables] = cos[:, None], sin[:, None]  # (N, 1, D)
        cos, sin = step.rope[tables]
        query = apply_rope(query.view(n, -1, self.head_size), cos, sin).view(query.shape)  # over (N, H, D)
        if key is not None:
            key = apply_rope(key.view(n, -1, self.head_size), cos, sin).view(key.shape)
        return query, key


class ExactRotaryEmbedding(ExactRotary, RotaryEmbedding):
    pass


class ExactLlama3RotaryEmbedding(ExactRotary, Llama3RotaryEmbedding):
    pass


def register() -> None:
    """Make vLLM build these classes in place of its own (CustomOp.__new__ looks the class name up)."""
    RMSNorm.register_oot(ExactRMSNorm, name="RMSNorm")
    SiluAndMul.register_oot(ExactSiluAndMul, name="SiluAndMul")
    RotaryEmbedding.register_oot(ExactRotaryEmbedding, name="RotaryEmbedding")
    Llama3RotaryEmbedding.register_oot(ExactLlama3RotaryEmbedding, name="Llama3RotaryEmbedding")
