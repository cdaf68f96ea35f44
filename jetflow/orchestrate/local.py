"""A whole run in one process: build, optional supervised warm-up, RL steps, checkpoints, logs.

Run directory <run.out_dir>/<run.name>/: config.yaml (resolved), metrics.jsonl, tensorboard/,
checkpoints/, and summary.json + COMPLETE written only when the run finished. A directory without
COMPLETE is an unfinished run: `run.resume=true` continues it from its last checkpoint.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from jetflow.config import Config, ConfigError, save_config, to_dict
from jetflow.distributed import SINGLE, DataParallel, init_from_env, shutdown
from jetflow.loop import RLLoop
from jetflow.metrics_log import MetricsLogger
from jetflow.orchestrate.build import (apply_mode, attach_kv_fp8, build_policy, build_task, copy_model,
                                       prompt_encoder, stop_token_ids)
from jetflow.orchestrate.native_rollout import NativeRollout
from jetflow.rl.experience import pack_experience
from jetflow.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from jetflow.train.trainer import Trainer

COMPLETE = "COMPLETE"
SFT_INDEX_OFFSET = 10_000_000  # supervised warm-up draws problems far from the RL prompts


def prepare_run_dir(cfg: Config, dp: DataParallel = SINGLE) -> Path:
    """Every rank checks the directory; rank 0 alone writes to it (the others wait for it)."""
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    if run_dir.exists() and not cfg.run.resume:
        if (run_dir / COMPLETE).exists() or latest_checkpoint(run_dir) or (run_dir / "metrics.jsonl").exists():
            raise ConfigError(f"run directory {run_dir} already holds a run; pass run.resume=true to continue it, "
                              "or choose another run.name")
    dp.barrier()  # no rank may see rank 0's fresh files before it checked
    if not dp.is_main:
        dp.barrier()
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / COMPLETE).unlink(missing_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    dp.barrier()
    return run_dir


def _truncate_metrics(run_dir: Path, keep_before_step: int, sft_done: bool) -> None:
    """On resume, drop metric rows of steps the checkpoint does not contain (they are redone)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [r for r in rows if (r["phase"] == "sft" and sft_done) or (r["phase"] == "rl" and r["step"] < keep_before_step)]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def supervised_warmup(cfg: Config, trainer_model, task, encode, tokenizer, logger, progress,
                      dp: DataParallel = SINGLE) -> None:
    """A short supervised phase on reference answers (for models trained from scratch)."""
    n = cfg.train.sft_warmup_steps
    sft_cfg = replace(cfg.train, lr=cfg.train.sft_lr, warmup_steps=max(1, n // 10), steps=n, min_lr_ratio=0.1,
                      micro_batch_size=cfg.train.sft_batch_size)
    sft = Trainer(trainer_model, sft_cfg, cfg.algo, total_steps=n, dp=dp)
    mine = dp.shard(cfg.train.sft_batch_size)
    bs = len(mine)
    end = task.stop[0] if task.stop else ""
    for step in range(n):
        problems = task.problems(SFT_INDEX_OFFSET + step * cfg.train.sft_batch_size + mine.start, bs, cfg.run.seed)
        prompts = [encode(p) for p in problems]
        answers = [tokenizer.encode(p.answer + end) + [tokenizer.eos_token_id] for p in problems]
        zeros = torch.zeros(bs)
        exp = pack_experience(prompts, answers, [[0.0] * len(a) for a in answers], zeros, zeros,
                              tokenizer.pad_token_id, cfg.model.device)
        metrics = sft.sft_step(exp)
        if logger is not None:
            logger.log(step, metrics, phase="sft")
        if progress is not None:
            progress.set_postfix_str(f"sft {step + 1}/{n} loss {metrics['loss/sft']:.3f}")


def check_backends(cfg: Config) -> None:
    """The vLLM, Megatron-Core and TE backends exist as components but `jetflow train` runs the native
    ones only: say so instead of silently running something else."""
    wired = {"rollout.backend": ("native", "jetflow.rollout.vllm.VLLMRollout"),
             "train.backend": ("native", "jetflow.train.megatron.MegatronPolicy"),
             "train.fp8_backend": ("jetflow", "jetflow.train.te")}
    for key, (supported, component) in wired.items():
        section, field = key.split(".")
        value = getattr(getattr(cfg, section), field)
        if value != supported:
            raise ConfigError(f"{key}={value!r}: `jetflow train` runs {key}={supported!r} today; the {value} "
                              f"backend is available as the library component {component} but is not wired "
                              "into the training loop yet")


def train(cfg: Config) -> Path:
    """Run (or resume) the configured RL run; returns its directory.

    Under torchrun (WORLD_SIZE > 1) every rank runs this with its share of each step's prompts
    (jetflow.distributed); rank 0 alone writes logs, checkpoints and the summary.
    """
    check_backends(cfg)
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    dp = init_from_env(cfg.model.device)
    try:
        return _train(cfg, dp)
    finally:
        shutdown(dp)


def _train(cfg: Config, dp: DataParallel) -> Path:
    if cfg.train.prompts_per_step % dp.world_size or cfg.train.sft_batch_size % dp.world_size:
        raise ConfigError(f"train.prompts_per_step={cfg.train.prompts_per_step} and train.sft_batch_size="
                          f"{cfg.train.sft_batch_size} must be multiples of the data-parallel size {dp.world_size}")
    run_dir = prepare_run_dir(cfg, dp)
    torch.manual_seed(cfg.run.seed)
    random.seed(cfg.run.seed)

    task = build_task(cfg)
    model, tokenizer = build_policy(cfg, task)
    encode = prompt_encoder(cfg, tokenizer, task)
    apply_mode(model, cfg, "trainer")
    recipe = cfg.precision.recipe()
    fingerprint = recipe.fingerprint() if cfg.precision.mode in ("mixed", "unified") else None

    trainer = Trainer(model, cfg.train, cfg.algo, dp=dp)
    kv_quantizer = attach_kv_fp8(model, cfg, "trainer")

    def trainer_state() -> dict:
        state = trainer.state_dict()
        if kv_quantizer is not None:
            state["kv_quantizer"] = kv_quantizer.state_dict()
        return state

    start_step, sft_done = 0, False
    checkpoint = latest_checkpoint(run_dir) if cfg.run.resume else None
    if checkpoint is not None:
        saved, state = load_checkpoint(checkpoint, model)
        trainer.load_state_dict(saved)
        if kv_quantizer is not None and "kv_quantizer" in saved:
            kv_quantizer.load_state_dict(saved["kv_quantizer"])
        start_step, sft_done = state["next_step"], state["sft_done"]
    if dp.is_main:
        _truncate_metrics(run_dir, start_step, sft_done)

    def checkpoint(step: int) -> None:
        if dp.is_main:
            save_checkpoint(run_dir, step, model, trainer_state(), {"next_step": step, "sft_done": sft_done})
        dp.barrier()

    logger = MetricsLogger(run_dir, cfg.run.tensorboard) if dp.is_main else None
    progress = None
    if cfg.run.progress and dp.is_main:
        from tqdm import tqdm
        progress = tqdm(total=cfg.train.steps, initial=start_step, desc=f"{cfg.run.name} [{cfg.precision.mode}]",
                        file=sys.stderr, dynamic_ncols=True)
    if dp.is_main:
        print(f"[jetflow] run {run_dir}  mode={cfg.precision.mode}  recipe={recipe.fingerprint()}  "
              f"model={cfg.model.path} ({model.num_params() / 1e6:.1f}M params)  data-parallel ranks={dp.world_size}",
              file=sys.stderr)

    try:
        if cfg.train.sft_warmup_steps and not sft_done:
            supervised_warmup(cfg, model, task, encode, tokenizer, logger, progress, dp)
            sft_done = True
            checkpoint(0)

        rollout_model = apply_mode(copy_model(model), cfg, "rollout")
        attach_kv_fp8(rollout_model, cfg, "rollout")
        max_prompt = max(len(encode(p)) for p in task.problems(0, 64, cfg.run.seed))
        rollout = NativeRollout(rollout_model, cfg, tokenizer, stop_token_ids(tokenizer, model, task), task.stop,
                                max_seq_len=2 * max_prompt + cfg.rollout.max_new_tokens + 16,
                                fingerprint=fingerprint)
        loop = RLLoop(cfg, trainer, rollout, task, encode, tokenizer.pad_token_id, fingerprint, kv_quantizer, dp)

        for step in range(start_step, cfg.train.steps):
            metrics = loop.step(step)
            if logger is not None:
                logger.log(step, metrics)
            if progress is not None:
                progress.update(1)
                progress.set_postfix_str(
                    f"reward {metrics['reward/mean']:.3f} kl {metrics['mismatch/kl_k3']:.1e} | "
                    f"rollout {metrics['time/rollout']:.1f}s old {metrics['time/old_logprobs']:.1f}s "
                    f"train {metrics['time/train']:.1f}s sync {metrics['time/sync']:.2f}s | "
                    f"{metrics['throughput/tokens_per_s']:.0f} tok/s")
            every = cfg.train.checkpoint_every
            if every and (step + 1) % every == 0 and step + 1 < cfg.train.steps:
                checkpoint(step + 1)

        checkpoint(cfg.train.steps)
        if dp.is_main:
            write_summary(run_dir, cfg, trainer)
        dp.barrier()
    finally:
        if logger is not None:
            logger.close()
        if progress is not None:
            progress.close()
    return run_dir


def write_summary(run_dir: Path, cfg: Config, trainer: Trainer) -> dict:
    from jetflow.metrics_log import read_metrics
    rows = read_metrics(run_dir)
    rewards = [r["reward/mean"] for r in rows]
    k = min(3, len(rewards))
    summary = {
        "steps": len(rows),
        "mode": cfg.precision.mode,
        "reward_first3": sum(rewards[:k]) / max(k, 1),
        "reward_last3": sum(rewards[-k:]) / max(k, 1),
        "reward_best": max(rewards, default=0.0),
        "mismatch_kl_k3_mean": sum(r["mismatch/kl_k3"] for r in rows) / max(len(rows), 1),
        "mismatch_kl_k3_max": max((r["mismatch/kl_k3"] for r in rows), default=0.0),
        "step_time_mean": sum(r["time/step"] for r in rows) / max(len(rows), 1),
        "skipped_steps": trainer.skipped_steps,
        "data_parallel_size": trainer.dp.world_size,
        "config": to_dict(cfg),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / COMPLETE).write_text(time.strftime("%Y-%m-%dT%H:%M:%S") + "\n")
    return summary
