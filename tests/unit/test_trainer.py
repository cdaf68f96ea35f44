"""Trainer: log-probs against a plain full forward, LR schedule, NaN skipping, checkpoints."""

import math

import pytest
import torch

from jetflow.config import load_config
from jetflow.model import Decoder, ModelConfig
from jetflow.rl.experience import pack_experience
from jetflow.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from jetflow.train.trainer import Trainer, TrainingDiverged, lr_lambda, response_logprobs


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return Decoder(ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=16, tie_word_embeddings=False))


def batch():
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    responses = [[20, 21], [22, 23, 24], [25]]
    lps = [[-1.0] * len(r) for r in responses]
    return pack_experience(prompts, responses, lps, torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0, -1.0, 0.5]), 0)


def test_response_logprobs_equal_unpadded_full_forward():
    model, exp = tiny_model(), batch()
    got = response_logprobs(model, exp, temperature=0.7)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    responses = [[20, 21], [22, 23, 24], [25]]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = torch.tensor([p + r])
        logits = model(ids)[0, len(p) - 1:len(p) + len(r) - 1] / 0.7
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        torch.testing.assert_close(got[i, :len(r)], ref, atol=1e-5, rtol=1e-5)
    assert exp.response_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]


def test_train_step_logs_the_policy_entropy_of_the_response_tokens():
    """policy/entropy = mean over response tokens of -sum p log p of softmax(logits / T), computed by
    hand in float64 from a plain forward of each unpadded row (before the update)."""
    cfg = load_config(None, ["train.micro_batch_size=2"])
    model, exp = tiny_model(), batch()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    responses = [[20, 21], [22, 23, 24], [25]]
    entropies = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            logits = model(torch.tensor([p + r]))[0, len(p) - 1:len(p) + len(r) - 1].double() / 0.7
            probs = torch.softmax(logits, -1)
            entropies += (-(probs * probs.log()).sum(-1)).tolist()
    metrics, _ = Trainer(model, cfg.train, cfg.algo).train_step_on_policy(exp, 0.7, "none")
    assert metrics["policy/entropy"] == pytest.approx(sum(entropies) / len(entropies), rel=1e-5)


