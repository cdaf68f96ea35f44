"""Trains the tiny Megatron policy of megatron_tp_worker with *active* gradient clipping; run by torchrun.

    torchrun --nproc_per_node 2 tests/integration/megatron_clip_worker.py --out result.json

jetflow's Trainer clips with the model's own `clip_grad_norm_` when it has one: for a MegatronPolicy
that is the global norm over the TP group, so TP=2 must take the same clipped steps as TP=1 (a
per-rank `torch.nn.utils.clip_grad_norm_` would see only each rank's shards and clip differently).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # run from a source tree without installing

import megatron_tp_worker as w  # noqa: E402

from jetflow.train.megatron import MegatronPolicy  # noqa: E402
from jetflow.train.trainer import Trainer  # noqa: E402

GRAD_CLIP = 0.05  # far below the gradient norms of these steps (about 2 to 6): every step is clipped


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    policy = MegatronPolicy.from_decoder(w.tiny_decoder("fp32"), kind="fp32", tensor_parallel_size=tp)
    train_cfg, algo = w.train_config("fp32", args.steps)
    trainer = Trainer(policy, replace(train_cfg, grad_clip=GRAD_CLIP), algo)
    exp = w.fixed_batch(w.CASES["fp32"].vocab_size)
    steps = [trainer.sft_step(exp) for _ in range(args.steps)]
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps({"tp": tp, "losses": [s["train/loss"] for s in steps],
                                              "grad_norms": [s["train/grad_norm"] for s in steps]}))
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from jetflow.distributed import exit_process
    exit_process(0)  # skip the distributed runtime's interpreter teardown (see exit_process)
