"""Linear layers: Megatron's parallel linears with jetflow's GEMMs (fp32, bf16, per-segment FP8).

Two numerics, as the native PrecisionLinear (`precision.numerics`):
  fast   Megatron's forward (its TP collectives, its bias handling) around jetflow's local GEMM.
  exact  the whole forward is jetflow's `exact_linear`, the very function the native engine and trainer
         run: the canonical GEMM (128-K blocks, G = tree_width(K) groups, a fixed pairwise tree), the bias
         and the bf16 rounding in its epilogue. A row-parallel layer at TP = T computes its G / T groups
         and combines the ranks' partials by the same tree (reduce.tp_tree_combine) before the
         epilogue, so its output is TP=1's bit for bit; column-parallel layers keep whole output rows.
         The bias goes into the epilogue (Megatron's skip_bias_add would add it after the bf16 rounding),
         so an exact layer returns (output, None).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from jetflow.precision import QuantRecipe, QuantizedTensor, bf16_linear, resolve_backend
from jetflow.precision.exact import ExactCache
from jetflow.precision.family import family_of
from jetflow.precision.lora import ADAPTER
from jetflow.precision.modes import LINEAR_KINDS, NUMERICS

from .lora import add_adapters
from .reduce import tp_tree_combine


@dataclass(frozen=True)
class Segment:
    """Rows of a (possibly fused) local weight that belong to one HF linear.

    The local weight is viewed as (groups, rows_per_group, K); the segment is [:, start:stop].
    linear_qkv: groups = local KV groups, segments q, k, v. linear_fc1: groups = 1, segments gate, up.
    """

    name: str  # HF module name, e.g. model.layers.0.self_attn.k_proj
    groups: int
    start: int
    stop: int
    kind: str  # fp32 | bf16 | fp8


def _segment_rows(t: torch.Tensor, seg: Segment) -> torch.Tensor:
    """The segment's rows of a weight (N, K) or bias (N,): (groups * (stop - start), ...)."""
    rest = t.shape[1:]
    return t.reshape(seg.groups, -1, *rest)[:, seg.start:seg.stop].reshape(-1, *rest)


class WeightCaches:
    """The `ExactCache`s `exact_linear` keeps for one module's GEMMs (one per segment name), emptied
    whenever the module's full weight changes version, i.e. after every optimizer step. exact_linear
    checks the panels against the tensor it is given; a segment of a fused weight is a fresh copy every
    call (linear_qkv's interleaved rows), which a later copy can meet at the same address and version:
    emptying the caches with the full weight's version keeps such panels from outliving their values."""

    def __init__(self) -> None:
        self.key: tuple | None = None  # (data_ptr, version, dtype, device) of the weight the caches belong to
        self.caches: dict[str, ExactCache] = {}

    def get(self, weight: torch.Tensor, name: str) -> ExactCache:
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if key != self.key:
            self.caches, self.key = {}, key
        return self.caches.setdefault(name, ExactCache())


