"""`jetflow audit` (jetflow.bench.audit): each linear and group of them in FP8 alone against the bf16 trainer.

- a linear whose FP8 scales are damaged (x1.5 on every block) ranks first among the linears, its layer first
  among the layers and its projection kind first among the kinds;
- nothing quantized is the bf16 trainer itself: KL 0, no flip, wgrad and dgrad equal (the probe's reference);
- the measures against hand-computed cases (KL of two distributions, relative error and cosine);
- the keep_* settings reach the target by keeping layers or projection kinds, and the CLI writes its files.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from jetflow.bench.audit import Probe, compare, module_groups, quantized_linears, run_audit, write_report
from jetflow.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DAMAGED = "model.layers.1.self_attn.v_proj"


def tiny_cfg(*overrides: str):
    return load_config(str(ROOT / "configs/tiny.yaml"), ["rollout.max_new_tokens=24", "run.num_threads=1", *overrides])


def damage(model, name: str, factor: float = 1.5) -> None:
    """The linear's FP8 weight with every block's scale multiplied by `factor` (its bytes as they are)."""
    linear = model.get_submodule(name)
    quantized_weight = linear.quantized_weight

    def damaged():
        wq = quantized_weight()
        return dataclasses.replace(wq, scale_inv=wq.scale_inv * factor, dequantized=None, packed=None, packed_t=None)
    linear.quantized_weight = damaged


def test_a_damaged_linear_ranks_first(monkeypatch):
    from jetflow.bench import audit as audit_module
    from jetflow.run.build import build_policy
    cfg = tiny_cfg()
    model, _ = build_policy(cfg)
    apply_mode = audit_module.apply_mode

    def apply_then_damage(m, precision, side):  # the audit converts the linears, then the damage is put on
        out = apply_mode(m, precision, side)
        damage(m, DAMAGED)
        return out
    monkeypatch.setattr(audit_module, "apply_mode", apply_then_damage)
    audit = run_audit(cfg, model, prompts=2, target_kl=1e-9)
    by_kind = {k: [e for e in audit["effects"] if e["kind"] == k] for k in ("linear", "layer", "projection")}
    assert by_kind["linear"][0]["group"] == DAMAGED
    assert by_kind["linear"][0]["kl"] > 3 * by_kind["linear"][1]["kl"]
    assert by_kind["layer"][0]["group"] == "layer 1" and by_kind["projection"][0]["group"] == "*v_proj*"
    assert by_kind["linear"][0]["wgrad_rel_err"] == max(e["wgrad_rel_err"] for e in by_kind["linear"])


def test_nothing_quantized_is_the_bf16_trainer_and_groups_cover_the_model():
    from jetflow.bench.audit import rollout_batch
    from jetflow.config import derive
    from jetflow.run.build import apply_mode, build_policy, load_inputs
    cfg = tiny_cfg()
    model, _ = build_policy(cfg)
    bf16 = load_config(str(ROOT / "configs/tiny.yaml"), ["precision.mode=bf16", "precision.numerics=fast"])
    apply_mode(model, derive(bf16).precision, "trainer")
    exp, advantages, _ = rollout_batch(cfg, model, load_inputs(cfg), 2)
    precision = derive(cfg).precision
    linears = quantized_linears(model, precision.recipe)
    assert len(linears) == 7 * cfg.model.tiny.num_layers  # q k v o gate up down; lm_head and embeddings stay bf16
    probe = Probe(model, exp, advantages, linears, precision.recipe, precision.gemm_backend, 1.0)
    none = probe.effect("none", "all", [])
    assert (none.kl, none.max_abs_dlogp, none.flip_frac, none.wgrad_rel_err, none.dgrad_rel_err) == (0, 0, 0, 0, 0)
    assert none.wgrad_cos == pytest.approx(1.0, abs=1e-12)
    every = probe.effect("all", "all", list(linears))
    assert every.kl > 0 and every.wgrad_rel_err > 0
    groups = module_groups(list(linears))
    assert [g for g, kind, _ in groups if kind == "layer"] == ["layer 0", "layer 1"]
    assert sorted(n for _, kind, names in groups if kind == "projection" for n in names) == sorted(linears)


def test_measures_against_hand_computed_cases():
    err, cos = compare([torch.tensor([3.0, 4.0])], [torch.tensor([3.0, 0.0])])
    assert err == pytest.approx(4 / 3) and cos == pytest.approx(9 / (5 * 3))
    # KL(p || q) of p = (1/2, 1/2), q = (1/4, 3/4) at one position, as the probe computes it from log-probs
    ref, got = torch.tensor([[[0.5, 0.5]]]).log(), torch.tensor([[[0.25, 0.75]]]).log()
    kl = float((ref.exp() * (ref - got)).sum(-1))
    assert kl == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3))


def test_the_keep_settings_reach_the_target_and_the_report_is_written(tmp_path):
    cfg = tiny_cfg()
    audit = run_audit(cfg, prompts=2, target_kl=1e-12, kinds=("layer", "projection"))
    keep = audit["keep"]
    assert keep["reached"] and keep["fp8_linears"] == 0  # only bf16 is within 1e-12: everything kept
    assert keep["overrides"][0].startswith("precision.keep_first_layers=")
    loose = run_audit(cfg, prompts=2, target_kl=1.0, kinds=("layer", "projection"))["keep"]
    assert loose["reached"] and loose["fp8_linears"] == loose["of"] and len(loose["trials"]) == 1
    text = write_report(audit, tmp_path)
    assert "## layer" in text and (tmp_path / "audit.png").stat().st_size > 0 and (tmp_path / "audit.json").is_file()


@pytest.mark.parametrize("args", [["--prompts", "0"], ["--target-kl", "0"]])
def test_a_batch_without_prompts_or_a_target_of_zero_is_one_line(args, capsys):
    from jetflow.cli import main
    assert main(["audit", "--model", "tiny", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "needs at least one prompt and the target a KL above 0" in err
