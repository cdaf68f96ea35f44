"""`jetflow bench mismatch`: rollout-vs-trainer mismatch of each precision mode on the same prompts.

For each mode, from the same starting weights: the trainer side and the rollout side are built as
in a real run (jetflow.run.build), the weights cross through jetflow.sync, the rollout
engine (native, or vLLM with `rollout.backend=vllm`) samples responses with the same per-request
seeds, and the trainer computes its log-probs of those tokens. Reported: token KL (k3, k1), max and
mean |delta logp|, the share of tokens whose two log-probs are exactly equal, and the rest of
jetflow.rl.mismatch, by response position too; for an MoE model the router flip rate (tokens whose
top-k expert set differs between the two sides, per MoE layer). This is the measurement behind the project's claim:
`mixed` (bf16 trainer, FP8 rollout) is off-policy by construction, `unified` (one recipe, the same
bytes, and under exact numerics one computation) is not: its KL is 0 and mixed / unified infinite.
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from jetflow.bench.common import markdown_table, write_results
from jetflow.config import Config, conversation_tokens, derive, load_config
from jetflow.run.loop import observe_kv_amax, request_seed, rl_seed
from jetflow.run.build import (apply_mode, attach_kv_fp8, build_policy, build_task, copy_model,
                               prompt_encoder, stop_token_ids)
from jetflow.rollout.conversation import conversation_driver
from jetflow.rollout.native import NativeRollout
from jetflow.rl import mismatch_metrics, mismatch_position_curves
from jetflow.rl.experience import Experience, pack_experience
from jetflow.sync import build_update
from jetflow.model.moe import moe_blocks
from jetflow.train.trainer import response_logprobs

MODES = ("bf16", "mixed", "unified")


def paired_logprobs(cfg: Config, base_model, tokenizer, task, prompts: list[list[int]], micro_batch: int = 16,
                    ignore_eos: bool = False, engine_dir: str | None = None,
                    problems: list | None = None) -> tuple[Experience, torch.Tensor, dict]:
    """Rollout and trainer log-probs of the same sampled tokens under cfg's precision mode:
    (exp with exp.rollout_logprobs (B, R), trainer log-probs (B, R), timings). A vLLM engine's model
    directory is engine_dir, or a temporary one removed on return. `problems` (one per prompt): under
    rollout.max_turns > 1 the conversations' problems (exp.response_mask then marks the model's tokens)."""
    if cfg.rollout.backend != "vllm" or engine_dir is not None:
        return _paired_logprobs(cfg, base_model, tokenizer, task, prompts, micro_batch, ignore_eos, engine_dir, problems)
    with tempfile.TemporaryDirectory(prefix="jetflow-vllm-") as tmp:
        return _paired_logprobs(cfg, base_model, tokenizer, task, prompts, micro_batch, ignore_eos, tmp, problems)


def _paired_logprobs(cfg: Config, base_model, tokenizer, task, prompts: list[list[int]], micro_batch: int,
                     ignore_eos: bool, engine_dir: str | None, problems: list | None) -> tuple[Experience, torch.Tensor, dict]:
    mode, derived = cfg.precision.mode, derive(cfg)
    trainer_model = apply_mode(copy_model(base_model), derived.precision, "trainer")
    fingerprint = derived.precision.fingerprint
    max_seq_len = max(len(p) for p in prompts) + cfg.rollout.max_new_tokens + 8
    driver = conversation_driver(cfg, task, tokenizer) if problems is not None else None
    if driver is not None:
        max_seq_len = conversation_tokens(cfg.rollout, max(len(p) for p in prompts))
    eos = stop_token_ids(tokenizer, base_model, task)
    rollout_model = None  # the model the rollout computes with, when it is a jetflow Decoder
    if cfg.rollout.backend == "vllm":
        from jetflow.run.vllm_side import build_vllm_rollout
        rollout = build_vllm_rollout(cfg, derived, copy_model(base_model), tokenizer, [] if ignore_eos else eos,
                                     task.stop, max_seq_len, Path(engine_dir), driver=driver)
        rollout_model = rollout.policy  # the exact engine's modules (None when vLLM runs its own kernels)
    else:
        rollout_model = apply_mode(copy_model(base_model), derived.precision, "rollout")
        attach_kv_fp8(rollout_model, derived.precision, "rollout")
        rollout = NativeRollout(rollout_model, cfg, tokenizer, eos, task.stop, max_seq_len, fingerprint, driver)
        if ignore_eos:
            rollout.params = dataclasses.replace(rollout.params, ignore_eos=True)
    kv_scales = None
    kv_quantizer = attach_kv_fp8(trainer_model, derived.precision, "trainer")
    if kv_quantizer is not None:  # calibrate the FP8 KV scales on a trainer forward over the prompts
        def forward(exp):
            with torch.no_grad():
                return [response_logprobs(trainer_model, mb) for mb in exp.micro_batches(micro_batch)]
        observe_kv_amax(forward, kv_quantizer, prompts, tokenizer.pad_token_id, cfg.model.device)
        kv_scales = kv_quantizer.recalibrate()
    rollout.load_weights(build_update(trainer_model, mode, 0, fingerprint, kv_scales=kv_scales))
    seeds = [request_seed(rl_seed(cfg.run), 0, i) for i in range(len(prompts))]
    t0 = time.perf_counter()
    out = rollout.generate(prompts, seeds, **({"problems": problems} if driver is not None else {}))
    t_rollout = time.perf_counter() - t0
    zeros = torch.zeros(len(prompts))
    exp = pack_experience(prompts, out.token_ids, out.logprobs, zeros, zeros, tokenizer.pad_token_id,
                          cfg.model.device, routed_experts=out.routed_experts,  # algo.routing_replay: replayed
                          token_masks=out.token_masks)
    t0 = time.perf_counter()
    with torch.no_grad():
        trainer_lp = torch.cat([response_logprobs(trainer_model, mb, cfg.rollout.temperature)
                                for mb in exp.micro_batches(micro_batch)])
    timings = {"rollout_s": t_rollout, "trainer_s": time.perf_counter() - t0}
    if out.turn_stats is not None:  # conversations: their turns and tool calls (not a timing)
        timings["turn_stats"] = out.turn_stats
    if cfg.rollout.backend == "vllm":  # a vLLM engine: its memory and parallel groups go now, not at exit
        rollout.close()
    if rollout_model is not None and moe_blocks(trainer_model):
        timings["router_flip_frac"] = router_flip_frac(rollout_model, trainer_model, exp)
    return exp, trainer_lp, timings


def expert_choices(model, exp: Experience) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert sets of every MoE layer over the sequences (L, N, K), sorted per token, and the real
    tokens among the N rows (N,), from one full forward (in the row order the layers saw)."""
    with torch.no_grad():
        model.forward_hidden(exp.input_ids, attention_mask=exp.attention_mask)
    ids = torch.stack([b.last_topk_ids for b in moe_blocks(model)]).sort(-1).values  # (L, N, K)
    mask = model.last_token_mask
    real = mask.reshape(-1) if mask is not None else torch.ones(ids.shape[1], dtype=torch.bool)
    return ids, real.to(torch.bool)


