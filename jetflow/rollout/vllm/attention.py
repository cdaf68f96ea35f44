"""The exact engine's attention: jetflow.kernels.invariant.attention reading vLLM's paged KV cache.

Registered over CPU_ATTN (plugin.register), the backend CpuPlatform always picks; in an engine that is
not exact every method falls through to vLLM's CPU attention.

Per query the kernel attends key slots 0..position of its own sequence in one fixed order, so a row
computes the same bits whether it comes from a prefill, a chunked prefill or a decode step, and
whatever else shares the batch (the native engine and the trainer call the same
kernel). K/V written into the cache first pass the policy's FP8 KV quantizer when it has one
(jetflow.precision.kv, the function the native Attention calls; the values stay in the cache's fp32
on the E4M3 grid, as in the native engine's cache).

Cache layout. The exact engine gives each sequence one KV block (block_size >= max_model_len, set by
the adapter), so a sequence's keys and values are contiguous and the kernel reads them where they lie,
without a copy. vLLM allocates (num_blocks, H_kv, block_size, 2 D) per layer; of each (block, head)
the first half holds K transposed, (D, block_size), the second V, (block_size, D). Decode requests go
to the kernel in one call whose batch is the span of blocks they occupy (rows of blocks without a
query attend one slot and are dropped); each prefill chunk is one call on its own block.

Shapes: N tokens in the step, R requests, H / H_kv query / KV heads, D head dim, S key slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)

from jetflow.kernels import invariant
from jetflow.rollout.vllm.policies import UnservedError, exact_policy, layer_index


@dataclass
class Group:
    """Queries attended in one kernel call, over the cache blocks [first, first + B)."""

    rows: torch.Tensor | slice  # (R, T) token rows of the step (one request per row), a slice if consecutive
    blocks: torch.Tensor | None  # (R,) each request's block minus `first`; None: the span holds them in order
    positions: torch.Tensor  # (B, T) position of each query (0 in blocks without one)
    first: int
    span: int  # B


@dataclass
class ExactMetadata:
    """One step's attention plan, built once and shared by every layer."""

    policy: object  # the engine's policy
    slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # block (n,), offset (n,) of each token with a
    # slot, and which tokens have one (None: all)
    groups: list[Group] = field(default_factory=list)
    rope: dict = field(default_factory=dict)  # the step's RoPE tables (ops.ExactRotary), computed once


def plan_slots(slot_mapping: torch.Tensor, block_size: int):
    """Cache block and offset of each token of the step (-1: a padding token without a slot)."""
    keep = None
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping = slot_mapping[keep]
    return slot_mapping // block_size, slot_mapping % block_size, keep


def plan_groups(common: CommonAttentionMetadata) -> list[Group]:
    """Decode requests (one query each) in one group, every longer query (prefill chunk) in its own."""
    qsl = common.query_start_loc_cpu.tolist()
    seq_lens = common.seq_lens.cpu().tolist()
    first_blocks = common.block_table_tensor[:, 0].tolist()  # a sequence's one block
    decode, groups = [], []
    for r in range(common.num_reqs):
        start, end, seq = qsl[r], qsl[r + 1], seq_lens[r]
        if end == start:
            continue
        member = (start, end, first_blocks[r], torch.arange(seq - (end - start), seq))
        if end - start == 1:
            decode.append(member)
        else:
            groups.append(_group([member]))
    if decode:
        groups.insert(0, _group(decode))
    return groups


