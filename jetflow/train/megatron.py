"""Megatron-Core trainer model (`train.backend=megatron`): a GPTModel whose linear layers are jetflow's.

    policy = MegatronPolicy.from_decoder(decoder, kind="fp8", recipe=recipe, tensor_parallel_size=2)
    hidden = policy.forward_hidden(input_ids, attention_mask=mask)   # (B, T, C)
    logits = policy.lm_head(hidden)                                  # (B, T, V), gathered over TP
    Trainer(policy, cfg.train, cfg.algo)                             # trains it unchanged
    policy.hf_state_dict(); policy.quantized_weights()                # what sync ships to rollout

What is Megatron's and what is jetflow's:
- Megatron-Core builds the model (GPTModel, TransformerBlock, SelfAttention, MLP, VocabParallelEmbedding),
  owns the tensor-parallel layout of every parameter and the TP collectives.
- Every linear layer is a `ColumnParallelLinear` / `RowParallelLinear` subclass whose local GEMM is
  jetflow's: `F.linear` (fp32), `jetflow.precision.bf16_linear` (bf16) or `jetflow.precision.fp8_linear`
  (fp8: FP8 fprop, dgrad and wgrad with the recipe's quantizer, the one the native Decoder and the
  rollout engine use). Norms are the native Decoder's RMSNorm; RoPE tables come from the native
  `rope_inv_freq` (Llama-3 scaling included) and positions from the attention mask, so left padding
  behaves exactly as in `Decoder.forward_hidden`.

Same bytes as the native model under FP8. Megatron fuses q/k/v into `linear_qkv` (interleaved per
KV group) and gate/up into `linear_fc1`. Quantizing a fused weight in 128x128 blocks would mix rows of
different HF matrices in one block, so the FP8 path quantizes each HF sub-matrix ("segment": q, k, v,
gate, up) of the local shard separately and runs one FP8 GEMM per segment. With tensor parallelism a
shard must cover whole blocks (out_features / tp a multiple of 128 for column-parallel layers,
in_features / tp for row-parallel ones); then each rank quantizes exactly the blocks of the full HF
weight, and `quantized_weights()` gathers bytes equal to the native model's.

Megatron-Core is imported lazily, only in this module (`pip install megatron-core==0.16.1`). On the CPU
two of its calls assume CUDA; `patch_megatron_for_cpu()` replaces them (see its docstring).

Not supported: pipeline parallelism (NotImplementedError, see `initialize_parallel`), sequence
parallelism, fewer KV heads than TP ranks, o_proj bias without MLP bias (or the reverse).
Shapes: B batch, T tokens, C hidden, V vocab, G KV groups, D head dim, I intermediate size.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from jetflow.model.decoder import Decoder, ModelConfig, RMSNorm, UnsupportedModelError, rope_inv_freq
from jetflow.precision import FP8Recipe, QuantizedTensor, bf16_linear, fp8_linear, quantize_blocks, resolve_backend

INSTALL_HINT = "pip install megatron-core==0.16.1"


class MegatronConfigError(UnsupportedModelError):
    """The model or parallel layout cannot be expressed on the Megatron backend."""


def _require_megatron():
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise ImportError(f"train.backend=megatron needs Megatron-Core: {INSTALL_HINT} ({e})") from None


# ------------------------------------------------------------------------------------------------
# Checks of the model against the parallel layout (pure: no Megatron needed)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """VocabParallelEmbedding splits rows evenly over TP ranks: pad the vocab to a multiple of tp."""
    return -(-vocab_size // tp) * tp


def check_supported(config: ModelConfig, tp: int = 1) -> None:
    """Raise MegatronConfigError if `config` cannot be built with tensor-parallel size `tp`."""
    c = config
    if c.o_bias != c.mlp_bias:
        raise MegatronConfigError(
            f"o_bias={c.o_bias} with mlp_bias={c.mlp_bias}: Megatron has one `add_bias_linear` flag for "
            "o_proj, gate/up and down projections")
    if c.o_bias and not c.qkv_bias:
        raise MegatronConfigError("o_proj/MLP biases without q/k/v biases: Megatron's add_bias_linear also "
                                  "adds a q/k/v bias")
    if c.num_heads % c.num_kv_heads:
        raise MegatronConfigError(f"num_heads {c.num_heads} is not a multiple of num_kv_heads {c.num_kv_heads}")
    if tp < 1:
        raise MegatronConfigError(f"tensor_parallel_size={tp} must be >= 1")
    if c.num_kv_heads % tp:
        raise MegatronConfigError(
            f"num_kv_heads={c.num_kv_heads} is not a multiple of tensor_parallel_size={tp}: each rank must hold "
            "whole KV groups (the q/k/v split of Megatron's fused linear_qkv)")
    if c.intermediate_size % tp:
        raise MegatronConfigError(f"intermediate_size={c.intermediate_size} is not a multiple of "
                                  f"tensor_parallel_size={tp}")


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


def segment_kind(kind: str, recipe: FP8Recipe | None, name: str, layer: int | None, num_layers: int) -> str:
    """The GEMM kind of one HF linear under `kind`: fp8 layers the recipe keeps stay in bf16
    (the same rule as `jetflow.precision.apply_precision`)."""
    if kind == "fp8" and recipe.keeps_in_high_precision(name, layer, num_layers):
        return "bf16"
    return kind


def check_fp8_tp_alignment(config: ModelConfig, tp: int, recipe: FP8Recipe, kind: str = "fp8") -> None:
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


# ------------------------------------------------------------------------------------------------
# Weight names and layouts, Megatron <-> HF (pure tensor functions)
#
# Megatron linear_qkv rows, per KV group g (G groups, h = num_heads / G queries per group):
#     [q_{g*h} .. q_{g*h+h-1} | k_g | v_g]  each head D rows; TP rank r holds groups [r*G/tp, (r+1)*G/tp)
# Megatron linear_fc1 rows on TP rank r: [gate rows of shard r | up rows of shard r]
# Row-parallel weights (linear_proj, linear_fc2) split their columns; their biases are replicated.
# Vocab-parallel weights (embedding, output_layer) split rows of the vocab padded to a multiple of tp.


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


def tensor_parallel_dims(config: ModelConfig) -> dict[str, int]:
    """Megatron parameter name -> the dim it is split along over TP ranks (absent: replicated)."""
    dims = {"embedding.word_embeddings.weight": 0}
    if not config.tie_word_embeddings:
        dims["output_layer.weight"] = 0
    for i in range(config.num_layers):
        m = f"decoder.layers.{i}."
        dims[m + "self_attention.linear_qkv.weight"] = 0
        dims[m + "self_attention.linear_proj.weight"] = 1
        dims[m + "mlp.linear_fc1.weight"] = 0
        dims[m + "mlp.linear_fc2.weight"] = 1
        if config.qkv_bias:
            dims[m + "self_attention.linear_qkv.bias"] = 0
        if config.mlp_bias:
            dims[m + "mlp.linear_fc1.bias"] = 0
    return dims


def hf_to_megatron(hf: dict[str, torch.Tensor], config: ModelConfig, tp: int = 1, rank: int = 0
                   ) -> dict[str, torch.Tensor]:
    """HF-named full tensors (a Decoder state dict) -> the Megatron-named shard of TP rank `rank`."""
    c = config
    check_supported(c, tp)
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
        for p in ("weight", "bias") if c.mlp_bias else ("weight",):
            gate, up = hf[h + f"mlp.gate_proj.{p}"], hf[h + f"mlp.up_proj.{p}"]
            out[m + f"mlp.linear_fc1.{p}"] = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"].chunk(tp, dim=1)[rank]
        if c.mlp_bias:
            out[m + "mlp.linear_fc2.bias"] = hf[h + "mlp.down_proj.bias"]
    return out


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The Megatron-named shards of every TP rank (rank order) -> HF-named full tensors.

    Keys are those of `Decoder(config).named_parameters()` (so no `lm_head.weight` when tied)."""
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


