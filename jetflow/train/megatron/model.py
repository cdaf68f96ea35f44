"""The Megatron model's pieces: TransformerConfig from a ModelConfig, and the layer spec with jetflow's
linears, RMSNorm and core attention (under exact numerics: the batch-invariant kernel and `silu_exact`,
the native exact model's functions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jetflow.model.decoder import ModelConfig, RMSNorm, silu_exact

from .attention import ExactCoreAttention, fast_core_attention
from .linear import _linear_classes
from .moe import moe_layer_spec


class MegatronRMSNorm(RMSNorm):
    """The native Decoder's RMSNorm (fp32 normalization, cast, then scale) with Megatron's signature."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps)


def _moe_fields(c: ModelConfig, ep: int) -> dict:
    """TransformerConfig fields of a mixture-of-experts model, routing as transformers does.

    Qwen3-MoE without norm_topk_prob: softmax over all experts, then top-k (moe_router_pre_softmax).
    With it, and always for Mixtral: top-k of the logits, then a softmax over those k, which equals the
    top-k of the full softmax renormalized to sum 1. No load-balancing term inside Megatron (the
    Trainer adds jetflow's, `MegatronPolicy.load_balancing_loss`), no token dropping, fp32 router."""
    if not c.is_moe:
        return {}
    return dict(num_moe_experts=c.num_experts, moe_ffn_hidden_size=c.moe_intermediate_size,
                moe_router_topk=c.num_experts_per_tok, moe_router_score_function="softmax",
                moe_router_pre_softmax=not c.norm_topk_prob, moe_router_load_balancing_type="none",
                moe_aux_loss_coeff=0.0, moe_router_dtype="fp32", moe_token_dispatcher_type="allgather",
                moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
                expert_model_parallel_size=ep)


def _transformer_config(c: ModelConfig, tp: int, params_dtype: torch.dtype, init_weights: bool, pp: int = 1,
                        ep: int = 1, numerics: str = "fast"):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**_moe_fields(c, ep),
        num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size,
        num_attention_heads=c.num_heads, num_query_groups=c.num_kv_heads, kv_channels=c.head_dim,
        normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps, qk_layernorm=c.qk_norm,
        gated_linear_unit=True,  # SwiGLU: silu(gate) * up; exact: the native exact model's SiLU
        activation_func=silu_exact if numerics == "exact" else F.silu,
        add_bias_linear=c.o_bias, add_qkv_bias=c.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        # fused kernels are CUDA/TE-only, and our own linears replace the fused GEMM paths
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=False,
        pipeline_dtype=params_dtype if pp > 1 else None,  # the residual stream stays in params_dtype
        use_cpu_initialization=True, perform_initialization=init_weights, params_dtype=params_dtype,
    )


def _block_spec(config: ModelConfig, mcfg=None, numerics: str = "fast"):
    """A local (no Transformer Engine) layer spec with jetflow's linears, RMSNorm and core attention
    (attention.py): one per layer of this pipeline stage (Megatron's split of `mcfg`, the
    TransformerConfig; all layers without it). A sparse layer of an MoE model holds Megatron's MoE layer
    (moe.py) in place of the dense MLP."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    column, row = _linear_classes()
    core_attention = ExactCoreAttention if numerics == "exact" else fast_core_attention()
    qk_norm = MegatronRMSNorm if config.qk_norm else IdentityOp  # Qwen3: RMSNorm over D per head, before RoPE

    def layer(mlp):
        return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=MegatronRMSNorm,
            self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                      submodules=SelfAttentionSubmodules(
                                          linear_qkv=column, core_attention=core_attention, linear_proj=row,
                                          q_layernorm=qk_norm, k_layernorm=qk_norm)),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=MegatronRMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ))

    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    dense = layer(ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)))
    sparse = layer(moe_layer_spec(column, row)) if config.is_moe else None
    layers = config.num_layers if mcfg is None else get_num_layers_to_build(mcfg)
    offset = 0 if mcfg is None else get_transformer_layer_offset(mcfg)  # this stage's first global layer
    specs = [sparse if config.is_moe_layer(offset + i) else dense for i in range(layers)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=MegatronRMSNorm)
