"""LoRA on the Megatron trainer at TP = world size against the native LoRA trainer; run by torchrun.

    torchrun --nproc_per_node 2 tests/integration/megatron_lora_worker.py --out DIR [--cases fp32,bf16,unified]

Per case (precision.mode fp32 / bf16 / unified, precision.numerics=exact, configs/tiny-tp.yaml with seeded
random weights, model.lora.rank=4 on every projection), built as `jetflow train` builds them
(jetflow.run.megatron_side.build_trainer_model): the Megatron trainer (train.backend=megatron, TP-split adapters)
and, in the same process, the native trainer (train.backend=native) on a copy of the same Decoder. Both take
STEPS supervised steps (Trainer.sft_step, grad_clip 0: the raw gradients stay in `.grad`) on one fixed
left-padded batch. Recorded on every rank (DIR/<case>.rank<r>.pt):
  - the log-probs of the batch before training and, after the steps, with the native trainer's adapters
    loaded into the Megatron policy (the forward on equal trained adapters), both sides';
  - per step: both losses, both trainers' adapter gradients and adapters after the step (the Megatron ones
    gathered whole over TP, in the native names);
  - the native rollout engine synced from the Megatron trainer (jetflow.sync: the base and the gathered
    adapters) samples responses, and the Megatron trainer's log-probs of them: equal or not.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from jetflow.config import derive, load_config  # noqa: E402
from jetflow.distributed import DataParallel  # noqa: E402
from jetflow.precision.lora import ADAPTER, adapter_parameters  # noqa: E402
from jetflow.rl.experience import pack_experience  # noqa: E402
from jetflow.rollout.native import NativeRollout  # noqa: E402
from jetflow.run.build import build_policy, build_task, prompt_encoder, rollout_model  # noqa: E402
from jetflow.run.loop import request_seed  # noqa: E402
from jetflow.run.megatron_side import build_trainer_model, model_data_parallel  # noqa: E402
from jetflow.train.megatron.lora import segment_adapters  # noqa: E402
from jetflow.train.trainer import Trainer  # noqa: E402
from megatron_exact_worker import mixed_prompts, random_weights  # noqa: E402
from megatron_tp_worker import fixed_batch  # noqa: E402

STEPS = 2
NEW_TOKENS = 8
TARGETS = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


def config(mode: str, backend: str, tp: int):
    return load_config(ROOT / "configs/tiny-tp.yaml", [
        f"precision.mode={mode}", "precision.numerics=exact", f"train.backend={backend}",
        f"train.tensor_parallel_size={tp if backend == 'megatron' else 1}", "model.lora.rank=4",
        f"model.lora.targets={TARGETS}", "train.grad_clip=0", "train.lr=3e-3", "train.micro_batch_size=2",
        f"rollout.max_new_tokens={NEW_TOKENS}"])


def megatron_grads(policy) -> dict[str, torch.Tensor]:
    """The Megatron adapters' gradients whole, in the native names (TP shards gathered as the weights are)."""
    out = {}
    for linear in policy._linears():
        for seg, adapter in segment_adapters(linear):
            if adapter is None:
                continue
            for part, dim in (("A", 1), ("B", 0)):
                g = getattr(adapter, part).grad.detach().contiguous()
                if policy.tp_size > 1 and dim == (0 if linear.parallel_dim == 0 else 1):
                    parts = [torch.empty_like(g) for _ in range(policy.tp_size)]
                    dist.all_gather(parts, g, group=policy.tp_group)
                    g = torch.cat(parts, dim)
                out[f"{seg.name}.{ADAPTER}.{part}"] = g
    return out


