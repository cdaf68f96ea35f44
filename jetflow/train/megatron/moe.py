"""Megatron-Core's MoE layer with jetflow's pieces: the router's GEMM in high precision, experts whose
linear_fc1 / linear_fc2 are jetflow's linears, and an all-gather token dispatcher that runs on the CPU.

Megatron builds the layer (MoELayer: TopKRouter -> token dispatcher -> SequentialMLP -> combine), owns
the routing (top-k with the TransformerConfig's score function, see model.py) and the expert-parallel
layout (each rank of the expert-parallel group holds num_experts / EP consecutive experts). Three
classes replace Megatron's where its code cannot run here or where jetflow's numerics differ:

- `JetflowTopKRouter.gating`: router logits with the GEMM of the native model's router (fp32, or bf16
  where the FP8 recipe keeps routers in high precision). Megatron's `Router.gating` first moves the
  weight with `.to(torch.cuda.current_device())` (router.py:88-92, megatron-core 0.16.1): CUDA only.
- `JetflowSequentialMLP.forward`: each local expert on its tokens, the routing weight applied to the
  expert's *output* (as transformers and the native `SparseMoeBlock` do). Megatron's MLP scales the
  activation before linear_fc2 (`per_token_scale`, mlp.py:232-235): equal in exact arithmetic, but under
  FP8 it would change what linear_fc2 quantizes. Experts without tokens are skipped (as natively).
  Under EP an expert runs one GEMM per source rank (the tokens each EP rank sent it), not one over
  the group's tokens: FP8 wgrad quantizes along the token dimension in groups, and a GEMM over
  several ranks' tokens would put other tokens in a group than a rank alone (or one process running
  the same micro-batches) does. Per source rank, EP=2 training matches one process to fp32 rounding.
- `JetflowAllGatherTokenDispatcher`: Megatron's all-gather dispatcher (every EP rank gathers the
  group's tokens, runs its local experts on those routed to them, and a reduce-scatter returns each
  rank's token outputs) with the two collectives rewritten: Megatron's `_gather_along_first_dim` /
  `_reduce_scatter_along_first_dim` allocate on `torch.cuda.current_device()` (tensor_parallel/
  mappings.py:141,148,181), gloo has no reduce_scatter (mappings.py:182,193), and both assume every
  rank holds the same number of tokens, which data-parallel ranks with their own padded batches do
  not. Here: sizes are exchanged first, the gather pads to the largest, the reduce-scatter is an
  all-reduce of the gathered layout then this rank's slice. The all-to-all dispatcher is not used: it
  makes a `torch.cuda.Stream()` in its constructor (token_dispatcher.py:445), syncs its split sizes
  on CUDA streams (token_dispatcher.py:871-899) and allocates its output on CUDA (mappings.py:442).

Exact numerics (the router's `numerics == "exact"`): the router's GEMM is exact_linear and its routing
the native exact block's (`exact_routing`: softmax_exact, top-k, tree_sum renormalization; Megatron's
own renormalizes by a softmax over the k logits, equal only in exact arithmetic). The dispatcher then
keeps each expert output at its token's slot (combine_preprocess: (N, K, C), zeros elsewhere; under EP
the reduce-scatter adds only zeros to it) and sums the k slots in slot order (token_combine), as the
native SparseMoeBlock does: Megatron's unpermute sums in expert order, and over EP ranks in rank
order, which differ in the last bits once k >= 3.

Shapes: n this rank's tokens (T * B), N the EP group's tokens, C hidden, E experts, K experts per token,
I expert width.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .linear import WeightCaches, _dense

_CLASSES: dict[str, type] = {}


# Collectives over the expert-parallel group, any device, ranks with different token counts ----------
def _token_counts(n: int, group, device: torch.device) -> list[int]:
    """Every rank's token count, in group rank order."""
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]


def _gather_rows(x: torch.Tensor, group, counts: list[int]) -> torch.Tensor:
    """(counts[rank], ...) on each rank -> (sum(counts), ...) on every rank (padded to the largest)."""
    most = max(counts)
    padded = x.new_zeros((most, *x.shape[1:]))
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, counts)])


def _reduce_scatter_rows(x: torch.Tensor, group, counts: list[int]) -> torch.Tensor:
    """(sum(counts), ...) on each rank -> the sum over ranks of this rank's rows (counts[rank], ...)."""
    total = x.contiguous().clone()
    dist.all_reduce(total, group=group)
    rank = dist.get_rank(group)
    start = sum(counts[:rank])
    return total[start:start + counts[rank]]


class _GatherTokens(torch.autograd.Function):
    """Gather over the group in forward; backward: the sum over ranks of this rank's gradient rows."""

    @staticmethod
    def forward(ctx, x, group, counts):
        ctx.group, ctx.counts = group, counts
        return _gather_rows(x, group, counts)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.group, ctx.counts), None, None


class _ReduceScatterTokens(torch.autograd.Function):
    """Sum over the group and keep this rank's rows in forward; backward: gather the gradient rows."""

    @staticmethod
    def forward(ctx, x, group, counts):
        ctx.group, ctx.counts = group, counts
        return _reduce_scatter_rows(x, group, counts)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad.contiguous(), ctx.group, ctx.counts), None, None


