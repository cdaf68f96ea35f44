"""A run's life, written once: model load (+ resume) -> supervised warm-up -> RL steps with held-out
evaluations -> final writes (checkpoint, model/, summary.json + COMPLETE). Where the trainer and the
rollout engines live is the `Placement`'s business (one process or torchrun ranks: jetflow.run.local;
Ray actors: jetflow.run.ray_placement); the sequence is the same.

Every phase answers a stop request (jetflow.run.stop) at its next step boundary: a checkpoint where
there is state to keep, then `RunStopped`, and the run directory is marked STOPPED; the same command
with run.resume=true continues it, bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Protocol

import torch.distributed

from jetflow.config import Config, Derived, MemorySavers, loss_aggregation, to_dict
from jetflow.metrics_log import MetricsLogger
from jetflow.run.files import (append_position_curve, mark_stopped, tidy_for_resume, write_lora_dirs, write_model_dirs,
                               write_summary)
from jetflow.run.loop import RLLoop
from jetflow.run.stop import RESUME_HINT, RunStopped, StopRequests, collective_fault
from jetflow.tasks import RewardError
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
    """Load a checkpoint into every trainer; returns its state (next_step, sft_done[, warmup_step])."""

    def warmup_step(self, step: int) -> dict: ...
    """Supervised warm-up step `step` on every trainer; returns its metrics."""

    def save(self, step: int, sft_done: bool, warmup_step: int | None = None) -> None: ...
    """A checkpoint at RL step `step` (or at warm-up step `warmup_step`); every trainer joins."""

    def build_loop(self) -> RLLoop: ...
    """The RL loop over this placement's trainer and rollout engines."""

    def step_metrics(self, metrics: dict) -> dict: ...
    """Add the placement's own per-step metrics (e.g. actor restarts)."""

    def skipped_steps(self) -> int: ...

    def barrier(self) -> None: ...

    def any_rank(self, flag: bool) -> bool: ...
    """True on every rank if `flag` is True on any (a stop request must end all ranks at one step)."""


def run_sequence(cfg: Config, derived: Derived, placement: Placement, run_dir: Path,
                 stop: StopRequests | None = None) -> Path:
    """Run (or resume) the configured run on `placement`; returns its directory. `stop`: the stop
    requests caught since the run began (its model load included); default: from here on."""
    if stop is not None:
        return RunSequence(cfg, derived, placement, run_dir, stop).run()
    with StopRequests() as stop:
        return RunSequence(cfg, derived, placement, run_dir, stop).run()


