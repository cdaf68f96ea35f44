"""How much memory a run will take, estimated from its config before anything is built, and what the
process can have: a run that cannot fit is refused in one line, one close to the limit is warned.

    estimate = estimate_run(cfg, derived, arch, prompt_len)      # jetflow train's process
    estimate = estimate_train_step(cfg, derived, arch, batch, prompt_len, response_len)   # the bench's
    derived = check_memory(cfg, derived, arch, prompt_len)   # jetflow.run.validate: `auto` savers chosen, then the check

    jetflow estimate-memory --config FILE [key=value ...]      the table of terms, and the limit

The memory savers left to `auto` (train.logprob_chunk_tokens, train.activation_checkpointing) are chosen
here, by the estimate (choose_savers): the cheapest combination under which the run fits with room, the
trainer running what jetflow.config.Derived.savers then holds.

The estimate is a sum of terms, each a product of the config's sizes (its formula in `Term.formula`).
Notation: P parameters (tied weights once), m the master dtype's bytes (4 fp32, 2 bf16), L layers, h
hidden size, i intermediate size (MoE: experts_per_token x the experts' size), kv = num_kv_heads x
head_dim, V vocabulary, N = micro_batch_size x (prompt + response) positions of one micro-batch.

- runtime: Python, torch, jetflow, tokenizer and allocator slack (RUNTIME_BYTES, measured).
- weights, gradients, AdamW: P x m each, and 2 P x m for AdamW's two moments (kept in the parameters' dtype).
  With LoRA (model.lora): gradients and AdamW of the adapters alone, A = rank x (in + out) fp32 per targeted
  linear; the trainer's weights lose the frozen FP8 linears' (their bytes are the copies' term) and keep the
  decoder layers' bf16 linears in bf16 (lora_trainer_weights). The adapters' saved inputs are not counted.
- weight copies: what a precision keeps beside a weight, per linear weight element
  (jetflow.precision.linear.held_bytes_per_weight): exact numerics keep the canonical GEMM's packed panels
  (fp32: 4 B, bf16: 2 B; FP8: 1 B of bytes + 1 B of panels + on the trainer 1 B of transposed panels for
  the dgrad); the CPU emulation of fast FP8 keeps a 4 B dequantized copy beside the 1 B bytes.
- activations: what autograd saves for one micro-batch's backward, N x per-token bytes
  (activation_bytes_per_token): L x (a_h h + a_kv kv + a_i i) + 16 h, the coefficients per trainer
  kind counted with autograd's saved-tensor hooks (results/memory-estimate/saved_activations.py; with LoRA
  SAVED_PER_LAYER_LORA + 4 B x rank per adapted linear);
  under train.activation_checkpointing, L x 4 h (each layer's input) + one layer's full set (the layer
  recomputed in the backward).
- backward working set: the gradients of one layer's activations, as large as its saved set (two
  layers' under checkpointing: the recomputed one and its gradients).
- logits: the (rows, V) fp32 logits and their log_softmax in the forward, rows = the micro-batch's
  response positions (N_r) or train.logprob_chunk_tokens of them; the backward recomputes GROUP = 256
  rows at a time (logits, log_softmax, its gradient, the softmax): max(2 x rows x V, 4 x 256 x V) x 4 B.
- rollout engine (jetflow train only): its own copy of the weights (P x m) and its copies, the KV
  pages its sequences hold (the pool's budget when they would hold more: pages are mapped when first
  used), and one decode step's sampling logits (max_batch x V x 4 B x 3).

The peak: the forward ends with the activations and the logits held, the backward starts with them and
the gradients begin to fill: activations + backward working set + logits + gradients is taken as the
step's peak (an upper bound: the gradients fill as the activations are freed). Compared with measured
peak RSS in results/memory-estimate/README.md (within 25% on the configurations measured there).
Not covered (the check skipped, `auto` savers off): run.orchestrator=ray, train.backend=megatron and fsdp
(their memory is split over processes and machines the driver does not see), and run.memory_check=false.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from jetflow.config import Config, ConfigError, Derived, LoRAConfig, MemorySavers, TrainConfig
from jetflow.model.attention import GRAD_BLOCK
from jetflow.model.chunked_logprobs import GROUP
from jetflow.model.model_config import ModelConfig
from jetflow.model.paged_cache import PagePool
from jetflow.precision.linear import held_bytes_per_weight, layer_index
from jetflow.precision.lora import is_target
from jetflow.rollout.engine import kv_pool_pages
from jetflow.rollout.native import kv_pool_bytes
from jetflow.run.build import master_dtype
from jetflow.run.sides import engine_max_seq_len
from jetflow.tasks.reward_model import DTYPE_BYTES, num_parameters, reward_model_dirs, reward_model_dtype

GIB = 2**30
RUNTIME_BYTES = int(0.45 * GIB)
"""Python + torch + jetflow imported (0.24 GB measured), the tokenizer and data, the interpreter's and
the allocator's slack: the peak RSS of a train step of a model of 0.1M parameters is about 0.45 GB."""
WARN_FRACTION = 0.8
"""An estimate above this fraction of the available memory is warned (the estimate is within about 25%)."""
CHOOSE_FRACTION = 0.6
"""`auto` turns savers on until the estimate is at most this fraction of the available memory. More room than the
warning's, because the savers cost nothing measured (the same step 16% faster with them on a Zen 4, issue 75) and
the estimate ran low where it mattered: SmolLM2 unified at 8 x (44 + 1024) was estimated at 17.8 GiB, 79.9% of 22.3
available (no saver at WARN_FRACTION), and peaked at 21.0 GiB (results/async/README.md)."""

