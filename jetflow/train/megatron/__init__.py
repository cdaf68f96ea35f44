"""Megatron-Core trainer model (`train.backend=megatron`): a GPTModel whose linear layers are jetflow's.

    policy = MegatronPolicy.from_decoder(decoder, kind="fp8", recipe=recipe, tensor_parallel_size=2)
    hidden = policy.forward_hidden(input_ids, attention_mask=mask)   # (B, T, C)
    logits = policy.lm_head(hidden)                                  # (B, T, V), gathered over TP
    Trainer(policy, cfg.train, cfg.algo)                             # trains it unchanged
    policy.hf_state_dict(); policy.quantized_weights()                # what sync ships to rollout

What is Megatron's and what is jetflow's:
- Megatron-Core builds the model (GPTModel, TransformerBlock, SelfAttention, MLP, VocabParallelEmbedding),
  owns the tensor-parallel layout of every parameter and the TP collectives.
- Every linear layer is a `ColumnParallelLinear` / `RowParallelLinear` subclass whose local GEMM is
  jetflow's: `F.linear` (fp32), `jetflow.precision.bf16_linear` (bf16) or `jetflow.precision.fp8_linear`
  (fp8: FP8 fprop, dgrad and wgrad with the recipe's quantizer, the one the native Decoder and the
  rollout engine use). Norms are the native Decoder's RMSNorm; RoPE tables come from the native
  `rope_inv_freq` (Llama-3 scaling included) and positions from the attention mask, so left padding
  behaves exactly as in `Decoder.forward_hidden`.

Exact numerics (`numerics="exact"`, what `precision.numerics=auto` resolves to with train.backend=megatron):
the trainer computes every token's row with the native exact model's functions, so its log-probs equal
the native rollout engine's bit for bit at TP = 1, 2, 4, PP and EP:
- every linear is `jetflow.precision.exact.exact_linear` (the canonical GEMM, bias and bf16 rounding in
  its epilogue); a row-parallel layer computes its tree_width(K) / TP canonical groups and combines the
  TP ranks' partials by all_gather + the same pairwise tree, in rank order (reduce.py), not an
  all-reduce; a K that TP cannot split into whole groups is refused (checks.check_exact_tp_split);
- attention is jetflow's batch-invariant kernel as Megatron's `core_attention` (attention.py) on rows
  realigned so that slot = position (the native exact trainer's realignment), SiLU is `silu_exact`;
- an MoE layer routes as the native exact block and sums a token's k expert outputs in slot order
  whichever EP ranks computed them (moe.py).
Megatron's unfused RoPE (`x * cos + rotate_half(x) * sin`), the residual adds and the vocab-parallel
embedding (a sum with zeros) are the native operations already. Only the forward is exact: the backward
is torch's (fp32 / bf16) or the recipe's FP8 dgrad / wgrad, as in the native trainer.

Same bytes as the native model under FP8. Megatron fuses q/k/v into `linear_qkv` (interleaved per
KV group) and gate/up into `linear_fc1`. Quantizing a fused weight in 128x128 blocks would mix rows of
different HF matrices in one block, so the FP8 path quantizes each HF sub-matrix ("segment": q, k, v,
gate, up) of the local shard separately and runs one FP8 GEMM per segment. With tensor parallelism a
shard must cover whole blocks (out_features / tp a multiple of 128 for column-parallel layers,
in_features / tp for row-parallel ones); then each rank quantizes exactly the blocks of the full HF
weight, and `quantized_weights()` gathers bytes equal to the native model's.

Megatron-Core is imported lazily, only inside this package (`pip install megatron-core==0.16.1`). On the
CPU two of its calls assume CUDA; `patch_megatron_for_cpu()` replaces them (see its docstring).

Pipeline parallelism (pipeline_parallel_size > 1): Megatron splits the layers over stages (the first
also holds the embedding, the last the final norm and lm_head; a tied lm_head is a copy of the
embedding kept equal over Megatron's embedding group). The Trainer runs a step's micro-batches through
`MegatronPolicy.pipeline_forward_backward`, a GPipe schedule of jetflow's (pipeline.py says why not
Megatron's on the CPU); log-probs, metrics, weights and FP8 bytes reach every rank.

Mixture of experts (Qwen3-MoE, Mixtral; moe.py): a sparse layer is Megatron-Core's MoELayer
(TopKRouter, all-gather token dispatcher, SequentialMLP), configured to route as transformers does
(model._moe_fields: softmax top-k, renormalized through `moe_router_pre_softmax=False` when
norm_topk_prob, no token dropping, no Megatron aux loss). The router's GEMM is the native router's
(fp32, or bf16 where the FP8 recipe keeps routers); each expert's linear_fc1 / linear_fc2 are jetflow's
linears, so under FP8 each expert's gate, up and down are quantized separately: `quantized_weights()`
gives the native model's bytes. The routing weight scales the expert's output (as natively), not its
activation. `load_balancing_loss()` is jetflow's router aux loss over this rank's tokens; the Trainer
uses it.

Expert parallelism (expert_parallel_size = EP > 1, TP = 1): Megatron's expert-parallel groups split
the data-parallel ranks of a stage; each rank holds num_experts / EP experts and its own data. The
dispatcher all-gathers the EP group's tokens, runs each local expert once per source rank (so FP8 wgrad
groups hold the tokens they hold without EP) and reduce-scatters the outputs. Expert gradients are
summed over the expert-data-parallel group, the rest over the data-parallel group
(`reduce_data_parallel_grads`, called by the Trainer); the gradient norm adds every expert's squares
once, in the one-process order; `hf_state_dict()` / `quantized_weights()` gather every expert. Every
rank must run every micro-batch (the dispatch is a collective): the Trainer runs one without response
tokens with loss weight 0 (`collective_forward`).

Megatron-Core 0.16.1 calls that do not run on the CPU (gloo, a CPU build of torch) and what replaces them:
  - transformer/moe/router.py:88-92 `Router.gating` moves the router weight to
    `torch.cuda.current_device()`: `JetflowTopKRouter.gating` (jetflow's GEMM) replaces it.
  - tensor_parallel/mappings.py:141,148,181 `_gather_along_first_dim` / `_reduce_scatter_along_first_dim`
    (the all-gather dispatcher's collectives) allocate on CUDA, and mappings.py:182,193 call
    reduce_scatter, which gloo lacks; both also assume equal token counts on every rank:
    `JetflowAllGatherTokenDispatcher` gathers padded rows and reduce-scatters as all-reduce + slice.
  - the all-to-all dispatcher is not used: token_dispatcher.py:445 creates a `torch.cuda.Stream()` in its
    constructor, token_dispatcher.py:871-899 syncs split sizes on CUDA streams, mappings.py:442 allocates
    the all-to-all output on CUDA.
  - transformer/moe/moe_layer.py:379-383 refuses MoE training with TP > 1 without sequence parallelism,
    which jetflow's linears do not have: MoE models run with TP = 1 (checks.check_supported says so).

Not supported: sequence parallelism, virtual (interleaved) pipeline stages, uneven stage splits, fewer
KV heads than TP ranks, o_proj bias without MLP bias (or the reverse); MoE with TP > 1, shared experts,
expert biases, routing replay (train.backend=native), the router aux loss under PP > 1.
Shapes: B batch, T tokens, C hidden, V vocab, G KV groups, D head dim, I intermediate size, E experts.

Modules (each imports only from those listed above it):
- deps.py      INSTALL_HINT, MegatronConfigError, the lazy Megatron-Core gate, Megatron on the CPU
- checks.py    checks of a ModelConfig against the TP x PP x EP layout (pure; also run by the pre-run pass)
- sharding.py  HF <-> Megatron names, TP shards and EP expert shards of the weights (pure tensor functions)
- reduce.py    the exact row-parallel combine over TP ranks (all_gather + tree_sum)
- lora.py      model.lora: TP-split adapters (A / B split as their linear's TP split), added after the base in the
               native order, gathered whole for sync and checkpoints
- linear.py    Megatron's parallel linears with jetflow's GEMMs (Segment, per-segment FP8, exact_linear)
- attention.py the exact core attention, the FP8 K/V quantizer hooks, the slot = position row alignment
- moe.py       Megatron's MoE layer with jetflow's router GEMM, experts and a CPU-capable dispatcher
- parallel.py  torch.distributed and Megatron's process groups (TP, PP, DP, EP), a rank's ParallelLayout,
               the TP gather of logits
- pipeline.py  the GPipe schedule over stage-to-stage send/recv, the gather over pipeline stages
- weights.py   ShardedWeights: the HF-named weights, FP8 bytes and parameter count over a ParallelLayout
- grads.py     ShardedGrads: the gradient norm, clipping and data-parallel reductions over a ParallelLayout
- model.py     TransformerConfig and the layer spec (jetflow's linears, RMSNorm and core attention)
- policy.py    MegatronPolicy, the trainer's model: builds the GPTModel and hands the weights and gradients
               to a ShardedWeights and a ShardedGrads
"""

from .checks import check_fp8_tp_alignment, check_layout, check_supported, padded_vocab_size, segment_kind
from .deps import INSTALL_HINT, MegatronConfigError, patch_megatron_for_cpu
from .linear import Segment
from .model import MegatronRMSNorm
from . import moe
from .parallel import initialize_parallel
from .policy import MegatronPolicy
from .sharding import hf_to_megatron, is_expert_param, megatron_to_hf, tensor_parallel_dims

__all__ = [
    "INSTALL_HINT", "MegatronConfigError", "MegatronPolicy", "MegatronRMSNorm", "Segment", "check_fp8_tp_alignment",
    "check_layout", "check_supported", "hf_to_megatron", "initialize_parallel", "is_expert_param", "megatron_to_hf", "moe",
    "padded_vocab_size",
    "patch_megatron_for_cpu", "segment_kind", "tensor_parallel_dims",
]
