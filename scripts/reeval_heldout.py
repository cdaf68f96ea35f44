"""Held-out pass@1 of each finished cell's final weights, decoded in another precision mode.

A run's held-out evaluation (`eval/pass@1`) decodes with its rollout engine: under `mixed` that is the
low-precision rollout (FP8 or NVFP4 weights and activations) of the bf16 trainer's weights. A lower
pass@1 there can be the mismatch harming what the trainer learned, or only the quantized decoding of
the same weights (before any RL step the NVFP4 rollout already scores lower than bf16 on the same
weights). This script loads each finished cell's newest checkpoint (the weights after the last RL
step) into a fresh run of the cell's config with `precision.mode` replaced (default bf16: the trainer
precision of mixed) and runs the same held-out evaluation (same problems, greedy), so the learned
bf16 policy of a mixed cell is scored the way bf16's cells are. Unified cells are left out: their
trainer already computes in the rollout's precision.

    python scripts/reeval_heldout.py results/learning [--mode bf16] [--only 'PATTERN' ...]
        [--problems N] [--all-arms] [--out FILE]

Writes <ablation dir>/trainer_precision_eval.json (or --out): per cell, its logged final pass@1, the
pass@1 of the same weights re-decoded in the cell's own mode (a check: equal to the logged one under
exact numerics) and in --mode. --problems N evaluates N held-out problems instead of the cell's
eval.num_prompts (the first N of the same held-out split: less binomial noise, and then the logged
value is on other problems); --all-arms takes the unified cells too, so every arm of a grid is scored
by one and the same decoding engine.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from pathlib import Path

import torch


def final_logged(run_dir: Path) -> float | None:
    from jetflow.metrics_log import read_metrics

    evals = read_metrics(run_dir, "eval")
    return evals[-1]["eval/pass@1"] if evals else None


def evaluate(run_dir: Path, mode: str, problems: int | None = None) -> float:
    from jetflow.config import derive, load_config
    from jetflow.run.build import load_inputs
    from jetflow.run.sides import TrainerSide
    from jetflow.train.checkpoint import latest_checkpoint

    overrides = [f"precision.mode={mode}"] + ([f"eval.num_prompts={problems}"] if problems else [])
    cfg = load_config(run_dir / "config.yaml", overrides)
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    side = TrainerSide(cfg, derive(cfg), load_inputs(cfg))
    side.restore(latest_checkpoint(run_dir))
    return side.rl_loop(None).evaluate()["eval/pass@1"]


def main(argv: list[str] | None = None) -> int:
    from jetflow.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ablation_dir", type=Path)
    ap.add_argument("--mode", default="bf16")
    ap.add_argument("--only", nargs="*", default=None, help="cell id patterns")
    ap.add_argument("--problems", type=int, default=None, help="held-out problems (default: the cell's)")
    ap.add_argument("--all-arms", action="store_true", help="the unified cells too")
    ap.add_argument("--out", type=Path, default=None, help="default: <ablation dir>/trainer_precision_eval.json")
    args = ap.parse_args(argv)
    out_file = args.out or args.ablation_dir / "trainer_precision_eval.json"
    results = json.loads(out_file.read_text()) if out_file.exists() else {}
    for run_dir in sorted((args.ablation_dir / "runs").iterdir()):
        if not (run_dir / "COMPLETE").exists():
            continue
        if args.only and not any(fnmatch.fnmatchcase(run_dir.name, p) for p in args.only):
            continue
        own_mode = load_config(run_dir / "config.yaml").precision.mode
        done = results.get(run_dir.name, {})
        if (own_mode == "unified" and not args.all_arms) or (
                done.get("mode") == args.mode and done.get("problems") == args.problems):
            continue
        row = {"own_mode": own_mode, "mode": args.mode, "problems": args.problems, "logged_final": final_logged(run_dir),
               "own_mode_again": evaluate(run_dir, own_mode, args.problems),
               "in_mode": evaluate(run_dir, args.mode, args.problems) if own_mode != args.mode else None}
        if row["in_mode"] is None:
            row["in_mode"] = row["own_mode_again"]
        results[run_dir.name] = row
        print(run_dir.name, row, file=sys.stderr)
        out_file.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
