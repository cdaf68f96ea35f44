"""Data parallelism for the native trainer (torchrun; gloo on CPU, NCCL on GPU).

Each rank owns whole GRPO groups: rank r takes prompts [r*n/W, (r+1)*n/W) of the step's n prompts,
generates their samples, computes their log-probs and backpropagates its share of the loss. The loss
denominators (tokens or sequences) are summed over ranks first, so each rank's gradient is its part
of the global-batch gradient, and one all-reduce SUM of the gradients gives every rank exactly the
gradient a single process would compute over the whole batch.

This is what DistributedDataParallel does, done explicitly after gradient accumulation: the trainer
projects only the response columns through lm_head (`forward_hidden` + `lm_head`), bypassing the
module's `forward`, which DDP's hooks rely on.
"""

from __future__ import annotations

import faulthandler
import os
import random
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DataParallel:
    rank: int = 0  # within the data-parallel group
    world_size: int = 1  # data-parallel size
    device: str = "cpu"  # where reduction buffers live (NCCL reduces CUDA tensors only)
    group: object = None  # the data-parallel process group (None: the whole world)
    global_rank: int = 0  # rank in the world: rank 0 alone writes files

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.global_rank == 0

    def shard(self, n: int) -> range:
        """This rank's slice of n items (n must divide evenly: ranks hold whole groups)."""
        if n % self.world_size:
            raise ValueError(f"{n} items do not split evenly over {self.world_size} data-parallel ranks")
        per = n // self.world_size
        return range(self.rank * per, (self.rank + 1) * per)

    def sum(self, value: float) -> float:
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return float(t.item())

    def sum_dict(self, values: dict[str, float]) -> dict[str, float]:
        if not self.enabled or not values:
            return values
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return dict(zip(keys, t.cpu().tolist()))

    def mean_dict(self, values: dict[str, float]) -> dict[str, float]:
        """Scalar metrics averaged over ranks (`*_max` keys take the max), identical on every rank."""
        if not self.enabled:
            return values
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.device)
        is_max = torch.tensor([k.endswith("max") for k in keys], device=self.device)
        summed, maxed = t.clone(), t.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self.group)
        dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=self.group)
        out = torch.where(is_max, maxed, summed / self.world_size)
        return dict(zip(keys, out.cpu().tolist()))

    def max_(self, tensor: torch.Tensor) -> None:
        """In-place element-wise max over ranks (e.g. FP8 KV amax, so every rank gets one scale)."""
        if self.enabled:
            buf = tensor.to(self.device)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
            tensor.copy_(buf)

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum gradients over ranks in one flat buffer (ranks already scaled by the global denominator)."""
        if not self.enabled:
            return
        for p in params:  # a rank whose micro-batches were all empty still joins the reduction
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def any_in_world(self, flag: bool) -> bool:
        """True on every process when `flag` is true on any process of the world (data-parallel and
        model-parallel ranks alike)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        """All processes of the world (data-parallel and model-parallel ranks alike)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def within(self, group, rank: int, world_size: int) -> "DataParallel":
        """The data-parallel view of a world that also splits the model (Megatron tensor parallelism):
        collectives over `group`, files still written by world rank 0."""
        return DataParallel(rank=rank, world_size=world_size, device=self.device, group=group,
                            global_rank=self.global_rank)


SINGLE = DataParallel()


EPHEMERAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A TCP port free on this machine right now, for a process to bind a moment later (a rendezvous: torchrun,
    gloo, Ray trainer workers; a test's SLURM or Ray head).

    Chosen below the kernel's ephemeral range, where no other process's `bind(0)` or outgoing connection lands: a
    port from `bind(0)` is ephemeral, and between its choice here and the rendezvous binding it another process
    could take it (EADDRINUSE in fresh-clone CI, beside the Ray tests). The draw is from the OS's entropy, so
    processes choosing at once rarely meet; outside Linux, or with nothing free there, it is `bind(0)`'s port.
    """
    try:
        low = int(EPHEMERAL_PORT_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    draw = random.SystemRandom()  # not the global `random`: runs seed that alike (run.seed), so two test
    # workers or two launchers in one process would draw the same ports
    for port in draw.sample(range(max(1024, low - 10000), low), min(200, max(0, low - 1024))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(device: str = "cpu") -> DataParallel:
    """Join the process group torchrun describes (WORLD_SIZE > 1); a single process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE
    faulthandler.enable()  # a rank that dies in native code (SIGABRT, SIGSEGV) prints its Python stacks
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))
    return DataParallel(rank=dist.get_rank(), world_size=dist.get_world_size(), global_rank=dist.get_rank(),
                        device=f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu")


def shutdown(dp: DataParallel, completed: bool) -> None:
    """Leave the process group after a completed run (whose last collective is a barrier of all ranks,
    so none tears down its connections while another still uses them). After a failure the teardown is
    skipped (torchtitan does the same): a collective teardown while another rank is stuck in a
    collective would hang instead of letting the error end the job."""
    if completed and dp.enabled and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End a torchrun worker at once, after flushing stdout and stderr.

    A finished gloo run once died in CI with SIGABRT ("terminate called without an active exception")
    on rank 1 after every rank had passed the final barrier and rank 0 had reported the run complete:
    a C++ thread of the distributed runtime torn down with the interpreter. torchrun then reports
    the whole completed run as failed. The run's files are closed by then, so nothing is lost by
    skipping the interpreter's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
