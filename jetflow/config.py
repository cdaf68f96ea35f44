"""Configuration: one dataclass per component, YAML files, and `key=value` overrides (omegaconf).

`load_config("configs/tiny.yaml", ["precision.mode=mixed", "train.steps=5"])` starts from the
dataclass defaults below, merges the YAML, then the overrides. An unknown key or a bad value is an
error that names it and lists what is valid. `save_config` writes the resolved config beside a run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jetflow.errors import UserError
from jetflow.model.model_config import MOE_TYPES
from jetflow.precision.modes import PRECISION_MODES, PrecisionMode
from jetflow.precision.recipe import FAMILIES, FORMATS, SCALE_RULES, FP8Recipe


class ConfigError(UserError, ValueError):
    """A configuration key or value is invalid."""


@dataclass
class PrecisionConfig:
    mode: str = "unified"
    """fp32 | bf16 | mixed (bf16 train, FP8 rollout) | unified (FP8 train and rollout, one recipe)."""
    family: str = "fp8_block"
    """The recipe: fp8_block (128x128 / 1x128 FP8) | mxfp8 (1x32 E4M3, E8M0 scales) | nvfp4 (E2M1 in 16-blocks,
    E4M3 + fp32 scales): Transformer Engine's recipes, jetflow.precision.recipe; `mixed` rolls out in it."""
    fmt: str = "e4m3"
    """e4m3 everywhere, or hybrid (E5M2 gradients)."""
    weight_block: list[int] = field(default_factory=lambda: [128, 128])
    """Weight scaling block (out, in)."""
    group_size: int = 128
    """Activation / gradient group along the contraction dim."""
    scale_rule: str = "fp32"
    """fp32 scale_inv = amax / 448, or pow2 (rounded up to a power of two)."""
    margin: int = 0
    """Extra headroom in powers of two."""
    keep_high_precision: list[str] = field(default_factory=lambda: list(FP8Recipe().keep_high_precision))
    """Module-name patterns that stay in bf16 (default: the recipe's own list: embeddings, lm_head, norms,
    MoE routers)."""
    keep_first_layers: int = 0
    """First N decoder layers stay in bf16."""
    keep_last_layers: int = 0
    """Last N decoder layers stay in bf16."""
    gemm_backend: str = "auto"
    """auto (Hopper torch._scaled_mm when available, else emulation) | scaled_mm | emulate."""
    kv_cache_fp8: bool = False
    """FP8 (E4M3) KV cache in the rollout engine, per-layer scales recalibrated each step."""
    numerics: str = "auto"
    """exact | fast | auto. exact: the rollout engine and the trainer compute every token with the
    batch-invariant kernels (jetflow.kernels), so their log-probs agree bit for bit (CPU; the native
    engine, or vLLM through jetflow's plugin; the native trainer). fast: torch's / vLLM's kernels (BLAS,
    SDPA), a few ulps apart. auto: exact where it runs (CPU, native trainer), else fast."""

    @property
    def precision_mode(self) -> PrecisionMode:
        return PrecisionMode(self.mode)

    def recipe(self) -> FP8Recipe:
        return FP8Recipe(family=self.family, fmt=self.fmt, weight_block=tuple(self.weight_block),
                         group_size=self.group_size, scale_rule=self.scale_rule, margin=self.margin,
                         keep_high_precision=tuple(self.keep_high_precision),
                         keep_first_layers=self.keep_first_layers, keep_last_layers=self.keep_last_layers)


@dataclass
class TinyModelConfig:
    """A small Llama-style model built from scratch (character tokenizer) for tests and quick looks."""
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position: int = 512
    num_experts: int = 0
    """0: a dense Llama-style model. > 0: a mixture-of-experts model (see `moe_family`) with this many
    experts in every layer."""
    moe_family: str = "qwen3_moe"
    """MoE: `qwen3_moe` (q/k norms, renormalized top-k) or `mixtral` (its names: block_sparse_moe, w1/w2/w3)."""
    experts_per_token: int = 2
    """MoE: experts each token is routed to (top-k)."""
    expert_size: int = 128
    """MoE: each expert's intermediate size (a multiple of 128 keeps the FP8 export loadable by vLLM)."""