def _dense(kind: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if kind == "fp32":
        return F.linear(x, w, b)
    if kind == "bf16":
        return bf16_linear(x, w, b)
    raise ValueError(f"linear kind {kind!r}: valid kinds are {LINEAR_KINDS}")


class _JetflowLinearMixin:
    """The local GEMM of a Megatron parallel linear, computed by jetflow under each segment's kind.

    Megatron's `ColumnParallelLinear.forward` / `RowParallelLinear.forward` keep doing the TP work
    (all-reduce of row-parallel outputs, gathers, bias handling); they call `_forward_impl` for the
    local (M, K_local) x (N_local, K_local)^T product, which this mixin replaces.
    """

    parallel_dim = 0  # 0: column-parallel (out_features split), 1: row-parallel (in_features split)
    segments: tuple[Segment, ...] = ()  # empty: one plain fp32 GEMM (before configure)
    recipe: QuantRecipe | None = None
    gemm_backend = "auto"
    numerics = "fast"  # fast | exact (see the module docstring)
    _wq_key: tuple | None = None  # (data_ptr, version, dtype, device) of the weight _wq was made from
    _wq: dict[str, QuantizedTensor] = {}
    _wq_frozen = False  # a reference policy's linear: _wq are fixed bytes (freeze_quantized)
    _exact_caches: WeightCaches  # exact_linear's caches, one per GEMM (segment name or "*"), made by configure

    def configure(self, segments: list[Segment], recipe: QuantRecipe | None, gemm_backend: str = "auto",
                  numerics: str = "fast") -> None:
        groups = {s.groups for s in segments}
        if len(groups) != 1 or [s.start for s in segments][1:] != [s.stop for s in segments][:-1]:
            raise ValueError(f"segments must share `groups` and tile the rows in order: {segments}")
        if any(s.kind == "fp8" for s in segments) and recipe is None:
            raise ValueError(f"{segments[0].name}: an fp8 segment needs a QuantRecipe")
        if numerics not in NUMERICS:
            raise ValueError(f"{segments[0].name}: numerics={numerics!r}; valid: {NUMERICS}")
        self.segments, self.recipe, self.gemm_backend = tuple(segments), recipe, gemm_backend
        self.family = family_of(recipe) if recipe is not None else None  # the recipe family's strategy
        self.numerics, self._exact_caches = numerics, WeightCaches()
        self._wq_key, self._wq = None, {}

    def forward(self, input_, *args, **kwargs):
        """Megatron's forward (fast), or jetflow's exact one: (output, None). With LoRA adapters (lora.py) each
        adapted segment's adapter is added to the output after the base's product."""
        if self.numerics == "exact":
            out, bias = self.exact_forward(input_, *args, **kwargs), None
        else:
            out, bias = super().forward(input_, *args, **kwargs)
        return (out if getattr(self, ADAPTER, None) is None else add_adapters(self, input_, out)), bias

    def exact_forward(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                      runtime_gather_output: bool | None = None) -> torch.Tensor:
        """(..., K_local) -> (..., N_local), bias included. Column-parallel: the input's gradient is summed
        over the TP group in backward (Megatron's copy region). Row-parallel: the local groups' partial,
        tree-combined over the TP group."""
        weight = self.weight if weight is None else weight
        tp = 1 if self.explicit_expert_comm else dist.get_world_size(self.tp_group)
        groups = combine = None
        if self.parallel_dim == 0:
            if getattr(self, "gather_output", False) or runtime_gather_output:
                raise NotImplementedError("jetflow's exact column-parallel linears do not gather their output")
            if tp > 1:
                from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
                x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
        elif tp > 1:
            from jetflow.kernels.canonical import tree_width

            groups, combine = tree_width(self.input_size) // tp, tp_tree_combine(self.tp_group)
        return self.exact_local(x, weight, self.bias, groups, combine)

    def exact_local(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups: int | None = None,
                    combine=None) -> torch.Tensor:
        """exact_linear on this rank's shard: one call over the fused weight when every segment has one
        non-FP8 kind (a column of the canonical GEMM does not depend on the other columns), else one per
        segment (each HF matrix its own FP8 bytes), concatenated in Megatron's fused row order."""
        from jetflow.precision.exact import exact_linear

        kinds = {s.kind for s in self.segments} or {"fp32"}
        if len(kinds) == 1 and "fp8" not in kinds:
            name = "+".join(s.name for s in self.segments) or "linear"
            return exact_linear(x, weight, bias, kinds.pop(), recipe=self.recipe, cache=self._exact_caches.get(weight, "*"),
                                groups=groups, combine=combine, name=name)
        wq = self.quantized_segments(weight)
        outs = []
        for seg in self.segments:
            y = exact_linear(x, _segment_rows(weight, seg), None if bias is None else _segment_rows(bias, seg),
                             seg.kind, recipe=self.recipe, wq=wq.get(seg.name), cache=self._exact_caches.get(weight, seg.name),
                             groups=groups, combine=combine, name=seg.name)
            outs.append(y.unflatten(-1, (seg.groups, seg.stop - seg.start)))  # (..., groups, rows)
        return torch.cat(outs, dim=-1).flatten(-2)  # (..., N_local)

    def _forward_impl(self, input, weight, bias=None, allreduce_dgrad=False, sequence_parallel=False, **_):
        if sequence_parallel:
            raise NotImplementedError("jetflow's Megatron linears do not support sequence parallelism")
        if allreduce_dgrad:  # column-parallel, tp > 1: identity forward, all-reduce of dX in backward
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
            input = copy_to_tensor_model_parallel_region(input, group=self.tp_group)
        return self.local_linear(input, weight, bias)

    def local_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x (..., K_local) -> (..., N_local); one GEMM per segment when kinds differ or any is fp8.

        x is made contiguous first: on a strided (B, T, K) view (the output layer's input, forward_hidden's
        transpose) torch.matmul folds the rows into one GEMM only when the weight requires grad, and runs
        B batched GEMMs otherwise, whose fp32 rounding differs on the Intel Xeon kind; so the frozen
        reference (weights without grad) and the policy would part in the last bits on equal weights."""
        x = x.contiguous()  # (..., K_local)
        kinds = {s.kind for s in self.segments} or {"fp32"}
        if len(kinds) == 1 and "fp8" not in kinds:
            return _dense(kinds.pop(), x, weight, bias)
        wq = self.quantized_segments(weight)
        outs = []
        for seg in self.segments:
            w = _segment_rows(weight, seg)  # (groups * rows, K)
            b = None if bias is None else _segment_rows(bias, seg)
            if seg.kind == "fp8":
                y = self.family.linear(x, w, b, wq[seg.name], self.recipe, self.gemm_backend, seg.name)
            else:
                y = _dense(seg.kind, x, w, b)
            outs.append(y.unflatten(-1, (seg.groups, seg.stop - seg.start)))  # (..., groups, rows)
        return torch.cat(outs, dim=-1).flatten(-2)  # (..., N_local) in Megatron's fused row order

    def quantized_segments(self, weight: torch.Tensor | None = None) -> dict[str, QuantizedTensor]:
        """{HF module name: this rank's FP8 shard} of the fp8 segments, quantized once per weight version."""
        if self._wq_frozen:
            return self._wq
        weight = self.weight if weight is None else weight
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if key != self._wq_key:
            r = self.recipe
            # the CPU emulation of the fast path multiplies a cached fp32 dequantization; the exact fp8_block
            # GEMM reads the bytes' panels (as PrecisionLinear._multiplies_dequantized)
            emulate = resolve_backend(self.gemm_backend, weight.device) == "emulate" and not (
                self.numerics == "exact" and self.family.exact_reads_bytes)
            self._wq = {}
            for seg in self.segments:
                if seg.kind != "fp8":
                    continue
                q = self.family.quantize_weight(_segment_rows(weight.detach(), seg), r, f"{seg.name}.weight")
                self._wq[seg.name] = q.with_dequantized_cache() if emulate else q
            self._wq_key = key
        return self._wq

    @torch.no_grad()
    def freeze_quantized(self) -> None:
        """A reference policy's linear (jetflow.train.reference): its FP8 segments' bytes quantized once and
        kept. When every segment is FP8 its weight is then replaced by a zero-stride placeholder of its
        shape: a no-grad forward reads only the bytes (exact_linear their panels, the recipe family's linear the bytes).
        An lm_head tied to the embedding (no weight of its own) is left as it is."""
        if self.weight is None or not any(s.kind == "fp8" for s in self.segments):
            return
        self._wq, self._wq_frozen = dict(self.quantized_segments()), True
        if all(s.kind == "fp8" for s in self.segments):
            shape, placeholder = self.weight.shape, torch.zeros((), dtype=self.weight.dtype, device=self.weight.device)
            del self.weight  # the parameter
            self.weight = placeholder.expand(shape)  # (N_local, K_local), one element stored
            self._exact_caches = WeightCaches()

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors it keeps beside its parameters: the FP8 bytes, scales and cached forms of its
        segments, and the exact path's GEMM panels."""
        held = [getattr(q, f.name) for q in self._wq.values() for f in dataclasses.fields(q)]
        held += [c.packed for c in self._exact_caches.caches.values()] if self.numerics == "exact" else []
        return [t for t in held if isinstance(t, torch.Tensor)]


_CLASSES: dict[str, type] = {}


def _linear_classes() -> tuple[type, type]:
    """(JetflowColumnParallelLinear, JetflowRowParallelLinear), made on first use (Megatron is lazy)."""
    if not _CLASSES:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        _CLASSES["column"] = type("JetflowColumnParallelLinear", (_JetflowLinearMixin, ColumnParallelLinear),
                                  {"parallel_dim": 0, "__doc__": "ColumnParallelLinear with jetflow's GEMMs."})
        _CLASSES["row"] = type("JetflowRowParallelLinear", (_JetflowLinearMixin, RowParallelLinear),
                               {"parallel_dim": 1, "__doc__": "RowParallelLinear with jetflow's GEMMs."})
    return _CLASSES["column"], _CLASSES["row"]
