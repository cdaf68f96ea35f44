"""The one pre-run pass: every check of a run's config, before anything is built or loaded.

The schema (jetflow.config) types every key: an unknown key, a value of the wrong type or a choice
outside a field's `Literal` fails when the config is loaded; a derived value that cannot be derived
(the recipe, the correction's typed parameters, exact numerics, the trackers) fails in
jetflow.config.derive. Every other check is here, once, and refuses with one line (ConfigError) that
names the key and what is valid:

    check_config(cfg)          what the config alone decides: each value's range (RANGES) and the
                               combinations the backends run, then `derive`; returns the config's
                               derived values (jetflow.config.Derived)
    validate_run(cfg, n)       check_config, and what needs more than the config: the device, the
                               trainer's process count, the optional packages, the run directory
                               (a resume continues the same config); returns the derived values and
                               the run's inputs (jetflow.run.build.RunInputs: task, tokenizer,
                               architecture, prompt lengths), read once and checked: the task's
                               parameters, and the model the run will build, read without loading a
                               weight (its architecture against the parallel layout, its positions
                               against prompt + response); last its estimated memory against the
                               machine's, the memory savers left to `auto` chosen by it
                               (jetflow.run.memory_estimate.check_memory: Derived.savers)

`jetflow train` runs validate_run first; `jetflow ablate` runs it for every cell before the first;
`jetflow launch` and the benches run check_config.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any, Callable

import torch

from jetflow.config import (Config, ConfigError, Derived, config_changes, config_value, conversation_tokens, derive,
                            load_config)
from jetflow.precision.family import family_of
from jetflow.precision.recipe import QuantRecipe
from jetflow.rollout.engine import default_kv_pool_bytes
from jetflow.rollout.native import kv_pool_bytes
from jetflow.run.build import RunInputs, load_inputs
from jetflow.run.feature_checks import check_lora, check_lora_model, check_lora_numerics, check_staleness, check_turns
from jetflow.run.files import CONFIG_FILE, holds_a_run, run_dir_of
from jetflow.run.memory_estimate import check_memory

# key, valid(value), what is valid: each a range outside which a run would fail late or silently do
# something else than asked
RANGES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("train.steps", lambda v: v >= 0, ">= 0"),
    ("train.sft_warmup_steps", lambda v: v >= 0, ">= 0"),
    ("train.prompts_per_step", lambda v: v >= 1, ">= 1"),
    ("train.micro_batch_size", lambda v: v >= 1, ">= 1"),
    ("train.sft_batch_size", lambda v: v >= 1, ">= 1"),
    ("train.num_workers", lambda v: v >= 1, ">= 1"),
    ("train.tensor_parallel_size", lambda v: v >= 1, ">= 1"),
    ("train.pipeline_parallel_size", lambda v: v >= 1, ">= 1"),
    ("train.expert_parallel_size", lambda v: v >= 1, ">= 1"),
    ("train.data_parallel_shard_size", lambda v: v >= 0, ">= 0 (0: one shard group of all ranks)"),
    ("train.lr", lambda v: v > 0, "> 0"),
    ("train.sft_lr", lambda v: v > 0, "> 0"),
    ("train.grad_clip", lambda v: v >= 0, ">= 0 (0 turns clipping off)"),
    ("train.min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("train.weight_decay", lambda v: v >= 0, ">= 0"),
    ("train.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("train.betas", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two values in [0, 1)"),
    ("train.checkpoint_every", lambda v: v >= 0, ">= 0 (0: only at the end)"),
    ("train.max_bad_steps", lambda v: v >= 0, ">= 0"),
    ("rollout.max_staleness", lambda v: v >= 0, ">= 0 (0: synchronous)"),
    ("rollout.engine_threads", lambda v: v >= 0, ">= 0 (0: half the threads)"),
    ("rollout.inflight_swap_step", lambda v: v >= 0, ">= 0 (0: half of rollout.max_new_tokens)"),
    ("train.logprob_chunk_tokens", lambda v: v == "auto" or v >= 0, ">= 0 (0: one lm_head call), or auto"),
    ("train.max_tokens_per_micro_batch", lambda v: v is None or v >= 0, ">= 0 (0 or null: no packing)"),
    ("rollout.group_size", lambda v: v >= 2,
     ">= 2: GRPO's advantage is a reward minus its group's mean, so one sample per prompt learns nothing"),
    ("rollout.max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("rollout.max_batch", lambda v: v >= 1, ">= 1"),
    ("rollout.kv_cache_gib", lambda v: v is None or v > 0, "> 0 GiB, or null (max_batch full-length sequences)"),
    ("rollout.num_engines", lambda v: v >= 1, ">= 1"),
    ("rollout.temperature", lambda v: v > 0, "> 0"),
    ("rollout.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("rollout.top_k", lambda v: v >= 0, ">= 0 (0 turns top-k off)"),
    ("rollout.vllm_gpu_memory_utilization", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("rollout.max_turns", lambda v: v >= 1, ">= 1 (1: one response per prompt)"),
    ("rollout.max_total_tokens", lambda v: v >= 0, ">= 0 (0: the longest prompt + 2 x max_turns x max_new_tokens)"),
    ("rollout.tool_timeout_s", lambda v: v > 0, "> 0 seconds"),
    ("precision.group_size", lambda v: v >= 1, ">= 1"),
    ("algo.ppo_epochs", lambda v: v >= 1, ">= 1"),
    ("algo.clip_low", lambda v: 0 <= v < 1, "in [0, 1) (the ratio is clipped below at 1 - clip_low)"),
    ("algo.clip_high", lambda v: v >= 0, ">= 0"),
    ("algo.router_aux_loss_coef", lambda v: v >= 0, ">= 0 (0 turns it off)"),
    ("algo.kl_coef", lambda v: v >= 0, ">= 0 (0 turns the KL penalty off)"),
    ("algo.loss_scale_factor", lambda v: v >= 0, ">= 0 (0: rollout.max_new_tokens)"),
    ("algo.dynamic_sampling_max_rounds", lambda v: v >= 0, ">= 0 (extra rollout rounds a step may run)"),
    ("algo.overlong_buffer", lambda v: v >= 0, ">= 0 (0 turns the overlong punishment off)"),
    ("algo.overlong_penalty", lambda v: v >= 0, ">= 0"),
    ("eval.num_prompts", lambda v: v >= 0, ">= 0 (0 turns evaluation off)"),
    ("eval.every", lambda v: v >= 0, ">= 0 (0: before the first and after the last step only)"),
    ("run.num_threads", lambda v: v >= 0, ">= 0 (0: torch's default)"),
    ("run.ray_num_cpus", lambda v: v >= 0, ">= 0 (0: all cores)"),
    ("model.lora.rank", lambda v: v >= 0, ">= 0 (0: LoRA off)"),
    ("model.lora.alpha", lambda v: v > 0, "> 0 (the adapters' scale is alpha / rank)"),
    ("run.name", lambda v: v not in ("", ".", "..") and "/" not in v and "\\" not in v,
     "one directory name (the run goes to run.out_dir/run.name; put the path in run.out_dir)"),
]
TINY_SIZES = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_position")


def validate_run(cfg: Config, processes: int | None = None) -> tuple[Derived, RunInputs]:
    """Refuse what `jetflow train` cannot run as asked, before any weight is loaded; returns the config's
    derived values and the run's inputs (task, tokenizer, architecture, prompt lengths), which the run's
    builders take from here. `processes`: the trainer's process count (default: Ray's train.num_workers,
    else torchrun's WORLD_SIZE)."""
    if processes is None:
        processes = cfg.train.num_workers if cfg.run.orchestrator == "ray" else int(os.environ.get("WORLD_SIZE", "1"))
    check_ranges(cfg)
    check_combinations(cfg)
    check_device(cfg)
    check_processes(cfg, processes)
    check_packages(cfg)
    check_run_dir(cfg)
    derived = derive_checked(cfg)
    inputs = check_task_and_model(cfg, derived)
    # before any weight is loaded: the savers `auto` leaves to the estimate chosen, a run that cannot fit refused
    return check_memory(cfg, derived, inputs.arch, inputs.longest_prompt), inputs


