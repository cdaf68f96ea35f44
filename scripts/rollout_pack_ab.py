#!/usr/bin/env python
"""`python scripts/rollout_pack_ab.py [reps]`. Same-run A/B: jetflow engine with and without prepacked linears, and HF generate(); SmolLM2 fp32,
batch 16, 64 prompt + 128 new tokens, temperature 1, EOS ignored; interleaved reps, medians."""
import json, os, statistics, sys, torch
from jetflow.bench.rollout import _hf_runner, _jetflow_runner, _time
path, reps = ".cache/models/smollm2", int(sys.argv[1]) if len(sys.argv) > 1 else 3
dev = torch.device("cpu")
g = torch.Generator().manual_seed(16)
prompts = torch.randint(100, 49152, (16, 64), generator=g).tolist()
def jf(pack):
    return _jetflow_runner(path, "fp32", 16, 64, 128, dev, pack_linears=pack)[0]
runners = {"jetflow fp32 (prepacked linears)": jf(True), "jetflow fp32 (plain F.linear)": jf(False),
           "hf transformers fp32": _hf_runner(path, 128, dev)[0]}
for fn in runners.values():
    fn(prompts, 0, 4)
res = {k: [] for k in runners}
load0 = os.getloadavg()[0]
for rep in range(reps):
    for name, fn in runners.items():
        dt, stats, _ = _time(fn, prompts, rep + 1, dev)
        res[name].append({"s": dt, "decode_ms": 1e3 * stats["decode_s"] / stats["decode_steps"] if stats else None})
        print(f"rep {rep} {name:34s} {16 * 128 / dt:6.1f} tok/s" + (f"  decode {res[name][-1]['decode_ms']:.1f} ms/step" if stats else ""), flush=True)
hf = statistics.median(r["s"] for r in res["hf transformers fp32"])
summary = {}
for name, rs in res.items():
    med = statistics.median(r["s"] for r in rs)
    summary[name] = {"tokens_per_s": 16 * 128 / med, "vs_hf": hf / med, "tokens_per_s_all": [round(2048 / r["s"], 1) for r in rs],
                     "decode_ms_per_step": statistics.median(r["decode_ms"] for r in rs) if rs[0]["decode_ms"] else None}
    print(f"{name:34s} {summary[name]['tokens_per_s']:6.1f} tok/s  {summary[name]['vs_hf']:.2f}x HF")
print(json.dumps({"loadavg_before": load0, "loadavg_after": os.getloadavg()[0], "summary": summary}))
