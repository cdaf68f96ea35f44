"""Give the heap's freed memory back to the operating system (glibc's `malloc_trim`) where a train step has
just freed a large working set: after each decoder layer's forward and backward under activation
checkpointing (jetflow.train.checkpointing), where a long response's train step holds the most.

    release_freed_memory()     # glibc: malloc_trim(0); elsewhere nothing
    advise_huge_pages()        # before torch is imported (jetflow.cli does it): see its docstring

Why it is needed: torch's CPU tensors come from glibc's malloc, whose mmap threshold rises to the size of
the largest block freed so far (up to 32 MiB). After the first layers every activation-sized block (one
4224-token row through SmolLM2's MLP: 26 MB) is carved from the heap instead of its own mapping, and a
freed block stays resident until the memory above it is free too. A long-response train step's resident
memory then grows far past what it holds live: SmolLM2 unified, batch 8 x 4096-token responses, 7.32 GB
peak RSS, 3.90 GB with these trims (results/long-train/README.md, "Host memory"). A trim walks the free
chunks and returns their pages; reusing them costs a page fault every 4 KiB: 18% more CPU on that step,
8% with torch's blocks of 2 MiB or more on transparent huge pages (`advise_huge_pages`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from typing import Callable


KEEP_FREE = 256 * 2**20
"""Free heap bytes left in place before a trim: reusing freed memory is free, taking it back from the OS
costs a page fault every 4 KiB, so the heap is trimmed only once it holds more than this unused."""


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33: struct mallinfo2, all size_t
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _glibc() -> tuple[Callable[[int], int], Callable[[], _MallInfo2] | None] | None:
    """(malloc_trim, mallinfo2 or None where glibc < 2.33 lacks it), or None where the C library is not glibc
    (musl, macOS, Windows: their allocators differ; nothing to call)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)  # the process's own glibc
    trim = libc.malloc_trim
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    try:
        info = libc.mallinfo2
    except AttributeError:
        return trim, None
    info.argtypes, info.restype = [], _MallInfo2
    return trim, info


def release_freed_memory(keep_free: int = KEEP_FREE) -> None:
    """Return the free pages of every malloc arena to the OS once they hold more than `keep_free` bytes
    (every call where glibc cannot tell; a no-op where the C library is not glibc)."""
    glibc = _glibc()
    if glibc is None:
        return
    trim, info = glibc
    if info is None or info().fordblks > keep_free:
        trim(0)


def advise_huge_pages() -> None:
    """Ask torch's CPU allocator for transparent huge pages (THP_MEM_ALLOC_ENABLE=1: blocks of 2 MiB or more
    aligned to 2 MiB and advised MADV_HUGEPAGE), unless the environment says otherwise: after a trim, the
    pages come back 2 MiB per fault instead of 4 KiB. torch reads the variable once, at its first allocation,
    so this does nothing once torch is imported. Where the kernel's THP mode is `never`, nothing changes."""
    if "torch" not in sys.modules:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
