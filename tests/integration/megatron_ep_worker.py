"""Trains a tiny Qwen3-MoE MegatronPolicy with expert parallelism under jetflow's Trainer; run by torchrun.

    torchrun --nproc_per_node 2 tests/integration/megatron_ep_worker.py --out DIR --ep 2 --steps 5

--ep expert-parallel size, --pp pipeline stages; the data-parallel ranks (world / pp) each take their
rows of one fixed RL batch (4 left-padded sequences, micro-batches of 1; the last sequence has no
response tokens, so under EP its rank runs that micro-batch's forward and backward for the others'
token dispatch). Every rank builds the same native Decoder (fixed seed) and hands it to
`MegatronPolicy.from_decoder`; it records:
  logprobs0   Trainer.compute_logprobs of its rows
  losses      `steps` Trainer.train_step against logprobs0, gradient clipping by the global norm
  weights     the HF-named weights after training (every expert gathered to every rank)
  fp8         (case fp8) checksums of quantized_weights() before and after training
Every rank writes DIR/<case>.rank<r>.pt. Cases: fp32, fp8 (FP8 expert GEMMs, emulated), nan (fp8 with a
NaN put into one token's embedding on one rank only, the last data-parallel rank of the first stage, in
RL step 1 and in a last compute_logprobs; it records:
  skipped     train/skipped of every step
  logprobs_nonfinite  whether that compute_logprobs raised NonFiniteError on this rank).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a source tree without installing

from jetflow.config import AlgoConfig, TrainConfig  # noqa: E402
from jetflow.distributed import DataParallel  # noqa: E402
from jetflow.model import Decoder, ModelConfig  # noqa: E402
from jetflow.precision import QuantRecipe  # noqa: E402
from jetflow.rl.experience import pack_experience  # noqa: E402
from jetflow.run.megatron_side import model_data_parallel  # noqa: E402
from jetflow.train.trainer import Trainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from megatron_pp_worker import checksum, random_decoder  # noqa: E402

# hidden 128 and expert width 128: whole 128x128 FP8 blocks
MOE = ModelConfig(model_type="qwen3_moe", vocab_size=96, hidden_size=128, intermediate_size=256, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=128, norm_topk_prob=True)


def tiny_decoder(seed: int = 0) -> Decoder:
    """The same random model on every rank (and in every run)."""
    return random_decoder(MOE, seed)


def rl_batch(vocab: int):
    """Four left-padded prompts with responses of different lengths; the last response is empty."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (5, 3, 7, 4)]
    responses = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (4, 6, 2, 0)]
    lps = [(-torch.rand(len(r), generator=g)).tolist() for r in responses]
    return pack_experience(prompts, responses, lps, torch.zeros(4), torch.tensor([1.0, -0.5, 0.7, -1.2]), pad_id=0)


def run_case(case: str, steps: int, ep: int, pp: int) -> dict:
    from jetflow.train.megatron import MegatronPolicy

    kind = "fp32" if case == "fp32" else "fp8"
    policy = MegatronPolicy.from_decoder(tiny_decoder(), kind=kind, recipe=QuantRecipe() if kind == "fp8" else None,
                                         gemm_backend="emulate", expert_parallel_size=ep, pipeline_parallel_size=pp)
    world = dist.get_world_size()
    dp = model_data_parallel(policy, DataParallel(rank=dist.get_rank(), world_size=world, global_rank=dist.get_rank()))
    result = {"ep": ep, "pp": pp, "dp": dp.world_size, "num_params": policy.num_params(),
              "local_experts": len(policy.gpt.decoder.layers[0].mlp.experts.local_experts)}
    if kind == "fp8":
        result["fp8_checksum"] = checksum(policy.quantized_weights())
    train = TrainConfig(lr=1e-5, grad_clip=0.5, micro_batch_size=1, steps=steps + 2, warmup_steps=0)
    trainer = Trainer(policy, train, AlgoConfig(), dp=dp)
    exp = rl_batch(MOE.vocab_size)
    rows = dp.shard(exp.batch_size)
    exp = exp.select(slice(rows.start, rows.stop))
    result["rows"] = (rows.start, rows.stop)
    result["logprobs0"] = trainer.compute_logprobs(exp)
    exp.old_logprobs = result["logprobs0"]
    poison = {"on": False}
    if case == "nan" and policy.first_stage and dp.rank == dp.world_size - 1:
        def put_nan(module, args, out):  # (T, B, C): one token's embedding on this rank only
            if poison["on"]:
                out = out.clone()
                out[0, 0, 0] = float("nan")
            return out
        policy.gpt.embedding.register_forward_hook(put_nan)
    metrics = []
    for step in range(steps):
        poison["on"] = case == "nan" and step == 1
        metrics.append(trainer.train_step(exp))
    poison["on"] = False
    result["losses"] = [m["train/loss"] for m in metrics]
    result["skipped"] = [m["train/skipped"] for m in metrics]
    if case == "nan":
        from jetflow.precision import NonFiniteError
        poison["on"] = True
        try:
            trainer.compute_logprobs(exp)
            result["logprobs_nonfinite"] = False
        except NonFiniteError:
            result["logprobs_nonfinite"] = True
        poison["on"] = False
    result["grad_norms"] = [m["train/grad_norm"] for m in metrics]
    result["logprobs_end"] = trainer.compute_logprobs(exp)
    result["weights"] = {k: v.clone() for k, v in policy.hf_state_dict().items()}
    if kind == "fp8":
        result["fp8_checksum_end"] = checksum(policy.quantized_weights())
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cases", default="fp32,fp8")
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)
    for case in args.cases.split(","):
        torch.save(run_case(case, args.steps, args.ep, args.pp), out / f"{case}.rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from jetflow.distributed import exit_process
    exit_process(0)  # skip the distributed runtime's interpreter teardown (see exit_process)
