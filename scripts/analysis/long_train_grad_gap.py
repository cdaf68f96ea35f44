"""The packed step (on packing's grid) against the default padded step (off it) and the aligned padded step,
tiny model, the test's batch: the gradient gap and how many gradients differ, per mode.

    PYTHONPATH=. python scripts/analysis/long_train_grad_gap.py      # from the repository root
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "unit"))
from test_sequence_packing import model_for, batch, step, flat
for mode in ["fp32", "bf16", "unified"]:
    model, cfg = model_for(mode)
    exp = batch(model.config.vocab_size)
    padded, g_ref, _ = step(model, cfg, exp, 0)
    packed, g, _ = step(model, cfg, exp, 256)
    grid, g_grid, _ = step(model, cfg, exp, 0, grid=True)
    ref = flat(g_ref.values())
    gap = float((flat(g.values()) - ref).norm() / ref.norm())
    differ = sum(not __import__("torch").equal(g[n], g_ref[n]) for n in g_ref)
    gridgap = float((flat(g_grid.values()) - ref).norm() / ref.norm())
    print(mode, "packed vs default padded: rel gap", gap, f"{differ}/{len(g_ref)} grads differ;",
          "aligned padded vs default padded:", gridgap, "loss", packed["train/loss"] == padded["train/loss"])