def _group(members) -> Group:
    """members: (first token row, end row, block, positions (T,)) of each request, all of one length T."""
    starts = [start for start, *_ in members]
    t = members[0][1] - members[0][0]
    consecutive = starts == list(range(starts[0], starts[0] + t * len(starts), t))
    rows = (slice(starts[0], starts[-1] + t) if consecutive else
            torch.tensor(starts)[:, None] + torch.arange(t))  # (R, T)
    blocks = torch.tensor([block for _, _, block, _ in members])
    first = int(blocks.min())
    span = int(blocks.max()) - first + 1
    in_order = span == len(members) and bool((blocks == first + torch.arange(span)).all())
    positions = torch.zeros(span, t, dtype=torch.long)  # (B, T)
    positions[blocks - first] = torch.stack([pos for *_, pos in members])
    return Group(rows=rows, blocks=None if in_order else blocks - first, positions=positions, first=first, span=span)


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's (num_blocks, H_kv, block_size, 2 D) -> K^T (num_blocks, H_kv, D, block_size) and
    V (num_blocks, H_kv, block_size, D), views of its two halves (see the module docstring)."""
    nb, hkv, bs, two_d = kv_cache.shape
    halves = kv_cache.view(nb, hkv, 2, bs * (two_d // 2))
    return halves[:, :, 0].view(nb, hkv, two_d // 2, bs), halves[:, :, 1].view(nb, hkv, bs, two_d // 2)


class ExactMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.policy = exact_policy(vllm_config)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        if self.policy is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        if common_attn_metadata.max_seq_len > self.block_size:
            raise UnservedError(f"exact vLLM plugin: a sequence of {common_attn_metadata.max_seq_len} tokens spans "
                                f"several KV blocks of {self.block_size}; the exact engine needs block_size >= max_model_len")
        return ExactMetadata(self.policy, plan_slots(common_attn_metadata.slot_mapping, self.block_size),
                             plan_groups(common_attn_metadata))


class ExactAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None):
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self.policy = exact_policy(get_current_vllm_config())
        if self.policy is not None:
            unserved = {"alibi slopes": alibi_slopes is not None, "a sliding window": self.sliding_window != -1,
                        "a logits soft cap": bool(self.logits_soft_cap), "sinks": sinks is not None,
                        f"attention type {attn_type}": attn_type != AttentionType.DECODER,
                        "shared KV layers": kv_sharing_target_layer_name is not None,
                        f"kv_cache_dtype={kv_cache_dtype} (FP8 KV runs through the policy's quantizer, on an "
                        "fp32 cache)": kv_cache_dtype != "auto"}
            if any(unserved.values()):
                raise UnservedError(f"exact vLLM plugin: cannot serve attention with "
                                    f"{', '.join(k for k, v in unserved.items() if v)}")
        self._attention = None  # the policy's jetflow Attention of this layer (found at the first call)

    def _jetflow_attention(self, layer) -> torch.nn.Module:
        if self._attention is None:
            attention = self.policy.model.layers[layer_index(layer.layer_name)].self_attn
            self._attention = (attention,)  # in a tuple: not registered as a submodule anywhere
        return self._attention[0]

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """key, value (N, H_kv, D) after RoPE -> their cache slots (planned once per step: ExactMetadata.slots)."""
        if self.policy is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        from vllm.forward_context import get_forward_context

        block, offset, keep = get_forward_context().attn_metadata[layer.layer_name].slots
        attention = self._jetflow_attention(layer)
        key, value = key[:slot_mapping.shape[0]], value[:slot_mapping.shape[0]]
        if keep is not None:
            key, value = key[keep], value[keep]
        if attention.kv_quantizer is not None:  # the native Attention's K/V quantization, after RoPE
            key, value = attention.kv_quantizer(attention.layer_idx, key, value)
        kt_cache, v_cache = cache_views(kv_cache)
        kt_cache[block, :, :, offset] = key.to(kt_cache.dtype)  # (n, H_kv, D)
        v_cache[block, :, offset] = value.to(v_cache.dtype)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata, output: torch.Tensor, output_scale=None, output_block_scale=None) -> torch.Tensor:
        """query (N, H, D) -> output (N, H, D), attending the cache (this step's K/V already written)."""
        if self.policy is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if attn_metadata is None:  # vLLM's warm-up
            return output
        scale = self._jetflow_attention(layer).scale
        kt_cache, v_cache = cache_views(kv_cache)
        for g in attn_metadata.groups:
            r, t = g.positions.shape if g.blocks is None else (len(g.blocks), g.positions.shape[1])
            q = query[g.rows].view(r, t, *query.shape[1:]).transpose(1, 2)  # (R, H, T, D)
            if g.blocks is not None:  # a row per block of the span, the requests' queries at their blocks
                q = q.new_zeros(g.span, *q.shape[1:]).index_copy_(0, g.blocks, q)  # (B, H, T, D)
            kt, v = kt_cache[g.first:g.first + g.span], v_cache[g.first:g.first + g.span]  # views
            y = invariant.attention(q, kt, v, g.positions, scale)  # (B, H, T, D)
            y = (y if g.blocks is None else y[g.blocks]).transpose(1, 2)  # (R, T, H, D)
            output[g.rows] = y.reshape(r * t, *y.shape[2:]) if isinstance(g.rows, slice) else y
        return output


class ExactAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with jetflow's exact attention in exact engines (vLLM's own in the others)."""

    @staticmethod
    def get_impl_cls():
        return ExactAttentionImpl

    @staticmethod
    def get_builder_cls():
        return ExactMetadataBuilder


def running_metadata():
    """The attention plan (attention.ExactMetadata) of the exact engine whose forward runs now, or None
    (another engine, or a warm-up run without attention metadata). For ops that vLLM shares between
    engines (the rotary embedding is cached by its parameters): they ask at each call."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # micro-batched runs: one dict per micro-batch
        metadata = metadata[0] if metadata else None
    first = next(iter(metadata.values()), None) if isinstance(metadata, dict) else None
    return first if isinstance(first, ExactMetadata) else None