class RunSequence:
    def __init__(self, cfg: Config, derived: Derived, placement: Placement, run_dir: Path, stop: StopRequests):
        self.cfg, self.placement, self.run_dir, self.stop, self.derived = cfg, placement, run_dir, stop, derived
        self.precision, self.loggers = derived.precision, derived.loggers  # resolved once (jetflow.config.derive)
        self.savers = derived.savers  # `auto` resolved by the memory estimate (jetflow.run.memory_estimate)
        self.logger: MetricsLogger | None = None
        self.state: dict = {}  # the newest checkpoint's: next_step, sft_done[, warmup_step]
        self.saved_at: tuple | None = None  # (step, warmup_step) of the newest checkpoint this run holds

    def run(self) -> Path:
        cfg, placement, run_dir = self.cfg, self.placement, self.run_dir
        try:
            checkpoint = latest_checkpoint(run_dir) if cfg.run.resume else None
            if checkpoint is not None:
                self.state = placement.restore(checkpoint)
                self.saved_at = (self.state["next_step"], self.state.get("warmup_step"))
            self._stop_point("model load", "step 0")  # (the model load is the placement's construction)
            if placement.is_main:
                tidy_for_resume(run_dir, self.state)
                print(f"[jetflow] run {run_dir}  mode={self.precision.mode.value}  "
                      f"recipe={self.precision.recipe.fingerprint()}  {placement.describe()}{objective_note(cfg)}"
                      f"{savers_note(self.savers)}",
                      file=sys.stderr)
                self.logger = MetricsLogger(run_dir, list(self.loggers), to_dict(cfg), cfg.run.tracker_project,
                                            cfg.run.mlflow_tracking_uri)
            self._warmup()
            self._rl_steps()
            self._final_writes()
        except RunStopped as stopped:  # its checkpoint is written: mark the run directory resumable
            if placement.is_main:
                stopped.resumes_at = mark_stopped(run_dir, stopped.signame, stopped.phase, stopped.at)
            raise
        except RuntimeError as e:  # another rank died or hung: one line, not a traceback
            fault = collective_fault(e, torch.distributed.is_initialized())
            if fault is None:
                raise
            raise fault from e
        finally:
            if self.logger is not None:
                self.logger.close()
        return run_dir

    # Stop requests ---------------------------------------------------------------------------------
    def _requested(self) -> str | None:
        """The stop request any rank received (every rank agrees), or None."""
        if not self.placement.any_rank(self.stop.signame is not None):
            return None
        return self.stop.signame or "a signal on another rank"

    def _stop_point(self, phase: str, at: str, save: Callable[[], None] | None = None) -> None:
        """A step boundary of `phase`: on a stop request, `save()` (a checkpoint of the state so far),
        then RunStopped."""
        signame = self._requested()
        if signame is None:
            return
        if save is not None:
            save()
        raise RunStopped(signame, phase, at, self.run_dir)

    def _save(self, step: int, sft_done: bool, warmup_step: int | None = None) -> None:
        """A checkpoint, unless this run already holds that one (a resume from it, an earlier stop point)."""
        if self.saved_at == (step, warmup_step):
            return
        self.placement.save(step, sft_done, warmup_step)
        self.saved_at = (step, warmup_step)

    def _log(self, step: int, metrics: dict, phase: str = "rl") -> None:
        if self.logger is not None:
            self.logger.log(step, metrics, phase=phase)

    # Phases ------------------------------------------------------------------------------------------
    def _warmup(self) -> None:
        """The supervised warm-up (unless done): rows logged as they come, a checkpoint every
        train.checkpoint_every steps, a stop request answered after the current step."""
        n, every = self.cfg.train.sft_warmup_steps, self.cfg.train.checkpoint_every
        if not n or self.state.get("sft_done"):
            return
        for step in range(self.state.get("warmup_step", 0), n):
            self._log(step, self.placement.warmup_step(step), phase="sft")
            if step + 1 == n:
                break
            checkpoint = lambda s=step: self._save(0, False, warmup_step=s + 1)
            self._stop_point("warm-up", f"warm-up step {step + 1}", checkpoint)
            if every and (step + 1) % every == 0:
                checkpoint()
        self._save(0, True)  # the warm-up's end: step_000000
        self.state = {"next_step": 0, "sft_done": True}

    def _rl_steps(self) -> None:
        """The RL steps with their logs, progress bar, periodic checkpoints and held-out evaluations
        (before step 0, every eval.every steps, and after the last: before step k, so a run resumed at
        k evaluates there again)."""
        cfg, start = self.cfg, self.state.get("next_step", 0)
        sft_done = bool(self.state.get("sft_done"))
        checkpoint = lambda step: self._save(step, sft_done)  # noqa: E731
        self._stop_point("rl", f"step {start}", lambda: checkpoint(start))
        loop = self.placement.build_loop()
        evaluate = cfg.eval.num_prompts > 0
        progress = _progress_bar(cfg, start) if cfg.run.progress and self.logger is not None else None
        held_out = ""  # the progress line's latest held-out accuracy
        step = start
        try:
            for step in range(start, cfg.train.steps):
                if evaluate and (step == 0 or (cfg.eval.every and step % cfg.eval.every == 0)):
                    held_out = f"held-out {self._evaluate(loop, step)['eval/pass@1']:.2f} "
                    self._stop_point("evaluation", f"step {step}", lambda s=step: checkpoint(s))
                metrics = self.placement.step_metrics(loop.step(step))
                self._log(step, metrics)
                if self.placement.is_main:
                    append_position_curve(self.run_dir, step, loop.last_experience)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix_str(_progress_line(metrics, held_out))
                self._stop_point("rl", f"step {step + 1}", lambda s=step: checkpoint(s + 1))
                every = cfg.train.checkpoint_every
                if every and (step + 1) % every == 0 and step + 1 < cfg.train.steps:
                    checkpoint(step + 1)
            step = cfg.train.steps
            if evaluate:
                self._evaluate(loop, step)
        except RewardError as e:  # the user's reward function failed before the step's update: keep what the run
            checkpoint(step)  # has (the step's starting state), then the one line
            raise RewardError(f"{e}; the run is checkpointed at step {step}: fix the reward, then {RESUME_HINT}") \
                from None
        finally:
            if progress is not None:
                progress.close()

    def _evaluate(self, loop: RLLoop, step: int) -> dict[str, float]:
        metrics = loop.evaluate()  # every rank: each decodes its share
        self._log(step, metrics, phase="eval")
        return metrics

    def _final_writes(self) -> None:
        """The final checkpoint, model/ (+ model-fp8/; with LoRA adapter/, model/ merged, + base-fp8/) from it,
        then summary.json and COMPLETE: each
        atomic, a stop request answered between them (a resume then finishes the run)."""
        cfg, placement, steps = self.cfg, self.placement, self.cfg.train.steps
        at = f"step {steps}"
        sft_done = bool(self.state.get("sft_done"))
        self._stop_point("final writes", at, lambda: self._save(steps, sft_done))
        self._save(steps, sft_done)
        self._stop_point("final writes", at)
        if placement.is_main and cfg.model.lora.rank:  # adapter/ (PEFT), model/ merged (+ base-fp8/ under unified)
            write_lora_dirs(self.run_dir, latest_checkpoint(self.run_dir), cfg, self.derived)
        elif placement.is_main:  # from the final checkpoint: the same for every placement
            write_model_dirs(self.run_dir, latest_checkpoint(self.run_dir), self.precision)
        self._stop_point("final writes", at)
        self.stop.after_run = True  # no stop point is left: a signal from here on lets the run finish
        if placement.is_main:
            write_summary(self.run_dir, cfg, placement.skipped_steps(), placement.data_parallel_size)
        placement.barrier()


