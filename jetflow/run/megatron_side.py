"""The trainer model of a local run on Megatron-Core (`train.backend=megatron`).

`build_trainer_model(cfg, derived, decoder, kv)` returns what jetflow's `Trainer` trains (and the K/V
quantizer it drives): the native Decoder under the precision mode (`train.backend=native`), or a
`jetflow.train.megatron.MegatronPolicy` holding the Decoder's weights (`train.backend=megatron`). The
policy has the Decoder's trainer interface (`forward_hidden`, `lm_head`, `parameters`, `config`,
`num_params`), so the same Trainer, loss, micro-batching and RL loop run unchanged; what differs goes
through the `ShardedPolicy` protocol (jetflow.model.protocol), which the Trainer, sync and checkpoints
ask for by isinstance:
  - gradient clipping: `MegatronPolicy.clip_grad_norm_` (the global norm over the TP group);
  - weight sync: `hf_state_dict()` (HF names, TP shards gathered) and `quantized_weights()` (the FP8
    bytes of its linears, per HF module) used by `jetflow.sync.build_update`;
  - checkpoints and the rollout side's copy: HF-named weights (`hf_state_dict` / `load_hf_state_dict`),
    so a checkpoint is the same file whichever backend wrote it.

Parallelism: one process runs TP=1 (a gloo world of size 1). Under `torchrun --nproc_per_node N` with
`train.tensor_parallel_size=T`, Megatron splits the world into TP groups of T ranks and N / T data-
parallel ranks: losses and gradients are summed over Megatron's data-parallel group only
(`model_data_parallel`), every rank runs its own rollout engine on its DP rank's prompts, and world rank
0 writes the checkpoint after all ranks gathered the weights; the optimizer state of every TP shard
goes into it (`gather_trainer_state`). With `train.pipeline_parallel_size=P` the ranks that share one
model are a TP x PP group (`model_parallel_size`): it replaces the TP group in both places, and the
Trainer hands its micro-batches to the policy's pipeline schedule (jetflow.train.megatron.pipeline).
With `train.expert_parallel_size=E` (MoE models) the data-parallel ranks of one stage are split into
groups of E that share their experts (each holds num_experts / E): the data-parallel view is unchanged,
and the policy sums expert gradients over Megatron's expert-data-parallel group instead
(`MegatronPolicy.reduce_data_parallel_grads`, called by the Trainer).
"""

from __future__ import annotations


from jetflow.config import Config, Derived
from jetflow.model import CheckpointError, Decoder
from jetflow.model.protocol import model_parallel_size, state_parts
from jetflow.precision.kv import KVQuantizer
from jetflow.precision.lora import adapter_parameters, base_digest
from jetflow.run.build import apply_mode, embedding_grid, kv_rounding, with_lora



def build_megatron_policy(cfg: Config, derived: Derived, decoder: Decoder, kv: KVQuantizer | None = None):
    """(a MegatronPolicy with `decoder`'s config and weights, the K/V quantizer it drives): its linears
    under the precision mode, its forward under the run's numerics (exact: the native engine's functions,
    so the rollout's log-probs equal the trainer's bit for bit at any TP / PP / EP layout the checks
    accept), and on K/V `kv` or else the mode's rounding (under TP or PP the quantizer it drives wraps
    `kv`: its amax is reduced over the model-parallel group)."""
    from jetflow.train.megatron import MegatronPolicy

    precision = derived.precision  # the layout was checked against the model (jetflow.run.validate)
    policy = MegatronPolicy.from_decoder(
        decoder, kind=precision.trainer_kind, recipe=precision.recipe,
        gemm_backend=precision.gemm_backend, tensor_parallel_size=cfg.train.tensor_parallel_size,
        pipeline_parallel_size=cfg.train.pipeline_parallel_size,
        expert_parallel_size=cfg.train.expert_parallel_size, seed=cfg.run.seed, numerics=precision.numerics,
        embed_grid=embedding_grid(precision.trainer_kind))
    if cfg.model.lora.rank:
        attach_megatron_lora(policy, cfg, derived, decoder)
    driven = policy.attach_kv_quantizer(kv if kv is not None else kv_rounding(precision.mode))
    return policy, (driven if kv is not None else None)


