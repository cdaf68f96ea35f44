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

Not supported: sequence parallelism, virtual (interleaved) pipeline stages, uneven stage splits, fewer
KV heads than TP ranks, o_proj bias without MLP bias (or the reverse).
Shapes: B batch, T tokens, C hidden, V vocab, G KV groups, D head dim, I intermediate size.

Modules (each imports only from those listed above it):
- deps.py      INSTALL_HINT, MegatronConfigError, the lazy Megatron-Core gate, Megatron on the CPU
- checks.py    checks of a ModelConfig against the TP layout (pure)
- sharding.py  HF <-> Megatron names and TP shards of the weights (pure tensor functions)
- linear.py    Megatron's parallel linears with jetflow's GEMMs (Segment, per-segment FP8)
- parallel.py  torch.distributed and Megatron's process groups, the TP gather of logits
- pipeline.py  the GPipe schedule over stage-to-stage send/recv, the gather over pipeline stages
- model.py     TransformerConfig and the layer spec (jetflow's linears and RMSNorm)
- policy.py    MegatronPolicy, the trainer's model
"""

from .checks import check_fp8_tp_alignment, check_supported, padded_vocab_size, segment_kind
from .deps import INSTALL_HINT, MegatronConfigError, patch_megatron_for_cpu
from .linear import Segment
from .model import MegatronRMSNorm
from .parallel import initialize_parallel
from .policy import MegatronPolicy
from .sharding import hf_to_megatron, megatron_to_hf, tensor_parallel_dims

__all__ = [
    "INSTALL_HINT", "MegatronConfigError", "MegatronPolicy", "MegatronRMSNorm", "Segment", "check_fp8_tp_alignment",
    "check_supported", "hf_to_megatron", "initialize_parallel", "megatron_to_hf", "padded_vocab_size",
    "patch_megatron_for_cpu", "segment_kind", "tensor_parallel_dims",
]
