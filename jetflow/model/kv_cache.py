"""A preallocated key/value cache for incremental decoding with `jetflow.model.Decoder`.

Layout: one K and one V tensor per layer, each (B, H_kv, S_max, D), allocated once. Slots
[0, length) are filled. A forward pass with T new tokens writes them into slots
[length, length + T) of every layer (`update`) and then advances `length` by T (`advance`, called by
`Decoder.forward` once after the last layer). The cache never grows: writing past `max_len` raises.

Padding is not the cache's business: a left-padded batch simply keeps its padding slots in the cache,
and the attention mask passed to the decoder (B, length + T) says which slots are real.

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
        shape = (batch_size, num_kv_heads, max_len, head_dim)  # (B, H_kv, S_max, D)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.length = 0  # slots filled so far (the same for every row of the batch)
        self.quantize_kv: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def for_model(cls, model_config, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> "KVCache":
        """A cache shaped for a `ModelConfig` (num_layers, num_kv_heads, head_dim)."""
        c = model_config
        return cls(c.num_layers, batch_size, c.num_kv_heads, max_len, c.head_dim, dtype, device)

    def check_room(self, t: int) -> None:
        """Raise if `t` more tokens do not fit."""
        if self.length + t > self.max_len:
            raise RuntimeError(
                f"KVCache overflow: {self.length} slots filled + {t} new tokens > max_len={self.max_len}; "
                f"allocate a larger cache (max_len >= prompt length + new tokens)"
            )

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T, D) at slots [length, length + T) of `layer`.

        Returns views of that layer's K and V over slots [0, length + T): (B, H_kv, length + T, D).
        Does not advance `length` (all layers of one forward write the same slots); see `advance`.
        """
        t = k.shape[2]
        self.check_room(t)
        if k.shape[0] != self.batch_size:
            raise ValueError(f"KVCache was allocated for batch {self.batch_size}, got batch {k.shape[0]}")
        if self.quantize_kv is not None:
            k, v = self.quantize_kv(k), self.quantize_kv(v)
        end = self.length + t
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, t: int) -> None:
        """Mark `t` more slots as filled (called once per forward, after every layer wrote them)."""
        self.check_room(t)
        self.length += t

    def reset(self) -> None:
        """Forget all slots (the memory is kept and overwritten by the next forward)."""
        self.length = 0

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.num_kv_heads}, "
                f"length={self.length}/{self.max_len}, head_dim={self.head_dim}, dtype={self.dtype}, "
                f"device={self.device})")
