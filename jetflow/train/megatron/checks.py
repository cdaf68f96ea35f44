"""Checks of the model against the parallel layout (pure: no Megatron needed).

`check_layout` runs them all: MegatronPolicy calls it when it is built, and `jetflow train`'s pre-run
pass (jetflow.run.validate) calls it on the architecture of the model the run will build, before any
weight loads. The sizes themselves (>= 1, the process count a multiple of TP x PP x EP) are config
values: the pass checks those.
"""

from __future__ import annotations

from jetflow.model.decoder import ModelConfig
from jetflow.precision import QuantRecipe

from .deps import MegatronConfigError


def check_layout(config: ModelConfig, tp: int, pp: int, ep: int, kind: str, recipe: QuantRecipe | None,
                 numerics: str) -> None:
    """Raise MegatronConfigError naming what of `config` the layout (TP x PP x EP) cannot build under the
    GEMM kind, recipe and numerics."""
    check_supported(config, tp, pp, ep)
    check_fp8_tp_alignment(config, tp, recipe, kind)
    check_exact_tp_split(config, tp, numerics)
    check_router_precision(config, kind, recipe)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """VocabParallelEmbedding splits rows evenly over TP ranks: pad the vocab to a multiple of tp."""
    return -(-vocab_size // tp) * tp


def check_supported(config: ModelConfig, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    """Raise MegatronConfigError if `config` cannot be built with tensor-parallel size `tp`,
    pipeline-parallel size `pp` and expert-parallel size `ep`."""
    c = config
    _check_moe(c, tp, ep)
    if c.o_bias != c.mlp_bias:
        raise MegatronConfigError(
            f"o_bias={c.o_bias} with mlp_bias={c.mlp_bias}: Megatron has one `add_bias_linear` flag for "
            "o_proj, gate/up and down projections")
    if c.o_bias and not c.qkv_bias:
        raise MegatronConfigError("o_proj/MLP biases without q/k/v biases: Megatron's add_bias_linear also "
                                  "adds a q/k/v bias")
    if c.num_heads % c.num_kv_heads:
        raise MegatronConfigError(f"num_heads {c.num_heads} is not a multiple of num_kv_heads {c.num_kv_heads}")
    if c.num_kv_heads % tp:
        raise MegatronConfigError(
            f"num_kv_heads={c.num_kv_heads} is not a multiple of tensor_parallel_size={tp}: each rank must hold "
            "whole KV groups (the q/k/v split of Megatron's fused linear_qkv)")
    if c.intermediate_size % tp:
        raise MegatronConfigError(f"intermediate_size={c.intermediate_size} is not a multiple of "
                                  f"tensor_parallel_size={tp}")
    if c.num_layers % pp:
        raise MegatronConfigError(f"num_layers={c.num_layers} is not a multiple of pipeline_parallel_size={pp}: "
                                  "each pipeline stage holds the same number of layers")


def _check_moe(c: ModelConfig, tp: int, ep: int) -> None:
    if not c.is_moe:
        if ep > 1:
            raise MegatronConfigError(f"expert_parallel_size={ep} needs a mixture-of-experts model; {c.model_type} is "
                                      "dense: use expert_parallel_size=1")
        return
    if tp > 1:  # moe_layer.py:379-383 (megatron-core 0.16.1); jetflow's linears have no sequence parallelism
        raise MegatronConfigError(
            f"{c.model_type} with tensor_parallel_size={tp}: Megatron's MoE layer trains under tensor parallelism "
            "only with sequence parallelism, which the Megatron backend does not run; use tensor_parallel_size=1 "
            "(and expert_parallel_size to split the experts)")
    if c.num_experts % ep:
        raise MegatronConfigError(f"num_experts={c.num_experts} is not a multiple of expert_parallel_size={ep}: each "
                                  "expert-parallel rank holds the same number of experts")
    if c.mlp_bias:
        raise MegatronConfigError("MoE experts with biases: the native MoE block has none; use mlp_bias=false")


def _linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int, str]]:
    """HF module suffix -> (out_features, in_features, 'column' | 'row') for one decoder layer."""
    c = config
    q, kv, hidden, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    return {
        "self_attn.q_proj": (q, hidden, "column"), "self_attn.k_proj": (kv, hidden, "column"),
        "self_attn.v_proj": (kv, hidden, "column"), "self_attn.o_proj": (hidden, q, "row"),
        "mlp.gate_proj": (inter, hidden, "column"), "mlp.up_proj": (inter, hidden, "column"),
        "mlp.down_proj": (hidden, inter, "row"),
    }


