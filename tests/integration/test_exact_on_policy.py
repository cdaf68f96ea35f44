"""Exact on-policy: under exact numerics the rollout engine's log-probs of its sampled tokens equal the
trainer's full-forward log-probs bit for bit (`torch.equal`), in fp32, bf16 and unified (with and
without the FP8 KV cache), for a batch of mixed prompt lengths decoded with a KV cache; a sequence
generated alone gives the same tokens and log-probs as inside the batch; mixed keeps its mismatch.
The path is the mismatch benchmark's (jetflow.bench.mismatch.paired_logprobs): trainer and rollout
built as in a run, weights through jetflow.sync.

Tiny model: 16 sequences x 512 new tokens (fast suite). SmolLM2-135M: a short check in the default
suite (slow) and the full 16 x 512 matrix under `-m long` (minutes; results/exact-on-policy/)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from jetflow.bench.mismatch import paired_logprobs
from jetflow.config import derive, load_config
from jetflow.run.loop import request_seed
from jetflow.run.build import (apply_mode, attach_kv_fp8, build_policy, build_task, copy_model, prompt_encoder)
from jetflow.rollout import RolloutEngine, SamplingParams
from jetflow.sync import apply_update, build_update

ROOT = Path(__file__).resolve().parents[2]
CASES = [("fp32", False), ("bf16", False), ("unified", False), ("unified", True)]


def setup(config: str | None, overrides: list[str]):
    cfg = load_config(config, overrides)
    task = build_task(cfg)
    model, tok = build_policy(cfg)
    return cfg, model, tok, task


def mixed_length_prompts(tok, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """n prompts of lengths spread over [lo, hi], random real tokens (no pad / eos)."""
    gen = torch.Generator().manual_seed(seed)
    special = {tok.pad_token_id, tok.eos_token_id, getattr(tok, "bos_token_id", None)}
    vocab = [i for i in range(min(tok.vocab_size, 5000)) if i not in special]
    lengths = torch.linspace(lo, hi, n).round().long().tolist()
    return [[vocab[j] for j in torch.randint(len(vocab), (L,), generator=gen).tolist()] for L in lengths]


def assert_exact(cfg, model, tok, task, prompts, new_tokens: int):
    cfg.rollout.max_new_tokens = new_tokens
    exp, trainer_lp, _ = paired_logprobs(cfg, model, tok, task, prompts, micro_batch=16, ignore_eos=True)
    mask = exp.response_mask > 0
    assert int(mask.sum()) == len(prompts) * new_tokens
    rollout_lp, trainer_lp = exp.rollout_logprobs[mask], trainer_lp[mask]
    assert torch.equal(rollout_lp, trainer_lp), (
        f"{cfg.precision.mode}: {int((rollout_lp != trainer_lp).sum())} of {rollout_lp.numel()} log-probs differ, "
        f"max |dlogp| {(rollout_lp - trainer_lp).abs().max().item():.3g}")
    return exp


def tiny(mode: str, kv_fp8: bool, numerics: str = "exact"):
    return setup(str(ROOT / "configs/tiny.yaml"), [
        f"precision.mode={mode}", f"precision.kv_cache_fp8={str(kv_fp8).lower()}", f"precision.numerics={numerics}",
        "model.tiny.max_position=600", "rollout.temperature=1.0"])


@pytest.mark.parametrize("mode,kv_fp8", CASES)
def test_tiny_rollout_logprobs_equal_trainer_bit_for_bit(mode, kv_fp8):
    cfg, model, tok, task = tiny(mode, kv_fp8)
    assert_exact(cfg, model, tok, task, mixed_length_prompts(tok, 16, 3, 60), new_tokens=512)


def test_tiny_mixed_keeps_its_mismatch():
    cfg, model, tok, task = tiny("mixed", False)
    cfg.rollout.max_new_tokens = 64
    exp, trainer_lp, _ = paired_logprobs(cfg, model, tok, task, mixed_length_prompts(tok, 8, 3, 30), ignore_eos=True)
    mask = exp.response_mask > 0
    assert not torch.equal(exp.rollout_logprobs[mask], trainer_lp[mask])  # bf16 trainer vs FP8 rollout


def test_tiny_fast_numerics_are_not_exact():
    """The switch matters: torch's kernels (fast) differ in the last bits on this workload."""
    cfg, model, tok, task = tiny("unified", False, numerics="fast")
    cfg.rollout.max_new_tokens = 64
    exp, trainer_lp, _ = paired_logprobs(cfg, model, tok, task, mixed_length_prompts(tok, 16, 3, 60), ignore_eos=True)
    mask = exp.response_mask > 0
    assert not torch.equal(exp.rollout_logprobs[mask], trainer_lp[mask])


