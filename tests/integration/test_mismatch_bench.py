"""The project's central claim on the tiny model: mixed is off-policy, unified is not (with and without FP8 KV)."""

from pathlib import Path

import pytest

from jetflow.bench import mismatch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_mixed_kl_is_orders_above_unified(tmp_path, kv_fp8):
    out = mismatch.run(str(ROOT / "configs/tiny.yaml"),
                       ("run.num_threads=1", f"precision.kv_cache_fp8={str(kv_fp8).lower()}"),
                       num_prompts=4, group_size=4, out_dir=str(tmp_path), name="m")
    kl = {r["mode"]: r["kl_k3"] for r in out["rows"]}
    assert kl["mixed"] > 10 * kl["bf16"] or kl["mixed"] > 1e-5, kl
    assert kl["unified"] < 1e-8, kl
    assert out["summary"]["kl_mixed_over_unified"] > 1e3
    assert (tmp_path / "m.json").exists() and (tmp_path / "m.md").exists()
