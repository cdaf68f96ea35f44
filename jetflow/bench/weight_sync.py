"""`jetflow bench sync`: bytes and seconds of one trainer -> rollout weight sync per precision mode.

For each mode the trainer side and the rollout side are built as in a run (jetflow.run.build),
each over its own copy of the same weights. One sync = `jetflow.sync.build_update` on the trainer
model after a simulated optimizer step (an in-place touch of every parameter bumps its version, so
FP8 weights are requantized exactly as after a real step) + `apply_update` into the rollout model +
the rollout side's own FP8 quantization where it makes one (`mixed` quantizes the bf16 weights it
received; `unified` runs the shipped bytes as they are). What is timed is what `RLLoop.sync` does,
in one process; bytes are `WeightUpdate.nbytes()`, what would cross a wire between machines, broken
down into FP8 data, FP8 scales and the other tensors (by dtype).

Under `unified` the build includes quantizing the trainer's weights; in a run that work is not extra:
the trainer's next forward reuses those bytes. In one process the rollout side receives the trainer's
own QuantizedTensor objects (on the CPU with their fp32 dequantized copy for the emulated GEMM), so
`apply` is cheap there; across machines a sync adds the transfer of `total_bytes` (and, for the CPU
emulation only, one dequantization on the receiving side).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import defaultdict

import torch

from jetflow.bench.common import markdown_table, write_results
from jetflow.bench.workload import LoadAverage, bench_config
from jetflow.config import derive
from jetflow.run.build import apply_mode, build_policy, copy_model
from jetflow.precision import quantized_weights
from jetflow.sync import WeightUpdate, apply_update, build_update

MODES = ("fp32", "bf16", "mixed", "unified")


def payload_breakdown(update: WeightUpdate) -> dict:
    """Bytes of an update by category; fp8_data + scales + other == total."""
    fp8 = sum(q.data.numel() * q.data.element_size() for q in update.quantized.values())
    scales = sum(q.nbytes() for q in update.quantized.values()) - fp8  # block scales (+ NVFP4's tensor scales)
    by_dtype: dict[str, int] = defaultdict(int)
    for t in update.tensors.values():
        by_dtype[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
    return {"total_bytes": update.nbytes(), "fp8_data_bytes": fp8, "scale_bytes": scales,
            "other_bytes": sum(by_dtype.values()), "other_bytes_by_dtype": dict(by_dtype),
            "num_fp8_tensors": len(update.quantized), "num_other_tensors": len(update.tensors)}


def simulate_optimizer_step(model: torch.nn.Module) -> None:
    """Bump every parameter's version without changing its value (cached FP8 bytes go stale)."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0)


def measure_mode(cfg, base, reps: int) -> dict:
    """Median seconds of build / apply / rollout-side quantization over `reps` syncs after one warm-up."""
    mode, derived = cfg.precision.mode, derive(cfg)
    trainer_model = apply_mode(copy_model(base), derived.precision, "trainer")
    rollout_model = apply_mode(copy_model(base), derived.precision, "rollout")
    fingerprint = derived.precision.fingerprint
    times: dict[str, list[float]] = {"build_s": [], "apply_s": [], "rollout_quantize_s": [], "total_s": []}
    rollout_version = -1
    for version in range(reps + 1):
        simulate_optimizer_step(trainer_model)
        t0 = time.perf_counter()
        update = build_update(trainer_model, mode, version, fingerprint)
        t1 = time.perf_counter()
        rollout_version = apply_update(rollout_model, update, rollout_version, fingerprint)
        t2 = time.perf_counter()
        quantized_weights(rollout_model)  # mixed: quantize here; unified: the loaded bytes, no work
        t3 = time.perf_counter()
        if version == 0:
            continue  # warm-up
        for key, dt in (("build_s", t1 - t0), ("apply_s", t2 - t1), ("rollout_quantize_s", t3 - t2),
                        ("total_s", t3 - t0)):
            times[key].append(dt)
    row = {"mode": mode, **payload_breakdown(update)}
    row.update({key: statistics.median(v) for key, v in times.items()})
    row["total_ms_all"] = [round(t * 1e3, 1) for t in times["total_s"]]
    row["total_mib"] = row["total_bytes"] / 2**20
    return row


