"""A paged key/value cache: a pool of fixed pages of 64 positions (the exact attention's KV block), a
block table per sequence, storage in the precision's own bytes (fp32, bf16 or E4M3 codes).

    pool = PagePool.for_budget(model.config, budget_bytes, torch.float8_e4m3fn, exact=True)
    pages = pool.alloc(3)                        # page ids, or None when the pool is short
    cache = pool.view(table)                     # table (B, nb) int32: row b's block j is page table[b, j]
    model.forward_hidden(ids, position_ids=pos, cache=cache)   # token at position p -> page table[b, p // 64]
    pool.free(pages)

Why pages: a sequence holds ceil(len / 64) pages, so memory follows the tokens actually held instead of
max_batch x max_seq_len, a finished sequence's pages serve the next request at once, and a long-tail
batch does not reserve its longest member's length for every row. Why 64: the exact kernel reads one
pointer per 64-position block and visits keys in position order, so a sequence's bits do not depend on
which pages it got (jetflow.kernels.paged).

Layout per layer (one tensor for all layers, page id shared by every layer): exact numerics keep K
transposed inside a page, K (N + 1, H_kv, D, 64) and V (N + 1, H_kv, 64, D); fast numerics K and V
(N + 1, H_kv, 64, D). Page N is the null page: block-table entries past a sequence's pages point at it
(a right-padded prefill's padding tokens write there; no real query ever reads it).

E4M3 pages hold the FP8 KV quantizer's codes (jetflow.precision.kv; value = code * per-layer scale):
one byte a value instead of four, the same values as the fake-quantized fp32 cache.

Memory: the pool is one `torch.empty` byte buffer sized by the budget; the OS maps its memory when a
page is first touched, and a page is zeroed when allocated, so resident memory follows the pages
ever held (their peak), not the budget.
"""

from __future__ import annotations

import torch

from jetflow.kernels.paged import PAGE


