"""The tensor-parallel reduction of a row-parallel layer under exact numerics: an all-gather of the ranks'
partial sums and the canonical pairwise tree over them, in rank order, instead of Megatron's all-reduce.

Why: a row-parallel layer (o_proj, down_proj) splits K over the TP ranks, so each rank holds a partial
sum of every output element. An all-reduce adds those partials in an order of the backend's choosing
(and NCCL's depends on the message size), so TP=2 would not give TP=1's bits. The canonical GEMM
(jetflow.kernels.canonical, jetflow.precision.exact) sums K as G = tree_width(K) contiguous groups
combined by a fixed pairwise tree; TP rank r holds groups [r * G / T, (r + 1) * G / T), computes their
subtree (`exact_linear(..., groups=G // T)`), and the T subtrees combined by the same tree in rank order
are the whole tree: TP=1's sum, bit for bit. Gloo and NCCL alike (all_gather only).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


class _GatherTreeSum(torch.autograd.Function):
    """Forward: every rank's partial (..., N), gathered and summed by the canonical tree in rank order.
    Backward: the output is replicated on every rank and is the plain sum of the partials, so each
    rank's partial gets the output's gradient as it is (as Megatron's all-reduce region does)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        from jetflow.kernels.canonical import tree_sum

        parts = [torch.empty_like(partial) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, partial.contiguous(), group=group)
        return tree_sum(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def tp_tree_combine(group) -> Callable[[torch.Tensor], torch.Tensor]:
    """The `combine` of a row-parallel exact_linear over the TP group `group`: fp32 partial (..., N) ->
    the full fp32 sum (..., N) on every rank."""
    return lambda partial: _GatherTreeSum.apply(partial, group)
