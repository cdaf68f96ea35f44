"""MegatronPolicy's weights in Hugging Face names: TP shards, pipeline stages and expert-parallel ranks
gathered into full HF-named tensors and FP8 bytes (what weight sync, checkpoints and the rollout side
read), and HF tensors scattered into this rank's shards."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from jetflow.model.model_config import ModelConfig
from jetflow.precision import QuantizedTensor
from jetflow.precision.lora import is_adapter

from .parallel import ParallelLayout
from .pipeline import allgather_stages
from .sharding import hf_to_megatron, is_expert_param, megatron_to_hf, tensor_parallel_dims


class ShardedWeights:
    """The weights of one rank's GPTModel `gpt` in Hugging Face names, gathered and scattered over the
    process grid `layout`. `global_names`: `gpt`'s parameter names -> the one-stage model's (None: the
    tied copy of the embedding on the last stage, `tied_copy`); `output_weight()`: the lm_head's weight
    (the embedding's when tied); `linears()`: the jetflow linears of `gpt` (their FP8 bytes)."""

    def __init__(self, gpt: nn.Module, config: ModelConfig, layout: ParallelLayout, global_names: dict[str, str | None],
                 tied_copy: bool, output_weight: Callable[[], torch.Tensor], linears: Callable[[], Iterable]):
        self.gpt, self.config, self.layout, self.global_names = gpt, config, layout, global_names
        self.tied_copy, self.output_weight, self.linears = tied_copy, output_weight, linears
        self.split_adapters: set[str] = set()  # LoRA: the global names of the TP-split adapter shards (lora.py)

    def count_params(self, padded_vocab: int) -> int:
        """Parameters of the full model (every TP shard, pipeline stage and expert, not the vocabulary's
        padding to `padded_vocab` rows): `Decoder.num_params`. A collective over the pipeline stages."""
        lay, c = self.layout, self.config
        split = set(tensor_parallel_dims(c)) | self.split_adapters
        n = sum(p.numel() * (lay.tp_size if self.global_names[name] in split else 1)
                * (lay.ep_size if is_expert_param(name) else 1)  # every EP rank holds as many experts
                for name, p in self.gpt.named_parameters() if self.global_names[name] is not None)
        n -= (padded_vocab - c.vocab_size) * c.hidden_size * (lay.first_stage + (lay.last_stage and not c.tie_word_embeddings))
        if lay.pp_size > 1:
            total = torch.tensor([n], dtype=torch.int64, device=next(self.gpt.parameters()).device)
            dist.all_reduce(total, group=lay.pp_group)
            n = int(total.item())
        return n

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.layout.tp_size)]
        dist.all_gather(parts, t.contiguous(), group=self.layout.tp_group)
        return parts

    @torch.no_grad()
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors gathered from all TP ranks and pipeline stages (every rank gets them);
        the keys of `Decoder(config).named_parameters()`. A collective: call it on every rank of the
        model-parallel group (TP x PP)."""
        local = {self.global_names[n]: p.detach() for n, p in self.gpt.named_parameters()
                 if self.global_names[n] is not None and not is_adapter(n)}  # one-stage names; not the tied copy
        if self.layout.ep_size > 1:  # every EP rank's experts (disjoint global names), on every rank
            local.update(allgather_stages({k: v for k, v in local.items() if is_expert_param(k)}, self.layout.ep_group))
        shards = [dict(local) for _ in range(self.layout.tp_size)]
        if self.layout.tp_size > 1:
            for name in tensor_parallel_dims(self.config):
                if name in local:  # the same names on every rank of this stage's TP group
                    for r, part in enumerate(self._gather(local[name])):
                        shards[r][name] = part
        if self.layout.pp_size > 1:
            merged = allgather_stages({f"{r}/{k}": v for r, shard in enumerate(shards) for k, v in shard.items()},
                                      self.layout.pp_group)
            shards = [{} for _ in range(self.layout.tp_size)]
            for key, tensor in merged.items():
                r, name = key.split("/", 1)
                shards[int(r)][name] = tensor
        return megatron_to_hf(shards, self.config)

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy HF-named full tensors (e.g. a Decoder's state dict) into this rank's shards (this
        pipeline stage's layers; the tied copy from the embedding)."""
        full = hf_to_megatron(state_dict, self.config, self.layout.tp_size, self.layout.tp_rank, self.layout.ep_size,
                              self.layout.ep_rank)  # one-stage names, this rank's experts
        params = dict(self.gpt.named_parameters())
        wanted = {n: g for n, g in self.global_names.items() if g is not None and not is_adapter(n)}  # base
        if self.tied_copy and self.layout.last_stage:
            wanted["output_layer.weight"] = "embedding.word_embeddings.weight"
        missing = {n for n, g in wanted.items() if g not in full}
        unexpected = set(full) - set(wanted.values()) if self.layout.pp_size == 1 else set()
        if missing or unexpected:
            raise KeyError(f"Megatron parameters without HF weights: {sorted(missing)[:5]}; "
                           f"HF weights without Megatron parameters: {sorted(unexpected)[:5]}")
        for name, source in wanted.items():
            tensor = full[source]
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: shard shape {tuple(tensor.shape)} != parameter {tuple(params[name].shape)}")
            params[name].copy_(tensor)

    @torch.no_grad()
    def quantized_weights(self) -> dict[str, QuantizedTensor]:
        """{HF module name: QuantizedTensor of the full weight} for every FP8 linear: this step's bytes
        (the ones the forward computes with), shards gathered over TP, pipeline stages and expert-parallel
        ranks. A collective under TP, PP or EP > 1."""
        out = {}
        expert_names = set()
        for module in self.linears():
            weight = self.output_weight() if module is getattr(self.gpt, "output_layer", None) else module.weight
            for name, q in module.quantized_segments(weight).items():
                if ".experts." in name:
                    expert_names.add(name)
                if self.layout.tp_size > 1:
                    dim = module.parallel_dim
                    data = torch.cat([p.view(q.data.dtype) for p in self._gather(q.data.view(torch.uint8))], dim)
                    q = QuantizedTensor(data, torch.cat(self._gather(q.scale_inv), dim), q.block)
                out[name] = q
        if self.layout.ep_size > 1:  # every EP rank's experts
            out.update(_allgather_quantized({k: q for k, q in out.items() if k in expert_names}, self.layout.ep_group))
        if self.layout.pp_size > 1:
            out = _allgather_quantized(out, self.layout.pp_group)
        return out


def _allgather_quantized(quantized: dict[str, QuantizedTensor], group) -> dict[str, QuantizedTensor]:
    """The union of every rank's QuantizedTensors (disjoint names) over `group`, on every rank."""
    parts = {}
    for k, q in quantized.items():
        parts.update({f"{k}/data": q.data, f"{k}/scale_inv": q.scale_inv,
                      f"{k}/block": torch.tensor(q.block, device=q.data.device)})
    parts = allgather_stages(parts, group)
    return {k[:-5]: QuantizedTensor(t, parts[k[:-5] + "/scale_inv"], tuple(parts[k[:-5] + "/block"].tolist()))
            for k, t in parts.items() if k.endswith("/data")}
