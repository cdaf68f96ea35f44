"""The pre-run checks of the features built for some placements and backends only (part of the one pre-run
pass, jetflow.run.validate): multi-turn rollouts, asynchronous rollouts (rollout.max_staleness) and LoRA
(model.lora). Each refuses what is not built with one line (ConfigError) that names the key and what to use."""

from __future__ import annotations

import torch

from jetflow.config import Config, ConfigError, Derived, config_value
from jetflow.model import Decoder
from jetflow.precision.lora import lora_targets, unmatched_targets


def check_turns(cfg: Config) -> None:
    """Multi-turn rollouts: a custom task that has something to answer the model (tools or an environment)."""
    r, params = cfg.rollout, cfg.task.params
    talks = cfg.task.name == "custom" and bool(params.get("tools") or params.get("env"))
    if r.max_turns > 1 and not talks:
        raise ConfigError(f"rollout.max_turns={r.max_turns}: a multi-turn rollout needs something to answer the model "
                          "between turns: task.name=custom with task.params.tools or task.params.env (README: Your own "
                          "task); or rollout.max_turns=1")
    if talks and r.max_turns == 1:
        key = "tools" if params.get("tools") else "env"
        raise ConfigError(f"task.params.{key} answers the model between turns, and rollout.max_turns=1 gives it one "
                          "turn; set rollout.max_turns (for example 4)")
    if r.max_turns > 1 and cfg.run.orchestrator != "local":
        raise ConfigError(f"run.orchestrator={cfg.run.orchestrator} with rollout.max_turns={r.max_turns}: multi-turn "
                          "rollouts run in the trainer's process today (native or vLLM engine); use run.orchestrator=local")
    if r.max_turns > 1 and cfg.algo.routing_replay:
        raise ConfigError("algo.routing_replay=true with rollout.max_turns > 1: routing replay is not built for "
                          "multi-turn rollouts; set algo.routing_replay=false")
    if r.max_turns > 1 and r.max_total_tokens and r.max_total_tokens <= r.max_new_tokens:
        raise ConfigError(f"rollout.max_total_tokens={r.max_total_tokens} holds a conversation's prompt, turns and "
                          f"observations: it must exceed rollout.max_new_tokens={r.max_new_tokens} (a turn)")


def check_staleness(cfg: Config) -> None:
    """Asynchronous rollouts (rollout.max_staleness > 0, jetflow.run.ahead): what they are built for today."""
    k, inflight = cfg.rollout.max_staleness, cfg.rollout.inflight_updates
    if inflight != "off" and not k:
        raise ConfigError(f"rollout.inflight_updates={inflight} needs rollout.max_staleness > 0 (a batch generated "
                          "while the trainer trains); set rollout.max_staleness=1 or rollout.inflight_updates=off")
    if not k:
        return
    check_inflight(cfg)
    if cfg.rollout.backend != "native":
        raise ConfigError(f"rollout.max_staleness={k} with rollout.backend={cfg.rollout.backend}: asynchronous rollouts "
                          "run jetflow's native engine today (in a process beside the trainer, or as Ray actors); use "
                          "rollout.backend=native or rollout.max_staleness=0")
    ray_not_built: tuple[tuple[str, object, object, str], ...] = (
        ("rollout.inflight_updates", inflight, "off", "a Ray engine actor takes an update between batches"),
        ("rollout.split_mismatch", cfg.rollout.split_mismatch, False, "the split's rescoring runs in the trainer's "
         "process"))
    for name, value, off, why in ray_not_built if cfg.run.orchestrator == "ray" else ():
        if value != off:
            raise ConfigError(f"rollout.max_staleness={k} with run.orchestrator=ray and {name}={value}: not built "
                              f"({why}); set {name}={off} or run.orchestrator=local")
    if cfg.algo.dynamic_sampling:
        raise ConfigError(f"rollout.max_staleness={k} with algo.dynamic_sampling=true: the refill rounds need the step's "
                          "own weights (a synchronous rollout); set one of them off")
    split_needs: tuple[tuple[str, object, object], ...] = (
        ("model.lora.rank", cfg.model.lora.rank, 0), ("precision.kv_cache_fp8", cfg.precision.kv_cache_fp8, False))
    for name, setting, off in split_needs if cfg.rollout.split_mismatch else ():
        if setting != off:  # jetflow.run.staleness_split keeps whole updates without K/V scales only
            raise ConfigError(f"rollout.split_mismatch=true with {name}={setting}: the split rescoring keeps the whole "
                              f"model's weight updates without FP8 K/V scales, which this run does not send; set "
                              f"rollout.split_mismatch=false or {name}={off}")



def check_inflight(cfg: Config) -> None:
    """In-flight weight updates (rollout.inflight_updates, jetflow.run.inflight): what they are built for today."""
    inflight = cfg.rollout.inflight_updates
    not_built = (("rollout.split_mismatch", cfg.rollout.split_mismatch, False, "the split rescores a batch under one "
                  "version"), ("rollout.max_turns", cfg.rollout.max_turns, 1, "a conversation's turns are not swapped"),
                 ("algo.routing_replay", cfg.algo.routing_replay, False, "the routing of a swapped prefix is not kept"),
                 ("precision.kv_cache_fp8", cfg.precision.kv_cache_fp8, False, "an update's new K/V scales would not "
                  "match the pages"))
    for name, setting, off, why in not_built if inflight != "off" else ():
        if setting != off:
            raise ConfigError(f"rollout.inflight_updates={inflight} with {name}={setting}: not built ({why}); set "
                              f"rollout.inflight_updates=off or {name}={off}")


