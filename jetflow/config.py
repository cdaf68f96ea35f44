"""Configuration: one dataclass per component, YAML files, and `key=value` overrides (omegaconf).
`load_config("configs/tiny.yaml", ["precision.mode=mixed"])` merges defaults <- YAML <- overrides. The schema
is typed: an unknown key, a wrong type, or a choice outside a `Literal` is an error that names the key and
lists what is valid; ranges and combinations are jetflow.run.validate's. `config_text` is what a run saves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_type_hints

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jetflow import trackers
from jetflow.errors import UserError
from jetflow.model.model_config import MOE_TYPES
from jetflow.precision.modes import PRECISION_MODES, PrecisionMode
from jetflow.precision.plan import Precision
from jetflow.precision.recipe import FAMILIES, FORMATS, SCALE_RULES, QuantRecipe
from jetflow.rl import correction_parameters


class ConfigError(UserError, ValueError):
    """A configuration key or value is invalid."""


@dataclass
class PrecisionConfig:
    mode: Literal[PRECISION_MODES] = "unified"
    """fp32 | bf16 | mixed (bf16 train, FP8 rollout) | unified (FP8 train and rollout, one recipe)."""
    family: Literal[FAMILIES] = "fp8_block"
    """The recipe: fp8_block (128x128 / 1x128 FP8) | mxfp8 (1x32 E4M3, E8M0 scales) | nvfp4 (E2M1 in 16-blocks,
    E4M3 + fp32 scales): Transformer Engine's recipes, jetflow.precision.recipe; `mixed` rolls out in it."""
    fmt: Literal[FORMATS] = "e4m3"
    """e4m3 everywhere, or hybrid (E5M2 gradients)."""
    weight_block: list[int] = field(default_factory=lambda: [128, 128])
    """Weight scaling block (out, in)."""
    group_size: int = 128
    """Activation / gradient group along the contraction dim."""
    scale_rule: Literal[SCALE_RULES] = "fp32"
    """fp32 scale_inv = amax / 448, or pow2 (rounded up to a power of two)."""
    margin: int = 0
    """Extra headroom in powers of two."""
    keep_high_precision: list[str] = field(default_factory=lambda: list(QuantRecipe().keep_high_precision))
    """Module-name patterns that stay in bf16 (default: the recipe's own list: embeddings, lm_head, norms,
    MoE routers)."""
    dgrad: Literal["fp8", "bf16"] = "fp8"
    """The input-gradient GEMM: fp8 (the recipe's) or bf16 (fp8_block; jetflow.precision.recipe)."""
    wgrad: Literal["fp8", "bf16"] = "fp8"
    """The weight-gradient GEMM: fp8 or bf16 (the input saved in bf16). dgrad=bf16 wgrad=bf16: forward-only FP8."""
    keep_first_layers: int = 0
    """First N decoder layers stay in bf16."""
    keep_last_layers: int = 0
    """Last N decoder layers stay in bf16."""
    gemm_backend: Literal["auto", "scaled_mm", "emulate", "triton"] = "auto"
    """auto (Hopper torch._scaled_mm when available, else emulation) | scaled_mm | emulate | triton."""
    kv_cache_fp8: bool = False
    """FP8 (E4M3) KV cache in the rollout engine, per-layer scales recalibrated each step."""
    numerics: Literal["auto", "exact", "fast"] = "auto"
    """exact | fast | auto. exact: the rollout engine and the trainer compute every token with the
    batch-invariant kernels (jetflow.kernels), so their log-probs agree bit for bit (CPU; the native
    engine, or vLLM through jetflow's plugin; the native trainer). fast: torch's / vLLM's kernels (BLAS,
    SDPA), a few ulps apart. auto: exact where it runs (CPU, native trainer), else fast."""

    @property
    def precision_mode(self) -> PrecisionMode:
        return PrecisionMode(self.mode)

    def recipe(self) -> QuantRecipe:
        return QuantRecipe(family=self.family, fmt=self.fmt, weight_block=tuple(self.weight_block),
                         group_size=self.group_size, scale_rule=self.scale_rule, margin=self.margin,
                         dgrad=self.dgrad, wgrad=self.wgrad,
                         keep_high_precision=tuple(self.keep_high_precision),
                         keep_first_layers=self.keep_first_layers, keep_last_layers=self.keep_last_layers)


