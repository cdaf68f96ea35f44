"""Profile the native engine's exact rollout on SmolLM2: where a decode step's time goes.

    python scripts/profile_exact_rollout.py [threads=1] [mode=unified] [new_tokens=64 (<= 136)]

16 random prompts x 64 tokens, `new_tokens` new tokens each, exact numerics. Prints the wall time, the
time inside each of jetflow's C++ kernels (the library's entry points timed one call at a time: they run
through ctypes, which torch.profiler does not see) and the rest ("other": Python and torch ops), the
wall time of the same generation with every compute kernel replaced by a call that returns at once
(what Python and torch cost alone; the tokens it samples are garbage), then a torch.profiler table of a
second run. results/bench/rollout-exact-profile.md has runs and readings.
"""

import collections
import copy
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from jetflow.bench.workload import bench_config
from jetflow.config import derive
from jetflow.kernels import cpu_build, invariant
from jetflow.rollout import RolloutEngine, SamplingParams
from jetflow.run.build import apply_mode, build_policy, copy_model


COMPUTE_KERNELS = ("jf_gemm", "jf_gemm_fp8", "jf_linear_fp8", "jf_attention", "jf_rope_decode", "jf_quantize_1x128",
                   "jf_round_to_bf16")


class TimedLibrary:
    """The kernels' library with every `jf_*` entry point timed (seconds and calls per name); with `stub`
    set, the compute kernels return at once instead (an exact linear keeps the function it was handed:
    the switch is inside it)."""

    def __init__(self, lib):
        self.lib, self.seconds, self.calls = lib, collections.defaultdict(float), collections.Counter()
        self.stub = False

    def __getattr__(self, name):
        fn = getattr(self.lib, name)
        if not name.startswith("jf_") or name in ("jf_panel_width", "jf_isa"):
            return fn

        def timed(*args):
            if self.stub and name in COMPUTE_KERNELS:
                return 0
            t0 = time.perf_counter()
            out = fn(*args)
            self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1
            return out
        return timed


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    mode = sys.argv[2] if len(sys.argv) > 2 else "unified"
    new_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    timed = TimedLibrary(cpu_build.load_library("native"))
    invariant.load_library = lambda variant="native": timed
    cfg = bench_config("smollm2")
    base, tok = build_policy(cfg)
    cfg = copy.deepcopy(cfg)
    cfg.precision.mode, cfg.precision.numerics = mode, "exact"
    model = apply_mode(copy_model(base), derive(cfg).precision, "rollout")
    engine = RolloutEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id, max_batch=16, max_seq_len=200)
    prompts = torch.randint(0, base.config.vocab_size, (16, 64), generator=torch.Generator().manual_seed(0)).tolist()
    seeds = list(range(16))
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True), seeds)  # warm-up
    timed.seconds.clear()
    timed.calls.clear()
    t0 = time.perf_counter()
    engine.generate(prompts, params, seeds)
    wall = time.perf_counter() - t0
    print(f"{mode}, {torch.get_num_threads()} threads: {new_tokens} new tokens x 16 in {wall:.2f} s wall "
          f"({16 * new_tokens / wall:.0f} new tok/s)")
    for name, s in sorted(timed.seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {name:20s} {s:6.3f} s  {timed.calls[name]:6d} calls  {1e6 * s / timed.calls[name]:7.0f} us/call")
    print(f"  {'other':20s} {wall - sum(timed.seconds.values()):6.3f} s  (Python and torch ops)")
    timed.stub = True
    t0 = time.perf_counter()
    engine.generate(prompts, params, seeds)
    print(f"  the same with every compute kernel a no-op: {time.perf_counter() - t0:.2f} s (Python and torch alone)")
    timed.stub = False
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(prompts, params, seeds)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
