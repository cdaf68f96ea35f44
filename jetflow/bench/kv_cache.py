"""`jetflow bench rollout --lengths fixed|longtail|eos`: the native engine's paged KV cache on long
responses: KV bytes per token in each storage, peak KV memory, how many sequences fit a budget, and
throughput with continuous batching against static batches.

Work: `requests` random prompts of `prompt_len` tokens (default 3 x batch, so that waiting requests
exist), at most `batch` decoding at once, sampling at temperature 1. Response lengths:
- fixed: every request generates exactly `new_tokens` (EOS ignored);
- longtail: request i generates n_i = max(1, round(new_tokens * u_i^4)) tokens, u_i ~ U(0, 1) seeded
  (median new_tokens / 16, mean new_tokens / 5, a few near new_tokens: a long-tail RL batch), EOS ignored;
- eos: the model's own EOS ends a request, at most `new_tokens`.
Engines: `continuous` (a waiting request starts as soon as a row and its pages are free) and `static`
(admits only into an empty batch: the old engine's chunks), interleaved, `reps` runs each, medians.
Storage: fp32 pages, and with `kv_fp8` E4M3 pages (an FP8 K/V quantizer attached and calibrated on the
prompts, as a run does before its first rollout).

The fit table is the engine's own arithmetic (jetflow.model.paged_cache.PagePool): pages of 64
positions over every layer, a budget's pages less the null page, ceil((prompt + new) / 64) pages a
sequence.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from jetflow.bench.common import markdown_table, write_results
from jetflow.model.paged_cache import PagePool
from jetflow.rollout.scheduler import pages_for

LENGTHS = ("fixed", "longtail", "eos")


def response_lengths(kind: str, n: int, new_tokens: int, seed: int = 0) -> list[int] | None:
    """Per-request caps for `kind` (None: EOS decides, up to new_tokens)."""
    if kind == "fixed":
        return [new_tokens] * n
    if kind == "longtail":
        u = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        return (new_tokens * u**4).round().clamp(1, new_tokens).long().tolist()
    if kind == "eos":
        return None
    raise ValueError(f"lengths={kind!r}: one of {LENGTHS}")


def fit_table(model_config, budget_bytes: int, prompt_len: int, new_tokens: int) -> list[dict]:
    """Per page storage: KV bytes per token and per page, the budget's pages, and how many
    prompt_len + new_tokens sequences fit it at once."""
    c, rows = model_config, []
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp8 e4m3", torch.float8_e4m3fn)):
        page = PagePool.page_bytes(c.num_layers, c.num_kv_heads, c.head_dim, dtype)
        pages = budget_bytes // page - 1  # less the null page
        per_seq = pages_for(prompt_len + new_tokens)
        rows.append({"storage": name, "kv_bytes_per_token": page // 64, "page_bytes": page,
                     "pages_in_budget": pages, "pages_per_sequence": per_seq,
                     "sequences_that_fit": pages // per_seq})
    return rows


def _model(model_path: str, precision: str, numerics: str, kv_fp8: bool, calib_prompts: list[list[int]]):
    from jetflow.model import load
    from jetflow.precision import QuantRecipe, apply_precision
    from jetflow.precision.kv import BF16KVRounding, KVQuantizer, attach_kv_quantizer

    model = load(model_path, device="cpu").eval()
    if precision != "fp32" or numerics == "exact":
        apply_precision(model, precision, QuantRecipe() if precision == "fp8" else None, numerics=numerics)
        model.set_numerics(numerics, model.embed_grid)
    if precision == "bf16":  # the bf16 mode's K/V rounding: bf16 pages (jetflow.run.build.kv_rounding)
        attach_kv_quantizer(model, BF16KVRounding())
    if kv_fp8:  # calibrate the K/V scales on the prompts (a run calibrates on the trainer's forward)
        q = KVQuantizer(model.config.num_layers)
        attach_kv_quantizer(model, q)
        q.calibrating = True
        with torch.inference_mode():
            model(torch.tensor(calib_prompts[:4]))
        q.calibrating = False
        q.recalibrate()
    return model


def run(model_path: str, batch: int = 32, prompt_len: int = 64, new_tokens: int = 512, lengths: str = "longtail",
        requests: int | None = None, kv_budget_gib: float | None = None, kv_fp8: bool = True, reps: int = 1,
        precision: str = "fp32", numerics: str = "exact", out_dir: str = "results/kv-cache-long",
        name: str | None = None) -> dict:
    from jetflow.model import load_tokenizer
    from jetflow.rollout import RolloutEngine, SamplingParams

    requests = requests or 3 * batch
    tok = load_tokenizer(model_path)
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(100, tok.vocab_size, (requests, prompt_len), generator=g).tolist()
    caps = response_lengths(lengths, requests, new_tokens)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=lengths != "eos")
    budget = None if kv_budget_gib is None else int(kv_budget_gib * 2**30)
    load_before = os.getloadavg()[0]
    runners = {}
    for storage in (("fp32", "fp8") if kv_fp8 else ("fp32",)):
        model = _model(model_path, precision, numerics, storage == "fp8", prompts)
        for mode in ("continuous", "static"):
            eng = RolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, max_batch=batch,
                                max_seq_len=prompt_len + new_tokens, kv_cache_bytes=budget,
                                continuous=mode == "continuous")
            runners[f"{storage} pages, {mode}"] = eng
    for eng in runners.values():  # warm-up
        eng.generate(prompts[:2], SamplingParams(max_new_tokens=2, temperature=1.0, ignore_eos=True), seeds=[0, 1])
    samples = {k: [] for k in runners}
    for rep in range(reps):
        for key, eng in runners.items():
            t = time.perf_counter()
            out = eng.generate(prompts, params, seeds=list(range(requests)), max_new_tokens=caps)
            dt = time.perf_counter() - t
            samples[key].append((dt, out, eng.memory_stats()))
            print(f"  rep {rep}: {key:26s} {out.stats['new_tokens'] / dt:7.1f} new tok/s ({dt:.1f} s)", flush=True)
    rows = []
    for key, runs in samples.items():
        dt = statistics.median(r[0] for r in runs)
        out, mem = runs[-1][1], runs[-1][2]
        n = out.stats["new_tokens"]
        rows.append({"engine": key, "seconds": round(dt, 2), "new_tokens": n, "tokens_per_s": round(n / dt, 1),
                     "decode_steps": out.stats["decode_steps"], "prefill_calls": out.stats["prefills"],
                     "preemptions": out.stats["preemptions"], "kv_page_dtype": mem["kv_page_dtype"],
                     "kv_bytes_per_token": mem["kv_bytes_per_token"],
                     "peak_kv_mib": round(mem["kv_cache_bytes"] / 2**20, 1),
                     "kv_pool_mib": round(mem["kv_pool_bytes"] / 2**20, 1), "pool_pages": mem["kv_pool_pages"],
                     "largest_batch_in_pool": mem["kv_pool_pages"] // pages_for(prompt_len + new_tokens),
                     "max_rss_delta_mib": round(mem["max_rss_delta_bytes"] / 2**20, 1)})
    for r in rows:  # continuous over static, same storage
        static = next(x for x in rows if x["engine"] == r["engine"].replace("continuous", "static"))
        r["vs_static"] = round(r["tokens_per_s"] / static["tokens_per_s"], 2)
    model_config = next(iter(runners.values())).model.config
    fits = fit_table(model_config, 2 * 2**30, prompt_len, 4096)
    work = {"model": model_path, "batch": batch, "requests": requests, "prompt_len": prompt_len,
            "new_tokens_max": new_tokens, "lengths": lengths, "caps": caps, "precision": precision, "numerics": numerics,
            "kv_budget_bytes": next(iter(runners.values())).kv_pool_bytes, "reps": reps,
            "threads": torch.get_num_threads(), "loadavg_1m_before_after": [round(load_before, 2),
                                                                             round(os.getloadavg()[0], 2)]}
    payload = {"workload": work, "rows": rows, "fit_2gib_64_plus_4096": fits}
    md = (f"Native engine, SmolLM2-class model `{model_path}`, {precision} {numerics}: {requests} requests of "
          f"{prompt_len} prompt tokens, at most {batch} at once, response lengths `{lengths}` (max {new_tokens}; "
          f"{sum(caps) if caps else 'EOS-driven'} new tokens in all), temperature 1; median of {reps} interleaved "
          f"run(s); load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.\n\n"
          + markdown_table(rows, list(rows[0].keys()))
          + "\n\nHow many 64 + 4096-token sequences fit a 2 GiB KV budget (the engine's page arithmetic):\n\n"
          + markdown_table(fits, list(fits[0].keys())) + "\n")
    path = write_results(name or f"kv-{lengths}-b{batch}-n{new_tokens}", payload, md, out_dir)
    print(md)
    print(f"wrote {path}")
    return payload
