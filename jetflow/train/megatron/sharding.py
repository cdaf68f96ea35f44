"""Weight names and layouts, Megatron <-> HF (pure tensor functions): TP sharding and gathering.

Megatron linear_qkv rows, per KV group g (G groups, h = num_heads / G queries per group):
    [q_{g*h} .. q_{g*h+h-1} | k_g | v_g]  each head D rows; TP rank r holds groups [r*G/tp, (r+1)*G/tp)
Megatron linear_fc1 rows on TP rank r: [gate rows of shard r | up rows of shard r]
Row-parallel weights (linear_proj, linear_fc2) split their columns; their biases are replicated.
Vocab-parallel weights (embedding, output_layer) split rows of the vocab padded to a multiple of tp.
MoE layers (Megatron's MoELayer at `mlp`), E experts, EP expert-parallel ranks:
    mlp.router.weight (E, C)                                   <- HF {moe}.gate.weight
    mlp.experts.local_experts.{e}.linear_fc1.weight (2I, C)    <- [gate rows | up rows] of expert e
    mlp.experts.local_experts.{e}.linear_fc2.weight (C, I)     <- down of expert e
Expert names here carry the *global* expert index e; EP rank r holds experts [r*E/EP, (r+1)*E/EP) as
its local experts 0 .. E/EP - 1 (MegatronPolicy maps the local names to these).
"""

from __future__ import annotations

import torch

from jetflow.model.decoder import ModelConfig
from jetflow.model.moe import EXPERT_NAMES

from .checks import check_supported, padded_vocab_size


def _qkv_dims(c: ModelConfig) -> tuple[int, int, int]:
    return c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim  # G, h, D


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: ModelConfig, tp: int, rank: int) -> torch.Tensor:
    """HF q (H*D, ...), k, v (G*D, ...) -> rank's linear_qkv shard (G/tp * (h+2) * D, ...)."""
    G, h, D = _qkv_dims(c)
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(G, h * D, *rest), k.reshape(G, D, *rest), v.reshape(G, D, *rest)], dim=1)
    per = G // tp
    return fused[rank * per:(rank + 1) * per].reshape(-1, *rest)


