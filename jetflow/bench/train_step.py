"""`jetflow bench train-step`: one training step (forward + backward + AdamW) per precision mode.

Work: jetflow's `Trainer.train_step` (micro-batched forward, GRPO policy loss, backward, gradient
clipping, AdamW on the fp32 master weights) on one fixed synthetic batch: `batch` rows of
`prompt_len` random prompt tokens + `response_len` random response tokens with random advantages,
identical in every mode. The modes are the trainer sides of the precision modes: fp32, bf16 (bf16
GEMMs) and unified (FP8 fprop / dgrad / wgrad; the weights are requantized after every optimizer
step, as in a run). On the CPU the bf16 and FP8 GEMMs are emulated in fp32: the ratios there measure
the recipe's overhead, not FP8 hardware.

Each mode takes `warmup` warm-up steps (default 1), then `reps` steps interleaved across the modes (so load
from other processes hits every mode alike); the median is reported. tokens/s = real (trained) tokens,
prompts included, / seconds per step (fixed lengths: batch * (prompt_len + response_len)); ratios are of
tokens/s (above 1: faster than the reference). `lengths` = longtail: most responses response_len / 8,
every 8th at response_len (jetflow.bench.workload.response_lengths). `overrides`: config keys, e.g.
train.logprob_chunk_tokens=1024 train.activation_checkpointing=true.

Memory savers: explicit values as given; `auto` (the default of train.activation_checkpointing and
train.logprob_chunk_tokens) resolved as a `jetflow train` run of the step's shape would resolve it: the memory
estimate for `batch` sequences of prompt_len + response_len positions against this machine's memory
(savers_as_a_run_would). The payload records the choice.

Peak RSS: this process's high-water mark (ru_maxrss) when the bench ends, model loading and every mode
included, and per row after that mode's last step: a configuration's own figure needs one mode in a fresh
process (jetflow.bench.train_step_sweep). `train.max_tokens_per_micro_batch=N` in `overrides` (the CLI's
--max-tokens-per-micro-batch) packs the sequences (jetflow.train.packing); the payload records the
micro-batch count.
"""

from __future__ import annotations

import copy
import dataclasses
import resource
import statistics
import time

import torch

from jetflow.bench.common import markdown_table, write_results
from jetflow.bench.workload import LoadAverage, bench_config, synthetic_experience
from jetflow.config import MemorySavers, derive, loss_aggregation
from jetflow.run.build import apply_mode, build_policy, copy_model
from jetflow.run import memory_estimate
from jetflow.precision import PrecisionMode
from jetflow.rl.experience import Experience
from jetflow.train.packing import micro_batches
from jetflow.train.trainer import Trainer

MODES = ("fp32", "bf16", "unified")


def build_trainer(base, cfg, savers: MemorySavers | None = None) -> Trainer:
    """A Trainer over its own copy of `base` under cfg's precision mode and numerics (and `savers`; default:
    the explicit values, `auto` off)."""
    model = apply_mode(copy_model(base), derive(cfg).precision, "trainer")
    for p in model.parameters():
        p.requires_grad_(True)  # copy_model makes rollout-side copies, frozen
    return Trainer(model, cfg.train, cfg.algo, savers=savers)


def savers_as_a_run_would(cfg, arch, batch: int, prompt_len: int, response_len: int) -> MemorySavers:
    """The memory savers of a `jetflow train` run whose step is this bench's: `batch` sequences of prompt_len +
    response_len positions (one prompt each, every response at rollout.max_new_tokens, no held-out evaluation),
    `auto` chosen by the run's memory estimate against this machine's memory (choose_savers); explicit values,
    and run.memory_check=false, as a run takes them."""
    shape = copy.deepcopy(cfg)
    shape.train.prompts_per_step, shape.rollout.group_size = batch, 1
    shape.rollout.max_new_tokens, shape.eval.num_prompts = response_len, 0
    derived = derive(shape)
    if not cfg.run.memory_check or not memory_estimate.estimated(shape):
        return derived.savers
    have, _ = memory_estimate.available_memory(cfg.model.device)
    return memory_estimate.choose_savers(shape, derived, arch, prompt_len, have)[0].savers