@dataclass
class ModelConfig:
    path: str = "smollm2"
    """A local Hugging Face directory, `smollm2` (SmolLM2-135M-Instruct converted on first use), or
    `tiny` (built from scratch with a character tokenizer, see `tiny`)."""
    dtype: str = "float32"
    """Master weight dtype: float32 (the CPU default) or bfloat16."""
    device: str = "cpu"
    """cpu | cuda | cuda:N."""
    chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template when it has one."""
    cache_dir: str = ".cache/models"
    """Where converted models (e.g. smollm2) are kept."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class RolloutConfig:
    backend: str = "native"
    """native | vllm."""
    group_size: int = 4
    """Samples per prompt (GRPO group)."""
    max_new_tokens: int = 10
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (in addition to EOS)."""
    max_batch: int = 64
    """Largest batch the engine decodes at once (KV cache is sized from it)."""
    num_engines: int = 1
    """run.orchestrator=ray: rollout engine replicas (Ray actors); each step's requests are split among them."""
    vllm_gpu_memory_utilization: float = 0.2
    """vLLM: fraction of device memory (on CPU: of RAM) reserved for the KV cache."""


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    """arithmetic | countdown | math."""
    params: dict[str, Any] = field(default_factory=dict)
    """Task knobs, e.g. {digits: 1, num_operands: 2} or {path: data.jsonl} for math."""
    format_weight: float = 0.0
    """Extra reward for a well-formed answer."""


@dataclass
class EvalConfig:
    """Held-out evaluation: greedy decoding on problems training never sees (jetflow.run.evaluate)."""
    num_prompts: int = 32
    """Held-out problems per evaluation (0: no evaluation and no held-out split)."""
    every: int = 5
    """Evaluate every this many RL steps, and always before the first and after the last (0: only those)."""
    held_out: float = 0.2
    """Fraction of the task's prompts (by a hash of the prompt text) kept out of training for evaluation."""


@dataclass
class AlgoConfig:
    adv_norm: str = "mean_std"
    """GRPO advantage normalisation: mean_std | mean | none."""
    clip_low: float = 0.2
    clip_high: float = 0.28
    """Asymmetric PPO clipping (clip-higher)."""
    loss_agg: str = "token_mean"
    """token_mean | seq_mean_token_mean | seq_mean_token_sum."""
    kl_coef: float = 0.0
    """KL penalty to the initial (reference) policy. Must be 0 for now: the loss has the term
    (jetflow.rl.loss.policy_loss) but `jetflow train` keeps no reference policy yet."""
    correction: str = "auto"
    """Rollout correction: auto (none for bf16 / unified, token_tis for mixed) | none | token_tis |
    token_mis | seq_tis | seq_mis | ais."""
    correction_params: dict[str, Any] = field(default_factory=dict)
    """Parameters of the correction, e.g. {C: 2.0} or {lo: 0.5, hi: 2.0}."""
    ppo_epochs: int = 1
    """Optimizer passes over each rollout batch."""
    old_logprobs: str = "auto"
    """Where pi_old comes from. auto: with ppo_epochs = 1 and a row-local correction (all but ais), the
    training forward's own detached log-probs (no extra forward); otherwise, and with `recompute`,
    a separate no-grad forward before the update."""
    router_aux_loss_coef: float = 0.0
    """MoE models: weight of the router load-balancing loss (transformers' `load_balancing_loss_func`
    over every MoE layer and every real token of a micro-batch) added to the policy loss; 0 leaves the
    routers to the policy gradient alone (pretrained MoE configs use about 0.001)."""
    routing_replay: bool = False
    """MoE models: the trainer routes every token the rollout ran to the experts the rollout engine
    chose (routing replay), with the router's probabilities at them as the weights; the step's
    `moe/router_flip_frac` says how many tokens the trainer's router alone would have sent elsewhere.
    Native rollout engine and trainer only."""