@dataclass
class TinyModelConfig:
    """A small Llama-style model built from scratch (character tokenizer) for tests and quick looks."""
    hidden_size: int = 128
    """Width of the residual stream (the embedding size)."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention (query) heads; the head size is hidden_size / num_heads."""
    num_kv_heads: int = 2
    """Key / value heads (grouped-query attention: num_heads must be a multiple of it)."""
    intermediate_size: int = 384
    """The SwiGLU MLP's inner width (a dense model's; a MoE expert's is expert_size)."""
    max_position: int = 512
    """Positions the model has: a prompt and its response (or a whole conversation) must fit in them."""
    num_experts: int = 0
    """0: a dense Llama-style model. > 0: a mixture-of-experts model (see `moe_family`) with this many experts a layer."""
    moe_family: Literal[MOE_TYPES] = "qwen3_moe"
    """MoE: `qwen3_moe` (q/k norms, renormalized top-k) or `mixtral` (its names: block_sparse_moe, w1/w2/w3)."""
    experts_per_token: int = 2
    """MoE: experts each token is routed to (top-k)."""
    expert_size: int = 128
    """MoE: each expert's intermediate size (a multiple of 128 keeps the FP8 export loadable by vLLM)."""


LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAConfig:
    """LoRA (jetflow.precision.lora): each targeted linear of the decoder layers computes base(x) + alpha / rank
    x ((x A^T) B^T) with a frozen base and trained fp32 adapters A (rank, in), B (out, rank); the trainer's
    optimizer sees the adapters alone, and after the first weight update only they travel to the engine."""
    rank: int = 0
    """Adapter rank r (0: LoRA off, the whole model trains)."""
    alpha: float = 16.0
    """The adapters' scale is alpha / rank (PEFT's convention without rsLoRA)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    """Module-name patterns of the decoder layers' linears to adapt: a name's last parts (q_proj, mlp.up_proj)
    or an fnmatch pattern of the whole name (model.layers.1.*); default: the attention and MLP projections."""
    dropout: float = 0.0
    """Dropout on the adapters' input. Only 0: dropout makes the trainer's forward another function than the
    rollout engine's (off-policy by design), so it is refused."""