# bytes saved for backward per token and decoder layer = a_h * h + a_kv * kv + a_i * i, by trainer kind
# (fp32 master weights; counted by results/memory-estimate/saved_activations.py)
SAVED_PER_LAYER = {"fp32": (32, 8, 24), "bf16": (48, 12, 30), "fp8": (20, 8, 20)}
SAVED_PER_LAYER_LORA = {"fp32": (24, 8, 24), "bf16": (48, 8, 28), "fp8": (24, 8, 24)}
"""The same under model.lora with its default targets (the base's weight gradients are not computed, the adapters
save their fp32 inputs), plus 4 B x rank per adapted linear of the layer (the adapter's (x A^T)); counted with the
same hooks on tiny models of h 256, i 768 / 1536, kv 128 / 256, rank 16 / 32, exact numerics
(scripts/analysis/lora_saved_activations.py; tests/unit/test_lora_memory.py checks them at another shape)."""
SAVED_OUTSIDE_LAYERS = 16
"""Bytes per token and unit of h saved outside the layers (embedding output, final norm, the head's input)."""


class MemoryTooSmall(ConfigError):
    """The run's estimated memory exceeds what the process can have."""


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    formula: str
    """How `bytes` was computed, with the config's numbers in it."""


@dataclass(frozen=True)
class MemoryEstimate:
    terms: tuple[Term, ...]
    what: str
    """Whose memory: `jetflow train` (trainer + rollout engine), or a bench's process."""

    @property
    def total(self) -> int:
        return sum(t.bytes for t in self.terms)

    def term(self, name: str) -> int:
        return next(t.bytes for t in self.terms if t.name == name)

    def table(self) -> str:
        rows = [f"  {t.name:<22} {t.bytes / GIB:8.3f} GiB   {t.formula}" for t in self.terms]
        return "\n".join([f"memory estimate ({self.what}):", *rows, f"  {'total':<22} {self.total / GIB:8.3f} GiB"])


# Model sizes -------------------------------------------------------------------------------------------

def weight_copies(arch: ModelConfig, kind: str, derived: Derived, cuda: bool, trainer: bool) -> tuple[int, str]:
    """(bytes, formula) of the copies every linear of one side keeps under its linear `kind`; under fp8
    the linears the recipe keeps in high precision (lm_head, routers, first / last layers) are bf16."""
    recipe, by_kind = derived.precision.recipe, {"fp32": 0, "bf16": 0, "fp8": 0}
    for name, o, i in arch.linear_shapes():
        k = kind
        if kind == "fp8" and recipe.keeps_in_high_precision(name, _layer(name), arch.num_layers):
            k = "bf16"
        by_kind[k] += o * i
    total, parts = 0.0, []
    for k, n in by_kind.items():
        b = held_bytes_per_weight(k, recipe, derived.precision.numerics, cuda, trainer)
        if n and b:
            total += n * b
            parts.append(f"{n / 1e6:.3g}M {k} weights x {b:g} B")
    return int(total), " + ".join(parts) or "none"


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None


