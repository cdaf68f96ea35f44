"""MegatronPolicy: a Megatron-Core GPTModel behind the native Decoder's trainer interface (the adapter
the Trainer, weight sync and checkpoints use)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from jetflow.model.decoder import Decoder, ModelConfig, rope_inv_freq
from jetflow.precision import FP8Recipe, QuantizedTensor

from .checks import check_fp8_tp_alignment, check_supported, padded_vocab_size, segment_kind
from .deps import _seed_cpu_rng_tracker, patch_megatron_for_cpu
from .linear import Segment, _linear_classes
from .model import _block_spec, _transformer_config
from .parallel import _GatherLastDim, initialize_parallel
from .sharding import _qkv_dims, hf_to_megatron, megatron_to_hf, tensor_parallel_dims

class MegatronPolicy(nn.Module):
    """A Megatron-Core GPTModel behind the native Decoder's trainer interface.

    kind: fp32 | bf16 | fp8 (as in `apply_precision`; fp8 layers the recipe keeps run in bf16).
    Parameters are fp32 master weights on every path (`params_dtype`); only the GEMMs change.
    Each rank holds its TP shards; `parameters()` are what an optimizer on this rank steps.
    """

    def __init__(self, config: ModelConfig, *, kind: str = "fp32", recipe: FP8Recipe | None = None,
                 gemm_backend: str = "auto", tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 device: torch.device | str = "cpu", params_dtype: torch.dtype = torch.float32,
                 init_weights: bool = True, seed: int = 0):
        super().__init__()
        if kind not in ("fp32", "bf16", "fp8"):
            raise ValueError(f"MegatronPolicy kind={kind!r}: valid kinds are fp32, bf16, fp8")
        if kind == "fp8" and recipe is None:
            raise ValueError("MegatronPolicy kind='fp8' needs an FP8Recipe")
        tp = tensor_parallel_size
        check_supported(config, tp)
        check_fp8_tp_alignment(config, tp, recipe, kind)
        device = torch.device(device)
        initialize_parallel(tp, pipeline_parallel_size, device)
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        if device.type == "cpu":
            patch_megatron_for_cpu()
            _seed_cpu_rng_tracker(seed)
        else:
            model_parallel_cuda_manual_seed(seed)

        self.config, self.kind, self.recipe, self.gemm_backend = config, kind, recipe, gemm_backend
        self.tp_size, self.tp_rank = tp, ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.padded_vocab = padded_vocab_size(config.vocab_size, tp)
        torch.manual_seed(seed)  # Megatron's CPU init draws the full weight on every rank: same on all
        mcfg = _transformer_config(config, tp, params_dtype, init_weights)
        self.gpt = GPTModel(mcfg, _block_spec(config), vocab_size=self.padded_vocab,
                            max_sequence_length=config.max_position_embeddings, position_embedding_type="rope",
                            rotary_base=int(config.rope_theta),
                            share_embeddings_and_output_weights=config.tie_word_embeddings, parallel_output=True)
        # GPTModel hard-codes Megatron's ColumnParallelLinear for lm_head: swap in ours (same layout)
        column, _ = _linear_classes()
        old = self.gpt.output_layer
        self.gpt.output_layer = column(
            config.hidden_size, self.padded_vocab, config=mcfg, init_method=mcfg.init_method, bias=False,
            gather_output=False, skip_weight_param_allocation=config.tie_word_embeddings, tp_group=self.tp_group)
        if old.weight is not None:
            self.gpt.output_layer.weight = old.weight
        self._configure_linears()
        self.register_buffer("rope_inv_freq", rope_inv_freq(config), persistent=False)
        self.embed_grid: torch.dtype | None = None  # see Decoder.embed_grid
        self.to(device)

    # Construction helpers ----------------------------------------------------------------------
    @classmethod
    def from_decoder(cls, decoder: Decoder, **kwargs) -> "MegatronPolicy":
        """A policy with `decoder`'s config and weights (kwargs as in __init__)."""
        kwargs.setdefault("init_weights", False)
        kwargs.setdefault("device", decoder.model.embed_tokens.weight.device)
        policy = cls(decoder.config, **kwargs)
        policy.load_hf_state_dict(decoder.state_dict())
        return policy

    def _configure_linears(self) -> None:
        c, tp = self.config, self.tp_size
        G, h, D = _qkv_dims(c)
        inter = c.intermediate_size // tp

        def seg(name, layer, groups, start, stop):
            return Segment(name, groups, start, stop, segment_kind(self.kind, self.recipe, name, layer, c.num_layers))

        for i, layer in enumerate(self.gpt.decoder.layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            attn, mlp = layer.self_attention, layer.mlp
            g = G // tp
            attn.linear_qkv.configure([seg(a + "q_proj", i, g, 0, h * D), seg(a + "k_proj", i, g, h * D, (h + 1) * D),
                                       seg(a + "v_proj", i, g, (h + 1) * D, (h + 2) * D)], self.recipe,
                                      self.gemm_backend)
            attn.linear_proj.configure([seg(a + "o_proj", i, 1, 0, c.hidden_size)], self.recipe, self.gemm_backend)
            mlp.linear_fc1.configure([seg(m + "gate_proj", i, 1, 0, inter), seg(m + "up_proj", i, 1, inter, 2 * inter)],
                                     self.recipe, self.gemm_backend)
            mlp.linear_fc2.configure([seg(m + "down_proj", i, 1, 0, c.hidden_size)], self.recipe, self.gemm_backend)
        self.gpt.output_layer.configure([seg("lm_head", None, 1, 0, self.padded_vocab // tp)], self.recipe,
                                        self.gemm_backend)

    def _output_weight(self) -> torch.Tensor:
        """lm_head's local (V_pad / tp, C) weight: the embedding's when tied."""
        if self.config.tie_word_embeddings:
            return self.gpt.embedding.word_embeddings.weight
        return self.gpt.output_layer.weight

    def _linears(self):
        """Every jetflow parallel linear of the model (their `segments` name the HF linears)."""
        column, row = _linear_classes()
        for module in self.gpt.modules():
            if isinstance(module, (column, row)):
                yield module

    # The trainer interface ---------------------------------------------------------------------
    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (B, T, C), after the last norm; the semantics of `Decoder.forward_hidden`
        without a cache: attention_mask bool (B, T), True = real token (left padding);
        position_ids default cumsum(mask) - 1 (arange without a mask); a padding token attends only
        to itself."""
        B, T = input_ids.shape
        device = input_ids.device
        if attention_mask is not None:
            if attention_mask.shape != (B, T):
                raise ValueError(f"attention_mask must be (B, T) = ({B}, {T}), got {tuple(attention_mask.shape)}")
            attention_mask = attention_mask.to(device=device, dtype=torch.bool)
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
            else:
                position_ids = torch.arange(T, device=device).expand(B, T)

        # Megatron's mask: bool, True = masked out, broadcast over heads. Always explicit: with None,
        # Megatron builds its causal mask with device="cuda" (get_default_causal_mask).
        slot = torch.arange(T, device=device)
        allowed = (slot[None, :] <= slot[:, None])[None]  # (1, T, T) causal
        if attention_mask is not None:
            allowed = (allowed & attention_mask[:, None, :]) | (slot[None, :] == slot[:, None])[None]  # (B, T, T)
        mask = ~allowed[:, None]  # (B|1, 1, T, T)

        # RoPE angles per (token, sequence): Megatron applies cos/sin of these in fp32, cast to x's dtype
        freqs = position_ids[..., None].float() * self.rope_inv_freq.float()  # (B, T, D/2)
        rope = torch.cat((freqs, freqs), dim=-1).transpose(0, 1)[:, :, None, :]  # (T, B, 1, D)

        x = self.gpt.embedding(input_ids=input_ids, position_ids=position_ids)  # (T, B, C)
        if self.embed_grid is not None:  # as Decoder.embed_grid: embeddings on the bf16 grid
            x = x.to(self.embed_grid).to(x.dtype)
        x = self.gpt.decoder(hidden_states=x, attention_mask=mask, rotary_pos_emb=rope)  # (T, B, C), final norm
        return x.transpose(0, 1)  # (B, T, C)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> logits (B, T, V), the vocab-parallel shards gathered (and the padding dropped)."""
        logits, _ = self.gpt.output_layer(hidden, weight=self._output_weight() if self.config.tie_word_embeddings
                                          else None)  # (B, T, V_pad / tp)
        if self.tp_size > 1:
            logits = _GatherLastDim.apply(logits, self.tp_group)  # (B, T, V_pad)
        return logits[..., :self.config.vocab_size]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) (argument order of `Decoder.forward`)."""
        return self.lm_head(self.forward_hidden(input_ids, attention_mask, position_ids))

    def num_params(self) -> int:
        """Parameters of the full model (every TP shard, not the vocabulary padding): `Decoder.num_params`."""
        split = set(tensor_parallel_dims(self.config))
        n = sum(p.numel() * (self.tp_size if name in split else 1) for name, p in self.gpt.named_parameters())
        vocab_tables = 1 if self.config.tie_word_embeddings else 2
        return n - vocab_tables * (self.padded_vocab - self.config.vocab_size) * self.config.hidden_size

    # Weights in HF names -----------------------------------------------------------------------
    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return parts

    @torch.no_grad()
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors gathered from all TP ranks (every rank gets them); the keys of
        `Decoder(config).named_parameters()`. A collective: call it on every rank of the TP group."""
        local = {n: p.detach() for n, p in self.gpt.named_parameters()}
        shards = [dict(local) for _ in range(self.tp_size)]
        if self.tp_size > 1:
            for name in tensor_parallel_dims(self.config):
                for r, part in enumerate(self._gather(local[name])):
                    shards[r][name] = part
        return megatron_to_hf(shards, self.config)

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy HF-named full tensors (e.g. a Decoder's state dict) into this rank's shards."""
        local = hf_to_megatron(state_dict, self.config, self.tp_size, self.tp_rank)
        params = dict(self.gpt.named_parameters())
        missing, unexpected = set(params) - set(local), set(local) - set(params)
        if missing or unexpected:
            raise KeyError(f"Megatron parameters without HF weights: {sorted(missing)[:5]}; "
                           f"HF weights without Megatron parameters: {sorted(unexpected)[:5]}")
        for name, tensor in local.items():
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: shard shape {tuple(tensor.shape)} != parameter {tuple(params[name].shape)}")
            params[name].copy_(tensor)

    @torch.no_grad()
    def quantized_weights(self) -> dict[str, QuantizedTensor]:
        """{HF module name: QuantizedTensor of the full weight} for every FP8 linear: this step's bytes
        (the ones the forward computes with), shards gathered over TP. A collective under TP > 1."""
        out = {}
        for module in self._linears():
            weight = self._output_weight() if module is self.gpt.output_layer else module.weight
            for name, q in module.quantized_segments(weight).items():
                if self.tp_size > 1:
                    dim = module.parallel_dim
                    data = torch.cat([p.view(q.data.dtype) for p in self._gather(q.data.view(torch.uint8))], dim)
                    q = QuantizedTensor(data, torch.cat(self._gather(q.scale_inv), dim), q.block)
                out[name] = q
        return out

    # Gradients ---------------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients over the TP group: TP-split parameters counted on every
        rank, replicated ones (norms, row-parallel biases) once. The native Trainer's
        `clip_grad_norm_` sees only this rank's shards; under TP > 1 clip with `clip_grad_norm_` below."""
        split = set(tensor_parallel_dims(self.config))
        total = torch.zeros((), dtype=torch.float32, device=self.rope_inv_freq.device)
        for name, p in self.gpt.named_parameters():
            if p.grad is not None and (name in split or self.tp_rank == 0):
                total += p.grad.detach().float().pow(2).sum()
        if self.tp_size > 1:
            dist.all_reduce(total, group=self.tp_group)
        return total.sqrt()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale all gradients so that the global (TP-aware) norm is at most max_norm; returns the norm."""
        norm = self.grad_norm()
        coef = max_norm / (norm + 1e-6)
        if bool(coef < 1):
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    def allreduce_data_parallel_grads(self) -> None:
        """Average gradients over Megatron's data-parallel group (when world > tp); call after backward."""
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group()
        world = dist.get_world_size(group)
        if world == 1:
            return
        for p in self.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(world)
