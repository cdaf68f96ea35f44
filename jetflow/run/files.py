"""The run directory and every file name in it (the one owner of these names).

<run.out_dir>/<run.name>/
    config.yaml                 the resolved config (written first; a resume must match it)
    metrics.jsonl               one JSON row per SFT / RL step (jetflow.metrics_log)
    mismatch_positions.jsonl    per RL step: mean k3 and token count per response index
    tensorboard/, wandb/, mlruns/   the trackers of run.loggers (jetflow.trackers); trackers.json: their run ids
    *.damaged                   damaged lines or files a resume set aside (named in its warning)
    checkpoints/                warmup_NNNNNN/, step_NNNNNN/ + latest (jetflow.train.checkpoint)
    vllm_engine*/, rollout_engine*/   checkpoints the vLLM engines start from
    model/, model-fp8/          the trained policy as a Hugging Face directory (bf16) and, under
                                `unified`, its FP8 export (written at the end, from the final checkpoint)
    summary.json + COMPLETE     written only when the run finished (COMPLETE last)
    STOPPED                     the run stopped on a signal (SIGTERM / SIGINT / SIGUSR1), resumable
    LOCK                        while a run is in it: the owner's pid and host
    error.txt                   the traceback of a failed ablation cell (jetflow.ablate)

A directory without COMPLETE is an unfinished run: `run.resume=true` continues it from its last
checkpoint. The checkpoints are the run's truth; every other file is derived from the run and never
blocks a resume (a damaged row is set aside with a warning), and every final write is atomic.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

from jetflow.config import Config, Derived, config_text, to_dict
from jetflow.distributed import SINGLE, DataParallel
from jetflow.errors import UserError
from jetflow.precision.plan import Precision
from jetflow.metrics_log import (
    METRIC_KEYS,
    METRICS_FILE,
    RESUME_HINT,
    read_metrics,
    set_aside_bad_lines,
    warn,
    write_jsonl,
)
from jetflow.train.checkpoint import CHECKPOINTS_DIR
from jetflow.writes import LockHeld, WriteError, append_text, atomic_write_text, guarded, lock_file

CONFIG_FILE = "config.yaml"
POSITIONS_FILE = "mismatch_positions.jsonl"
SUMMARY_FILE = "summary.json"
COMPLETE = "COMPLETE"
STOPPED = "STOPPED"
ERROR_FILE = "error.txt"
LOCK_FILE = "LOCK"


def run_dir_of(cfg: Config) -> Path:
    return Path(cfg.run.out_dir) / cfg.run.name


def engine_dir(run_dir: Path, kind: str, index: int = 0) -> Path:
    """Where a rollout engine's start-up checkpoint goes: `vllm_engine[_rankN]` for a local / torchrun
    rank's engine, `rollout_engineN` for a Ray rollout actor."""
    if kind == "ray":
        return run_dir / f"rollout_engine{index}"
    return run_dir / (f"vllm_engine_rank{index}" if index else "vllm_engine")


def run_status(run_dir: Path) -> str:
    """complete | failed | partial (started, resumable) | pending."""
    if (run_dir / COMPLETE).exists():
        return "complete"
    if (run_dir / ERROR_FILE).exists():
        return "failed"
    return "partial" if run_dir.exists() else "pending"


class RunDirectoryInUse(UserError, RuntimeError):
    """Another live run holds the run directory's LOCK."""


def holds_a_run(run_dir: Path) -> bool:
    """A run was started in `run_dir` (what run.resume=true continues)."""
    return any((run_dir / name).exists() for name in (COMPLETE, CHECKPOINTS_DIR, METRICS_FILE))


