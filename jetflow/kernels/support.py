"""Where the exact (batch-invariant) kernels can run: the kernels' answer to the config's `numerics=auto`."""

from __future__ import annotations

from jetflow.kernels.canonical import tree_width


def exact_kernels_missing(device: str) -> str | None:
    """Why the exact kernels cannot run on `device` ("cpu", "cuda", "cuda:1", ...), or None."""
    if device.startswith("cuda"):
        from jetflow.kernels.triton import available  # Triton is optional: imported only for CUDA
        return None if available() else "on CUDA the batch-invariant kernels are Triton's: pip install triton==3.6.0"
    if not device.startswith("cpu"):
        return f"the batch-invariant kernels run on the CPU and on CUDA (model.device={device})"
    return None


def unsplit_row_parallel_k(ks: tuple[int, ...], tensor_parallel: int) -> int | None:
    """A row-parallel K among `ks` that `tensor_parallel` ranks cannot split into whole canonical 128-block
    groups (tree_width(K) not a multiple of TP), else None."""
    if tensor_parallel == 1:
        return None
    return next((k for k in ks if tree_width(k) % tensor_parallel), None)
