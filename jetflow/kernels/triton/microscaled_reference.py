"""The mxfp8 / nvfp4 Triton GEMM's arithmetic in plain torch (jetflow.kernels.triton.microscaled), for the
tests: per 128-wide K block the sum of the exact products of the operands' values, taken in float64
(exact: the values carry at most 6 significant bits, so 128 products fit in 53 bits) and rounded once
to fp32 (the value an exact MMA gives), the blocks summed in order within each canonical group, the
groups through the pairwise tree, then NVFP4's alpha (one fp32 product of the tensor scales, one
multiply)."""

from __future__ import annotations

import torch

from jetflow.kernels.canonical import tree_sum, tree_width


def microscaled_gemm(a: torch.Tensor, b: torch.Tensor, groups: int | None = None,
                     da: torch.Tensor | None = None, db: torch.Tensor | None = None) -> torch.Tensor:
    """a (M, K), b (N, K): the operands' exact fp32 values (code * block scale); da (M,) or () and db ()
    the NVFP4 tensor scales, or None -> (M, N) fp32."""
    (m, k), n = a.shape, b.shape[0]
    nb = -(-k // 128)
    groups = tree_width(k) if groups is None else groups
    sums = []
    for g in range(groups):
        acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
        for kb in range(g * nb // groups, (g + 1) * nb // groups):
            cols = slice(kb * 128, (kb + 1) * 128)
            acc = acc + (a[:, cols].double() @ b[:, cols].double().t()).float()
        sums.append(acc)
    out = tree_sum(sums)
    if da is not None:
        alpha = da.float() * db.float()  # (M,) or ()
        out = out * (alpha[:, None] if alpha.dim() else alpha)
    return out