def exact_routing(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (n, E) fp32 -> routing weights (n, K) fp32 and expert ids (n, K) in slot order, as the native
    `SparseMoeBlock.route` computes them under exact numerics (softmax_exact, top-k, renormalized by a
    tree_sum). Megatron's own routing renormalizes by a softmax over the k logits: equal in exact
    arithmetic, not in floating point. (The activation dtype here is the fp32 master dtype, so the native
    cast of the weights to it is a no-op.)"""
    from jetflow.model.moe import softmax_exact, tree_sum

    weights, ids = torch.topk(softmax_exact(logits.float()), top_k, dim=-1)  # (n, K) fp32, (n, K)
    if norm_topk_prob:
        weights = weights / tree_sum(weights)
    return weights, ids


# Megatron subclasses (made on first use: Megatron is imported lazily) ----------------------------
def _moe_classes() -> dict[str, type]:
    if not _CLASSES:
        from megatron.core.transformer.moe.moe_layer import MoELayer
        _CLASSES.update(router=_router_class(), experts=_experts_class(), layer=MoELayer,
                        dispatcher=_dispatcher_class())
    return _CLASSES


def _router_class() -> type:
    from megatron.core.transformer.moe.router import TopKRouter

    class JetflowTopKRouter(TopKRouter):
        """TopKRouter whose logits come from the native router's GEMM (`kind`: fp32 or bf16); under exact
        numerics the routing is the native exact one too (`exact_routing`)."""

        kind = "fp32"
        numerics = "fast"
        norm_topk_prob = True
        last_logits: torch.Tensor | None = None  # (T, B, E) fp32: the last forward's (load_balancing_loss)

        def configure(self, kind: str, numerics: str, norm_topk_prob: bool) -> None:
            """The native router's GEMM kind (fp32, or bf16 where the recipe keeps it: checks.py), the
            numerics and the model config's norm_topk_prob (MegatronPolicy)."""
            self.kind, self.numerics, self.norm_topk_prob = kind, numerics, norm_topk_prob
            self._exact_caches = WeightCaches()

        def gating(self, input: torch.Tensor) -> torch.Tensor:
            """(T, B, C) -> logits (T, B, E) in fp32: `SparseMoeBlock.route`'s `self.gate(x)`."""
            if self.numerics == "exact":
                from jetflow.precision.exact import exact_linear
                logits = exact_linear(input, self.weight, self.bias, self.kind,
                                      cache=self._exact_caches.get(self.weight, "gate"), name="router")
            else:
                logits = _dense(self.kind, input, self.weight, self.bias)
            self.last_logits = logits.float()
            return self.last_logits

        def routing(self, logits: torch.Tensor, padding_mask=None):
            """Megatron's routing (fast), or the native exact one: probs (n, E) with the k routing weights
            at the chosen experts, routing map (n, E); the chosen ids in slot order in `last_topk_ids`."""
            if self.numerics != "exact":
                return super().routing(logits, padding_mask=padding_mask)
            logits = logits.reshape(-1, self.config.num_moe_experts)  # (n, E)
            weights, ids = exact_routing(logits, self.topk, self.norm_topk_prob)  # (n, K), (n, K)
            self.last_topk_ids = ids
            probs = torch.zeros_like(logits).scatter(1, ids, weights)  # (n, E)
            return probs, torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, True)

    return JetflowTopKRouter


def _experts_class() -> type:
    from megatron.core.transformer.moe.experts import SequentialMLP

    class JetflowSequentialMLP(SequentialMLP):
        """SequentialMLP scaling each expert's output (not its activation) by the routing weight."""

        def forward(self, hidden: torch.Tensor, tokens_per_expert, probs: torch.Tensor):
            """hidden (n_local, C) grouped by local expert (and by source rank inside an expert), probs
            (n_local,), tokens_per_expert (E_local,) or (E_local, EP) -> ((n_local, C), None)."""
            counts = torch.as_tensor(tokens_per_expert).reshape(len(self.local_experts), -1)  # (E_local, EP)
            experts = [e for e in self.local_experts for _ in range(counts.shape[1])]  # one GEMM per source rank
            counts = counts.reshape(-1).tolist()
            outs = []
            for expert, x, p in zip(experts, hidden.split(counts), probs.split(counts)):
                if x.shape[0] == 0:  # as natively: an expert without tokens does not run
                    outs.append(x)
                    continue
                y, _ = expert(x)  # (n_e, C)
                outs.append((y * p[:, None]).to(x.dtype))
            return torch.cat(outs) if outs else hidden, None

    return JetflowSequentialMLP


