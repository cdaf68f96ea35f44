"""Trains a tiny MegatronPolicy with jetflow's Trainer for a few steps; run by torchrun.

    torchrun --nproc_per_node 2 tests/integration/megatron_tp_worker.py --out losses.json --steps 5

Every rank builds the same native Decoder (fixed seed) and hands it to `MegatronPolicy.from_decoder`
with tensor_parallel_size = world size, then runs `Trainer.sft_step` on one fixed left-padded batch.
Rank 0 writes, per case: the per-step losses, the TP-aware gradient norms, a checksum of the FP8 bytes
that `quantized_weights()` gathers before training, and the final HF-named weights (a .pt beside the
json). The test (test_megatron_tp.py) compares a 2-process run with a 1-process run and with the native
model. Cases:
  fp32  Qwen2-style (q/k/v biases, tied embeddings, vocab 51 -> padded to a multiple of tp), GQA.
  fp8   Llama-style sized so that TP=2 shards cover whole 128x128 blocks (hidden 256, 4 KV heads x 64).
  bf16  the fp8 case's model with bf16 GEMMs (TP's own effect on a low-precision run, for comparison).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a source tree without installing

from jetflow.config import AlgoConfig, TrainConfig  # noqa: E402
from jetflow.model import Decoder, ModelConfig  # noqa: E402
from jetflow.precision import QuantRecipe  # noqa: E402
from jetflow.rl.experience import pack_experience  # noqa: E402
from jetflow.train.trainer import Trainer  # noqa: E402

CASES = {
    "fp32": ModelConfig(model_type="qwen2", vocab_size=51, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, tie_word_embeddings=True),
    "fp8": ModelConfig(model_type="llama", vocab_size=64, hidden_size=256, intermediate_size=256, num_layers=2,
                       num_heads=4, num_kv_heads=4, head_dim=64, rope_theta=500000.0),
}
CASES["bf16"] = CASES["fp8"]  # bf16 GEMMs on the FP8 case's model: how much TP alone moves a low-precision run


def tiny_decoder(case: str, seed: int = 0) -> Decoder:
    """The same random model on every rank (and in the test process)."""
    torch.manual_seed(seed)
    model = Decoder(CASES[case])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))  # non-trivial norm weights
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))  # non-zero biases
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def fixed_batch(vocab: int):
    """Three left-padded prompts with responses of different lengths (deterministic)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (5, 3, 7)]
    responses = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (4, 6, 2)]
    lps = [[0.0] * len(r) for r in responses]
    return pack_experience(prompts, responses, lps, torch.zeros(3), torch.zeros(3), pad_id=0)


LR = {"fp32": 3e-3, "fp8": 1e-3, "bf16": 1e-3}


def train_config(case: str, steps: int) -> tuple[TrainConfig, AlgoConfig]:
    # grad_clip=0: the Trainer's clip_grad_norm_ sees only this rank's shards (see MegatronPolicy.grad_norm)
    return TrainConfig(lr=LR[case], grad_clip=0.0, micro_batch_size=2, steps=steps, warmup_steps=0), AlgoConfig()


def quantized_checksum(quantized: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(quantized):
        q = quantized[name]
        h.update(name.encode())
        h.update(q.data.contiguous().view(torch.uint8).numpy().tobytes())
        h.update(q.scale_inv.contiguous().numpy().tobytes())
    return h.hexdigest()


def run_case(case: str, steps: int, tp: int) -> tuple[dict, dict]:
    from jetflow.train.megatron import MegatronPolicy

    kind = case
    recipe = QuantRecipe() if kind == "fp8" else None
    policy = MegatronPolicy.from_decoder(tiny_decoder(case), kind=kind, recipe=recipe, gemm_backend="emulate",
                                         tensor_parallel_size=tp)
    checksum = quantized_checksum(policy.quantized_weights()) if kind == "fp8" else None
    trainer = Trainer(policy, *train_config(case, steps))
    exp = fixed_batch(CASES[case].vocab_size)
    losses, norms = [], []
    for _ in range(steps):
        losses.append(trainer.sft_step(exp)["train/loss"])
        norms.append(float(policy.grad_norm()))  # gradients of the step just taken
    weights = {k: v.clone() for k, v in policy.hf_state_dict().items()}
    return {"losses": losses, "grad_norms": norms, "fp8_checksum": checksum}, weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cases", default="fp32,fp8,bf16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    result = {"tp": tp}
    for case in args.cases.split(","):
        result[case], weights = run_case(case, args.steps, tp)
        if rank == 0:
            torch.save(weights, f"{args.out}.{case}.pt")
    if rank == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from jetflow.distributed import exit_process
    exit_process(0)  # skip the distributed runtime's interpreter teardown (see exit_process)
