"""The Llama-family decoder: Llama 3 (incl. "llama3" RoPE scaling), Qwen2 / Qwen2.5
(q/k/v biases), Qwen3 (RMSNorm on q and k per head), SmolLM2 (Llama architecture), and the
mixture-of-experts decoders Qwen3-MoE and Mixtral.

This module holds ModelConfig and the Decoder with its forward passes; the attention (RoPE,
AttentionPlan, the SDPA / invariant-kernel dispatch) lives in jetflow.model.attention, RMSNorm and
the MLP in jetflow.model.layers, the sparse MoE block in jetflow.model.moe. Their names stay
importable from here.

Design rules (other parts of jetflow rely on them):
- Module and parameter names mirror Hugging Face exactly (`model.layers.0.self_attn.q_proj.weight`,
  ...), so `state_dict()` keys equal HF checkpoint keys. MoE experts are one module per expert, as
  on disk (`mlp.experts.3.gate_proj`), not transformers 5's fused in-memory tensors.
- Every projection is a plain `nn.Linear` that is *called* (never `F.linear(x, module.weight)`), so
  the precision converter can swap any of them for an FP8 linear by name and the swap takes effect.
- Numerics follow transformers' implementation (RMSNorm in fp32 then cast, RoPE cos/sin in fp32 then
  cast to the activation dtype), so fp32 logits agree with HF to ~1e-5.

Shapes: B batch, T new tokens in this forward, S key slots attended (T, or cache.length + T),
C hidden size, H query heads, H_kv key/value heads, D head dim, V vocab.
"""

from __future__ import annotations


import torch
import torch.nn as nn

from jetflow.kernels import invariant
from jetflow.model.attention import (  # noqa: F401  (re-exported: jetflow.model.decoder.apply_rope, ...)
    GRAD_BLOCK,
    Attention,
    AttentionPlan,
    align_rows,
    apply_rope,
    attention_plan,
    packed_plan,
    rope_inv_freq,
    rope_tables,
    rotate_half,
)
from jetflow.model.kv_cache import KVCache
from jetflow.model.model_config import SUPPORTED, ModelConfig, UnsupportedModelError  # noqa: F401  (re-exported)
from jetflow.model.layers import MLP, RMSNorm, silu_exact  # noqa: F401  (re-exported)
from jetflow.model.moe import SparseMoeBlock, model_load_balancing_loss
from jetflow.precision.linear import PrecisionLinear
from jetflow.precision.modes import NUMERICS

# model_type -> HF architecture class name


class DecoderLayer(nn.Module):
    """Attention then a feed-forward block: a dense MLP (`mlp`), or in an MoE layer a SparseMoeBlock
    under the checkpoint's name (`mlp` for Qwen3-MoE, `block_sparse_moe` for Mixtral)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.ffn_name = config.moe_attr if config.is_moe_layer(layer_idx) else "mlp"
        ffn = SparseMoeBlock(config) if config.is_moe_layer(layer_idx) else MLP(config)
        setattr(self, self.ffn_name, ffn)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, plan: AttentionPlan, cache, routed_ids: torch.Tensor | None = None):
        """routed_ids (B, T, K): an MoE layer's replayed expert ids (SparseMoeBlock.route)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, plan, cache)
        ffn = getattr(self, self.ffn_name)
        h = self.post_attention_layernorm(x)
        x = x + (ffn(h, plan.exact) if routed_ids is None else ffn(h, plan.exact, routed_ids=routed_ids))
        return x  # (B, T, C)