def router_flip_frac(rollout_model, trainer_model, exp: Experience) -> float:
    """Share of (real token, MoE layer) pairs whose top-k expert set differs between the rollout
    engine's model and the trainer's, on the sampled sequences (prompt and response tokens).

    Both sides route in a full forward over the sequences. Under exact numerics that is bitwise the
    engine's own routing while it decoded (a decoded row equals its prefill row, tests/integration/
    test_exact_on_policy.py); under fast numerics the engine's cached decode may route a few more
    tokens differently than this shows."""
    a, real = expert_choices(rollout_model, exp)
    b, _ = expert_choices(trainer_model, exp)
    differs = (a != b).any(-1)[:, real]  # (L, real tokens)
    return float(differs.float().mean()) if differs.numel() else 0.0


def measure_mode(cfg: Config, base_model, tokenizer, task, prompts: list[list[int]], micro_batch: int = 16,
                 ignore_eos: bool = False) -> dict:
    exp, trainer_lp, timings = paired_logprobs(cfg, base_model, tokenizer, task, prompts, micro_batch, ignore_eos)
    metrics = mismatch_metrics(exp.rollout_logprobs, trainer_lp, exp.response_mask)
    curves = mismatch_position_curves(exp.rollout_logprobs, trainer_lp, exp.response_mask)
    return {
        "mode": cfg.precision.mode,
        "rollout": cfg.rollout.backend,
        "numerics": derive(cfg).precision.numerics,
        "kl_k3": metrics["mismatch/kl_k3"],
        "kl_k1": metrics["mismatch/kl_k1"],
        "abs_delta_mean": metrics["mismatch/abs_delta_mean"],
        "abs_delta_max": metrics["mismatch/abs_delta_max"],
        "equal_frac": metrics["mismatch/equal_frac"],
        "ratio_outside_frac": metrics["mismatch/ratio_outside_frac"],
        "tokens": int(metrics["mismatch/num_tokens"]),
        "response_len_mean": float(exp.response_mask.sum(1).mean()),
        "router_flip_frac": timings.pop("router_flip_frac", None),
        **timings,
        "metrics": metrics,
        "curve_kl_k3": curves["kl_k3"].tolist(),
        "curve_abs_delta": curves["abs_delta"].tolist(),
    }


