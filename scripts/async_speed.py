"""Wall-clock table of runs that differ in rollout.max_staleness (issue 72): per run, the RL steps' total
wall time, trained tokens per second of it, and each side's time (the trainer's training and its wait for the
engine; the engine's generation and its wait for the trainer), summed over the steps.

    python scripts/async_speed.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

from jetflow.metrics_log import read_metrics


def row(run_dir: Path) -> str:
    rows = read_metrics(run_dir, "rl")

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in rows)
    wall = total("time/step")
    tokens = sum(r["throughput/tokens_per_s"] * r["time/step"] for r in rows)  # the step's trained tokens
    return (f"| {run_dir.name} | {len(rows)} | {wall:.1f} | {tokens / wall:.1f} | {total('time/train'):.1f} | "
            f"{total('async/trainer_idle_s') if 'async/trainer_idle_s' in rows[0] else total('time/rollout'):.1f} | "
            f"{total('time/rollout'):.1f} | {total('async/engine_idle_s') if 'async/engine_idle_s' in rows[0] else total('time/train'):.1f} | "
            f"{total('time/sync'):.1f} | {sum(r['response/length_mean'] for r in rows) / len(rows):.1f} |")


if __name__ == "__main__":
    print("| run | steps | wall s | trained tok/s | trainer: train s | trainer: idle s | engine: generate s | "
          "engine: idle s | sync s | mean length |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for arg in sys.argv[1:]:
        print(row(Path(arg)))
