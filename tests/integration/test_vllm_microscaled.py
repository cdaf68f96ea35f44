"""vLLM with jetflow's exact plugin under the mxfp8 and nvfp4 recipes (issue 28): each vLLM linear is
computed by the policy's PrecisionLinear, so the recipe's exact linear runs inside vLLM with the
trainer's shipped bytes and scales, and the rollout log-probs equal the trainer's bit for bit. Same
path as tests/integration/test_vllm_exact.py (jetflow.bench.mismatch.paired_logprobs with
rollout.backend=vllm); skipped where vLLM cannot be imported."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from jetflow.bench.mismatch import paired_logprobs
from jetflow.run import vllm_side
from test_exact_on_policy import assert_exact, mixed_length_prompts
from test_vllm_exact import tiny, vllm_importable  # noqa: F401  (the fixture)


@pytest.mark.parametrize("family", ["mxfp8", "nvfp4"])
def test_vllm_unified_rollout_logprobs_equal_trainer_bit_for_bit(family, capsys):
    cfg, model, tok, task = tiny("unified", False)
    cfg.precision.family = family
    assert_exact(cfg, model, tok, task, mixed_length_prompts(tok, 16, 3, 60), new_tokens=128)
    name = {"mxfp8": "MXFP8", "nvfp4": "NVFP4"}[family]
    captured = capsys.readouterr()
    assert f"{name} with jetflow's kernels" in captured.out + captured.err  # the engine's log line names the recipe


def test_vllm_mixed_nvfp4_rollout_keeps_its_mismatch(monkeypatch, tmp_path):
    """bf16 trainer, NVFP4 rollout inside vLLM (the rollout quantizes the synced bf16 weights itself);
    the engine's temporary model directory is gone when paired_logprobs returns."""
    cfg, model, tok, task = tiny("mixed", False)
    cfg.precision.family = "nvfp4"
    cfg.rollout.max_new_tokens = 32
    engine_dirs = []
    build = vllm_side.build_vllm_rollout

    def recording_build(*args, **kwargs):
        engine_dirs.append(Path(args[-1]))  # engine_dir, the last positional argument
        return build(*args, **kwargs)

    monkeypatch.setattr(vllm_side, "build_vllm_rollout", recording_build)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    exp, trainer_lp, _ = paired_logprobs(cfg, model, tok, task, mixed_length_prompts(tok, 8, 3, 30), ignore_eos=True)
    mask = exp.response_mask > 0
    assert (exp.rollout_logprobs[mask] - trainer_lp[mask]).abs().max() > 0
    assert len(engine_dirs) == 1 and engine_dirs[0].parent == tmp_path and not engine_dirs[0].exists()
