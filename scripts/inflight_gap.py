"""In-flight weight updates (rollout.inflight_updates, issue 72): the kept-KV way's gap and the re-prefill way's cost,
at the engine, on one batch that spans an update.

    python scripts/inflight_gap.py [--config configs/tiny.yaml] [--prompts 32] [--max-new-tokens 32] [--trials 3] \
        [override ...]

The trainer takes one GRPO-shaped step (the config's lr, weight decay 0.1) between version 0 and version 1. For each
trial and each way, the engine starts the batch under version 0 (ignore_eos: every request runs max_new_tokens),
pauses it half way (jetflow.run.inflight.swap_step), loads version 1 and finishes it. Reported: for keep_kv, over
the tokens sampled after the swap, KL k3 and max |dlogp| of the behaviour log-probs against the trainer's
recomputation under version 1 given the same prefix; for reprefill, that they are equal (torch.equal), and the seconds
its resume takes beyond keep_kv's (the re-prefill of every running request), per swap, median over the trials, and
the engine's own prefill seconds beyond keep_kv's (the re-prefill alone, less exposed to a loaded machine's noise).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch


def main() -> None:
    from jetflow.config import derive, load_config
    from jetflow.rl import mismatch_metrics
    from jetflow.rl.experience import pack_experience
    from jetflow.run.build import load_inputs
    from jetflow.run.inflight import swap_step, version_grid
    from jetflow.run.loop import request_seed
    from jetflow.run.sides import TrainerSide, build_rollout_side
    from jetflow.rollout.types import Rollouts

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    cfg = load_config(a.config, ["precision.numerics=exact", "run.loggers=[]", "rollout.max_staleness=1",
                                 "rollout.inflight_updates=reprefill", f"rollout.max_new_tokens={a.max_new_tokens}",
                                 "train.weight_decay=0.1", *a.overrides])
    derived = derive(cfg)
    inputs = load_inputs(cfg)
    side = TrainerSide(cfg, derived, inputs)
    trainer, mode, fingerprint = side.trainer, derived.precision.mode.value, derived.precision.fingerprint
    rollout = build_rollout_side(cfg, derived, inputs, side)
    rollout.params = replace(rollout.params, ignore_eos=True, stop=())
    prompts = [side.encode(p) for p in side.task.problems(0, a.prompts, cfg.run.seed)]
    pad, zeros, n = side.tokenizer.pad_token_id, torch.zeros(a.prompts), a.prompts

    weights = [{k: v.clone() for k, v in trainer.model.state_dict().items()}]
    warm = rollout.generate(prompts, [request_seed(cfg.run.seed, 0, i) for i in range(n)])  # the step's samples
    exp = pack_experience(prompts, warm.token_ids, warm.logprobs, zeros, torch.linspace(-1, 1, n), pad)
    exp.old_logprobs = trainer.compute_logprobs(exp, cfg.rollout.temperature)
    trainer.train_step(exp, cfg.rollout.temperature)
    weights.append({k: v.clone() for k, v in trainer.model.state_dict().items()})

    def update(index: int, version: int):
        trainer.model.load_state_dict(weights[index])
        trainer.version = version
        return trainer.weight_update(mode, fingerprint)

    pause = swap_step(cfg)
    seconds: dict[str, list[float]] = {"keep_kv": [], "reprefill": []}
    prefill: dict[str, list[float]] = {"keep_kv": [], "reprefill": []}  # the engine's prefill seconds, start and resume
    version = 10
    for trial in range(a.trials):
        seeds = [request_seed(cfg.run.seed, 100 + trial, i) for i in range(n)]
        for way in ("keep_kv", "reprefill"):
            rollout.reprefill = way == "reprefill"
            rollout.load_weights(update(0, version))
            rollout.start(prompts, seeds, pause)
            rollout.load_weights(update(1, version + 1))
            t0 = time.perf_counter()
            out: Rollouts = rollout.finish()
            seconds[way].append(time.perf_counter() - t0)
            stats = rollout.engine.last_stats
            prefill[way].append(stats["prefill_s"])
            exp = pack_experience(prompts, out.token_ids, out.logprobs, zeros, zeros, pad)
            trainer.model.load_state_dict(weights[1])
            lp1 = trainer.compute_logprobs(exp, cfg.rollout.temperature)  # (B, T) under version 1
            swapped = (exp.response_mask > 0) & (version_grid(out, lp1.shape[1]) == version + 1)  # (B, T)
            gap = mismatch_metrics(exp.rollout_logprobs, lp1, swapped, num_position_bins=1)
            equal = torch.equal(exp.rollout_logprobs[swapped], lp1[swapped])
            print(f"trial {trial} {way:9s}: {int(swapped.sum())} post-swap tokens, KL k3 {gap['mismatch/kl_k3']:.3e}, "
                  f"max |dlogp| {gap['mismatch/abs_delta_max']:.3e}, torch.equal {equal}, resume "
                  f"{seconds[way][-1]:.3f} s (prefill {stats['prefill_s']:.3f} s, decode {stats['decode_s']:.3f} s; "
                  f"re-prefilled positions {stats.get('swap_prefill_tokens', 0)})",
                  flush=True)
            version += 2
    extra = statistics.median(r - k for r, k in zip(seconds["reprefill"], seconds["keep_kv"]))
    extra_prefill = statistics.median(r - k for r, k in zip(prefill["reprefill"], prefill["keep_kv"]))
    print(f"{n} requests x {a.max_new_tokens} new tokens, swap after {pause} decode steps: re-prefill costs "
          f"{extra:+.3f} s per swap (median over {a.trials}; resume keep_kv {statistics.median(seconds['keep_kv']):.3f} s, "
          f"reprefill {statistics.median(seconds['reprefill']):.3f} s); the engine's prefill seconds alone: "
          f"{extra_prefill:+.3f} s per swap (median), {min(prefill['reprefill']) - min(prefill['keep_kv']):+.3f} s "
          f"(fastest against fastest)")


if __name__ == "__main__":
    main()