# Activations and logits -------------------------------------------------------------------------------

def _ffn_size(arch: ModelConfig) -> int:
    """The intermediate size a token's MLP activations span (MoE: the experts it is routed to)."""
    return arch.num_experts_per_tok * arch.moe_intermediate_size if arch.is_moe else arch.intermediate_size


def layer_bytes_per_token(arch: ModelConfig, kind: str, lora: LoRAConfig | None = None) -> int:
    """Bytes one decoder layer saves for backward per token: a_h h + a_kv kv + a_i i (SAVED_PER_LAYER; with
    LoRA SAVED_PER_LAYER_LORA + 4 x rank per adapted linear)."""
    if lora is None or not lora.rank:
        a_h, a_kv, a_i = SAVED_PER_LAYER[kind]
        adapters = 0
    else:
        a_h, a_kv, a_i = SAVED_PER_LAYER_LORA[kind]
        layer = [name for name, _, _ in arch.linear_shapes() if name.startswith("model.layers.0.")]
        adapters = 4 * lora.rank * sum(is_target(name, lora.targets) for name in layer)
    return a_h * arch.hidden_size + a_kv * arch.num_kv_heads * arch.head_dim + a_i * _ffn_size(arch) + adapters


def activation_bytes_per_token(arch: ModelConfig, kind: str, checkpointing: bool, lora: LoRAConfig | None = None) -> int:
    """Bytes saved for backward per token of a micro-batch, every layer and the parts outside them:
    L x layer + 16 h; under checkpointing L x 4 h (each layer's input) + one layer (recomputed)."""
    outside = SAVED_OUTSIDE_LAYERS * arch.hidden_size
    layer = layer_bytes_per_token(arch, kind, lora)
    if checkpointing:
        return arch.num_layers * 4 * arch.hidden_size + layer + outside
    return arch.num_layers * layer + outside


def logits_bytes(vocab: int, response_positions: int, chunk: int) -> tuple[int, str]:
    """(bytes, formula) of the log-probs' logits: forward 2 x rows x V x 4 (logits and log_softmax, rows
    = the response positions or the chunk), backward 4 x GROUP x V x 4; the larger of the two."""
    rows = min(chunk, response_positions) if chunk else response_positions
    fwd, bwd = 2 * rows * vocab * 4, 4 * min(GROUP, response_positions) * vocab * 4
    if fwd >= bwd:
        return fwd, f"2 x {rows} rows x V={vocab} x 4 B (forward{', train.logprob_chunk_tokens' if chunk else ''})"
    return bwd, f"4 x {min(GROUP, response_positions)} rows x V={vocab} x 4 B (backward groups)"


def lora_trainer_weights(cfg: Config, derived: Derived, arch: ModelConfig) -> tuple[int, int, str]:
    """(the trainer's weight bytes, the trained parameters A, formula) under model.lora
    (jetflow.precision.lora.freeze_base): P x m less the FP8 linears' master weights (dropped: their bytes
    are kept) and, for the decoder layers' bf16 linears, m - 2 B each; plus the adapters' A x 4 B."""
    lora, m = cfg.model.lora, master_dtype(cfg).itemsize
    kind, recipe = derived.precision.trainer_kind, derived.precision.recipe
    adapters = sum(lora.rank * (o + i) for name, o, i in arch.linear_shapes() if is_target(name, lora.targets))
    dropped = 0
    for name, o, i in arch.linear_shapes():
        layer = layer_index(name)
        k = "bf16" if kind == "fp8" and recipe.keeps_in_high_precision(name, layer, arch.num_layers) else kind
        if k == "fp8" and (layer is not None or name != "lm_head" or not arch.tie_word_embeddings):
            dropped += o * i * m
        elif k == "bf16" and layer is not None:
            dropped += o * i * (m - 2)
    P = arch.num_parameters()
    return (P * m - dropped + adapters * 4, adapters,
            f"P x {m} B less {dropped / 1e6:.1f} MB frozen (FP8: bytes only; bf16: 2 B) + A={adapters / 1e6:.2f}M x 4 B")