class PagePool:
    """`num_pages` pages (+ the null page) of every layer's K and V in `dtype`, and the free list."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, dtype: torch.dtype,
                 exact: bool, buffer: torch.Tensor | None = None, device: torch.device | str = "cpu"):
        if num_pages < 1:
            raise ValueError(f"a KV page pool needs at least one page, got {num_pages} (raise the KV budget)")
        L, H, D, N = num_layers, num_kv_heads, head_dim, num_pages + 1
        self.num_layers, self.num_kv_heads, self.head_dim, self.num_pages = L, H, D, num_pages
        self.dtype, self.exact = dtype, exact
        elem = torch.empty(0, dtype=dtype).element_size()
        half = L * N * H * D * PAGE * elem  # bytes of every layer's K pages
        if buffer is None:
            buffer = torch.empty(2 * half, dtype=torch.uint8, device=device)
        if buffer.numel() < 2 * half or buffer.dtype != torch.uint8:
            raise ValueError(f"KV page buffer of {buffer.numel()} bytes < {2 * half} needed")
        self.buffer = buffer
        k_shape = (L, N, H, D, PAGE) if exact else (L, N, H, PAGE, D)
        self.k = buffer[:half].view(dtype).view(k_shape)  # (L, N + 1, H_kv, D, 64), fast: (L, N + 1, H_kv, 64, D)
        self.v = buffer[half:2 * half].view(dtype).view(L, N, H, PAGE, D)  # (L, N + 1, H_kv, 64, D)
        self.null_page = num_pages
        self._zero([num_pages])
        self._free = list(range(num_pages - 1, -1, -1))  # popped from the end: low ids first
        self.peak_held = 0

    @staticmethod
    def page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one page (64 positions) of K and V over every layer."""
        return 2 * num_layers * num_kv_heads * head_dim * PAGE * torch.empty(0, dtype=dtype).element_size()

    @classmethod
    def for_budget(cls, config, budget_bytes: int, dtype: torch.dtype, exact: bool,
                   buffer: torch.Tensor | None = None) -> "PagePool":
        """As many pages as `budget_bytes` holds (the null page included) for a ModelConfig."""
        c = config
        per_page = cls.page_bytes(c.num_layers, c.num_kv_heads, c.head_dim, dtype)
        return cls(c.num_layers, c.num_kv_heads, c.head_dim, budget_bytes // per_page - 1, dtype, exact, buffer)

    @property
    def bytes_per_page(self) -> int:
        return self.page_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_page // PAGE

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def held_pages(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n zeroed pages, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self._zero(pages)
        self.peak_held = max(self.peak_held, self.held_pages)
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def _zero(self, pages: list[int]) -> None:
        if pages:
            idx = torch.tensor(pages, device=self.buffer.device)
            self.k.view(torch.uint8)[:, idx] = 0
            self.v.view(torch.uint8)[:, idx] = 0

    def view(self, table: torch.Tensor) -> "PagedKVCache":
        return PagedKVCache(self, table)


class PagedKVCache:
    """What one forward sees: the pool and the block table of its B rows, (B, nb) int32 (entries past a
    row's pages: the null page). Slot = position: row b's token at position p lives in page
    table[b, p // 64] at offset p % 64 (every sequence starts at its own first page)."""

    length = 0  # the Decoder's default positions start here: a paged forward always passes position_ids
    k_transposed: bool

    def __init__(self, pool: PagePool, table: torch.Tensor):
        self.pool = pool
        self.table = table.to(device=pool.buffer.device, dtype=torch.int32).contiguous()  # (B, nb)
        self.k_transposed = pool.exact

    def check_end(self, end: int) -> None:
        if end > self.table.shape[1] * PAGE:
            raise RuntimeError(f"paged KV cache: position {end - 1} is past the {self.table.shape[1]} pages "
                               "of the block table")

    def advance_to(self, end: int) -> None:
        """Nothing to record: the engine tracks each sequence's length."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store k, v (B, H_kv, T, D) (values in the pages' dtype: codes for E4M3) at `positions` (B, T)."""
        B, H, T, D = k.shape
        pages = self.table.gather(1, (positions // PAGE).to(torch.int64)).reshape(-1).long()  # (B*T,)
        slots = (positions % PAGE).reshape(-1).long()  # (B*T,)
        kr = k.to(self.pool.dtype).transpose(1, 2).reshape(B * T, H, D)  # (B*T, H_kv, D)
        vr = v.to(self.pool.dtype).transpose(1, 2).reshape(B * T, H, D)
        K, V = self.pool.k[layer], self.pool.v[layer]
        if self.pool.dtype == torch.float8_e4m3fn:  # index_put on the bytes
            K, V, kr, vr = K.view(torch.uint8), V.view(torch.uint8), kr.view(torch.uint8), vr.view(torch.uint8)
        if self.k_transposed:
            K[pages, :, :, slots] = kr  # (B*T, H_kv, D)
        else:
            K[pages, :, slots] = kr
        V[pages, :, slots] = vr

    def gather(self, layer: int, end: int, dtype: torch.dtype, k_scale: float = 1.0,
               v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [0, end) of every row as dense K, V (B, H_kv, end, D) in `dtype` (E4M3 codes times their
        scales; K a transposed view where the pages keep K transposed): what fast numerics' SDPA and the
        exact Triton kernel on CUDA read."""
        nb = -(-end // PAGE)
        ids = self.table[:, :nb].long()  # (B, nb)
        B, H, D = ids.shape[0], self.pool.num_kv_heads, self.pool.head_dim
        out = []
        for pages, s, transposed in ((self.pool.k[layer], k_scale, self.k_transposed), (self.pool.v[layer], v_scale, False)):
            x = pages[ids]  # (B, nb, H_kv, 64, D), or (B, nb, H_kv, D, 64) for transposed K
            if transposed:
                x = x.permute(0, 2, 3, 1, 4).reshape(B, H, D, nb * PAGE)[..., :end].transpose(-1, -2)
            else:
                x = x.transpose(1, 2).reshape(B, H, nb * PAGE, D)[:, :, :end]
            x = x.float() * s if self.pool.dtype == torch.float8_e4m3fn else x
            out.append(x.to(dtype))
        return out[0], out[1]