def run(model: str = "smollm2", modes: tuple[str, ...] = MODES, reps: int = 3, device: str | None = None,
        out_dir: str = "results/bench", name: str | None = None) -> dict:
    """Benchmark and write <out_dir>/sync-<cpu|gpu>.{json,md} (or `name`); returns the payload."""
    cfg = bench_config(model, [f"model.device={device}"] if device else [])
    base, _ = build_policy(cfg)
    rows = []
    with LoadAverage() as load:
        for mode in modes:
            mode_cfg = copy.deepcopy(cfg)
            mode_cfg.precision.mode = mode
            row = measure_mode(mode_cfg, base, reps)
            rows.append(row)
            print(f"  {mode:8s} {row['total_mib']:8.1f} MiB (fp8 {row['fp8_data_bytes'] / 2**20:.1f}, scales "
                  f"{row['scale_bytes'] / 2**20:.2f}, other {row['other_bytes'] / 2**20:.1f})  build "
                  f"{row['build_s'] * 1e3:.0f} ms  apply {row['apply_s'] * 1e3:.0f} ms  rollout quantize "
                  f"{row['rollout_quantize_s'] * 1e3:.0f} ms", flush=True)
    by_mode = {r["mode"]: r for r in rows}
    ratios = {}
    for num, den in (("unified", "bf16"), ("unified", "mixed"), ("unified", "fp32"), ("bf16", "fp32")):
        if num in by_mode and den in by_mode:
            ratios[f"bytes_{num}_over_{den}"] = by_mode[num]["total_bytes"] / by_mode[den]["total_bytes"]
            ratios[f"seconds_{num}_over_{den}"] = by_mode[num]["total_s"] / by_mode[den]["total_s"]
    print("  " + ", ".join(f"{k} = {v:.3f}" for k, v in ratios.items()))

    dev = torch.device(cfg.model.device)
    headline = {"name": "unified (FP8) / bf16 sync payload bytes", "value": ratios.get("bytes_unified_over_bf16")}
    payload = {"workload": {"model": model, "num_params": base.num_params(), "reps": reps,
                            "recipe": cfg.precision.recipe().fingerprint(),
                            "keep_high_precision": list(cfg.precision.keep_high_precision)},
               "rows": rows, "ratios": ratios, "headline": headline, "loadavg_1m": load.record()}
    table_rows = [{**r, "fp8_mib": r["fp8_data_bytes"] / 2**20, "scale_mib": r["scale_bytes"] / 2**20,
                   "other_mib": r["other_bytes"] / 2**20,
                   "other_dtypes": " ".join(f"{k}:{v / 2**20:.3g}" for k, v in r["other_bytes_by_dtype"].items()),
                   "build_ms": r["build_s"] * 1e3, "apply_ms": r["apply_s"] * 1e3,
                   "rollout_quantize_ms": r["rollout_quantize_s"] * 1e3, "total_ms": r["total_s"] * 1e3}
                  for r in rows]
    md = (f"One trainer -> rollout weight sync of model `{model}` ({base.num_params() / 1e6:.1f}M parameters) in "
          f"one process: `build_update` after a simulated optimizer step, `apply_update` into the rollout model, "
          f"and the rollout side's own FP8 quantization where it makes one (`mixed`). Median of {reps} syncs after "
          f"a warm-up. Bytes are `WeightUpdate.nbytes()` (MiB = 2^20 bytes), what would cross a wire; in one "
          f"process tensors are handed over by reference, so no transfer time is included. {load.sentence()}\n\n"
          + markdown_table(table_rows, ["mode", "total_mib", "fp8_mib", "scale_mib", "other_mib", "other_dtypes",
                                        "build_ms", "apply_ms", "rollout_quantize_ms", "total_ms"])
          + "\n\n" + "\n".join(f"- {k}: {v:.3f}" for k, v in ratios.items()))
    path = write_results(name or f"sync-{'gpu' if dev.type == 'cuda' else 'cpu'}", payload, md, out_dir)
    print(f"wrote {path}")
    return payload
