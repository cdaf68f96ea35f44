"""Training-state memory per rank: the replicated native trainer vs the FSDP2 trainer (issue 41).

Run under torchrun, one backend per launch (the numbers are this process's own):
    torchrun --nproc_per_node 2 -m jetflow.bench.fsdp_memory --config configs/tiny.yaml train.backend=fsdp
It builds the run's trainer side (jetflow.run.sides.TrainerSide: model under the precision mode,
AdamW), takes two supervised warm-up steps, and rank 0 prints one JSON line per rank: the bytes this
rank holds of parameters, gradients and optimizer state (DTensors counted by their local shard), the
bytes its parameter all-gathers received in the second step (and the bytes it all-reduced: the FP8
all-gather's block amax, the gradient norm, under HSDP the replicas' gradients), and the process's peak resident set
(which on rank 0 also holds the whole model it builds before sharding; the other ranks receive it a unit at
a time, jetflow.train.fsdp.from_rank0).
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys

import torch
import torch.distributed as dist


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * t.element_size() for t in tensors)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds (its shards under FSDP)."""
    params = list({id(p): p for p in model.parameters()}.values())
    moments = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    out = {"params": _nbytes(params), "grads": _nbytes([p.grad for p in params if p.grad is not None]),
           "optimizer": _nbytes(moments)}
    out["total"] = sum(out.values())
    return out


@contextlib.contextmanager
def counted_all_gathers():
    """{"bytes": ..., "all_reduce_bytes": ...}: the bytes this rank receives from `all_gather_single` (the
    collective FSDP2's parameter all-gathers call, torch 2.13) and the bytes it all-reduces (the FP8
    all-gather's block amax grids, the gradient norm) while the block runs."""
    seen = {"bytes": 0, "all_reduce_bytes": 0}
    original_gather, original_reduce = dist.all_gather_single, dist.all_reduce

    def gathering(output, input, *args, **kwargs):
        seen["bytes"] += output.numel() * output.element_size()
        return original_gather(output, input, *args, **kwargs)

    def reducing(tensor, *args, **kwargs):
        seen["all_reduce_bytes"] += tensor.numel() * tensor.element_size()
        return original_reduce(tensor, *args, **kwargs)

    dist.all_gather_single, dist.all_reduce = gathering, reducing
    try:
        yield seen
    finally:
        dist.all_gather_single, dist.all_reduce = original_gather, original_reduce


def main(argv: list[str]) -> None:
    from jetflow.config import load_config
    from jetflow.distributed import init_from_env
    from jetflow.run.sides import TrainerSide
    from jetflow.run.validate import validate_run

    config = argv[argv.index("--config") + 1] if "--config" in argv else None
    overrides = [a for i, a in enumerate(argv) if a != "--config" and (i == 0 or argv[i - 1] != "--config")]
    cfg = load_config(config, [*overrides, "eval.num_prompts=0"])
    derived, inputs = validate_run(cfg)
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    dp = init_from_env(cfg.model.device)
    side = TrainerSide(cfg, derived, inputs, dp)
    side.warmup_step(0)
    with counted_all_gathers() as gathered:  # one whole step (forward and backward gathers)
        side.warmup_step(1)
    row = {"backend": cfg.train.backend, "model": cfg.model.path, "mode": cfg.precision.mode,
           "world_size": dist.get_world_size() if dist.is_initialized() else 1, "rank": dp.global_rank,
           **state_bytes(side.model, side.warmup.trainer.optimizer),
           "all_gather_bytes_per_step": gathered["bytes"], "all_reduce_bytes_per_step": gathered["all_reduce_bytes"],
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    rows = [None] * row["world_size"]
    if dist.is_initialized():
        dist.all_gather_object(rows, row)
    else:
        rows = [row]
    if dp.is_main:
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main(sys.argv[1:])
