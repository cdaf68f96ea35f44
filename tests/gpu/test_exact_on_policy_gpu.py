"""Exact on-policy on the GPU: with precision.numerics=exact on CUDA (jetflow's Triton kernels), the
rollout engine's log-probs of its sampled tokens equal the trainer's full-forward log-probs bit for
bit, for a random-init model (tests/integration/test_exact_on_policy.py is the CPU twin).

The model is the tiny arithmetic config widened to 4 layers of 256 (head dim 64), random init, built
on the GPU. Prompts of mixed lengths; 16 sequences (the decode batch shrinks to none as they finish,
so small-M decode rows are compared too), and 3 sequences alone. The config is loaded for the CPU and
moved to CUDA afterwards: config validation refuses exact numerics off the CPU until config.py knows
about the Triton kernels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("triton")
pytest.importorskip("omegaconf")

from jetflow.bench.mismatch import paired_logprobs  # noqa: E402
from jetflow.config import load_config  # noqa: E402
from jetflow.run.build import build_policy, build_task  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def setup(mode: str, kv_fp8: bool = False):
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), [
        f"precision.mode={mode}", "precision.numerics=exact", f"precision.kv_cache_fp8={str(kv_fp8).lower()}",
        "model.tiny.hidden_size=256", "model.tiny.num_layers=4", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
        "model.tiny.intermediate_size=768", "model.tiny.max_position=600", "rollout.temperature=1.0"])
    cfg.model.device = "cuda"  # after validation (see the module docstring)
    task = build_task(cfg)
    model, tok = build_policy(cfg)
    return cfg, model, tok, task


def prompts(tok, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    special = {tok.pad_token_id, tok.eos_token_id, getattr(tok, "bos_token_id", None)}
    vocab = [i for i in range(tok.vocab_size) if i not in special]
    lengths = torch.linspace(lo, hi, n).round().long().tolist()
    return [[vocab[j] for j in torch.randint(len(vocab), (L,), generator=gen).tolist()] for L in lengths]


@pytest.mark.parametrize("mode,kv_fp8,n", [("bf16", False, 16), ("unified", False, 16), ("unified", True, 16),
                                           ("fp32", False, 16), ("unified", False, 3)])
def test_rollout_logprobs_equal_trainer_logprobs_on_gpu(mode, kv_fp8, n):
    cfg, model, tok, task = setup(mode, kv_fp8)
    cfg.rollout.max_new_tokens = 256
    exp, trainer_lp, timings = paired_logprobs(cfg, model, tok, task, prompts(tok, n, 3, 60), micro_batch=16,
                                               ignore_eos=True)
    mask = exp.response_mask > 0
    rollout_lp, trainer_lp = exp.rollout_logprobs[mask].cpu(), trainer_lp[mask].cpu()
    assert rollout_lp.numel() == n * 256
    differ = int((rollout_lp != trainer_lp).sum())
    print(f"{mode} kv_fp8={kv_fp8} n={n}: {differ} of {rollout_lp.numel()} log-probs differ, max |dlogp| "
          f"{(rollout_lp - trainer_lp).abs().max().item():.3g}; rollout {timings['rollout_s']:.2f} s, "
          f"trainer {timings['trainer_s']:.2f} s")
    assert torch.equal(rollout_lp, trainer_lp)
