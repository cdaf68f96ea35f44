"""The native Decoder sharded with PyTorch FSDP2 (`train.backend=fsdp`): every decoder layer and the
root (embedding, final norm, lm_head) a `fully_shard` unit over a 1-D device mesh of the data-parallel
ranks (gloo on the CPU, NCCL on GPUs). Each rank keeps 1/N of the fp32 master weights, gradients and
AdamW moments; a unit's weights are all-gathered before its forward (and again in backward) and its
gradients reduce-scattered after its backward.

The arithmetic of every forward is the native trainer's: the all-gather moves the fp32 master
weights (no MixedPrecisionPolicy) and the same PrecisionLinears compute on the gathered tensor (fp32 or
bf16 GEMMs), except the FP8 linears' weights under `unified`, which each rank quantizes on its own shard
and the all-gather moves as E4M3 bytes (jetflow.train.fsdp.gather): the bytes quantizing the whole
weight gives, which the linears compute with and the weight sync ships. So the trainer's log-probs equal
the rollout engine's exactly as with the replicated trainer. What differs from one
process is the summation order of the gradients only: each micro-batch's gradient is reduce-scattered
(SUM, no division: the loss is already scaled by the global denominator) in the backward's fixed unit
order and accumulated into the shard, where the replicated trainer sums micro-batches first and
all-reduces once.

HSDP (`train.data_parallel_shard_size` = S < world W): a 2-D (W / S replicas, S shards) mesh. Each rank
keeps 1/S of the state, all-gathers within its shard group (the same bytes as FSDP over S ranks), and a
micro-batch's gradients are reduce-scattered (SUM) within the shard group, then all-reduced (SUM) across
the replicas: the same W per-rank terms as FSDP over W ranks sums, grouped differently, so its updates
differ from FSDP's only in fp32 summation order (per element and micro-batch at most 2 * gamma_(W-1) *
sum |g_r|, gamma_n = n u / (1 - n u), u = 2^-24).

`FSDPPolicy` is a `jetflow.model.protocol.ShardedPolicy`, so the Trainer, weight sync and checkpoints
take the Megatron backend's paths: gathered HF-named weights, the FP8 bytes of the gathered weights,
a global gradient norm, and a collective forward (every rank runs every micro-batch: a rank that skipped
one would leave the others waiting in its all-gather).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from jetflow.model.decoder import Decoder
from jetflow.model.moe import model_load_balancing_loss
from jetflow.precision import QuantizedTensor, quantized_weights
from jetflow.precision.kv import attach_kv_quantizer
from jetflow.precision.linear import PrecisionLinear, linear_precision
from jetflow.train.fsdp.from_rank0 import any_rank_on_meta, fill_from_rank0
from jetflow.train.fsdp.gather import FP8ShardWeight, plain, wrap_for_low_precision_all_gather


def init_world(device: str) -> None:
    """The default process group FSDP's mesh needs: torchrun's or the Ray trainer workers' (joined already,
    jetflow.run.ray_placement), or a world of one process."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def data_parallel_mesh(device: str, shard_size: int = 0):
    """FSDP's mesh over the world: 1-D (every rank one shard group) for shard_size 0 or the world size, else
    HSDP's 2-D (replicate, shard) mesh, whose rows (consecutive ranks) are the shard groups: FSDP
    reduce-scatters the gradients within a row, then all-reduces them down the columns."""
    from torch.distributed.device_mesh import init_device_mesh

    world, kind = dist.get_world_size(), "cuda" if device.startswith("cuda") else "cpu"
    if shard_size in (0, world):
        return init_device_mesh(kind, (world,))
    if world % shard_size:  # refused first in jetflow.run.validate
        raise ValueError(f"shard size {shard_size} does not divide the world of {world} ranks")
    return init_device_mesh(kind, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def shard_group(mesh) -> dist.ProcessGroup:
    """The process group of this rank's shard group (the mesh's last dimension)."""
    return mesh.get_group(mesh.ndim - 1)


class FSDPPolicy(nn.Module):
    """A Decoder (already under the precision mode) sharded over every rank of the world, or (HSDP,
    `shard_size` ranks < world) over each group of `shard_size` consecutive ranks and replicated across the
    world / shard_size groups."""

    tp_size = tp_rank = mp_size = state_size = 1
    state_rank = 0
    state_group = None
    collective_forward = True  # FSDP's all-gathers: every rank runs every micro-batch
    sharded_optimizer_state = True  # each rank holds its shards of AdamW's moments (jetflow.train.fsdp.state)

    def __init__(self, decoder: Decoder, device: str = "cpu", shard_size: int = 0):
        from torch.distributed.fsdp import fully_shard

        super().__init__()
        init_world(device)
        self.decoder = decoder
        self.config = decoder.config
        self.kind, self.recipe = linear_precision(decoder)  # what its linears run (ShardedPolicy)
        self.mesh = data_parallel_mesh(device, shard_size)
        # FP8 linears' weights gather as FP8 bytes, weights read on the bf16 grid as bf16 (jetflow.train.fsdp.gather)
        self.low_precision_gathered = wrap_for_low_precision_all_gather(decoder)
        # ranks other than 0 may hold a meta-device shell: each unit is filled from rank 0 just before it
        # is sharded (jetflow.train.fsdp.from_rank0), so no rank but 0 ever holds the whole model
        from_rank0 = any_rank_on_meta(decoder, device)
        for unit in [*decoder.model.layers, self]:  # the root last: embedding, norm, lm_head (tied or not)
            if from_rank0:
                fill_from_rank0(unit, device)
            fully_shard(unit, mesh=self.mesh)
        for unit in self._units():
            # a plain SUM (no AVG / PREMUL_SUM, which gloo lacks): each rank's loss is already its share of
            # the global-batch loss
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        # the sharded parameters (DTensors): inside a forward `parameters()` yields the gathered ones
        self._shards: list[DTensor] = list(self.parameters())
        self._seen_versions: tuple[int, ...] | None = None
        self._release_others_when_computing()

    def _units(self) -> list[nn.Module]:
        return [self, *self.decoder.model.layers]

    def _release_others_when_computing(self) -> None:
        """Before a decoder layer computes (its forward, or its backward: a hook on its output's gradient),
        every other unit's linears drop what they derived from their gathered weights (the exact GEMM's
        bf16 / fp32 panels): whole-weight tensors that would otherwise outlive FSDP's reshard and add up
        to the whole model on every rank (bf16 at 2 ranks, 0.97B parameters: 12 GB a rank instead of 9).
        Each all-gather refills the weights, so a unit derives them again from what it gathered: the same
        bits, one packing per gather."""
        inner = {id(m) for layer in self.decoder.model.layers for m in layer.modules()}
        linears = {unit: [m for m in unit.modules() if isinstance(m, PrecisionLinear)
                          and (unit is not self or id(m) not in inner)] for unit in self._units()}

        def release_all_but(keep: nn.Module) -> None:
            for unit, owned in linears.items():
                if unit is not keep:
                    for m in owned:
                        m.drop_caches()

        def before_backward(layer: nn.Module, args, output) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: release_all_but(layer))

        for layer in self.decoder.model.layers:
            layer.register_forward_pre_hook(lambda layer, args: release_all_but(layer))
            layer.register_forward_hook(before_backward)

    # The Decoder's trainer interface -----------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (B, T, C): the root unit's forward (FSDP's hooks run on `forward`)."""
        self._forget_stale_weights()
        return self.decoder.forward_hidden(input_ids, attention_mask=attention_mask, routed_experts=routed_experts)

    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       **kwargs) -> torch.Tensor:
        return self(input_ids, attention_mask, **kwargs)

    @property
    def lm_head(self) -> nn.Module:
        """The Decoder's lm_head: its weight stays gathered after the root's forward (FSDP does not
        reshard the root after forward), until the backward's end reshards it."""
        return self.decoder.lm_head

    def num_params(self) -> int:
        return self.decoder.num_params()  # DTensor numel is the global size

    def _forget_stale_weights(self) -> None:
        """Drop the PrecisionLinears' per-weight-version caches (quantized bytes, bf16 copies, packed
        panels) after the shards changed (an optimizer step, a restore). They are keyed by the weight
        tensor's address and version counter, and FSDP refills one gathered buffer in place with the
        version counter preserved: the key would not see a new step's weights."""
        # an optimizer step on a DTensor bumps the DTensor's counter, an in-place copy into its local shard the shard's
        versions = tuple((p._version, p._local_tensor._version) for p in self._shards)
        if versions == self._seen_versions:
            return
        for p in self._shards:
            if isinstance(p._local_tensor, FP8ShardWeight):
                p._local_tensor.forget_quantized()
        for m in self.decoder.modules():
            if isinstance(m, PrecisionLinear):
                m.drop_caches()
        self._seen_versions = versions

    # ShardedPolicy: weights for sync, checkpoints and the rollout's copy --------------------------
    @torch.no_grad()
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The Decoder's state dict with every tensor whole (an all-gather each, in name order: call it
        on every rank). A tied lm_head is the embedding itself and is left out, as `named_parameters` does."""
        out = {}
        for name, t in self.decoder.state_dict(keep_vars=True).items():
            if not (self.config.tie_word_embeddings and name == "lm_head.weight"):
                out[name] = plain(t.full_tensor() if isinstance(t, DTensor) else t).detach()
        return out

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Whole HF-named tensors (every rank holds them) into this rank's shards."""
        own = self.decoder.state_dict(keep_vars=True)
        tied = self.config.tie_word_embeddings
        missing = [k for k in own if k not in state_dict and not (tied and k == "lm_head.weight")]
        unexpected = [k for k in state_dict if k not in own]
        if missing or unexpected:
            from jetflow.model import CheckpointError
            raise CheckpointError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, full in state_dict.items():
            param = own[name]
            if isinstance(param, DTensor):
                local = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(full)

    def quantized_weights(self) -> dict[str, QuantizedTensor]:
        """The FP8 bytes every FP8 linear computes with: quantized from the gathered weight, as in the
        trainer's forward (a collective: every rank calls it)."""
        self._forget_stale_weights()
        for unit in self._units():
            unit.unshard()
        try:
            # copies: the FP8 all-gather's bytes live in FSDP's buffers, freed at the reshard
            return {name: QuantizedTensor(wq.data.clone(), wq.scale_inv.clone(), wq.block)
                    if isinstance(wq, QuantizedTensor) else wq for name, wq in quantized_weights(self.decoder).items()}
        finally:
            for unit in self._units():
                unit.reshard()

    # A reference policy (jetflow.train.reference) ------------------------------------------------
    @torch.no_grad()
    def freeze_as_reference(self) -> None:
        """Freeze as the frozen reference of a KL penalty: no gradients, and (unified) each FP8 weight's
        shard quantized once, by one all-gather of every unit (a collective: every rank calls it), then
        its fp32 rows freed: the rank keeps its rows' FP8 bytes and the whole weight's scales, which every
        later all-gather sends (FP8ShardWeight.freeze). Other weights keep their fp32 shards. Its root unit
        is resharded after each lm_head projection (one more all-gather of it per chunk under
        train.logprob_chunk_tokens)."""
        for p in self._shards:
            p.requires_grad_(False)
        self._forget_stale_weights()
        for unit in self._units():
            unit.unshard()  # FSDP's lazy init (its last re-padding of the shards), then the FP8 all-gathers
        for unit in self._units():
            unit.reshard()
        for p in self._shards:
            if isinstance(p._local_tensor, FP8ShardWeight):
                p._local_tensor.freeze()
        # FSDP reshards the root unit (embedding, norm, lm_head) at a backward's end only, and a reference
        # runs none: its lm_head gathers the root if needed and reshards it after each projection, so the
        # gathered weights are not held between steps
        self.decoder.lm_head.register_forward_pre_hook(lambda *_: self.unshard())
        self.decoder.lm_head.register_forward_hook(lambda *_: self.reshard())

    def held_tensors(self) -> list[torch.Tensor]:
        """What this rank holds between forwards: its shards (a frozen FP8 weight's fp32 storage freed, its
        bytes and scales instead) and the Decoder's buffers."""
        out: list[torch.Tensor] = list(self.decoder.buffers())
        for p in self._shards:
            local = p._local_tensor
            out.append(plain(local))
            if isinstance(local, FP8ShardWeight):
                out += local.quantized_tensors()
        return out

    # ShardedPolicy: gradients ------------------------------------------------------------------
    def reduce_data_parallel_grads(self, dp) -> None:
        """Nothing to do: FSDP reduce-scattered every gradient in the backward."""

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm: the squared norms of every rank's shards summed over ranks."""
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in self._shards if p.grad is not None]
        local = torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
        total = local.to(self.mesh.device_type)
        dist.all_reduce(total, group=shard_group(self.mesh))  # the replicas hold the same (all-reduced) shards
        norm = total.sqrt().cpu()
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return norm

    # ShardedPolicy: the rest -----------------------------------------------------------------
    def load_balancing_loss(self) -> torch.Tensor | None:
        return model_load_balancing_loss(self.decoder)

    def attach_kv_quantizer(self, quantizer):
        attach_kv_quantizer(self.decoder, quantizer)
        return quantizer
