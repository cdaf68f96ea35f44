"""Trained tokens/s and peak RSS of one training step over response lengths, before / after the trainer's
memory savers, each configuration in a fresh process (ru_maxrss is a high-water mark: a process that
ran a larger configuration first would report that one's peak).

    python -m jetflow.bench.train_step_sweep --batch 4 --response-lens 256,1024 --settings before,after \\
        --out-dir results/train-step-long

Each configuration runs `jetflow bench train-step --modes <mode>` (jetflow.bench.train_step) in its own
subprocess and this module collects its tokens/s and peak RSS into <out-dir>/<name>.{json,md}.
Settings: before = train.logprob_chunk_tokens=0, train.activation_checkpointing=false; after = chunks of
--chunk positions and checkpointing on.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from jetflow.bench.common import markdown_table, write_results

SETTINGS = {"before": ("train.logprob_chunk_tokens=0", "train.activation_checkpointing=false"),
            "after": ("train.logprob_chunk_tokens={chunk}", "train.activation_checkpointing=true")}


def one(model: str, mode: str, batch: int, prompt_len: int, response_len: int, lengths: str, setting: str,
        chunk: int, reps: int, warmup: int, out_dir: Path, timeout_s: int) -> dict:
    """One configuration in a fresh process: its row (tokens/s, peak RSS) or the reason it has none."""
    name = f"{setting}-b{batch}-r{response_len}-{lengths}"
    overrides = [o.format(chunk=chunk) for o in SETTINGS[setting]]
    cmd = [sys.executable, "-m", "jetflow.cli", "bench", "train-step", "--model", model, "--modes", mode,
           "--batch", str(batch), "--prompt-len", str(prompt_len), "--response-len", str(response_len),
           "--lengths", lengths, "--reps", str(reps), "--warmup", str(warmup), "--out-dir", str(out_dir / "runs"),
           "--name", name, *overrides]
    row = {"setting": setting, "batch": batch, "response_len": response_len, "lengths": lengths,
           "overrides": " ".join(overrides)}
    print(f"{name}: {' '.join(cmd[1:])}", flush=True)
    try:
        done = subprocess.run(cmd, timeout=timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"over {timeout_s} s"}
    if done.returncode != 0:
        return {**row, "error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1]}
    payload = json.loads((out_dir / "runs" / f"{name}.json").read_text())
    r = payload["rows"][0]
    return {**row, "tokens": payload["workload"]["tokens_per_step"], "s_per_step": r["ms_per_step"] / 1e3,
            "tokens_per_s": r["tokens_per_s"], "peak_rss_gb": payload["peak_rss_gb"], "loss": r["loss"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--mode", default="unified")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-lens", default="256,1024,2048")
    ap.add_argument("--lengths", default="fixed", choices=["fixed", "long-tail"])
    ap.add_argument("--settings", default="before,after")
    ap.add_argument("--chunk", type=int, default=1024, help="after: train.logprob_chunk_tokens")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--timeout-s", type=int, default=3600)
    ap.add_argument("--out-dir", default="results/train-step-long")
    ap.add_argument("--name", default="sweep")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    rows = [one(args.model, args.mode, args.batch, args.prompt_len, int(r), args.lengths, s, args.chunk, args.reps,
                args.warmup, out, args.timeout_s)
            for r in args.response_lens.split(",") for s in args.settings.split(",")]
    for row in rows:
        print(row, flush=True)
    md = (f"`{args.model}`, {args.mode}, batch {args.batch}, {args.prompt_len}-token prompts, {args.lengths} "
          f"response lengths; one training step (`Trainer.train_step`) per configuration after {args.warmup} "
          f"warm-up step(s), {args.reps} measured, each configuration in a fresh process (peak RSS = its "
          f"ru_maxrss, model load included). tokens = real tokens of the step, prompts included.\n\n"
          + markdown_table(rows, ["setting", "batch", "response_len", "tokens", "s_per_step", "tokens_per_s",
                                  "peak_rss_gb", "loss", "error"]))
    print(f"wrote {write_results(args.name, {'rows': rows, 'args': vars(args)}, md, out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
