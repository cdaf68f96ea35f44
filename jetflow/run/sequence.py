"""A run's life, written once: resume -> supervised warm-up -> RL steps -> final checkpoint ->
summary. Where the trainer and the rollout engines live is the `Placement`'s business (one process
or torchrun ranks: jetflow.run.local; Ray actors: jetflow.run.ray_placement); the sequence is the same.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Protocol

from jetflow.config import Config
from jetflow.metrics_log import MetricsLogger
from jetflow.run.files import (append_position_curve, mark_stopped, truncate_metrics, write_final_model,
                               write_summary)
from jetflow.run.loop import RLLoop
from jetflow.run.stop import RunStopped, StopRequests
from jetflow.train.checkpoint import latest_checkpoint


class Placement(Protocol):
    """The trainer and rollout sides of a run, wherever they live; a context manager (leaving it
    releases what the placement started: actors, a Ray cluster)."""
    is_main: bool
    """This process writes the logs and the summary."""
    data_parallel_size: int

    def describe(self) -> str: ...
    """One line for the start-up banner (layout, model size)."""

    def restore(self, checkpoint: Path) -> dict: ...
    """Load a checkpoint into every trainer; returns its state (next_step, sft_done)."""

    def supervised_warmup(self) -> list[dict]: ...
    """Run the supervised warm-up; returns its per-step metric rows."""

    def save(self, step: int, sft_done: bool) -> None: ...
    """A checkpoint at `step` (every trainer joins)."""

    def build_loop(self) -> RLLoop: ...
    """The RL loop over this placement's trainer and rollout engines."""

    def step_metrics(self, metrics: dict) -> dict: ...
    """Add the placement's own per-step metrics (e.g. actor restarts)."""

    def skipped_steps(self) -> int: ...

    def barrier(self) -> None: ...

    def any_rank(self, flag: bool) -> bool: ...
    """True on every rank if `flag` is True on any (a stop request must end all ranks at one step)."""


def run_sequence(cfg: Config, placement: Placement, run_dir: Path) -> Path:
    """Run (or resume) the configured run on `placement`; returns its directory."""
    start_step, sft_done = 0, False
    checkpoint = latest_checkpoint(run_dir) if cfg.run.resume else None
    if checkpoint is not None:
        state = placement.restore(checkpoint)
        start_step, sft_done = state["next_step"], state["sft_done"]
    if placement.is_main:
        truncate_metrics(run_dir, start_step, sft_done)
        print(f"[jetflow] run {run_dir}  mode={cfg.precision.mode}  recipe={cfg.precision.recipe().fingerprint()}  "
              f"{placement.describe()}", file=sys.stderr)
    logger = MetricsLogger(run_dir, cfg.run.tensorboard) if placement.is_main else None
    try:
        with StopRequests() as stop:
            _run(cfg, placement, run_dir, logger, start_step, sft_done, stop)
    finally:
        if logger is not None:
            logger.close()
    return run_dir


def _run(cfg: Config, placement: Placement, run_dir: Path, logger, start_step: int, sft_done: bool,
         stop: StopRequests) -> None:
    try:
        sft_done = _train(cfg, placement, run_dir, logger, start_step, sft_done, stop)
    except RunStopped as stopped:  # its checkpoint is written: mark the run directory resumable
        if placement.is_main:
            stopped.resumes_at = mark_stopped(run_dir, stopped.signame, stopped.stopped_at)
        raise
    placement.save(cfg.train.steps, sft_done)
    if placement.is_main:  # from the final checkpoint: the same for every placement
        write_final_model(run_dir, latest_checkpoint(run_dir), cfg)
        write_summary(run_dir, cfg, placement.skipped_steps(), placement.data_parallel_size)
    placement.barrier()


def _train(cfg: Config, placement: Placement, run_dir: Path, logger, start_step: int, sft_done: bool,
           stop: StopRequests) -> bool:
    """The supervised warm-up (unless done) and the RL steps; returns sft_done."""
    def stop_requested() -> str | None:
        if not placement.any_rank(stop.signame is not None):
            return None
        return stop.signame or "a signal on another rank"

    if cfg.train.sft_warmup_steps and not sft_done:
        rows = placement.supervised_warmup()
        if logger is not None:
            for step, metrics in enumerate(rows):
                logger.log(step, metrics, phase="sft")
        sft_done = True
        placement.save(0, sft_done)
    signame = stop_requested()
    if signame is not None:  # during the warm-up: its checkpoint is written
        raise RunStopped(signame, start_step, run_dir)
    loop = placement.build_loop()
    run_rl_steps(cfg, loop, start_step, logger, lambda step: placement.save(step, sft_done),
                 on_metrics=placement.step_metrics, run_dir=run_dir, stop=stop_requested,
                 evaluate=(lambda step: _evaluate(loop, logger, step)) if cfg.eval.num_prompts else None)
    return sft_done


def _evaluate(loop: RLLoop, logger, step: int) -> dict[str, float]:
    metrics = loop.evaluate()  # every rank: each decodes its share
    if logger is not None:
        logger.log(step, metrics, phase="eval")
    return metrics


def run_rl_steps(cfg: Config, loop: RLLoop, start_step: int, logger, checkpoint: Callable[[int], None],
                 on_metrics: Callable[[dict], dict] | None = None, run_dir: Path | None = None,
                 stop: Callable[[], str | None] | None = None, evaluate: Callable[[int], dict] | None = None) -> None:
    """The RL steps of a run with their logs, progress bar and periodic checkpoints (logger None: not
    the logging rank). `stop()` names a stop request: then a checkpoint and RunStopped. `evaluate(k)`
    runs the held-out evaluation at step k (before step 0, every eval.every steps, after the last):
    before RL step k, so a run resumed at k evaluates there again."""
    progress = None
    if cfg.run.progress and logger is not None:
        from tqdm import tqdm
        progress = tqdm(total=cfg.train.steps, initial=start_step, desc=f"{cfg.run.name} [{cfg.precision.mode}]",
                        file=sys.stderr, dynamic_ncols=True)
    held_out = ""  # the progress line's latest held-out accuracy
    try:
        for step in range(start_step, cfg.train.steps):
            if evaluate is not None and (step == 0 or (cfg.eval.every and step % cfg.eval.every == 0)):
                held_out = f"held-out {evaluate(step)['eval/pass@1']:.2f} "
            metrics = loop.step(step)
            if on_metrics is not None:
                metrics = on_metrics(metrics)
            if logger is not None:
                logger.log(step, metrics)
                if run_dir is not None:
                    append_position_curve(run_dir, step, loop.last_experience)
            if progress is not None:
                progress.update(1)
                progress.set_postfix_str(
                    f"reward {metrics['reward/mean']:.3f} {held_out}kl {metrics['mismatch/kl_k3']:.1e} | "
                    f"rollout {metrics['time/rollout']:.1f}s old {metrics['time/old_logprobs']:.1f}s "
                    f"train {metrics['time/train']:.1f}s sync {metrics['time/sync']:.2f}s | "
                    f"{metrics['throughput/tokens_per_s']:.0f} tok/s")
            last = step + 1 == cfg.train.steps
            every = cfg.train.checkpoint_every
            signame = None if last or stop is None else stop()
            if signame is not None or (every and (step + 1) % every == 0 and not last):
                checkpoint(step + 1)
            if signame is not None:
                raise RunStopped(signame, step + 1, run_dir)
        if evaluate is not None:
            evaluate(cfg.train.steps)
    finally:
        if progress is not None:
            progress.close()
