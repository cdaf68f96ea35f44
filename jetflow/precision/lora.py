"""LoRA on a frozen base: the one definition of an adapted linear, for the trainer's model and the rollout
engine's alike (both are Decoders whose linears are PrecisionLinears; model.lora in the config).

    y = base(x) + scale * ((x @ A^T) @ B^T),    scale = alpha / rank (PEFT's convention)

`base` is the PrecisionLinear as it is under the run's precision (fp32, bf16 or the FP8 recipe, fast or
exact numerics), frozen; A (rank, in) and B (out, rank) are fp32 and trained, A drawn as PEFT draws it
(kaiming-uniform with a = sqrt(5)), B zeros, so the adapted model starts as the base. The adapter is a
`LoRAAdapter` held by its linear under the name `lora` (parameters `<linear>.lora.A`, `<linear>.lora.B`;
PEFT's `<linear>.lora_A.weight` / `<linear>.lora_B.weight`), and PrecisionLinear.forward adds it after
the base's product: the base's output first, then scale times the adapter's product, in that order, on
both sides (jetflow.precision.linear; sibling linears computed as one GEMM add each one's adapter to its
own output).

Exact numerics: the adapter's two products are exact_linear's fp32 kind (the canonical GEMM, a row's bits
independent of the batch), so a decode step's adapted row is the trainer's full-sequence row bit for bit;
scale and the addition are elementwise. Fast numerics: torch's F.linear, in fp32.

The frozen base (`freeze_base`): every parameter but the adapters stops requiring grad; an FP8 linear keeps
its recipe bytes and scales and no high-precision weight (PrecisionLinear.keep_bytes_only, the reference
policy's mechanism); a bf16 linear of the decoder layers keeps its weight in bf16 (the grid it computes
on); fp32 stays fp32.
"""

from __future__ import annotations

import hashlib
import math
from fnmatch import fnmatchcase
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from jetflow.precision.exact import exact_linear
from jetflow.precision.exact_cache import ExactCache
from jetflow.precision.linear import PrecisionLinear, layer_index

__all__ = ["LoRAAdapter", "adapter_parameters", "apply_lora", "base_digest", "freeze_base", "has_lora", "is_adapter",
           "is_target", "lora_targets", "unmatched_targets"]

ADAPTER = "lora"
"""The attribute (and module-name part) an adapted linear holds its adapter under."""


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (`...q_proj.lora.A`)."""
    return f".{ADAPTER}." in f".{name}"


class LoRAAdapter(nn.Module):
    """A (rank, in) and B (out, rank), fp32, and the adapter's product (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float,
                 generator: torch.Generator | None = None, device=None):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank={rank}: >= 1")
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.A = nn.Parameter(torch.zeros(rank, in_features, dtype=torch.float32, device=device))
        self.B = nn.Parameter(torch.zeros(out_features, rank, dtype=torch.float32, device=device))
        if generator is not None:  # PEFT's init; without one (the rollout side) zeros, which the first update replaces
            nn.init.kaiming_uniform_(self.A, a=math.sqrt(5), generator=generator)
        self._cache_a, self._cache_b = ExactCache(), ExactCache()  # exact numerics: the panels, once per version

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, in={self.A.shape[1]}, out={self.B.shape[0]}"

    def delta(self, x: torch.Tensor, numerics: str = "fast", ordered_wgrad: bool = False, *,
              groups: int | None = None, combine: Callable | None = None,
              between: Callable | None = None) -> torch.Tensor:
        """(x A^T) B^T in fp32, (..., out), without the scale.

        Tensor parallelism (jetflow.train.megatron.lora) passes: `groups` and `combine`, where A holds a shard
        of `in` (a row-parallel layer's): the product over the shard's canonical groups, then the sum finished
        over the TP ranks in the canonical tree (exact_linear's row-parallel form, so h is the whole-`in`
        h bit for bit; under fast numerics `combine` alone sums the partials); `between`, applied to
        h = x A^T before B's product (a column-parallel layer's: identity forward, its gradient summed over
        the ranks that hold B's other rows)."""
        x = x.float()
        if numerics == "exact":
            h = exact_linear(x, self.A, None, "fp32", cache=self._cache_a, name="lora.A", ordered_wgrad=ordered_wgrad,
                             groups=groups, combine=combine)  # (..., rank)
        else:
            h = F.linear(x, self.A)  # (..., rank)
            h = h if combine is None else combine(h)
        h = h if between is None else between(h)
        if numerics == "exact":
            return exact_linear(h, self.B, None, "fp32", cache=self._cache_b, name="lora.B",
                                ordered_wgrad=ordered_wgrad)
        return F.linear(h, self.B)

    def forward(self, x: torch.Tensor, y: torch.Tensor, numerics: str = "fast",
                ordered_wgrad: bool = False, **tp) -> torch.Tensor:
        """y (the base's output for x) + scale * delta(x), in y's dtype: the one order both sides add in.
        `tp`: delta's tensor-parallel arguments."""
        return y + (self.scale * self.delta(x, numerics, ordered_wgrad, **tp)).to(y.dtype)


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern) or fnmatchcase(name, pattern)


