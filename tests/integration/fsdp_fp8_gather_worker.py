"""FSDP's FP8 all-gather across ranks; run by torchrun (tests/integration/test_fsdp.py):

    torchrun --nproc_per_node 2 tests/integration/fsdp_fp8_gather_worker.py --out result.json

A Decoder whose FP8 weights split between ranks off the 128-row block boundaries (hidden 192: 96 rows a
rank at 2 ranks) and on them (intermediate 512: 256 rows a rank), under `unified`, sharded by FSDPPolicy.
Rank 0 writes what it saw: whether the gathered FP8 bytes and scales equal the recipe's quantization of the whole
weight (before and after an optimizer step), whether the sharded gradients equal a replicated Decoder's
(every rank runs the same batch: the reduce-scatter sums 2 equal values, exactly twice one), and the bytes
FSDP's all-gathers received against FP8 weights' 1 byte, the bf16 embedding's 2 and the norms' 4; and
whether the same weights sharded from rank 0 alone (rank 1 holding a meta-device shell) give every rank the
same shards, of the same wrapper kinds, and whether `share_rng_state` gives every rank rank 0's generator.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a source tree without installing

from jetflow.bench.fsdp_memory import counted_all_gathers  # noqa: E402
from jetflow.config import derive, load_config  # noqa: E402
from jetflow.model import Decoder, ModelConfig  # noqa: E402
from jetflow.precision import fp8_linears  # noqa: E402
from jetflow.precision.family import quantize_weight_for_recipe  # noqa: E402
from jetflow.run.build import apply_mode  # noqa: E402
from jetflow.train.fsdp import FSDPPolicy  # noqa: E402
from jetflow.train.fsdp.from_rank0 import share_rng_state  # noqa: E402
from jetflow.train.fsdp.gather import plain  # noqa: E402


def bytes_equal(policy: FSDPPolicy, recipe) -> dict[str, bool]:
    shipped, full = policy.quantized_weights(), policy.hf_state_dict()
    out = {}
    for name, wq in shipped.items():
        ref = quantize_weight_for_recipe(full[f"{name}.weight"], recipe)  # the whole weight
        out[name] = torch.equal(wq.data.view(torch.uint8), ref.data.view(torch.uint8)) and \
            torch.equal(wq.scale_inv, ref.scale_inv)
    return out


def expected_gather_bytes(policy: FSDPPolicy, world: int) -> int:
    """One all-gather of every unit: FP8 weights 1 byte an element, the embedding (tied to a bf16 lm_head) 2,
    the norms 4, each over FSDP's padded shard (ceil(rows / world) rows a rank)."""
    fp8 = {id(m.weight) for m in fp8_linears(policy.decoder).values()}
    embedding = policy.decoder.model.embed_tokens.weight
    total = 0
    for p in policy.parameters():
        rows = -(-p.shape[0] // world)
        size = 1 if id(p) in fp8 else 2 if p is embedding else 4
        total += world * rows * (p[0].numel() if p.dim() > 1 else 1) * size
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    cfg = load_config(None, ["precision.mode=unified", "precision.gemm_backend=emulate"])
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, hidden_size=192, intermediate_size=512, num_layers=2,
                         num_heads=3, num_kv_heads=1, head_dim=64, tie_word_embeddings=True)
    decoder = apply_mode(Decoder(config), derive(cfg).precision, "trainer")
    reference = copy.deepcopy(decoder)
    # the same weights sharded from rank 0 alone: the other ranks build a meta-device shell (build_policy_shell)
    if dist.get_rank() == 0:
        source = copy.deepcopy(decoder)
    else:
        with torch.device("meta"):
            source = apply_mode(Decoder(config), derive(cfg).precision, "trainer")
    policy = FSDPPolicy(decoder)
    result = {"wrapped": policy.low_precision_gathered, "world": world}
    from_rank0 = FSDPPolicy(source)
    shards = dict(from_rank0.decoder.named_parameters())
    result["from_rank0_equal"] = {
        name: type(p.to_local()) is type(shards[name].to_local())
        and torch.equal(plain(p.to_local()), plain(shards[name].to_local()))
        for name, p in policy.decoder.named_parameters()}
    result["from_rank0_tied"] = from_rank0.decoder.lm_head.weight is from_rank0.decoder.model.embed_tokens.weight
    if dist.get_rank() == 1:
        torch.manual_seed(123)  # another state than rank 0's
    share_rng_state("cpu")
    states = [None] * world
    dist.all_gather_object(states, torch.get_rng_state())
    result["rng_shared"] = all(torch.equal(states[0], s) for s in states)

    with counted_all_gathers() as seen:
        result["bytes_equal"] = bytes_equal(policy, cfg.precision.recipe())
    result["gathered_bytes"], result["expected_fp8_bytes"] = seen["bytes"], expected_gather_bytes(policy, world)
    result["fp32_bytes"] = sum(world * -(-p.shape[0] // world) * (p[0].numel() if p.dim() > 1 else 1) * 4
                               for p in policy.parameters())

    ids = torch.randint(0, 64, (2, 9))
    policy.lm_head(policy.forward_hidden(ids)).float().logsumexp(-1).mean().backward()
    reference.lm_head(reference.forward_hidden(ids)).float().logsumexp(-1).mean().backward()
    grads = dict(reference.named_parameters())
    result["grads_equal"] = {name: torch.equal(p.grad.full_tensor(), world * grads[name].grad)
                             for name, p in policy.decoder.named_parameters()}
    torch.optim.AdamW(policy.parameters(), lr=1e-2).step()
    result["bytes_equal_after_step"] = bytes_equal(policy, cfg.precision.recipe())
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from jetflow.distributed import exit_process
    exit_process(0)  # skip the distributed runtime's interpreter teardown (see exit_process)
