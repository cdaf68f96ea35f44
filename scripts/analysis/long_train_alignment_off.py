"""The packed vs padded gradients of tests/unit/test_sequence_packing.py's train step with the weight
gradients' token order kept (invariant.weight_grad) and the head fed real positions only, but the 128-token
alignment of sequences turned off: how many parameter gradients differ, and by how much of the norm.
(Written for the pack-bitwise branch; adapted to branch pack2's grid: `Decoder.use_grad_block(128)` for the
ordered weight gradients, then `grad_block = 1` for no alignment, the head's real-positions path forced on.)

    PYTHONPATH=. python scripts/analysis/long_train_alignment_off.py fp32|bf16|unified
"""

import sys
from pathlib import Path

import torch

import jetflow.train.packing as packing
import jetflow.train.trainer as trainer_module

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "unit"))
import test_sequence_packing as tsp  # noqa: E402


def ordered_without_alignment(model) -> None:
    model.use_grad_block(128)  # every exact weight gradient in weight_grad's order ...
    model.grad_block = 1  # ... but no sequence padded to a block multiple, packed or padded


if __name__ == "__main__":
    tsp.use_packing_grid = trainer_module.use_packing_grid = ordered_without_alignment
    trainer_module.on_grid = lambda model: True  # the head sees real positions only on both paths
    model, cfg = tsp.model_for(sys.argv[1])
    exp = tsp.batch(model.config.vocab_size)
    _, g_ref, _ = tsp.step(model, cfg, exp, 0, grid=True)  # micro-batches [0, 1], [2, 3], [4]
    _, g, t = tsp.step(model, cfg, exp, 100)  # the same rows packed (44 + 10, 72 + 21, 25 tokens)
    assert len(packing.micro_batches(exp, t.cfg, t.model)) == 3
    differ = [n for n in g_ref if not torch.equal(g[n], g_ref[n])]
    ref = torch.cat([v.flatten() for v in g_ref.values()])
    got = torch.cat([g[n].flatten() for n in g_ref])
    print(f"{sys.argv[1]}: {len(differ)} of {len(g_ref)} gradients differ; |g - g_ref| / |g_ref| = "
          f"{float((got - ref).norm() / ref.norm()):.1e}")
