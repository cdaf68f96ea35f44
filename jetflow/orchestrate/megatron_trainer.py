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

Parallelism: one process runs TP=1 (a gloo world of size 1); under torchrun each process is a
data-parallel rank (jetflow.distributed) holding a whole TP=1 policy. `train.tensor_parallel_size > 1`
is refused by `check_megatron` for now: the trainer side is ready (the policy's TP shards,
`clip_grad_norm_` over the TP group, `hf_state_dict` / `quantized_weights` gathering the shards), but
the data-parallel ranks of `jetflow train` would first have to span Megatron's DP group (world / TP)
instead of the whole world. Pipeline parallelism is not implemented (refused too).
"""

from __future__ import annotations

import importlib.util

from jetflow.config import Config, ConfigError
from jetflow.model import Decoder

# The GEMM kind of the trainer's linears per precision mode (as jetflow.orchestrate.build.TRAINER_KIND).
MEGATRON_KIND = {"fp32": "fp32", "bf16": "bf16", "mixed": "bf16", "unified": "fp8"}


def check_megatron(cfg: Config) -> None:
    """Refuse parallel layouts and options the Megatron backend does not run, before anything is built."""
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
    if t.tensor_parallel_size > 1:
        raise ConfigError(
            f"train.tensor_parallel_size={t.tensor_parallel_size}: tensor parallelism is not wired into "
            "`jetflow train` yet. The trainer side supports it (MegatronPolicy shards, TP-aware gradient "
            "clipping, HF weights gathered for sync and checkpoints; tests/integration/test_megatron_tp.py), but "
            "`jetflow train` under torchrun treats every process as a data-parallel rank (jetflow.distributed), "
            "which would sum the gradients of different TP shards; use train.tensor_parallel_size=1 (and torchrun "
            "for data parallelism)")
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        from jetflow.train.megatron import INSTALL_HINT
        raise ConfigError(f"train.backend=megatron needs Megatron-Core, which is not installed: {INSTALL_HINT}")


def build_megatron_policy(cfg: Config, decoder: Decoder):
    """A MegatronPolicy with `decoder`'s config and weights, its linears under the precision mode."""
    from jetflow.train.megatron import MegatronConfigError, MegatronPolicy

    from jetflow.orchestrate.build import TRAINER_KIND, embedding_grid
    try:
        policy = MegatronPolicy.from_decoder(
            decoder, kind=MEGATRON_KIND[cfg.precision.mode], recipe=cfg.precision.recipe(),
            gemm_backend=cfg.precision.gemm_backend, tensor_parallel_size=cfg.train.tensor_parallel_size,
            pipeline_parallel_size=cfg.train.pipeline_parallel_size, seed=cfg.run.seed)
    except MegatronConfigError as e:
        raise ConfigError(f"train.backend=megatron: {e}") from None
    policy.embed_grid = embedding_grid(TRAINER_KIND[cfg.precision.mode])
    return policy


def build_trainer_model(cfg: Config, decoder: Decoder):
    """What the Trainer trains: `decoder` under the precision mode, or a MegatronPolicy of it."""
    if cfg.train.backend == "megatron":
        return build_megatron_policy(cfg, decoder)
    from jetflow.orchestrate.build import apply_mode
    return apply_mode(decoder, cfg, "trainer")
