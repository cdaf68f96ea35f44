"""Trains a tiny MegatronPolicy split into pipeline stages with jetflow's Trainer; run by torchrun.

    torchrun --nproc_per_node 2 tests/integration/megatron_pp_worker.py --out DIR --steps 5

pipeline_parallel_size = world size / --tp (tensor_parallel_size, default 1). Every rank builds the same native Decoder
(fixed seed), hands it to `MegatronPolicy.from_decoder`, and runs on one fixed left-padded RL batch
(5 sequences, micro-batches of 2, the last one without response tokens):
  logprobs0   Trainer.compute_logprobs (the trainer's old log-probs; every rank gets them)
  losses      `steps` Trainer.train_step against logprobs0 (PPO-style: the ratio moves with the weights,
              so the loss depends on them), with gradient clipping by the global norm (grad_clip)
  on_policy   one Trainer.train_step_on_policy (pi_old from the training forward) and its old log-probs
  sft         one Trainer.sft_step
  weights     the HF-named weights after training (checkpoint_weights: gathered over stages)
  round trip  rank 0 writes a checkpoint (save_checkpoint), every rank loads it into a fresh, randomly
              initialised policy (load_checkpoint): its weights and log-probs must equal the trained ones
Every rank writes DIR/<case>.rank<r>.pt. Cases:
  llama  Llama-style, untied lm_head, GQA (4 layers, hidden 64, vocab 128), fp32
  tied   Qwen2-style: q/k/v biases, tied embeddings (the last stage's copy of the embedding), fp32
  fp8    the llama model under FP8 GEMMs (emulated): the gathered FP8 bytes of every stage; last, a NaN
         put into a first-stage weight: the FP8 quantizer raises there, and every stage skips the step
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a source tree without installing

from jetflow.config import AlgoConfig, TrainConfig  # noqa: E402
from jetflow.model import Decoder, ModelConfig  # noqa: E402
from jetflow.precision import QuantRecipe  # noqa: E402
from jetflow.rl.experience import pack_experience  # noqa: E402
from jetflow.train.checkpoint import checkpoint_weights, load_checkpoint, save_checkpoint  # noqa: E402
from jetflow.train.trainer import Trainer  # noqa: E402

LLAMA = ModelConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=500000.0)
CASES = {
    "llama": LLAMA,
    "tied": ModelConfig(model_type="qwen2", vocab_size=51, hidden_size=64, intermediate_size=128, num_layers=4,
                        num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, tie_word_embeddings=True),
    "fp8": LLAMA,
}


def tiny_decoder(case: str, seed: int = 0) -> Decoder:
    """The same random model on every rank (and in every run)."""
    return random_decoder(CASES[case], seed)


def random_decoder(config: ModelConfig, seed: int = 0) -> Decoder:
    """A Decoder with seeded random weights: norms 1 + 0.1 noise, biases 0.1 and matrices 0.05 scale."""
    torch.manual_seed(seed)
    model = Decoder(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def rl_batch(vocab: int):
    """Five left-padded prompts with responses of different lengths and non-zero advantages; the last
    response is empty (its micro-batch carries no response token and is skipped by the Trainer)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (5, 3, 7, 4, 6)]
    responses = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (4, 6, 2, 5, 0)]
    lps = [(-torch.rand(len(r), generator=g)).tolist() for r in responses]
    return pack_experience(prompts, responses, lps, torch.zeros(5), torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3]),
                           pad_id=0)


def train_config(steps: int) -> tuple[TrainConfig, AlgoConfig]:
    # grad_clip small enough to clip: the norm must be the global one over every stage
    return TrainConfig(lr=2e-5, grad_clip=0.5, micro_batch_size=2, steps=steps + 2, warmup_steps=0), AlgoConfig()