@contextmanager
def run_directory(cfg: Config, dp: DataParallel = SINGLE) -> Iterator[Path]:
    """The run directory, held while the run is in it: rank 0 takes its LOCK and writes config.yaml
    (the others wait for it); leaving releases the LOCK. What the directory holds was checked by the
    pre-run pass (jetflow.run.validate.check_run_dir)."""
    run_dir, text = run_dir_of(cfg), config_text(cfg)
    lock = run_dir / LOCK_FILE
    dp.barrier()  # no rank may see rank 0's fresh files before it checked
    refused: UserError | None = None
    with ExitStack() as held:  # the LOCK this process took, released however the block ends
        if dp.is_main:
            try:
                with guarded(run_dir, "the run directory"):
                    run_dir.mkdir(parents=True, exist_ok=True)
                held.enter_context(lock_file(lock, "the run's lock file"))
                (run_dir / COMPLETE).unlink(missing_ok=True)
                (run_dir / STOPPED).unlink(missing_ok=True)
                atomic_write_text(run_dir / CONFIG_FILE, text, "the run config")
            except LockHeld as e:
                refused = RunDirectoryInUse(f"run directory {run_dir} is in use by pid {e.pid} on {e.host} (its "
                                            f"{LOCK_FILE}); wait for that run to end, choose another run.name, or, "
                                            f"if that process is gone, delete {lock}")
            except WriteError as e:
                refused = e
        if dp.sum(float(refused is not None)):  # every rank learns it: none may wait for rank 0 in vain
            raise refused or RunDirectoryInUse(f"run directory {run_dir} is in use by another run (see rank 0's error)")
        dp.barrier()
        yield run_dir


def describe_position(state: dict) -> str:
    """Where a checkpoint's state resumes: "warm-up step K" or "step N"."""
    return f"warm-up step {state['warmup_step']}" if "warmup_step" in state else f"step {state['next_step']}"


def mark_stopped(run_dir: Path, signame: str, phase: str, at: str) -> str | None:
    """STOPPED: the run stopped on a signal and a resume continues it (the SLURM templates requeue
    the job when it is there; the next run removes it). Returns where a resume continues: the newest
    checkpoint's position (None without a checkpoint)."""
    pointer = run_dir / CHECKPOINTS_DIR / "latest"
    try:  # the newest checkpoint's position (not verified here: a resume does that)
        resumes_at = describe_position(json.loads((pointer.parent / pointer.read_text().strip() / "state.json")
                                                  .read_text()))
    except (OSError, ValueError, KeyError):
        resumes_at = None
    atomic_write_text(run_dir / STOPPED, json.dumps({"signal": signame, "phase": phase, "stopped_at": at,
                                                      "resumes_at": resumes_at}) + "\n", "the stop mark", RESUME_HINT)
    return resumes_at


def tidy_for_resume(run_dir: Path, state: dict) -> None:
    """On resume, make the derived files agree with the checkpoint the run resumes from (`state`; {}
    for none): damaged lines of metrics.jsonl and mismatch_positions.jsonl are set aside with a warning,
    rows of steps the checkpoint does not contain are dropped (they are redone; an evaluation at the
    resumed step too), and rows that are missing are named."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        if state.get("next_step", 0) or state.get("sft_done"):
            warn(f"{path} is missing; the run goes on from its checkpoint, the rows of the steps before it are lost")
        return
    rows = set_aside_bad_lines(path, METRIC_KEYS)
    if not state and rows:
        warn(f"{run_dir} has no checkpoint: starting over; its {len(rows)} metric row(s) are dropped")
    next_step, sft_done, warm = state.get("next_step", 0), state.get("sft_done", False), state.get("warmup_step", 0)
    kept = [r for r in rows if (r["phase"] == "sft" and (sft_done or r["step"] < warm))
            or (r["phase"] in ("rl", "eval") and r["step"] < next_step)]
    if path.is_file():
        write_jsonl(path, kept)
    lost = sorted(set(range(next_step)) - {r["step"] for r in kept if r["phase"] == "rl"})
    if lost:
        warn(f"{path} has no rows for RL step(s) {_ranges(lost)}; the run goes on from its checkpoint without them")
    set_aside_bad_lines(run_dir / POSITIONS_FILE)


def _ranges(steps: list[int]) -> str:
    parts, start = [], steps[0]
    for a, b in zip(steps, steps[1:] + [None]):
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)


def append_position_curve(run_dir: Path, step: int, exp) -> None:
    """Append the step's mismatch by response index to mismatch_positions.jsonl (plotted by
    `jetflow ablate`): mean k3 and token count per index; a resumed step's last row wins."""
    if exp is None or exp.old_logprobs is None:
        return
    from jetflow.rl.mismatch import mismatch_position_curves
    curves = mismatch_position_curves(exp.rollout_logprobs, exp.old_logprobs, exp.response_mask)
    row = {"step": step, **{k: [float(f"{x:.4g}") for x in v.tolist()] for k, v in curves.items()}}
    append_text(run_dir / POSITIONS_FILE, json.dumps(row) + "\n", "the mismatch-by-position file", RESUME_HINT)