# The estimates ---------------------------------------------------------------------------------------

def _trainer_terms(cfg: Config, derived: Derived, arch: ModelConfig, batch: int, prompt_len: int,
                   response_len: int) -> list[Term]:
    """The trainer's terms for `batch` sequences of prompt_len + response_len positions (packing's grid: widened)."""
    t, m, savers = cfg.train, master_dtype(cfg).itemsize, derived.savers
    kind = derived.precision.trainer_kind
    cuda = cfg.model.device.startswith("cuda")
    P = arch.num_parameters()
    copies, copies_formula = weight_copies(arch, kind, derived, cuda, trainer=True)
    grid = derived.precision.numerics == "exact" and bool(t.max_tokens_per_micro_batch)  # jetflow.train.packing
    width = prompt_len + response_len + (-(prompt_len + response_len) % GRAD_BLOCK if grid else 0)
    rows = _micro_rows(cfg, batch, width)
    n = rows * width
    per_token = activation_bytes_per_token(arch, kind, savers.checkpointing, cfg.model.lora)
    layer = layer_bytes_per_token(arch, kind, cfg.model.lora)
    work = (2 if savers.checkpointing else 1) * layer
    logits, logits_formula = logits_bytes(arch.vocab_size, rows * response_len, savers.chunk_tokens)
    ckpt = "train.activation_checkpointing: L x 4 h + one layer" if savers.checkpointing else "L layers"
    weights, trained, weights_formula, b = P * m, P, f"P={P / 1e6:.1f}M x {m} B", m
    if cfg.model.lora.rank:  # the adapters alone are trained, in fp32
        (weights, trained, weights_formula), b = lora_trainer_weights(cfg, derived, arch), 4
    what = "A" if cfg.model.lora.rank else "P"
    return [
        Term("trainer weights", weights, weights_formula),
        Term("trainer copies", copies, f"{kind} linears: {copies_formula}"),
        Term("gradients", trained * b, f"{what} x {b} B"),
        Term("AdamW state", 2 * trained * b, f"2 x {what} x {b} B"),
        Term("activations", n * per_token, f"N={rows} x {width} ({prompt_len} + {response_len}) positions "
                                           f"(train.micro_batch_size) x {per_token} B ({ckpt})"),
        Term("backward working set", n * work, f"N x {work} B ({'two layers' if savers.checkpointing else 'one layer'})"),
        Term("logits", logits, logits_formula),
    ]


def _runtime(cfg: Config) -> Term:
    if cfg.model.device.startswith("cuda"):
        return Term("runtime", 0, "host memory (the check compares device memory)")
    return Term("runtime", RUNTIME_BYTES, "Python, torch, jetflow, allocator slack (measured floor)")


