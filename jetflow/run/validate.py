"""The checks a run passes before anything is built: one pass over the whole config, beside the
per-key choices and ranges that jetflow.config.validate checks when the config is loaded.

What is checked here needs more than the config: the process count (torchrun's WORLD_SIZE or the Ray
workers), which optional backends are installed, which combinations the backends support.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import torch

from jetflow.config import Config, ConfigError, resolve_numerics
from jetflow.run.build import build_task


def validate_run(cfg: Config, processes: int | None = None) -> None:
    """Refuse backend choices `jetflow train` cannot run, instead of silently running something else.
    `processes`: the trainer's process count (default: Ray's train.num_workers, else WORLD_SIZE)."""
    if processes is None:
        processes = cfg.train.num_workers if cfg.run.orchestrator == "ray" else int(os.environ.get("WORLD_SIZE", "1"))
    check_device(cfg)
    check_values(cfg)
    check_megatron(cfg, world=processes)
    check_batch_split(cfg, processes)
    check_vllm(cfg)
    check_routing_replay(cfg)
    check_wired(cfg)
    task = build_task(cfg)  # the task's parameters are checked by the task itself (a ConfigError naming them)
    if cfg.eval.num_prompts and not task.held_out_problems(1):
        raise ConfigError(f"eval.held_out={cfg.eval.held_out}: no prompt of task {cfg.task.name!r} falls in the "
                          "held-out split; raise eval.held_out, or set eval.num_prompts=0")


def check_device(cfg: Config) -> None:
    if cfg.model.device.startswith("cuda") and not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"model.device={cfg.model.device}: {why}; use model.device=cpu")


def check_values(cfg: Config) -> None:
    """Values that jetflow.config.validate leaves through and that failed later with a traceback, ran
    something else than asked, or wrote outside run.out_dir."""
    tiny, r, util = cfg.model.tiny, cfg.run, cfg.rollout.vllm_gpu_memory_utilization
    if cfg.model.path == "tiny":
        sizes = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_position")
        if bad := [f"model.tiny.{k}={getattr(tiny, k)}" for k in sizes if getattr(tiny, k) < 1]:
            raise ConfigError(" and ".join(bad) + " must be >= 1")
        if tiny.num_heads % tiny.num_kv_heads or tiny.hidden_size % tiny.num_heads:
            raise ConfigError(f"model.tiny.num_heads={tiny.num_heads} must be a multiple of num_kv_heads="
                              f"{tiny.num_kv_heads} and divide hidden_size={tiny.hidden_size}")
    checks = [
        ("algo.clip_low", cfg.algo.clip_low, cfg.algo.clip_low < 1, "< 1 (the ratio is clipped below at 1 - clip_low)"),
        ("rollout.vllm_gpu_memory_utilization", util, 0 < util <= 1, "in (0, 1]"),
        ("run.num_threads", r.num_threads, r.num_threads >= 0, ">= 0 (0: torch's default)"),
        ("run.ray_num_cpus", r.ray_num_cpus, r.ray_num_cpus >= 0, ">= 0 (0: all cores)"),
        ("run.name", r.name, r.name not in ("", ".", "..") and "/" not in r.name and "\\" not in r.name,
         "one directory name (the run goes to run.out_dir/run.name; put the path in run.out_dir)"),
    ]
    for key, value, ok, valid in checks:
        if not ok:
            raise ConfigError(f"{key}={value!r} is out of range; it must be {valid}")
    if unknown := [k for k in r.allow_changes if not _is_key(k)]:
        raise ConfigError(f"run.allow_changes: {', '.join(unknown)} is not a config key (e.g. train.steps)")
    check_correction_params(cfg)


def _is_key(dotted: str) -> bool:
    node: object = Config()
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return False
        node = getattr(node, part)
    return True


def check_correction_params(cfg: Config) -> None:
    """algo.correction_params must be the correction's own parameters, in range: tried once on one token."""
    from jetflow.rl import apply_correction
    from jetflow.run.loop import resolve_correction
    name, params = resolve_correction(cfg), cfg.algo.correction_params
    zero, one = torch.zeros(1, 1), torch.ones(1, 1)
    try:
        apply_correction(name, zero, zero, one, **params)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"algo.correction_params={dict(params)} for correction {name}: {e}") from None


def check_wired(cfg: Config) -> None:
    """Transformer Engine is a library component (jetflow.train.te), not wired into the training loop
    (it cannot be installed on the CPU machines)."""
    wired = {"train.fp8_backend": ("jetflow", "jetflow.train.te")}
    for key, (supported, component) in wired.items():
        section, field = key.split(".")
        value = getattr(getattr(cfg, section), field)
        if value != supported:
            raise ConfigError(f"{key}={value!r}: `jetflow train` runs {key}={supported!r} today; the {value} "
                              f"backend is available as the library component {component} but is not wired "
                              "into the training loop yet")


