"""Timing and the record of where a benchmark ran."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch


def environment() -> dict:
    """The machine, torch and CUDA versions: every result file carries them."""
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": "cpu",
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return env


def command_line() -> str:
    """The command as a user would type it: `jetflow ...` whether run as the entry point or `python -m
    jetflow.cli`, with arguments that need it shell-quoted."""
    import shlex
    entry = bool(sys.argv) and (sys.argv[0].endswith("jetflow") or sys.argv[0].endswith("jetflow/cli.py"))
    args = sys.argv[1:] if entry else sys.argv
    return " ".join(["jetflow" if entry else "", *map(shlex.quote, args)]).strip()


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int = 2, iters: int = 5,
            min_seconds: float = 0.0) -> float:
    """Median seconds per call (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    start_all = time.perf_counter()
    while len(samples) < iters or time.perf_counter() - start_all < min_seconds:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        if len(samples) >= 1000:
            break
    return statistics.median(samples)


def write_results(name: str, payload: dict, markdown: str, out_dir: str | Path = "results/bench") -> Path:
    """Write <out_dir>/<name>.json and .md; returns the JSON path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"command": command_line(), "environment": environment(), **payload}
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    env = payload["environment"]
    header = (f"# {name}\n\nCommand: `{payload['command']}`  \nMachine: {env['device']} "
              f"({env['cpu_count']} CPU cores), torch {env['torch']}, CUDA {env['cuda']}\n\n")
    (out / f"{name}.md").write_text(header + markdown + "\n")
    return json_path


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def saved_activation_bytes(model: torch.nn.Module, forward: Callable[[], object]) -> int:
    """The bytes autograd saves for the backward while `forward()` runs: each saved storage counted once, the
    model's parameters excluded (what the memory estimate's activation term predicts)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(saved.values())