def _dispatcher_class() -> type:
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    class JetflowAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
        """Megatron's all-gather dispatcher with device-agnostic collectives for uneven token counts
        over the expert-parallel group (see the module docstring)."""

        router = None  # this layer's JetflowTopKRouter (set by use_jetflow_dispatchers)

        @property
        def slot_order(self) -> bool:
            """Exact numerics: a token's k expert outputs are summed in slot order (see combine_preprocess)."""
            return self.router is not None and self.router.numerics == "exact"

        def token_dispatch(self, hidden_states, probs):
            """hidden (n, C), probs (n, E), routing map (n, E) -> the EP group's (N, C), (N, E), (N, E)."""
            self.topk_ids = self.router.last_topk_ids if self.slot_order else None  # (n, K)
            if self.ep_size > 1:
                group = self.ep_group
                self.token_counts = _token_counts(hidden_states.shape[0], group, hidden_states.device)
                with torch.no_grad():
                    self.routing_map = _gather_rows(self.routing_map.to(torch.uint8), group,
                                                    self.token_counts).bool()
                    if self.topk_ids is not None:
                        self.topk_ids = _gather_rows(self.topk_ids, group, self.token_counts)  # (N, K)
                probs = _GatherTokens.apply(probs, group, self.token_counts)
                hidden_states = _GatherTokens.apply(hidden_states, group, self.token_counts)
            return hidden_states, probs

        def dispatch_postprocess(self, hidden_states, probs):
            """Megatron's permutation (tokens grouped by local expert, in gathered order, so by source
            rank inside an expert); tokens_per_expert becomes (E_local, EP): per source rank."""
            permuted, tokens_per_expert, permuted_probs = super().dispatch_postprocess(hidden_states, probs)
            if self.ep_size > 1:
                per_rank = self.local_map.split(self.token_counts)  # EP x (n_r, E_local)
                tokens_per_expert = torch.stack([m.sum(0) for m in per_rank], dim=1).long().cpu()  # (E_local, EP)
            return permuted, tokens_per_expert, permuted_probs

        def combine_preprocess(self, hidden_states):
            """Megatron's unpermute (fast: each token's outputs of this rank's experts summed in expert
            order), or under exact numerics the outputs placed by (token, slot): (N, K, C), zero where
            another rank's expert or no expert wrote."""
            if not self.slot_order:
                return super().combine_preprocess(hidden_states)
            expert, token = self.local_map.T.nonzero(as_tuple=True)  # each permuted row: expert-major, tokens in order
            expert = expert + self.local_expert_indices[0]  # global expert ids
            slot = (self.topk_ids[token] == expert[:, None]).long().argmax(-1)  # (rows,) its slot of the token's k
            out = hidden_states.new_zeros(self.topk_ids.shape[0], self.topk_ids.shape[1], hidden_states.shape[-1])
            return out.index_put((token, slot), hidden_states)  # (N, K, C)

        def token_combine(self, hidden_states):
            """(N, C) partial outputs of this rank's experts -> (n, C) summed over the EP group. Exact
            numerics: (N, K, C) by slot -> this rank's tokens' (n, K, C) (each (token, slot) written by one
            rank: the sum over ranks adds zeros only), then the k slots added in slot order, 0, 1, ...,
            as the native SparseMoeBlock does, whichever ranks hold the experts."""
            if self.slot_order:
                n, K, C = hidden_states.shape
                if self.ep_size > 1:
                    hidden_states = _ReduceScatterTokens.apply(hidden_states.reshape(n, K * C), self.ep_group,
                                                               self.token_counts).reshape(-1, K, C)
                out = hidden_states[:, 0]
                for k in range(1, K):
                    out = out + hidden_states[:, k]
                return out  # (n, C)
            if self.ep_size > 1:
                hidden_states = _ReduceScatterTokens.apply(
                    hidden_states.to(self.local_probs.dtype), self.ep_group, self.token_counts).to(hidden_states.dtype)
            return hidden_states

    return JetflowAllGatherTokenDispatcher


def use_jetflow_dispatchers(gpt) -> None:
    """Give every MoELayer of a built GPTModel jetflow's token dispatcher. Megatron's MoELayer makes its
    own from the config's type (its all-gather dispatcher, whose constructor is device-free); replacing
    it after the build keeps Megatron's MoELayer class, which TransformerLayer recognises (a subclass
    would be built without its process groups, with an "Unknown MLP type" warning)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    dispatcher = _moe_classes()["dispatcher"]
    for layer in gpt.modules():
        if isinstance(layer, MoELayer):
            layer.token_dispatcher = dispatcher(layer.num_local_experts, layer.local_expert_indices,
                                                config=layer.config, pg_collection=get_default_pg_collection())
            layer.token_dispatcher.router = layer.router  # a plain attribute: the dispatcher is no nn.Module


def moe_layer_spec(column: type, row: type):
    """The ModuleSpec of one MoE block: Megatron's MoELayer with jetflow's router and experts (whose
    linears are jetflow's); its dispatcher is replaced after the build (`use_jetflow_dispatchers`)."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    c = _moe_classes()
    experts = ModuleSpec(module=c["experts"], submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row))
    return ModuleSpec(module=c["layer"], submodules=MoESubmodules(experts=experts, router=c["router"]))


def router_modules(gpt) -> list:
    """The MoE routers of a GPTModel stage, in layer order."""
    router = _moe_classes()["router"]
    return [m for m in gpt.modules() if isinstance(m, router)]