# ------------------------------------------------------------------------------------------------
# Linear layers: Megatron's parallel linears with jetflow's GEMMs


@dataclass(frozen=True)
class Segment:
    """Rows of a (possibly fused) local weight that belong to one HF linear.

    The local weight is viewed as (groups, rows_per_group, K); the segment is [:, start:stop].
    linear_qkv: groups = local KV groups, segments q, k, v. linear_fc1: groups = 1, segments gate, up.
    """

    name: str  # HF module name, e.g. model.layers.0.self_attn.k_proj
    groups: int
    start: int
    stop: int
    kind: str  # fp32 | bf16 | fp8


def _segment_rows(t: torch.Tensor, seg: Segment) -> torch.Tensor:
    """The segment's rows of a weight (N, K) or bias (N,): (groups * (stop - start), ...)."""
    rest = t.shape[1:]
    return t.reshape(seg.groups, -1, *rest)[:, seg.start:seg.stop].reshape(-1, *rest)


def _dense(kind: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if kind == "fp32":
        return F.linear(x, w, b)
    if kind == "bf16":
        return bf16_linear(x, w, b)
    raise ValueError(f"linear kind {kind!r}: valid kinds are fp32, bf16, fp8")


class _JetflowLinearMixin:
    """The local GEMM of a Megatron parallel linear, computed by jetflow under each segment's kind.

    Megatron's `ColumnParallelLinear.forward` / `RowParallelLinear.forward` keep doing the TP work
    (all-reduce of row-parallel outputs, gathers, bias handling); they call `_forward_impl` for the
    local (M, K_local) x (N_local, K_local)^T product, which this mixin replaces.
    """

    parallel_dim = 0  # 0: column-parallel (out_features split), 1: row-parallel (in_features split)
    segments: tuple[Segment, ...] = ()  # empty: one plain fp32 GEMM (before configure)
    recipe: FP8Recipe | None = None
    gemm_backend = "auto"
    _wq_key: tuple | None = None  # (data_ptr, version, dtype, device) of the weight _wq was made from
    _wq: dict[str, QuantizedTensor] = {}

    def configure(self, segments: list[Segment], recipe: FP8Recipe | None, gemm_backend: str = "auto") -> None:
        groups = {s.groups for s in segments}
        if len(groups) != 1 or [s.start for s in segments][1:] != [s.stop for s in segments][:-1]:
            raise ValueError(f"segments must share `groups` and tile the rows in order: {segments}")
        if any(s.kind == "fp8" for s in segments) and recipe is None:
            raise ValueError(f"{segments[0].name}: an fp8 segment needs an FP8Recipe")
        self.segments, self.recipe, self.gemm_backend = tuple(segments), recipe, gemm_backend
        self._wq_key, self._wq = None, {}

    def _forward_impl(self, input, weight, bias=None, allreduce_dgrad=False, sequence_parallel=False, **_):
        if sequence_parallel:
            raise NotImplementedError("jetflow's Megatron linears do not support sequence parallelism")
        if allreduce_dgrad:  # column-parallel, tp > 1: identity forward, all-reduce of dX in backward
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
            input = copy_to_tensor_model_parallel_region(input, group=self.tp_group)
        return self.local_linear(input, weight, bias)

    def local_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x (..., K_local) -> (..., N_local); one GEMM per segment when kinds differ or any is fp8."""
        kinds = {s.kind for s in self.segments} or {"fp32"}
        if len(kinds) == 1 and "fp8" not in kinds:
            return _dense(kinds.pop(), x, weight, bias)
        wq = self.quantized_segments(weight)
        outs = []
        for seg in self.segments:
            w = _segment_rows(weight, seg)  # (groups * rows, K)
            b = None if bias is None else _segment_rows(bias, seg)
            if seg.kind == "fp8":
                y = fp8_linear(x, w, b, wq[seg.name], self.recipe, self.gemm_backend, seg.name)
            else:
                y = _dense(seg.kind, x, w, b)
            outs.append(y.unflatten(-1, (seg.groups, seg.stop - seg.start)))  # (..., groups, rows)
        return torch.cat(outs, dim=-1).flatten(-2)  # (..., N_local) in Megatron's fused row order

    def quantized_segments(self, weight: torch.Tensor | None = None) -> dict[str, QuantizedTensor]:
        """{HF module name: this rank's FP8 shard} of the fp8 segments, quantized once per weight version."""
        weight = self.weight if weight is None else weight
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if key != self._wq_key:
            r = self.recipe
            emulate = resolve_backend(self.gemm_backend, weight.device) == "emulate"
            self._wq = {}
            for seg in self.segments:
                if seg.kind != "fp8":
                    continue
                q = quantize_blocks(_segment_rows(weight.detach(), seg), r.weight_block, r.forward_format,
                                    r.scale_rule, r.margin, f"{seg.name}.weight")
                self._wq[seg.name] = q.with_dequantized_cache() if emulate else q
            self._wq_key = key
        return self._wq


class MegatronRMSNorm(RMSNorm):
    """The native Decoder's RMSNorm (fp32 normalization, cast, then scale) with Megatron's signature."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps)


_CLASSES: dict[str, type] = {}


def _linear_classes() -> tuple[type, type]:
    """(JetflowColumnParallelLinear, JetflowRowParallelLinear), made on first use (Megatron is lazy)."""
    if not _CLASSES:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        _CLASSES["column"] = type("JetflowColumnParallelLinear", (_JetflowLinearMixin, ColumnParallelLinear),
                                  {"parallel_dim": 0, "__doc__": "ColumnParallelLinear with jetflow's GEMMs."})
        _CLASSES["row"] = type("JetflowRowParallelLinear", (_JetflowLinearMixin, RowParallelLinear),
                               {"parallel_dim": 1, "__doc__": "RowParallelLinear with jetflow's GEMMs."})
    return _CLASSES["column"], _CLASSES["row"]


# ------------------------------------------------------------------------------------------------
# Process groups, and Megatron on the CPU


def patch_megatron_for_cpu() -> None:
    """Replace Megatron-Core's two CUDA-only calls on the forward path by CPU equivalents (process-wide).

    1. `GlobalMemoryBuffer.get_tensor` allocates its scratch buffer (the `baddbmm` input of
       DotProductAttention) on `torch.cuda.current_device()`: here it allocates on the CPU.
    2. `CudaRNGStatesTracker.fork` swaps the CUDA RNG state around attention dropout: here it swaps the
       CPU generator's state with the tracker's named state (registered by `_seed_cpu_rng_tracker`).
    Only applied when a policy is built for the CPU; idempotent. Megatron-Core 0.16.1.
    """
    from megatron.core import utils as mcore_utils
    from megatron.core.tensor_parallel import random as mcore_random

    if getattr(mcore_utils.GlobalMemoryBuffer.get_tensor, "_jetflow_cpu", False):
        return

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        required = math.prod(tensor_shape)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < required:
            buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
        return buf[:required].view(*tensor_shape)

    @contextlib.contextmanager
    def fork(self, name=mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise RuntimeError(f"CPU rng state {name!r} was not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

    get_tensor._jetflow_cpu = True
    mcore_utils.GlobalMemoryBuffer.get_tensor = get_tensor
    mcore_random.CudaRNGStatesTracker.fork = fork


def _seed_cpu_rng_tracker(seed: int) -> None:
    """The CPU counterpart of `model_parallel_cuda_manual_seed`: one named CPU state per TP rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mcore_random

    tracker = mcore_random.get_cuda_rng_tracker()
    name = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME
    if name not in tracker.states_:
        gen = torch.Generator().manual_seed(seed + 2718 + ps.get_tensor_model_parallel_rank())
        tracker.states_[name] = gen.get_state()


def initialize_parallel(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                        device: torch.device | str = "cpu") -> None:
    """torch.distributed (gloo on the CPU, NCCL on GPUs) and Megatron's TP/PP/DP process groups.

    Under torchrun the world comes from its environment; without it a single-process world is made
    (only valid for tensor_parallel_size == 1). Idempotent; a second call with other sizes raises.
    Pipeline parallelism raises NotImplementedError: jetflow's Trainer drives forward and backward
    itself (forward_hidden -> lm_head -> loss.backward()), while PP needs Megatron's microbatch
    schedule (`get_forward_backward_func`) to own that loop; not wired up yet.
    """
    _require_megatron()
    from megatron.core import parallel_state as ps

    if pipeline_parallel_size != 1:
        raise NotImplementedError(
            f"pipeline_parallel_size={pipeline_parallel_size}: pipeline parallelism is not implemented on "
            "jetflow's Megatron backend (the Trainer's forward/backward would have to run inside Megatron's "
            "pipeline schedule); use tensor parallelism and data parallelism")
    device = torch.device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda" and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tensor_parallel_size, pipeline_parallel_size):
            raise MegatronConfigError(f"Megatron parallel state already initialized with (tp, pp) = {have}, "
                                      f"not {(tensor_parallel_size, pipeline_parallel_size)}")
        return
    world = dist.get_world_size()
    if world % (tensor_parallel_size * pipeline_parallel_size):
        raise MegatronConfigError(f"world size {world} is not a multiple of tp * pp = "
                                  f"{tensor_parallel_size * pipeline_parallel_size}")
    ps.initialize_model_parallel(tensor_parallel_size, pipeline_parallel_size)


class _GatherLastDim(torch.autograd.Function):
    """All-gather TP shards along the last dim; backward keeps this rank's slice of the gradient.

    Megatron's `gather_from_tensor_model_parallel_region` does the same but allocates its output on
    `torch.cuda.current_device()`; this one works on any device (gloo on the CPU, NCCL on GPUs)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank = group, dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(ctx.group), dim=-1)[ctx.rank].contiguous(), None


# ------------------------------------------------------------------------------------------------
# The model


def _transformer_config(c: ModelConfig, tp: int, params_dtype: torch.dtype, init_weights: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size,
        num_attention_heads=c.num_heads, num_query_groups=c.num_kv_heads, kv_channels=c.head_dim,
        normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps, qk_layernorm=c.qk_norm,
        gated_linear_unit=True, activation_func=F.silu,  # SwiGLU: silu(gate) * up
        add_bias_linear=c.o_bias, add_qkv_bias=c.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        # fused kernels are CUDA/TE-only, and our own linears replace the fused GEMM paths
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, sequence_parallel=False,
        use_cpu_initialization=True, perform_initialization=init_weights, params_dtype=params_dtype,
    )


def _block_spec(config: ModelConfig):
    """A local (no Transformer Engine) layer spec with jetflow's linears and RMSNorm."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    column, row = _linear_classes()
    qk_norm = MegatronRMSNorm if config.qk_norm else IdentityOp  # Qwen3: RMSNorm over D per head, before RoPE
    layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=MegatronRMSNorm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(
                                      linear_qkv=column, core_attention=DotProductAttention, linear_proj=row,
                                      q_layernorm=qk_norm, k_layernorm=qk_norm)),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=MegatronRMSNorm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)),
        mlp_bda=get_bias_dropout_add,
    ))
    return TransformerBlockSubmodules(layer_specs=[layer] * config.num_layers, layer_norm=MegatronRMSNorm)