def attach_megatron_lora(policy, cfg: Config, derived: Derived, decoder: Decoder) -> None:
    """model.lora on a MegatronPolicy made from `decoder`: its TP-split adapters (jetflow.train.megatron.lora)
    filled with the native trainer's (`decoder` under the mode with with_lora: A drawn from run.seed, B zeros),
    and the native frozen base's sha256 (jetflow.precision.lora.base_digest) kept by the policy for the
    checkpoints (`lora_base_digest`), so that a resume and the final export (which rebuild the native base) compare the same
    digest. `decoder` is changed in place (its precision, adapters and frozen base) and then not used."""
    native = with_lora(apply_mode(decoder, derived.precision, "trainer"), cfg, "trainer")
    lora = cfg.model.lora
    policy.attach_lora(lora.rank, lora.alpha, lora.targets, base_digest(native))
    policy.load_adapter_state_dict({k: v.detach() for k, v in adapter_parameters(native).items()})


def build_trainer_model(cfg: Config, derived: Derived, decoder: Decoder, kv: KVQuantizer | None = None):
    """(what the Trainer trains, the K/V quantizer the run drives or None): `decoder` under the precision
    mode, a MegatronPolicy of it, or (fsdp) it sharded over the data-parallel ranks (jetflow.train.fsdp);
    `kv`: the trainer's FP8 K/V quantizer (Precision.kv_quantizer), None for the mode's own K/V rounding.

    fsdp with model.lora: nothing is sharded. Every rank builds the whole frozen base from the model source
    (loads_whole_policy) and holds the adapters whole; the Trainer sums their gradients over the ranks
    (Decoder.reduce_data_parallel_grads: one all-reduce, each rank's loss already its share of the global
    batch's, as FSDP's reduce-scatter sums) and clips by their norm: the replicated data-parallel trainer.
    What FSDP shards is the trainer's fp32 master weights, gradients and AdamW moments (16 bytes a
    parameter); under LoRA only the adapters have those, and the frozen base is what the forward reads
    (1 byte a weight for unified's FP8 linears), so sharding it would save little and cost an all-gather
    of every layer per forward and backward."""
    if cfg.train.backend == "megatron":
        return build_megatron_policy(cfg, derived, decoder, kv)
    model = with_lora(apply_mode(decoder, derived.precision, "trainer", kv), cfg, "trainer")  # model.lora
    if cfg.train.backend == "fsdp" and not cfg.model.lora.rank:
        from jetflow.train.fsdp import FSDPPolicy
        return FSDPPolicy(model, cfg.model.device, cfg.train.data_parallel_shard_size), kv
    return model, kv


def model_data_parallel(model, dp):
    """The data-parallel view for a model-parallel MegatronPolicy: the ranks of one TP x PP group hold the
    same data and different parts of the model, so losses and gradients are summed over Megatron's
    data-parallel group only (world / (TP x PP) ranks). Any other model: `dp` itself."""
    if model_parallel_size(model) == 1:
        return dp
    from jetflow.train.megatron.parallel import data_parallel_group
    return dp.within(*data_parallel_group())


def gather_trainer_state(model, state: dict) -> dict | None:
    """Optimizer state is per model part (TP shard, PP stage, EP rank's experts): gather every part's to
    the group's rank 0 (None elsewhere), so one checkpoint file holds all of them; `select_trainer_state`
    picks a rank's own on resume. (The key keeps its name: with TP alone the group is the TP group, and
    checkpoints written before pipeline parallelism still load.)"""
    if state_parts(model) == 1:
        return state
    import torch.distributed as dist
    states = [None] * model.state_size if model.state_rank == 0 else None
    dist.gather_object(state, states, group_dst=0, group=model.state_group)
    return {"tp_states": states} if model.state_rank == 0 else None


def select_trainer_state(model, saved: dict) -> dict:
    if "tp_states" not in saved:
        return saved
    states = saved["tp_states"]
    if len(states) != state_parts(model):
        raise CheckpointError(f"checkpoint holds optimizer state for {len(states)} model parts, this run has "
                          f"{state_parts(model)} (train.tensor_parallel_size x pipeline_parallel_size x "
                          "expert_parallel_size)")
    return states[model.state_rank]
