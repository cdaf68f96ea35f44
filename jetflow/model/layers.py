"""The Decoder's non-attention building blocks: RMSNorm, the SwiGLU MLP and its exact-numerics SiLU.

Numerics follow transformers' implementation (RMSNorm in fp32 then cast, then scale). Every projection
is a plain `nn.Linear` that is *called*, so the precision converter can swap it for an FP8 linear by
name (see jetflow.model.decoder).

Shapes: B batch, T new tokens, C hidden size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from jetflow.kernels import invariant
from jetflow.precision.linear import sibling_linears

if TYPE_CHECKING:
    from jetflow.model.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ordered_wgrad = False
        """The weight's gradient summed over tokens in `invariant.weight_grad`'s order, not by autograd's
        shape-dependent reduction (sequence packing's grid under exact numerics, jetflow.train.packing)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalize in fp32, cast back, then scale: the same order as transformers (matters in bf16)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.ordered_wgrad and torch.is_grad_enabled() and self.weight.requires_grad:
            return _ScaleByWeight.apply(x32.to(dtype), self.weight)  # the same values
        return self.weight * x32.to(dtype)


class _ScaleByWeight(torch.autograd.Function):
    """weight * x (weight (C,), x (..., C)); backward: x's gradient as autograd's, the weight's by
    `invariant.weight_grad` over the tokens."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return weight * x

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = (grad * weight).to(x.dtype) if ctx.needs_input_grad[0] else None
        prod = (grad * x).reshape(-1, x.shape[-1])  # (tokens, C)
        grad_w = invariant.weight_grad(prod.new_ones(prod.shape[0], 1), prod)[0].to(weight.dtype)  # (C,)
        return grad_x, grad_w


def silu_exact(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) as x / (1 + exp(-x)): exp, add and divide give the same bits in a vector lane and
    in a scalar tail, while torch's fused sigmoid / silu kernels do not (measured: 4% of values
    differ), which would make a row's result depend on where it falls in the tensor."""
    return x / (1 + torch.exp(-x))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x, exact: bool = False):
        gate, up = sibling_linears(x, (self.gate_proj, self.up_proj))  # one GEMM where exact
        return self.down_proj((silu_exact(gate) if exact else F.silu(gate)) * up)
