"""Trainer -> rollout weight transfer, versioned and fingerprinted.

What crosses depends on the precision mode:
  fp32     every tensor in fp32.
  bf16     matrices in bf16, the grid both sides compute them on (bf16 GEMMs, bf16 embeddings);
           vectors (norms, biases) as they are, since the trainer computes norms with its own.
  mixed    as bf16; the rollout side quantizes the FP8 linears itself (the common recipe whose
           mismatch the ablations measure).
  unified  the FP8 linears as the trainer's own quantized bytes + scale_inv (never requantized); the
           other matrices (embeddings, lm_head, kept layers) in bf16, the grid both sides compute them
           on; vectors (norms, biases) as they are. The recipe fingerprint travels along and the
           receiver refuses another recipe's bytes.
So in every mode but mixed the rollout side computes with exactly the trainer's values.
LoRA (model.lora.rank > 0, jetflow.precision.lora): the adapters travel in fp32 as they are (`adapters`);
the frozen base travels as above with the first update only, and every later update is the adapters
alone (`base=False`), a receiver refusing such an update before it holds a base.
Every receipt checks the version (a stale or repeated update is refused) and, for FP8 payloads, that
no scale is zero or non-finite (users of FP8 RL report all-zero and stale scales after sync).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from jetflow.model.protocol import ShardedPolicy, adapter_weights
from jetflow.precision import QuantizedTensor, check_fingerprint, fp8_linears, quantized_weights
from jetflow.precision.lora import adapter_parameters


class StaleWeightsError(RuntimeError):
    """A weight update is not newer than what the receiver already holds."""


class CorruptWeightsError(RuntimeError):
    """A weight update failed its integrity checks (checksum, zero or non-finite scales)."""


class MissingBaseError(RuntimeError):
    """An update of LoRA adapters alone reached a receiver that holds no base weights yet."""


@dataclass
class WeightUpdate:
    version: int
    mode: str
    fingerprint: str | None  # recipe fingerprint of the quantized payload (unified), else None
    quantized: dict[str, QuantizedTensor] = field(default_factory=dict)  # module name -> FP8 bytes + scales
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter name -> high-precision tensor
    kv_scales: dict[str, torch.Tensor] | None = None  # per-layer FP8 K/V scales (precision.kv_cache_fp8)
    checksum: str = ""
    adapters: dict[str, torch.Tensor] = field(default_factory=dict)  # LoRA: adapter parameter name -> fp32 tensor
    base: bool = True  # False: the LoRA adapters alone (the frozen base came with an earlier update)

    def nbytes(self) -> int:
        return (sum(q.nbytes() for q in self.quantized.values())
                + sum(t.numel() * t.element_size() for t in self.tensors.values()) + self.adapter_nbytes())

    def adapter_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.adapters.values())

    def compute_checksum(self) -> str:
        """sha256 over every byte and scale, in name order (detects corruption in transit)."""
        h = hashlib.sha256()
        for name in sorted(self.quantized):
            h.update(name.encode())
            for part in self.quantized[name].parts().values():  # bytes and scales (of any recipe family)
                h.update(part.view(torch.uint8).cpu().numpy().tobytes())
        for name in sorted(self.tensors):
            t = self.tensors[name].detach().contiguous()
            h.update(name.encode())
            h.update(t.view(torch.uint8).cpu().numpy().tobytes() if t.dtype == torch.bfloat16 else t.cpu().numpy().tobytes())
        for name in sorted(self.adapters):  # LoRA's (none: the digest of an update without them is unchanged)
            h.update(name.encode())
            h.update(self.adapters[name].detach().contiguous().cpu().numpy().tobytes())
        if not self.base:
            h.update(b"adapters alone")
        return h.hexdigest()[:16]


def build_update(model: nn.Module, mode: str, version: int, fingerprint: str | None = None,
                 with_checksum: bool = False, kv_scales: dict[str, torch.Tensor] | None = None,
                 base: bool = True) -> WeightUpdate:
    """The payload for rollout engines after the trainer reached weight `version`.

    A `ShardedPolicy` (the Megatron backend's) gives its HF-named weights and FP8 bytes through its
    `hf_state_dict()` / `quantized_weights()` (collectives under tensor parallelism:
    call on every rank); any other model is read through `named_parameters` and its FP8 linears.
    A model with LoRA adapters: they go in `adapters` (fp32; a sharded policy's gathered whole, in the native
    names); `base=False` leaves the frozen base out."""
    sharded = isinstance(model, ShardedPolicy)
    adapters = {k: v.detach() for k, v in adapter_weights(model).items()}  # TP: gathered whole, native names
    if not base:  # (a sharded policy's frozen FP8 linears may hold no master weight to gather any more)
        if not adapters:
            raise ValueError("build_update: base=False ships the LoRA adapters alone, and the model has none")
        update = WeightUpdate(version, mode, fingerprint if mode == "unified" else None, adapters=adapters, base=False)
        update.kv_scales = kv_scales
        if with_checksum:
            update.checksum = update.compute_checksum()
        return update
    params = model.hf_state_dict() if sharded else dict(model.named_parameters(remove_duplicate=True))
    params = {k: v for k, v in params.items() if k not in adapters}

    def bf16_matrices(skip=frozenset()) -> dict[str, torch.Tensor]:
        # Matrices outside FP8 linears (bf16 linears, embeddings, lm_head, layers the recipe keeps)
        # compute on the bf16 grid on both sides, so bf16 carries them exactly; vectors go as they are.
        return {k: v.detach().to(torch.bfloat16) if v.dim() >= 2 else v.detach()
                for k, v in params.items() if k not in skip}

    if mode == "unified":
        quantized = model.quantized_weights() if sharded else quantized_weights(model)  # the bytes the trainer computes with
        update = WeightUpdate(version, mode, fingerprint, quantized,
                              bf16_matrices({f"{name}.weight" for name in quantized}))
    elif mode in ("bf16", "mixed"):
        update = WeightUpdate(version, mode, None, {}, bf16_matrices())
    elif mode == "fp32":
        update = WeightUpdate(version, mode, None, {}, {k: v.detach() for k, v in params.items()})
    else:
        raise ValueError(f"build_update: unknown mode {mode!r}")
    update.adapters = adapters
    update.kv_scales = kv_scales
    if with_checksum:
        update.checksum = update.compute_checksum()
    return update


def check_update(update: WeightUpdate, current_version: int, fingerprint: str | None) -> None:
    """The checks every receiver runs before it touches its weights (the native rollout, the vLLM
    adapter): the version is newer than `current_version`, the checksum (when sent) holds, FP8
    payloads were made under the receiver's recipe `fingerprint`, and no scale is damaged."""
    if update.version <= current_version:
        raise StaleWeightsError(f"weight update version {update.version} is not newer than the "
                                f"rollout's version {current_version}; refusing it")
    if not update.base and current_version < 0:
        raise MissingBaseError(f"weight update v{update.version} carries the LoRA adapters alone and this rollout has "
                               "no base weights yet (no update with the base reached it); refusing it")
    if update.checksum and update.compute_checksum() != update.checksum:
        raise CorruptWeightsError(f"weight update v{update.version}: checksum mismatch")
    if update.quantized:
        check_fingerprint(fingerprint or "", update.fingerprint or "", "shipped FP8 weights")
        for name, q in update.quantized.items():
            if problem := q.scale_error():
                raise CorruptWeightsError(f"{name}: {problem} in update v{update.version}")


def apply_update(model: nn.Module, update: WeightUpdate, current_version: int, fingerprint: str | None) -> int:
    """Load an update into a rollout-side model; returns the new version."""
    check_update(update, current_version, fingerprint)
    params = dict(model.named_parameters(remove_duplicate=True))
    missing = set(update.tensors) - set(params)
    if missing:
        raise KeyError(f"weight update has tensors the rollout model lacks: {sorted(missing)[:5]}")
    layers = fp8_linears(model) if update.quantized else {}
    unknown = set(update.quantized) - set(layers)
    if unknown:
        raise KeyError(f"quantized weights for modules that are not FP8 linears here: {sorted(unknown)[:5]}")
    held = adapter_parameters(model)
    if set(update.adapters) != set(held):
        raise KeyError(f"weight update's LoRA adapters differ from the rollout model's: it has "
                       f"{sorted(set(update.adapters) - set(held))[:3]} more, {sorted(set(held) - set(update.adapters))[:3]} "
                       "fewer")
    with torch.no_grad():
        for name, tensor in update.tensors.items():
            params[name].copy_(tensor)
        for name, tensor in update.adapters.items():
            held[name].copy_(tensor)
    for name, q in update.quantized.items():
        layers[name].load_quantized(q)
    if update.kv_scales is not None:
        quantizer = model.model.layers[0].self_attn.kv_quantizer
        if quantizer is None:
            raise ValueError("weight update carries FP8 KV scales but the rollout model has no KV quantizer")
        quantizer.load_scales(update.kv_scales)
    return update.version
