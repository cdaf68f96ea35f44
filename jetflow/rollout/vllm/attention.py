"""The exact engine's attention: jetflow's paged exact kernel (jetflow.kernels.paged) on vLLM's paged KV cache.

Registered over CPU_ATTN (plugin.register), the backend CpuPlatform always picks; in an engine that is
not exact every method falls through to vLLM's CPU attention.

Pages. The exact engine runs vLLM's block size = 64 (kernels.paged.PAGE, the exact attention's KV
block; the adapter sets it), so vLLM's blocks are the native engine's pages: a sequence holds
ceil(len / 64) blocks that vLLM allocates as it grows, and each request's row of vLLM's block table
(CommonAttentionMetadata.block_table_tensor) is the kernel's block table. The kernel visits a query's
keys 0..position in one fixed order, one block pointer per 64 slots, so a row computes the same bits
whichever blocks it got, whether it comes from a prefill, a chunked prefill or a decode step, and
whatever else shares the batch (the native engine and the trainer compute the same function).

Storage. vLLM allocates (num_blocks, H_kv, 64, 2 D) per layer; of each (block, head) the first half
holds K transposed, (D, 64), the second V, (64, D): the kernel reads both halves in place through
their strides. The cache holds the policy's K/V rounding in its own bytes (`cache_dtype`): under
precision.kv_cache_fp8 vLLM's kv_cache_dtype="fp8" (one byte a value, uint8 in vLLM) holding the E4M3
codes of jetflow's FP8 K/V quantizer (jetflow.precision.kv: value = code * per-layer fp32 scale, the
scales of the trainer's latest calibration, shipped with the weights), converted in registers by the
kernel as for the native engine's FP8 pages; bf16 under the bf16 mode's K/V rounding; else the
model's fp32. Decode requests go to the kernel in one call; each prefill chunk is one call.

Shapes: N tokens in the step, R requests, H / H_kv query / KV heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)

from jetflow.kernels import paged
from jetflow.rollout.vllm.policies import UnservedError, exact_policy, layer_index

CACHE_DTYPES = {torch.float8_e4m3fn: "fp8", torch.bfloat16: "bfloat16"}
"""A K/V rounding's page dtype -> vLLM's kv_cache_dtype holding its bytes (others: "auto", the model's fp32)."""


def cache_dtype(policy) -> str:
    """vLLM's kv_cache_dtype for an exact engine computing with `policy`: its K/V rounding's own bytes."""
    quantizer = policy.model.layers[0].self_attn.kv_quantizer  # KVQuantizer | BF16KVRounding | None
    return "auto" if quantizer is None else CACHE_DTYPES.get(quantizer.page_dtype, "auto")


@dataclass
class Group:
    """Queries attended in one kernel call: R requests of T queries each."""

    rows: torch.Tensor | slice  # (R, T) token rows of the step (one request per row), a slice if consecutive
    table: torch.Tensor  # (R, nb) int32: the requests' rows of vLLM's block table
    positions: torch.Tensor  # (R, T) position of each query


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
    decode, groups = [], []
    for r in range(common.num_reqs):
        start, end, seq = qsl[r], qsl[r + 1], seq_lens[r]
        if end == start:
            continue
        member = (r, start, end, torch.arange(seq - (end - start), seq))
        if end - start == 1:
            decode.append(member)
        else:
            groups.append(_group([member], common.block_table_tensor))
    if decode:
        groups.insert(0, _group(decode, common.block_table_tensor))
    return groups


def _group(members, block_table: torch.Tensor) -> Group:
    """members: (request, first token row, end row, positions (T,)) of each request, all of one length T."""
    starts = [start for _, start, _, _ in members]
    t = members[0][2] - members[0][1]
    consecutive = starts == list(range(starts[0], starts[0] + t * len(starts), t))
    rows = (slice(starts[0], starts[-1] + t) if consecutive else
            torch.tensor(starts)[:, None] + torch.arange(t))  # (R, T)
    positions = torch.stack([pos for *_, pos in members])  # (R, T)
    nb = -(-(int(positions.max()) + 1) // paged.PAGE)  # blocks the group's longest sequence holds
    requests = torch.tensor([r for r, *_ in members])
    table = block_table[requests.to(block_table.device), :nb].to("cpu", torch.int32).contiguous()  # (R, nb)
    return Group(rows=rows, table=table, positions=positions)


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's (num_blocks, H_kv, 64, 2 D) -> K^T (num_blocks, H_kv, D, 64) and V (num_blocks, H_kv, 64, D),
    views of its two halves (see the module docstring); a uint8 (FP8) cache is viewed as E4M3."""
    if kv_cache.dtype == torch.uint8:
        kv_cache = kv_cache.view(torch.float8_e4m3fn)
    nb, hkv, bs, two_d = kv_cache.shape
    halves = kv_cache.view(nb, hkv, 2, bs * (two_d // 2))
    return halves[:, :, 0].view(nb, hkv, two_d // 2, bs), halves[:, :, 1].view(nb, hkv, bs, two_d // 2)


class ExactMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        self.policy = exact_policy(vllm_config)
        if self.policy is None:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            return
        # not CPU_ATTN's own set-up: it picks vLLM's kernel ISA, which refuses an FP8 cache without AVX-512
        AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        if self.block_size != paged.PAGE:
            raise UnservedError(f"exact vLLM plugin: KV block size {self.block_size}; the exact kernels read blocks "
                                f"of {paged.PAGE} positions (block_size={paged.PAGE})")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        if self.policy is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
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
            own = cache_dtype(self.policy)
            unserved = {"alibi slopes": alibi_slopes is not None, "a sliding window": self.sliding_window != -1,
                        "a logits soft cap": bool(self.logits_soft_cap), "sinks": sinks is not None,
                        f"attention type {attn_type}": attn_type != AttentionType.DECODER,
                        "shared KV layers": kv_sharing_target_layer_name is not None,
                        f"kv_cache_dtype={kv_cache_dtype} (the policy's K/V rounding stores {own!r})":
                            kv_cache_dtype not in ("auto", own)}
            if any(unserved.values()):
                raise UnservedError(f"exact vLLM plugin: cannot serve attention with "
                                    f"{', '.join(k for k, v in unserved.items() if v)}")
        self._attention = None  # the policy's jetflow Attention of this layer (found at the first call)

    def _jetflow_attention(self, layer) -> torch.nn.Module:
        if self._attention is None:
            attention = self.policy.model.layers[layer_index(layer.layer_name)].self_attn
            self._attention = (attention,)  # in a tuple: not registered as a submodule anywhere
        return self._attention[0]

    def _scales(self, attention, kv_cache: torch.Tensor) -> tuple[bool, float, float]:
        """(FP8 cache?, k_scale, v_scale) of this layer; an FP8 cache needs the quantizer's scales."""
        if kv_cache.dtype != torch.uint8:
            return False, 1.0, 1.0
        quantizer = attention.kv_quantizer
        if quantizer is None or not quantizer.ready:
            raise UnservedError("exact vLLM plugin: the FP8 KV cache stores E4M3 codes of the FP8 K/V quantizer's "
                                "scales, which are not set yet: load a weight update with kv_scales (or calibrate "
                                "the policy's quantizer) before generating")
        return (True, *quantizer.layer_scales(attention.layer_idx))

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
        fp8, _, _ = self._scales(attention, kv_cache)
        kt_cache, v_cache = cache_views(kv_cache)
        if fp8:  # the native paged cache's bytes: E4M3 codes (value = code * scale)
            key, value = attention.kv_quantizer.encode(attention.layer_idx, key, value)
            kt_cache, v_cache, key, value = (t.view(torch.uint8) for t in (kt_cache, v_cache, key, value))
        elif attention.kv_quantizer is not None:  # the native Attention's K/V rounding, after RoPE
            key, value = attention.kv_quantizer(attention.layer_idx, key, value)
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
        attention = self._jetflow_attention(layer)
        _, k_scale, v_scale = self._scales(attention, kv_cache)
        kt_cache, v_cache = cache_views(kv_cache)
        for g in attn_metadata.groups:
            r, t = g.positions.shape
            q = query[g.rows].view(r, t, *query.shape[1:]).transpose(1, 2)  # (R, H, T, D)
            y = paged.paged_attention(q, kt_cache, v_cache, g.table, g.positions, attention.scale,
                                      k_scale, v_scale).transpose(1, 2)  # (R, T, H, D)
            output[g.rows] = y.reshape(r * t, *y.shape[2:]) if isinstance(g.rows, slice) else y
        return output


class ExactAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with jetflow's exact attention in exact engines (vLLM's own in the others)."""

    supported_kv_cache_dtypes = [*CPUAttentionBackend.supported_kv_cache_dtypes, "bfloat16"]  # bf16 mode's K/V

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