# The config alone --------------------------------------------------------------------------------------

def check_config(cfg: Config) -> Derived:
    """Every check the config alone decides; returns the config's derived values."""
    check_ranges(cfg)
    check_combinations(cfg)
    return derive_checked(cfg)


def derive_checked(cfg: Config) -> Derived:
    """The config's derived values, each checked (jetflow.config.derive: the recipe checks its own fields),
    then what needs the resolved precision: the recipe's blocks against the backends (check_blocks), LoRA's
    numerics under vLLM (check_lora_numerics)."""
    derived = derive(cfg)
    check_blocks(cfg, derived.precision.recipe)
    check_lora_numerics(cfg, derived)
    return derived


def _refuse(key: str, value: Any, valid: str) -> ConfigError:
    return ConfigError(f"{key}={value!r} is out of range; it must be {valid}")


def check_ranges(cfg: Config) -> None:
    for key, ok, valid in RANGES:
        if not ok(value := config_value(cfg, key)):
            raise _refuse(key, value, valid)
    if cfg.eval.num_prompts and not 0 < cfg.eval.held_out < 1:
        raise _refuse("eval.held_out", cfg.eval.held_out, "in (0, 1) when eval.num_prompts > 0")
    if cfg.model.path == "tiny":
        tiny = cfg.model.tiny
        for size in TINY_SIZES:
            if getattr(tiny, size) < 1:
                raise _refuse(f"model.tiny.{size}", getattr(tiny, size), ">= 1")
        if tiny.num_heads % tiny.num_kv_heads or tiny.hidden_size % tiny.num_heads:
            raise ConfigError(f"model.tiny.num_heads={tiny.num_heads} must be a multiple of num_kv_heads="
                              f"{tiny.num_kv_heads} and divide hidden_size={tiny.hidden_size}")