def _micro_rows(cfg: Config, batch: int, seq_len: int) -> int:
    """Sequences of seq_len positions in one micro-batch: train.micro_batch_size, or under packing as many
    as train.max_tokens_per_micro_batch holds (at least one)."""
    budget = cfg.train.max_tokens_per_micro_batch
    return min(max(1, budget // seq_len) if budget else cfg.train.micro_batch_size, batch)


def estimate_train_step(cfg: Config, derived: Derived, arch: ModelConfig, batch: int, prompt_len: int,
                        response_len: int, first_step_only: bool = False) -> MemoryEstimate:
    """The process of `jetflow bench train-step` with one mode: the bench's source model (P x m) and a
    Trainer over its copy, `batch` rows of prompt_len + response_len positions. `first_step_only` (the
    bench's --warmup 0 --reps 1): AdamW's state is first allocated by the optimizer step, after the
    backward has freed the activations, so it adds to the peak only where it exceeds them."""
    m = master_dtype(cfg).itemsize
    terms = [_runtime(cfg),
             Term("bench source model", arch.num_parameters() * m, f"P x {m} B (the copy the bench builds trainers from)"),
             *_trainer_terms(cfg, derived, arch, batch, prompt_len, response_len)]
    if first_step_only:
        freed = sum(t.bytes for t in terms if t.name in ("activations", "backward working set", "logits"))
        adam = next(t for t in terms if t.name == "AdamW state")
        terms = [Term(t.name, max(adam.bytes - freed, 0), f"first step: max(0, 2 x P x {m} B - activations, working "
                      "set and logits freed before the optimizer step)") if t is adam else t for t in terms]
    return MemoryEstimate(tuple(terms), f"bench train-step, batch {batch} x ({prompt_len} + {response_len})")


def estimate_run(cfg: Config, derived: Derived, arch: ModelConfig, prompt_len: int, data_parallel: int = 1) -> MemoryEstimate:
    """One process of `jetflow train` (local placement): the trainer, its rollout engine, and the KV
    pages of a step's sequences (this rank's share of prompts_per_step x group_size, or the held-out
    evaluation's prompts if more), every response at rollout.max_new_tokens."""
    r, t = cfg.rollout, cfg.train
    m = master_dtype(cfg).itemsize
    P, new = arch.num_parameters(), r.max_new_tokens
    trained = t.prompts_per_step // max(data_parallel, 1) * r.group_size
    sequences = max(trained, cfg.eval.num_prompts)  # what the engine decodes at once, at most
    terms = [_runtime(cfg), *_trainer_terms(cfg, derived, arch, trained, prompt_len, new)]
    cuda = cfg.model.device.startswith("cuda")
    copies, copies_formula = weight_copies(arch, derived.precision.rollout_kind, derived, cuda, trainer=False)
    terms += [Term("rollout weights", P * m, f"P x {m} B (the engine's own copy)"),
              Term("rollout copies", copies, f"{derived.precision.rollout_kind} linears: {copies_formula}")]
    terms.append(_kv_term(cfg, arch, prompt_len, sequences))
    batch = min(r.max_batch, sequences)
    terms.append(Term("sampling logits", 3 * batch * arch.vocab_size * 4, f"3 x {batch} rows x V x 4 B"))
    terms += _reward_model_terms(cfg)
    return MemoryEstimate(tuple(terms), f"jetflow train, {sequences} sequences of {prompt_len} + {new} positions")


def _reward_model_terms(cfg: Config) -> list[Term]:
    """The custom task's reward models (``model:DIR``), their weights at task.params.reward_model_dtype
    (the parameter count read from their safetensors headers); none for other tasks."""
    if cfg.task.name != "custom":
        return []
    dirs = [d for d in reward_model_dirs(cfg.task.params.get("reward")) if d.is_dir()]
    if not dirs:
        return []
    width = DTYPE_BYTES[reward_model_dtype(cfg.task.params)]
    count = sum(num_parameters(d) for d in dirs)
    models = f"{len(dirs)} model{'s' if len(dirs) > 1 else ''}"
    return [Term("reward models", count * width, f"{count / 1e6:.1f}M params x {width} B ({models})")]


def _kv_term(cfg: Config, arch: ModelConfig, prompt_len: int, sequences: int) -> Term:
    """The native engine's KV pages: min(pool, held) where held = (min(max_batch, sequences) x
    ceil((prompt + new) / 64) + 1) pages (kv_pool_pages) of 2 x L x kv x 64 x e bytes (PagePool.page_bytes;
    e: 1 for FP8 K/V, else 4) and the pool = the run's (jetflow.rollout.native.kv_pool_bytes):
    rollout.kv_cache_gib, or max_batch x ceil(max_seq_len / 64) + 1 fp32 pages (the engine's default,
    max_seq_len = 2 x prompt + new + 16: engine_max_seq_len). vLLM: its reservation, the fraction of memory."""
    r = cfg.rollout
    if r.backend == "vllm":
        total = _total_memory(cfg)
        return Term("KV cache", int(r.vllm_gpu_memory_utilization * total),
                    f"rollout.vllm_gpu_memory_utilization={r.vllm_gpu_memory_utilization} x {total / GIB:.1f} GiB")
    dtype = torch.float8_e4m3fn if cfg.precision.kv_cache_fp8 else torch.float32  # E4M3 codes, else fp32 pages
    page = PagePool.page_bytes(arch.num_layers, arch.num_kv_heads, arch.head_dim, dtype)
    held_pages = kv_pool_pages(min(r.max_batch, sequences), prompt_len + r.max_new_tokens)
    pool = kv_pool_bytes(cfg, arch, engine_max_seq_len(cfg, prompt_len))
    pool_what = (f"rollout.kv_cache_gib={r.kv_cache_gib}" if r.kv_cache_gib is not None
                 else f"rollout.max_batch={r.max_batch} full-length fp32 sequences")
    held = held_pages * page
    if held <= pool:
        return Term("KV cache", held, f"{held_pages} pages x {page / 2**20:.2f} MiB (pages the sequences hold)")
    return Term("KV cache", pool, f"the pool, {pool_what} (the sequences would hold {held / GIB:.2f} GiB)")


# What the process can have -------------------------------------------------------------------------------

def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _rss_bytes() -> int:
    """This process's resident memory now (it is part of the estimate's runtime term)."""
    status = _read("/proc/self/status") or ""
    line = next((ln for ln in status.splitlines() if ln.startswith("VmRSS:")), None)
    return int(line.split()[1]) * 1024 if line else 0


def _total_memory(cfg: Config) -> int:
    if cfg.model.device.startswith("cuda"):
        import torch
        return torch.cuda.mem_get_info(torch.device(cfg.model.device))[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


CGROUPS = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "inactive_file"),
           ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
            "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"))
