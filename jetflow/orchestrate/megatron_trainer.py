"""The trainer model of a local run on Megatron-Core (`train.backend=megatron`).

`build_trainer_model(cfg, decoder)` returns what jetflow's `Trainer` trains: the native Decoder under
the precision mode (`train.backend=native`), or a `jetflow.train.megatron.MegatronPolicy` holding the
Decoder's weights (`train.backend=megatron`). The policy has the Decoder's trainer interface
(`forward_hidden`, `lm_head`, `parameters`, `config`, `num_params`), so the same Trainer, loss,
micro-batching and RL loop run unchanged; what differs goes through duck-typed hooks:
  - gradient clipping: `MegatronPolicy.clip_grad_norm_` (the global norm over the TP group), used by
    `Trainer` when the model has one;
  - weight sync: `hf_state_dict()` (HF names, TP shards gathered) and `quantized_weights()` (the FP8
    bytes of its linears, per HF module) used by `jetflow.sync.build_update`;
  - checkpoints and the rollout side's copy: HF-named weights (`hf_state_dict` / `load_hf_state_dict`),
    so a checkpoint is the same file whichever backend wrote it.

Parallelism: one process runs TP=1 (a gloo world of size 1). Under `torchrun --nproc_per_node N` with
`train.tensor_parallel_size=T`, Megatron splits the world into TP groups of T ranks and N / T data-
parallel ranks: losses and gradients are summed over Megatron's data-parallel group only
(`model_data_parallel`), every rank runs its own rollout engine on its DP rank's prompts, and world rank
0 writes the checkpoint after all ranks gathered the weights; the optimizer state of every TP shard
goes into it (`gather_trainer_state`). Pipeline parallelism is not implemented (refused).
"""

from __future__ import annotations

import importlib.util
import os

from jetflow.config import Config, ConfigError
from jetflow.model import Decoder


def check_megatron(cfg: Config, world: int | None = None) -> None:
    """Refuse parallel layouts and options the Megatron backend does not run, before anything is built.
    `world`: the trainer's process count (default: torchrun's WORLD_SIZE)."""
    t = cfg.train
    if t.tensor_parallel_size < 1 or t.pipeline_parallel_size < 1:
        raise ConfigError(f"train.tensor_parallel_size={t.tensor_parallel_size} and train.pipeline_parallel_size="
                          f"{t.pipeline_parallel_size} must be >= 1")
    if t.backend != "megatron":
        if t.tensor_parallel_size != 1 or t.pipeline_parallel_size != 1:
            raise ConfigError(f"train.tensor_parallel_size={t.tensor_parallel_size} / pipeline_parallel_size="
                              f"{t.pipeline_parallel_size}: model parallelism needs train.backend=megatron")
        return
    if t.pipeline_parallel_size != 1:
        raise ConfigError(f"train.pipeline_parallel_size={t.pipeline_parallel_size}: pipeline parallelism is not "
                          "implemented on the Megatron backend (jetflow's Trainer drives forward and backward itself; "
                          "PP needs Megatron's pipeline schedule to own that loop); use train.pipeline_parallel_size=1")
    if cfg.precision.kv_cache_fp8:
        raise ConfigError("precision.kv_cache_fp8=true with train.backend=megatron is not supported: the trainer-side "
                          "K/V quantizer hooks the native Decoder's attention; use train.backend=native")
    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    if world % t.tensor_parallel_size:
        raise ConfigError(f"train.tensor_parallel_size={t.tensor_parallel_size} needs a multiple of that many "
                          f"processes, this run has {world}: launch with `torchrun --nproc_per_node "
                          f"{t.tensor_parallel_size} -m jetflow.cli train ...` (or launch/torchrun.sh), or under "
                          f"run.orchestrator=ray set train.num_workers to a multiple of it")
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        from jetflow.train.megatron import INSTALL_HINT
        raise ConfigError(f"train.backend=megatron needs Megatron-Core, which is not installed: {INSTALL_HINT}")


def build_megatron_policy(cfg: Config, decoder: Decoder):
    """A MegatronPolicy with `decoder`'s config and weights, its linears under the precision mode."""
    from jetflow.train.megatron import MegatronConfigError, MegatronPolicy

    from jetflow.orchestrate.build import embedding_grid
    kind = cfg.precision.precision_mode.trainer_kind
    try:
        policy = MegatronPolicy.from_decoder(
            decoder, kind=kind, recipe=cfg.precision.recipe(),
            gemm_backend=cfg.precision.gemm_backend, tensor_parallel_size=cfg.train.tensor_parallel_size,
            pipeline_parallel_size=cfg.train.pipeline_parallel_size, seed=cfg.run.seed)
    except MegatronConfigError as e:
        raise ConfigError(f"train.backend=megatron: {e}") from None
    policy.embed_grid = embedding_grid(kind)
    return policy


def build_trainer_model(cfg: Config, decoder: Decoder):
    """What the Trainer trains: `decoder` under the precision mode, or a MegatronPolicy of it."""
    if cfg.train.backend == "megatron":
        return build_megatron_policy(cfg, decoder)
    from jetflow.orchestrate.build import apply_mode
    return apply_mode(decoder, cfg, "trainer")


def model_data_parallel(model, dp):
    """The data-parallel view for a tensor-parallel MegatronPolicy: the ranks of one TP group hold the
    same data and different shards, so losses and gradients are summed over Megatron's data-parallel
    group only (world / TP ranks). Any other model: `dp` itself."""
    if getattr(model, "tp_size", 1) == 1:
        return dp
    from megatron.core import parallel_state as ps
    return dp.within(ps.get_data_parallel_group(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())


def gather_trainer_state(model, state: dict) -> dict | None:
    """Optimizer state is per TP shard: gather every TP rank's to TP rank 0 (None elsewhere), so one
    checkpoint file holds all of them; `select_trainer_state` picks a rank's own on resume."""
    if getattr(model, "tp_size", 1) == 1:
        return state
    import torch.distributed as dist
    states = [None] * model.tp_size if model.tp_rank == 0 else None
    dist.gather_object(state, states, group_dst=0, group=model.tp_group)
    return {"tp_states": states} if model.tp_rank == 0 else None


def select_trainer_state(model, saved: dict) -> dict:
    if "tp_states" not in saved:
        return saved
    states = saved["tp_states"]
    if len(states) != getattr(model, "tp_size", 1):
        raise ConfigError(f"checkpoint holds optimizer state for {len(states)} tensor-parallel ranks, this run has "
                          f"train.tensor_parallel_size={getattr(model, 'tp_size', 1)}")
    return states[model.tp_rank]
