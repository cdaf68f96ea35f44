"""Seconds per weight update to the engine's process (rollout.max_staleness > 0, jetflow.run.engine_process), and
the in-process update of the synchronous loop for comparison (issue 72).

For each precision mode given: builds the trainer side of the run (default config: SmolLM2-135M-Instruct), starts
the engine's process, then REPEATS times: the trainer's update for a new version (`build` s), handed to the engine's
process (`send` s: what the trainer waits for), and waited for until the engine has loaded it (`loaded` s after the
send returned: the transfer, the engine's checks and its load). The in-process row loads the same update into a
rollout model in this process (`apply_update`, as the synchronous loop does). Prints one line per repetition and
the medians.

    python scripts/engine_update_speed.py [--modes unified,bf16] [--repeats 5] [--threads 1] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from jetflow.config import derive, load_config
from jetflow.run.build import load_inputs
from jetflow.run.engine_process import ProcessRollout
from jetflow.run.sides import TrainerSide, build_rollout_side, standalone_engine


def measure(mode: str, repeats: int, threads: int, overrides: list[str]) -> None:
    cfg = load_config(None, [f"precision.mode={mode}", f"run.num_threads={threads}", *overrides])
    derived = derive(cfg)
    torch.set_num_threads(threads)
    side = TrainerSide(cfg, derived, load_inputs(cfg))
    trainer = side.trainer
    local = build_rollout_side(cfg, derived, side.inputs, side)
    engine = ProcessRollout(standalone_engine, cfg, derived, threads)
    rows: list[tuple[float, float, float, float]] = []
    try:
        for i in range(repeats):
            trainer.version = i + 1
            t0 = time.perf_counter()
            update = trainer.weight_update(derived.precision.mode.value, derived.precision.fingerprint)
            t1 = time.perf_counter()
            ticket = engine.process.send("load_weights", update)  # wanted: its reply says it is loaded
            t2 = time.perf_counter()
            engine.process.reply(ticket)
            t3 = time.perf_counter()
            local.load_weights(update)
            t4 = time.perf_counter()
            rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
            print(f"{mode} v{i + 1}: {update.nbytes() / 1e6:.1f} MB  build {t1 - t0:.3f} s  send {t2 - t1:.3f} s  "
                  f"loaded {t3 - t2:.3f} s  (process total {t2 - t1 + t3 - t2:.3f} s)  in-process load {t4 - t3:.3f} s",
                  flush=True)
    finally:
        engine.close()
    build, send, loaded, local_s = (statistics.median(c) for c in zip(*rows[1:] or rows))  # the first warms up
    print(f"{mode} median of v2..v{repeats}: build {build:.3f} s  send {send:.3f} s  loaded {loaded:.3f} s  "
          f"process total {send + loaded:.3f} s  in-process load {local_s:.3f} s", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="unified,bf16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    for mode in args.modes.split(","):
        measure(mode, args.repeats, args.threads, args.overrides)