def build_trainers(cfg, modes: tuple[str, ...], shape: tuple[int, int, int] | None = None
                   ) -> tuple[dict[str, Trainer], int, int]:
    """({mode: Trainer over its own copy of the model}, vocab size, pad id); same initial weights. `shape`
    (batch, prompt_len, response_len): each mode's savers as a run of that step would choose them
    (savers_as_a_run_would); None: `auto` off."""
    base, tokenizer = build_policy(cfg)
    trainers = {}
    for mode in modes:
        mode_cfg = copy.deepcopy(cfg)
        mode_cfg.precision.mode = mode
        savers = savers_as_a_run_would(mode_cfg, base.config, *shape) if shape else None
        trainers[mode] = build_trainer(base, mode_cfg, savers)
    return trainers, base.config.vocab_size, tokenizer.pad_token_id


def timed_step(trainer: Trainer, exp: Experience) -> tuple[float, float, dict]:
    """(wall seconds, this process's CPU seconds, metrics) of one train_step."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    metrics = trainer.train_step(exp)
    if exp.input_ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - cpu0, metrics


def peak_rss_gb() -> float:
    """This process's peak resident set size so far, GB (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def run(model: str = "smollm2", modes: tuple[str, ...] = MODES, batch: int = 8, prompt_len: int = 64,
        response_len: int = 128, reps: int = 3, device: str | None = None, out_dir: str = "results/bench",
        name: str | None = None, lengths: str = "fixed", warmup: int = 1, overrides: tuple[str, ...] = ()) -> dict:
    """Benchmark and write <out_dir>/train-step-<cpu|gpu>.{json,md} (or `name`); returns the payload."""
    cfg = bench_config(model, [*overrides, *([f"model.device={device}"] if device else [])])
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    trainers, vocab, pad_id = build_trainers(cfg, tuple(modes), (batch, prompt_len, response_len))
    for mode, trainer in trainers.items():
        print(f"  {mode}: memory savers: {trainer.savers.note or trainer.savers.describe()}", flush=True)
    exp = synthetic_experience(batch, prompt_len, response_len, vocab, pad_id, device=cfg.model.device, dist=lengths)
    batches = {mode: dataclasses.replace(exp, old_logprobs=t.compute_logprobs(exp)) for mode, t in trainers.items()}
    tokens = int(exp.attention_mask.sum())  # real tokens: prompts + responses
    samples: dict[str, list[float]] = {mode: [] for mode in trainers}
    cpu_samples: dict[str, list[float]] = {mode: [] for mode in trainers}
    last: dict[str, dict] = {}
    rss: dict[str, float] = {}
    with LoadAverage() as load:
        for _ in range(warmup):  # first-call allocations, optimizer state
            for mode, trainer in trainers.items():
                timed_step(trainer, batches[mode])
        for rep in range(reps):
            for mode, trainer in trainers.items():
                dt, cpu, last[mode] = timed_step(trainer, batches[mode])
                samples[mode].append(dt)
                cpu_samples[mode].append(cpu)
                print(f"  rep {rep}: {mode:8s} {dt * 1e3:9.1f} ms/step  {tokens / dt:8.1f} tokens/s  "
                      f"peak RSS {peak_rss_gb():.2f} GB", flush=True)
                rss[mode] = peak_rss_gb()  # the high-water mark after this mode's step
    rows = []
    for mode, times in samples.items():
        sec = statistics.median(times)
        rows.append({"mode": mode, "trainer_linear": PrecisionMode(mode).trainer_kind, "ms_per_step": sec * 1e3,
                     "tokens_per_s": tokens / sec, "ms_all": [round(t * 1e3, 1) for t in times],
                     "cpu_ms_per_step": statistics.median(cpu_samples[mode]) * 1e3,
                     "loss": last[mode]["train/loss"], "grad_norm": last[mode]["train/grad_norm"],
                     "skipped_steps": trainers[mode].skipped_steps, "peak_rss_gb": rss.get(mode, peak_rss_gb())})
    by_mode = {r["mode"]: r for r in rows}
    ratios = {}
    for num, den in (("bf16", "fp32"), ("unified", "fp32"), ("unified", "bf16")):
        if num in by_mode and den in by_mode:
            ratios[f"{num}_over_{den}"] = by_mode[num]["tokens_per_s"] / by_mode[den]["tokens_per_s"]
            ratios[f"{num}_over_{den}_cpu"] = by_mode[den]["cpu_ms_per_step"] / by_mode[num]["cpu_ms_per_step"]
    if "fp32" in by_mode:
        for r in rows:
            r["vs_fp32"] = r["tokens_per_s"] / by_mode["fp32"]["tokens_per_s"]
    for r in rows:
        print(f"  {r['mode']:8s} {r['ms_per_step']:9.1f} ms/step  {r['tokens_per_s']:8.1f} tokens/s"
              + (f"  {r['vs_fp32']:.2f}x fp32" if "vs_fp32" in r else ""))
    print("  " + ", ".join(f"{k} = {v:.3f}" for k, v in ratios.items()))

    dev = torch.device(cfg.model.device)
    savers = next(iter(trainers.values())).savers
    headline = {"name": "unified (FP8) / fp32 training tokens/s", "value": ratios.get("unified_over_fp32")}
    payload = {"workload": {"model": model, "batch": batch, "prompt_len": prompt_len, "response_len": response_len,
                            "lengths": lengths, "overrides": list(overrides), "warmup": warmup,
                            # what the trainers ran: explicit values, `auto` as a run of this step's shape chooses
                            "logprob_chunk_tokens": savers.chunk_tokens, "activation_checkpointing": savers.checkpointing,
                            "savers_choice": savers.note,
                            "max_tokens_per_micro_batch": cfg.train.max_tokens_per_micro_batch,
                            "micro_batches": len(micro_batches(exp, cfg.train, next(iter(trainers.values())).model)),
                            "tokens_per_step": tokens, "reps": reps, "micro_batch_size": cfg.train.micro_batch_size,
                            "optimizer": "AdamW (fp32 master weights)", "loss": loss_aggregation(cfg.algo)},
               "rows": rows, "ratios": ratios, "headline": headline, "loadavg_1m": load.record(),
               "peak_rss_gb": peak_rss_gb()}
    md = (f"One training step (forward + backward + AdamW, `Trainer.train_step`) of model `{model}` on a fixed "
          f"synthetic batch of {batch} x ({prompt_len} prompt + {response_len} response) tokens ({lengths} lengths, "
          f"{tokens} real tokens; overrides: {' '.join(overrides) or 'none'}); median of {reps} steps interleaved "
          f"across modes after {warmup} warm-up step(s) each. Peak RSS of this process: {payload['peak_rss_gb']:.2f} "
          f"GB (every mode and the model load included). On the CPU bf16 / FP8 GEMMs are emulated in "
          f"fp32 (the recipe's overhead, not FP8 hardware). {load.sentence()}\n\n"
          + markdown_table(rows, ["mode", "trainer_linear", "ms_per_step", "tokens_per_s", "vs_fp32", "cpu_ms_per_step",
                                  "peak_rss_gb", "loss", "skipped_steps"])
          + "\n\nRatios of speed (above 1: the first is faster); `_cpu`: from this process's CPU time per step "
            "(all threads), less sensitive to other processes on a shared machine.\n\n"
          + "\n".join(f"- {k}: {v:.3f}" for k, v in ratios.items()))
    path = write_results(name or f"train-step-{'gpu' if dev.type == 'cuda' else 'cpu'}", payload, md, out_dir)
    print(f"wrote {path}")
    return payload
