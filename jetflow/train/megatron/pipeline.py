"""Pipeline parallelism on Megatron's pipeline groups: a GPipe schedule over explicit stage-to-stage
send/recv with autograd through it, and the gather that gives every stage the tensors of all stages.

Megatron-Core builds the stages (GPTModel with pre_process / post_process, TransformerBlock holding
num_layers / pp layers with their global layer numbers), owns the process groups (pipeline group,
embedding group of the first and last stage) and the rank layout. The schedule is jetflow's, because
Megatron-Core 0.16.1's own (`get_forward_backward_func()` ->
`forward_backward_pipelining_without_interleaving`) does not run on the CPU (measured under torchrun,
gloo, a CPU build of torch):
  - schedules.py:2138 `total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")` at the start
    of the schedule raises `AssertionError: Torch not compiled with CUDA enabled`;
  - `P2PCommunicator._communicate` allocates every received activation and gradient with
    `torch.empty(shape, requires_grad=True, device=torch.cuda.current_device(), ...)`
    (p2p_communication.py:313) and raises the same (variable shapes would also need
    `_communicate_shapes`, CUDA tensors again, then `torch.cuda.synchronize()`).
Both sit inside function bodies (no device argument), so replacing them would mean copying the
schedule. The schedule here is small: all forwards, then all backwards (GPipe), micro-batch by
micro-batch in the caller's order, which is also the order of the one-process gradient accumulation.

Activations cross stages in Megatron's layout (T, B, C), in the parameters' dtype (the residual stream's).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from jetflow.precision import NonFiniteError


def stage_neighbours(group) -> tuple[int | None, int | None]:
    """Global ranks of the previous and next pipeline stage (None at the ends)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    prev = dist.get_global_rank(group, rank - 1) if rank > 0 else None
    nxt = dist.get_global_rank(group, rank + 1) if rank < size - 1 else None
    return prev, nxt


def gpipe(n: int, shapes: list[tuple[int, int, int]], stage_forward: Callable[[int, torch.Tensor | None], torch.Tensor],
          head: Callable[[int, torch.Tensor], tuple[torch.Tensor | None, Any]], *, group, dtype: torch.dtype,
          device: torch.device, forward_only: bool = False,
          finish_grads: Callable[[], None] | None = None) -> list[Any]:
    """Run n micro-batches through the pipeline stages; returns head's results on every stage.

    shapes[i]: (T, B, C) of micro-batch i's activation between stages (every stage knows it: all stages
    hold the same micro-batches). stage_forward(i, x) runs this stage's layers on x (None on the first
    stage: it embeds the tokens itself) and returns (T, B, C). head(i, y) runs on the last stage on its
    output and returns (loss, result): the loss is backpropagated through every stage (unless
    forward_only), the result (any picklable value) is broadcast to every stage. finish_grads() runs on
    every stage after the last backward (the tied-embedding gradient sum).

    An FP8 quantizer meeting NaN/Inf (NonFiniteError) on any stage does not stop the exchange (the
    other stages would wait forever): that micro-batch sends NaN onwards, and at the end every stage
    raises NonFiniteError, so each one skips the step the same way.
    """
    prev, nxt = stage_neighbours(group)
    first, last = prev is None, nxt is None
    pending: list[tuple[Any, torch.Tensor]] = []  # (isend work, the tensor it reads: kept alive until waited)
    inputs: list[torch.Tensor | None] = []
    outputs: list[torch.Tensor | None] = []
    losses: list[torch.Tensor | None] = []
    results: list[Any] = []
    bad = False

    def send(t: torch.Tensor, dst: int) -> None:
        t = t.detach().contiguous()
        pending.append((dist.isend(t, dst, group=group), t))

    for i in range(n):
        x = None
        if not first:
            x = torch.empty(shapes[i], dtype=dtype, device=device)
            dist.recv(x, prev, group=group)
            x.requires_grad_(not forward_only)
        y = loss = result = None
        try:
            with torch.set_grad_enabled(not forward_only):
                y = stage_forward(i, x)
                if y.dtype != dtype or tuple(y.shape) != tuple(shapes[i]):
                    raise RuntimeError(f"pipeline stage output {tuple(y.shape)} {y.dtype}, expected "
                                       f"{tuple(shapes[i])} {dtype}")
                if last:
                    loss, result = head(i, y.transpose(0, 1))
        except NonFiniteError:
            bad = True
            y = loss = result = None
        if not last:
            send(y if y is not None else torch.full(shapes[i], float("nan"), dtype=dtype, device=device), nxt)
        inputs.append(x)
        outputs.append(None if forward_only or last else y)
        losses.append(None if forward_only else loss)
        results.append(result)

    if not forward_only:
        for i in range(n):
            try:
                if last:
                    if losses[i] is not None:
                        losses[i].backward()
                else:
                    grad = torch.empty(shapes[i], dtype=dtype, device=device)
                    dist.recv(grad, nxt, group=group)
                    if outputs[i] is not None:
                        outputs[i].backward(grad)
            except NonFiniteError:
                bad = True
            if not first:
                g = inputs[i].grad
                if g is None:  # this micro-batch failed here (or its loss ignored the input)
                    g = torch.full(shapes[i], float("nan") if bad else 0.0, dtype=dtype, device=device)
                send(g, prev)
            inputs[i] = outputs[i] = losses[i] = None  # free the micro-batch's graph
        if finish_grads is not None:
            finish_grads()

    return _finish(pending, bad, results if last else None, group, device)


def _finish(pending: list[tuple[Any, torch.Tensor]], bad: bool, results: list[Any] | None, group,
            device: torch.device) -> list[Any]:
    """The end of a schedule on every stage: the sends waited for, NonFiniteError on every stage if any
    stage met NaN/Inf, else the last stage's `results` broadcast to all."""
    for work, _ in pending:
        work.wait()
    flag = torch.tensor([float(bad)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item():
        raise NonFiniteError("an FP8 quantizer met NaN/Inf on a pipeline stage; the step is bad on every stage")
    box = [results]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, dist.get_world_size(group) - 1), group=group)
    return box[0]


def allgather_stages(tensors: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """The union of every pipeline stage's `tensors` (disjoint names), on every stage: one broadcast of
    the names/shapes/dtypes and one of the bytes per stage. Any dtype (float8 included) travels as bytes."""
    out: dict[str, torch.Tensor] = {}
    me = dist.get_rank(group)
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    for stage in range(dist.get_world_size(group)):
        src = dist.get_global_rank(group, stage)
        meta = [[(k, tuple(t.shape), t.dtype) for k, t in tensors.items()] if stage == me else None]
        dist.broadcast_object_list(meta, src=src, group=group)
        sizes = [torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype in meta[0]]
        if stage == me:
            flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]
                             or [torch.empty(0, dtype=torch.uint8, device=device)])
        else:
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=src, group=group)
        if stage == me:
            out.update(tensors)
            continue
        for (name, shape, dtype), part in zip(meta[0], flat.split(sizes)):
            out[name] = part.clone().view(dtype).reshape(shape)  # a fresh storage: aligned for any dtype
    return out
