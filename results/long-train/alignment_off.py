"""The packed vs padded gradients of tests/unit/test_sequence_packing.py's train step with the weight
gradients' token order kept (invariant.weight_grad) but the 128-token alignment of sequences turned off:
how many parameter gradients differ, and by how much of the norm.

    PYTHONPATH=. python results/long-train/alignment_off.py fp32|bf16|unified
"""

import sys

import torch

import jetflow.model.decoder as decoder
import jetflow.train.packing as packing

sys.path.insert(0, "tests/unit")
from test_sequence_packing import batch, model_for, step  # noqa: E402

if __name__ == "__main__":
    packing.GRAD_BLOCK = decoder.GRAD_BLOCK = 1  # no padding to a block multiple, packed or padded
    model, cfg = model_for(sys.argv[1])
    exp = batch(model.config.vocab_size)
    _, g_ref, _ = step(model, cfg, exp, 0)  # micro-batches [0, 1], [2, 3], [4]
    _, g, t = step(model, cfg, exp, 100)  # the same rows packed (44 + 10, 72 + 21, 25 tokens)
    assert len(packing.micro_batches(exp, t.cfg, t.model)) == 3
    differ = [n for n in g_ref if not torch.equal(g[n], g_ref[n])]
    ref = torch.cat([v.flatten() for v in g_ref.values()])
    got = torch.cat([g[n].flatten() for n in g_ref])
    print(f"{sys.argv[1]}: {len(differ)} of {len(g_ref)} gradients differ; |g - g_ref| / |g_ref| = "
          f"{float((got - ref).norm() / ref.norm()):.1e}")
