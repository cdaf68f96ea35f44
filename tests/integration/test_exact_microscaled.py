"""Exact on-policy under the mxfp8 and nvfp4 recipes (issue 28): with `precision.numerics=exact` and
`unified`, the rollout engine's log-probs of its sampled tokens equal the trainer's bit for bit
(`torch.equal`), the rollout computing with the trainer's shipped bytes and scales; `mixed` (bf16
trainer, the recipe's rollout: the 4-bit rollout under nvfp4) keeps a mismatch. Same path and checks
as tests/integration/test_exact_on_policy.py (the fp8_block recipe's)."""

from __future__ import annotations

import pytest
import torch

from jetflow.bench.mismatch import paired_logprobs
from test_exact_on_policy import (assert_exact, generate_alone_and_batched, mixed_length_prompts, prompt_encoder,
                                  setup, tiny)


def tiny_family(family: str, mode: str, kv_fp8: bool = False):
    cfg, model, tok, task = tiny(mode, kv_fp8)
    cfg.precision.family = family
    cfg.precision.recipe()  # the family's recipe builds (validation ran on the config before the family)
    return cfg, model, tok, task


@pytest.mark.parametrize("family,kv_fp8", [("mxfp8", False), ("nvfp4", False), ("nvfp4", True)])
def test_tiny_unified_rollout_logprobs_equal_trainer_bit_for_bit(family, kv_fp8):
    cfg, model, tok, task = tiny_family(family, "unified", kv_fp8)
    assert_exact(cfg, model, tok, task, mixed_length_prompts(tok, 16, 3, 60), new_tokens=512)


@pytest.mark.parametrize("family", ["mxfp8", "nvfp4"])
def test_tiny_mixed_keeps_its_mismatch(family):
    cfg, model, tok, task = tiny_family(family, "mixed")
    cfg.rollout.max_new_tokens = 64
    exp, trainer_lp, _ = paired_logprobs(cfg, model, tok, task, mixed_length_prompts(tok, 8, 3, 30), ignore_eos=True)
    mask = exp.response_mask > 0
    assert (exp.rollout_logprobs[mask] - trainer_lp[mask]).abs().max() > 0  # bf16 trainer vs the recipe's rollout


def test_tiny_nvfp4_sequence_alone_equals_inside_the_batch():
    """NVFP4's activation tensor scale is per token row: a sequence decoded alone gets the bytes it gets
    inside a batch of 16 (a per-tensor amax would tie them to the batch)."""
    cfg, model, tok, task = tiny_family("nvfp4", "unified")
    generate_alone_and_batched(cfg, model, tok, mixed_length_prompts(tok, 16, 3, 60), 128, pick=[0, 15])


@pytest.mark.slow
@pytest.mark.long  # 30-45 s each on 2 cores: the tiny cases above make the claim in the default suite
@pytest.mark.parametrize("family", ["mxfp8", "nvfp4"])
def test_smollm2_unified_exact_short(smollm2_dir, family):
    """The real model (576 = 18 x 32 = 36 x 16 wide): 4 sequences x 48 new tokens, unified."""
    cfg, model, tok, task = setup(None, [f"model.path={smollm2_dir}", "precision.mode=unified",
                                         f"precision.family={family}", "precision.numerics=exact"])
    encode = prompt_encoder(cfg, tok, task)
    prompts = [encode(p) for p in task.problems(0, 4, 0)]
    prompts = [p + p[-(i * 5):] if i else p for i, p in enumerate(prompts)]
    exp = assert_exact(cfg, model, tok, task, prompts, new_tokens=48)
    assert bool(torch.isfinite(exp.rollout_logprobs).all())
