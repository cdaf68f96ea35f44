"""LoRA on Megatron's tensor-parallel linears (model.lora with train.backend=megatron): TP-split adapters that
compute the native adapted linear's bits (jetflow.precision.lora: y = base(x) + scale * ((x A^T) B^T)).

Each adapted HF linear (a segment of a fused linear_qkv / linear_fc1, or a linear_proj / linear_fc2) holds a
`LoRAAdapter` with this rank's shard, under `<megatron linear>.lora.<q_proj|k_proj|...>`:

  column-parallel (q, k, v, gate, up; `out` split)
      A (rank, in) whole, replicated on the TP ranks; B (out / tp, rank) this rank's rows of the HF B (the rows
      of its output shard: contiguous in HF order, its KV groups' heads). h = x A^T is the native call on the
      whole input; its gradient is summed over the TP group before A's wgrad (Megatron's copy region, so
      every rank's A takes the same step); h B_local^T gives the native output's columns of this shard (a
      column of the canonical GEMM does not depend on the other columns): bit for bit.
  row-parallel (o, down; `in` split)
      A (rank, in / tp) this rank's columns; B (out, rank) whole, replicated. h = x_local A_local^T over this
      rank's canonical groups of `in`, the tree finished over the TP ranks in rank order (the base layer's
      combine, reduce.tp_tree_combine: no all-reduce), so h is the native whole-`in` h bit for bit; B's
      product on the replicated h is the native call. (A TP split of `in` into whole canonical groups is what
      the base already needs: checks.check_exact_tp_split.) Under fast numerics the same combine sums the
      partials.

The adapter is added to its own segment's output rows, y + (scale * delta).to(y.dtype), elementwise: the
native order. Only the forward is exact: the backward is torch's in both trainers, and under TP the input
gradients of column-parallel layers (the base's and the adapters') are sums over the ranks, another order than
one process's, so gradients and updated adapters equal the native trainer's to fp32 summation order, as the
base's gradients at TP=2 do (tests/integration/test_megatron_tp.py).

Sync, checkpoints and the export read the adapters whole, in the native names (`<HF linear>.lora.A`):
`full_adapters` gathers the TP shards, `load_full_adapters` scatters whole ones.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from jetflow.precision.lora import ADAPTER, LoRAAdapter, is_target

from .reduce import tp_tree_combine


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]  # model.layers.0.self_attn.q_proj -> q_proj


def _tp(linear) -> int:
    return 1 if linear.explicit_expert_comm else dist.get_world_size(linear.tp_group)


def segment_adapters(linear):
    """(segment, its adapter or None) of a jetflow parallel linear, in its fused row order."""
    held = getattr(linear, ADAPTER, None)
    for seg in linear.segments:
        yield seg, (held[_short(seg.name)] if held is not None and _short(seg.name) in held else None)


def attach_adapters(linears, rank: int, alpha: float, targets: list[str] | tuple[str, ...]) -> list[str]:
    """Give every targeted segment of `linears` (the policy's jetflow parallel linears) a zero adapter shard
    of its layout (see the module docstring); returns the adapted HF linears' names. Experts and lm_head are
    not targets (is_target: decoder layers' linears; MoE LoRA is refused before a run)."""
    names = []
    for linear in linears:
        adapters = {}
        for seg in linear.segments:
            if ".experts." in seg.name or not is_target(seg.name, targets):
                continue
            rows = seg.groups * (seg.stop - seg.start)  # this segment's output rows on this rank
            fan_in = linear.input_size if linear.parallel_dim == 0 else linear.input_size_per_partition
            adapters[_short(seg.name)] = LoRAAdapter(fan_in, rows, rank, alpha, device=linear.weight.device)
            names.append(seg.name)
        if adapters:
            setattr(linear, ADAPTER, nn.ModuleDict(adapters))
    return names


def add_adapters(linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The base's output y (..., N_local) for input x (..., K_local) with each adapted segment's adapter added
    to its rows: (..., N_local), y's dtype. Column-parallel: x is the whole (replicated) input; row-parallel:
    this rank's shard of it, y the combined output."""
    tp, kw = _tp(linear), dict[str, Any]()  # LoRAAdapter.delta's tensor-parallel arguments
    if tp > 1 and linear.parallel_dim == 0:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
        kw["between"] = lambda h: copy_to_tensor_model_parallel_region(h, group=linear.tp_group)
    elif tp > 1:
        kw["combine"] = tp_tree_combine(linear.tp_group)
        if linear.numerics == "exact":
            from jetflow.kernels.canonical import tree_width
            kw["groups"] = tree_width(linear.input_size) // tp
    groups = linear.segments[0].groups
    ys = y.unflatten(-1, (groups, -1))  # (..., groups, rows per group)
    parts = []
    for seg, adapter in segment_adapters(linear):
        part = ys[..., seg.start:seg.stop]  # (..., groups, stop - start)
        if adapter is not None:
            part = adapter(x, part.flatten(-2), linear.numerics, **kw).unflatten(-1, (groups, seg.stop - seg.start))
        parts.append(part)
    return torch.cat(parts, dim=-1).flatten(-2)  # (..., N_local)


def _gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


@torch.no_grad()
def full_adapters(linears) -> dict[str, torch.Tensor]:
    """{`<HF linear>.lora.A` / `.B`: the whole fp32 tensor}, the TP shards gathered (a collective of the TP
    group: every rank calls it); the names and shapes of the native model's adapter_parameters."""
    out = {}
    for linear in linears:
        for seg, adapter in segment_adapters(linear):
            if adapter is None:
                continue
            A, B = adapter.A.detach(), adapter.B.detach()  # (rank, in[/tp]), (out[/tp], rank)
            if _tp(linear) > 1 and linear.parallel_dim == 0:
                B = _gather(B, linear.tp_group, 0)
            elif _tp(linear) > 1:
                A = _gather(A, linear.tp_group, 1)
            out[f"{seg.name}.{ADAPTER}.A"], out[f"{seg.name}.{ADAPTER}.B"] = A, B
    return out


@torch.no_grad()
def load_full_adapters(linears, tensors: dict[str, torch.Tensor]) -> None:
    """Whole adapters in the native names (`full_adapters`' form) into this rank's shards; the set of names
    must be the model's."""
    shards = []
    for linear in linears:
        tp = _tp(linear)
        rank = dist.get_rank(linear.tp_group) if tp > 1 else 0
        for seg, adapter in segment_adapters(linear):
            if adapter is None:
                continue
            A, B = tensors.get(f"{seg.name}.{ADAPTER}.A"), tensors.get(f"{seg.name}.{ADAPTER}.B")
            if A is None or B is None:
                raise KeyError(f"no LoRA adapter for {seg.name} among {sorted(tensors)[:4]}...")
            A = A.chunk(tp, dim=1)[rank] if linear.parallel_dim == 1 else A
            B = B.chunk(tp, dim=0)[rank] if linear.parallel_dim == 0 else B
            shards += [(adapter.A, A), (adapter.B, B)]
    if len(shards) != len(tensors):
        raise KeyError(f"{len(tensors)} LoRA tensors for {len(shards)} adapter parameters of the model")
    for param, value in shards:
        if param.shape != value.shape:
            raise ValueError(f"LoRA shard shape {tuple(value.shape)} != parameter {tuple(param.shape)}")
        param.copy_(value)


def split_adapter_names(named_parameters, linears) -> set[str]:
    """The names (in `named_parameters`' naming) of the adapter parameters split over the TP ranks:
    column-parallel layers' B, row-parallel layers' A; the others are replicated."""
    split = set()
    by_id = {id(p): n for n, p in named_parameters}
    for linear in linears:
        for _, adapter in segment_adapters(linear):
            if adapter is not None and _tp(linear) > 1:
                split.add(by_id[id(adapter.B if linear.parallel_dim == 0 else adapter.A)])
    return split