@dataclass
class PolicyConfig:
    """The `model:` section: which policy model the run trains, its master dtype and device, and how
    prompts are rendered (the architecture itself is jetflow.model.ModelConfig)."""
    path: str = "smollm2"
    """A local Hugging Face directory, `smollm2` (SmolLM2-135M-Instruct converted on first use), or `tiny` (see `tiny`)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Master weight dtype: float32 (the CPU default) or bfloat16."""
    device: str = "cpu"
    """cpu | cuda | cuda:N."""
    chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template when it has one."""
    cache_dir: str = ".cache/models"
    """Where converted models (e.g. smollm2) are kept."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class RolloutConfig:
    backend: Literal["native", "vllm"] = "native"
    """native | vllm."""
    group_size: int = 4
    """Samples per prompt (GRPO group)."""
    max_new_tokens: int = 10
    """Most tokens generated per response (per turn under rollout.max_turns > 1); a response that reaches it ends
    with finish reason `length`."""
    temperature: float = 1.0
    """Sampling temperature (> 0); the rollout's log-probs are those of the tempered distribution,
    log_softmax(logits / temperature), as the trainer computes them."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p (1.0: all)."""
    top_k: int = 0
    """0 disables top-k."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (in addition to EOS)."""
    max_batch: int = 64
    """Largest batch the engine decodes at once."""
    kv_cache_gib: float | None = None
    """The KV cache's budget in GiB: a pool of 64-position pages shared by the requests (memory follows the tokens
    held; a waiting request starts when pages free up, the youngest is preempted and recomputed when they run out).
    Native engine, and vLLM on the CPU (on a GPU vLLM takes vllm_gpu_memory_utilization). null: native, room for
    max_batch sequences of the longest prompt + max_new_tokens at fp32; vLLM, max_batch full-length ones in its cache
    dtype (FP8: 1 byte), plus 25%."""
    num_engines: int = 1
    """run.orchestrator=ray: rollout engine replicas (Ray actors); each step's requests are split among them."""
    vllm_gpu_memory_utilization: float = 0.2
    """vLLM: fraction of device memory (on CPU: of RAM) reserved for the KV cache."""
    max_turns: int = 1
    """Model turns per conversation (multi-turn rollouts: a custom task with task.params.tools or task.params.env,
    jetflow.rollout.conversation). 1: one response per prompt, as ever. max_new_tokens is then per turn."""
    max_total_tokens: int = 0
    """Multi-turn: most tokens of a conversation, its prompt, every turn and every observation; one that reaches it
    ends with finish reason `length` and is trained on what it has. 0: the longest prompt + 2 x max_turns x
    max_new_tokens."""
    tool_format: Literal["hermes"] = "hermes"
    """How the model writes a tool call (jetflow.rollout.tool_format): hermes, <tool_call>{"name": ..., "arguments":
    {...}}</tool_call>, as vLLM's hermes parser reads it."""
    tool_timeout_s: float = 30.0
    """Multi-turn: the longest a tool call may run; past it the model reads a timeout error as the tool's result."""
    max_staleness: int = 0
    """Asynchronous RL with bounded staleness (jetflow.run.ahead). 0: the synchronous loop (the engine generates step t's
    samples with the weights step t trains from). k > 0: the engine runs in a process of its own beside the trainer and
    generates step t's samples while the trainer trains the steps before it, under the weights the trainer had at the
    start of step t - k (step 0's for t < k): each sample is k weight versions old, exactly, and carries its version.
    The update is decoupled PPO's: the clipped ratio against the trainer's current weights (the proximal policy), each
    token weighted by pi_proximal / pi_behaviour truncated (algo.correction=auto is then token_tis; none leaves the
    staleness uncorrected). The native engine: under run.orchestrator=local in a process beside one trainer process,
    under run.orchestrator=ray the engine actors (docs/async.md)."""
    engine_threads: int = 0
    """rollout.max_staleness > 0: torch threads of the engine's process (0: half of run.num_threads, or of the cores
    when that is 0); the trainer keeps the rest. Under run.orchestrator=ray: each engine actor's threads (0:
    run.num_threads, as the trainer workers')."""
    inflight_updates: Literal["off", "reprefill", "keep_kv"] = "off"
    """rollout.max_staleness > 0: in-flight weight updates (PipelineRL's, NeMo-RL's): the batch generated ahead takes the
    next weight update half way (after rollout.inflight_swap_step decode steps, by default ceil(max_new_tokens / 2): a
    fixed point, so that a run stays a function of its seed; jetflow.run.inflight), its requests going on under the new
    weights, every token tagged with its version (Rollouts.token_versions). off: the batch is generated under one
    version. reprefill: at the swap every running request's prefix is prefilled again under the new weights, so each
    token's behaviour log-prob is exactly its version's policy given its prefix (a prefill of every running request per
    swap). keep_kv: the prefix's KV pages are kept (as PipelineRL and NeMo-RL do: cheaper), so the tokens after the swap
    come from no single version's policy. A checkpoint hands a paused batch its update first; a batch that gets none
    before it is taken (a skipped step) finishes under its version."""
    inflight_swap_step: int = 0
    """rollout.inflight_updates: the decode step of the batch after which it takes the next weight update (0:
    ceil(max_new_tokens / 2)). Requests that ended before it are one version's; set it below the typical response
    length (a short-answer task's few tokens) for the swap to meet running requests."""
    split_mismatch: bool = False
    """rollout.max_staleness > 0: log a stale batch's mismatch split into numerics and staleness
    (mismatch/numerics_kl_k3, mismatch/staleness_kl_k3, jetflow.run.staleness_split): the trainer keeps a copy of
    each weight update it sent while batches of its version may come, and recomputes a stale batch's log-probs
    under the version that sampled it. Costs a trainer forward per stale step, a model copy and up to k + 1
    updates' bytes. Ignored at 0 (the mismatch is numerics alone)."""


@dataclass
class TaskConfig:
    name: Literal["arithmetic", "countdown", "math", "custom"] = "arithmetic"
    """arithmetic | countdown | math | custom (your data file and reward functions: jetflow.tasks.custom)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Task knobs, e.g. {digits: 1, num_operands: 2}, {path: data.jsonl} for math, or for custom {path, prompt_key,
    answer_key, reward, reward_weights, pass_threshold, split} (docs/own-task.md). Tasks read from a data file
    also take max_prompt_tokens: rows whose prompt is longer are dropped, with a warning that counts them."""
    format_weight: float = 0.0
    """Extra reward for a well-formed answer."""


@dataclass
class EvalConfig:
    """Held-out evaluation: greedy decoding on problems training never sees (jetflow.run.loop.RLLoop.evaluate)."""
    num_prompts: int = 32
    """Held-out problems per evaluation (0: no evaluation and no held-out split)."""
    every: int = 5
    """Evaluate every this many RL steps, and always before the first and after the last (0: only those)."""
    held_out: float = 0.2
    """Fraction of the task's prompts (by a hash of the prompt text) kept out of training for evaluation."""