def check_combinations(cfg: Config) -> None:
    """Values that are valid alone and not together (those that involve a derived value, such as the
    resolved numerics, are jetflow.config.derive's)."""
    t, a = cfg.train, cfg.algo
    if t.steps == 0 and t.sft_warmup_steps == 0:
        raise ConfigError("train.steps=0 and train.sft_warmup_steps=0: the run would do nothing")
    if t.backend != "megatron":
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
            if getattr(t, key) != 1:
                kind = "expert" if key == "expert_parallel_size" else "model"
                raise ConfigError(f"train.{key}={getattr(t, key)}: {kind} parallelism needs train.backend=megatron")
    if t.data_parallel_shard_size and t.backend != "fsdp":
        raise ConfigError(f"train.data_parallel_shard_size={t.data_parallel_shard_size} sizes the FSDP trainer's shard "
                          "groups (HSDP); use train.backend=fsdp or leave it 0")
    if t.backend == "fsdp":
        for key, value, why in (("rollout.backend", cfg.rollout.backend, "native"),
                                ("train.activation_checkpointing", t.activation_checkpointing, False)):
            if value not in (why, "auto"):  # auto: off on FSDP (its memory is not estimated)
                raise ConfigError(f"train.backend=fsdp with {key}={value}: the FSDP trainer runs with the native "
                                  f"rollout engine and without activation checkpointing today; use {key}={why} or "
                                  "train.backend=native")
    for key in ("logprob_chunk_tokens", "activation_checkpointing"):  # the native trainer's memory savers
        if t.backend == "megatron" and getattr(t, key) not in (0, False, "auto"):  # auto: off on Megatron
            raise ConfigError(f"train.{key}={getattr(t, key)} runs on the native trainer only (train.backend=native)")
    if t.max_tokens_per_micro_batch and t.backend != "native":  # packing: the native Decoder's packed forward
        raise ConfigError(f"train.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch} (sequence packing) runs "
                          f"on the native trainer only; use train.backend=native or train.max_tokens_per_micro_batch=0")
    if a.routing_replay:
        for key, value in (("rollout.backend", cfg.rollout.backend), ("train.backend", t.backend)):
            if value != "native":
                raise ConfigError(f"algo.routing_replay=true with {key}={value}: routing replay runs with the native "
                                  f"rollout engine and trainer only; use {key}=native or algo.routing_replay=false")
    check_algorithm(cfg)
    check_turns(cfg)
    check_staleness(cfg)
    check_lora(cfg)
    if unknown := [k for k in cfg.run.allow_changes if not _is_key(k)]:
        raise ConfigError(f"run.allow_changes: {', '.join(unknown)} is not a config key (e.g. train.steps)")


