"""Sparse mixture-of-experts blocks (Qwen3-MoE, Mixtral) and the router load-balancing loss.

Names follow the models' ON-DISK checkpoints (what the released Qwen3-30B-A3B / Mixtral files and
vLLM's loaders use), so `state_dict()` keys equal checkpoint keys:

    Qwen3-MoE  model.layers.N.mlp.gate.weight                       (E, C)  router
               model.layers.N.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight
    Mixtral    model.layers.N.block_sparse_moe.gate.weight          (E, C)  router
               model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.weight   (w1 gate, w3 up, w2 down)

(transformers >= 5 holds the experts fused in memory, `mlp.experts.gate_up_proj` (E, 2I, C) and
`down_proj` (E, C, I), and converts from / to these names when it loads / saves.)

Every projection, the router's included, is a plain `nn.Linear` that is *called*, so the precision
converter swaps them by name: experts go FP8, the router stays high precision (the recipe's keep list
matches `*.mlp.gate` and `*.block_sparse_moe.gate`).

Forward (numerics follow transformers): router logits in the activation dtype, softmax over the experts
in fp32, top-k, optional renormalization; each expert runs once on the group of (token, slot) pairs
routed to it, and a token's weighted expert outputs are summed over its k slots in slot order. Under
exact numerics the softmax and the renormalization sum over a fixed tree, the activation is
`silu_exact` and the linears are the batch-invariant ones (apply_precision(..., numerics="exact")),
so a token's output does not depend on which other tokens share the batch or on how they route.

Shapes: N tokens (B * T flattened), C hidden size, E experts, K experts per token, I expert width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from jetflow.model.layers import silu_exact

if TYPE_CHECKING:
    from jetflow.model.model_config import ModelConfig

EXPERT_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
"""The (gate, up, down) projection names of one expert in each family's checkpoints."""