@dataclass
class TrainConfig:
    backend: str = "native"
    """native | megatron."""
    tensor_parallel_size: int = 1
    """Megatron backend: tensor-parallel ranks (under torchrun or as Ray trainer workers)."""
    pipeline_parallel_size: int = 1
    """Megatron backend: pipeline stages (under torchrun or as Ray trainer workers; jetflow's GPipe
    schedule over Megatron's stages)."""
    expert_parallel_size: int = 1
    """Megatron backend, mixture-of-experts models: expert-parallel ranks (under torchrun or as Ray
    trainer workers), each holding
    num_experts / EP experts; they are data-parallel ranks (own prompts), so the process count must be a
    multiple of EP x pipeline_parallel_size."""
    fp8_backend: str = "jetflow"
    """jetflow (this recipe's own GEMMs) | te (Transformer Engine Float8BlockScaling)."""
    steps: int = 12
    """RL steps."""
    prompts_per_step: int = 6
    lr: float = 2e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    grad_clip: float = 1.0
    micro_batch_size: int = 16
    """Sequences per forward/backward; gradients accumulate over the batch."""
    sft_warmup_steps: int = 0
    """Supervised steps on reference answers before RL (for models trained from scratch)."""
    sft_lr: float = 3e-3
    sft_batch_size: int = 64
    checkpoint_every: int = 0
    """Write a checkpoint every N steps (0: only at the end)."""
    num_workers: int = 1
    """run.orchestrator=ray: trainer workers (Ray actors, data parallel over gloo/NCCL). Under torchrun the
    data-parallel size is torchrun's world size instead."""
    max_bad_steps: int = 3
    """Consecutive NaN/Inf steps tolerated (skipped) before the run stops."""


