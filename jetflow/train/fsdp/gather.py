"""What FSDP2's all-gather moves (`train.backend=fsdp`): each weight in the lowest precision its forward
reads it in, so the gathered weights compute the same bits as the fp32 master weights would.

  FP8ShardWeight   an FP8 linear's weight (`precision.mode=unified`, fp8_block recipes): E4M3 bytes, 1 byte a
                   weight, the bytes quantizing the whole fp32 weight gives (below), as torchao's float8
                   all-gather does.
  BF16ShardWeight  a weight the forward reads on the bf16 grid (bf16-kind linears, the embedding under the
                   bf16 / mixed / unified modes, which round its rows to bf16): its bf16 rounding, 2 bytes.
  anything else    (norms, fp32 mode) gathers its fp32 master shard, as before.

Each is FSDP's sharded local tensor: a wrapper around the fp32 shard (every op, the optimizer's in-place
updates included, runs on the fp32 tensor inside) with FSDP2's extension points: `fsdp_pre_all_gather`
gives FSDP the shard in its wire format, `fsdp_post_all_gather` makes the unsharded weight from the
gathered shards. FSDP shards a weight along dim 0: rank r holds rows [r * c, r * c + c), c = ceil(N /
world), the last shard zero-padded to c.

FP8: the unsharded weight is a GatheredFP8Weight, the fp32 weight's shape and dtype holding the gathered
QuantizedTensor (`gathered_fp8`), which PrecisionLinear computes with and the weight sync ships
(FSDPPolicy.quantized_weights). Its gradient is a plain fp32 tensor (the FP8 wgrad), which FSDP
reduce-scatters into the fp32 master shards: the straight-through update of the native unified trainer.

Scales: a block's scale is a function of that block's amax alone. The ranks first agree on every block's
amax with one MAX all-reduce of the weight's (N/128, K/128) amax grid, each rank filling in the blocks its
rows touch (jetflow.precision.quant.row_shard_amax). Where c is a multiple of 128 every block is one rank's
and the all-reduce just hands the scales round; where it is not (hidden 576 at 2 ranks: 288 rows a rank)
the ranks sharing a block take the larger amax. Each rank then quantizes its rows with the whole weight's
scales, so the gathered bytes are the bytes quantize_blocks gives the whole weight (torch.equal in
tests/unit/test_fsdp_fp8_gather.py and, across 2 ranks, tests/integration/fsdp_fp8_gather_worker.py) and the
forward equals the rollout's. No weight is refused or padded beyond FSDP's own padding. The scales travel
in that all-reduce (4 bytes a block), not in the all-gather, because FSDP refuses an unevenly sharded
weight's all-gather inputs of any size but its padded shard's.

Both are computed once per optimizer step: the forward's and backward's all-gathers of a step reuse the
bytes until FSDPPolicy sees the shards change (`forget_quantized`, from the DTensors' version counters,
which an optimizer step bumps and the shard inside does not see). Every rank sees the same steps and
loads, so they agree on when to all-reduce again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from jetflow.model.decoder import Decoder
from jetflow.precision.gathered import GatheredFP8Weight
from jetflow.precision.linear import PrecisionLinear
from jetflow.precision.quant import QuantizedTensor, compute_scale_inv, quantize_row_shard, row_shard_amax
from jetflow.precision.recipe import FP8_DTYPES, QuantRecipe

aten = torch.ops.aten
# ops whose result is (a view or a copy of) the weight itself: FSDP shards, pads and slices it with them
# (a copy in another dtype or a clone is a plain tensor: what a checkpoint or an export reads)
_PRESERVE = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.new_zeros.default,
             aten.slice.Tensor, aten.narrow.default, aten.view.default, aten._unsafe_view.default,
             aten.as_strided.default, aten.detach.default, aten.alias.default}


class _ShardWeight(torch.Tensor):
    """A rank's fp32 shard of a weight that FSDP all-gathers in a lower precision (subclasses: the format).
    Every op runs on the fp32 tensor inside; views and copies of the shard (FSDP's padding and slicing)
    stay wrapped, anything else (the optimizer's moments, a gradient) is a plain tensor."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, name: str, recipe: QuantRecipe | None = None):
        return torch.Tensor._make_wrapper_subclass(cls, tensor.size(), strides=tensor.stride(), dtype=tensor.dtype,
                                                   device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, name: str, recipe: QuantRecipe | None = None):
        self._tensor, self._name, self._recipe = tensor, name, recipe

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._name}, {tuple(self.shape)})"

    def with_tensor(self, tensor: torch.Tensor) -> _ShardWeight:
        """The same kind of weight (name, recipe) around another fp32 tensor (a meta weight materialized)."""
        return type(self)(tensor, self._name, self._recipe)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        like = next(a for a in [*args, *kwargs.values()] if isinstance(a, _ShardWeight))
        out = func(*tree_map_only(_ShardWeight, lambda t: t._tensor, args),
                   **tree_map_only(_ShardWeight, lambda t: t._tensor, kwargs))
        if func._schema.is_mutable and isinstance(args[0], _ShardWeight):
            return args[0]  # in place (an optimizer step, a load): the same weight
        if func in _PRESERVE:
            return tree_map_only(torch.Tensor, lambda t: type(like)(t, like._name, like._recipe), out)
        return out

    @staticmethod
    def _padded(rows: torch.Tensor, padded_rows: int) -> torch.Tensor:
        """rows (r, K) zero-padded to FSDP's padded shard (c, K)."""
        if rows.shape[0] == padded_rows:
            return rows
        return torch.cat([rows, rows.new_zeros(padded_rows - rows.shape[0], *rows.shape[1:])])


