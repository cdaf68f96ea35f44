"""A preallocated key/value cache for incremental decoding with `jetflow.model.Decoder`.

Layout: one K and one V tensor per layer, allocated once, (B, H_kv, S_max, D) each; with
`k_transposed` (the exact numerics mode) K is kept as (B, H_kv, D, S_max), the layout the
batch-invariant attention reads keys in. A forward pass writes its T new tokens' K/V into slots and
then raises `length`, the high-water mark: slots [0, length) hold data for some row.

Two ways to fill it (the decoder picks by what it is given):
- slot = position (right-padded rows, what the rollout engine does): a row's token at position p
  lives in slot p; a prefill writes slots [0, T) of every row, a decode step writes one slot per row
  (`update(..., row_slots=positions)`). Queries see the slots at or before their own position, so a
  row's layout does not depend on the other rows, which exact numerics needs.
- contiguous slots [length, length + T) for every row (left-padded rows with an attention mask).

FP8 KV hook: `quantize_kv`, if set, is a callable applied to K and to V (each (B, H_kv, T, D)) before
they are stored, e.g. a fake-quantizer that rounds to the FP8 grid and back. It is None by default.
"""

from __future__ import annotations

from typing import Callable

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        k_transposed: bool = False,
    ):
        if max_len <= 0:
            raise ValueError(f"KVCache max_len must be positive, got {max_len}")
        self.num_layers = num_layers
        self.batch_size = batch_size
        self.num_kv_heads = num_kv_heads
        self.max_len = max_len
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.k_transposed = k_transposed
        v_shape = (batch_size, num_kv_heads, max_len, head_dim)  # (B, H_kv, S_max, D)
        k_shape = (batch_size, num_kv_heads, head_dim, max_len) if k_transposed else v_shape
        self.k = [torch.zeros(k_shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(v_shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.length = 0  # high-water mark: slots [0, length) hold data for some row
        self.quantize_kv: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def for_model(cls, model_config, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", k_transposed: bool = False) -> "KVCache":
        """A cache shaped for a `ModelConfig` (num_layers, num_kv_heads, head_dim)."""
        c = model_config
        return cls(c.num_layers, batch_size, c.num_kv_heads, max_len, c.head_dim, dtype, device, k_transposed)

    def check_end(self, end: int) -> None:
        """Raise if slots up to `end` (exclusive) do not fit."""
        if end > self.max_len:
            raise RuntimeError(
                f"KVCache overflow: writing up to slot {end} > max_len={self.max_len}; "
                f"allocate a larger cache (max_len >= prompt length + new tokens)")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int | None = None,
               row_slots: torch.Tensor | None = None, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T, D) of `layer` and return that layer's K and V over slots [0, end).

        Where: at slots [start, start + T) of every row (start defaults to `length`), or, for one
        new token per row (T = 1), at slot row_slots[b] of row b. `end` (default: start + T, or
        max(length, max(row_slots) + 1)) bounds the returned views: K (B, H_kv, end, D), or
        (B, H_kv, D, end) for a k_transposed cache; V (B, H_kv, end, D). Does not move `length`
        (every layer of one forward writes the same slots); see `advance_to`.
        """
        if k.shape[0] != self.batch_size:
            raise ValueError(f"KVCache was allocated for batch {self.batch_size}, got batch {k.shape[0]}")
        if self.quantize_kv is not None:
            k, v = self.quantize_kv(k), self.quantize_kv(v)
        K, V = self.k[layer], self.v[layer]
        if row_slots is not None:
            if k.shape[2] != 1:
                raise ValueError("KVCache.update: row_slots writes one token per row (T = 1)")
            if end is None:
                end = max(self.length, int(row_slots.max()) + 1)
            self.check_end(end)
            rows = torch.arange(self.batch_size, device=K.device)
            slots = row_slots.to(K.device)
            V[rows, :, slots] = v[:, :, 0]  # (B, H_kv, D)
            if self.k_transposed:
                K[rows, :, :, slots] = k[:, :, 0]
            else:
                K[rows, :, slots] = k[:, :, 0]
        else:
            start = self.length if start is None else start
            t = k.shape[2]
            end = start + t if end is None else end
            self.check_end(max(end, start + t))
            V[:, :, start:start + t] = v
            if self.k_transposed:
                K[:, :, :, start:start + t] = k.transpose(-1, -2)
            else:
                K[:, :, start:start + t] = k
        return (K[..., :end] if self.k_transposed else K[:, :, :end]), V[:, :, :end]

    def advance_to(self, end: int) -> None:
        """Mark slots up to `end` as holding data (called once per forward, after every layer wrote)."""
        self.check_end(end)
        self.length = max(self.length, end)

    def reset(self) -> None:
        """Forget all slots (the memory is kept and overwritten by the next forward)."""
        self.length = 0

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.num_kv_heads}, "
                f"length={self.length}/{self.max_len}, head_dim={self.head_dim}, dtype={self.dtype}, "
                f"device={self.device}, k_transposed={self.k_transposed})")