@dataclass
class AlgoConfig:
    adv_norm: Literal["mean_std", "mean", "none"] = "mean_std"
    """GRPO advantage normalisation: mean_std | mean | none."""
    clip_low: float = 0.2
    """PPO clipping below: the ratio is clipped at 1 - clip_low (jetflow.rl.loss)."""
    clip_high: float = 0.28
    """PPO clipping above: the ratio is clipped at 1 + clip_high (asymmetric clipping, DAPO's clip-higher)."""
    loss_agg: Literal["auto", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = "auto"
    """auto | token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm (Dr. GRPO;
    jetflow.rl.loss). auto: the aggregation the ratio level defines (loss_aggregation): token_mean, or
    seq_mean_token_mean under ratio_level=sequence (GSPO), as verl's GSPO recipe sets it."""
    loss_scale_factor: int = 0
    """loss_agg=seq_mean_token_sum_norm (Dr. GRPO): the constant each sequence's token sum is divided by; 0:
    rollout.max_new_tokens."""
    ratio_level: Literal["token", "sequence"] = "token"
    """token: PPO's per-token importance ratio. sequence: GSPO's per-sequence ratio, the geometric mean of the
    tokens' ratios (jetflow.rl.loss); loss_agg=auto then aggregates per sequence (seq_mean_token_mean)."""
    kl_coef: float = 0.0
    """KL penalty to the frozen reference (jetflow.train.reference); log_ref_kl: log `kl/ref` at 0 too."""
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    """The per-token estimator of KL(pi || pi_ref) the penalty uses, by verl's names and formulas (jetflow.rl.kl)."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL penalty goes. loss: kl_coef x the estimator, added to the policy loss. reward: each
    sequence's reward less kl_coef x its summed estimator, before the advantages."""
    log_ref_kl: bool = False
    """Keep the reference policy and log `kl/ref` (pi_old against it) also at kl_coef = 0, with no penalty."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose samples all got the same reward (no advantage, no gradient) are
    dropped and refilled by more rollout rounds (jetflow.run.loop); `sampling/kept_group_frac` each step."""
    dynamic_sampling_max_rounds: int = 3
    """dynamic_sampling: the most extra rollout rounds a step runs to refill the dropped groups."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: a response that runs into the last N tokens of rollout.max_new_tokens
    loses reward in proportion to how far in it runs, up to overlong_penalty (jetflow.rl.shaping). 0: off."""
    overlong_penalty: float = 1.0
    """overlong_buffer: the largest reward penalty, reached at rollout.max_new_tokens."""
    correction: Literal["auto", "none", "token_tis", "token_mis", "seq_tis", "seq_mis", "ais"] = "auto"
    """Rollout correction: auto (none for bf16 / unified, token_tis for mixed or rollout.max_staleness > 0) | none |
    token_tis | token_mis | seq_tis | seq_mis | ais. Its weight is taken on pi_old / pi_rollout, which under
    staleness is the proximal policy against the behaviour one: numerics and staleness together."""
    correction_params: dict[str, float] = field(default_factory=dict)
    """The correction's parameters (jetflow.rl.correction.PARAMETERS): {cap: 2.0} for token_tis / seq_tis,
    {lo: 0.5, hi: 2.0} for token_mis / seq_mis, {cap, kl_scale, chi2_scale, ess_power} for ais."""
    ppo_epochs: int = 1
    """Optimizer passes over each rollout batch."""
    old_logprobs: Literal["auto", "recompute"] = "auto"
    """Where pi_old comes from. auto: with ppo_epochs = 1 and a row-local correction (all but ais), the training
    forward's own detached log-probs; otherwise, and with `recompute`, a separate no-grad forward."""
    router_aux_loss_coef: float = 0.0
    """MoE models: weight of the router load-balancing loss (transformers' `load_balancing_loss_func` over every
    MoE layer and real token of a micro-batch) in the policy loss; 0: none (pretrained MoE configs: ~0.001)."""
    routing_replay: bool = False
    """MoE models: the trainer routes every token to the experts the rollout engine chose (routing replay),
    weighted by its router's probabilities; `moe/router_flip_frac`: tokens its router alone would send
    elsewhere. Native rollout engine and trainer only."""


@dataclass
class TrainConfig:
    backend: Literal["native", "megatron", "fsdp"] = "native"
    """native | megatron | fsdp (the native Decoder sharded with FSDP2, torchrun or Ray: jetflow.train.fsdp)."""
    tensor_parallel_size: int = 1
    """Megatron backend: tensor-parallel ranks (under torchrun or as Ray trainer workers)."""
    pipeline_parallel_size: int = 1
    """Megatron backend: pipeline stages (under torchrun or as Ray trainer workers; jetflow's GPipe
    schedule over Megatron's stages)."""
    expert_parallel_size: int = 1
    """Megatron backend, mixture-of-experts models: expert-parallel ranks (torchrun or Ray trainer workers), each
    holding num_experts / EP experts; data-parallel ranks too, so processes are a multiple of EP x PP."""
    data_parallel_shard_size: int = 0
    """FSDP backend: ranks one shard group spans (0: all); fewer gives HSDP, world / this many replicas."""
    steps: int = 12
    """RL steps."""
    prompts_per_step: int = 6
    """Prompts of one RL step (of the whole run, over every data-parallel rank); each is sampled
    rollout.group_size times."""
    lr: float = 2e-5
    """AdamW's peak learning rate of the RL phase (after warmup_steps, then cosine decay to lr * min_lr_ratio)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay of the linears' matrices (norms, biases and the embedding are never decayed)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's (beta1, beta2)."""
    warmup_steps: int = 0
    """RL steps of linear learning-rate warm-up from lr / warmup_steps to lr (0: none)."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    grad_clip: float = 1.0
    """Clip the gradient's global norm to this before each optimizer step (0: no clipping)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward; gradients accumulate over the batch."""
    sft_warmup_steps: int = 0
    """Supervised steps on reference answers before RL (for models trained from scratch)."""
    sft_lr: float = 3e-3
    """The supervised warm-up's peak learning rate (its own AdamW: 10% linear warm-up, then cosine decay;
    jetflow.run.warmup)."""
    sft_batch_size: int = 64
    """Problems per supervised warm-up step (over every data-parallel rank)."""
    checkpoint_every: int = 0
    """Write a checkpoint every N steps (0: only at the end)."""
    num_workers: int = 1
    """run.orchestrator=ray: trainer workers (Ray actors, data parallel over gloo/NCCL). Under torchrun the
    data-parallel size is torchrun's world size instead."""
    max_bad_steps: int = 3
    """Consecutive NaN/Inf steps tolerated (skipped) before the run stops."""
    logprob_chunk_tokens: int | Literal["auto"] = "auto"
    """Native backend: response positions sent through lm_head at a time when computing log-probs (forward
    and backward, jetflow.model.chunked_logprobs), so the (tokens x vocab) logits never exist whole
    (0: one call). The same log-probs bit for bit under exact numerics. auto: 0, or chunks of 512 where the
    memory estimate says the run needs them to fit (MemorySavers; jetflow.run.memory_estimate.choose_savers)."""
    activation_checkpointing: bool | Literal["auto"] = "auto"
    """Native backend: keep only each decoder layer's input in the forward and recompute the layer in
    the backward (torch.utils.checkpoint); memory for time, the same gradients under exact numerics.
    auto: false, or true where the memory estimate says the run needs it (after chunked log-probs) to fit."""
    release_host_memory: bool = True
    """With activation_checkpointing: give the heap's freed pages back to the OS after each layer's forward
    and backward (glibc malloc_trim, jetflow.host_memory), once more than 256 MiB lie free. Host memory for
    time: on the CPU a 4096-token SmolLM2 step peaks at 3.75 instead of 6.58 GB for 8% more CPU (page
    faults, on the huge pages `jetflow` asks torch for; results/long-train/README.md). The same numbers."""
    max_tokens_per_micro_batch: int | None = 0
    """Native backend: sequence packing. Each micro-batch is one row of whole sequences (prompt + response)
    side by side without padding, up to this many tokens, in batch order (a longer sequence alone); each
    sequence keeps its own positions and attention (jetflow.train.packing). Replaces micro_batch_size.
    The same log-probs bit for bit under exact numerics; algo.loss_agg unchanged. 0 / null: padded rows."""


@dataclass
class RunConfig:
    name: str = "default"
    """The run's name: its directory is <out_dir>/<name>/ (a run directory has one owner at a time: its LOCK)."""
    out_dir: str = "runs"
    """Runs go to <out_dir>/<name>/."""
    seed: int = 0
    """The run's seed: model initialisation, the supervised warm-up, and the RL phase's draws unless run.rl_seed is set."""
    rl_seed: int | None = None
    """The RL phase's draws (sampling seeds, training and held-out problems); null: run.seed. RL replicates from one
    warm-up differ in it alone (an ablation axis its shared_warmup ignores). The warm-up and model init use run.seed."""
    resume: bool = False
    """Continue from the last checkpoint in the run directory."""
    progress: bool = True
    """Progress bar on stderr."""
    loggers: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Trackers besides metrics.jsonl (jetflow.trackers): tensorboard | wandb (offline unless WANDB_MODE says
    otherwise, <run>/wandb) | mlflow (<run>/mlruns, or run.mlflow_tracking_uri). A resume continues their runs."""
    tensorboard: bool | None = None
    """Deprecated alias of run.loggers: false drops tensorboard from it, true adds it."""
    tracker_project: str = "jetflow"
    """The W&B project and the MLflow experiment the run is logged under."""
    mlflow_tracking_uri: str = ""
    """MLflow's store (empty: a SQLite store in <run>/mlruns; or e.g. http://host:5000)."""
    num_threads: int = 0
    """torch CPU threads (0: torch's default)."""
    orchestrator: Literal["local", "ray"] = "local"
    """local (this process, or one per rank under torchrun) | ray (rollout engines and trainer workers as
    Ray actors; weights travel through the object store)."""
    ray_address: str = ""
    """run.orchestrator=ray: an existing cluster's address (`auto` inside a Ray job); empty starts a local one."""
    ray_num_cpus: int = 0
    """Local Ray cluster size (0: all cores)."""
    allow_changes: list[str] = field(default_factory=list)
    """run.resume=true: config keys that may differ from the run's config.yaml (e.g. [train.steps,
    train.lr]); they take effect from the resumed step. Any other difference is refused."""
    memory_check: bool = True
    """Estimate the run's memory before it starts (jetflow.run.memory_estimate), choose the memory savers left to
    `auto` by it (train.logprob_chunk_tokens, train.activation_checkpointing), and refuse a run that cannot fit in what
    the process can have (RAM and cgroup limit on the CPU, free device memory on CUDA); warn when close. false skips it,
    and `auto` savers are off."""


@dataclass
class Config:
    model: PolicyConfig = field(default_factory=PolicyConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)


def _valid_keys(node: Any) -> list[str]:
    return sorted(f.name for f in dataclasses.fields(node)) if dataclasses.is_dataclass(node) else []


@dataclass(frozen=True)
class MemorySavers:
    """The native trainer's memory savers as the trainer runs them: train.activation_checkpointing and
    train.logprob_chunk_tokens with `auto` resolved. Both trade compute for memory and leave the numbers
    as they are under exact numerics (jetflow.train.checkpointing, jetflow.model.chunked_logprobs)."""
    checkpointing: bool = False
    chunk_tokens: int = 0  # 0: the log-probs' lm_head in one call
    note: str = ""
    """What the run's header says of a saver `auto` turned on, and why (empty: none)."""

    @staticmethod
    def of(train: TrainConfig) -> MemorySavers:
        """The explicit values, `auto` as off: what a run has before its memory estimate resolves `auto`
        (jetflow.run.memory_estimate.choose_savers), and what a Trainer built outside a run (a bench, a
        test) runs."""
        chunk = train.logprob_chunk_tokens
        return MemorySavers(train.activation_checkpointing is True, 0 if chunk == "auto" else chunk)

    def describe(self) -> str:
        parts = (["activation checkpointing"] if self.checkpointing else []) + (
            [f"log-prob chunks of {self.chunk_tokens}"] if self.chunk_tokens else [])
        return " + ".join(parts) or "none"


@dataclass(frozen=True)
class Derived:
    """What a config implies, worked out once by `derive` (the pre-run pass) and handed to the builders."""
    precision: Precision  # the run's precision (jetflow.precision.plan): mode, recipe, numerics, GEMM backend
    correction: str  # algo.correction; `auto`: token TIS where the rollout differs by design (mixed, stale), else none
    loggers: tuple[str, ...] = ()  # the trackers the run logs to (run_loggers)
    savers: MemorySavers = MemorySavers()
    """The trainer's memory savers: derive's explicit values (`auto` off), then the memory estimate's choice
    for `auto` (jetflow.run.memory_estimate.check_memory, in jetflow.run.validate.validate_run)."""


def conversation_tokens(rollout: RolloutConfig, longest_prompt: int) -> int:
    """The most positions one request takes: a prompt and one response, or under rollout.max_turns > 1 a whole
    conversation (rollout.max_total_tokens; 0: the longest prompt + 2 x max_turns x max_new_tokens)."""
    if rollout.max_turns <= 1:
        return longest_prompt + rollout.max_new_tokens
    return rollout.max_total_tokens or longest_prompt + 2 * rollout.max_turns * rollout.max_new_tokens


def derive(cfg: Config) -> Derived:
    """The config's derived values, each checked: a value that cannot be derived, or that this machine
    cannot run, is a ConfigError naming the key (a recipe field out of range, a correction parameter the
    correction does not take, exact numerics without their kernels, a logger whose library is absent)."""
    p, tiny, loggers = cfg.precision, cfg.model.tiny, tuple(run_loggers(cfg.run))
    # token TIS where the rollout differs by design: the mixed recipe's numerics, or staleness (decoupled PPO's weight)
    auto = "token_tis" if p.precision_mode.off_policy_by_design or cfg.rollout.max_staleness else "none"
    correction = auto if cfg.algo.correction == "auto" else cfg.algo.correction
    if why := trackers.unusable(loggers):
        raise ConfigError(f"run.loggers: {why}")
    split = cfg.train.backend == "megatron" and cfg.model.path == "tiny"  # a checkpoint's Ks: when the policy is built
    try:  # the recipe checks its own fields (blocks, margins, layer counts)
        precision = Precision.resolve(p.precision_mode, p.recipe(), p.numerics, p.gemm_backend, p.kv_cache_fp8,
                                      cfg.model.device, (tiny.hidden_size, tiny.intermediate_size) if split else (),
                                      cfg.train.tensor_parallel_size)
    except ValueError as e:
        raise ConfigError(f"precision: {e}") from None
    if p.numerics == "exact" and precision.exact_blocker:
        raise ConfigError(f"precision.numerics=exact: {precision.exact_blocker}; use precision.numerics=fast (or auto)")
    if cfg.rollout.backend == "vllm" and precision.kv_cache_fp8 and not precision.is_exact:
        raise ConfigError("precision.kv_cache_fp8=true with rollout.backend=vllm needs precision.numerics=exact (or "
                          "auto): only jetflow's plugin loads the per-step FP8 KV scales")
    try:
        correction_parameters(correction, cfg.algo.correction_params)
    except ValueError as e:
        why = f"; algo.correction=auto is {correction} under precision.mode={p.mode}"
        raise ConfigError(f"algo.correction_params: {e}{why if cfg.algo.correction == 'auto' else ''}") from None
    return Derived(precision, correction, loggers, MemorySavers.of(cfg.train))


def _explain(e: OmegaConfBaseException) -> ConfigError:
    key = getattr(e, "full_key", None) or getattr(e, "key", None)
    msg = str(e).splitlines()[0]
    if key:
        parent = Config()
        parts = str(key).split(".")
        for part in parts[:-1]:
            parent = vars(parent).get(part) if dataclasses.is_dataclass(parent) else None  # None: not a section
        choices = _choices(parent, parts[-1])
        if choices and "expected one of" in msg:
            return ConfigError(f"{key}={getattr(e, 'value', None)!r} is not valid; choose one of {list(choices)}")
        valid = _valid_keys(parent)
        hint = f"; valid keys here: {valid}" if valid and parts[-1] not in valid else ""
        return ConfigError(f"config key {key!r}: {msg}{hint}")
    return ConfigError(f"config: {msg}")


def _choices(section: Any, name: str) -> tuple | None:
    """The values a `Literal` field of a config section takes, else None."""
    if not dataclasses.is_dataclass(section):
        return None
    hint = get_type_hints(type(section)).get(name)
    return get_args(hint) if getattr(hint, "__origin__", None) is Literal else None


# free-form mappings: `key={...}` replaces the mapping (a dotted sub-key, `task.params.digits=2`, merges)
REPLACED_BY_OVERRIDE = ("task.params", "algo.correction_params")

# Keys that were removed: the one value every run had, and why the key went. A config that still sets one to
# that value loads (a saved run's config.yaml lists every key it had); any other value is refused.
RETIRED_KEYS = {
    "train.fp8_backend": ("jetflow", "jetflow's own GEMMs are the only training backend; Transformer Engine (te) was "
                                     "never wired into training, its recipe mapping is the library jetflow.train.te"),
}


def _retired(key: str, value: Any) -> bool:
    """True for a removed key set to the value it always had (to be dropped); another value is a ConfigError."""
    key, value = key.strip(), str(value).strip()
    if key not in RETIRED_KEYS:
        return False
    kept, why = RETIRED_KEYS[key]
    if value != kept:
        raise ConfigError(f"{key}={value!r}: the key was removed ({why}); delete it")
    return True


def _without_retired(loaded: DictConfig) -> DictConfig:
    """A loaded YAML without the removed keys it sets to their one value (see RETIRED_KEYS)."""
    for key in RETIRED_KEYS:
        section, name = key.rsplit(".", 1)
        node = OmegaConf.select(loaded, section)
        if isinstance(node, DictConfig) and name in node and _retired(key, node[name]):
            del node[name]
    return loaded


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- `key=value` overrides, in order; typed (the values' ranges and
    combinations are jetflow.run.validate's). A run's config; a checkpoint's architecture (its
    config.json) is jetflow.model.checkpoint.load_model_config's."""
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
            base = OmegaConf.merge(base, _without_retired(loaded))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"overrides must look like key=value, got {bad}")
        overrides = [o for o in overrides if not _retired(*o.split("=", 1))]
        batch: dict[str, str] = {}  # overrides of unrelated keys, merged at once (a merge copies the whole config)
        for key, override in [(o.split("=", 1)[0].strip(), o) for o in overrides] + [("", "")]:
            related = any(k == key or k.startswith(key + ".") or key.startswith(k + ".") for k in batch)
            if batch and (not key or key in REPLACED_BY_OVERRIDE or related):
                base, batch = OmegaConf.merge(base, OmegaConf.from_dotlist(list(batch.values()))), {}
            if key in REPLACED_BY_OVERRIDE:
                OmegaConf.update(base, key, OmegaConf.select(OmegaConf.from_dotlist([override]), key), merge=False)
            elif key:
                batch[key] = override
        cfg = OmegaConf.to_object(base)
    except OmegaConfBaseException as e:
        raise _explain(e) from None
    except yaml.YAMLError as e:  # a syntax error in the file
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    return cfg


