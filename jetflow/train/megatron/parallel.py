"""Process groups: torch.distributed and Megatron's TP/PP/DP groups, and a device-agnostic TP gather."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in Megatron's process grid, read once from its parallel_state (`read_layout`): what
    the policy's weights and gradients (weights.py, grads.py) need to gather and reduce over."""

    tp_size: int
    tp_rank: int
    tp_group: Any
    pp_size: int
    pp_rank: int
    pp_group: Any
    ep_size: int
    """Expert parallelism: the ranks of one EP group hold different experts (and different data)."""
    ep_rank: int
    ep_group: Any
    mp_group: Any
    """The ranks that hold one copy of the model between them (TP x PP): one optimizer shard each."""
    state_group: Any
    """The ranks whose trainer state differs: the model-parallel parts and, under EP, the ranks holding
    other experts (EP x PP: MoE runs with TP = 1). A checkpoint holds one part per rank of this group."""

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def read_layout(tensor_parallel_size: int, pipeline_parallel_size: int, expert_parallel_size: int) -> ParallelLayout:
    """The layout of this rank once `initialize_parallel` has made the groups."""
    from megatron.core import parallel_state as ps
    ep = expert_parallel_size
    mp_group = ps.get_model_parallel_group()
    return ParallelLayout(
        tp_size=tensor_parallel_size, tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_size=pipeline_parallel_size, pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        ep_size=ep, ep_rank=ps.get_expert_model_parallel_rank(), ep_group=ps.get_expert_model_parallel_group(),
        mp_group=mp_group, state_group=ps.get_expert_tensor_model_pipeline_parallel_group() if ep > 1 else mp_group)