def check_blocks(cfg: Config, recipe: QuantRecipe) -> None:
    """Blocks that not every backend lays out (fp8_block blocks other than 128x128 / 1x128, finer ones, say:
    they run on their dequantized values, jetflow.precision.fp8_function, which the native engine and trainer
    compute; vLLM's FP8 payload, Megatron-Core's fused weights and FSDP's FP8 all-gather lay out 128-row
    blocks), asked of the recipe family's strategy."""
    p = cfg.precision
    if p.mode not in ("mixed", "unified") or family_of(recipe).all_backends_read(recipe):
        return
    for key, value in (("rollout.backend", cfg.rollout.backend), ("train.backend", cfg.train.backend)):
        if value != "native":
            raise ConfigError(f"precision.weight_block={list(p.weight_block)} group_size={p.group_size} with {key}={value}: "
                              f"fp8_block blocks other than [128, 128] / 128 run on the native rollout engine and trainer "
                              f"only; use {key}=native or the 128 blocks")


def check_algorithm(cfg: Config) -> None:
    """The objective's keys that are valid alone and not together (jetflow.rl)."""
    a = cfg.algo
    if a.ratio_level == "sequence" and a.loss_agg not in ("auto", "seq_mean_token_mean"):
        raise ConfigError(f"algo.ratio_level=sequence with algo.loss_agg={a.loss_agg}: GSPO's sequence ratio is "
                          "aggregated per sequence; set algo.loss_agg=seq_mean_token_mean (or leave it unset: auto)")
    if a.overlong_buffer > cfg.rollout.max_new_tokens:
        raise ConfigError(f"algo.overlong_buffer={a.overlong_buffer} exceeds rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens}; it must be in [0, max_new_tokens]")


def _is_key(dotted: str) -> bool:
    node: object = Config()
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return False
        node = getattr(node, part)
    return True


# What needs more than the config -------------------------------------------------------------------------

def check_device(cfg: Config) -> None:
    if cfg.model.device.startswith("cuda") and not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"model.device={cfg.model.device}: {why}; use model.device=cpu")


