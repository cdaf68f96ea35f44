"""A whole run in one process: build, optional supervised warm-up, RL steps, checkpoints, logs.

Run directory <run.out_dir>/<run.name>/: config.yaml (resolved), metrics.jsonl, tensorboard/,
checkpoints/, and summary.json + COMPLETE written only when the run finished. A directory without
COMPLETE is an unfinished run: `run.resume=true` continues it from its last checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from jetflow.config import Config, ConfigError, save_config, to_dict
from jetflow.distributed import SINGLE, DataParallel, init_from_env, shutdown
from jetflow.loop import RLLoop
from jetflow.metrics_log import MetricsLogger
from jetflow.orchestrate.build import (apply_mode, attach_kv_fp8, build_policy, build_task, copy_model,
                                       prompt_encoder, stop_token_ids)
from jetflow.orchestrate.megatron_trainer import (build_trainer_model, check_megatron, gather_trainer_state,
                                                  model_data_parallel, select_trainer_state)
from jetflow.rollout.native import NativeRollout
from jetflow.orchestrate.vllm_rollout import build_vllm_rollout, check_vllm
from jetflow.rl.experience import pack_experience
from jetflow.train.checkpoint import checkpoint_weights, latest_checkpoint, load_checkpoint, save_checkpoint
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


def truncate_metrics(run_dir: Path, keep_before_step: int, sft_done: bool) -> None:
    """On resume, drop metric rows of steps the checkpoint does not contain (they are redone)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [r for r in rows if (r["phase"] == "sft" and sft_done) or (r["phase"] == "rl" and r["step"] < keep_before_step)]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def supervised_warmup(cfg: Config, trainer_model, task, encode, tokenizer, logger, progress,
                      dp: DataParallel = SINGLE) -> list[dict]:
    """A short supervised phase on reference answers (for models trained from scratch); returns its
    per-step metrics."""
    n = cfg.train.sft_warmup_steps
    sft_cfg = replace(cfg.train, lr=cfg.train.sft_lr, warmup_steps=max(1, n // 10), steps=n, min_lr_ratio=0.1,
                      micro_batch_size=cfg.train.sft_batch_size)
    sft = Trainer(trainer_model, sft_cfg, cfg.algo, total_steps=n, dp=dp)
    mine = dp.shard(cfg.train.sft_batch_size)
    bs = len(mine)
    end = task.stop[0] if task.stop else ""
    rows = []
    for step in range(n):
        problems = task.problems(SFT_INDEX_OFFSET + step * cfg.train.sft_batch_size + mine.start, bs, cfg.run.seed)
        prompts = [encode(p) for p in problems]
        answers = [tokenizer.encode(p.answer + end) + [tokenizer.eos_token_id] for p in problems]
        zeros = torch.zeros(bs)
        exp = pack_experience(prompts, answers, [[0.0] * len(a) for a in answers], zeros, zeros,
                              tokenizer.pad_token_id, cfg.model.device)
        metrics = sft.sft_step(exp)
        rows.append(metrics)
        if logger is not None:
            logger.log(step, metrics, phase="sft")
        if progress is not None:
            progress.set_postfix_str(f"sft {step + 1}/{n} loss {metrics['loss/sft']:.3f}")
    return rows


def check_backends(cfg: Config) -> None:
    """Refuse backend choices `jetflow train` cannot run, instead of silently running something else:
    Transformer Engine (not wired; it cannot be installed on the CPU machines), and Megatron / vLLM
    layouts and options they do not support (jetflow.orchestrate.megatron_trainer / vllm_rollout)."""
    processes = cfg.train.num_workers if cfg.run.orchestrator == "ray" else int(os.environ.get("WORLD_SIZE", "1"))
    check_megatron(cfg, world=processes)
    check_batch_split(cfg, processes)
    check_vllm(cfg)
    wired = {"train.fp8_backend": ("jetflow", "jetflow.train.te")}
    for key, (supported, component) in wired.items():
        section, field = key.split(".")
        value = getattr(getattr(cfg, section), field)
        if value != supported:
            raise ConfigError(f"{key}={value!r}: `jetflow train` runs {key}={supported!r} today; the {value} "
                              f"backend is available as the library component {component} but is not wired "
                              "into the training loop yet")


def check_batch_split(cfg: Config, processes: int) -> None:
    """Each step's prompts and each SFT batch split evenly over the data-parallel ranks: the trainer
    processes (torchrun ranks or Ray trainer workers), divided by the tensor-parallel size under Megatron."""
    t = cfg.train
    tp = t.tensor_parallel_size if t.backend == "megatron" else 1
    dp = max(processes // tp, 1)
    if t.prompts_per_step % dp or t.sft_batch_size % dp:
        raise ConfigError(f"train.prompts_per_step={t.prompts_per_step} and train.sft_batch_size={t.sft_batch_size} "
                          f"must be multiples of the data-parallel size {dp} ({processes} trainer processes / "
                          f"tensor_parallel_size={tp})")


class TrainerSide:
    """The trainer half of a run: task, tokenizer, policy model under the precision mode, optimizer,
    optional FP8 KV quantizer. One per process (or per data-parallel rank / Ray trainer worker)."""

    def __init__(self, cfg: Config, dp: DataParallel = SINGLE):
        self.cfg = cfg
        self.task = build_task(cfg)
        model, self.tokenizer = build_policy(cfg, self.task)
        self.encode = prompt_encoder(cfg, self.tokenizer, self.task)
        self.model = build_trainer_model(cfg, model)  # the Decoder under the precision mode, or a MegatronPolicy of it
        self.dp = model_data_parallel(self.model, dp)  # under tensor parallelism: Megatron's DP group
        self.trainer = Trainer(self.model, cfg.train, cfg.algo, dp=self.dp)
        self.kv_quantizer = attach_kv_fp8(self.model, cfg, "trainer")

    def state(self) -> dict:
        state = self.trainer.state_dict()
        if self.kv_quantizer is not None:
            state["kv_quantizer"] = self.kv_quantizer.state_dict()
        return state

    def restore(self, checkpoint: Path) -> dict:
        """Load a checkpoint into model, optimizer and KV quantizer; returns its state (next_step, sft_done)."""
        saved, state = load_checkpoint(checkpoint, self.model)
        saved = select_trainer_state(self.model, saved)
        self.trainer.load_state_dict(saved)
        if self.kv_quantizer is not None and "kv_quantizer" in saved:
            self.kv_quantizer.load_state_dict(saved["kv_quantizer"])
        return state

    def save(self, run_dir: Path, step: int, sft_done: bool) -> None:
        weights = checkpoint_weights(self.model)  # every rank: gathering TP shards is a collective
        trainer_state = gather_trainer_state(self.model, self.state())
        if self.dp.is_main:
            save_checkpoint(run_dir, step, self.model, trainer_state, {"next_step": step, "sft_done": sft_done},
                            model_state=weights)
        self.dp.barrier()

    def supervised_warmup(self, logger=None, progress=None) -> list[dict]:
        return supervised_warmup(self.cfg, self.model, self.task, self.encode, self.tokenizer, logger, progress, self.dp)


def build_rollout_side(cfg: Config, side: TrainerSide | None = None, run_dir: Path | None = None,
                       dp: DataParallel = SINGLE, engine_dir: Path | None = None):
    """The rollout engine of a run. Beside a trainer (`side`) it starts from a copy of the trainer's
    model; alone (a Ray rollout actor) it builds its own, whose weights the first sync replaces.
    A vLLM engine starts from a checkpoint written to `engine_dir` (default: in the run directory)."""
    if side is not None:
        task, tokenizer, encode, source = side.task, side.tokenizer, side.encode, side.model
    else:
        task = build_task(cfg)
        source, tokenizer = build_policy(cfg, task)
        encode = prompt_encoder(cfg, tokenizer, task)
    fingerprint = run_fingerprint(cfg)
    max_prompt = max(len(encode(p)) for p in task.problems(0, 64, cfg.run.seed))
    max_seq_len = 2 * max_prompt + cfg.rollout.max_new_tokens + 16
    eos = stop_token_ids(tokenizer, source, task)
    if cfg.rollout.backend == "vllm":  # an engine started from the trainer's current weights
        engine_dir = engine_dir or run_dir / (f"vllm_engine_rank{dp.global_rank}" if dp.global_rank else "vllm_engine")
        return build_vllm_rollout(cfg, copy_model(source), tokenizer, eos, task.stop, max_seq_len, engine_dir)
    rollout_model = apply_mode(copy_model(source), cfg, "rollout")
    attach_kv_fp8(rollout_model, cfg, "rollout")
    return NativeRollout(rollout_model, cfg, tokenizer, eos, task.stop, max_seq_len=max_seq_len,
                         fingerprint=fingerprint)


def run_fingerprint(cfg: Config) -> str | None:
    """The recipe fingerprint FP8 payloads carry (modes that quantize), else None."""
    return cfg.precision.recipe().fingerprint() if cfg.precision.precision_mode.quantizes else None


def run_rl_steps(cfg: Config, loop: RLLoop, start_step: int, logger, checkpoint: Callable[[int], None],
                 on_metrics: Callable[[dict], dict] | None = None, run_dir: Path | None = None) -> None:
    """The RL steps of a run with their logs, progress bar and periodic checkpoints (logger None: not
    the logging rank)."""
    progress = None
    if cfg.run.progress and logger is not None:
        from tqdm import tqdm
        progress = tqdm(total=cfg.train.steps, initial=start_step, desc=f"{cfg.run.name} [{cfg.precision.mode}]",
                        file=sys.stderr, dynamic_ncols=True)
    try:
        for step in range(start_step, cfg.train.steps):
            metrics = loop.step(step)
            if on_metrics is not None:
                metrics = on_metrics(metrics)
            if logger is not None:
                logger.log(step, metrics)
                if run_dir is not None:
                    log_position_curves(run_dir, step, loop.last_experience)
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
    finally:
        if progress is not None:
            progress.close()


def train(cfg: Config) -> Path:
    """Run (or resume) the configured RL run; returns its directory.

    Under torchrun (WORLD_SIZE > 1) every rank runs this with its share of each step's prompts
    (jetflow.distributed); rank 0 alone writes logs, checkpoints and the summary. With
    run.orchestrator=ray the same run is placed on Ray actors (jetflow.orchestrate.ray_run).
    """
    check_backends(cfg)
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    if cfg.run.orchestrator == "ray":
        from jetflow.orchestrate.ray_run import train_ray
        return train_ray(cfg)
    dp = init_from_env(cfg.model.device)
    completed = False
    try:
        run_dir = _train(cfg, dp)
        completed = True
        return run_dir
    finally:
        shutdown(dp, completed)


def _train(cfg: Config, dp: DataParallel) -> Path:
    run_dir = prepare_run_dir(cfg, dp)
    torch.manual_seed(cfg.run.seed)
    random.seed(cfg.run.seed)
    side = TrainerSide(cfg, dp)
    dp = side.dp  # the data-parallel view (Megatron tensor parallelism splits the world further)

    start_step, sft_done = 0, False
    checkpoint = latest_checkpoint(run_dir) if cfg.run.resume else None
    if checkpoint is not None:
        state = side.restore(checkpoint)
        start_step, sft_done = state["next_step"], state["sft_done"]
    if dp.is_main:
        truncate_metrics(run_dir, start_step, sft_done)
        print(f"[jetflow] run {run_dir}  mode={cfg.precision.mode}  recipe={cfg.precision.recipe().fingerprint()}  "
              f"model={cfg.model.path} ({side.model.num_params() / 1e6:.1f}M params)  data-parallel ranks={dp.world_size}",
              file=sys.stderr)
    logger = MetricsLogger(run_dir, cfg.run.tensorboard) if dp.is_main else None
    try:
        if cfg.train.sft_warmup_steps and not sft_done:
            side.supervised_warmup(logger)
            sft_done = True
            side.save(run_dir, 0, sft_done)

        rollout = build_rollout_side(cfg, side, run_dir, dp)
        loop = RLLoop(cfg, side.trainer, rollout, side.task, side.encode, side.tokenizer.pad_token_id,
                      run_fingerprint(cfg), side.kv_quantizer, dp)
        run_rl_steps(cfg, loop, start_step, logger, lambda step: side.save(run_dir, step, sft_done), run_dir=run_dir)
        side.save(run_dir, cfg.train.steps, sft_done)
        if dp.is_main:
            write_summary(run_dir, cfg, side.trainer.skipped_steps, dp.world_size)
        dp.barrier()
    finally:
        if logger is not None:
            logger.close()
    return run_dir


def log_position_curves(run_dir: Path, step: int, exp) -> None:
    """Append the step's mismatch by response index to mismatch_positions.jsonl (plotted by
    `jetflow ablate`): mean k3 and token count per index; a resumed step's last row wins."""
    if exp is None or exp.old_logprobs is None:
        return
    from jetflow.rl.mismatch import mismatch_position_curves
    curves = mismatch_position_curves(exp.rollout_logprobs, exp.old_logprobs, exp.response_mask)
    row = {"step": step, **{k: [float(f"{x:.4g}") for x in v.tolist()] for k, v in curves.items()}}
    with open(run_dir / "mismatch_positions.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def write_summary(run_dir: Path, cfg: Config, skipped_steps: int = 0, data_parallel_size: int = 1) -> dict:
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
        "skipped_steps": skipped_steps,
        "data_parallel_size": data_parallel_size,
        "config": to_dict(cfg),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / COMPLETE).write_text(time.strftime("%Y-%m-%dT%H:%M:%S") + "\n")
    return summary
