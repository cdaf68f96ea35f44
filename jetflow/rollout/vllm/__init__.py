"""The vLLM rollout side (`rollout.backend=vllm`); the only package of jetflow that imports vllm, lazily.

    adapter    VLLMRollout: jetflow's RolloutEngineSide protocol over an in-process vLLM engine
    payload    what an engine running vLLM's own kernels loads for an update; the exact engine's update check
    plugin     the exact-numerics plugin's registration with vLLM
    policies   the policies the plugin serves, by token; which engine is exact
    serve      what the plugin serves: the check before start, binding, the execution's description
    quant      the plugin's quantization config: linears, lm_head, embedding (imports vllm)
    attention  the plugin's attention backend over CPU_ATTN (imports vllm)
    ops        the plugin's RMSNorm, SiluAndMul and rotary embedding (imports vllm)

Importing this package does not import vllm: quant, attention and ops are imported when an engine starts.
"""

from jetflow.rollout.vllm.adapter import DTYPES, EXECUTIONS, INSTALL_HINT, VLLMRollout, import_vllm
from jetflow.rollout.vllm.payload import (SCALE_SUFFIX, check_exact_update, check_payload, checkpoint_shapes,
                                          engine_payload, is_linear_weight, layer_index, reprocess_cpu_moe_experts,
                                          reprocess_tied_lm_head, unfusable_projections)
from jetflow.rollout.vllm.policies import QUANT_METHOD, UnservedError

__all__ = [
    "DTYPES", "EXECUTIONS", "INSTALL_HINT", "QUANT_METHOD", "SCALE_SUFFIX", "UnservedError", "VLLMRollout",
    "check_exact_update", "check_payload", "checkpoint_shapes", "engine_payload", "import_vllm", "is_linear_weight",
    "layer_index", "reprocess_cpu_moe_experts", "reprocess_tied_lm_head", "unfusable_projections",
]