def _split_qkv(shards: list[torch.Tensor], c: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """linear_qkv shards of all ranks -> HF q, k, v."""
    G, h, D = _qkv_dims(c)
    rest = shards[0].shape[1:]
    fused = torch.cat([s.reshape(-1, (h + 2) * D, *rest) for s in shards])  # (G, (h+2)*D, ...)
    q, k, v = fused.split([h * D, D, D], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _vocab_shard(w: torch.Tensor, padded: int, tp: int, rank: int) -> torch.Tensor:
    if padded > w.shape[0]:
        w = torch.cat([w, w.new_zeros(padded - w.shape[0], *w.shape[1:])])
    return w.chunk(tp)[rank]


def is_expert_param(name: str) -> bool:
    """A Megatron parameter of one routed expert (held by one expert-parallel rank)."""
    return ".mlp.experts." in name


def local_experts(config: ModelConfig, ep: int, ep_rank: int) -> range:
    """The global indices of the experts expert-parallel rank `ep_rank` holds."""
    per = config.num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def _moe_to_megatron(hf: dict[str, torch.Tensor], c: ModelConfig, i: int, experts: range) -> dict[str, torch.Tensor]:
    """One sparse layer's router and `experts` (global indices), HF -> Megatron names."""
    h, m = f"model.layers.{i}.{c.moe_attr}.", f"decoder.layers.{i}.mlp."
    gate, up, down = EXPERT_NAMES[c.model_type]
    out = {m + "router.weight": hf[h + "gate.weight"]}
    for e in experts:
        x, y = f"{h}experts.{e}.", f"{m}experts.local_experts.{e}."
        out[y + "linear_fc1.weight"] = torch.cat([hf[x + f"{gate}.weight"], hf[x + f"{up}.weight"]])
        out[y + "linear_fc2.weight"] = hf[x + f"{down}.weight"]
    return out


def _moe_to_hf(full: dict[str, torch.Tensor], c: ModelConfig, i: int) -> dict[str, torch.Tensor]:
    """One sparse layer's router and every expert, Megatron (global expert indices) -> HF names."""
    h, m = f"model.layers.{i}.{c.moe_attr}.", f"decoder.layers.{i}.mlp."
    gate, up, down = EXPERT_NAMES[c.model_type]
    out = {h + "gate.weight": full[m + "router.weight"]}
    for e in range(c.num_experts):
        x, y = f"{h}experts.{e}.", f"{m}experts.local_experts.{e}."
        out[x + f"{gate}.weight"], out[x + f"{up}.weight"] = full[y + "linear_fc1.weight"].chunk(2)
        out[x + f"{down}.weight"] = full[y + "linear_fc2.weight"]
    return out


def tensor_parallel_dims(config: ModelConfig) -> dict[str, int]:
    """Megatron parameter name -> the dim it is split along over TP ranks (absent: replicated)."""
    dims = {"embedding.word_embeddings.weight": 0}
    if not config.tie_word_embeddings:
        dims["output_layer.weight"] = 0
    for i in range(config.num_layers):
        m = f"decoder.layers.{i}."
        dims[m + "self_attention.linear_qkv.weight"] = 0
        dims[m + "self_attention.linear_proj.weight"] = 1
        if config.is_moe_layer(i):  # MoE models run with TP = 1 (checks.check_supported)
            continue
        dims[m + "mlp.linear_fc1.weight"] = 0
        dims[m + "mlp.linear_fc2.weight"] = 1
        if config.qkv_bias:
            dims[m + "self_attention.linear_qkv.bias"] = 0
        if config.mlp_bias:
            dims[m + "mlp.linear_fc1.bias"] = 0
    return dims


def hf_to_megatron(hf: dict[str, torch.Tensor], config: ModelConfig, tp: int = 1, rank: int = 0, ep: int = 1,
                   ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """HF-named full tensors (a Decoder state dict) -> the Megatron-named shard of TP rank `rank` and
    expert-parallel rank `ep_rank` (its experts only, by their global indices)."""
    c = config
    check_supported(c, tp, ep=ep)
    padded = padded_vocab_size(c.vocab_size, tp)
    out = {"embedding.word_embeddings.weight": _vocab_shard(hf["model.embed_tokens.weight"], padded, tp, rank),
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not c.tie_word_embeddings:
        out["output_layer.weight"] = _vocab_shard(hf["lm_head.weight"], padded, tp, rank)
    for i in range(c.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        for p in ("weight", "bias") if c.qkv_bias else ("weight",):
            out[m + f"self_attention.linear_qkv.{p}"] = _fuse_qkv(
                hf[a + f"q_proj.{p}"], hf[a + f"k_proj.{p}"], hf[a + f"v_proj.{p}"], c, tp, rank)
        if c.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf[a + "o_proj.weight"].chunk(tp, dim=1)[rank]
        if c.o_bias:
            out[m + "self_attention.linear_proj.bias"] = hf[a + "o_proj.bias"]
        if c.is_moe_layer(i):
            out.update(_moe_to_megatron(hf, c, i, local_experts(c, ep, ep_rank)))
            continue
        for p in ("weight", "bias") if c.mlp_bias else ("weight",):
            gate, up = hf[h + f"mlp.gate_proj.{p}"], hf[h + f"mlp.up_proj.{p}"]
            out[m + f"mlp.linear_fc1.{p}"] = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"].chunk(tp, dim=1)[rank]
        if c.mlp_bias:
            out[m + "mlp.linear_fc2.bias"] = hf[h + "mlp.down_proj.bias"]
    return out


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The Megatron-named shards of every TP rank (rank order) -> HF-named full tensors.

    Keys are those of `Decoder(config).named_parameters()` (so no `lm_head.weight` when tied). MoE
    layers: every expert, by global index, in the first shard (MoE models run with TP = 1)."""
    c = config
    first = shards[0]

    def cat(name: str, dim: int = 0) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    hf = {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight")[:c.vocab_size]}
    for i in range(c.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        hf[h + "input_layernorm.weight"] = first[m + "input_layernorm.weight"]
        for p in ("weight", "bias") if c.qkv_bias else ("weight",):
            q, k, v = _split_qkv([s[m + f"self_attention.linear_qkv.{p}"] for s in shards], c)
            hf[a + f"q_proj.{p}"], hf[a + f"k_proj.{p}"], hf[a + f"v_proj.{p}"] = q, k, v
        hf[a + "o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", dim=1)
        if c.o_bias:
            hf[a + "o_proj.bias"] = first[m + "self_attention.linear_proj.bias"]
        if c.qk_norm:
            hf[a + "q_norm.weight"] = first[m + "self_attention.q_layernorm.weight"]
            hf[a + "k_norm.weight"] = first[m + "self_attention.k_layernorm.weight"]
        if c.is_moe_layer(i):
            hf.update(_moe_to_hf(first, c, i))
            hf[h + "post_attention_layernorm.weight"] = first[m + "pre_mlp_layernorm.weight"]
            continue
        for p in ("weight", "bias") if c.mlp_bias else ("weight",):
            gates, ups = zip(*(s[m + f"mlp.linear_fc1.{p}"].chunk(2) for s in shards))
            hf[h + f"mlp.gate_proj.{p}"], hf[h + f"mlp.up_proj.{p}"] = torch.cat(gates), torch.cat(ups)
        hf[h + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", dim=1)
        if c.mlp_bias:
            hf[h + "mlp.down_proj.bias"] = first[m + "mlp.linear_fc2.bias"]
        hf[h + "post_attention_layernorm.weight"] = first[m + "pre_mlp_layernorm.weight"]
    hf["model.norm.weight"] = first["decoder.final_layernorm.weight"]
    if not c.tie_word_embeddings:
        hf["lm_head.weight"] = cat("output_layer.weight")[:c.vocab_size]
    return hf
