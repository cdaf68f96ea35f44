"""Weights that only rank 0 loads (`train.backend=fsdp`): every other rank builds the model on the meta
device (jetflow.run.build.build_model, weights=False) and fills one `fully_shard` unit at a time from
rank 0 just before the unit is sharded, so a rank other than 0 holds at most one unit whole, never the model (FSDP1's
`sync_module_states`; torchtitan and torchtune load the full state on rank 0 and scatter it likewise).
Rank 0 frees the whole weights as each unit is sharded (the shards are copies).

The broadcast moves rank 0's tensors as they are, so every rank's shards hold the bytes it would hold
had it built the model itself (same checkpoint, or the same seed): sharding from rank 0 changes no bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from jetflow.train.fsdp.gather import _ShardWeight, plain


def any_rank_on_meta(module: nn.Module, device: str) -> bool:
    """Whether any rank's `module` holds meta tensors (a collective: every rank calls it): then every
    unit is filled from rank 0 before it is sharded."""
    meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])
    flag = torch.tensor([int(meta)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _broadcast_from_rank0(t: torch.Tensor, device: str) -> torch.Tensor:
    """Rank 0's `t` on every rank (`t` a meta tensor of its shape and dtype elsewhere). Sent as bytes: gloo
    broadcasts any dtype that way."""
    out = plain(t).detach().contiguous() if dist.get_rank() == 0 else torch.empty(t.shape, dtype=t.dtype, device=device)
    dist.broadcast(out.view(-1).view(torch.uint8), src=0)
    return out


@torch.no_grad()
def fill_from_rank0(module: nn.Module, device: str) -> None:
    """Give every rank rank 0's copy of the parameters and buffers of `module` that are not sharded yet
    (DTensors are skipped: a unit sharded before), in module order (a collective: every rank calls it on
    the same structure). A weight shared by two modules (a tied lm_head) is sent once and stays shared;
    a low-precision all-gather wrapper (jetflow.train.fsdp.gather) keeps its kind."""
    filled: dict[int, Any] = {}  # id(old tensor) -> its replacement
    for sub in module.modules():
        tables: list[tuple[dict[str, Any], bool]] = [(sub._parameters, True), (sub._buffers, False)]
        for table, as_param in tables:
            for name, t in list(table.items()):
                if t is None or isinstance(t, DTensor):
                    continue
                if id(t) not in filled:
                    data = _broadcast_from_rank0(t, device)
                    if dist.get_rank() == 0:
                        filled[id(t)] = t
                    else:
                        inner = t.with_tensor(data) if isinstance(t, _ShardWeight) else data
                        filled[id(t)] = nn.Parameter(inner, requires_grad=t.requires_grad) if as_param else inner
                table[name] = filled[id(t)]


def share_rng_state(device: str) -> None:
    """Every rank's torch CPU generator set to rank 0's (a collective): where building the model on every
    rank left them all (a tiny model's init draws from it on rank 0 alone now)."""
    state = torch.get_rng_state().to(device)  # (5056,) uint8; NCCL broadcasts device tensors only
    dist.broadcast(state, src=0)
    torch.set_rng_state(state.cpu())
