"""`jetflow bench suite`: gemm, rollout, train-step, rl-step and sync in sequence, then an index.

Each benchmark writes its own JSON + markdown under `out_dir` (with the command line, the machine
and the load average); `suite.md` / `suite.json` list them with one headline number each. A
benchmark that fails is recorded with its error and the others still run.
"""

from __future__ import annotations

import statistics
import time
import traceback
from typing import Callable

import torch

from jetflow.bench.common import markdown_table, write_results
from jetflow.bench.workload import LENGTHS
from jetflow.errors import UsageError

BENCHES = ("gemm", "rollout", "train-step", "rl-step", "sync")


def _device_tag(device: str | None) -> str:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return "gpu" if dev.type == "cuda" else "cpu"


def _gemm(model: str, out_dir: str, device: str | None, **kw) -> tuple[str, dict, dict]:
    from jetflow.bench import gemm
    payload = gemm.run(device=device, out_dir=out_dir, **kw)
    speedups = [r["speedup_quant_gemm"] for r in payload["rows"]]
    return f"gemm-{_device_tag(device)}", payload, {
        "name": f"FP8 quantize + GEMM / bf16 GEMM speed, median over shapes (backend {payload['backend']})",
        "value": statistics.median(speedups) if speedups else None}


def _rollout(model: str, out_dir: str, device: str | None, **kw) -> tuple[str, dict, dict]:
    from jetflow.bench import rollout
    from jetflow.run.build import smollm2_dir
    if model == "tiny":
        raise ValueError("rollout compares with HF generate and needs a Hugging Face model directory (not tiny)")
    path = str(smollm2_dir(".cache/models")) if model == "smollm2" else model
    payload = rollout.run(path, device=device, out_dir=out_dir, **kw)
    fp32 = next((r for r in payload["rows"] if r["system"] == "jetflow fp32" and "vs_hf" in r), None)
    return f"rollout-{_device_tag(device)}", payload, {
        "name": "jetflow fp32 / HF generate fp32 new tokens/s", "value": fp32["vs_hf"] if fp32 else None}


def _own_headline(module_name: str, file_prefix: str) -> Callable:
    """Runner for the benches whose payload carries its own `headline` (train-step, rl-step, sync)."""
    def runner(model: str, out_dir: str, device: str | None, **kw) -> tuple[str, dict, dict]:
        import importlib
        module = importlib.import_module(f"jetflow.bench.{module_name}")
        if device is not None and module_name != "rl_step":
            kw["device"] = device
        payload = module.run(model, out_dir=out_dir, **kw)
        headline = dict(payload["headline"])
        if headline["value"] is None and payload.get("notes"):
            headline["note"] = payload["notes"][0]  # e.g. why TRL did not run
        return f"{file_prefix}-{_device_tag(device)}", payload, headline
    return runner


RUNNERS: dict[str, Callable] = {
    "gemm": _gemm,
    "rollout": _rollout,
    "train-step": _own_headline("train_step", "train-step"),
    "rl-step": _own_headline("rl_step", "rl-step"),
    "sync": _own_headline("weight_sync", "sync"),
}


def run(model: str = "smollm2", benches: tuple[str, ...] = BENCHES, out_dir: str = "results/bench",
        device: str | None = None, options: dict[str, dict] | None = None) -> dict:
    """Run `benches` in order; options[bench] are extra keyword arguments of that bench's run()."""
    unknown = [b for b in benches if b not in RUNNERS]
    if unknown:
        raise ValueError(f"unknown benches {unknown}; valid: {list(RUNNERS)}")
    options = options or {}
    rows = []
    for bench in benches:
        print(f"[suite] {bench}", flush=True)
        t0 = time.perf_counter()
        row = {"bench": bench}
        try:
            file, _, headline = RUNNERS[bench](model, out_dir, device, **options.get(bench, {}))
            row.update(file=f"{file}.md", headline=headline["name"], value=headline["value"])
            if "note" in headline:
                row["note"] = headline["note"]
        except Exception as e:  # one broken bench must not hide the others' results
            traceback.print_exc()
            row.update(error=f"{type(e).__name__}: {e}")
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
    failed = [r["bench"] for r in rows if "error" in r]
    payload = {"model": model, "benches": list(benches), "options": options, "rows": rows, "failed": failed}
    table_rows = [{**r, "file": f"[{r['file']}]({r['file']})" if "file" in r else "",
                   "value": r["value"] if r.get("value") is not None else r.get("error", r.get("note", "n/a"))}
                  for r in rows]
    md = (f"Benchmark suite on model `{model}`: each line links the benchmark's own result (its workload, "
          f"machine load and full table).\n\n"
          + markdown_table(table_rows, ["bench", "headline", "value", "file", "seconds"]))
    path = write_results("suite", payload, md, out_dir)
    print(f"wrote {path}" + (f"; failed: {failed}" if failed else ""))
    return payload


def run_from_cli(args) -> int:
    """`jetflow bench train-step | rl-step | sync | suite` from the parsed command line."""
    from jetflow.bench import rl_step, train_step, weight_sync
    model = args.model or "smollm2"
    reps = {} if args.reps is None else {"reps": args.reps}
    rl_options = {"prompts": args.prompts or 4, "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
                  "compare_trl": not args.no_trl, **reps}
    if args.what == "train-step":
        if args.lengths not in (None, *LENGTHS):
            raise UsageError(f"bench train-step --lengths {args.lengths}: one of {', '.join(LENGTHS)}")
        budget = args.max_tokens_per_micro_batch
        packing = () if budget is None else (f"train.max_tokens_per_micro_batch={budget}",)
        train_step.run(model, modes=tuple(args.modes.split(",")), batch=args.batch or 8, prompt_len=args.prompt_len,
                       response_len=args.response_len, lengths=args.lengths or "fixed", warmup=args.warmup,
                       overrides=(*args.overrides, *packing), device=args.device, out_dir=args.out_dir, name=args.name,
                       **reps)
    elif args.what == "rl-step":
        rl_step.run(model, out_dir=args.out_dir, **rl_options)
    elif args.what == "sync":
        weight_sync.run(model, device=args.device, out_dir=args.out_dir, **reps)
    elif args.what == "suite":
        options = {"gemm": {"shapes": args.shapes, "iters": args.iters, "backend": args.backend},
                   "train-step": dict(reps), "sync": dict(reps), "rl-step": rl_options}
        payload = run(model, out_dir=args.out_dir, device=args.device, options=options)
        return 1 if payload["failed"] else 0
    return 0