def run_case(mode: str, tp: int) -> dict:
    cfg, native_cfg = config(mode, "megatron", tp), config(mode, "native", tp)
    decoder, tok = build_policy(cfg)
    random_weights(decoder)
    policy = build_trainer_model(cfg, derive(cfg), copy.deepcopy(decoder))[0]
    native = build_trainer_model(native_cfg, derive(native_cfg), copy.deepcopy(decoder))[0]
    dp = model_data_parallel(policy, DataParallel(rank=dist.get_rank(), world_size=dist.get_world_size(),
                                                  global_rank=dist.get_rank()))
    mega, nat = Trainer(policy, cfg.train, cfg.algo, dp=dp), Trainer(native, native_cfg.train, native_cfg.algo)
    exp = fixed_batch(decoder.config.vocab_size)
    out = {"tp": tp, "mode": mode, "logprobs0": (mega.compute_logprobs(exp), nat.compute_logprobs(exp)), "steps": []}
    for _ in range(STEPS):
        m, n = mega.sft_step(exp), nat.sft_step(exp)
        out["steps"].append({
            "loss": (m["train/loss"], n["train/loss"]),
            "grads": (megatron_grads(policy), {k: p.grad.clone() for k, p in adapter_parameters(native).items()}),
            "adapters": ({k: t.clone() for k, t in policy.adapter_state_dict().items()},
                         {k: p.detach().clone() for k, p in adapter_parameters(native).items()})})

    # the rollout engine, synced from the Megatron trainer, against the Megatron trainer's recomputation
    derived = derive(cfg)
    task = build_task(cfg)
    prompts = mixed_prompts(task, prompt_encoder(cfg, tok, task), 3, 0)
    engine = NativeRollout(rollout_model(cfg, derived.precision, decoder), cfg, tok, [], task.stop,
                           max(map(len, prompts)) + NEW_TOKENS + 1, derived.precision.fingerprint)
    engine.load_weights(mega.weight_update(derived.precision.mode, derived.precision.fingerprint))
    sampled = engine.generate(prompts, [request_seed(cfg.run.seed, 0, i) for i in range(len(prompts))])
    zeros = torch.zeros(len(prompts))
    rollout = pack_experience(prompts, sampled.token_ids, sampled.logprobs, zeros, zeros, tok.pad_token_id)
    mask = rollout.response_mask > 0
    trainer_lp = mega.compute_logprobs(rollout, cfg.rollout.temperature)
    out["rollout"] = {"equal": torch.equal(rollout.rollout_logprobs[mask], trainer_lp[mask]), "tokens": int(mask.sum()),
                      "max_abs_diff": float((rollout.rollout_logprobs[mask] - trainer_lp[mask]).abs().max())}

    # the forward on equal trained adapters: the native trainer's loaded into the Megatron policy
    policy.load_adapter_state_dict(out["steps"][-1]["adapters"][1])
    out["logprobs_trained"] = (mega.compute_logprobs(exp), nat.compute_logprobs(exp))
    # unified: the update above shipped the base, and the FP8 linears dropped their fp32 masters
    # (MegatronPolicy.drop_frozen_masters); one more step's gradients on those equal adapters, from the bytes alone
    fp8 = [lin for lin in policy._linears() if lin.segments and all(s.kind == "fp8" for s in lin.segments)]
    out["masters_dropped"] = [lin.weight.untyped_storage().nbytes() <= 4 for lin in fp8]
    mega.sft_step(exp), nat.sft_step(exp)
    out["after_drop_grads"] = (megatron_grads(policy), {k: p.grad.clone() for k, p in adapter_parameters(native).items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="fp32,bf16,unified")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from jetflow.train.megatron import initialize_parallel
    tp = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    initialize_parallel(tp, 1, "cpu", 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for mode in args.cases.split(","):
        result = run_case(mode, tp)
        torch.save(result, out / f"{mode}.rank{dist.get_rank()}.pt")
        print(f"rank {dist.get_rank()} {mode}: rollout == trainer log-probs: {result['rollout']['equal']} "
              f"({result['rollout']['tokens']} tokens)", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from jetflow.distributed import exit_process
    exit_process(0)  # skip the distributed runtime's interpreter teardown (see exit_process)
