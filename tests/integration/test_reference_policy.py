"""The reference policy of a KL penalty on the tiny model: built in the trainer's precision (under unified
its FP8 bytes only), equal to the trainer bit for bit before the first update, frozen after it, kept in
the run directory for a resume, and a tiny run with kl_coef > 0 whose rollout still equals its trainer."""

from pathlib import Path

import pytest
import torch

from jetflow.config import load_config
from jetflow.metrics_log import read_metrics
from jetflow.precision.linear import PrecisionLinear
from jetflow.rl.experience import pack_experience
from jetflow.run.runner import train
from jetflow.run.build import load_inputs
from jetflow.run.sides import REFERENCE_FILE, TrainerSide, build_reference
from jetflow.run.validate import check_config

ROOT = Path(__file__).resolve().parents[2]
FAST = ["train.sft_warmup_steps=3", "train.prompts_per_step=4", "rollout.group_size=4", "run.progress=false",
        "run.tensorboard=false", "run.num_threads=1", "eval.num_prompts=0"]


def _cfg(tmp_path, *overrides):
    return load_config(ROOT / "configs/tiny.yaml", [f"run.out_dir={tmp_path}", *FAST, *overrides])


def _batch(side: TrainerSide):
    problems = side.task.problems(0, 4, 0)
    prompts = [side.encode(p) for p in problems]
    responses = [list(p[-3:]) for p in prompts]  # any tokens: the two policies score the same ones
    zeros = torch.zeros(len(prompts))
    return pack_experience(prompts, responses, [[0.0] * len(r) for r in responses], zeros, zeros,
                           side.tokenizer.pad_token_id)


def _first_update(side: TrainerSide):
    """The reference's log-probs equal the trainer's before any update; then one update with them.
    Returns (the batch, the reference's log-probs, the update's metrics)."""
    trainer, exp = side.trainer, _batch(side)
    ref = trainer.compute_logprobs(exp, reference=True)
    assert torch.equal(ref, trainer.compute_logprobs(exp))
    exp.old_logprobs = trainer.compute_logprobs(exp)
    exp.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    exp.ref_logprobs = ref
    return exp, ref, trainer.train_step(exp)


@pytest.mark.parametrize("mode", ["unified", "bf16"])
def test_the_reference_equals_the_trainer_bit_for_bit_until_the_first_update_and_stays_frozen(tmp_path, mode):
    cfg = _cfg(tmp_path, f"precision.mode={mode}", "algo.kl_coef=0.05")
    side = TrainerSide(cfg, check_config(cfg), load_inputs(cfg))
    side.rl_loop(tmp_path)
    reference, trainer = side.trainer.reference, side.trainer
    fp8 = [m for m in reference.modules() if isinstance(m, PrecisionLinear) and m.kind == "fp8"]
    if mode == "unified":  # the FP8 bytes only: each weight a one-element zero-stride placeholder
        assert fp8 and all(m.weight.untyped_storage().nbytes() == m.weight.element_size() for m in fp8)
        assert all(m._loaded is not None for m in fp8)
    else:
        assert not fp8
    assert not any(p.requires_grad for p in reference.parameters())
    exp, ref, _ = _first_update(side)  # the policy moves, the reference does not
    assert not torch.equal(trainer.compute_logprobs(exp), ref)
    assert torch.equal(trainer.compute_logprobs(exp, reference=True), ref)

    # a resumed run gets the reference of reference.pt back, not the trainer's current weights
    assert (tmp_path / REFERENCE_FILE).is_file()
    again = build_reference(cfg, side.derived, side.model, tmp_path)
    side.trainer.reference = again
    assert torch.equal(trainer.compute_logprobs(exp, reference=True), ref)


def test_a_tiny_unified_run_with_a_kl_penalty_keeps_the_rollout_equal_to_the_trainer(tmp_path):
    run = train(_cfg(tmp_path, "run.name=kl", "train.steps=3", "train.sft_warmup_steps=5", "algo.kl_coef=0.05"))
    rows = read_metrics(run)
    assert len(rows) == 3
    assert all(r["mismatch/equal_frac"] == 1.0 and r["mismatch/kl_k3"] == 0.0 for r in rows)
    assert rows[0]["kl/ref"] == 0.0  # the reference is the policy RL starts from
    assert rows[-1]["kl/ref"] > 0.0 and rows[-1]["loss/kl"] > 0.0
    assert all(r["ref/bytes"] > 0 and r["time/ref_logprobs"] > 0 for r in rows)
    assert (run / REFERENCE_FILE).is_file()


@pytest.fixture
def megatron_world():
    """Megatron in this process (a gloo world of size 1), torn down after the test so that other test
    files start clean."""
    pytest.importorskip("megatron.core", reason="Megatron-Core is not installed (pip install -e '.[megatron]')")
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_on_megatron_the_reference_is_a_frozen_policy_of_fp8_bytes_equal_to_the_trainer_until_the_update(
        tmp_path, megatron_world):
    """train.backend=megatron, unified, exact numerics, one process: the reference is a second
    MegatronPolicy whose all-FP8 parallel linears keep only their bytes; its log-probs equal the
    trainer's bit for bit before the first update; after it the policy moves and the reference does not;
    reference.pt gives the same reference back."""
    from jetflow.train.megatron import MegatronPolicy
    from jetflow.train.reference import FreezableLinear, reference_nbytes

    cfg = _cfg(tmp_path, "precision.mode=unified", "train.backend=megatron", "algo.kl_coef=0.05")
    side = TrainerSide(cfg, check_config(cfg), load_inputs(cfg))
    rng = torch.get_rng_state()
    side.trainer.reference = build_reference(cfg, side.derived, side.model, tmp_path)  # what rl_loop does
    assert torch.equal(torch.get_rng_state(), rng)  # building the reference leaves the run's RNG stream alone
    reference, trainer = side.trainer.reference, side.trainer
    assert isinstance(reference, MegatronPolicy) and reference is not side.model
    linears = [m for m in reference.modules() if isinstance(m, FreezableLinear)]
    fp8 = [m for m in linears if all(s.kind == "fp8" for s in m.segments)]
    assert len(fp8) == 4 * side.model.config.num_layers  # qkv, proj, fc1, fc2 of every layer
    assert all(m.weight.untyped_storage().nbytes() == m.weight.element_size() for m in fp8)  # placeholders
    assert not any(p.requires_grad for p in reference.parameters())
    assert reference_nbytes(reference) < reference_nbytes(side.model)

    exp, ref, metrics = _first_update(side)
    assert metrics["loss/kl"] == 0.0  # pi = pi_ref in this first update
    after = trainer.compute_logprobs(exp)
    assert not torch.equal(after, ref)
    assert torch.equal(trainer.compute_logprobs(exp, reference=True), ref)
    kl = (torch.exp(ref - after) - (ref - after) - 1)[exp.response_mask.bool()]  # k3, per token
    assert kl.mean() > 0

    again = build_reference(cfg, side.derived, side.model, tmp_path)  # a resume: from reference.pt
    assert isinstance(again, MegatronPolicy)
    side.trainer.reference = again
    assert torch.equal(trainer.compute_logprobs(exp, reference=True), ref)
