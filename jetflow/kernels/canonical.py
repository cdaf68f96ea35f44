"""The canonical reduction of every exact GEMM: one order of additions whatever the sharding.

    y[m, n] = sum_k x[m, k] w[n, k]
      1. K in 128-wide blocks; each block's partial is its own chain from 0 (fp32 and bf16: k in order;
         FP8: of the raw E4M3 values, odd element of each pair first, then times sx[m, b] *
         sw[n // 128, b]). AVX512_BF16's vdpbf16ps, which the CPU kernel runs where it can, computes
         both orders: a pair's second product first, so bf16 pairs are packed swapped;
      2. the blocks in G contiguous groups of equal size, G = tree_width(K); a group's sum is
         0 + its block partials in order;
      3. the G group sums combined by one fixed pairwise tree: tree_sum.
    Then the epilogue (bias, the bf16 kind's rounding, the output dtype) on the full sum.

Why: a row-parallel layer under tensor parallelism T holds a contiguous 1/T of K on each rank. If the
sum over K were one chain, TP = 2 would sum two half-chains and TP = 1 one whole chain, and the last
bits would differ (FP8 rounding then turns them into visible flips). With the tree, a rank computes
the subtree of its G / T groups (`groups=G // T` in the kernels), the ranks exchange those partials
(all-gather) and combine them with the same `tree_sum`: TP = 1, 2, 4 and 8 give the same bits, and so
do the rollout engines, which compute the whole tree at TP = 1 (TBIK, arXiv 2511.17826, does the same
for bf16 inference).

The CPU kernels (csrc/gemm.cpp) and the Triton kernels (jetflow.kernels.triton.gemm) compute this
structure; what they compute inside a block differs (a CPU FMA chain vs a tensor-core MMA), so CPU and
GPU are not each other's bits, but each is invariant to M, the batch and the TP degree.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

BLOCK_K = 128
"""K block: one partial chain each; the FP8 recipe's scale group along K."""
MAX_TREE_WIDTH = 8
"""The most groups a K range is split into: the largest tensor-parallel degree of a row-parallel layer."""


def tree_width(k: int) -> int:
    """G for a contraction of length k: the largest power of two <= MAX_TREE_WIDTH that divides the
    number of 128-blocks (1 when k is not a whole number of blocks: one chain of block partials, and
    tensor parallelism cannot split such a K)."""
    if k <= 0 or k % BLOCK_K:
        return 1
    blocks, g = k // BLOCK_K, 1
    while g < MAX_TREE_WIDTH and blocks % (2 * g) == 0:
        g *= 2
    return g


def check_groups(k: int, groups: int) -> None:
    """`groups` must split k's blocks evenly into a power-of-two number of whole-block groups."""
    if groups < 1 or groups & (groups - 1):
        raise ValueError(f"groups={groups}: a power of two >= 1")
    if groups > 1 and (k % BLOCK_K or (k // BLOCK_K) % groups):
        raise ValueError(f"groups={groups} does not divide K={k} into whole {BLOCK_K}-blocks")


def tree_sum(parts: Sequence[Tensor]) -> Tensor:
    """The pairwise tree over equally shaped partials, in order: ((p0 + p1) + (p2 + p3)) + ...
    (len(parts) a power of two). Shards of a row-parallel layer combine their subtrees with it."""
    n = len(parts)
    if n == 0 or n & (n - 1):
        raise ValueError(f"tree_sum needs a power-of-two number of partials, got {n}")
    level = list(parts)
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]