def write_model_dirs(run_dir: Path, checkpoint: Path, precision: Precision) -> None:
    """<run>/model (and <run>/model-fp8 under unified) from the final checkpoint (self-describing),
    by jetflow.export.write_final_model."""
    from jetflow.export import write_final_model
    from jetflow.model import load_hf_dir, load_tokenizer
    write_final_model(run_dir, load_hf_dir(checkpoint), load_tokenizer(checkpoint), precision.mode,
                      precision.recipe)


def write_lora_dirs(run_dir: Path, checkpoint: Path, cfg: Config, derived: Derived) -> None:
    """A LoRA run's <run>/adapter (PEFT), <run>/model (merged) and under unified <run>/base-fp8
    (jetflow.export.write_lora_model): the final checkpoint's adapters on the trainer's frozen base rebuilt from
    its source as the native trainer builds it (the run's RNG streams untouched), checked against the base the
    checkpoint says the adapters were trained on."""
    import torch
    from jetflow.export import write_lora_model
    from jetflow.precision.lora import base_digest
    from jetflow.run.build import apply_mode, build_policy, lora_adapter_config, with_lora
    from jetflow.train.checkpoint import LORA_BASE, check_lora_base, load_adapters
    with torch.random.fork_rng():
        base, tokenizer = build_policy(cfg)
        model = with_lora(apply_mode(base, derived.precision, "trainer"), cfg, "trainer")  # native, whatever the
        # trainer backend: the Megatron trainer's checkpoint holds its adapters whole and the native base's digest
    trained_on = torch.load(checkpoint / "trainer.pt", weights_only=True).get(LORA_BASE)
    if trained_on is not None:
        check_lora_base(checkpoint, trained_on, base_digest(model), cfg.model.path)
    load_adapters(checkpoint, model)
    write_lora_model(run_dir, model, tokenizer, derived.precision.mode, lora_adapter_config(cfg, model),
                     derived.precision.recipe)


def write_summary(run_dir: Path, cfg: Config, skipped_steps: int = 0, data_parallel_size: int = 1) -> dict:
    """summary.json from the RL rows of metrics.jsonl, then COMPLETE (the run is finished)."""
    rows, evals = read_metrics(run_dir), read_metrics(run_dir, phase="eval")
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
        # held-out pass@1 and reward before the first RL step and after the last (without evaluation: none)
        **({"heldout_pass1_start": evals[0]["eval/pass@1"], "heldout_pass1_end": evals[-1]["eval/pass@1"],
            "heldout_reward_start": evals[0]["eval/reward"], "heldout_reward_end": evals[-1]["eval/reward"],
            "heldout_prompts": int(evals[-1]["eval/num_prompts"])} if evals else {}),
        "skipped_steps": skipped_steps,
        "data_parallel_size": data_parallel_size,
        "config": to_dict(cfg),
    }
    after = "the run's checkpoints are intact: the same command with run.resume=true finishes it"
    atomic_write_text(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2), "the run summary", after)
    atomic_write_text(run_dir / COMPLETE, time.strftime("%Y-%m-%dT%H:%M:%S") + "\n", "the run's end mark", after)
    return summary
