"""Process groups: torch.distributed and Megatron's TP/PP/DP groups, and a device-agnostic TP gather."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .deps import MegatronConfigError, _require_megatron


def initialize_parallel(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                        device: torch.device | str = "cpu", expert_parallel_size: int = 1) -> None:
    """torch.distributed (gloo on the CPU, NCCL on GPUs) and Megatron's TP/PP/DP (and expert) process groups.

    Under torchrun the world comes from its environment; without it a single-process world is made
    (only valid for tensor_parallel_size == pipeline_parallel_size == 1). Idempotent; a second call
    with other sizes raises. Megatron orders the ranks tp-cp-ep-dp-pp: the ranks of one TP group are
    neighbours, pipeline stages are world / pp ranks apart. Expert parallelism (EP ranks, each holding
    num_experts / EP experts) is carved out of the data-parallel ranks: the ranks of one EP group hold
    different data, and expert gradients are reduced over the expert-data-parallel group
    (world / (pp * EP) ranks, see `expert_data_parallel_group`).
    """
    _require_megatron()
    from megatron.core import parallel_state as ps

    device = torch.device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda" and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size())
        want = (tensor_parallel_size, pipeline_parallel_size, expert_parallel_size)
        if have != want:
            raise MegatronConfigError(f"Megatron parallel state already initialized with (tp, pp, ep) = {have}, "
                                      f"not {want}")
        return
    # (the world size is a multiple of tp * pp * ep: jetflow.run.validate checks it before a run)
    ps.initialize_model_parallel(tensor_parallel_size, pipeline_parallel_size,
                                 expert_model_parallel_size=expert_parallel_size)


class _GatherLastDim(torch.autograd.Function):
    """All-gather TP shards along the last dim; backward keeps this rank's slice of the gradient.

    Megatron's `gather_from_tensor_model_parallel_region` does the same but allocates its output on
    `torch.cuda.current_device()`; this one works on any device (gloo on the CPU, NCCL on GPUs)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank = group, dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(ctx.group), dim=-1)[ctx.rank].contiguous(), None


def data_parallel_group() -> tuple[object, int, int]:
    """Megatron's data-parallel process group, this rank's place in it and its size (after
    `initialize_parallel`): the ranks that hold the same weight shards and different data."""
    from megatron.core import parallel_state as ps
    return ps.get_data_parallel_group(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def expert_data_parallel_group() -> tuple[object, int, int]:
    """Megatron's expert-data-parallel group, this rank's place in it and its size: the ranks that hold
    the same experts and different data (world / (pp * EP) ranks under TP = 1)."""
    from megatron.core import parallel_state as ps
    group = ps.get_expert_data_parallel_group()
    return group, dist.get_rank(group), dist.get_world_size(group)
