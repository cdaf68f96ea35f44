"""Why continuous batching gains 1.24x here and not 1.5x: the exact decode step's CPU cost against its rows,
and the two schedules of section 1b replayed on that cost curve (results/long-rollout/README.md, section 1c).

    OMP_NUM_THREADS=1 python scripts/analysis/long_rollout_step_cost.py MODEL

1. c(r): CPU seconds of one decode step of r rows (native exact fp32 engine, SmolLM2, one thread), as the
   difference of two generates of r requests (64-token prompts, EOS ignored) running 16 and 48 new tokens:
   the prefill cancels, 32 decode steps remain, at contexts of 80-112 tokens (attention small).
2. The schedules: section 1b's 48 long-tail requests (jetflow.bench.kv_cache.response_lengths("longtail",
   48, 2048)) at batch 32, static (admit only into an empty batch) and continuous (a finished row's slot goes
   to the next request at once), replayed to the rows of every decode step; their step counts must equal
   the engines' own (3262 and 1812).
3. sum_t c(r_t) for each schedule (linear interpolation between measured r): the decode steps' cost without
   what both schedules share (the same tokens at the same positions: attention over the same contexts, the
   same prefills' tokens). The ratio of the two sums is the most continuous batching can gain on this work
   with this step-cost curve; the measured engines' CPU seconds are set beside it.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from jetflow.bench.kv_cache import _model, response_lengths
from jetflow.model import load_tokenizer
from jetflow.rollout import RolloutEngine, SamplingParams

ROWS = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32)
SHORT, LONG = 16, 48


def step_cost(model, tok, rows: int) -> float:
    """CPU seconds per decode step at `rows` rows."""
    g = torch.Generator().manual_seed(rows)
    prompts = torch.randint(100, tok.vocab_size, (rows, 64), generator=g).tolist()
    eng = RolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, max_batch=rows, max_seq_len=64 + LONG)
    cpu = {}
    for n in (2, SHORT, LONG):  # the first one warms up
        params = SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True)
        t = time.process_time()
        eng.generate(prompts, params, seeds=list(range(rows)))
        cpu[n] = time.process_time() - t
    return (cpu[LONG] - cpu[SHORT]) / (LONG - SHORT)


def schedule_rows(caps: list[int], batch: int, continuous: bool) -> list[int]:
    """Rows of every decode step (a request's first token comes from its prefill: cap - 1 decode steps)."""
    waiting, rows = list(caps), []
    running: list = []
    while waiting or running:
        if continuous or not running:
            while waiting and len(running) < batch:
                running.append(waiting.pop(0) - 1)
            running = [r for r in running if r > 0]
            if not running:
                continue
        rows.append(len(running))
        running = [r - 1 for r in running if r > 1]
    return rows


def interpolate(cost: dict[int, float], r: int) -> float:
    lo = max(k for k in cost if k <= r)
    hi = min(k for k in cost if k >= r)
    return cost[lo] if lo == hi else cost[lo] + (cost[hi] - cost[lo]) * (r - lo) / (hi - lo)


def main(model_path: str) -> None:
    torch.manual_seed(0)
    tok = load_tokenizer(model_path)
    probe = torch.randint(100, tok.vocab_size, (2, 64)).tolist()
    model = _model(model_path, "fp32", "exact", False, probe)
    cost = {}
    for r in ROWS:
        cost[r] = step_cost(model, tok, r)
        print(json.dumps({"rows": r, "cpu_s_per_step": round(cost[r], 4), "cpu_s_per_row": round(cost[r] / r, 5)}),
              flush=True)
    caps = response_lengths("longtail", 48, 2048)
    assert caps is not None
    out: dict = {}
    for name, continuous in (("static", False), ("continuous", True)):
        rows = schedule_rows(caps, 32, continuous)
        out[name] = {"decode_steps": len(rows), "row_steps": sum(rows),
                     "decode_cpu_s": round(sum(interpolate(cost, r) for r in rows), 1)}
    out["ratio"] = round(out["static"]["decode_cpu_s"] / out["continuous"]["decode_cpu_s"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