def generate_alone_and_batched(cfg, model, tok, prompts, new_tokens: int, pick: list[int]):
    """Tokens and log-probs of each picked prompt generated inside the whole batch and alone (one seed
    per request, as vLLM's per-request seed)."""
    derived = derive(cfg)
    trainer = apply_mode(copy_model(model), derived.precision, "trainer")
    rollout_model = apply_mode(copy_model(model), derived.precision, "rollout")
    kv = attach_kv_fp8(rollout_model, derived.precision, "rollout")
    scales = None if kv is None else {"k_scale": torch.full((model.config.num_layers,), 0.05),
                                      "v_scale": torch.full((model.config.num_layers,), 0.05)}
    fingerprint = derived.precision.fingerprint
    apply_update(rollout_model, build_update(trainer, cfg.precision.mode, 0, fingerprint, kv_scales=scales), -1,
                 fingerprint)
    engine = RolloutEngine(rollout_model, eos_token_ids=[], pad_token_id=tok.pad_token_id, max_batch=16,
                           max_seq_len=max(map(len, prompts)) + new_tokens + 1)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    seeds = [request_seed(cfg.run.seed, 0, i) for i in range(len(prompts))]
    batched = engine.generate(prompts, params, seeds)
    for i in pick:
        alone = engine.generate([prompts[i]], params, [seeds[i]])
        assert alone.token_ids[0] == batched.token_ids[i], f"request {i}: tokens differ alone vs in the batch"
        assert alone.logprobs[0] == batched.logprobs[i], f"request {i}: log-probs differ alone vs in the batch"


@pytest.mark.parametrize("mode,kv_fp8", [("unified", False), ("unified", True), ("bf16", False)])
def test_tiny_sequence_alone_equals_inside_the_batch(mode, kv_fp8):
    cfg, model, tok, task = tiny(mode, kv_fp8)
    generate_alone_and_batched(cfg, model, tok, mixed_length_prompts(tok, 16, 3, 60), 512, pick=[0, 7, 15])


@pytest.mark.slow
@pytest.mark.parametrize("kv_fp8", [False, pytest.param(True, marks=pytest.mark.long)])  # the default run's path;
def test_smollm2_unified_exact_short(smollm2_dir, kv_fp8):  # the FP8 KV cache's in the tiny cases (20 s each)
    """A short real-model check in the default suite: 4 sequences x 48 new tokens, unified."""
    cfg, model, tok, task = setup(None, [f"model.path={smollm2_dir}", "precision.mode=unified",
                                         f"precision.kv_cache_fp8={str(kv_fp8).lower()}", "precision.numerics=exact"])
    encode = prompt_encoder(cfg, tok, task)
    prompts = [encode(p) for p in task.problems(0, 4, 0)]
    prompts = [p + p[-(i * 5):] if i else p for i, p in enumerate(prompts)]  # lengths spread by up to 15 tokens
    assert_exact(cfg, model, tok, task, prompts, new_tokens=48)


def smollm2_countdown(smollm2_dir, mode: str, kv_fp8: bool):
    """SmolLM2 in `mode` (exact numerics) and 16 countdown prompts whose lengths spread by up to 45 tokens."""
    cfg, model, tok, task = setup(None, [f"model.path={smollm2_dir}", f"precision.mode={mode}",
                                         f"precision.kv_cache_fp8={str(kv_fp8).lower()}", "precision.numerics=exact",
                                         "task.name=countdown"])
    encode = prompt_encoder(cfg, tok, task)
    base = [encode(p) for p in task.problems(0, 16, 0)]
    return cfg, model, tok, task, [p + p[-(i * 3):] if i else p for i, p in enumerate(base)]


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("mode,kv_fp8", CASES)
def test_smollm2_rollout_logprobs_equal_trainer_bit_for_bit(smollm2_dir, mode, kv_fp8):
    """The full matrix on the real model: 16 sequences of mixed prompt lengths x 512 new tokens."""
    cfg, model, tok, task, prompts = smollm2_countdown(smollm2_dir, mode, kv_fp8)
    assert_exact(cfg, model, tok, task, prompts, new_tokens=512)


@pytest.mark.slow
@pytest.mark.long
def test_smollm2_sequence_alone_equals_inside_the_batch(smollm2_dir):
    cfg, model, tok, task, prompts = smollm2_countdown(smollm2_dir, "unified", False)
    generate_alone_and_batched(copy.deepcopy(cfg), model, tok, prompts, 512, pick=[0, 9])