def objective_note(cfg: Config) -> str:
    """What the header says of an objective default that followed another key (empty when none did)."""
    if cfg.algo.loss_agg == "auto" and cfg.algo.ratio_level == "sequence":
        return f"  algo.loss_agg={loss_aggregation(cfg.algo)} (GSPO's, as algo.ratio_level=sequence defines it)"
    return ""


def savers_note(savers: MemorySavers) -> str:
    """What the header says of the memory savers `auto` turned on, and why (empty when it turned none on)."""
    return f"  {savers.note}" if savers.note else ""


def _progress_bar(cfg: Config, start: int):
    from tqdm import tqdm
    return tqdm(total=cfg.train.steps, initial=start, desc=f"{cfg.run.name} [{cfg.precision.mode}]",
                file=sys.stderr, dynamic_ncols=True)


def _progress_line(metrics: dict, held_out: str) -> str:
    return (f"reward {metrics['reward/mean']:.3f} {held_out}kl {metrics['mismatch/kl_k3']:.1e} | "
            f"rollout {metrics['time/rollout']:.1f}s old {metrics['time/old_logprobs']:.1f}s "
            f"train {metrics['time/train']:.1f}s sync {metrics['time/sync']:.2f}s | "
            f"{metrics['throughput/tokens_per_s']:.0f} tok/s")
