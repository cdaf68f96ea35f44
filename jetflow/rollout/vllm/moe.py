"""The exact engine's mixture-of-experts layers (Qwen3-MoE, Mixtral): each vLLM MoE runner computes its
block with the policy's SparseMoeBlock (jetflow.model.moe): the router's PrecisionLinear, softmax_exact,
top-k and the tree-sum renormalization, each expert's PrecisionLinears and silu_exact, the outputs
summed in slot order. So routing is the trainer's, bit for bit, and every expert GEMM is jetflow's (FP8
experts under mixed / unified, a bf16 router as the recipe keeps it).

`register()` installs ExactMoERunner over vLLM's MoERunner (PluggableLayer.register_oot); in an engine
that is not exact it is vLLM's runner. The experts' vLLM layer (RoutedExperts) gets ExactMoEMethod from
the quantization config: no weights (they are the policy's), nothing to run.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

from jetflow.model.moe import SparseMoeBlock
from jetflow.rollout.vllm.policies import UnservedError, exact_policy


class ExactMoEMethod(FusedMoEMethodBase):
    """The experts' quant method in an exact engine: ExactMoERunner computes the whole block."""

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        pass

    def get_fused_moe_quant_config(self, layer):
        return None

    def process_weights_after_loading(self, layer) -> None:
        pass

    def apply(self, *args, **kwargs):
        raise UnservedError("exact vLLM plugin: the experts run in ExactMoERunner, not in a fused-MoE kernel")


class ExactMoERunner(MoERunner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        policy = exact_policy(get_current_vllm_config())
        self.exact = policy is not None
        self._block: tuple[SparseMoeBlock] | None = None  # in a tuple: not a submodule of vLLM's model
        if self.exact:
            name = self.layer_name.removesuffix(".experts")  # model.layers.N.mlp / .block_sparse_moe
            block = policy.get_submodule(name) if name != self.layer_name else None
            if not isinstance(block, SparseMoeBlock):
                raise UnservedError(f"exact vLLM plugin: {self.layer_name} has no jetflow SparseMoeBlock {name!r}")
            if self.shared_experts is not None:
                raise UnservedError(f"exact vLLM plugin: cannot serve {self.layer_name}: shared experts")
            self._block = (block,)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor, input_ids=None,
                shared_experts_input=None) -> torch.Tensor:
        """hidden_states (N, C) -> (N, C); vLLM's router logits are not used (the block routes itself)."""
        if not self.exact:
            return super().forward(hidden_states, router_logits, input_ids, shared_experts_input)
        return self._block[0](hidden_states, exact=True)


def register() -> None:
    MoERunner.register_oot(ExactMoERunner, name="MoERunner")
