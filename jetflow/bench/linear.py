"""`jetflow bench linear`: forward + backward of one linear layer, FP8 (this device's path) vs fp32 / bf16.

The FP8 timing includes quantizing the weight (as after every optimizer step), the input and the
gradients, so it is the full per-step cost of the layer. On the CPU the FP8 GEMMs are emulated.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from jetflow.bench.common import markdown_table, time_fn, write_results
from jetflow.precision import QuantRecipe, PrecisionLinear


def _step(layer: PrecisionLinear, x: torch.Tensor, fresh_weight: bool):
    def run():
        if fresh_weight:
            with torch.no_grad():  # an in-place update bumps the version: the cache requantizes
                layer.weight.mul_(1.0)
        layer.weight.grad = None
        xi = x.detach().requires_grad_()
        layer(xi).sum().backward()
    return run


def run(m: int = 1024, n: int = 4096, k: int = 4096, device: str | None = None, iters: int = 5,
        out_dir: str = "results/bench") -> dict:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    base = nn.Linear(k, n, bias=False, device=dev)
    x = torch.randn(m, k, device=dev)
    rows = []
    kinds = [("fp32", "fp32", False), ("bf16", "bf16", False), ("fp8 (weight cached)", "fp8", False),
             ("fp8 (weight requantized)", "fp8", True)]
    for label, kind, fresh in kinds:
        layer = PrecisionLinear.from_linear(base, kind=kind, recipe=QuantRecipe(), name="bench")
        t = time_fn(_step(layer, x, fresh), dev, warmup=1, iters=iters)
        rows.append({"layer": label, "fwd_bwd_ms": t * 1e3})
        print(f"  {label:26s} {t * 1e3:9.1f} ms", flush=True)
    fp32 = rows[0]["fwd_bwd_ms"]
    for r in rows:
        r["ratio_vs_fp32"] = r["fwd_bwd_ms"] / fp32
    tag = "gpu" if dev.type == "cuda" else "cpu"
    payload = {"shape": {"M": m, "N": n, "K": k}, "rows": rows}
    md = (f"Forward + backward of a {k}->{n} linear on {m} tokens (median of {iters}).\n\n"
          + markdown_table(rows, ["layer", "fwd_bwd_ms", "ratio_vs_fp32"]))
    path = write_results(f"linear-{tag}", payload, md, out_dir)
    print(f"wrote {path}")
    return payload
