"""Profile the native engine's exact rollout on SmolLM2: where a decode step's time goes (torch.profiler).

    python scripts/profile_exact_rollout.py [threads=1] [mode=unified]

16 random prompts x 64 tokens, 64 new tokens each, exact numerics. The C++ GEMMs run through ctypes
and do not appear as torch ops: the wall time minus the profiled ops is roughly their share.
results/bench/rollout-exact-profile.md has one run and its reading.
"""

import copy
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from jetflow.bench.workload import bench_config
from jetflow.config import derive
from jetflow.rollout import RolloutEngine, SamplingParams
from jetflow.run.build import apply_mode, build_policy, copy_model


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    mode = sys.argv[2] if len(sys.argv) > 2 else "unified"
    cfg = bench_config("smollm2")
    base, tok = build_policy(cfg)
    cfg = copy.deepcopy(cfg)
    cfg.precision.mode, cfg.precision.numerics = mode, "exact"
    model = apply_mode(copy_model(base), cfg, derive(cfg), "rollout")
    engine = RolloutEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id, max_batch=16, max_seq_len=200)
    prompts = torch.randint(0, base.config.vocab_size, (16, 64), generator=torch.Generator().manual_seed(0)).tolist()
    seeds = list(range(16))
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True), seeds)  # warm-up
    t0 = time.perf_counter()
    engine.generate(prompts, params, seeds)
    print(f"64 new tokens x 16: {time.perf_counter() - t0:.2f} s wall")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(prompts, params, seeds)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