LORA_BUILT = (("run.orchestrator", "local"), ("algo.kl_coef", 0.0), ("algo.log_ref_kl", False))
"""What LoRA runs with today (model.lora.rank > 0): each key's one value (rollout.backend: native, or vllm under
exact numerics, check_lora_numerics; train.backend: native, fsdp with the base and adapters replicated,
jetflow.run.megatron_side.build_trainer_model, or megatron with TP-split adapters, jetflow.train.megatron.lora)."""
LORA_BACKENDS = ("native", "fsdp", "megatron")
LORA_MEGATRON_BUILT = (("train.pipeline_parallel_size", 1), ("train.expert_parallel_size", 1))
"""LoRA on the Megatron trainer: tensor parallelism alone (the adapters' gather and the frozen base are one stage's)."""


def check_lora(cfg: Config) -> None:
    """model.lora (jetflow.precision.lora): what this LoRA is built for; the targets against the model are
    check_lora_model's."""
    lora, p = cfg.model.lora, cfg.precision
    if lora.dropout != 0:
        raise ConfigError(f"model.lora.dropout={lora.dropout}: dropout on the adapters' input makes the trainer's "
                          "forward another function than the rollout engine's (off-policy by design); set it to 0")
    if not lora.rank:
        return
    if not lora.targets:
        raise ConfigError("model.lora.targets=[]: name the linears to adapt (e.g. [q_proj, v_proj]), or set "
                          "model.lora.rank=0")
    if cfg.train.backend not in LORA_BACKENDS:
        raise ConfigError(f"model.lora.rank={lora.rank} with train.backend={cfg.train.backend}: LoRA there is not "
                          f"built yet; use train.backend=native, fsdp or megatron (or model.lora.rank=0)")
    for size, one in LORA_MEGATRON_BUILT if cfg.train.backend == "megatron" else ():
        if (n := config_value(cfg, size)) != one:
            raise ConfigError(f"model.lora.rank={lora.rank} with train.backend=megatron and {size}={n}: LoRA on the "
                              f"Megatron trainer is built for tensor parallelism alone; use {size}={one} (or "
                              "model.lora.rank=0)")
    if cfg.train.data_parallel_shard_size:
        raise ConfigError(f"model.lora.rank={lora.rank} with train.data_parallel_shard_size="
                          f"{cfg.train.data_parallel_shard_size}: LoRA on FSDP shards nothing (the base and the adapters "
                          "are replicated on every rank); leave it 0")
    for key, built in LORA_BUILT:
        if (value := config_value(cfg, key)) != built:
            raise ConfigError(f"model.lora.rank={lora.rank} with {key}={value}: LoRA there is not built yet; use "
                              f"{key}={built} (or model.lora.rank=0)")
    if p.mode == "unified" and (p.family != "fp8_block" or p.dgrad != "fp8"):
        key, built = ("precision.family", "fp8_block") if p.family != "fp8_block" else ("precision.dgrad", "fp8")
        raise ConfigError(f"model.lora.rank={lora.rank} with precision.mode=unified and {key}={config_value(cfg, key)}: "
                          f"LoRA on that frozen FP8 base is not built yet (its backward would need the "
                          f"high-precision weight); use {key}={built} (or model.lora.rank=0)")


def check_lora_numerics(cfg: Config, derived: Derived) -> None:
    """model.lora with rollout.backend=vllm: the adapters are computed by jetflow's exact plugin alone (the
    policy's PrecisionLinears, jetflow.precision.lora), so the resolved numerics must be exact."""
    if cfg.model.lora.rank and cfg.rollout.backend == "vllm" and not derived.precision.is_exact:
        raise ConfigError(f"model.lora.rank={cfg.model.lora.rank} with rollout.backend=vllm and precision.numerics="
                          f"{cfg.precision.numerics} (resolved: fast): LoRA in vLLM is built for jetflow's exact plugin "
                          "only; use precision.numerics=exact (or rollout.backend=native)")


def check_lora_model(cfg: Config, arch) -> None:
    """model.lora against the model the run builds (read without a weight): every target pattern matches a
    linear of its decoder layers, the rank fits each targeted linear, and the model is dense."""
    lora = cfg.model.lora
    if not lora.rank:
        return
    if arch.is_moe:
        raise ConfigError(f"model.lora.rank={lora.rank} with a mixture-of-experts model ({arch.model_type}): LoRA on "
                          "expert layers is not built yet; use a dense model (or model.lora.rank=0)")
    with torch.device("meta"):
        model = Decoder(arch)
    if missing := unmatched_targets(model, lora.targets):
        names = sorted({n.rsplit(".", 1)[-1] for n in lora_targets(model, ["*"])})
        raise ConfigError(f"model.lora.targets: {', '.join(map(repr, missing))} matches no linear of the model's "
                          f"decoder layers (its linears: {', '.join(names)})")
    for name, linear in lora_targets(model, lora.targets).items():
        if lora.rank > min(linear.in_features, linear.out_features):
            raise ConfigError(f"model.lora.rank={lora.rank} is larger than {name}'s smaller dimension "
                              f"{min(linear.in_features, linear.out_features)} ({linear.in_features} in, "
                              f"{linear.out_features} out); use a rank <= that")