def check_batch_split(cfg: Config, processes: int) -> None:
    """Each step's prompts and each SFT batch split evenly over the data-parallel ranks: the trainer
    processes (torchrun ranks or Ray trainer workers), divided by the model-parallel size (tensor x pipeline
    parallel) under Megatron."""
    t = cfg.train
    mp = t.tensor_parallel_size * t.pipeline_parallel_size if t.backend == "megatron" else 1
    dp = max(processes // mp, 1)
    if t.prompts_per_step % dp or t.sft_batch_size % dp:
        raise ConfigError(f"train.prompts_per_step={t.prompts_per_step} and train.sft_batch_size={t.sft_batch_size} "
                          f"must be multiples of the data-parallel size {dp} ({processes} trainer processes / "
                          f"(tensor_parallel_size x pipeline_parallel_size = {mp}))")


def check_megatron(cfg: Config, world: int | None = None) -> None:
    """Refuse parallel layouts and options the Megatron backend does not run, before anything is built.
    `world`: the trainer's process count (default: torchrun's WORLD_SIZE)."""
    t = cfg.train
    if t.expert_parallel_size != 1 and t.backend != "megatron":
        raise ConfigError(f"train.expert_parallel_size={t.expert_parallel_size}: expert parallelism needs "
                          "train.backend=megatron")
    sizes = {"tensor_parallel_size": t.tensor_parallel_size, "pipeline_parallel_size": t.pipeline_parallel_size,
             "expert_parallel_size": t.expert_parallel_size}
    if bad := [f"train.{k}={v}" for k, v in sizes.items() if v < 1]:
        raise ConfigError(" and ".join(bad) + " must be >= 1")
    if t.backend != "megatron":
        if t.tensor_parallel_size != 1 or t.pipeline_parallel_size != 1:
            raise ConfigError(f"train.tensor_parallel_size={t.tensor_parallel_size} / pipeline_parallel_size="
                              f"{t.pipeline_parallel_size}: model parallelism needs train.backend=megatron")
        return
    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    mp = t.tensor_parallel_size * t.pipeline_parallel_size * t.expert_parallel_size  # distinct ranks of one layout
    if world % mp:
        parts = [f"{k}={v}" for k, v in sizes.items() if v != 1] or ["tensor_parallel_size=1"]
        what = "train." + " x ".join(parts) + (f" = {mp}" if len(parts) > 1 else "")
        raise ConfigError(f"{what} needs a multiple of that many processes, this run has {world}: launch with "
                          f"`torchrun --nproc_per_node {mp} -m jetflow.cli train ...` (or launch/torchrun.sh), or under "
                          f"run.orchestrator=ray set train.num_workers to a multiple of it")
    check_expert_parallel(cfg)
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        from jetflow.train.megatron import INSTALL_HINT
        raise ConfigError(f"train.backend=megatron needs Megatron-Core, which is not installed: {INSTALL_HINT}")


def check_expert_parallel(cfg: Config) -> None:
    """Expert parallelism (Megatron backend): EP ranks are data-parallel ranks of one pipeline stage, each
    holding num_experts / EP experts of a mixture-of-experts model (checked here for `model.path=tiny`;
    a checkpoint's config is checked when the policy is built)."""
    t, tiny = cfg.train, cfg.model.tiny
    ep, pp = t.expert_parallel_size, t.pipeline_parallel_size
    if cfg.model.path == "tiny":
        if ep > 1 and not tiny.num_experts:
            raise ConfigError(f"train.expert_parallel_size={ep} needs a mixture-of-experts model: set "
                              "model.tiny.num_experts, or train.expert_parallel_size=1")
        if tiny.num_experts and tiny.num_experts % ep:
            raise ConfigError(f"model.tiny.num_experts={tiny.num_experts} is not a multiple of "
                              f"train.expert_parallel_size={ep}: each expert-parallel rank holds as many experts")
        if tiny.num_experts and pp > 1 and cfg.algo.router_aux_loss_coef:
            raise ConfigError(f"algo.router_aux_loss_coef={cfg.algo.router_aux_loss_coef} with train.backend=megatron "
                              f"and pipeline_parallel_size={pp}: the router load-balancing loss is computed on one "
                              "stage only; set algo.router_aux_loss_coef=0 or pipeline_parallel_size=1")


def check_routing_replay(cfg: Config) -> None:
    """Routing replay records the expert choices in jetflow's rollout engine and replays them in its Decoder."""
    if not cfg.algo.routing_replay:
        return
    for key, value in (("rollout.backend", cfg.rollout.backend), ("train.backend", cfg.train.backend)):
        if value != "native":
            raise ConfigError(f"algo.routing_replay=true with {key}={value}: routing replay runs with the native "
                              f"rollout engine and trainer only; use {key}=native or algo.routing_replay=false")


def check_vllm(cfg: Config) -> None:
    """Refuse what the vLLM rollout side does not run, before anything is built (imports nothing heavy)."""
    if cfg.rollout.backend != "vllm":
        return
    if cfg.precision.kv_cache_fp8 and resolve_numerics(cfg) != "exact":
        raise ConfigError("precision.kv_cache_fp8=true with rollout.backend=vllm needs precision.numerics=exact (or "
                          "auto): only jetflow's plugin loads the per-step FP8 KV scales")
    if importlib.util.find_spec("vllm") is None:
        from jetflow.rollout.vllm import INSTALL_HINT
        raise ConfigError(f"rollout.backend=vllm needs vLLM, which is not installed: {INSTALL_HINT}")