@dataclass
class RunConfig:
    name: str = "default"
    out_dir: str = "runs"
    """Runs go to <out_dir>/<name>/."""
    seed: int = 0
    resume: bool = False
    """Continue from the last checkpoint in the run directory."""
    progress: bool = True
    """Progress bar on stderr."""
    tensorboard: bool = True
    num_threads: int = 0
    """torch CPU threads (0: torch's default)."""
    orchestrator: str = "local"
    """local (this process, or one per rank under torchrun) | ray (rollout engines and trainer workers as
    Ray actors; weights travel through the object store)."""
    ray_address: str = ""
    """run.orchestrator=ray: an existing cluster's address (`auto` inside a Ray job); empty starts a local one."""
    ray_num_cpus: int = 0
    """Local Ray cluster size (0: all cores)."""
    allow_changes: list[str] = field(default_factory=list)
    """run.resume=true: config keys that may differ from the run's config.yaml (e.g. [train.steps,
    train.lr]); they take effect from the resumed step. Any other difference is refused."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)


CHOICES: dict[str, tuple[str, ...]] = {
    "precision.mode": PRECISION_MODES,
    "precision.family": FAMILIES,
    "precision.fmt": FORMATS,
    "precision.scale_rule": SCALE_RULES,
    "precision.gemm_backend": ("auto", "scaled_mm", "emulate", "triton"),
    "precision.numerics": ("auto", "exact", "fast"),
    "model.dtype": ("float32", "bfloat16"),
    "model.tiny.moe_family": MOE_TYPES,
    "rollout.backend": ("native", "vllm"),
    "task.name": ("arithmetic", "countdown", "math"),
    "algo.adv_norm": ("mean_std", "mean", "none"),
    "algo.loss_agg": ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"),
    "algo.correction": ("auto", "none", "token_tis", "token_mis", "seq_tis", "seq_mis", "ais"),
    "algo.old_logprobs": ("auto", "recompute"),
    "train.backend": ("native", "megatron"),
    "train.fp8_backend": ("jetflow", "te"),
    "run.orchestrator": ("local", "ray"),
}

POSITIVE: tuple[str, ...] = (
    "rollout.group_size", "rollout.max_new_tokens", "rollout.max_batch", "train.prompts_per_step",
    "train.micro_batch_size", "precision.group_size", "train.sft_batch_size", "algo.ppo_epochs",
    "rollout.num_engines", "train.num_workers")


def _valid_keys(node: Any) -> list[str]:
    return sorted(f.name for f in dataclasses.fields(node)) if dataclasses.is_dataclass(node) else []


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: Config) -> Config:
    """Check choices and ranges; raise ConfigError naming the key and the valid values."""
    for key, choices in CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not valid; choose one of {list(choices)}")
    for key in POSITIVE:
        if _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)} must be >= 1")
    if not 0.0 < cfg.rollout.temperature or not 0.0 < cfg.rollout.top_p <= 1.0:
        raise ConfigError("rollout.temperature must be > 0 and rollout.top_p in (0, 1]")
    if cfg.train.steps < 0 or cfg.train.sft_warmup_steps < 0:
        raise ConfigError("train.steps and train.sft_warmup_steps must be >= 0")
    if cfg.train.steps == 0 and cfg.train.sft_warmup_steps == 0:
        raise ConfigError("train.steps=0 and train.sft_warmup_steps=0: the run would do nothing")
    if cfg.train.lr <= 0 or cfg.algo.clip_low < 0 or cfg.algo.clip_high < 0:
        raise ConfigError("train.lr must be > 0 and algo.clip_low / clip_high >= 0")
    _check_ranges(cfg)
    try:
        cfg.precision.recipe()
    except ValueError as e:
        raise ConfigError(f"precision: {e}") from None
    if cfg.precision.numerics == "exact" and _exact_blocker(cfg):
        raise ConfigError(f"precision.numerics=exact: {_exact_blocker(cfg)}; use precision.numerics=fast (or auto)")
    return cfg


def _check_ranges(cfg: Config) -> None:
    """The numeric ranges outside which a run would silently do something else than asked."""
    t, a, r = cfg.train, cfg.algo, cfg.rollout
    checks = [
        ("train.grad_clip", t.grad_clip, t.grad_clip >= 0, ">= 0 (0 turns clipping off)"),
        ("train.min_lr_ratio", t.min_lr_ratio, 0 <= t.min_lr_ratio <= 1, "in [0, 1]"),
        ("train.weight_decay", t.weight_decay, t.weight_decay >= 0, ">= 0"),
        ("train.warmup_steps", t.warmup_steps, t.warmup_steps >= 0, ">= 0"),
        ("train.sft_lr", t.sft_lr, t.sft_lr > 0, "> 0"),
        ("train.betas", t.betas, len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "two values in [0, 1)"),
        ("train.checkpoint_every", t.checkpoint_every, t.checkpoint_every >= 0, ">= 0 (0: only at the end)"),
        ("train.max_bad_steps", t.max_bad_steps, t.max_bad_steps >= 0, ">= 0"),
        ("rollout.top_k", r.top_k, r.top_k >= 0, ">= 0 (0 turns top-k off)"),
        ("eval.num_prompts", cfg.eval.num_prompts, cfg.eval.num_prompts >= 0, ">= 0 (0 turns evaluation off)"),
        ("eval.every", cfg.eval.every, cfg.eval.every >= 0, ">= 0 (0: before the first and after the last step only)"),
        ("eval.held_out", cfg.eval.held_out, 0 < cfg.eval.held_out < 1 or cfg.eval.num_prompts == 0,
         "in (0, 1) when eval.num_prompts > 0"),
        ("rollout.group_size", r.group_size, r.group_size >= 2,
         ">= 2: GRPO's advantage is a reward minus its group's mean, so one sample per prompt learns nothing"),
        ("algo.router_aux_loss_coef", a.router_aux_loss_coef, a.router_aux_loss_coef >= 0, ">= 0 (0 turns it off)"),
        ("algo.kl_coef", a.kl_coef, a.kl_coef == 0,
         "0: a KL penalty needs a reference policy, which `jetflow train` does not keep yet"),
    ]
    for key, value, ok, valid in checks:
        if not ok:
            raise ConfigError(f"{key}={value!r} is out of range; it must be {valid}")


def _exact_blocker(cfg: Config) -> str | None:
    """Why exact numerics cannot run with this config, or None."""
    if cfg.model.device.startswith("cuda"):
        from jetflow.kernels.triton import available
        if not available():
            return "on CUDA the batch-invariant kernels are Triton's: pip install triton==3.6.0"
    elif not cfg.model.device.startswith("cpu"):
        return f"the batch-invariant kernels run on the CPU and on CUDA (model.device={cfg.model.device})"
    if cfg.train.backend == "megatron" and (k := _megatron_unsplit_k(cfg)):
        return (f"train.backend=megatron with train.tensor_parallel_size={cfg.train.tensor_parallel_size} cannot split "
                f"a row-parallel K of {k} into whole canonical 128-block groups (jetflow.kernels.canonical)")
    return None


def _megatron_unsplit_k(cfg: Config) -> int | None:
    """A row-parallel K of the tiny model (o_proj: hidden, down_proj: intermediate) that the Megatron
    trainer's tensor parallelism cannot split exactly (tree_width(K) not a multiple of TP), else None. A
    checkpoint's shapes are checked when the policy is built (jetflow.train.megatron.checks)."""
    from jetflow.kernels.canonical import tree_width

    tp, tiny = cfg.train.tensor_parallel_size, cfg.model.tiny
    if tp == 1 or cfg.model.path != "tiny":
        return None
    return next((k for k in (tiny.hidden_size, tiny.intermediate_size) if tree_width(k) % tp), None)


