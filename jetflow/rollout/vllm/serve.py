"""What the exact vLLM plugin serves: the check before an engine starts, the binding of vLLM's model to
the policy once vLLM built it, and the line that says what the engine executes.

A model is served when vLLM builds it with an architecture whose forward code the plugin was read
against (SERVED: every computation in it is a linear, the embedding, an RMSNorm, SiluAndMul, the
rotary embedding, attention or an MoE block, plus residual adds, splits and views) and every such module of the
built model is the plugin's; anything else is refused in one line that names it.
"""

from __future__ import annotations

import re
from collections import Counter

import torch

from jetflow.model import Decoder
from jetflow.rollout.vllm.policies import UnservedError, policy_for

SERVED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
          "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
"""jetflow model_type -> the vLLM architecture that runs it."""


def check_servable(policy: Decoder) -> None:
    """Refuse, before any engine starts, a policy the plugin cannot serve."""
    model_type = policy.config.model_type
    if model_type not in SERVED:
        raise UnservedError(f"exact vLLM plugin: cannot serve model_type {model_type!r} yet (served: "
                            f"{', '.join(SERVED)}); use rollout.backend=native or precision.numerics=fast")
    if policy.numerics != "exact":
        raise UnservedError(f"exact vLLM plugin: the policy runs numerics={policy.numerics!r}; "
                            "build it with numerics='exact' (jetflow.run.build.apply_mode)")


def bind(model, token: str) -> dict[str, int]:
    """Point every vLLM module of an exact engine's `model` at the policy's computation and check that
    nothing else computes; returns what computes, by kind (the engine's summary). Run in the engine's
    process (`LLM.apply_model`)."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.custom_op import CustomOp

    from jetflow.rollout.vllm.attention import ExactAttentionImpl
    from jetflow.rollout.vllm.moe import ExactMoERunner
    from jetflow.rollout.vllm.ops import ExactRMSNorm, ExactRotary, ExactSiluAndMul
    from jetflow.rollout.vllm.quant import ExactEmbeddingMethod, ExactLinearMethod

    policy = policy_for(token)
    architecture = type(model).__name__
    if architecture != SERVED[policy.config.model_type]:
        raise UnservedError(f"exact vLLM plugin: vLLM built {architecture} for model_type "
                            f"{policy.config.model_type!r}, not {SERVED[policy.config.model_type]}")
    kinds, served = Counter(), []  # served: modules whose children the exact path does not call
    for name, module in model.named_modules():
        if any(name.startswith(f"{parent}.") for parent in served):
            continue
        if isinstance(module, ExactRMSNorm) and module.exact:
            try:
                module.bind(policy.get_submodule(name))
            except AttributeError:
                raise UnservedError(f"exact vLLM plugin: vLLM's {name} (RMSNorm) has no jetflow RMSNorm of that name") from None
            kinds["RMSNorm"] += 1
        elif isinstance(module, (LinearBase, VocabParallelEmbedding)):
            if not isinstance(module.quant_method, (ExactLinearMethod, ExactEmbeddingMethod)):
                late_bind(module, name, policy)
            kinds["embedding" if isinstance(module.quant_method, ExactEmbeddingMethod) else "linear"] += 1
        elif isinstance(module, Attention):
            if not isinstance(module.impl, ExactAttentionImpl) or module.impl.policy is None:
                raise _refuse(name, module)
            kinds["attention"] += 1
        elif isinstance(module, LogitsProcessor):
            if module.scale != 1.0 or module.soft_cap is not None or module.logits_as_input:
                raise UnservedError(f"exact vLLM plugin: {name} scales or caps the logits")
        elif isinstance(module, ExactMoERunner) and module.exact:  # its gate, router and experts are the block's
            kinds["MoE"] += 1
            served.append(name)
        elif isinstance(module, ExactRotary):  # exact per call (vLLM shares rotary modules between engines)
            kinds["rotary"] += 1
            served.append(name)
        elif isinstance(module, ExactSiluAndMul) and module.exact:
            kinds["SiluAndMul"] += 1
        elif isinstance(module, CustomOp) or next(module.parameters(recurse=False), None) is not None:
            raise _refuse(name, module)
    return dict(kinds)


def late_bind(module, name: str, policy) -> None:
    """A layer vLLM built without the quantization config (Mixtral's embedding and router gate): hand it
    the exact method now (its vLLM weight, never read again, is dropped where nothing else reads it)."""
    from vllm.model_executor.layers.linear import LinearBase

    from jetflow.rollout.vllm.quant import exact_method

    method = exact_method(module, name, policy)
    if isinstance(module, LinearBase):
        in_features = getattr(module, "input_size_per_partition", module.input_size)
        method.create_weights(module, in_features, module.output_partition_sizes, module.input_size,
                              module.output_size, module.params_dtype)  # the shape check
    else:
        module.weight = torch.nn.Parameter(module.weight.new_empty(0), requires_grad=False)
    module.quant_method = method


def _refuse(name: str, module) -> UnservedError:
    return UnservedError(f"exact vLLM plugin: cannot serve {name} ({type(module).__name__}): it would compute "
                         "with vLLM's own kernels")


def describe(policy: Decoder) -> str:
    """What an exact engine executes, for its log line: the linears' kinds and the KV cache."""
    from jetflow.precision import PrecisionLinear

    linears = {n: m for n, m in policy.named_modules() if isinstance(m, PrecisionLinear)}
    kinds = Counter(m.kind for m in linears.values())
    fp8 = kinds.get("fp8", 0)
    if fp8:
        recipe = next(m.recipe for m in linears.values() if m.kind == "fp8")
        others = ", ".join(dict.fromkeys(re.sub(r"layers\.\d+\.", "layers.*.", n)  # one entry per role
                                         for n, m in linears.items() if m.kind != "fp8"))
        name = {"fp8_block": "W8A8 FP8", "mxfp8": "MXFP8", "nvfp4": "NVFP4"}[recipe.family]
        what = (f"{name} with jetflow's kernels ({fp8} {name} linears: {recipe.weight_block[0]}x{recipe.weight_block[1]} "
                f"weight blocks, 1x{recipe.group_size} activation groups; bf16: {others or 'none'})")
    else:
        what = f"{'/'.join(sorted(kinds))} linears with jetflow's kernels"
    adapted = [m.lora for m in linears.values() if getattr(m, "lora", None) is not None]
    if adapted:  # model.lora: each adapted linear adds its adapter (jetflow.precision.lora)
        what += f" + LoRA rank {adapted[0].rank} on {len(adapted)} linears (fp32, the canonical GEMM)"
    from jetflow.rollout.vllm.attention import cache_dtype

    kv = policy.model.layers[0].self_attn.kv_quantizer
    storage = {"fp8": "1-byte E4M3 codes x per-layer fp32 scales", "bfloat16": "bf16"}.get(cache_dtype(policy), "fp32")
    return (f"{what}; jetflow's paged attention on vLLM's KV cache in 64-position blocks of {storage}"
            f"{f' ({kv.values})' if kv else ''} (prefix caching off); activations fp32; eager mode (no torch.compile)")
