"""The run's precision, resolved once (jetflow.precision.plan.Precision, issue 43): what each mode means
for each side, `auto` numerics, and the config's derive handing it down."""

from __future__ import annotations

import dataclasses

import pytest

from jetflow.config import derive, load_config
from jetflow.precision.plan import Precision
from jetflow.precision.recipe import QuantRecipe

# mode -> (trainer kind, rollout kind, trainer quantizes, rollout quantizes, fingerprint carried, off-policy)
MODES = {
    "fp32": ("fp32", "fp32", False, False, False, False),
    "bf16": ("bf16", "bf16", False, False, False, False),
    "mixed": ("bf16", "fp8", False, True, True, True),
    "unified": ("fp8", "fp8", True, True, True, False),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_mode_answers_the_sides_questions(mode):
    recipe = QuantRecipe(family="mxfp8")
    p = Precision.resolve(mode, recipe, "fast")
    trainer, rollout, tq, rq, carried, off = MODES[mode]
    assert (p.linear_kind("trainer"), p.linear_kind("rollout")) == (trainer, rollout)
    assert (p.trainer_quantizes, p.rollout_quantizes, p.off_policy_by_design) == (tq, rq, off)
    assert p.fingerprint == (recipe.fingerprint() if carried else None)
    assert p.shipped_recipe is (recipe if carried else None)
    assert p.quantizes_kv("rollout") and p.quantizes_kv("trainer") == tq


def test_auto_numerics_is_exact_on_the_cpu_and_fast_where_the_kernels_cannot_run():
    assert Precision.resolve("unified", QuantRecipe(), "auto", device="cpu").is_exact
    meta = Precision.resolve("unified", QuantRecipe(), "auto", device="meta")
    assert meta.numerics == "fast" and "model.device=meta" in meta.exact_blocker
    # a Megatron TP=2 that cannot split a row-parallel K of 96 (one 96-wide canonical group)
    split = Precision.resolve("bf16", QuantRecipe(), "auto", row_parallel_ks=(256, 96), tensor_parallel_size=2)
    assert split.numerics == "fast" and "row-parallel K of 96" in split.exact_blocker
    assert Precision.resolve("bf16", QuantRecipe(), "fast").numerics == "fast"  # asked for by name


def test_it_is_immutable_and_refuses_numerics_outside_the_vocabulary():
    p = Precision.resolve("mixed", QuantRecipe())
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.numerics = "fast"  # type: ignore[misc]
    with pytest.raises(ValueError, match="numerics='auto'"):
        Precision(p.mode, p.recipe, "auto")


def test_derive_hands_down_the_configs_precision_and_correction():
    cfg = load_config("configs/tiny.yaml", ["precision.mode=mixed", "precision.family=nvfp4", "precision.kv_cache_fp8=true",
                                            "precision.gemm_backend=emulate"])
    d = derive(cfg)
    assert d.precision.recipe == cfg.precision.recipe() and d.precision.recipe.family == "nvfp4"
    assert (d.precision.mode.value, d.precision.gemm_backend, d.precision.kv_cache_fp8) == ("mixed", "emulate", True)
    assert d.correction == "token_tis"  # auto under mixed
    assert derive(load_config("configs/tiny.yaml", ["precision.mode=unified"])).correction == "none"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_model_reports_the_kind_and_recipe_its_linears_run(mode):
    """What an FSDPPolicy reports to export (the ShardedPolicy's kind / recipe): its linears' own state."""
    from jetflow.model import Decoder, ModelConfig
    from jetflow.precision.linear import linear_precision
    from jetflow.run.build import apply_mode

    precision = Precision.resolve(mode, QuantRecipe(), "fast")
    model = apply_mode(Decoder(ModelConfig(vocab_size=32, hidden_size=128, intermediate_size=128, num_layers=2,
                                           num_heads=2, num_kv_heads=1, head_dim=64)), precision, "trainer")
    expected = precision.recipe if precision.trainer_quantizes else None
    assert linear_precision(model) == (precision.trainer_kind, expected)
