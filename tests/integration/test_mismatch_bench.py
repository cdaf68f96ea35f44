"""The project's central claim on the tiny model, through `jetflow bench mismatch`: mixed is off-policy,
unified is not (with and without FP8 KV): under exact numerics (auto on the CPU) bf16 and unified
rollout log-probs equal the trainer's exactly, and mixed / unified is infinite."""

from pathlib import Path

import pytest

from jetflow.bench import mismatch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_mixed_kl_is_orders_above_unified(tmp_path, kv_fp8):
    out = mismatch.run(str(ROOT / "configs/tiny.yaml"),
                       ("run.num_threads=1", f"precision.kv_cache_fp8={str(kv_fp8).lower()}"),
                       num_prompts=4, group_size=4, out_dir=str(tmp_path), name="m")
    rows = {r["mode"]: r for r in out["rows"]}
    assert rows["unified"]["numerics"] == "exact"
    # with the FP8 KV cache only unified's trainer applies the cache's quantization; bf16's observes it
    for mode in ("unified",) if kv_fp8 else ("bf16", "unified"):
        assert rows[mode]["kl_k3"] == 0.0 and rows[mode]["abs_delta_max"] == 0.0 and rows[mode]["equal_frac"] == 1.0
    assert rows["mixed"]["kl_k3"] > 0 and rows["mixed"]["equal_frac"] < 1.0
    assert out["summary"]["kl_mixed_over_unified"] == "inf"
    assert (tmp_path / "m.json").exists() and (tmp_path / "m.md").exists()
