"""MegatronPolicy's gradients: the global norm over the model-parallel group (every expert counted once,
in the one-process order), clipping by it, and the data-parallel reduction: a sum, as the native
trainer's (experts over the expert-data-parallel group)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from jetflow.model.model_config import ModelConfig

from .parallel import ParallelLayout, expert_data_parallel_group
from .pipeline import stage_neighbours
from .sharding import is_expert_param, tensor_parallel_dims


class ShardedGrads:
    """The gradients of one rank's GPTModel `gpt` over the process grid `layout`: their global norm,
    clipping by it, and their data-parallel reduction. `global_names`: `gpt`'s parameter names -> the
    one-stage model's (None: the tied copy of the embedding, counted once as the embedding)."""

    def __init__(self, gpt: nn.Module, config: ModelConfig, layout: ParallelLayout, global_names: dict[str, str | None]):
        self.gpt, self.config, self.layout, self.global_names = gpt, config, layout, global_names
        self.split_adapters: set[str] = set()  # LoRA: the global names of the TP-split adapter shards (lora.py)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients over the model-parallel group (TP x PP): TP-split
        parameters counted on every rank, replicated ones (norms, row-parallel biases) once per stage,
        the tied embedding once (not its copy on the last stage). The native Trainer's
        `clip_grad_norm_` sees only this rank's shards; under TP/PP > 1 clip with `clip_grad_norm_` below.
        Pipeline stages add their squares to the running sum of the stages before them, in the
        one-stage model's parameter order, so under TP = 1 the norm is the one-process norm bit for bit."""
        split = set(tensor_parallel_dims(self.config)) | self.split_adapters

        def add_squares(total: torch.Tensor) -> torch.Tensor:
            if self.layout.ep_size > 1:
                return self._add_squares_over_experts(total)
            for name, p in self.gpt.named_parameters():
                name = self.global_names[name]
                if name is not None and p.grad is not None and (name in split or self.layout.tp_rank == 0):
                    total += p.grad.detach().float().pow(2).sum()
            return total

        zero = torch.zeros((), dtype=torch.float32, device=next(self.gpt.parameters()).device)
        if self.layout.pp_size == 1:
            total = add_squares(zero)
            if self.layout.tp_size > 1:
                dist.all_reduce(total, group=self.layout.tp_group)
            return total.sqrt()
        prev, nxt = stage_neighbours(self.layout.pp_group)
        total = zero.clone()
        if prev is not None:
            dist.recv(total, prev, group=self.layout.pp_group)
        if self.layout.tp_size == 1:
            total = add_squares(total)
        else:
            part = add_squares(zero)
            dist.all_reduce(part, group=self.layout.tp_group)
            total += part
        if nxt is not None:
            dist.send(total, nxt, group=self.layout.pp_group)
        dist.broadcast(total, src=dist.get_global_rank(self.layout.pp_group, self.layout.pp_size - 1), group=self.layout.pp_group)
        return total.sqrt()

    def _add_squares_over_experts(self, total: torch.Tensor) -> torch.Tensor:
        """`total` plus the squared gradients of this stage under EP > 1 (TP = 1), every expert once,
        added in the one-process model's parameter order: each layer's experts of EP rank 0, then of
        rank 1, ... (so the norm, and the clipping, equal one process's bit for bit). One all-gather of
        the per-parameter squares over the expert-parallel group."""
        named = [(n, p) for n, p in self.gpt.named_parameters() if self.global_names[n] is not None]

        def squares(p: nn.Parameter) -> torch.Tensor:
            return p.grad.detach().float().pow(2).sum() if p.grad is not None else total.new_zeros(())

        mine = torch.stack([squares(p) for n, p in named if is_expert_param(n)] or [total.new_zeros(())])
        every = [torch.empty_like(mine) for _ in range(self.layout.ep_size)]
        dist.all_gather(every, mine.contiguous(), group=self.layout.ep_group)
        i, k = 0, 0  # next parameter, next local expert parameter
        while i < len(named):
            if not is_expert_param(named[i][0]):
                total += squares(named[i][1])
                i += 1
                continue
            j = i
            while j < len(named) and is_expert_param(named[j][0]):
                j += 1
            for rank_squares in every:  # this layer's experts, EP rank by EP rank: global expert order
                for sq in rank_squares[k:k + j - i]:
                    total += sq
            k, i = k + j - i, j
        return total

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale all gradients so that the global (TP-aware) norm is at most max_norm; returns the norm."""
        norm = self.grad_norm()
        coef = max_norm / (norm + 1e-6)
        if bool(coef < 1):
            for p in self.gpt.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    def _expert_params(self) -> list[nn.Parameter]:
        return [p for n, p in self.gpt.named_parameters() if is_expert_param(n)]

    def _dense_params(self) -> list[nn.Parameter]:
        """Every parameter but the experts' (replicated over the data-parallel group)."""
        return [p for n, p in self.gpt.named_parameters() if not is_expert_param(n)]

    def reduce_data_parallel_grads(self, dp) -> None:
        """Sum gradients over the data-parallel ranks `dp` (a jetflow.distributed.DataParallel over
        Megatron's data-parallel group), an expert's over the expert-data-parallel group instead: the
        ranks of one EP group hold different experts, and an expert's gradient already holds the
        contributions of every EP rank's tokens (the dispatch's backward). The Trainer calls this in
        place of `dp.all_reduce_grads(params)`."""
        if not dp.enabled:
            return
        dp.all_reduce_grads([p for p in self._dense_params() if p.requires_grad])
        experts = [p for p in self._expert_params() if p.requires_grad]
        for p in experts:  # as dp.all_reduce_grads does (also for an expert-data-parallel group of 1): an
            if p.grad is None:  # expert without tokens still takes its optimizer step, as on other ranks
                p.grad = torch.zeros_like(p)
        if experts:
            dp.within(*expert_data_parallel_group()).all_reduce_grads(experts)
