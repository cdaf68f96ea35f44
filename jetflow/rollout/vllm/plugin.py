"""jetflow's exact-numerics plugin for vLLM: its registration and the policies it serves.

An exact engine (`VLLMRollout(execution="exact", policy=...)`) computes every token with the modules
of a jetflow Decoder, the *policy*: the rollout side's model built as the native engine's is
(`numerics="exact"`, the precision mode's PrecisionLinears, the FP8 KV quantizer). vLLM keeps its
scheduler, paged KV cache, batching and sampler; the plugin puts jetflow's functions under each op:

    vLLM op                                  computed by (module)
    linear layers, lm_head                   the policy's PrecisionLinears, one per HF sub-matrix (quant)
    embedding                                Decoder.embed (quant)
    attention                                jetflow.kernels.invariant.attention on vLLM's paged cache (attention)
    RMSNorm, SiluAndMul, rotary embedding    the policy's RMSNorm modules, silu_exact, rope_tables + apply_rope (ops)
    MoE block (router and experts)           the policy's SparseMoeBlock (moe)

`register()` installs the extension points once per process (vLLM 0.32: an out-of-tree quantization
config, an attention backend registered over CPU_ATTN, out-of-tree custom ops and MoE runner). They are global, so
each piece decides per engine: an engine whose quantization config is QUANT_METHOD is exact, every
other engine of the process keeps vLLM's own kernels. The engine names its policy by a token in that
config (`serve`), because vLLM copies its configs; the token is looked up here, in this process: the
exact path needs the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, which the adapter sets).
"""

from __future__ import annotations

import itertools
import re

from jetflow.errors import UserError
from jetflow.model import Decoder

QUANT_METHOD = "jetflow_exact"

_policies: dict[str, Decoder] = {}
_tokens = itertools.count()
_registered = False


class UnservedError(UserError, ValueError):
    """The plugin cannot serve this model or layer (the message names it)."""


def register() -> None:
    """Install the plugin's quantization config, attention backend and custom ops (once per process)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from jetflow.rollout.vllm import moe, ops
    from jetflow.rollout.vllm.attention import ExactAttentionBackend
    from jetflow.rollout.vllm.quant import ExactConfig

    register_quantization_config(QUANT_METHOD)(ExactConfig)
    # CpuPlatform.get_attn_backend_cls always picks CPU_ATTN; its registered path honours this override
    register_backend(AttentionBackendEnum.CPU_ATTN,
                     f"{ExactAttentionBackend.__module__}.{ExactAttentionBackend.__qualname__}")
    ops.register()
    moe.register()
    _registered = True


def serve(policy: Decoder) -> str:
    """A token naming `policy` for one engine's quantization config (see `release`)."""
    token = f"policy-{next(_tokens)}"
    _policies[token] = policy
    return token


def release(token: str) -> None:
    _policies.pop(token, None)


def policy_for(token: str) -> Decoder:
    try:
        return _policies[token]
    except KeyError:
        raise UnservedError(f"the exact vLLM engine's policy {token!r} is not served in this process: the exact "
                            "path runs vLLM in the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0)") from None


def exact_policy(vllm_config) -> Decoder | None:
    """The policy of the engine this vLLM config builds, or None for an engine that is not exact."""
    from jetflow.rollout.vllm.quant import ExactConfig

    quant = getattr(vllm_config, "quant_config", None)
    return policy_for(quant.token) if isinstance(quant, ExactConfig) else None


def running_metadata():
    """The attention plan (attention.ExactMetadata) of the exact engine whose forward runs now, or None
    (another engine, or a warm-up run without attention metadata). For ops that vLLM shares between
    engines (the rotary embedding is cached by its parameters): they ask at each call."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    from jetflow.rollout.vllm.attention import ExactMetadata

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # micro-batched runs: one dict per micro-batch
        metadata = metadata[0] if metadata else None
    first = next(iter(metadata.values()), None) if isinstance(metadata, dict) else None
    return first if isinstance(first, ExactMetadata) else None


def layer_index(name: str) -> int:
    """The decoder layer of a vLLM or HF module name (`model.layers.3.self_attn.attn` -> 3)."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    if m is None:
        raise UnservedError(f"exact vLLM plugin: cannot tell the decoder layer of {name!r}")
    return int(m.group(1))
