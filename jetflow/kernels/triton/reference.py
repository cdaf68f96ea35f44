"""The Triton kernels' arithmetic in plain torch (CPU or GPU), for the tests.

`fp8_gemm` is the block-scaled FP8 GEMM's definition (jetflow.kernels.triton.gemm): per 128-wide K
block the sum of the FP8 products, then `s = s + partial * (sa * sb)` in fp32, block by block in order
within each of the canonical groups, and the groups' sums through the pairwise tree
(jetflow.kernels.canonical). The block sums are taken in float64, where they are exact for E4M3 operands (products carry at
most 8 significant bits between 2^-18 and 2^18, so 128 of them fit in 53 bits) and then rounded once
to fp32: the value an exact MMA gives. Quantization's reference is jetflow.precision.quant itself,
attention's jetflow.kernels.invariant.reference_attention (in float64).
"""

from __future__ import annotations

import torch

from jetflow.kernels.canonical import tree_sum, tree_width


def fp8_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, b_rows_per_scale: int,
             out_dtype: torch.dtype = torch.float32, groups: int | None = None) -> torch.Tensor:
    """a (M, K) fp8, sa (M, ceil(K/128)); b (N, K) fp8, sb (ceil(N/r), ceil(K/128)) -> (M, N)."""
    (m, k), n = a.shape, b.shape[0]
    nb = -(-k // 128)
    groups = tree_width(k) if groups is None else groups
    sums = []
    for g in range(groups):
        acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
        for kb in range(g * nb // groups, (g + 1) * nb // groups):
            cols = slice(kb * 128, (kb + 1) * 128)
            partial = (a[:, cols].double() @ b[:, cols].double().t()).float()  # (M, N), exact then rounded once
            sb_n = sb[:, kb].repeat_interleave(b_rows_per_scale)[:n]  # (N,)
            acc = acc + partial * (sa[:, kb, None] * sb_n[None, :])
        sums.append(acc)
    return tree_sum(sums).to(out_dtype)