def loss_aggregation(algo: AlgoConfig) -> str:
    """algo.loss_agg with auto resolved: GSPO's per-sequence mean under algo.ratio_level=sequence, else the
    token mean (every reader of the aggregation calls this; a run's config keeps what the user wrote)."""
    if algo.loss_agg != "auto":
        return algo.loss_agg
    return "seq_mean_token_mean" if algo.ratio_level == "sequence" else "token_mean"


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def config_value(cfg: Config, key: str) -> Any:
    """The value of the dotted key `key` (`train.lr`) in `cfg`."""
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def from_dict(cfg_dict: dict) -> Config:
    """The Config a `to_dict` gave (how a config crosses to another process: a Ray actor, the engine's process)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), cfg_dict))


def config_text(cfg: Config) -> str:
    """The config as the YAML that load_config reads back."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# run.* keys a resumed (or re-run) session may change without changing the run's results
SESSION_KEYS = ("resume", "progress", "tensorboard", "loggers", "tracker_project", "mlflow_tracking_uri", "num_threads",
                "out_dir", "allow_changes", "memory_check")
# train.* keys a resumed session may change too: the memory savers change how a step is computed, not what (the same
# numbers on and off under exact numerics), and `auto` chooses them by the memory of the machine a session runs on
MEMORY_SAVER_KEYS = ("activation_checkpointing", "logprob_chunk_tokens")


def run_loggers(run: RunConfig) -> list[str]:
    """run.loggers with the run.tensorboard alias applied."""
    names = [n for n in run.loggers if not (n == "tensorboard" and run.tensorboard is False)]
    return names + ["tensorboard"] if run.tensorboard and "tensorboard" not in names else names


def config_changes(saved: Config, cfg: Config) -> list[str]:
    """The dotted keys whose values differ between two configs, session keys and memory savers aside."""
    def comparable(c: Config) -> dict:
        d = to_dict(c)
        for k in SESSION_KEYS:
            d["run"].pop(k, None)
        for k in MEMORY_SAVER_KEYS:
            d["train"].pop(k, None)
        d["algo"]["loss_agg"] = loss_aggregation(c.algo)  # a run saved before auto existed wrote token_mean
        return d

    def diff(a, b, prefix: str = "") -> list[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            return [k for key in sorted(set(a) | set(b)) for k in diff(a.get(key), b.get(key), f"{prefix}{key}.")]
        return [] if a == b else [prefix.rstrip(".")]
    return diff(comparable(saved), comparable(cfg))