class BF16ShardWeight(_ShardWeight):
    """A weight whose every reader rounds it to bf16 first: the all-gather moves its bf16 rounding."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = -(-outer_size[0] // mesh.size())  # FSDP's padded shard: torch.chunk's chunk
        return (self._padded(self._tensor.detach().bfloat16(), rows),), outer_size[0]

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (gathered,), n = all_gather_outputs, metadata  # (world * c, K) bf16
        if out is not None:  # a later all-gather: into the same parameter
            with torch.no_grad():
                out.copy_(gathered[:n])
            return
        weight = gathered[:n].to(param_dtype)  # (N, K) fp32 on the bf16 grid
        return weight, (weight,)


class FP8ShardWeight(_ShardWeight):
    """An FP8 linear's weight: the all-gather moves its rows quantized to the recipe's FP8 format, with the
    whole weight's block scales."""

    def __init__(self, tensor: torch.Tensor, name: str, recipe: QuantRecipe | None = None):
        super().__init__(tensor, name, recipe)
        self._quantized: tuple | None = None  # (FP8 rows as uint8 (c, K), scale_inv (nr, nc)) until forgotten
        self._frozen = False  # a reference policy's weight: the bytes are all it keeps (`freeze`)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        n, k = outer_size
        rows = -(-n // mesh.size())  # FSDP's padded shard: torch.chunk's chunk
        if self._quantized is None:
            self._quantized = self._quantize(mesh, n, rows)
        return (self._quantized[0],), (self._quantized[1], n)

    def forget_quantized(self) -> None:
        """The shard changed (an optimizer step, a load): quantize it again at the next all-gather."""
        if not self._frozen:
            self._quantized = None

    def freeze(self) -> None:
        """A reference policy's weight (FSDPPolicy.freeze_as_reference): keep the FP8 rows and scales the
        last all-gather sent, quantized once, and free the fp32 rows (their storage, which FSDP's padded
        shard shares): every later all-gather sends the kept bytes, and nothing reads the fp32 rows again."""
        if self._quantized is None:
            raise RuntimeError(f"{self._name}: freeze after an all-gather (it quantizes the shard)")
        self._frozen = True
        self._tensor.untyped_storage().resize_(0)

    def quantized_tensors(self) -> list[torch.Tensor]:
        """The kept FP8 rows (uint8) and scales, if quantized."""
        return list(self._quantized) if self._quantized is not None else []

    def _quantize(self, mesh, n: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        recipe, offset = self._recipe, mesh.get_local_rank() * rows
        local = self._tensor.detach()  # (r, K), r <= rows
        amax = row_shard_amax(local, offset, n, recipe.weight_block, f"{self._name}.weight")  # (nr, nc)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())  # every block's: all ranks'
        scale_inv = compute_scale_inv(amax, recipe.forward_format, recipe.scale_rule, recipe.margin)
        data = quantize_row_shard(local, offset, scale_inv, recipe.weight_block, recipe.forward_format)
        return self._padded(data.view(torch.uint8), rows), scale_inv  # (c, K) uint8: gloo has no float8

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (gathered,), (scale_inv, n) = all_gather_outputs, metadata  # (world * c, K) uint8
        fp8 = gathered.view(FP8_DTYPES[self._recipe.forward_format])[:n]  # (N, K)
        wq = QuantizedTensor(fp8, scale_inv, tuple(self._recipe.weight_block))
        if out is not None:  # a later all-gather into the same buffer: the parameter takes the new bytes
            out.gathered_fp8 = wq
            return
        return GatheredFP8Weight(wq, param_dtype, self.requires_grad), ()


def fp8_gathered_linears(decoder: Decoder) -> list[PrecisionLinear]:
    """The linears whose weights the all-gather moves in FP8: the fp8 kind under a recipe family that
    gathers its bytes (fp8_block; mxfp8 / nvfp4 weights gather in fp32)."""
    return [m for m in decoder.modules() if isinstance(m, PrecisionLinear) and m.kind == "fp8"
            and m.family.gathers_in_fp8 and m.weight.dim() == 2]


def bf16_gathered_weights(decoder: Decoder) -> dict[str, nn.Parameter]:
    """The weights every reader rounds to bf16: bf16-kind linears', and the embedding's when the Decoder
    rounds its rows to bf16 (`embed_grid`) and, if tied, the lm_head reading it is a bf16 linear too."""
    out = {m.name: m.weight for m in decoder.modules()
           if isinstance(m, PrecisionLinear) and m.kind == "bf16" and m.weight.dim() == 2}
    embedding = decoder.model.embed_tokens.weight
    readers_round = all(m.kind == "bf16" for m in decoder.modules()
                        if isinstance(m, PrecisionLinear) and m.weight is embedding)
    if decoder.embed_grid == torch.bfloat16 and readers_round:
        out["model.embed_tokens"] = embedding
    elif any(w is embedding for w in out.values()):  # a tied lm_head whose embedding is read in fp32
        out = {name: w for name, w in out.items() if w is not embedding}
    return out


def wrap_for_low_precision_all_gather(decoder: Decoder) -> dict[str, int]:
    """Put every weight the all-gather can move in FP8 or bf16 into an FP8ShardWeight / BF16ShardWeight
    (before `fully_shard`); how many of each."""
    fp8, bf16 = fp8_gathered_linears(decoder), bf16_gathered_weights(decoder)
    for m in fp8:
        m.weight = nn.Parameter(FP8ShardWeight(m.weight.data, m.name, m.recipe), requires_grad=m.weight.requires_grad)
    wrapped: dict[int, nn.Parameter] = {}  # a tied weight is one Parameter of two modules
    for module in decoder.modules():
        for attr, param in list(module.named_parameters(recurse=False)):
            if any(param is w for w in bf16.values()):
                if id(param) not in wrapped:
                    name = next(n for n, w in bf16.items() if w is param)
                    wrapped[id(param)] = nn.Parameter(BF16ShardWeight(param.data, name), requires_grad=param.requires_grad)
                setattr(module, attr, wrapped[id(param)])
    return {"fp8": len(fp8), "bf16": len(wrapped)}


def plain(t: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor inside a shard wrapper (a weight read whole: DTensor.full_tensor of a world of one
    is a view of the shard), else t."""
    return t._tensor if isinstance(t, _ShardWeight) else t