def test_lr_schedule_warmup_then_cosine():
    f = lr_lambda(warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [f(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def test_train_step_moves_logprobs_in_the_advantage_direction():
    cfg = load_config(None, ["train.lr=1e-2", "train.micro_batch_size=2"])
    model, exp = tiny_model(), batch()
    trainer = Trainer(model, cfg.train, cfg.algo)
    exp.old_logprobs = trainer.compute_logprobs(exp)
    before = exp.old_logprobs.clone()
    metrics = trainer.train_step(exp)
    after = trainer.compute_logprobs(exp)
    assert trainer.version == 1 and metrics["train/skipped"] == 0.0
    assert (after[0, :2] - before[0, :2]).sum() > 0  # positive advantage: more likely
    assert (after[1, :3] - before[1, :3]).sum() < 0  # negative advantage: less likely


@pytest.mark.parametrize("kind", ["fp32", "fp8"])
def test_nan_steps_are_skipped_then_stop_the_run(kind):
    """Under FP8 (unified) the NaN reaches a quantizer, which raised NonFiniteError out of backward
    and bypassed train.max_bad_steps."""
    from jetflow.precision import QuantRecipe
    from jetflow.precision.linear import apply_precision

    cfg = load_config(None, ["train.max_bad_steps=2"])
    model, exp = tiny_model(), batch()
    if kind == "fp8":
        apply_precision(model, "fp8", QuantRecipe(), gemm_backend="emulate", num_layers=2)
    trainer = Trainer(model, cfg.train, cfg.algo)
    exp.old_logprobs = trainer.compute_logprobs(exp)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    exp.advantages = torch.tensor([float("nan"), 1.0, 1.0])
    for _ in range(2):
        assert trainer.train_step(exp)["train/skipped"] == 1.0
    assert trainer.version == 0 and trainer.skipped_steps == 2
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    with pytest.raises(TrainingDiverged, match="max_bad_steps"):
        trainer.train_step(exp)


def test_checkpoint_round_trip_and_atomic_latest(tmp_path):
    cfg = load_config(None, [])
    model, exp = tiny_model(), batch()
    trainer = Trainer(model, cfg.train, cfg.algo)
    exp.old_logprobs = trainer.compute_logprobs(exp)
    trainer.train_step(exp)
    save_checkpoint(tmp_path, 1, model, trainer.state_dict(), {"next_step": 1})
    (tmp_path / "checkpoints" / ".tmp-step_000002").mkdir()  # a half-written checkpoint from a crash
    path = latest_checkpoint(tmp_path)
    assert path.name == "step_000001"
    other = tiny_model(seed=1)
    trainer2 = Trainer(other, cfg.train, cfg.algo)
    trainer_state, state = load_checkpoint(path, other)
    trainer2.load_state_dict(trainer_state)
    assert state["next_step"] == 1 and trainer2.version == 1
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), k
    assert not math.isnan(trainer2.optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("kind", ["fp32", "fp8"])
@pytest.mark.parametrize("correction", ["none", "token_tis", "seq_mis"])
def test_on_policy_step_equals_recompute_then_step(kind, correction):
    """pi_old taken from the training forward (one update per rollout) gives the log-probs, loss and
    weights of the separate no-grad forward followed by the step, also under FP8 (unified) GEMMs."""
    import copy

    from jetflow.precision import QuantRecipe
    from jetflow.precision.linear import apply_precision
    from jetflow.rl import apply_correction

    cfg = load_config(None, ["train.micro_batch_size=2"])
    model = tiny_model()
    if kind == "fp8":
        apply_precision(model, "fp8", QuantRecipe(), gemm_backend="emulate", num_layers=2)
    exp = batch()
    exp.rollout_logprobs = exp.rollout_logprobs * 3.0  # rollout far from the trainer: weights != 1
    params = {"lo": 0.01, "hi": 1e4} if correction == "seq_mis" else {}
    two_pass, fused = Trainer(model, cfg.train, cfg.algo), Trainer(copy.deepcopy(model), cfg.train, cfg.algo)

    exp.old_logprobs = two_pass.compute_logprobs(exp, temperature=0.9)
    exp.is_weights = apply_correction(correction, exp.rollout_logprobs, exp.old_logprobs, exp.response_mask,
                                      **params).weights
    assert not torch.allclose(exp.is_weights, torch.ones_like(exp.is_weights)) or correction == "none"
    want_old = exp.old_logprobs
    want = two_pass.train_step(exp, temperature=0.9)
    exp.old_logprobs, exp.is_weights = None, None
    got, old = fused.train_step_on_policy(exp, 0.9, correction, params)

    mask = exp.response_mask.bool()
    torch.testing.assert_close(old[mask], want_old[mask], rtol=0, atol=1e-6)
    assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5, abs=1e-7)
    assert got["train/loss"] != 0.0
    assert fused.version == two_pass.version == 1
    for (name, a), b in zip(model.state_dict().items(), fused.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_on_policy_step_refuses_a_batch_wide_correction():
    cfg = load_config(None, [])
    with pytest.raises(ValueError, match="ais"):
        Trainer(tiny_model(), cfg.train, cfg.algo).train_step_on_policy(batch(), 1.0, "ais")


def test_weight_decay_leaves_norms_biases_and_embeddings_alone():
    """With zero gradients AdamW's update is the decay alone: the linears' matrices shrink by exactly
    (1 - lr * weight_decay), the embedding, the norms and the biases stay as they were."""
    cfg = load_config(None, ["train.weight_decay=0.1", "train.lr=0.01"])
    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=16, tie_word_embeddings=True, qkv_bias=True))
    trainer = Trainer(model, cfg.train, cfg.algo)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    kept = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    decayed = [n for n, p in model.named_parameters() if torch.equal(p, before[n] * (1 - 0.01 * 0.1))]
    assert sorted(kept + decayed) == sorted(before)
    assert "model.embed_tokens.weight" in kept and "model.norm.weight" in kept
    assert "model.layers.0.self_attn.q_proj.bias" in kept and "model.layers.0.input_layernorm.weight" in kept
    assert "model.layers.0.self_attn.q_proj.weight" in decayed and "model.layers.1.mlp.down_proj.weight" in decayed


def test_an_optimizer_state_of_one_parameter_group_loads_into_the_decay_groups():
    """Checkpoints written before the weight-decay groups hold one AdamW group: each parameter keeps its
    moments, and the next step is the step that optimizer would have taken."""
    cfg = load_config(None, ["train.weight_decay=0.0"])
    model, exp = tiny_model(), batch()
    exp.old_logprobs = response_logprobs(model, exp).detach()
    one_group = torch.optim.AdamW([p for p in model.parameters()], lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                  weight_decay=0.0)
    old = Trainer(model, cfg.train, cfg.algo)
    old.optimizer, old.scheduler = one_group, torch.optim.lr_scheduler.LambdaLR(one_group, lambda s: 1.0)
    old.train_step(exp)
    state = old.state_dict()
    assert len(state["optimizer"]["param_groups"]) == 1
    fresh = Trainer(model, cfg.train, cfg.algo)
    assert len(fresh.optimizer.param_groups) == 2
    fresh.load_state_dict(state)
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh.optimizer.state[p][key], one_group.state[p][key])
