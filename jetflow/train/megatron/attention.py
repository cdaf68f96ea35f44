"""Megatron's core attention with jetflow's numerics, the FP8 K/V quantizer where the native Attention
applies it, and the row alignment that exact attention needs.

- `ExactCoreAttention` (exact numerics) replaces Megatron's DotProductAttention as SelfAttention's
  `core_attention`: it calls `jetflow.kernels.invariant.attention(q, kt, v, pos, scale)` exactly as
  jetflow/model/attention.py does (the kernel the native trainer and the rollout engine run, so a
  token's attention output is the same bits in all three). SelfAttention keeps Megatron's q/k/v split,
  q/k norms and RoPE (its unfused RoPE is the native `x * cos + rotate_half(x) * sin`, with cos / sin
  of the same fp32 angles), and Megatron's mask is not read: the kernel is causal by position.
- `JetflowDotProductAttention` (fast numerics) is Megatron's DotProductAttention with the K/V quantizer.
- Both apply the FP8 K/V quantizer (`precision.kv_cache_fp8`) to K and V after RoPE, where the native
  Attention applies it; `ModelParallelKVQuantizer` max-reduces its amax over the model-parallel group
  (a layer's K/V is seen by the TP rank holding those heads, on the pipeline stage holding the layer),
  so every rank sets, and ships, the scales one process would.
- `unalign_rows` (after jetflow.model.attention.align_rows): the exact kernel attends key slots
  0..position of its own row, so a left-padded row is shifted to start at slot 0 (slot = position, as in
  the rollout engine's cache) and its hidden states shifted back afterwards: `Decoder._forward_aligned`'s
  realignment, the same function. After it every
  row's token t sits at slot t and position t, so the kernel's positions are arange(T) in every row.

Shapes: T tokens, B batch, H local query heads, H_kv local KV heads, D head dim, C hidden.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from jetflow.precision.kv import BF16KVRounding, KVQuantizer

_CLASSES: dict[str, type] = {}


class ModelParallelKVQuantizer(KVQuantizer):
    """A KVQuantizer whose amax is max-reduced over the model-parallel group (TP x PP) before new
    scales are set; then, as any KVQuantizer, over the data-parallel ranks (`recalibrate(dp)`)."""

    def __init__(self, quantizer: KVQuantizer, group, device: torch.device):
        super().__init__(quantizer.num_layers, quantizer.margin, quantizer.apply)
        self.load_state_dict(quantizer.state_dict())
        self.group, self.device = group, device

    def recalibrate(self, dp=None) -> dict[str, torch.Tensor]:
        for amax in (self.k_amax, self.v_amax):
            buf = amax.to(self.device)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
            amax.copy_(buf)
        return super().recalibrate(dp)


def _quantize_kv(module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (any layout) through the attached quantizer, as the native Attention does after RoPE."""
    if module.kv_quantizer is None:
        return key, value
    return module.kv_quantizer(module.layer_idx, key, value)


class ExactCoreAttention(nn.Module):
    """Causal attention by position on jetflow's batch-invariant kernel, with DotProductAttention's
    constructor and forward signatures (a `core_attention` of Megatron's SelfAttention)."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__()
        if softmax_scale is not None or config.apply_query_key_layer_scaling:
            raise NotImplementedError("ExactCoreAttention scales scores by 1 / sqrt(head_dim), as the native model")
        self.layer_idx = layer_number - 1  # Megatron's global layer number (1-based), any pipeline stage
        self.head_dim = config.kv_channels
        self.kv_quantizer: KVQuantizer | BF16KVRounding | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        """query (T, B, H, D), key and value (T, B, H_kv, D), rows aligned (slot = position) -> (T, B, H * D).
        `attention_mask` is not read (see the module docstring)."""
        from jetflow.kernels import invariant

        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("ExactCoreAttention: no attention bias, no packed sequences")
        T, B, H, D = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (B, H|H_kv, T, D)
        k, v = _quantize_kv(self, k, v)
        kt = k.transpose(-1, -2).contiguous()  # (B, H_kv, D, T)
        pos = torch.arange(T, device=q.device).expand(B, T)  # (B, T): slot = position in aligned rows
        y = invariant.attention(q, kt, v, pos, 1.0 / math.sqrt(self.head_dim))  # (B, H, T, D)
        return y.permute(2, 0, 1, 3).reshape(T, B, H * D)


def fast_core_attention() -> type:
    """Megatron's DotProductAttention with the FP8 K/V quantizer (made on first use: Megatron is lazy)."""
    if not _CLASSES:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class JetflowDotProductAttention(DotProductAttention):
            """DotProductAttention applying the attached K/V quantizer to K and V (after RoPE)."""

            kv_quantizer: KVQuantizer | None = None

            @property
            def layer_idx(self) -> int:
                return self.layer_number - 1

            def forward(self, query, key, value, attention_mask, *args, **kwargs):
                key, value = _quantize_kv(self, key, value)  # (T, B, H_kv, D)
                return super().forward(query, key, value, attention_mask, *args, **kwargs)

        _CLASSES["fast"] = JetflowDotProductAttention
    return _CLASSES["fast"]


def core_attention_modules(gpt) -> list[nn.Module]:
    """The core attention modules of a GPTModel stage, in layer order."""
    return [layer.self_attention.core_attention for layer in gpt.decoder.layers]


def unalign_rows(hidden: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
    """hidden (T, B, C) in aligned order -> the original columns (T, B, C)."""
    index = back.t()[..., None].expand(-1, -1, hidden.shape[-1])  # (T, B, C)
    return hidden.gather(0, index)
