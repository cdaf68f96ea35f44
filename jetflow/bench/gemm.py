"""`jetflow bench gemm`: bf16 vs FP8 block-scaled GEMMs over (M, N, K) shapes, in TFLOP/s.

For each shape Y (M, N) = X (M, K) @ W^T (W: N, K), every path the device has, in one run:
  bf16           F.linear in bf16 (cuBLAS on CUDA; on the CPU the bf16 F.linear kernel, FACTS.md)
  scaled_mm      torch's block-scaled FP8 GEMM (cuBLASLt, Hopper + CUDA >= 12.9), pre-quantized operands
  triton         jetflow's batch-invariant Triton FP8 GEMM (CUDA), pre-quantized operands
  triton_quant   Triton 1x128 activation quantization + the Triton FP8 GEMM (the weight is quantized
                 once per step, so it is pre-quantized here too)
  triton_bf16    jetflow's batch-invariant Triton bf16 GEMM (the exact mode's bf16 layers)
  emulate        the CPU's fast-numerics FP8 path: dequantize + fp32 matmul (checks the math, not FP8 speed)
  emulate_quant  1x128 activation quantization + the emulated GEMM
  exact_fp32     the CPU's exact-numerics GEMM (jetflow.kernels.invariant: the canonical reduction) on
  exact_bf16     fp32 / bf16 / E4M3 weight panels packed once (`pack_weight`), fp32 out; exact_fp8 on
  exact_fp8      pre-quantized 1x128 activations; the rows' exact_*_vs_fp32 = exact_fp32 time over theirs
FP8 paths write bf16. `--backend X` measures bf16 and X only; `auto` measures every path available.
A path that fails on this machine is recorded with its error instead of a time. Each row also carries
speedup_gemm and speedup_quant_gemm (bf16 time over the FP8 time) for the payload's `backend`
(triton on CUDA, emulate on the CPU), the bench suite's headline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from jetflow.bench.common import environment, markdown_table, time_fn, write_results
from jetflow.kernels import invariant
from jetflow.precision.gemm import fp8_matmul, resolve_backend
from jetflow.precision.quant import QuantizedTensor, quantize_blocks

LLAMA3_8B_LINEARS = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]
"""(N, K) of Llama-3-8B's linears: q and o, k and v, gate and up, down."""
GPU_SHAPES = [(8192, 8192, 8192)] + [(m, n, k) for m in (16, 8192) for n, k in LLAMA3_8B_LINEARS]
CPU_SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (64, 4096, 4096), (1024, 1024, 1024), (1024, 4096, 4096)]
GPU_PATHS = ("bf16", "scaled_mm", "triton", "triton_quant", "triton_bf16")
CPU_PATHS = ("bf16", "emulate", "emulate_quant", "exact_fp32", "exact_bf16", "exact_fp8")


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'1x4096x4096,8192x8192x8192' -> [(1, 4096, 4096), (8192, 8192, 8192)]."""
    shapes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"bad shape {item!r}: expected MxNxK, e.g. 1024x4096x4096")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def paths_for(device: torch.device, backend: str) -> tuple[str, ...]:
    """The paths one run measures: every one the device has (`auto`), or bf16 and `backend`."""
    if backend == "auto":
        return GPU_PATHS if device.type == "cuda" else CPU_PATHS
    fp8 = resolve_backend(backend, device)
    return ("bf16", fp8) + ((f"{fp8}_quant",) if fp8 in ("triton", "emulate") else ())


def _calls(m: int, n: int, k: int, device: torch.device) -> dict[str, Callable[[], object]]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device)
    w = torch.randn(n, k, generator=gen).to(device)
    xb, wb = x.bfloat16(), w.bfloat16()
    wq = quantize_blocks(w, (128, 128))
    xq = quantize_blocks(x, (1, 128))
    calls = {"bf16": lambda: F.linear(xb, wb)}
    if device.type == "cpu":
        wq_emu = QuantizedTensor(wq.data, wq.scale_inv, wq.block).with_dequantized_cache()
        xq_emu = QuantizedTensor(xq.data, xq.scale_inv, xq.block).with_dequantized_cache()  # "GEMM alone"
        calls["emulate"] = lambda: fp8_matmul(xq_emu, wq_emu, torch.bfloat16, "emulate")
        calls["emulate_quant"] = lambda: fp8_matmul(quantize_blocks(x, (1, 128), check_finite=False), wq_emu,
                                                    torch.bfloat16, "emulate")
        p32, pbf, p8 = invariant.pack_weight(w), invariant.pack_weight(wb), invariant.pack_weight(wq.data)
        xb32 = xb.float()
        calls["exact_fp32"] = lambda: invariant.gemm(x, p32, n)
        calls["exact_bf16"] = lambda: invariant.gemm(xb32, pbf, n)
        calls["exact_fp8"] = lambda: invariant.fp8_gemm(xq.data, xq.scale_inv, p8, wq.scale_inv, n)
        return calls
    from jetflow.kernels import triton as tk

    def triton_quant():
        data, scale = tk.quantize_1x128(x)
        return tk.fp8_gemm(data, scale, wq.data, wq.scale_inv, 128, torch.bfloat16)

    calls.update({
        "scaled_mm": lambda: fp8_matmul(xq, wq, torch.bfloat16, "scaled_mm"),
        "triton": lambda: fp8_matmul(xq, wq, torch.bfloat16, "triton"),
        "triton_quant": triton_quant,
        "triton_bf16": lambda: tk.dense_gemm(xb, wb, "bf16", torch.bfloat16),
    })
    return calls


def bench_shape(m: int, n: int, k: int, device: torch.device, paths: tuple[str, ...], iters: int) -> dict:
    calls = _calls(m, n, k, device)
    min_s = 0.5 if device.type == "cuda" else 0.0
    row: dict = {"M": m, "N": n, "K": k}
    flops = 2.0 * m * n * k
    for path in paths:
        try:
            seconds = time_fn(calls[path], device, iters=iters, min_seconds=min_s)
        except Exception as e:  # a path this machine lacks (no block-scaled cuBLASLt, no Triton): say why
            row[f"{path}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            continue
        row[f"{path}_ms"] = seconds * 1e3
        row[f"{path}_tflops"] = flops / seconds / 1e12
    return row


def headline_backend(paths: tuple[str, ...]) -> str | None:
    """The FP8 path whose speedups each row carries: triton on CUDA, emulate on the CPU."""
    return next((p for p in ("triton", "emulate", "scaled_mm") if p in paths), None)


def add_speedups(row: dict, backend: str | None) -> None:
    for key, path in (("speedup_gemm", backend), ("speedup_quant_gemm", f"{backend}_quant")):
        if backend and f"{path}_ms" in row and "bf16_ms" in row:
            row[key] = row["bf16_ms"] / row[f"{path}_ms"]
    for kind in ("bf16", "fp8"):
        if f"exact_{kind}_ms" in row and "exact_fp32_ms" in row:
            row[f"exact_{kind}_vs_fp32"] = row["exact_fp32_ms"] / row[f"exact_{kind}_ms"]


def run(shapes: str | None = None, device: str | None = None, iters: int = 5, out_dir: str = "results/bench",
        backend: str = "auto") -> dict:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    paths = paths_for(dev, backend)
    shape_list = parse_shapes(shapes) if shapes else (GPU_SHAPES if dev.type == "cuda" else CPU_SHAPES)
    rows = []
    backend = headline_backend(paths)
    for m, n, k in shape_list:
        row = bench_shape(m, n, k, dev, paths, iters)
        add_speedups(row, backend)
        rows.append(row)
        cells = [f"{p} {row[f'{p}_tflops']:8.1f}" if f"{p}_tflops" in row else f"{p} failed" for p in paths]
        print(f"  M={m:>5} N={n:>5} K={k:>5}  TFLOP/s: " + "  ".join(cells), flush=True)
    tag = "gpu" if dev.type == "cuda" else "cpu"
    cols = ["M", "N", "K"] + [f"{p}_tflops" for p in paths] + [f"{p}_ms" for p in paths] + ["speedup_quant_gemm"] \
        + (["exact_bf16_vs_fp32", "exact_fp8_vs_fp32"] if "exact_fp32" in paths else [])
    errors = sorted({f"{p}: {r[f'{p}_error']}" for r in rows for p in paths if f"{p}_error" in r})
    note = (f"Paths: {', '.join(paths)} (FP8 paths write bf16; see jetflow/bench/gemm.py)."
            + (" On the CPU the fast-numerics FP8 path is an emulation (dequantize + fp32 matmul): it checks the "
               "math, not FP8 speed; the exact_* paths are the kernels exact numerics runs (CPU ISA: "
               f"{invariant.isa()})." if dev.type == "cpu" else "")
            + ("\n\nFailed paths: " + "; ".join(errors) if errors else ""))
    payload = {"backend": backend, "paths": list(paths), "rows": rows}
    path = write_results(f"gemm-{tag}", payload, note + "\n\n" + markdown_table(rows, cols), out_dir)
    print(f"wrote {path} ({environment()['device']})")
    return payload
