"""Linear layers under a precision mode, and the converter that puts them into a model.

`PrecisionLinear` replaces `nn.Linear` with the same parameter names (state dicts do not change) and
computes in one of three ways:
  fp32  plain F.linear.
  bf16  a bf16 GEMM (see gemm.bf16_linear).
  fp8   the recipe's quantized GEMMs for fprop, dgrad and wgrad: its family's linear (jetflow.precision.
        family; the kind's name stays `fp8` under the mxfp8 and nvfp4 recipe families).

The quantized weight is cached per weight version (the tensor's in-place version counter, which an
optimizer step bumps), so each weight is quantized once per optimizer step and those same bytes serve
every forward of the step and every export to a rollout engine. A rollout-side layer can instead be
handed quantized bytes directly (`load_quantized`), which it then uses as they are.

`numerics="exact"` computes the forward with `jetflow.precision.exact.exact_linear`, the function the
Megatron trainer and the vLLM plugin call too: the canonical GEMM on weight panels packed once per
weight version (fp32, bf16 or FP8 bytes), so a row's output is the same bits whether the row is one of
16 decode rows or of 9,600 trainer rows, and whichever engine computes it. Backward GEMMs stay torch's.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from jetflow.precision.exact import ExactCache, exact_linear, exact_linears
from jetflow.precision.family import family_of
from jetflow.precision.gathered import GatheredFP8Weight
from jetflow.precision.gemm import bf16_linear, resolve_backend
from jetflow.precision.modes import LINEAR_KINDS, NUMERICS
from jetflow.precision.quant import QuantizedTensor
from jetflow.precision.recipe import QuantRecipe

__all__ = ["PrecisionLinear", "apply_precision", "fp8_linears"]


class PrecisionLinear(nn.Linear):
    """nn.Linear that computes in fp32, bf16 or the FP8 recipe; parameter names are unchanged."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, kind: str = "fp32",
                 recipe: QuantRecipe | None = None, gemm_backend: str = "auto", name: str = "linear",
                 numerics: str = "fast", device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if kind not in LINEAR_KINDS:
            raise ValueError(f"PrecisionLinear kind={kind!r}: valid kinds are {LINEAR_KINDS}")
        if numerics not in NUMERICS:
            raise ValueError(f"PrecisionLinear numerics={numerics!r}: valid modes are {NUMERICS}")
        self.numerics = numerics
        self._exact_cache = ExactCache()  # exact numerics: panels of the weight as the kind reads it (exact_linear)
        if kind == "fp8" and recipe is None:
            raise ValueError(f"{name}: an fp8 linear needs a QuantRecipe")
        self.kind, self.recipe, self.gemm_backend, self.name = kind, recipe, gemm_backend, name
        self.family = family_of(recipe) if recipe is not None else None  # the recipe family's strategy
        self._cache_key: tuple | None = None
        self._cached: QuantizedTensor | None = None
        self._loaded: QuantizedTensor | None = None  # bytes handed in by a trainer (rollout side)
        self.ordered_wgrad = False  # exact: the weight gradient in one token order (jetflow.train.packing's grid)
        self.lora: nn.Module | None = None  # a LoRAAdapter added after the base's product (jetflow.precision.lora)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "PrecisionLinear":
        new = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        new.weight = linear.weight
        if linear.bias is not None:
            new.bias = linear.bias
        return new

    def set_precision(self, kind: str, recipe: QuantRecipe | None, gemm_backend: str, numerics: str) -> None:
        """Compute under another kind / recipe / numerics from now on (apply_precision over a model already
        converted): every cache and any loaded bytes are dropped."""
        if numerics not in NUMERICS:
            raise ValueError(f"apply_precision numerics={numerics!r}: valid modes are {NUMERICS}")
        self.kind, self.recipe, self.gemm_backend, self.numerics = kind, recipe, gemm_backend, numerics
        self.family = family_of(recipe) if recipe is not None else None
        self._loaded = None
        self.drop_caches()

    def drop_caches(self) -> None:
        """Forget what was computed from the weight (its quantized bytes or bf16 copy, the exact panels):
        the next forward computes it again. Bytes handed in by `load_quantized` stay."""
        self._cache_key = self._cached = None
        self._exact_cache.clear()

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors it keeps beside its parameters: the loaded bytes, their scales and cached forms
        (dequantized values, GEMM panels), and the exact path's panels of the weight."""
        held = [] if self._loaded is None else [getattr(self._loaded, f.name) for f in dataclasses.fields(self._loaded)]
        return [t for t in [*held, self._exact_cache.packed] if isinstance(t, torch.Tensor)]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kind={self.kind}, numerics={self.numerics}"

    # The quantized weight ----------------------------------------------------------------------
    def quantized_weight(self) -> QuantizedTensor:
        """This step's quantized weight: loaded bytes if any, else quantized once per weight version."""
        if self._loaded is not None:
            return self._loaded
        w = self.weight
        if isinstance(w, GatheredFP8Weight):  # the bytes FSDP's FP8 all-gather brought (jetflow.train.fsdp.gather)
            gathered = w.gathered_fp8
            if self._multiplies_dequantized(gathered.data.device):
                gathered.with_dequantized_cache()
            return gathered
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if key != self._cache_key:
            wq = self.family.quantize_weight(w, self.recipe, f"{self.name}.weight")
            if self._multiplies_dequantized(w.device):
                wq.with_dequantized_cache()
            self._cached, self._cache_key = wq, key
        return self._cached

    def _bf16_weight(self) -> torch.Tensor:
        """The weight rounded to the bf16 grid (kept in fp32 for the CPU GEMM), once per weight version."""
        w = self.weight
        key = ("bf16", w.data_ptr(), w._version, w.dtype, w.device)
        if key != self._cache_key:
            self._cached, self._cache_key = w.detach().bfloat16().float(), key
        return self._cached

    def load_quantized(self, wq: QuantizedTensor) -> None:
        """Use these bytes as they are (rollout side of `unified`): no requantization."""
        if wq.kind != self.family.name:
            raise ValueError(f"{self.name}: {wq.kind} bytes offered to a linear running the {self.family.name} recipe")
        if tuple(wq.shape) != (self.out_features, self.in_features):
            raise ValueError(f"{self.name}: quantized weight shape {tuple(wq.shape)} != "
                             f"{(self.out_features, self.in_features)}")
        if tuple(wq.block) != tuple(self.recipe.weight_block):
            raise ValueError(f"{self.name}: weight block {wq.block} != recipe {self.recipe.weight_block}")
        if self._multiplies_dequantized(wq.data.device):
            wq.with_dequantized_cache()
        self._loaded = wq

    def _multiplies_dequantized(self, device: torch.device) -> bool:
        """Whether this linear's GEMMs multiply the weight's fp32 dequantization (the CPU emulation of the
        fast path, which then keeps it cached next to the bytes). An exact linear of a family whose exact
        GEMMs read the bytes themselves (fp8_block: jetflow.kernels.invariant) keeps none: a cached fp32 copy
        would only cost time (its dequantization each weight version) and memory (4 bytes a weight, on the
        trainer and on the rollout engine)."""
        if self.numerics == "exact" and self.family.exact_reads_bytes:
            return False
        return resolve_backend(self.gemm_backend, device) == "emulate"

    def keep_bytes_only(self) -> None:
        """Freeze an FP8 linear as fixed bytes: its weight quantized once by the recipe, exactly as its forward
        quantizes it, handed to it as `load_quantized` bytes, and the high-precision weight replaced by a
        zero-stride placeholder of its shape (one element of storage): a forward reads only the bytes, and
        the fp8_block backward's dgrad reads them too (the reference policy, a LoRA base)."""
        with torch.no_grad():
            wq = self.quantized_weight()
        self.load_quantized(wq)
        placeholder = torch.zeros((), dtype=self.weight.dtype, device=self.weight.device)
        del self.weight  # the parameter: the bytes are all it keeps
        self.weight = placeholder.expand(self.out_features, self.in_features)  # (N, K), one element stored
        self.drop_caches()

    # Forward -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base_forward(x)
        return y if self.lora is None else self.lora(x, y, self.numerics, self.ordered_wgrad)

    def _base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.numerics == "exact":
            wq = self.quantized_weight() if self.kind == "fp8" else None
            return exact_linear(x, self.weight, self.bias, self.kind, recipe=self.recipe, wq=wq,
                                cache=self._exact_cache, name=self.name, ordered_wgrad=self.ordered_wgrad)
        if self.kind == "fp32":
            return F.linear(x, self.weight, self.bias)
        if self.kind == "bf16":
            if x.is_cuda or torch.is_grad_enabled():
                return bf16_linear(x, self.weight, self.bias)
            return bf16_linear(x, self._bf16_weight(), self.bias, weight_on_grid=True)  # rounded once per version
        return self.family.linear(x, self.weight, self.bias, self.quantized_weight(), self.recipe, self.gemm_backend,
                                  self.name)