def ratio(a: float, b: float) -> float | str:
    """a / b, or "inf" when b is exactly 0 and a is not (JSON has no infinity)."""
    if b == 0:
        return "inf" if a > 0 else "undefined"
    return a / b


def run(config: str | None = None, overrides: tuple[str, ...] = (), modes: tuple[str, ...] = MODES,
        num_prompts: int = 8, group_size: int = 4, ignore_eos: bool = False, out_dir: str = "results/bench",
        name: str | None = None) -> dict:
    cfg = load_config(config, list(overrides))
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    task = build_task(cfg)
    base_model, tokenizer = build_policy(cfg)
    encode = prompt_encoder(cfg, tokenizer, task)
    prompts = [encode(p) for p in task.problems(0, num_prompts, rl_seed(cfg.run)) for _ in range(group_size)]
    rows = []
    for mode in modes:
        mode_cfg = copy.deepcopy(cfg)
        mode_cfg.precision.mode = mode
        row = measure_mode(mode_cfg, base_model, tokenizer, task, prompts, cfg.train.micro_batch_size, ignore_eos)
        rows.append(row)
        flips = "" if row["router_flip_frac"] is None else f"  router flips {row['router_flip_frac']:.2%}"
        print(f"  {mode:8s} kl_k3 {row['kl_k3']:.3e}  kl_k1 {row['kl_k1']:.3e}  |dlogp| mean {row['abs_delta_mean']:.3e} "
              f"max {row['abs_delta_max']:.3e}  equal {row['equal_frac']:.1%}  tokens {row['tokens']}{flips}", flush=True)
    by_mode = {r["mode"]: r for r in rows}
    summary = {}
    if "mixed" in by_mode and "unified" in by_mode:
        summary["kl_mixed_over_unified"] = ratio(by_mode["mixed"]["kl_k3"], by_mode["unified"]["kl_k3"])
    if "bf16" in by_mode and "unified" in by_mode:
        summary["kl_unified_over_bf16"] = ratio(by_mode["unified"]["kl_k3"], by_mode["bf16"]["kl_k3"])
    name = name or (f"mismatch-{cfg.model.path if cfg.model.path in ('tiny', 'smollm2') else 'model'}"
                    + ("-vllm" if cfg.rollout.backend == "vllm" else ""))
    table = markdown_table([{k: v for k, v in r.items() if not isinstance(v, (list, dict))} for r in rows],
                           ["mode", "rollout", "numerics", "kl_k3", "kl_k1", "abs_delta_mean", "abs_delta_max",
                            "equal_frac", "ratio_outside_frac", "tokens", "response_len_mean"]
                           + (["router_flip_frac"] if any(r["router_flip_frac"] is not None for r in rows) else []))
    md = (f"Model `{cfg.model.path}`, task `{cfg.task.name}` {dict(cfg.task.params)}, {num_prompts} prompts x "
          f"{group_size} samples, max {cfg.rollout.max_new_tokens} new tokens, temperature "
          f"{cfg.rollout.temperature}, same seeds in every mode.\n\n{table}\n\n"
          + "\n".join(f"- {k}: {v if isinstance(v, str) else f'{v:.4g}'}" for k, v in summary.items()))
    payload = {"config": config, "overrides": list(overrides), "rows": rows, "summary": summary}
    write_results(name, payload, md, out_dir)
    print("  " + ", ".join(f"{k} = {v if isinstance(v, str) else f'{v:.4g}'}" for k, v in summary.items()))
    return payload
