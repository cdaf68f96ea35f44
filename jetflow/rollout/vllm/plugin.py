"""jetflow's exact-numerics plugin for vLLM: its registration (the policies it serves: policies.py).

An exact engine (`VLLMRollout(execution="exact", policy=...)`) computes every token with the modules
of a jetflow Decoder, the *policy*: the rollout side's model built as the native engine's is
(`numerics="exact"`, the precision mode's PrecisionLinears, the FP8 KV quantizer). vLLM keeps its
scheduler, paged KV cache, batching and sampler; the plugin puts jetflow's functions under each op:

    vLLM op                                  computed by (module)
    linear layers, lm_head                   the policy's PrecisionLinears, one per HF sub-matrix (quant)
    embedding                                Decoder.embed (quant)
    attention                                jetflow.kernels.paged.paged_attention on vLLM's blocks (attention)
    RMSNorm, SiluAndMul, rotary embedding    the policy's RMSNorm modules, silu_exact, rope_tables + apply_rope (ops)
    MoE block (router and experts)           the policy's SparseMoeBlock (moe)

`register()` installs the extension points once per process (vLLM 0.32: an out-of-tree quantization
config, an attention backend registered over CPU_ATTN, out-of-tree custom ops and MoE runner). They are global, so
each piece decides per engine: an engine whose quantization config is QUANT_METHOD is exact, every
other engine of the process keeps vLLM's own kernels. The engine names its policy by a token in that
config (`policies.serve`), because vLLM copies its configs; the token is looked up in this process:
the exact path needs the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, which the adapter sets).
"""

from __future__ import annotations

from jetflow.rollout.vllm.policies import QUANT_METHOD

_registered = False


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
