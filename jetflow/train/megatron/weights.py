"""MegatronPolicy's weights in Hugging Face names: TP shards, pipeline stages and expert-parallel ranks
gathered into full HF-named tensors and FP8 bytes (what weight sync, checkpoints and the rollout side
read), and HF tensors scattered into this rank's shards."""

from __future__ import annotations

import torch
import torch.distributed as dist

from jetflow.precision import QuantizedTensor

from .pipeline import allgather_stages
from .sharding import hf_to_megatron, is_expert_param, megatron_to_hf, tensor_parallel_dims


class PolicyWeights:
    """Mixin of MegatronPolicy (which owns the attributes used here: gpt, config, tp/pp/ep sizes, ranks and
    groups, _global_names, _tied_copy, _linears, _output_weight)."""

    # Weights in HF names -----------------------------------------------------------------------
    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return parts

    @torch.no_grad()
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors gathered from all TP ranks and pipeline stages (every rank gets them);
        the keys of `Decoder(config).named_parameters()`. A collective: call it on every rank of the
        model-parallel group (TP x PP)."""
        local = {self._global_names[n]: p.detach() for n, p in self.gpt.named_parameters()
                 if self._global_names[n] is not None}  # one-stage names; not the tied copy
        if self.ep_size > 1:  # every EP rank's experts (disjoint global names), on every rank
            local.update(allgather_stages({k: v for k, v in local.items() if is_expert_param(k)}, self.ep_group))
        shards = [dict(local) for _ in range(self.tp_size)]
        if self.tp_size > 1:
            for name in tensor_parallel_dims(self.config):
                if name in local:  # the same names on every rank of this stage's TP group
                    for r, part in enumerate(self._gather(local[name])):
                        shards[r][name] = part
        if self.pp_size > 1:
            merged = allgather_stages({f"{r}/{k}": v for r, shard in enumerate(shards) for k, v in shard.items()},
                                      self.pp_group)
            shards = [{} for _ in range(self.tp_size)]
            for key, tensor in merged.items():
                r, name = key.split("/", 1)
                shards[int(r)][name] = tensor
        return megatron_to_hf(shards, self.config)

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy HF-named full tensors (e.g. a Decoder's state dict) into this rank's shards (this
        pipeline stage's layers; the tied copy from the embedding)."""
        full = hf_to_megatron(state_dict, self.config, self.tp_size, self.tp_rank, self.ep_size,
                              self.ep_rank)  # one-stage names, this rank's experts
        params = dict(self.gpt.named_parameters())
        wanted = {n: g for n, g in self._global_names.items() if g is not None}
        if self._tied_copy and self.last_stage:
            wanted["output_layer.weight"] = "embedding.word_embeddings.weight"
        missing = {n for n, g in wanted.items() if g not in full}
        unexpected = set(full) - set(wanted.values()) if self.pp_size == 1 else set()
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
        for module in self._linears():
            weight = self._output_weight() if module is getattr(self.gpt, "output_layer", None) else module.weight
            for name, q in module.quantized_segments(weight).items():
                if ".experts." in name:
                    expert_names.add(name)
                if self.tp_size > 1:
                    dim = module.parallel_dim
                    data = torch.cat([p.view(q.data.dtype) for p in self._gather(q.data.view(torch.uint8))], dim)
                    q = QuantizedTensor(data, torch.cat(self._gather(q.scale_inv), dim), q.block)
                out[name] = q
        if self.ep_size > 1:  # every EP rank's experts
            out.update(_allgather_quantized({k: q for k, q in out.items() if k in expert_names}, self.ep_group))
        if self.pp_size > 1:
            out = _allgather_quantized(out, self.pp_group)
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