"""(limit, usage, stat, the stat's reclaimable page cache) of cgroup v2, then v1."""


def cgroup_room() -> int | None:
    """Bytes this cgroup may still take: its limit less its usage, the inactive page cache (which the
    kernel reclaims before it kills) not counted as used; None without a limit."""
    for limit_file, usage_file, stat_file, cache_key in CGROUPS:
        limit, usage = _read(limit_file), _read(usage_file)
        if not limit or not usage:
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes 'no limit' as a page-rounded 2^63
            return None
        stat = dict(line.split() for line in (_read(stat_file) or "").splitlines() if len(line.split()) == 2)
        return max(int(limit) - int(usage) + int(stat.get(cache_key, 0)), 0)
    return None


def available_memory(device: str = "cpu") -> tuple[int, str]:
    """(bytes, where from) the process can have: on CUDA the device's free memory (torch.cuda.mem_get_info);
    on the CPU this process's RSS plus what it can still get: /proc/meminfo's MemAvailable, or the
    cgroup's room (cgroup_room) when that is less."""
    if device.startswith("cuda"):
        import torch
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free, f"free memory of {device}"
    info = _read("/proc/meminfo") or ""
    line = next((ln for ln in info.splitlines() if ln.startswith("MemAvailable:")), None)
    more, source = (int(line.split()[1]) * 1024, "MemAvailable") if line else (1 << 62, "unknown")
    room = cgroup_room()
    if room is not None and room < more:
        more, source = room, "the cgroup's memory limit"
    rss = _rss_bytes()
    return rss + more, f"{source} + this process's {rss / GIB:.2f} GiB"


# The check -------------------------------------------------------------------------------------------------

def estimated(cfg: Config) -> bool:
    """The run's memory is estimated: not under run.orchestrator=ray, train.backend=megatron or fsdp (their
    memory is split over processes and machines the driver does not see)."""
    return cfg.run.orchestrator != "ray" and cfg.train.backend == "native"