def is_target(name: str, patterns: list[str] | tuple[str, ...]) -> bool:
    """Whether a linear's module name is a LoRA target: in a decoder layer, and a pattern matches it (see
    `lora_targets`)."""
    return layer_index(name) is not None and any(_matches(name, p) for p in patterns)


def lora_targets(model: nn.Module, patterns: list[str] | tuple[str, ...]) -> dict[str, nn.Linear]:
    """{name: linear} of the decoder layers' linears (`model.layers.N...`) that a pattern matches: a name's
    last dotted parts (`q_proj`, `mlp.up_proj`) or an fnmatch pattern of the whole name. Works on a model
    on the meta device (the pre-run checks)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and is_target(name, patterns)}


def unmatched_targets(model: nn.Module, patterns: list[str] | tuple[str, ...]) -> list[str]:
    """The patterns that match no linear of the decoder layers."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and layer_index(n) is not None]
    return [p for p in patterns if not any(_matches(n, p) for n in names)]


def apply_lora(model: nn.Module, rank: int, alpha: float, targets: list[str] | tuple[str, ...],
               seed: int | None = None) -> dict[str, LoRAAdapter]:
    """Give every targeted linear an adapter, in place (an nn.Linear becomes the PrecisionLinear that
    computes what it computed: fp32, fast); returns {linear name: adapter}. `seed`: A drawn by PEFT's init
    from a generator of its own (the run's RNG stream is not touched), in module order; None: zeros (a
    rollout side's, filled by its first weight update). The precision may be applied before or after."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    adapters = {}
    for name, linear in lora_targets(model, targets).items():
        if not isinstance(linear, PrecisionLinear):
            parent, _, child = name.rpartition(".")
            linear = PrecisionLinear.from_linear(linear, name=name)
            setattr(model.get_submodule(parent), child, linear)
        adapter = LoRAAdapter(linear.in_features, linear.out_features, rank, alpha, generator, linear.weight.device)
        linear.lora = adapter
        adapters[name] = adapter
    if not adapters:
        raise ValueError(f"LoRA targets {list(targets)} match no linear of the decoder layers")
    return adapters


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRAAdapter) for m in model.modules())


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """{parameter name: adapter parameter} in the model's order."""
    return {n: p for n, p in model.named_parameters() if is_adapter(n)}


def freeze_base(model: nn.Module) -> nn.Module:
    """Freeze everything but the adapters, in place (see the module docstring); returns the model. Call it
    after the precision is applied: an FP8 linear's bytes are its recipe's."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    tied = {id(p) for n, p in model.named_parameters() if "embed" in n}
    for name, layer in model.named_modules():
        if not isinstance(layer, PrecisionLinear):
            continue
        if layer.kind == "fp8":
            layer.keep_bytes_only()
        elif layer.kind == "bf16" and layer_index(name) is not None and id(layer.weight) not in tied:
            layer.weight = nn.Parameter(layer.weight.detach().bfloat16(), requires_grad=False)
            layer.drop_caches()
    return model


def base_digest(model: nn.Module) -> str:
    """The sha256 of the frozen base as the model holds it: every state-dict tensor but the adapters', and each
    loaded FP8 linear's bytes and scales (its kept weight is a placeholder), in name order, bytes and shape. A
    LoRA checkpoint keeps it, and a resume, which rebuilds the base from its source, compares."""
    tensors = {n: t for n, t in model.state_dict().items() if not is_adapter(n)}
    for name, layer in model.named_modules():
        if isinstance(layer, PrecisionLinear) and layer._loaded is not None:  # its bytes and scales, not caches
            tensors.update({f"{name}.weight.{part}": t for part, t in layer._loaded.parts().items()})
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu().reshape(-1)
        h.update(f"{name}:{tuple(tensors[name].shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
