"""Peak memory of one exact-attention backward (jetflow.kernels.invariant.attention), blocked over query
rows (now) against the whole-layer `reference_attention` backward it replaced (before), at SmolLM2-135M's
attention shape (H=9, H_kv=3, D=64), causal, each measured in a fresh process (ru_maxrss is a process peak):

    PYTHONPATH=. python scripts/analysis/train_step_long_attention_backward_memory.py [T]

Prints, per variant, the process peak RSS growth during backward alone (MiB) and its time (s)."""

import json
import resource
import subprocess
import sys
import time


def child(variant: str, T: int) -> None:
    import torch

    from jetflow.kernels import invariant as inv

    torch.manual_seed(0)
    B, H, Hkv, D = 1, 9, 3, 64
    q = torch.randn(B, H, T, D, requires_grad=True)
    kt = torch.randn(B, Hkv, D, T, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, requires_grad=True)
    pos = torch.arange(T).expand(B, T)
    if variant == "before":  # the backward as it was: one reference_attention over all T query rows
        def backward(ctx, grad):
            q, kt, v, pos = ctx.saved_tensors
            with torch.enable_grad():
                q_, kt_, v_ = (t.detach().requires_grad_() for t in (q, kt, v))
                out = inv.reference_attention(q_, kt_.transpose(-1, -2), v_, pos, ctx.scale)
                return (*torch.autograd.grad(out, [q_, kt_, v_], grad), None, None, None)
        inv._Attention.backward = staticmethod(backward)  # type: ignore[method-assign]
    out = inv.attention(q, kt, v, pos, D ** -0.5)  # (B, H, T, D)
    g = torch.randn_like(out)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    out.backward(g)
    dt = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"variant": variant, "T": T, "backward_peak_growth_MiB": round((peak - base) / 1024, 1),
                      "process_peak_MiB": round(peak / 1024, 1), "backward_s": round(dt, 2),
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
    else:
        T = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
        for variant in ("before", "after"):
            subprocess.run([sys.executable, __file__, "--child", variant, str(T)], check=True)