def _need(cfg: Config, estimate: MemoryEstimate) -> int:
    """The memory the run's processes on this machine need: under torchrun the LOCAL_WORLD_SIZE ranks of a
    machine share its RAM (on CUDA each has its own device)."""
    return estimate.total * (1 if cfg.model.device.startswith("cuda") else int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _estimate(cfg: Config, derived: Derived, arch: ModelConfig, prompt_len: int) -> MemoryEstimate:
    return estimate_run(cfg, derived, arch, prompt_len, int(os.environ.get("WORLD_SIZE", "1")))


AUTO_CHUNK_TOKENS = 2 * GROUP
"""The log-prob chunk `auto` takes: the forward's chunk logits (2 x rows x V) are then no larger than the
backward's groups (4 x GROUP x V, logits_bytes), so a smaller chunk would save nothing, a larger one holds more."""


def saver_options(train: TrainConfig) -> list[MemorySavers]:
    """What `auto` may choose, cheapest first: neither saver; log-probs in chunks of AUTO_CHUNK_TOKENS (more,
    smaller lm_head calls; the backward recomputes the head with chunking off too); and activation
    checkpointing as well (each layer's forward once more in the backward). An explicit value holds in
    every option. Sequence packing (train.max_tokens_per_micro_batch) is never chosen: its grid changes how
    the gradients are summed, so their bits; it stays the user's to set."""
    options: list[MemorySavers] = []
    for checkpointing, chunk in ((False, 0), (False, AUTO_CHUNK_TOKENS), (True, AUTO_CHUNK_TOKENS)):
        option = MemorySavers(checkpointing if train.activation_checkpointing == "auto" else train.activation_checkpointing,
                              chunk if train.logprob_chunk_tokens == "auto" else train.logprob_chunk_tokens)
        if option not in options:
            options.append(option)
    return options


def choose_savers(cfg: Config, derived: Derived, arch: ModelConfig, prompt_len: int,
                  have: int) -> tuple[Derived, MemoryEstimate]:
    """`derived` with the memory savers `auto` leaves to the estimate chosen, and the run's estimate under
    them: the first of saver_options whose need is at most CHOOSE_FRACTION of `have` (one the check neither
    refuses nor warns about, with room for an estimate that runs low), else the one that needs least (which the
    check then warns about or refuses; checkpointing a model of few layers can cost more than it saves: its
    backward holds two layers' working set). A run that fits without savers keeps them off, its numbers
    those of a run without `auto`. The choice is the header's note (MemorySavers.note) when it turned a
    saver on."""
    tried: list[tuple[Derived, MemoryEstimate]] = []
    for option in saver_options(cfg.train):
        with_option = dataclasses.replace(derived, savers=option)
        tried.append((with_option, _estimate(cfg, with_option, arch, prompt_len)))
        if _need(cfg, tried[-1][1]) <= CHOOSE_FRACTION * have:
            break
    else:
        tried.append(min(tried, key=lambda t: _need(cfg, t[1])))  # the first of the least
    chosen, estimate = tried[-1]
    if chosen.savers != tried[0][0].savers:  # `auto` turned a saver on (the first option: it turns none on)
        note = (f"memory savers (auto): {chosen.savers.describe()} (estimate {_need(cfg, estimate) / GIB:.1f} GiB of "
                f"{have / GIB:.1f} available; without: {_need(cfg, tried[0][1]) / GIB:.1f} GiB)")
        chosen = dataclasses.replace(chosen, savers=dataclasses.replace(chosen.savers, note=note))
    return chosen, estimate


def knobs(cfg: Config, savers: MemorySavers, estimate: MemoryEstimate) -> str:
    """What to turn, for the largest terms that a config key shrinks (a saver the run left out, unless `auto`
    has tried it: under run.memory_check)."""
    t, r = cfg.train, cfg.rollout
    tried = {k for k in ("activation_checkpointing", "logprob_chunk_tokens") if getattr(t, k) == "auto"} \
        if cfg.run.memory_check else set()
    batch = f"lower train.micro_batch_size (now {t.micro_batch_size})"
    advice = {
        "activations": [batch] + ([] if savers.checkpointing or "activation_checkpointing" in tried
                                  else ["set train.activation_checkpointing=true"]),
        "logits": [f"set train.logprob_chunk_tokens (now {savers.chunk_tokens}) to e.g. {AUTO_CHUNK_TOKENS}"
                   if "logprob_chunk_tokens" not in tried and (not savers.chunk_tokens or savers.chunk_tokens > AUTO_CHUNK_TOKENS)
                   else batch],
        "KV cache": [f"set rollout.kv_cache_gib (now {r.kv_cache_gib}) lower" if r.backend == "native"
                     else "lower rollout.vllm_gpu_memory_utilization"]
        + (["set precision.kv_cache_fp8=true"] if r.backend == "native" and not cfg.precision.kv_cache_fp8 else []),
        "reward models": (["set task.params.reward_model_dtype=bfloat16"]
                          if reward_model_dtype(cfg.task.params) != "bfloat16" else [])
        + ["use a smaller reward model"],
    }
    advice["backward working set"] = advice["activations"]
    ranked = sorted((t for t in estimate.terms if t.name in advice), key=lambda t: -t.bytes)
    out: list[str] = []
    for term in ranked[:2]:
        out += [a for a in advice[term.name] if a not in out]
    if not out or estimate.total - sum(t.bytes for t in ranked) > sum(t.bytes for t in ranked):
        out.append("use a smaller model or more memory")
    return ", ".join(out)


def check_memory(cfg: Config, derived: Derived, arch: ModelConfig, prompt_len: int) -> Derived:
    """`derived` with the memory savers `auto` leaves to the estimate chosen (choose_savers); then refuse a run
    whose estimate exceeds the memory its processes can have on this machine (MemoryTooSmall, one line: the
    estimate, the memory, the knobs left), and warn on stderr above WARN_FRACTION of it. Under torchrun each
    rank holds a whole trainer and engine for its share of the prompts (WORLD_SIZE), and the LOCAL_WORLD_SIZE
    ranks of this machine share its RAM. Not estimated (`derived` as it is, `auto` savers off): run.memory_check
    =false, and Ray, Megatron and FSDP runs (whose ranks shard the trainer's state; Megatron has neither saver,
    FSDP no activation checkpointing)."""
    if not cfg.run.memory_check or not estimated(cfg):
        return derived
    have, source = available_memory(cfg.model.device)
    derived, estimate = choose_savers(cfg, derived, arch, prompt_len, have)
    need = _need(cfg, estimate)
    biggest = ", ".join(f"{t.name} {t.bytes / GIB:.2f}" for t in sorted(estimate.terms, key=lambda t: -t.bytes)[:3])
    procs = f" x {need // estimate.total} processes" if need != estimate.total else ""
    savers = derived.savers.describe()
    line = (f"this run needs about {need / GIB:.1f} GiB{procs} with every response at rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}{'' if savers == 'none' else ' and ' + savers} (largest: {biggest} GiB; "
            f"`jetflow estimate-memory` lists every term) and the process can have {have / GIB:.1f} GiB ({source})")
    if need > have:
        raise MemoryTooSmall(f"memory: {line}; {knobs(cfg, derived.savers, estimate)}, or set run.memory_check=false "
                             "to try anyway")
    if need > WARN_FRACTION * have:
        print(f"[jetflow] warning: memory: {line}: close to the limit; {knobs(cfg, derived.savers, estimate)} to leave "
              "room", file=sys.stderr)
    return derived


def describe(cfg: Config, derived: Derived) -> str:
    """`jetflow estimate-memory`: the run's terms under the memory savers it would run with (`auto`'s choice
    and why), the memory the process can have, and the verdict."""
    from jetflow.run.build import load_inputs

    if not estimated(cfg):
        return ("not estimated: run.orchestrator=ray, train.backend=megatron and train.backend=fsdp split the run "
                "over processes")
    inputs = load_inputs(cfg)
    have, source = available_memory(cfg.model.device)
    if cfg.run.memory_check:
        derived, estimate = choose_savers(cfg, derived, inputs.arch, inputs.longest_prompt, have)
    else:
        estimate = _estimate(cfg, derived, inputs.arch, inputs.longest_prompt)
    savers = derived.savers.note or f"memory savers: {derived.savers.describe()}" + (
        "" if cfg.run.memory_check else " (run.memory_check=false: `auto` is off)")
    need = _need(cfg, estimate)
    verdict = "does not fit" if need > have else "close to the limit" if need > WARN_FRACTION * have else "fits"
    return (f"{estimate.table()}\n{savers}\n"
            f"available: {have / GIB:.3f} GiB ({source}): {verdict}"
            + (f"; {knobs(cfg, derived.savers, estimate)}" if verdict != "fits" else ""))