def segment_kind(kind: str, recipe: QuantRecipe | None, name: str, layer: int | None, num_layers: int) -> str:
    """The GEMM kind of one HF linear under `kind`: fp8 layers the recipe keeps stay in bf16
    (the same rule as `jetflow.precision.apply_precision`)."""
    if kind == "fp8" and recipe.keeps_in_high_precision(name, layer, num_layers):
        return "bf16"
    return kind


def check_fp8_tp_alignment(config: ModelConfig, tp: int, recipe: QuantRecipe, kind: str = "fp8") -> None:
    """Raise MegatronConfigError naming the first FP8 layer whose TP shards cut through a block.

    Column-parallel layers (q/k/v, gate/up, lm_head) split out_features: out / tp must be a multiple
    of the weight block's rows and of the group size (dgrad quantizes the output gradient in 1 x group
    groups along out_features). Row-parallel layers (o_proj, down_proj) split in_features: in / tp must
    be a multiple of the block's columns and of the group size (activation groups along K). Otherwise
    a rank would quantize partial blocks that the full weight does not have, and the trainer's bytes
    would differ from the rollout engine's.
    """
    if kind != "fp8" or tp == 1:
        return
    br, bc = recipe.weight_block
    g = recipe.group_size
    layers = [(f"model.layers.{i}.{suffix}", i, shape)
              for i in range(config.num_layers) for suffix, shape in _linear_shapes(config).items()]
    layers.append(("lm_head", None, (padded_vocab_size(config.vocab_size, tp), config.hidden_size, "column")))
    for name, layer, (out_f, in_f, style) in layers:
        if segment_kind(kind, recipe, name, layer, config.num_layers) != "fp8":
            continue
        if style == "column":
            per_rank, dim, need = out_f // tp, f"out_features {out_f}", (br, g)
        else:
            per_rank, dim, need = in_f // tp, f"in_features {in_f}", (bc, g)
        bad = [n for n in need if per_rank % n]
        if bad:
            raise MegatronConfigError(
                f"{name}: {style}-parallel FP8 shard of {dim} / tensor_parallel_size {tp} = {per_rank} is not a "
                f"multiple of {bad[0]} (weight block {recipe.weight_block}, group {g}); a shard edge would cut "
                "through a scaling block, so the ranks' FP8 bytes would not be the full weight's. Use a smaller "
                "tensor_parallel_size or keep this layer in bf16 (recipe.keep_high_precision).")


def check_exact_tp_split(config: ModelConfig, tp: int, numerics: str = "exact") -> None:
    """Raise MegatronConfigError naming the first row-parallel layer whose K the TP ranks cannot split
    into whole canonical groups under exact numerics.

    The canonical GEMM sums K as G = tree_width(K) contiguous groups of 128-wide blocks combined by a
    fixed pairwise tree (jetflow.kernels.canonical); TP rank r of T computes groups [r G/T, (r+1) G/T)
    and the ranks' partials are combined by the same tree (reduce.py): TP=1's sum, if T divides G.
    Column-parallel layers keep whole output rows at any T."""
    if numerics != "exact" or tp == 1:
        return
    from jetflow.kernels.canonical import tree_width

    for suffix, (_, in_f, style) in _linear_shapes(config).items():
        groups = tree_width(in_f)
        if style == "row" and groups % tp:
            raise MegatronConfigError(
                f"model.layers.0.{suffix}: a row-parallel K of {in_f} sums as {groups} canonical group(s) of "
                f"128-wide blocks (tree_width({in_f}) = {groups}), which tensor_parallel_size {tp} cannot split "
                f"into whole groups per rank, so TP={tp} would not give TP=1's bits under precision.numerics=exact; "
                f"use a tensor_parallel_size dividing {groups}, or precision.numerics=fast")


def check_router_precision(config: ModelConfig, kind: str, recipe: QuantRecipe | None) -> None:
    """The Megatron backend runs MoE routers in bf16 or fp32: the FP8 recipe must keep them."""
    if not config.is_moe:
        return
    for i in range(config.num_layers):
        gate = f"model.layers.{i}.{config.moe_attr}.gate"
        if config.is_moe_layer(i) and segment_kind(kind, recipe, gate, i, config.num_layers) == "fp8":
            raise MegatronConfigError(f"{gate}: the FP8 recipe does not keep the MoE router in high precision; the "
                                      "Megatron backend runs routers in bf16 or fp32: add '*.mlp.gate' / "
                                      "'*.block_sparse_moe.gate' to recipe.keep_high_precision")
