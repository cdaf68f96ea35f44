"""The exact engine's attention: jetflow.kernels.invariant.attention reading vLLM's paged KV cache.

Registered over CPU_ATTN (plugin.register), the backend CpuPlatform always picks; in an engine that is
not exact every method falls through to vLLM's CPU attention.

Per query the kernel attends key slots 0..position of its own sequence in one fixed order, so a row
computes the same bits whether it comes from a prefill, a chunked prefill, a prefix-cache hit or a
decode step, and whatever else shares the batch (the native engine and the trainer call the same
kernel). K/V written into the cache first pass the policy's FP8 KV quantizer when it has one
(jetflow.precision.kv, the function the native Attention calls; the values stay in the cache's fp32
on the E4M3 grid, as in the native engine's cache).

Cache layout. vLLM allocates (num_blocks, H_kv, block_size, 2 D) per layer; of each (block, head) row
block, the first half holds K transposed, (D, block_size), the second V, (block_size, D): a block's
keys are then contiguous along slots, the layout the kernel reads. A request's blocks are gathered
into (H_kv, D, S) / (H_kv, S, D) per call (one copy; S = its blocks x block_size), decode requests
together, each prefill chunk on its own.

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
from jetflow.rollout.vllm.plugin import UnservedError, exact_policy, layer_index


@dataclass
class Group:
    """Requests attended in one kernel call: their query rows and positions, and their KV blocks."""

    rows: torch.Tensor  # (R, T) token rows of the step (one request per row)
    positions: torch.Tensor  # (R, T) position of each query
    blocks: torch.Tensor  # (R * nblk,) KV cache blocks, request-major
    nblk: int  # blocks per request (the longest request's; shorter ones read blocks they never attend)


@dataclass
class ExactMetadata:
    """One step's attention plan, built once and shared by every layer."""

    policy: object  # the engine's policy (plugin.running_policy reads it)
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # (N,) cache slot of each token (-1: none)
    groups: list[Group] = field(default_factory=list)


def plan_groups(common: CommonAttentionMetadata, block_size: int) -> list[Group]:
    """Decode requests (one query each) in one group, every longer query (prefill chunk) in its own."""
    qsl = common.query_start_loc_cpu.tolist()
    seq_lens = common.seq_lens.cpu().tolist()
    table = common.block_table_tensor.cpu()  # (R, max blocks)
    decode, groups = [], []
    for r in range(common.num_reqs):
        start, end, seq = qsl[r], qsl[r + 1], seq_lens[r]
        if end == start:
            continue
        rows = torch.arange(start, end)
        positions = torch.arange(seq - (end - start), seq)  # the context before this step's queries, then them
        if end - start == 1:
            decode.append((r, rows, positions, seq))
        else:
            groups.append(_group([(r, rows, positions, seq)], table, block_size))
    if decode:
        groups.insert(0, _group(decode, table, block_size))
    return groups


def _group(members, table: torch.Tensor, block_size: int) -> Group:
    nblk = -(-max(seq for *_, seq in members) // block_size)
    requests = torch.tensor([r for r, *_ in members])
    return Group(rows=torch.stack([rows for _, rows, _, _ in members]),
                 positions=torch.stack([pos for _, _, pos, _ in members]),
                 blocks=table[requests, :nblk].reshape(-1).long(), nblk=nblk)


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
        return ExactMetadata(self.policy, common_attn_metadata.num_actual_tokens, common_attn_metadata.slot_mapping,
                             plan_groups(common_attn_metadata, self.block_size))


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
        """key, value (N, H_kv, D) after RoPE -> the cache slots (-1: padding, skipped)."""
        if self.policy is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        attention = self._jetflow_attention(layer)
        n = slot_mapping.shape[0]
        key, value = key[:n], value[:n]
        if attention.kv_quantizer is not None:  # the native Attention's K/V quantization, after RoPE
            key, value = attention.kv_quantizer(attention.layer_idx, key, value)
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        kt_cache, v_cache = cache_views(kv_cache)
        block, offset = slots // kt_cache.shape[-1], slots % kt_cache.shape[-1]
        kt_cache[block, :, :, offset] = key[keep].to(kt_cache.dtype)  # (n, H_kv, D)
        v_cache[block, :, offset] = value[keep].to(v_cache.dtype)

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
        hkv, d, bs = kt_cache.shape[1:]
        for g in attn_metadata.groups:
            r, t = g.rows.shape
            # one copy each: (H_kv, D, R * nblk, bs) -> (R, H_kv, D, S) with unit stride along S
            kt = kt_cache.permute(1, 2, 0, 3).index_select(2, g.blocks).view(hkv, d, r, g.nblk * bs).permute(2, 0, 1, 3)
            v = v_cache.permute(1, 0, 2, 3).index_select(1, g.blocks).view(hkv, r, g.nblk * bs, d).permute(1, 0, 2, 3)
            q = query[g.rows].transpose(1, 2)  # (R, H, T, D)
            y = invariant.attention(q, kt, v, g.positions, scale)  # (R, H, T, D)
            output[g.rows] = y.transpose(1, 2).to(output.dtype)
        return output


class ExactAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with jetflow's exact attention in exact engines (vLLM's own in the others)."""

    @staticmethod
    def get_impl_cls():
        return ExactAttentionImpl

    @staticmethod
    def get_builder_cls():
        return ExactMetadataBuilder
