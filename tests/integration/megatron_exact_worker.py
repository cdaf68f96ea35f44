"""The native rollout engine's log-probs against the Megatron trainer's under exact numerics; run by torchrun.

    torchrun --nproc_per_node 2 tests/integration/megatron_exact_worker.py --config configs/tiny-tp.yaml \
        --tp 2 --out DIR [--cases fp32,bf16,unified,unified_kv] [--pp 1] [--ep 1] [--set key=value ...]

Each case builds, as `jetflow train` does (jetflow.run.build, jetflow.run.megatron_side, precision.numerics
=auto, which resolves to exact here): the tiny model from the config with seeded random weights, the
Megatron trainer (train.backend=megatron at the given TP / PP / EP sizes) under jetflow's Trainer, and the
native rollout engine beside it. With the FP8 KV cache (case unified_kv) the trainer's forward over the
prompts calibrates the K/V scales (max-reduced over the model-parallel and data-parallel ranks). The
trainer's weights (and scales) go to the engine through jetflow.sync; the engine samples responses to
prompts of mixed lengths (left padding in the trainer's batch); the trainer computes its log-probs of
them (Trainer.compute_logprobs: through the pipeline under PP, on this rank's rows under EP, where the
ranks are data-parallel ranks with prompts of their own).

Every rank writes DIR/<case>.rank<r>.pt: whether the two log-probs are equal (torch.equal), the token
count, max |diff|, the trainer's log-probs, the batch's token ids and the rows it holds; it prints one
line per case. Cases: fp32, bf16, unified (FP8), unified_kv (FP8 + FP8 KV cache).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a source tree without installing

from jetflow.config import derive, load_config  # noqa: E402
from jetflow.distributed import DataParallel  # noqa: E402
from jetflow.rl.experience import pack_experience  # noqa: E402
from jetflow.rollout.native import NativeRollout  # noqa: E402
from jetflow.run.build import (apply_mode, attach_kv_fp8, build_policy, build_task, copy_model,  # noqa: E402
                               prompt_encoder)
from jetflow.run.loop import observe_kv_amax, request_seed  # noqa: E402
from jetflow.run.megatron_side import build_trainer_model, model_data_parallel  # noqa: E402
from jetflow.train.trainer import Trainer  # noqa: E402

CASES = {"fp32": ("fp32", False), "bf16": ("bf16", False), "unified": ("unified", False),
         "unified_kv": ("unified", True)}
NEW_TOKENS = 12


def random_weights(model, seed: int = 0) -> None:
    """Weights far from the tiny model's near-uniform init: varied log-probs and (MoE) routing."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def mixed_prompts(task, encode, n: int, start: int) -> list[list[int]]:
    """n prompts of the task from problem `start` on, each extended by a different number of its own
    tokens: lengths spread over about 3x, so the trainer's batch is left-padded."""
    prompts = [encode(p) for p in task.problems(start, n, 0)]
    return [p + (p * 4)[:i * 3] for i, p in enumerate(prompts)]


def run_case(config: str, case: str, tp: int, pp: int, ep: int, prompts_per_rank: int,
             overrides: list[str] = ()) -> dict:
    mode, kv = CASES[case]
    cfg = load_config(ROOT / config, [
        f"precision.mode={mode}", f"precision.kv_cache_fp8={str(kv).lower()}", "train.backend=megatron",
        f"train.tensor_parallel_size={tp}", f"train.pipeline_parallel_size={pp}", f"train.expert_parallel_size={ep}",
        f"rollout.max_new_tokens={NEW_TOKENS}", *overrides])
    derived = derive(cfg)
    task = build_task(cfg)
    decoder, tok = build_policy(cfg)
    random_weights(decoder)
    policy = build_trainer_model(cfg, derived, copy.deepcopy(decoder))[0]
    world = dist.get_world_size()
    dp = model_data_parallel(policy, DataParallel(rank=dist.get_rank(), world_size=world, global_rank=dist.get_rank()))
    trainer = Trainer(policy, cfg.train, cfg.algo, dp=dp)
    kv_quantizer = attach_kv_fp8(policy, derived.precision, "trainer")

    rollout_model = apply_mode(copy_model(policy), derived.precision, "rollout")
    attach_kv_fp8(rollout_model, derived.precision, "rollout")
    prompts = mixed_prompts(task, prompt_encoder(cfg, tok, task), prompts_per_rank, dp.rank * prompts_per_rank)
    fingerprint = derived.precision.fingerprint
    rollout = NativeRollout(rollout_model, cfg, tok, [], task.stop, max(map(len, prompts)) + NEW_TOKENS + 1,
                            fingerprint)
    scales = None
    if kv_quantizer is not None:  # the first scales: a trainer forward over the prompts, as the RL loop does
        observe_kv_amax(trainer.compute_logprobs, kv_quantizer, prompts, tok.pad_token_id, cfg.model.device)
        scales = kv_quantizer.recalibrate(dp)
    rollout.load_weights(trainer.weight_update(mode, fingerprint, scales))
    seeds = [request_seed(cfg.run.seed, 0, dp.rank * prompts_per_rank + i) for i in range(len(prompts))]
    out = rollout.generate(prompts, seeds)
    zeros = torch.zeros(len(prompts))
    exp = pack_experience(prompts, out.token_ids, out.logprobs, zeros, zeros, tok.pad_token_id)
    trainer_lp = trainer.compute_logprobs(exp, cfg.rollout.temperature)  # (B, R)
    mask = exp.response_mask > 0
    a, b = exp.rollout_logprobs[mask], trainer_lp[mask]
    return {"case": case, "numerics": derived.precision.numerics, "tp": tp, "pp": pp, "ep": ep, "dp": dp.world_size,
            "equal": torch.equal(a, b), "tokens": int(mask.sum()), "max_abs_diff": float((a - b).abs().max()),
            "trainer_logprobs": trainer_lp, "input_ids": exp.input_ids, "rows": (dp.rank, dp.world_size),
            "kv_scales": scales}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per data-parallel rank")
    parser.add_argument("--set", nargs="*", default=[], help="more config overrides, key=value")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from jetflow.train.megatron import initialize_parallel
    initialize_parallel(args.tp, args.pp, "cpu", args.ep)  # the torchrun world (or one process)
    rank = dist.get_rank()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for case in args.cases.split(","):
        result = run_case(args.config, case, args.tp, args.pp, args.ep, args.prompts, args.set)
        torch.save(result, out / f"{case}.rank{rank}.pt")
        print(f"rank {rank} {case}: tp {args.tp} pp {args.pp} ep {args.ep} numerics {result['numerics']}: "
              f"{result['tokens']} tokens, rollout == trainer log-probs: {result['equal']} "
              f"(max |diff| {result['max_abs_diff']:.3g})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from jetflow.distributed import exit_process
    exit_process(0)  # skip the distributed runtime's interpreter teardown (see exit_process)
