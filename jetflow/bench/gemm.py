"""`jetflow bench gemm`: bf16 vs FP8 block-scaled GEMM over (M, N, K) shapes.

For each shape Y (M, N) = X (M, K) @ W^T (W: N, K):
  bf16          F.linear in bf16 (on the CPU: the bf16 F.linear kernel, FACTS.md's fast bf16 path)
  fp8_gemm      the FP8 GEMM alone on pre-quantized operands
  fp8_quant     quantize X (1x128) + the FP8 GEMM, weight pre-quantized (it is quantized once per step)
On a Hopper GPU the FP8 path is torch._scaled_mm with block scales; elsewhere the emulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jetflow.bench.common import environment, markdown_table, time_fn, write_results
from jetflow.precision.gemm import fp8_matmul, resolve_backend
from jetflow.precision.quant import quantize_blocks

GPU_SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (64, 4096, 4096), (64, 8192, 8192),
              (1024, 4096, 4096), (2048, 8192, 8192), (4096, 4096, 4096), (8192, 8192, 8192)]
CPU_SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (64, 4096, 4096), (1024, 1024, 1024), (1024, 4096, 4096)]


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'1x4096x4096,8192x8192x8192' -> [(1, 4096, 4096), (8192, 8192, 8192)]."""
    shapes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"bad shape {item!r}: expected MxNxK, e.g. 1024x4096x4096")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def bench_shape(m: int, n: int, k: int, device: torch.device, backend: str, iters: int) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device)
    w = torch.randn(n, k, generator=gen).to(device)
    xb, wb = x.bfloat16(), w.bfloat16()
    wq = quantize_blocks(w, (128, 128))
    xq = quantize_blocks(x, (1, 128))
    if backend == "emulate":
        wq.with_dequantized_cache()
        xq.with_dequantized_cache()  # "GEMM alone": operands already in the form the GEMM reads
    min_s = 0.5 if device.type == "cuda" else 0.0
    t_bf16 = time_fn(lambda: F.linear(xb, wb), device, iters=iters, min_seconds=min_s)
    t_gemm = time_fn(lambda: fp8_matmul(xq, wq, torch.bfloat16, backend), device, iters=iters, min_seconds=min_s)
    t_quant = time_fn(lambda: fp8_matmul(quantize_blocks(x, (1, 128), check_finite=False), wq, torch.bfloat16,
                                         backend), device, iters=iters, min_seconds=min_s)
    flops = 2.0 * m * n * k
    return {
        "M": m, "N": n, "K": k,
        "bf16_ms": t_bf16 * 1e3, "fp8_gemm_ms": t_gemm * 1e3, "fp8_quant_gemm_ms": t_quant * 1e3,
        "bf16_tflops": flops / t_bf16 / 1e12, "fp8_gemm_tflops": flops / t_gemm / 1e12,
        "fp8_quant_gemm_tflops": flops / t_quant / 1e12,
        "speedup_gemm": t_bf16 / t_gemm, "speedup_quant_gemm": t_bf16 / t_quant,
    }


def run(shapes: str | None = None, device: str | None = None, iters: int = 5, out_dir: str = "results/bench",
        backend: str = "auto") -> dict:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = resolve_backend(backend, dev)
    shape_list = parse_shapes(shapes) if shapes else (GPU_SHAPES if dev.type == "cuda" else CPU_SHAPES)
    rows = []
    for m, n, k in shape_list:
        row = bench_shape(m, n, k, dev, backend, iters)
        rows.append(row)
        print(f"  M={m:>5} N={n:>5} K={k:>5}  bf16 {row['bf16_ms']:9.3f} ms  fp8 gemm {row['fp8_gemm_ms']:9.3f} ms "
              f"({row['speedup_gemm']:.2f}x)  quant+gemm {row['fp8_quant_gemm_ms']:9.3f} ms "
              f"({row['speedup_quant_gemm']:.2f}x)", flush=True)
    tag = "gpu" if dev.type == "cuda" else "cpu"
    cols = ["M", "N", "K", "bf16_ms", "fp8_gemm_ms", "fp8_quant_gemm_ms", "bf16_tflops", "fp8_gemm_tflops",
            "speedup_gemm", "speedup_quant_gemm"]
    note = (f"FP8 backend: `{backend}`." + (" On the CPU the FP8 path is an emulation (dequantize + fp32 "
            "matmul): it checks the math, not FP8 speed." if backend == "emulate" else ""))
    payload = {"backend": backend, "rows": rows}
    path = write_results(f"gemm-{tag}", payload, note + "\n\n" + markdown_table(rows, cols), out_dir)
    print(f"wrote {path} ({environment()['device']})")
    return payload
