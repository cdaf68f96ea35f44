"""MegatronPolicy: a Megatron-Core GPTModel behind the native Decoder's trainer interface (the adapter
the Trainer, weight sync and checkpoints use)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from jetflow.model.attention import align_rows
from jetflow.model.decoder import Decoder, ModelConfig, rope_inv_freq
from jetflow.precision import LINEAR_KINDS, NUMERICS, QuantizedTensor, QuantRecipe
from jetflow.precision.kv import KVQuantizer
from jetflow.precision.lora import is_adapter

from .attention import ModelParallelKVQuantizer, core_attention_modules, unalign_rows
from .checks import check_layout, padded_vocab_size, segment_kind
from .deps import _seed_cpu_rng_tracker, patch_megatron_for_cpu
from .grads import ShardedGrads
from .linear import Segment, _linear_classes
from .lora import attach_adapters, full_adapters, load_full_adapters, split_adapter_names
from .model import _block_spec, _transformer_config
from .moe import router_modules, use_jetflow_dispatchers
from .parallel import _GatherLastDim, initialize_parallel, read_layout
from .pipeline import gpipe
from .sharding import _qkv_dims, is_expert_param
from .weights import ShardedWeights


class MegatronPolicy(nn.Module):
    """A Megatron-Core GPTModel behind the native Decoder's trainer interface.

    kind: fp32 | bf16 | fp8 (as in `apply_precision`; fp8 layers the recipe keeps run in bf16).
    Parameters are fp32 master weights on every path (`params_dtype`); only the GEMMs change.
    Each rank holds its TP shards; `parameters()` are what an optimizer on this rank steps.

    Pipeline parallelism (pipeline_parallel_size > 1): each rank holds one stage, num_layers / pp
    consecutive layers (Megatron's split); the first stage also the embedding, the last one the final
    norm and lm_head. No stage can run `forward_hidden` alone: the Trainer hands each step's
    micro-batches to `pipeline_forward_backward` (a GPipe schedule, see pipeline.py) with the loss as a
    function of the last stage's hidden states. With tied embeddings the last stage keeps its own copy
    of the embedding as lm_head's weight (Megatron's layout), equal to the first stage's at load and
    kept equal by summing the two gradients over Megatron's embedding group after every backward.
    Weights (`hf_state_dict`, `quantized_weights`) are gathered over stages too: every rank gets the
    whole model.

    Mixture-of-experts models (Qwen3-MoE, Mixtral) run Megatron's MoE layer (moe.py); with
    expert_parallel_size = EP > 1 each rank of an expert-parallel group holds num_experts / EP experts
    and its own data (EP ranks are data-parallel ranks): every rank must run the same number of
    forwards (the token dispatch is a collective of the EP group). Expert gradients are summed over the
    expert-data-parallel group, the others over the data-parallel group (`reduce_data_parallel_grads`);
    the gradient norm counts each expert once; `hf_state_dict` / `quantized_weights` gather every expert.
    """

    def __init__(self, config: ModelConfig, *, kind: str = "fp32", recipe: QuantRecipe | None = None,
                 gemm_backend: str = "auto", tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 device: torch.device | str = "cpu", params_dtype: torch.dtype = torch.float32,
                 init_weights: bool = True, seed: int = 0, expert_parallel_size: int = 1, numerics: str = "fast",
                 embed_grid: torch.dtype | None = None):
        super().__init__()
        if numerics not in NUMERICS:
            raise ValueError(f"MegatronPolicy numerics={numerics!r}: valid modes are {NUMERICS}")
        if kind not in LINEAR_KINDS:
            raise ValueError(f"MegatronPolicy kind={kind!r}: valid kinds are {LINEAR_KINDS}")
        if kind == "fp8" and recipe is None:
            raise ValueError("MegatronPolicy kind='fp8' needs a QuantRecipe")
        tp, pp, ep = tensor_parallel_size, pipeline_parallel_size, expert_parallel_size
        check_layout(config, tp, pp, ep, kind, recipe, numerics)
        device = torch.device(device)
        initialize_parallel(tp, pp, device, ep)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        if device.type == "cpu":
            patch_megatron_for_cpu()
            _seed_cpu_rng_tracker(seed)
        else:
            model_parallel_cuda_manual_seed(seed)

        self.config, self.kind, self.recipe, self.gemm_backend = config, kind, recipe, gemm_backend
        self.numerics = numerics
        self.layout = layout = read_layout(tp, pp, ep)  # the process grid (parallel.ParallelLayout)
        # its view for the ShardedPolicy protocol and the trainer, read here once
        self.tp_size, self.tp_rank, self.tp_group = layout.tp_size, layout.tp_rank, layout.tp_group
        self.pp_size, self.pp_rank, self.pp_group = layout.pp_size, layout.pp_rank, layout.pp_group
        self.first_stage, self.last_stage = layout.first_stage, layout.last_stage
        self.ep_size, self.ep_rank, self.ep_group = layout.ep_size, layout.ep_rank, layout.ep_group
        self.mp_group, self.state_group = layout.mp_group, layout.state_group
        self.mp_size, self.mp_rank = dist.get_world_size(self.mp_group), dist.get_rank(self.mp_group)
        self.state_size, self.state_rank = dist.get_world_size(self.state_group), dist.get_rank(self.state_group)
        self.params_dtype = params_dtype
        # tied embeddings on 2+ stages: the last stage's lm_head weight is a copy of the embedding
        self._tied_copy = config.tie_word_embeddings and pp > 1
        self.padded_vocab = padded_vocab_size(config.vocab_size, tp)
        torch.manual_seed(seed)  # Megatron's CPU init draws the full weight on every rank: same on all
        mcfg = _transformer_config(config, tp, params_dtype, init_weights, pp, ep, numerics)
        # Under PP, GPTModel's own tying (setup_embeddings_and_output_layer) moves the weight with
        # `weight.data.cuda()` before its all-reduce over the embedding group (CUDA only): build the
        # stages untied and keep the copy equal here (_sync_tied_copy, _allreduce_tied_grads).
        self.gpt = GPTModel(mcfg, _block_spec(config, mcfg, numerics), vocab_size=self.padded_vocab,
                            max_sequence_length=config.max_position_embeddings, position_embedding_type="rope",
                            rotary_base=int(config.rope_theta), pre_process=self.first_stage,
                            post_process=self.last_stage,
                            share_embeddings_and_output_weights=config.tie_word_embeddings and pp == 1,
                            parallel_output=True)
        if self.last_stage:
            self._swap_output_layer(mcfg, tied=config.tie_word_embeddings and pp == 1)
        use_jetflow_dispatchers(self.gpt)  # Megatron's all-gather dispatcher assumes CUDA (moe.py)
        # this stage's parameter names -> the names of the one-stage model (global layer numbers);
        # the tied copy has none (it is the embedding's)
        self._global_names = {name: self._global_name(name) for name, _ in self.gpt.named_parameters()}
        if self._tied_copy and self.last_stage:
            self._global_names["output_layer.weight"] = None
        self._configure_linears()
        self.weights = ShardedWeights(self.gpt, config, layout, self._global_names, self._tied_copy,
                                      self._output_weight, self._linears)
        self.grads = ShardedGrads(self.gpt, config, layout, self._global_names)
        self.register_buffer("rope_inv_freq", rope_inv_freq(config), persistent=False)
        self.embed_grid = embed_grid  # see Decoder.embed_grid
        self._last_mask: torch.Tensor | None = None
        self.to(device)
        if self._tied_copy:
            self._sync_tied_copy()
        self._num_params = self.weights.count_params(self.padded_vocab)  # a collective over the stages

    # Construction helpers ----------------------------------------------------------------------
    def _swap_output_layer(self, mcfg, tied: bool) -> None:
        """GPTModel hard-codes Megatron's ColumnParallelLinear for lm_head: ours instead (same layout and weight)."""
        column, _ = _linear_classes()
        old = self.gpt.output_layer
        self.gpt.output_layer = column(
            self.config.hidden_size, self.padded_vocab, config=mcfg, init_method=mcfg.init_method, bias=False,
            gather_output=False, skip_weight_param_allocation=tied, tp_group=self.tp_group)
        if old.weight is not None:
            self.gpt.output_layer.weight = old.weight

    @classmethod
    def from_decoder(cls, decoder: Decoder, **kwargs) -> "MegatronPolicy":
        """A policy with `decoder`'s config and weights (kwargs as in __init__)."""
        kwargs.setdefault("init_weights", False)
        kwargs.setdefault("device", decoder.model.embed_tokens.weight.device)
        policy = cls(decoder.config, **kwargs)
        policy.load_hf_state_dict(decoder.state_dict())
        return policy

    def _global_name(self, name: str) -> str:
        """A parameter name of this stage -> its name in the one-stage model (decoder.layers.{global i}),
        an expert's with its global index (mlp.experts.local_experts.{global e})."""
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            if is_expert_param(name):
                head, tail = rest.split("local_experts.", 1)
                j, tail = tail.split(".", 1)
                rest = f"{head}local_experts.{self._expert_offset() + int(j)}.{tail}"
            return f"decoder.layers.{self.gpt.decoder.layers[int(local)].layer_number - 1}.{rest}"
        return name

    def _expert_offset(self) -> int:
        """The global index of this rank's first expert."""
        return self.ep_rank * (self.config.num_experts // self.ep_size)

    def _configure_linears(self) -> None:
        c, tp = self.config, self.tp_size
        G, h, D = _qkv_dims(c)
        inter = c.intermediate_size // tp

        def seg(name, layer, groups, start, stop):
            return Segment(name, groups, start, stop, segment_kind(self.kind, self.recipe, name, layer, c.num_layers))

        for layer in self.gpt.decoder.layers:
            i = layer.layer_number - 1  # Megatron's global layer number (1-based) on any pipeline stage
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            attn, mlp = layer.self_attention, layer.mlp
            g = G // tp
            attn.linear_qkv.configure([seg(a + "q_proj", i, g, 0, h * D), seg(a + "k_proj", i, g, h * D, (h + 1) * D),
                                       seg(a + "v_proj", i, g, (h + 1) * D, (h + 2) * D)], self.recipe,
                                      self.gemm_backend, self.numerics)
            attn.linear_proj.configure([seg(a + "o_proj", i, 1, 0, c.hidden_size)], self.recipe, self.gemm_backend, self.numerics)
            if c.is_moe_layer(i):
                self._configure_moe(mlp, i, seg)
                continue
            mlp.linear_fc1.configure([seg(m + "gate_proj", i, 1, 0, inter), seg(m + "up_proj", i, 1, inter, 2 * inter)],
                                     self.recipe, self.gemm_backend, self.numerics)
            mlp.linear_fc2.configure([seg(m + "down_proj", i, 1, 0, c.hidden_size)], self.recipe, self.gemm_backend,
                                     self.numerics)
        if self.last_stage:
            self.gpt.output_layer.configure([seg("lm_head", None, 1, 0, self.padded_vocab // tp)], self.recipe,
                                            self.gemm_backend, self.numerics)

    def _configure_moe(self, moe, i: int, seg) -> None:
        """Layer i's router (the GEMM kind of the native router: bf16 where the recipe keeps it) and
        each local expert's linears, one FP8 segment per HF matrix (gate, up; down)."""
        from jetflow.model.moe import EXPERT_NAMES

        c, inter = self.config, self.config.moe_intermediate_size
        b = f"model.layers.{i}.{c.moe_attr}."
        moe.router.configure(segment_kind(self.kind, self.recipe, b + "gate", i, c.num_layers), self.numerics,
                             c.norm_topk_prob)
        gate, up, down = EXPERT_NAMES[c.model_type]
        for j, expert in enumerate(moe.experts.local_experts):
            x = f"{b}experts.{self._expert_offset() + j}."
            expert.linear_fc1.configure([seg(x + gate, i, 1, 0, inter), seg(x + up, i, 1, inter, 2 * inter)],
                                        self.recipe, self.gemm_backend, self.numerics)
            expert.linear_fc2.configure([seg(x + down, i, 1, 0, c.hidden_size)], self.recipe, self.gemm_backend, self.numerics)

    def _output_weight(self) -> torch.Tensor:
        """lm_head's local (V_pad / tp, C) weight: the embedding's when tied (its copy on the last stage)."""
        if self.config.tie_word_embeddings and not self._tied_copy:
            return self.gpt.embedding.word_embeddings.weight
        return self.gpt.output_layer.weight

    # Tied embeddings over pipeline stages ------------------------------------------------------
    def _tied_weight(self) -> torch.Tensor | None:
        """This stage's member of the tied pair (the embedding on the first stage, its copy on the
        last), None on a middle stage or without the tie over stages."""
        if not self._tied_copy:
            return None
        if self.first_stage:
            return self.gpt.embedding.word_embeddings.weight
        return self.gpt.output_layer.weight if self.last_stage else None

    @torch.no_grad()
    def _sync_tied_copy(self) -> None:
        """Copy the first stage's embedding shard into the last stage's lm_head weight (Megatron's
        embedding group: the first and last stage of each pipeline)."""
        from megatron.core import parallel_state as ps

        weight = self._tied_weight()
        if weight is not None:
            group = ps.get_embedding_group()
            dist.broadcast(weight.data, src=dist.get_process_group_ranks(group)[0], group=group)

    def _allreduce_tied_grads(self) -> None:
        """Sum the gradients of the embedding and of its copy over the embedding group (what Megatron's
        finalize_model_grads does for a tied model): both then take the same optimizer step."""
        from megatron.core import parallel_state as ps

        weight = self._tied_weight()
        if weight is None:
            return
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=ps.get_embedding_group())

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
        to itself. One pipeline stage only (see `pipeline_forward_backward`)."""
        if self.pp_size > 1:
            raise RuntimeError("MegatronPolicy with pipeline_parallel_size > 1: no stage holds the whole model; "
                               "run forward and backward through pipeline_forward_backward")
        return self._stage_forward(input_ids, attention_mask, position_ids, None).transpose(0, 1)  # (B, T, C)

    def _stage_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       position_ids: torch.Tensor | None, hidden: torch.Tensor | None) -> torch.Tensor:
        """This stage's layers: (T, B, C) out, after the final norm on the last stage. The first stage
        embeds input_ids; a later one starts from `hidden` (T, B, C), the previous stage's output."""
        B, T = input_ids.shape
        device = input_ids.device
        if attention_mask is not None:
            if attention_mask.shape != (B, T):
                raise ValueError(f"attention_mask must be (B, T) = ({B}, {T}), got {tuple(attention_mask.shape)}")
            attention_mask = attention_mask.to(device=device, dtype=torch.bool)
        if self.numerics == "exact":
            return self._exact_stage_forward(input_ids, attention_mask, position_ids, hidden)
        self._last_mask = attention_mask  # (B, T) or None: the real tokens of load_balancing_loss
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

        return self._run_stage(input_ids, position_ids, mask, hidden)

    def _run_stage(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                   hidden: torch.Tensor | None) -> torch.Tensor:
        """This stage's embedding (first stage) and layers: (T, B, C). position_ids (B, T) give the RoPE
        angles (fp32, as `Decoder.forward_hidden` computes them); mask is Megatron's (True = masked)."""
        # RoPE angles per (token, sequence): Megatron applies cos/sin of these in fp32, cast to x's dtype
        freqs = position_ids[..., None].float() * self.rope_inv_freq.float()  # (B, T, D/2)
        rope = torch.cat((freqs, freqs), dim=-1).transpose(0, 1)[:, :, None, :]  # (T, B, 1, D)
        if self.first_stage:
            x = self.gpt.embedding(input_ids=input_ids, position_ids=position_ids)  # (T, B, C)
            if self.embed_grid is not None:  # as Decoder.embed_grid: embeddings on the bf16 grid
                x = x.to(self.embed_grid).to(x.dtype)
        else:
            x = hidden
            self.gpt.decoder.set_input_tensor(x)  # a later stage's TransformerBlock reads its input from here
        return self.gpt.decoder(hidden_states=x, attention_mask=mask, rotary_pos_emb=rope)  # (T, B, C), final norm

    def _exact_stage_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                             position_ids: torch.Tensor | None, hidden: torch.Tensor | None) -> torch.Tensor:
        """`_stage_forward` under exact numerics (`Decoder.forward_hidden`'s exact path): the batch-invariant
        attention attends slots 0..position of a row, so padded rows are shifted to start at slot 0
        (jetflow.model.attention.align_rows; every stage shifts alike, the first embeds the shifted tokens,
        the last shifts its output back) and every row's positions are arange(T)."""
        B, T = input_ids.shape
        device = input_ids.device
        arange = torch.arange(T, device=device).expand(B, T)
        if position_ids is not None and not torch.equal(position_ids.to(device), arange):
            raise ValueError("exact numerics need slot = position: position_ids must be arange(T) (pass an "
                             "attention_mask for padded rows, not position_ids)")
        back = None
        if attention_mask is not None:
            shift, back = align_rows(attention_mask)  # (B, T) each
            input_ids, attention_mask = input_ids.gather(1, shift), attention_mask.gather(1, shift)
        self._last_mask = attention_mask  # (B, T) in the aligned order the layers see (load_balancing_loss)
        y = self._run_stage(input_ids, arange, None, hidden)  # (T, B, C); the exact attention reads no mask
        return unalign_rows(y, back) if back is not None and self.last_stage else y

    def pipeline_forward_backward(self, inputs: list[tuple[torch.Tensor, torch.Tensor | None]],
                                  head: Callable[[int, torch.Tensor], tuple[torch.Tensor | None, Any]],
                                  forward_only: bool = False) -> list[Any]:
        """Forward (and backward) of micro-batches through the pipeline stages; head's results, in order,
        on every rank of the pipeline. A collective of the pipeline group: every stage calls it with
        the same micro-batches.

        inputs: per micro-batch (input_ids (b, T), attention_mask (b, T) or None), as `forward_hidden`.
        head(i, hidden (b, T, C)) runs on the last stage on micro-batch i's final hidden states and
        returns (loss, result): loss (a scalar, or None) is backpropagated through every stage unless
        forward_only; result (any picklable value: log-probs, metrics) reaches every stage. After the
        backward the tied-embedding gradients are summed over the embedding group; gradients are
        accumulated into `.grad` as by `loss.backward()`. One stage (pp = 1): the same, in-process.
        Raises NonFiniteError on every stage when an FP8 quantizer met NaN/Inf on any stage.
        """
        if self.pp_size == 1:
            results = []
            for i, (ids, mask) in enumerate(inputs):
                with torch.set_grad_enabled(not forward_only):
                    loss, result = head(i, self.forward_hidden(ids, attention_mask=mask))
                if loss is not None and not forward_only:
                    loss.backward()
                results.append(result)
            return results
        if not inputs:
            return []
        self._check_same_inputs(inputs)
        shapes = [(ids.shape[1], ids.shape[0], self.config.hidden_size) for ids, _ in inputs]
        device = self.rope_inv_freq.device
        return gpipe(len(inputs), shapes, lambda i, x: self._stage_forward(inputs[i][0], inputs[i][1], None, x),
                     head, group=self.pp_group, dtype=self.params_dtype, device=device, forward_only=forward_only,
                     finish_grads=self._allreduce_tied_grads)

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

    def _check_same_inputs(self, inputs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Every stage must run the same micro-batches (they hold the same data-parallel rank's rows):
        compare a checksum of the token ids and masks over the pipeline group, so that stages fed
        different batches fail loudly instead of training on a mix."""
        ids_sum = mask_sum = 0
        for ids, mask in inputs:
            weights = torch.arange(1, ids.numel() + 1, device=ids.device).view_as(ids)
            ids_sum += int((ids.long() * weights).sum())
            mask_sum += 0 if mask is None else int((mask.long() * weights).sum())
        mine = torch.tensor([len(inputs), ids_sum % 2**61, mask_sum % 2**61], dtype=torch.int64, device=self.rope_inv_freq.device)
        every = [torch.empty_like(mine) for _ in range(self.pp_size)]
        dist.all_gather(every, mine, group=self.pp_group)
        if any(not torch.equal(mine, other) for other in every):
            raise RuntimeError(f"pipeline stages were given different micro-batches (count, id and mask checksums "
                               f"per stage: {[o.tolist() for o in every]}); every stage of a pipeline must get the "
                               "same batch (the same data-parallel rank's rows)")

    # Weights and gradients (the ShardedPolicy protocol): weights.py and grads.py ------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.weights.hf_state_dict()

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.weights.load_hf_state_dict(state_dict)

    def quantized_weights(self) -> dict[str, QuantizedTensor]:
        return self.weights.quantized_weights()

    def grad_norm(self) -> torch.Tensor:
        return self.grads.grad_norm()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.grads.clip_grad_norm_(max_norm)

    def reduce_data_parallel_grads(self, dp) -> None:
        self.grads.reduce_data_parallel_grads(dp)

    def num_params(self) -> int:
        """Parameters of the full model (every TP shard and pipeline stage, not the vocabulary padding):
        `Decoder.num_params`."""
        return self._num_params

    def attach_kv_quantizer(self, quantizer):
        """Make every attention layer of this stage apply `quantizer` (a jetflow.precision.kv.KVQuantizer,
        or the bf16 mode's BF16KVRounding) to K and V after RoPE, as `attach_kv_quantizer` does on the
        native Decoder; returns the quantizer the run must drive (under TP or PP a ModelParallelKVQuantizer:
        its amax is max-reduced over the model-parallel group before new scales are set)."""
        if isinstance(quantizer, KVQuantizer) and self.mp_size > 1:
            quantizer = ModelParallelKVQuantizer(quantizer, self.mp_group, self.rope_inv_freq.device)
        for module in core_attention_modules(self.gpt):
            module.kv_quantizer = quantizer
        return quantizer

    # LoRA (model.lora): TP-split adapters on the linears (lora.py) ---------------------------------------
    def attach_lora(self, rank: int, alpha: float, targets: list[str] | tuple[str, ...], base_digest: str) -> None:
        """Zero adapters on the targeted linears, split over TP as lora.py says, and the base frozen (only the
        adapters require grad); fill them with `load_adapter_state_dict` (the native model's, drawn by
        jetflow.precision.lora.apply_lora). `base_digest`: the native frozen base's sha256 (base_digest of the
        Decoder it was made from, under the mode), which checkpoints keep. One stage, no expert parallelism."""
        if self.pp_size > 1 or self.ep_size > 1:
            raise ValueError("LoRA on the Megatron trainer: pipeline_parallel_size and expert_parallel_size must be 1")
        self._lora_names = attach_adapters(self._linears(), rank, alpha, targets)
        self._lora_base = base_digest
        for name, p in self.gpt.named_parameters():
            p.requires_grad_(is_adapter(name))
            self._global_names.setdefault(name, self._global_name(name))
        split = {self._global_names[n] for n in split_adapter_names(self.gpt.named_parameters(), self._linears())}
        self.weights.split_adapters = self.grads.split_adapters = split
        self._num_params = self.weights.count_params(self.padded_vocab)

    def drop_frozen_masters(self) -> None:
        """model.lora under unified, once the first weight update has shipped the frozen base: each FP8 linear
        keeps its bytes and scales alone, as the reference policy's do (`freeze_quantized`), and its fp32 master
        weight goes. The bytes are those it computed with (quantized once from the master, as the native base's
        are), the backward's dgrad reads them, and nothing later reads the master: the next updates, the
        checkpoints and the exports carry the adapters, and a resume or an export rebuilds the base."""
        for linear in self._linears():
            if linear.recipe is not None:
                linear.freeze_quantized()

    def lora_names(self) -> list[str]:
        """The HF names of the adapted linears."""
        return list(getattr(self, "_lora_names", []))

    def lora_base_digest(self) -> str:
        return self._lora_base

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapters whole in the native names (`<HF linear>.lora.A`): a collective of the TP group."""
        return full_adapters(self._linears())

    def load_adapter_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        load_full_adapters(self._linears(), tensors)

    # Mixture of experts --------------------------------------------------------------------------
    @property
    def collective_forward(self) -> bool:
        """True when a forward is a collective of several ranks that hold different data (the token
        dispatch over the expert-parallel group): every rank must run every micro-batch, even one
        without response tokens."""
        return self.ep_size > 1

    def load_balancing_loss(self) -> torch.Tensor | None:
        """`jetflow.model.moe.load_balancing_loss` of the last forward (this rank's tokens, padding left
        out), what the native model's `model_load_balancing_loss` gives; None for a dense model.
        One pipeline stage only (the routers of other stages are not here)."""
        from jetflow.model.moe import load_balancing_loss

        routers = [r for r in router_modules(self.gpt) if r.last_logits is not None]
        if not routers:
            return None
        if self.pp_size > 1:
            raise RuntimeError("the router load-balancing loss with pipeline_parallel_size > 1 is not supported; "
                               "set algo.router_aux_loss_coef=0")
        logits = [r.last_logits.transpose(0, 1).reshape(-1, self.config.num_experts) for r in routers]  # (B*T, E)
        return load_balancing_loss(logits, self.config.num_experts, self.config.num_experts_per_tok,
                                   attention_mask=self._last_mask)