def check_processes(cfg: Config, processes: int) -> None:
    """The trainer's processes (torchrun ranks or Ray trainer workers) hold whole Megatron layouts (TP x
    PP x EP ranks), and each step's prompts and each SFT batch split evenly over their data-parallel
    ranks (the processes / (TP x PP) under Megatron)."""
    t = cfg.train
    if t.backend == "megatron":
        sizes = {"tensor_parallel_size": t.tensor_parallel_size, "pipeline_parallel_size": t.pipeline_parallel_size,
                 "expert_parallel_size": t.expert_parallel_size}
        layout = t.tensor_parallel_size * t.pipeline_parallel_size * t.expert_parallel_size
        if processes % layout:
            parts = [f"{k}={v}" for k, v in sizes.items() if v != 1] or ["tensor_parallel_size=1"]
            what = "train." + " x ".join(parts) + (f" = {layout}" if len(parts) > 1 else "")
            raise ConfigError(f"{what} needs a multiple of that many processes, this run has {processes}: launch with "
                              f"`torchrun --nproc_per_node {layout} -m jetflow.cli train ...` (or the launch "
                              "templates' torchrun.sh), or under run.orchestrator=ray set train.num_workers to a "
                              "multiple of it")
    if cfg.rollout.max_staleness and processes > 1 and cfg.run.orchestrator == "local":
        raise ConfigError(f"rollout.max_staleness={cfg.rollout.max_staleness} with {processes} trainer processes: "
                          "asynchronous rollouts run beside one trainer process under torchrun today; launch one "
                          "process, use run.orchestrator=ray (train.num_workers), or set rollout.max_staleness=0")
    shard = t.data_parallel_shard_size
    if t.backend == "fsdp" and shard and processes % shard:
        raise ConfigError(f"train.data_parallel_shard_size={shard} must divide the {processes} trainer processes (HSDP: "
                          f"processes / shard size replicas); launch a multiple of {shard} ranks, or set a divisor of "
                          f"{processes} (0: all)")
    mp = t.tensor_parallel_size * t.pipeline_parallel_size if t.backend == "megatron" else 1
    dp = max(processes // mp, 1)
    if t.prompts_per_step % dp or t.sft_batch_size % dp:
        raise ConfigError(f"train.prompts_per_step={t.prompts_per_step} and train.sft_batch_size={t.sft_batch_size} "
                          f"must be multiples of the data-parallel size {dp} ({processes} trainer processes / "
                          f"(tensor_parallel_size x pipeline_parallel_size = {mp}))")


def check_packages(cfg: Config) -> None:
    """The optional backends the config names are installed (found, not imported)."""
    if cfg.train.backend == "megatron" and (importlib.util.find_spec("megatron") is None
                                            or importlib.util.find_spec("megatron.core") is None):
        from jetflow.train.megatron import INSTALL_HINT
        raise ConfigError(f"train.backend=megatron needs Megatron-Core, which is not installed: {INSTALL_HINT}")
    if cfg.rollout.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        from jetflow.rollout.vllm import INSTALL_HINT
        raise ConfigError(f"rollout.backend=vllm needs vLLM, which is not installed: {INSTALL_HINT}")


def check_run_dir(cfg: Config) -> None:
    """A run directory that holds a run is continued (run.resume=true), and a resume continues the config
    the run was started with: its config.yaml must load, and a difference that run.allow_changes does not
    list is refused by name."""
    run_dir = run_dir_of(cfg)
    held, saved = holds_a_run(run_dir), run_dir / CONFIG_FILE
    if not cfg.run.resume:
        if held:
            raise ConfigError(f"run directory {run_dir} already holds a run; pass run.resume=true to continue it, "
                              "or choose another run.name")
        return
    if not saved.exists():
        return
    try:
        started = load_config(saved)
    except ConfigError as e:
        raise ConfigError(f"run.resume=true: {saved} is damaged ({e}); restore it, or delete it to resume with the "
                          "config given here (then nothing checks that it is the run's)") from None
    changed = [k for k in config_changes(started, cfg) if k not in cfg.run.allow_changes]
    if changed:
        raise ConfigError(f"run.resume=true: {run_dir} was started with another config ({', '.join(changed)} differ "
                          f"from its {saved.name}); resume with the same values, allow the change with "
                          f"run.allow_changes=[{','.join(changed)}], or choose another run.name")


def check_task_and_model(cfg: Config, derived: Derived) -> RunInputs:
    """The run's inputs, read (the task's parameters checked by the task itself), then checked: the
    task's held-out split, and the model the run will build, read without loading a weight (`smollm2`
    is converted on first use): its positions hold the longest prompt and a whole response, the layers
    kept in high precision exist, routing replay has experts to replay, and Megatron's layout can split
    it under the run's numerics and recipe (jetflow.train.megatron.checks). Its memory is validate_run's
    last check."""
    path = cfg.model.path
    if path not in ("tiny", "smollm2") and not Path(path).is_dir():
        raise ConfigError(f"model.path={path!r}: not a directory (use a local Hugging Face directory, `smollm2` or "
                          "`tiny`)")
    inputs = load_inputs(cfg)
    task, arch, longest = inputs.task, inputs.arch, inputs.longest_prompt
    if cfg.eval.num_prompts and not task.held_out_problems(1):
        raise ConfigError(f"eval.held_out={cfg.eval.held_out}: no prompt of task {cfg.task.name!r} falls in the "
                          "held-out split; raise eval.held_out, or set eval.num_prompts=0")
    if cfg.train.sft_warmup_steps and task.dataset_problems() is not None and not all(
            p.answer for p in task.dataset_problems()):
        raise ConfigError(f"train.sft_warmup_steps={cfg.train.sft_warmup_steps}: the supervised warm-up trains on "
                          "the reference answers, and the task has none; set task.params.answer_key (the field "
                          "holding them) or train.sft_warmup_steps=0")
    check_prompt_positions(cfg, task, inputs.prompt_lengths, arch.max_position_embeddings)
    request = conversation_tokens(cfg.rollout, longest)  # a prompt and its response, or a whole conversation
    if cfg.rollout.max_turns > 1 and request > arch.max_position_embeddings:
        raise ConfigError(f"rollout.max_total_tokens: a conversation may take {request} tokens, past the model's "
                          f"{arch.max_position_embeddings} positions; set rollout.max_total_tokens <= "
                          f"{arch.max_position_embeddings}")
    if cfg.rollout.kv_cache_gib is not None and cfg.rollout.backend == "native":  # the longest request alone, fp32
        need = default_kv_pool_bytes(arch, 1, request)
        if kv_pool_bytes(cfg, arch, request) < need:
            raise ConfigError(f"rollout.kv_cache_gib={cfg.rollout.kv_cache_gib}: one request of {request} tokens "
                              f"needs {need / 2**30:.4g} GiB of fp32 KV pages")
    kept = cfg.precision.keep_first_layers + cfg.precision.keep_last_layers
    if kept > arch.num_layers:
        raise ConfigError(f"precision.keep_first_layers={cfg.precision.keep_first_layers} + keep_last_layers="
                          f"{cfg.precision.keep_last_layers} = {kept}: the model has {arch.num_layers} layers; keep at "
                          "most that many in high precision")
    if cfg.algo.routing_replay and not arch.is_moe:
        raise ConfigError(f"algo.routing_replay=true: the model ({arch.model_type}) has no mixture-of-experts layers "
                          "to replay; set algo.routing_replay=false")
    if cfg.train.backend == "megatron":
        check_megatron_model(cfg, arch, derived)
    check_lora_model(cfg, arch)
    return inputs


def check_prompt_positions(cfg: Config, task, lengths: list[tuple[int | None, int]], positions: int) -> None:
    """Every prompt and a whole response fit the model's positions; a data file's row that does not is
    named, with the key that drops such rows."""
    new = cfg.rollout.max_new_tokens
    over = [(row, n) for row, n in lengths if n + new > positions]
    if not over:
        return
    longest = max(n for _, n in lengths)
    if over[0][0] is None:  # a generated task
        raise ConfigError(f"rollout.max_new_tokens={new}: with prompts of up to {longest} tokens, responses would "
                          f"pass the model's {positions} positions; lower it")
    row, n = over[0]
    more = f" (and {len(over) - 1} more rows, the longest {longest} tokens)" if len(over) > 1 else ""
    raise ConfigError(f"{task.path}: row {row} is a prompt of {n} tokens{more}: with rollout.max_new_tokens={new} its "
                      f"response would pass the model's {positions} positions; drop such rows with task.params."
                      f"max_prompt_tokens={max(positions - new, 1)} or lower rollout.max_new_tokens")


def check_megatron_model(cfg: Config, arch, derived: Derived) -> None:
    from jetflow.train.megatron.checks import MegatronConfigError, check_layout

    t = cfg.train
    if arch.is_moe and t.pipeline_parallel_size > 1 and cfg.algo.router_aux_loss_coef:
        raise ConfigError(f"algo.router_aux_loss_coef={cfg.algo.router_aux_loss_coef} with train.backend=megatron "
                          f"and pipeline_parallel_size={t.pipeline_parallel_size}: the router load-balancing loss is "
                          "computed on one stage only; set algo.router_aux_loss_coef=0 or pipeline_parallel_size=1")
    try:
        check_layout(arch, t.tensor_parallel_size, t.pipeline_parallel_size, t.expert_parallel_size,
                     derived.precision.trainer_kind, derived.precision.recipe, derived.precision.numerics)
    except MegatronConfigError as e:
        raise ConfigError(f"train.backend=megatron: {e}") from None
