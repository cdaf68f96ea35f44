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


def test_nan_steps_are_skipped_then_stop_the_run():
    cfg = load_config(None, ["train.max_bad_steps=2"])
    model, exp = tiny_model(), batch()
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