def sibling_linears(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> list[torch.Tensor]:
    """[linear(x) for linear in linears] for linears that share their input (q / k / v, gate / up). Exact
    PrecisionLinears of one kind, outside autograd, on the CPU, run as one GEMM (`exact_linears`: the
    same bits, one activation quantization and one kernel call instead of one per linear); anything
    else (fast numerics, a graph being recorded, hooks, mixed kinds) calls each module. A LoRA adapter is
    added to its own linear's output either way."""
    first = linears[0]
    fusable = (not x.is_cuda and all(isinstance(m, PrecisionLinear) for m in linears)
               and all(m.numerics == "exact" and m.kind == first.kind and m.recipe == first.recipe
                       and not (m._forward_hooks or m._forward_pre_hooks) for m in linears)
               and (first.kind != "fp8" or first.recipe.canonical_blocks)
               and not (torch.is_grad_enabled() and (x.requires_grad or any(m.weight.requires_grad for m in linears))))
    if not fusable:
        return [m(x) for m in linears]
    wqs = [m.quantized_weight() for m in linears] if first.kind == "fp8" else None
    outs = exact_linears(x, [m.weight for m in linears], [m.bias for m in linears], first.kind, recipe=first.recipe,
                         wqs=wqs, caches=[m._exact_cache for m in linears],
                         fused=first._exact_cache.siblings, name=first.name)
    # each linear's adapter on its own output, as its forward adds it (jetflow.precision.lora)
    return [y if m.lora is None else m.lora(x, y, m.numerics, m.ordered_wgrad) for y, m in zip(outs, linears)]


def held_bytes_per_weight(kind: str, recipe: QuantRecipe | None, numerics: str, cuda: bool, trainer: bool) -> float:
    """Bytes a PrecisionLinear of `kind` keeps per weight element beside the weight itself (the memory
    estimate's): exact numerics pack the canonical GEMM's panels of the weight as the kind reads it (fp32 4,
    bf16 2); fast numerics: a bf16 rollout on the CPU keeps a bf16-rounded fp32 copy (4); the fp8 kind
    what its recipe family keeps (jetflow.precision.family: held_bytes_per_weight)."""
    if kind == "fp8":
        return family_of(recipe).held_bytes_per_weight(numerics, cuda, trainer)
    if numerics == "exact":
        return 4.0 if kind == "fp32" else 2.0
    return 4.0 if (kind == "bf16" and not trainer and not cuda) else 0.0


def layer_index(module_name: str) -> int | None:
    """The decoder layer of a module or parameter name (`model.layers.3.mlp.up_proj` -> 3), None outside the layers."""
    parts = module_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def apply_precision(model: nn.Module, kind: str, recipe: QuantRecipe | None = None,
                    gemm_backend: str = "auto", num_layers: int | None = None, numerics: str = "fast") -> nn.Module:
    """Swap every nn.Linear of `model` for a PrecisionLinear of `kind` and `numerics`, in place.

    Under kind="fp8", modules the recipe keeps in high precision (embeddings, lm_head, norms, routers,
    first/last N layers) become bf16 linears instead. Parameters are shared, not copied.
    """
    if kind not in LINEAR_KINDS:
        raise ValueError(f"apply_precision kind={kind!r}: valid kinds are {LINEAR_KINDS}")
    if kind == "fp8" and recipe is None:
        raise ValueError("apply_precision: kind='fp8' needs a QuantRecipe")
    if num_layers is None:
        indices = [layer_index(n) for n, _ in model.named_modules()]
        num_layers = max((i for i in indices if i is not None), default=-1) + 1
    replacements = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        module_kind = kind
        if kind == "fp8" and recipe.keeps_in_high_precision(name, layer_index(name), num_layers):
            module_kind = "bf16"
        replacements.append((name, module, module_kind))
    for name, module, module_kind in replacements:
        if isinstance(module, PrecisionLinear):
            module.set_precision(module_kind, recipe, gemm_backend, numerics)
            continue
        new = PrecisionLinear.from_linear(module, kind=module_kind, recipe=recipe, gemm_backend=gemm_backend,
                                          name=name, numerics=numerics)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    return model


def linear_precision(model: nn.Module) -> tuple[str, QuantRecipe | None]:
    """(kind, recipe) a model's PrecisionLinears run, as a policy reports them: `fp8` and the recipe when
    any linear runs it (the recipe keeps some in bf16), else bf16 when any runs bf16, else fp32."""
    kinds = {m.kind: m.recipe for m in model.modules() if isinstance(m, PrecisionLinear)}
    if "fp8" in kinds:
        return "fp8", kinds["fp8"]
    return ("bf16" if "bf16" in kinds else "fp32"), None


def fp8_linears(model: nn.Module) -> dict[str, PrecisionLinear]:
    """The FP8 linear layers of a model by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, PrecisionLinear) and m.kind == "fp8"}