def resolve_numerics(cfg: Config) -> str:
    """precision.numerics with `auto` resolved: exact wherever it can run, else fast."""
    if cfg.precision.numerics != "auto":
        return cfg.precision.numerics
    if cfg.model.device.startswith("cuda"):
        return "fast"  # the Triton kernels are unmeasured on a GPU yet: exact on CUDA is asked for by name
    return "fast" if _exact_blocker(cfg) else "exact"


def _explain(e: OmegaConfBaseException) -> ConfigError:
    key = getattr(e, "full_key", None) or getattr(e, "key", None)
    msg = str(e).splitlines()[0]
    if key:
        parent = Config()
        parts = str(key).split(".")
        for part in parts[:-1]:
            parent = getattr(parent, part, None)
        valid = _valid_keys(parent)
        hint = f"; valid keys here: {valid}" if valid and parts[-1] not in valid else ""
        return ConfigError(f"config key {key!r}: {msg}{hint}")
    return ConfigError(f"config: {msg}")


# free-form mappings: `key={...}` replaces the mapping (a dotted sub-key, `task.params.digits=2`, merges)
REPLACED_BY_OVERRIDE = ("task.params", "algo.correction_params")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- `key=value` overrides, in order; validated."""
    base = OmegaConf.structured(Config)
    try:
        if path is not None:
            path = Path(path)
            if not path.is_file():
                raise ConfigError(f"config file not found: {path}")
            loaded = OmegaConf.load(path)
            if not isinstance(loaded, DictConfig):
                raise ConfigError(f"{path}: a config is a mapping of sections (model:, train:, ...), got a "
                                  f"{type(loaded).__name__.replace('Config', '').lower()}")
            base = OmegaConf.merge(base, loaded)
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"overrides must look like key=value, got {bad}")
        for override in overrides:
            key = override.split("=", 1)[0].strip()
            if key in REPLACED_BY_OVERRIDE:
                OmegaConf.update(base, key, OmegaConf.select(OmegaConf.from_dotlist([override]), key), merge=False)
            else:
                base = OmegaConf.merge(base, OmegaConf.from_dotlist([override]))
        cfg = OmegaConf.to_object(base)
    except OmegaConfBaseException as e:
        raise _explain(e) from None
    except yaml.YAMLError as e:  # a syntax error in the file
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    return validate(cfg)


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


# run.* keys a resumed (or re-run) session may change without changing the run's results
SESSION_KEYS = ("resume", "progress", "tensorboard", "num_threads", "out_dir", "allow_changes")


def config_changes(saved: Config, cfg: Config) -> list[str]:
    """The dotted keys whose values differ between two configs, session keys aside."""
    def comparable(c: Config) -> dict:
        d = to_dict(c)
        for k in SESSION_KEYS:
            d["run"].pop(k, None)
        return d

    def diff(a, b, prefix: str = "") -> list[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            return [k for key in sorted(set(a) | set(b)) for k in diff(a.get(key), b.get(key), f"{prefix}{key}.")]
        return [] if a == b else [prefix.rstrip(".")]
    return diff(comparable(saved), comparable(cfg))


def check_resumed_config(cfg: Config, path: str | Path) -> None:
    """On resume (run.resume=true, the run's config file `path` exists) the run must go on with the
    config it was started with: a difference not listed in run.allow_changes is refused by name."""
    path = Path(path)
    if not (cfg.run.resume and path.exists()):
        return
    changed = [k for k in config_changes(load_config(path), cfg) if k not in cfg.run.allow_changes]
    if changed:
        raise ConfigError(f"run.resume=true: {path.parent} was started with another config "
                          f"({', '.join(changed)} differ from its {path.name}); resume with the same values, "
                          f"allow the change with run.allow_changes=[{','.join(changed)}], or choose another "
                          "run.name")