def checksum(quantized: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(quantized):
        q = quantized[name]
        h.update(name.encode())
        h.update(q.data.contiguous().view(torch.uint8).numpy().tobytes())
        h.update(q.scale_inv.contiguous().numpy().tobytes())
        h.update(str(tuple(q.block)).encode())
    return h.hexdigest()


def build(case: str, pp: int, decoder: Decoder | None = None, seed: int = 0, tp: int = 1):
    from jetflow.train.megatron import MegatronPolicy

    kind = "fp8" if case == "fp8" else "fp32"
    kwargs = dict(kind=kind, recipe=QuantRecipe() if kind == "fp8" else None, gemm_backend="emulate",
                  pipeline_parallel_size=pp, tensor_parallel_size=tp, seed=seed)
    if decoder is None:
        return MegatronPolicy(CASES[case], init_weights=True, **kwargs)
    return MegatronPolicy.from_decoder(decoder, **kwargs)


def run_case(case: str, steps: int, pp: int, rank: int, out: Path, tp: int = 1) -> dict:
    policy = build(case, pp, tiny_decoder(case), tp=tp)
    result = {"pp": pp, "tp": tp, "num_params": policy.num_params(), "stage": policy.pp_rank}
    if case == "fp8":
        result["fp8_checksum"] = checksum(policy.quantized_weights())
    trainer = Trainer(policy, *train_config(steps))
    exp = rl_batch(CASES[case].vocab_size)
    result["logprobs0"] = trainer.compute_logprobs(exp)
    exp.old_logprobs = result["logprobs0"]
    metrics = [trainer.train_step(exp) for _ in range(steps)]
    result["losses"] = [m["train/loss"] for m in metrics]
    result["grad_norms"] = [m["train/grad_norm"] for m in metrics]
    result["metrics"] = metrics[-1]
    on_policy, result["on_policy_old"] = trainer.train_step_on_policy(exp, 1.0, "none")
    result["on_policy_loss"] = on_policy["train/loss"]
    result["sft_loss"] = trainer.sft_step(exp)["train/loss"]
    result["logprobs_end"] = trainer.compute_logprobs(exp)
    if case == "fp8":
        result["fp8_checksum_end"] = checksum(policy.quantized_weights())
    weights = checkpoint_weights(policy)  # every rank: a collective over the stages
    result["weights"] = {k: v.clone() for k, v in weights.items()}
    tied = policy._tied_weight()
    if tied is not None:  # the embedding on stage 0 and its copy on the last stage: still equal?
        copies = [torch.empty_like(tied) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, tied.detach().contiguous())
        copies = [copies[r] for r in range(len(copies)) if r % tp == rank % tp]  # the same TP shard
        result["tied_copy_equal"] = all(torch.equal(copies[0], c) for c in copies)

    # save -> load round trip: rank 0 writes, every rank reads into a fresh random policy
    ckpt_root = out / f"ckpt-{case}-pp{pp}"
    if rank == 0:
        save_checkpoint(ckpt_root, 1, policy, trainer.state_dict(), {"next_step": 1}, model_state=weights,
                        hf_config=True)
    dist.barrier()
    fresh = build(case, pp, seed=123, tp=tp)
    before = checkpoint_weights(fresh)
    result["fresh_differs"] = any(not torch.equal(before[k], weights[k]) for k in weights)
    load_checkpoint(ckpt_root / "checkpoints" / "step_000001", fresh)
    loaded = checkpoint_weights(fresh)
    result["roundtrip_equal"] = set(loaded) == set(weights) and all(torch.equal(loaded[k], weights[k]) for k in weights)
    fresh_trainer = Trainer(fresh, *train_config(steps))
    result["roundtrip_logprobs_equal"] = torch.equal(fresh_trainer.compute_logprobs(exp), result["logprobs_end"])
    if case == "fp8":  # a NaN weight on the first stage: every stage must skip the step (and none hang)
        if policy.first_stage:
            with torch.no_grad():
                policy.gpt.decoder.layers[0].mlp.linear_fc1.weight[0, 0] = float("nan")
        bad = trainer.train_step(exp)
        result["nan_step"] = {k: bad[k] for k in ("train/skipped", "train/skipped_total")}
        result["nan_step"]["loss_finite"] = bool(torch.isfinite(torch.tensor(bad["train/loss"])))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cases", default="llama,tied,fp8")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (pipeline stages: world / tp)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pp = int(os.environ.get("WORLD_SIZE", "1")) // args.tp
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)
    for case in args.cases.split(","):
        torch.save(run_case(case, args.steps, pp, rank, out, args.tp), out / f"{case}.rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from jetflow.distributed import exit_process
    exit_process(0)  # skip the distributed runtime's interpreter teardown (see exit_process)