class Expert(nn.Module):
    """One SwiGLU expert, down(silu(gate(x)) * up(x)), with its family's projection names."""

    def __init__(self, hidden_size: int, intermediate_size: int, names: tuple[str, str, str]):
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden_size, intermediate_size, bias=False))
        setattr(self, up, nn.Linear(hidden_size, intermediate_size, bias=False))
        setattr(self, down, nn.Linear(intermediate_size, hidden_size, bias=False))

    def forward(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        gate_proj, up_proj, down_proj = (getattr(self, n) for n in self.names)  # looked up: swappable
        gate = gate_proj(x)  # (n, I)
        return down_proj((silu_exact(gate) if exact else F.silu(gate)) * up_proj(x))  # (n, C)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as a fixed pairwise tree of elementwise adds (keepdim): the same
    operations for every row whatever the number of rows, unlike torch's reductions, whose
    blocking (on CUDA) depends on the tensor's shape. Zero padding is exact for these nonnegative
    sums."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = F.pad(x, (0, 1))
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def softmax_exact(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim whose every row is one fixed sequence of elementwise ops: max (exact
    in any order), exp, a `tree_sum`, divide."""
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / tree_sum(e)


class SparseMoeBlock(nn.Module):
    """Top-k routed SwiGLU experts (Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock), checkpoint names.

    After each forward `last_router_logits` (N, E) (in the activation dtype, in the autograd graph:
    what `load_balancing_loss` takes) and `last_topk_ids` (N, K) hold what the router did.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        if c.num_experts < 1 or not 1 <= c.num_experts_per_tok <= c.num_experts:
            raise ValueError(f"an MoE block needs num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts, "
                             f"got {c.num_experts} and {c.num_experts_per_tok}")
        self.num_experts, self.top_k = c.num_experts, c.num_experts_per_tok
        self.norm_topk_prob = c.norm_topk_prob
        # transformers casts Qwen3-MoE's routing weights back to the activation dtype before they scale
        # the expert outputs; Mixtral's stay fp32 and the scaled output is cast
        self.fp32_weights = c.model_type == "mixtral"
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        names = EXPERT_NAMES[c.model_type]
        self.experts = nn.ModuleList(Expert(c.hidden_size, c.moe_intermediate_size, names)
                                     for _ in range(c.num_experts))
        self.last_router_logits: torch.Tensor | None = None
        self.last_topk_ids: torch.Tensor | None = None
        self.last_replay_flips: torch.Tensor | None = None
        self.last_replayed: torch.Tensor | None = None

    # Routing -----------------------------------------------------------------------------------
    def route(self, x2: torch.Tensor, exact: bool = False, routed_ids: torch.Tensor | None = None):
        """Router logits (N, E), routing weights (N, K) and expert ids (N, K) for tokens x2 (N, C).

        routed_ids (N, K): use these experts instead of the router's top-k (routing replay, e.g. the
        rollout engine's choices replayed in the trainer); their weights are still the router's
        softmax probabilities at those ids, renormalized as the config says. A row of -1 keeps the
        router's own choice (padding, positions the rollout never ran). `last_replay_flips` (N,)
        then says which replayed rows the router alone would have sent elsewhere (another top-k set)."""
        logits = self.gate(x2)  # (N, E), activation dtype
        probs = softmax_exact(logits.float()) if exact else torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # (N, K) fp32, (N, K)
        self.last_replay_flips = self.last_replayed = None
        if routed_ids is not None:
            forced = self._check_routed_ids(routed_ids, x2.shape[0])  # (N, K), -1 rows: the router's
            replayed = self.last_replayed = forced[:, 0] >= 0  # (N,)
            self.last_replay_flips = replayed & (forced.sort(-1).values != ids.sort(-1).values).any(-1)
            ids = torch.where(replayed[:, None], forced, ids)
            weights = probs.gather(-1, ids)  # (N, K), the same values as topk's where not replayed
        if self.norm_topk_prob:
            weights = weights / (tree_sum(weights) if exact else weights.sum(-1, keepdim=True))
        if not self.fp32_weights:
            weights = weights.to(logits.dtype)
        return logits, weights, ids

    def _check_routed_ids(self, routed_ids: torch.Tensor, n: int) -> torch.Tensor:
        ids = routed_ids.reshape(-1, routed_ids.shape[-1]).to(device=self.gate.weight.device, dtype=torch.long)
        if ids.shape != (n, self.top_k):
            raise ValueError(f"routed_ids must hold {self.top_k} expert ids for each of the {n} tokens, "
                             f"got shape {tuple(routed_ids.shape)}")
        if n and (int(ids.min()) < -1 or int(ids.max()) >= self.num_experts):
            raise ValueError(f"routed_ids must lie in [0, {self.num_experts}) (or -1: the router's own choice)")
        if n and not torch.equal(ids.min(-1).values < 0, ids.max(-1).values < 0):
            raise ValueError("routed_ids: a token's row is either all -1 (the router's choice) or all expert ids")
        return ids

    # Forward -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, exact: bool = False, routed_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., C) -> (..., C). routed_ids (..., K): forced expert ids (see `route`)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (N, C)
        logits, weights, ids = self.route(x2, exact, routed_ids)
        self.last_router_logits, self.last_topk_ids = logits, ids
        y = self._experts_forward(x2, ids, exact)  # (N, K, C), expert output of each (token, slot)
        scaled = (y * weights[..., None]).to(x.dtype)  # (N, K, C)
        out = scaled[:, 0]
        for k in range(1, self.top_k):  # a fixed order: slot 0, 1, ...
            out = out + scaled[:, k]
        return out.reshape(shape)

    def _experts_forward(self, x2: torch.Tensor, ids: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """Each expert on the group of (token, slot) pairs routed to it: (N, K, C)."""
        N, K = ids.shape
        flat = ids.reshape(-1)  # (N*K,) expert of each (token, slot), token-major
        order = flat.argsort(stable=True)  # (N*K,) pairs grouped by expert, token order inside a group
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        grouped = x2[order // K]  # (N*K, C) each pair's token, grouped
        outs = [expert(chunk, exact) for expert, chunk, n in zip(self.experts, grouped.split(counts), counts) if n]
        y_grouped = torch.cat(outs) if outs else grouped[:0]  # (N*K, C)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return y_grouped[inverse].reshape(N, K, -1)  # back to (token, slot) order


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's MoE blocks in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def router_logits(model: nn.Module) -> tuple[torch.Tensor, ...]:
    """The last forward's router logits of every MoE layer, (N, E) each (for `load_balancing_loss`)."""
    return tuple(b.last_router_logits for b in moe_blocks(model) if b.last_router_logits is not None)


def load_balancing_loss(router_logits_per_layer: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, as transformers' `load_balancing_loss_func`:
    num_experts * sum_e f_e * P_e over the tokens of every layer, f_e the fraction of top-k
    assignments that went to expert e and P_e its mean router probability. With attention_mask
    (B, T) (the logits' N = B * T rows, row-major), padding tokens are left out. As transformers does,
    the softmax runs in the logits' dtype; the sums are fp32."""
    if not router_logits_per_layer:
        raise ValueError("load_balancing_loss needs the router logits of at least one layer")
    device = router_logits_per_layer[0].device
    logits = torch.cat([t.to(device) for t in router_logits_per_layer])  # (L*N, E)
    probs = torch.softmax(logits, dim=-1)  # (L*N, E)
    chosen = torch.topk(probs, top_k, dim=-1).indices  # (L*N, K)
    if attention_mask is None:
        row_weight = torch.ones(logits.shape[0], dtype=torch.float32, device=device)  # (L*N,)
    else:
        row_weight = attention_mask.reshape(-1).to(device=device, dtype=torch.float32).repeat(
            len(router_logits_per_layer))  # (L*N,)
    total = row_weight.sum()
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device).scatter_add_(
        0, chosen.reshape(-1), row_weight.repeat_interleave(top_k))  # (E,)
    prob_mass = (probs.float() * row_weight[:, None]).sum(0)  # (E,)
    return num_experts * torch.sum((assigned / total) * (prob_mass / total))


def replay_flip_fraction(model: nn.Module) -> float | None:
    """Of the (token, MoE layer) pairs the last forward replayed, the fraction whose router alone
    would have chosen another set of experts; None when nothing was replayed."""
    blocks = [b for b in moe_blocks(model) if b.last_replayed is not None]
    replayed = sum(int(b.last_replayed.sum()) for b in blocks)
    if not replayed:
        return None
    return sum(int(b.last_replay_flips.sum()) for b in blocks) / replayed


def model_load_balancing_loss(model: nn.Module) -> torch.Tensor | None:
    """`load_balancing_loss` of a Decoder's last forward over its real tokens (its `last_token_mask`, in
    the order its MoE layers saw them); None for a model without MoE layers."""
    blocks = [b for b in moe_blocks(model) if b.last_router_logits is not None]
    if not blocks:
        return None
    mask = model.last_token_mask
    return load_balancing_loss([b.last_router_logits for b in blocks], blocks[0].num_experts, blocks[0].top_k,
                               attention_mask=mask)