class MegatronPolicy(nn.Module):
    """A Megatron-Core GPTModel behind the native Decoder's trainer interface.

    kind: fp32 | bf16 | fp8 (as in `apply_precision`; fp8 layers the recipe keeps run in bf16).
    Parameters are fp32 master weights on every path (`params_dtype`); only the GEMMs change.
    Each rank holds its TP shards; `parameters()` are what an optimizer on this rank steps.
    """

    def __init__(self, config: ModelConfig, *, kind: str = "fp32", recipe: FP8Recipe | None = None,
                 gemm_backend: str = "auto", tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 device: torch.device | str = "cpu", params_dtype: torch.dtype = torch.float32,
                 init_weights: bool = True, seed: int = 0):
        super().__init__()
        if kind not in ("fp32", "bf16", "fp8"):
            raise ValueError(f"MegatronPolicy kind={kind!r}: valid kinds are fp32, bf16, fp8")
        if kind == "fp8" and recipe is None:
            raise ValueError("MegatronPolicy kind='fp8' needs an FP8Recipe")
        tp = tensor_parallel_size
        check_supported(config, tp)
        check_fp8_tp_alignment(config, tp, recipe, kind)
        device = torch.device(device)
        initialize_parallel(tp, pipeline_parallel_size, device)
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        if device.type == "cpu":
            patch_megatron_for_cpu()
            _seed_cpu_rng_tracker(seed)
        else:
            model_parallel_cuda_manual_seed(seed)

        self.config, self.kind, self.recipe, self.gemm_backend = config, kind, recipe, gemm_backend
        self.tp_size, self.tp_rank = tp, ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.padded_vocab = padded_vocab_size(config.vocab_size, tp)
        torch.manual_seed(seed)  # Megatron's CPU init draws the full weight on every rank: same on all
        mcfg = _transformer_config(config, tp, params_dtype, init_weights)
        self.gpt = GPTModel(mcfg, _block_spec(config), vocab_size=self.padded_vocab,
                            max_sequence_length=config.max_position_embeddings, position_embedding_type="rope",
                            rotary_base=int(config.rope_theta),
                            share_embeddings_and_output_weights=config.tie_word_embeddings, parallel_output=True)
        # GPTModel hard-codes Megatron's ColumnParallelLinear for lm_head: swap in ours (same layout)
        column, _ = _linear_classes()
        old = self.gpt.output_layer
        self.gpt.output_layer = column(
            config.hidden_size, self.padded_vocab, config=mcfg, init_method=mcfg.init_method, bias=False,
            gather_output=False, skip_weight_param_allocation=config.tie_word_embeddings, tp_group=self.tp_group)
        if old.weight is not None:
            self.gpt.output_layer.weight = old.weight
        self._configure_linears()
        self.register_buffer("rope_inv_freq", rope_inv_freq(config), persistent=False)
        self.embed_grid: torch.dtype | None = None  # see Decoder.embed_grid
        self.to(device)

    # Construction helpers ----------------------------------------------------------------------
    @classmethod
    def from_decoder(cls, decoder: Decoder, **kwargs) -> "MegatronPolicy":
        """A policy with `decoder`'s config and weights (kwargs as in __init__)."""
        kwargs.setdefault("init_weights", False)
        kwargs.setdefault("device", decoder.model.embed_tokens.weight.device)
        policy = cls(decoder.config, **kwargs)
        policy.load_hf_state_dict(decoder.state_dict())
        return policy

    def _configure_linears(self) -> None:
        c, tp = self.config, self.tp_size
        G, h, D = _qkv_dims(c)
        inter = c.intermediate_size // tp

        def seg(name, layer, groups, start, stop):
            return Segment(name, groups, start, stop, segment_kind(self.kind, self.recipe, name, layer, c.num_layers))

        for i, layer in enumerate(self.gpt.decoder.layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            attn, mlp = layer.self_attention, layer.mlp
            g = G // tp
            attn.linear_qkv.configure([seg(a + "q_proj", i, g, 0, h * D), seg(a + "k_proj", i, g, h * D, (h + 1) * D),
                                       seg(a + "v_proj", i, g, (h + 1) * D, (h + 2) * D)], self.recipe,
                                      self.gemm_backend)
            attn.linear_proj.configure([seg(a + "o_proj", i, 1, 0, c.hidden_size)], self.recipe, self.gemm_backend)
            mlp.linear_fc1.configure([seg(m + "gate_proj", i, 1, 0, inter), seg(m + "up_proj", i, 1, inter, 2 * inter)],
                                     self.recipe, self.gemm_backend)
            mlp.linear_fc2.configure([seg(m + "down_proj", i, 1, 0, c.hidden_size)], self.recipe, self.gemm_backend)
        self.gpt.output_layer.configure([seg("lm_head", None, 1, 0, self.padded_vocab // tp)], self.recipe,
                                        self.gemm_backend)

    def _output_weight(self) -> torch.Tensor:
        """lm_head's local (V_pad / tp, C) weight: the embedding's when tied."""
        if self.config.tie_word_embeddings:
            return self.gpt.embedding.word_embeddings.weight
        return self.gpt.output_layer.weight

    def _linears(self):
        """Every jetflow parallel linear of the model (their `segments` name the HF linears)."""
        column, row = _linear_classes()
        for module in self.gpt.modules():
            if isinstance(module, (column, row)):
                yield module

    # The trainer interface ---------------------------------------------------------------------
    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (B, T, C), after the last norm; the semantics of `Decoder.forward_hidden`
        without a cache: attention_mask bool (B, T), True = real token (left padding);
        position_ids default cumsum(mask) - 1 (arange without a mask); a padding token attends only
        to itself."""
        B, T = input_ids.shape
        device = input_ids.device
        if attention_mask is not None:
            if attention_mask.shape != (B, T):
                raise ValueError(f"attention_mask must be (B, T) = ({B}, {T}), got {tuple(attention_mask.shape)}")
            attention_mask = attention_mask.to(device=device, dtype=torch.bool)
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
            else:
                position_ids = torch.arange(T, device=device).expand(B, T)

        # Megatron's mask: bool, True = masked out, broadcast over heads. Always explicit: with None,
        # Megatron builds its causal mask with device="cuda" (get_default_causal_mask).
        slot = torch.arange(T, device=device)
        allowed = (slot[None, :] <= slot[:, None])[None]  # (1, T, T) causal
        if attention_mask is not None:
            allowed = (allowed & attention_mask[:, None, :]) | (slot[None, :] == slot[:, None])[None]  # (B, T, T)
        mask = ~allowed[:, None]  # (B|1, 1, T, T)

        # RoPE angles per (token, sequence): Megatron applies cos/sin of these in fp32, cast to x's dtype
        freqs = position_ids[..., None].float() * self.rope_inv_freq.float()  # (B, T, D/2)
        rope = torch.cat((freqs, freqs), dim=-1).transpose(0, 1)[:, :, None, :]  # (T, B, 1, D)

        x = self.gpt.embedding(input_ids=input_ids, position_ids=position_ids)  # (T, B, C)
        if self.embed_grid is not None:  # as Decoder.embed_grid: embeddings on the bf16 grid
            x = x.to(self.embed_grid).to(x.dtype)
        x = self.gpt.decoder(hidden_states=x, attention_mask=mask, rotary_pos_emb=rope)  # (T, B, C), final norm
        return x.transpose(0, 1)  # (B, T, C)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> logits (B, T, V), the vocab-parallel shards gathered (and the padding dropped)."""
        logits, _ = self.gpt.output_layer(hidden, weight=self._output_weight() if self.config.tie_word_embeddings
                                          else None)  # (B, T, V_pad / tp)
        if self.tp_size > 1:
            logits = _GatherLastDim.apply(logits, self.tp_group)  # (B, T, V_pad)
        return logits[..., :self.config.vocab_size]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) (argument order of `Decoder.forward`)."""
        return self.lm_head(self.forward_hidden(input_ids, attention_mask, position_ids))

    def num_params(self) -> int:
        """Parameters of the full model (every TP shard, not the vocabulary padding): `Decoder.num_params`."""
        split = set(tensor_parallel_dims(self.config))
        n = sum(p.numel() * (self.tp_size if name in split else 1) for name, p in self.gpt.named_parameters())
        vocab_tables = 1 if self.config.tie_word_embeddings else 2
        return n - vocab_tables * (self.padded_vocab - self.config.vocab_size) * self.config.hidden_size

    # Weights in HF names -----------------------------------------------------------------------
    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return parts

    @torch.no_grad()
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors gathered from all TP ranks (every rank gets them); the keys of
        `Decoder(config).named_parameters()`. A collective: call it on every rank of the TP group."""
        local = {n: p.detach() for n, p in self.gpt.named_parameters()}
        shards = [dict(local) for _ in range(self.tp_size)]
        if self.tp_size > 1:
            for name in tensor_parallel_dims(self.config):
                for r, part in enumerate(self._gather(local[name])):
                    shards[r][name] = part
        return megatron_to_hf(shards, self.config)

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy HF-named full tensors (e.g. a Decoder's state dict) into this rank's shards."""
        local = hf_to_megatron(state_dict, self.config, self.tp_size, self.tp_rank)
        params = dict(self.gpt.named_parameters())
        missing, unexpected = set(params) - set(local), set(local) - set(params)
        if missing or unexpected:
            raise KeyError(f"Megatron parameters without HF weights: {sorted(missing)[:5]}; "
                           f"HF weights without Megatron parameters: {sorted(unexpected)[:5]}")
        for name, tensor in local.items():
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: shard shape {tuple(tensor.shape)} != parameter {tuple(params[name].shape)}")
            params[name].copy_(tensor)

    @torch.no_grad()
    def quantized_weights(self) -> dict[str, QuantizedTensor]:
        """{HF module name: QuantizedTensor of the full weight} for every FP8 linear: this step's bytes
        (the ones the forward computes with), shards gathered over TP. A collective under TP > 1."""
        out = {}
        for module in self._linears():
            weight = self._output_weight() if module is self.gpt.output_layer else module.weight
            for name, q in module.quantized_segments(weight).items():
                if self.tp_size > 1:
                    dim = module.parallel_dim
                    data = torch.cat([p.view(q.data.dtype) for p in self._gather(q.data.view(torch.uint8))], dim)
                    q = QuantizedTensor(data, torch.cat(self._gather(q.scale_inv), dim), q.block)
                out[name] = q
        return out

    # Gradients ---------------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients over the TP group: TP-split parameters counted on every
        rank, replicated ones (norms, row-parallel biases) once. The native Trainer's
        `clip_grad_norm_` sees only this rank's shards; under TP > 1 clip with `clip_grad_norm_` below."""
        split = set(tensor_parallel_dims(self.config))
        total = torch.zeros((), dtype=torch.float32, device=self.rope_inv_freq.device)
        for name, p in self.gpt.named_parameters():
            if p.grad is not None and (name in split or self.tp_rank == 0):
                total += p.grad.detach().float().pow(2).sum()
        if self.tp_size > 1:
            dist.all_reduce(total, group=self.tp_group)
        return total.sqrt()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale all gradients so that the global (TP-aware) norm is at most max_norm; returns the norm."""
        norm = self.grad_norm()
        coef = max_norm / (norm + 1e-6)
        if bool(coef < 1):
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    def allreduce_data_parallel_grads(self) -> None:
        """Average gradients over Megatron's data-parallel group (when world > tp); call after backward."""
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group()
        world = dist.get_world_size(group)
        if world == 1:
            return
        for p in self.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(world)