class Decoder(nn.Module):
    """A causal LM. `Decoder(config)` gives random weights; use `jetflow.model.load` for a checkpoint."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.num_heads % config.num_kv_heads:
            raise ValueError(f"num_heads {config.num_heads} not a multiple of num_kv_heads {config.num_kv_heads}")
        self.config = config
        self.model = nn.Module()  # the HF "model." prefix
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # RoPE inverse frequencies (D/2,), a non-persistent buffer (not in the state dict). Made on
        # the CPU even when the model is built on the meta device, and kept fp32 by `_apply`.
        self.register_buffer("rope_inv_freq", rope_inv_freq(config, device="cpu"), persistent=False)
        self.numerics = "fast"
        """fast | exact (NUMERICS): set with the precision of the linears (jetflow.run.build)."""
        self.last_token_mask: torch.Tensor | None = None
        """(B, T) real tokens of the last forward, in the order its layers saw them (None: all real)."""
        self.layer_call = None
        """fn(layer, *args) -> the layer's output, through which a forward with grad enabled and no cache
        calls each decoder layer (jetflow.train.checkpointing: activation checkpointing); None: directly."""
        self.embed_grid: torch.dtype | None = None
        """Round embedding outputs to this dtype's grid (bf16 under the bf16 / mixed / unified modes,
        as the recipe keeps embeddings in bf16): trainer and rollout then agree on them, and the
        embedding can ship in bf16 (jetflow.sync)."""
        self.grad_block = 1
        """Token columns a sequence's padded row is widened to a multiple of in a forward that records a
        graph (exact numerics): 1, or GRAD_BLOCK on sequence packing's grid (`use_grad_block`)."""

    def use_grad_block(self, block: int) -> None:
        """Sequence packing's grid (block GRAD_BLOCK, exact numerics; jetflow.train.packing): padded rows
        widened to a multiple of `block` when recording a graph, and every exact weight gradient (linears,
        RMSNorm weights) summed over tokens in one order (`invariant.weight_grad`). 1: torch's own sums."""
        self.grad_block = block
        for m in self.modules():
            if isinstance(m, (PrecisionLinear, RMSNorm)):
                m.ordered_wgrad = block > 1

    def set_numerics(self, numerics: str, embed_grid: torch.dtype | None) -> None:
        """How the forward computes, set with the precision of its linears (jetflow.run.build.apply_mode):
        `numerics` (NUMERICS) and the embeddings' grid (`embed_grid`)."""
        if numerics not in NUMERICS:
            raise ValueError(f"Decoder numerics={numerics!r}: valid modes are {NUMERICS}")
        self.numerics, self.embed_grid = numerics, embed_grid

    def _apply(self, fn, recurse=True):
        """After .to() / .cuda() / .bfloat16(): recompute rope_inv_freq in fp32 on its new device, so
        that a bf16 model does not rotate with bf16-rounded frequencies."""
        super()._apply(fn, recurse)
        self.rope_inv_freq = rope_inv_freq(self.config, device=self.rope_inv_freq.device)
        return self

    def tie_weights(self) -> None:
        """With tie_word_embeddings, lm_head.weight *is* the embedding matrix (one Parameter)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) for input_ids (B, T). See `forward_hidden` for the arguments."""
        return self.lm_head(self.forward_hidden(input_ids, position_ids, attention_mask, cache))

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        routed_experts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states (B, T, C), after the last norm and before lm_head.

        input_ids: (B, T) new tokens.
        attention_mask: bool, True = real token, False = padding. Without a cache: (B, T), any
            padding in fast numerics, one contiguous run of real tokens per row in exact numerics
            (left-padded prompt + right-padded response, as a trainer batch is). With a cache:
            (B, cache.length + T) covering every slot so far, left padding, fast numerics only.
        position_ids: (B, T). Default: the number of real tokens before each token,
            `cumsum(attention_mask) - 1` (= arange without padding); with a cache and no mask,
            arange(cache.length, cache.length + T).
        cache: if given, the T new tokens are written into it and attend to its earlier slots; then
            this method raises cache.length. With an attention_mask, slots [cache.length,
            cache.length + T) of every row; without one, slot = position (right-padded rows: row b's
            token at position p goes to slot p and attends slots 0..p), the layout the rollout
            engine uses and exact numerics needs.
        routed_experts: (B, T, L_moe, K) expert ids to replay in each MoE layer (routing replay: the
            rollout engine's choices, `RolloutEngine(record_routing=True)`), -1 where the router
            chooses; None: every router chooses.

        Each token attends to the valid slots at or before its own. A padding token attends only to
        itself (fast) or to the slots before it (exact), so its (meaningless) outputs stay finite.
        """
        exact = self.numerics == "exact"
        if exact:
            invariant.check_device(input_ids.device)
        B, T = input_ids.shape
        L = cache.length if cache is not None else 0
        device = input_ids.device
        if attention_mask is not None:
            S = L + T
            if attention_mask.shape != (B, S):
                raise ValueError(
                    f"attention_mask must be (B, cache.length + T) = ({B}, {S}), got {tuple(attention_mask.shape)}")
            attention_mask = attention_mask.to(device=device, dtype=torch.bool)
            if exact:
                if cache is not None:
                    raise ValueError("exact numerics with a KV cache need right-padded rows (slot = position): "
                                     "pass position_ids, not an attention_mask")
                if position_ids is not None:
                    raise ValueError("exact numerics with an attention_mask derive the positions themselves; "
                                     "do not pass position_ids")
                return self._forward_aligned(input_ids, attention_mask, routed_experts)
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, L:]  # (B, T)
            else:
                position_ids = torch.arange(L, L + T, device=device).expand(B, T)
        elif exact and cache is None and not torch.equal(position_ids, torch.arange(T, device=device).expand(B, T)):
            raise ValueError("exact numerics without a KV cache need slot = position: position_ids must be arange(T)")
        plan = attention_plan(position_ids, attention_mask, cache, exact)
        # the real tokens of this forward in the order its layers see them (MoE: the load-balancing loss)
        self.last_token_mask = attention_mask[:, L:] if attention_mask is not None else None  # (B, T)

        return self._layers(input_ids, plan, cache, routed_experts)

    def forward_packed(self, input_ids: torch.Tensor, lengths: list[int], routed_experts: torch.Tensor | None = None,
                       real: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (1, N, C) of sequences packed side by side in one row without padding:
        input_ids (1, N), N = sum(lengths), each sequence whole (prompt + response) at its own positions
        from 0 and attending only to itself (jetflow.model.attention.packed_plan). Under exact numerics a
        token's hidden state is the same bits as in `forward_hidden` of the padded batch: the linears,
        norms and RoPE are row-local, the attention runs per sequence with the same kernel.
        routed_experts: (1, N, L_moe, K) as in `forward_hidden`. real: (1, N) bool, the real tokens where a
        sequence carries its own padding (packing's grid; None: all real)."""
        exact = self.numerics == "exact"
        if exact:
            invariant.check_device(input_ids.device)
        if input_ids.shape != (1, sum(lengths)):
            raise ValueError(f"packed input_ids must be (1, sum(lengths)) = (1, {sum(lengths)}), "
                             f"got {tuple(input_ids.shape)}")
        self.last_token_mask = real
        return self._layers(input_ids, packed_plan(lengths, exact, input_ids.device), None, routed_experts)

    def _layers(self, input_ids: torch.Tensor, plan: AttentionPlan, cache: KVCache | None,
                routed_experts: torch.Tensor | None) -> torch.Tensor:
        """Embedding, every decoder layer under `plan`, the final norm: (B, T, C)."""
        B, T = input_ids.shape
        x = self.embed(input_ids)  # (B, T, C)
        cos, sin = rope_tables(plan.positions, self.rope_inv_freq, x.dtype)  # (B, T, D) each
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D)

        replay = self._replay_per_layer(routed_experts, B, T)
        call = self.layer_call if self.layer_call is not None and cache is None and torch.is_grad_enabled() else None
        for layer, routed_ids in zip(self.model.layers, replay):
            x = layer(x, cos, sin, plan, cache, routed_ids) if call is None else \
                call(layer, x, cos, sin, plan, cache, routed_ids)  # (B, T, C)
        if cache is not None:
            cache.advance_to(plan.end)
        return self.model.norm(x)  # (B, T, C)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (..., C) of input_ids (...), on `embed_grid` when it is set (the precision
        modes' bf16 embedding): the Decoder's first step, also called by the vLLM plugin."""
        x = self.model.embed_tokens(input_ids)
        return x if self.embed_grid is None else x.to(self.embed_grid).to(x.dtype)

    def _replay_per_layer(self, routed_experts: torch.Tensor | None, B: int, T: int) -> list[torch.Tensor | None]:
        """routed_experts (B, T, L_moe, K) -> one (B, T, K) per decoder layer (None for dense layers)."""
        moe = [i for i in range(self.config.num_layers) if self.config.is_moe_layer(i)]
        if routed_experts is None:
            return [None] * self.config.num_layers
        want = (B, T, len(moe), self.config.num_experts_per_tok)
        if not moe or tuple(routed_experts.shape) != want:
            raise ValueError(f"routed_experts must be (B, T, MoE layers, top-k) = {want}, got "
                             f"{tuple(routed_experts.shape)}" + ("" if moe else " (this model has no MoE layers)"))
        per_layer: list[torch.Tensor | None] = [None] * self.config.num_layers
        for j, i in enumerate(moe):
            per_layer[i] = routed_experts[:, :, j]
        return per_layer

    def _forward_aligned(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """Exact numerics on padded rows: shift each row so its real tokens start at slot 0 (slot =
        position, as in the rollout engine's cache), run, and shift the hidden states back. Recording a
        graph, the rows are widened to a multiple of `grad_block` (packing's grid; 1: as they are)."""
        T = attention_mask.shape[1]
        width = -(-T // self.grad_block) * self.grad_block if torch.is_grad_enabled() else T
        shift, back = align_rows(attention_mask, width)  # (B, width), (B, T)
        if routed_experts is not None:  # (B, T, L, K): the same shift
            routed_experts = routed_experts.to(shift.device).gather(
                1, shift[:, :, None, None].expand(-1, -1, *routed_experts.shape[2:]))
        hidden = self.forward_hidden(input_ids.gather(1, shift), routed_experts=routed_experts)  # (B, width, C)
        cols = torch.arange(width, device=shift.device)
        self.last_token_mask = cols[None] < attention_mask.sum(-1, keepdim=True)  # (B, width): real tokens first
        return hidden.gather(1, back[..., None].expand(-1, -1, hidden.shape[-1]))

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None, device=None) -> KVCache:
        """A KVCache for this model (dtype/device default to the embedding's; K transposed under exact
        numerics, the layout the invariant attention reads)."""
        w = self.model.embed_tokens.weight
        return KVCache.for_model(self.config, batch_size, max_len, dtype or w.dtype, device or w.device,
                                 k_transposed=self.numerics == "exact")

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # shared (tied) parameters counted once

    # What the Trainer asks of every policy (jetflow.model.protocol.TrainablePolicy), answered for a model
    # whole in each process: its gradients are plain tensors, its forward runs alone.
    collective_forward = False
    """A forward never waits for another rank's (no expert parallelism): a micro-batch without response
    tokens can be skipped."""

    def load_balancing_loss(self) -> torch.Tensor | None:
        """The router load-balancing loss of the last forward (None for a dense model)."""
        return model_load_balancing_loss(self)

    def reduce_data_parallel_grads(self, dp) -> None:
        """Sum the trained parameters' gradients over the data-parallel ranks `dp`."""
        dp.all_reduce_grads([p for p in self.parameters() if p.requires_grad])

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the trained parameters' gradients by their global norm; returns that norm."""
        return torch.nn.utils.clip_grad_norm_([p for p in self.parameters() if p.requires_grad], max_norm)
