"""FP8 in FSDP2's all-gather (`train.backend=fsdp`, `precision.mode=unified`, fp8_block recipes).

Each FP8 linear's fp32 master weight is sharded by FSDP along dim 0 (rank r holds rows [r * c, r * c + c),
c = ceil(N / world), the last shard zero-padded to c). Before the all-gather every rank quantizes its own
rows to E4M3 with the weight's 128x128 block scales and the all-gather moves those bytes (1 byte a weight
instead of 4), as torchao's float8 all-gather does, through FSDP2's extension points:

  FP8ShardWeight   the sharded local tensor (a wrapper around the fp32 shard that the optimizer updates in
                   place); `fsdp_pre_all_gather` hands FSDP its rows' FP8 bytes, `fsdp_post_all_gather`
                   wraps the gathered bytes and the block scales in a GatheredFP8Weight.
  GatheredFP8Weight  the unsharded parameter the linear sees: shape and dtype of the fp32 weight, holding
                   the gathered QuantizedTensor (`gathered_fp8`), which PrecisionLinear computes with and
                   the weight sync ships (FSDPPolicy.quantized_weights). Its gradient is a plain fp32
                   tensor (the FP8 wgrad), which FSDP reduce-scatters into the fp32 master shards: the
                   straight-through update of the native unified trainer.

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

from jetflow.precision.linear import PrecisionLinear
from jetflow.precision.quant import QuantizedTensor, compute_scale_inv, quantize_row_shard, row_shard_amax
from jetflow.precision.recipe import FP8_DTYPES, FP8Recipe

aten = torch.ops.aten
# ops whose result is (a view or a copy of) the weight itself: FSDP shards, pads and slices it with them
_PRESERVE = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.new_zeros.default,
             aten.slice.Tensor, aten.narrow.default, aten.view.default, aten._unsafe_view.default,
             aten.as_strided.default, aten.detach.default, aten.alias.default, aten.clone.default,
             aten._to_copy.default}


def _wrapper(cls, like: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_wrapper_subclass(cls, like.size(), strides=like.stride(), dtype=like.dtype,
                                               device=like.device, requires_grad=like.requires_grad)


class FP8ShardWeight(torch.Tensor):
    """A rank's fp32 shard of an FP8 linear's weight (every op runs on the fp32 tensor inside), whose
    all-gather moves its rows quantized to the recipe's FP8 format."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, recipe: FP8Recipe, name: str):
        return _wrapper(cls, tensor)

    def __init__(self, tensor: torch.Tensor, recipe: FP8Recipe, name: str):
        self._tensor, self._recipe, self._name = tensor, recipe, name
        self._quantized: tuple | None = None  # (FP8 rows as uint8 (c, K), scale_inv (nr, nc)) until forgotten

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"FP8ShardWeight({self._name}, {tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        like = next(a for a in [*args, *kwargs.values()] if isinstance(a, FP8ShardWeight))
        out = func(*tree_map_only(FP8ShardWeight, lambda t: t._tensor, args),
                   **tree_map_only(FP8ShardWeight, lambda t: t._tensor, kwargs))
        if func._schema.is_mutable and isinstance(args[0], FP8ShardWeight):
            return args[0]  # in place (an optimizer step, a load): the same weight
        if func in _PRESERVE:
            return tree_map_only(torch.Tensor, lambda t: FP8ShardWeight(t, like._recipe, like._name), out)
        return out

    # FSDP2's all-gather extension ------------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        n, k = outer_size
        rows = -(-n // mesh.size())  # FSDP's padded shard: torch.chunk's chunk
        if self._quantized is None:
            self._quantized = self._quantize(mesh, n, rows)
        return (self._quantized[0],), (self._quantized[1], n)

    def forget_quantized(self) -> None:
        """The shard changed (an optimizer step, a load): quantize it again at the next all-gather."""
        self._quantized = None

    def _quantize(self, mesh, n: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        recipe, offset = self._recipe, mesh.get_local_rank() * rows
        local = self._tensor.detach()  # (r, K), r <= rows
        amax = row_shard_amax(local, offset, n, recipe.weight_block, f"{self._name}.weight")  # (nr, nc)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())  # every block's: all ranks
        scale_inv = compute_scale_inv(amax, recipe.forward_format, recipe.scale_rule, recipe.margin)
        data = torch.zeros(rows, local.shape[1], dtype=torch.uint8, device=local.device)  # (c, K)
        data[:local.shape[0]] = quantize_row_shard(local, offset, scale_inv, recipe.weight_block,
                                                   recipe.forward_format).view(torch.uint8)
        return data, scale_inv

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (gathered,), (scale_inv, n) = all_gather_outputs, metadata  # (world * c, K) uint8
        fp8 = gathered.view(FP8_DTYPES[self._recipe.forward_format])[:n]  # (N, K)
        wq = QuantizedTensor(fp8, scale_inv, tuple(self._recipe.weight_block))
        if out is not None:  # a later all-gather into the same buffer: the parameter takes the new bytes
            out.gathered_fp8 = wq
            return
        return GatheredFP8Weight(wq, param_dtype, self.requires_grad), ()


class GatheredFP8Weight(torch.Tensor):
    """The unsharded weight of an FP8 linear under the FP8 all-gather: its FP8 bytes and scales
    (`gathered_fp8`), the fp32 weight's shape and dtype. Only the linear reads it, through `gathered_fp8`;
    any other op on its values is an error (there are no fp32 values here to compute with)."""

    @staticmethod
    def __new__(cls, wq: QuantizedTensor, dtype: torch.dtype, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(cls, wq.shape, dtype=dtype, device=wq.data.device,
                                                   requires_grad=requires_grad)

    def __init__(self, wq: QuantizedTensor, dtype: torch.dtype, requires_grad: bool = False):
        self.gathered_fp8 = wq

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"GatheredFP8Weight({tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        src = args[0]
        same = func in (aten.detach.default, aten.alias.default) or (
            func in (aten.as_strided.default, aten.view.default) and tuple(args[1]) == tuple(src.shape))
        if same:  # FSDP's as_strided to the weight's shape, nn.Parameter's detach
            return GatheredFP8Weight(src.gathered_fp8, src.dtype, False)
        raise NotImplementedError(f"{func} on an FP8-gathered weight (train.backend=fsdp, precision.mode=unified): "
                                  "only its FP8 bytes were all-gathered; read them through `gathered_fp8`")


def fp8_gathered_linears(decoder: nn.Module) -> list[PrecisionLinear]:
    """The linears whose weights the all-gather moves in FP8: the fp8 kind under an fp8_block recipe
    (mxfp8 / nvfp4 weights gather in fp32)."""
    return [m for m in decoder.modules() if isinstance(m, PrecisionLinear) and m.kind == "fp8"
            and m.recipe.family == "fp8_block" and m.weight.dim() == 2]


def wrap_for_fp8_all_gather(decoder: nn.Module) -> int:
    """Make every FP8 linear's weight an FP8ShardWeight (before `fully_shard`); the number wrapped."""
    linears = fp8_gathered_linears(decoder)
    for m in linears:
        m.weight = nn.Parameter(FP8ShardWeight(m.weight.data, m.recipe, m.name), requires_grad=m.weight.requires_grad)
    return len(linears)
