"""The exact engine's quantization config: vLLM's linear layers, embedding and lm_head computed by the
policy's own modules (see jetflow.rollout.vllm.plugin); MoE experts get jetflow.rollout.vllm.moe's method.

vLLM fuses q/k/v (QKVParallelLinear) and gate/up (MergedColumnParallelLinear) into one layer; here
each fused layer keeps one jetflow PrecisionLinear per Hugging Face sub-matrix (`q_proj`, `k_proj`,
`v_proj`; `gate_proj`, `up_proj`), so every sub-matrix keeps its own FP8 blocks and scales whatever
its width (SmolLM2's 576 = 4.5 blocks, which vLLM's fused FP8 grid refuses), and the outputs are
concatenated in vLLM's fused order. A PrecisionLinear computes exactly as in the native engine: fp32,
the bf16 grid, or W8A8 FP8 (the trainer's bytes and 128x128 scales, activations through jetflow's
1x128 quantizer) on the batch-invariant GEMM. The weights live in those modules, not in vLLM's
parameters (the engine starts with `load_format="dummy"` and registers none); weight updates load
into the policy (jetflow.sync.apply_update).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

from jetflow.precision import PrecisionLinear
from jetflow.rollout.vllm.moe import ExactMoEMethod
from jetflow.rollout.vllm.policies import QUANT_METHOD, UnservedError, policy_for

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""vLLM's fused layers -> the HF sub-matrices they stack, in vLLM's order."""


def hf_names(prefix: str) -> list[str]:
    """The HF module names a vLLM linear layer computes (`...qkv_proj` -> q/k/v_proj)."""
    parent, _, leaf = prefix.rpartition(".")
    return [f"{parent}.{part}" for part in FUSED[leaf]] if leaf in FUSED else [prefix]


class ExactConfig(QuantizationConfig):
    """Selected by `quantization_config = {"quant_method": QUANT_METHOD, "policy": token}` (the
    adapter passes it as an hf_override); `token` names the policy (jetflow.rollout.vllm.policies.serve)."""

    def __init__(self, token: str):
        super().__init__()
        self.token = token

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32]  # the policy's activations: fp32 master weights, bf16 / FP8 GEMM kinds

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ExactConfig":
        return cls(cls.get_from_keys(config, ["policy"]))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        policy = policy_for(self.token)
        if isinstance(layer, (LinearBase, VocabParallelEmbedding)):
            return exact_method(layer, prefix, policy)
        if isinstance(layer, RoutedExperts):
            return ExactMoEMethod(layer.moe_config)  # the MoE runner computes the block (jetflow.rollout.vllm.moe)
        if isinstance(layer, Attention):
            return None  # the attention backend computes it (jetflow.rollout.vllm.attention)
        raise UnservedError(f"exact vLLM plugin: cannot serve {prefix} ({type(layer).__name__})")


def exact_method(layer: torch.nn.Module, prefix: str, policy) -> QuantizeMethodBase:
    """The method that computes vLLM's linear layer, lm_head or embedding `prefix` with the policy's module."""
    if isinstance(layer, ParallelLMHead):
        return ExactLinearMethod(prefix, [_linear(policy, "lm_head", prefix)], vocab=True)
    if isinstance(layer, VocabParallelEmbedding):
        return ExactEmbeddingMethod(policy)
    return ExactLinearMethod(prefix, [_linear(policy, name, prefix) for name in hf_names(prefix)])


def _linear(policy, name: str, prefix: str) -> PrecisionLinear:
    try:
        module = policy.get_submodule(name)
    except AttributeError:
        raise UnservedError(f"exact vLLM plugin: {prefix} has no jetflow module {name!r} to compute it") from None
    if not isinstance(module, PrecisionLinear) or module.numerics != "exact":
        what = f"a {module.numerics} PrecisionLinear" if isinstance(module, PrecisionLinear) else type(module).__name__
        raise UnservedError(f"exact vLLM plugin: {name} is {what}, not an exact PrecisionLinear")
    return module


class ExactLinearMethod(LinearMethodBase):
    """One vLLM linear layer (or the lm_head) as the concatenated outputs of jetflow PrecisionLinears."""

    def __init__(self, prefix: str, linears: list[PrecisionLinear], vocab: bool = False):
        self.prefix, self.linears, self.vocab = prefix, linears, vocab

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        """No vLLM parameters: the weights are the PrecisionLinears'. Checks that they fit the layer
        (an lm_head's vLLM width is the vocabulary padded to 64; its logits are cut back to it)."""
        outs = [m.out_features for m in self.linears]
        want = [layer.org_vocab_size] if self.vocab else list(output_partition_sizes)
        if outs != want or any(m.in_features != input_size_per_partition for m in self.linears):
            raise UnservedError(f"exact vLLM plugin: {self.prefix} is {input_size_per_partition} -> {want} in vLLM "
                                f"(tensor parallel?), its jetflow linears {[m.in_features for m in self.linears]} "
                                f"-> {outs}")

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (N, K) -> (N, sum of widths); vLLM's bias parameter is not used (a PrecisionLinear adds its own)."""
        ys = [linear(x) for linear in self.linears]  # (N, N_i) each
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module) -> torch.nn.Module:
        """A tied lm_head: the policy's lm_head already shares the embedding matrix."""
        return layer


class ExactEmbeddingMethod(QuantizeMethodBase):
    """The token embedding as the Decoder computes it (`Decoder.embed`: on the bf16 grid under the
    precision modes)."""

    def __init__(self, policy):
        self.policy = policy  # the module itself (a quant method is no nn.Module: not registered in vLLM's model)

    def create_weights(self, layer: torch.nn.Module, *args, **kwargs) -> None:
        pass

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return self.policy.embed(input_)  # (N,) -> (N, C)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise UnservedError("exact vLLM plugin: the embedding is not an lm_head")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass
