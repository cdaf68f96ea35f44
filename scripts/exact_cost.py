"""The price of exact numerics on SmolLM2-135M (CPU): rollout new tokens/s and training-step time,
exact vs fast, in fp32, bf16 and unified, in one run with interleaved repetitions (load from other
processes then hits every variant alike); medians reported. `rollout_vs_fp32_exact` compares each
exact rollout with the fp32 exact one (what FP8 buys on this CPU).

    python scripts/exact_cost.py [--reps 3] [--batch 16] [--prompt-len 64] [--new-tokens 128]
        [--train-batch 8] [--out results/exact-on-policy]

Rollout: the native engine, `batch` random prompts of `prompt_len` tokens, `new_tokens` sampled each
(EOS ignored), prefill included. Train step: `Trainer.train_step_on_policy` (forward, GRPO loss,
backward, AdamW) on `train_batch` rows of prompt_len + new_tokens random tokens, the mean of
`train_steps` steps after two warm-up steps. Writes cost.json / cost.md under --out.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from jetflow.bench.common import markdown_table, write_results
from jetflow.bench.train_step import build_trainer
from jetflow.bench.workload import LoadAverage, bench_config, synthetic_experience
from jetflow.config import derive
from jetflow.run.build import apply_mode, build_policy, copy_model
from jetflow.rollout import RolloutEngine, SamplingParams

MODES = ("fp32", "bf16", "unified")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=2, help="timed steps per measurement (after 2 warm-up steps)")
    ap.add_argument("--out", default="results/exact-on-policy")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated precision modes")
    args = ap.parse_args()
    variants = [(mode, numerics) for mode in args.modes.split(",") for numerics in ("fast", "exact")]

    base_cfg = bench_config("smollm2")
    base, tok = build_policy(base_cfg)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, base.config.vocab_size, (args.batch, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    exp = synthetic_experience(args.train_batch, args.prompt_len, args.new_tokens, base.config.vocab_size,
                               tok.pad_token_id)

    configs, engines = {}, {}
    for mode, numerics in variants:
        cfg = configs[mode, numerics] = copy.deepcopy(base_cfg)
        cfg.precision.mode, cfg.precision.numerics = mode, numerics
        rollout_model = apply_mode(copy_model(base), derive(cfg).precision, "rollout")
        engines[mode, numerics] = RolloutEngine(rollout_model, eos_token_ids=[], pad_token_id=tok.pad_token_id,
                                                max_batch=args.batch, max_seq_len=args.prompt_len + args.new_tokens + 1)

    def train_step_seconds(v) -> float:
        """Mean of `--train-steps` timed steps of a fresh trainer after two warm-up steps (weights packed
        or quantized, Adam state allocated, the allocator settled); built per measurement, since four
        trainers with Adam state do not fit in 24 GiB."""
        t = build_trainer(base, configs[v])
        for _ in range(2):
            t.train_step_on_policy(exp, 1.0, "none")
        t0 = time.perf_counter()
        for _ in range(args.train_steps):
            t.train_step_on_policy(exp, 1.0, "none")
        return (time.perf_counter() - t0) / args.train_steps

    rollout_s = {v: [] for v in variants}
    train_s = {v: [] for v in variants}
    seeds = list(range(args.batch))
    with LoadAverage() as load:
        for v in variants:  # warm-up: kernels built, weights packed, first-touch allocations
            engines[v].generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True), seeds)
        for rep in range(args.reps):
            for v in variants:
                t0 = time.perf_counter()
                out = engines[v].generate(prompts, params, seeds)
                rollout_s[v].append(time.perf_counter() - t0)
                assert sum(map(len, out.token_ids)) == args.batch * args.new_tokens
                train_s[v].append(train_step_seconds(v))
            print(f"rep {rep}: " + ", ".join(f"{m}/{n} rollout {rollout_s[m, n][-1]:.1f}s train {train_s[m, n][-1]:.1f}s"
                                             for m, n in variants), flush=True)

    rows = []
    fp32_exact = statistics.median(rollout_s["fp32", "exact"]) if ("fp32", "exact") in rollout_s else None
    for mode, numerics in variants:
        r, t = statistics.median(rollout_s[mode, numerics]), statistics.median(train_s[mode, numerics])
        fr, ft = statistics.median(rollout_s[mode, "fast"]), statistics.median(train_s[mode, "fast"])
        rows.append({"mode": mode, "numerics": numerics,
                     "rollout_new_tokens_per_s": args.batch * args.new_tokens / r,
                     "rollout_vs_fast": fr / r, "train_step_s": t, "train_step_vs_fast": t / ft,
                     "rollout_vs_fp32_exact": fp32_exact / r if numerics == "exact" and fp32_exact else None,
                     "rollout_s_all": rollout_s[mode, numerics], "train_s_all": train_s[mode, numerics]})
    table = markdown_table([{k: v for k, v in r.items() if not k.endswith("_all")} for r in rows],
                           ["mode", "numerics", "rollout_new_tokens_per_s", "rollout_vs_fast", "rollout_vs_fp32_exact",
                            "train_step_s", "train_step_vs_fast"])
    md = (f"SmolLM2-135M-Instruct, CPU. Rollout: {args.batch} prompts x {args.prompt_len} tokens, {args.new_tokens} new "
          f"tokens each (prefill included). Train step: {args.train_batch} x {args.prompt_len + args.new_tokens} "
          f"tokens, forward + backward + AdamW, mean of {args.train_steps} steps after 2 warm-up steps. Medians of "
          f"{args.reps} interleaved repetitions. rollout_vs_fast: "
          f"exact tokens/s over fast tokens/s (below 1: exact is slower); train_step_vs_fast: exact seconds over "
          f"fast seconds (above 1: exact is slower); rollout_vs_fp32_exact: exact tokens/s over fp32 exact tokens/s.\n\n{table}\n\n{load.sentence()}")
    write_results("cost", {"args": vars(args), "rows": rows, "load": load.record()}, md, args.out)
    print(md)


if __name__ == "__main__":
    main()
