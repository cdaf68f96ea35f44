"""In-flight weight updates (rollout.inflight_updates, jetflow.run.inflight, issue 72): a batch generated ahead takes
the next weight update half way, each token tagged with the version that sampled it. Under unified exact numerics,
the re-prefill way gives every token the behaviour log-prob of its own version's policy given its prefix, bit for
bit; the kept-KV way gives the pre-swap tokens theirs and the post-swap tokens a measured gap; off is today's."""

from __future__ import annotations

import copy

import pytest
import torch

from jetflow.config import ConfigError, derive, load_config
from jetflow.metrics_log import read_metrics
from jetflow.rl.experience import pack_experience
from jetflow.run.loop import request_seed
from jetflow.run.validate import check_config
from crashes import kill_at_step

PAUSE_AT = 4  # of the tiny config's 8 new tokens (jetflow.run.inflight.swap_step's default)


def _cfg(tmp_path, *extra: str):
    return load_config("configs/tiny.yaml", ["precision.numerics=exact", "run.num_threads=1", f"run.out_dir={tmp_path}",
                                             "run.loggers=[]", "rollout.max_staleness=1", *extra])


def _spanning_batch(tmp_path, mode: str):
    """A batch started under version 0 and finished under version 1 (one weight-decayed train step later), on the
    tiny model (no warm-up: long responses, few EOS). Returns (the experience with the behaviour log-probs, each
    response token's version (B, T) as the experience lays out tokens, the trainer's log-probs under versions 0 and 1
    (B, T) each)."""
    from jetflow.run.build import load_inputs
    from jetflow.run.sides import TrainerSide, build_rollout_side

    cfg = _cfg(tmp_path, f"rollout.inflight_updates={mode}", "train.weight_decay=0.5")
    derived = derive(cfg)
    inputs = load_inputs(cfg)
    side = TrainerSide(cfg, derived, inputs)
    trainer, mode_name, fingerprint = side.trainer, derived.precision.mode.value, derived.precision.fingerprint
    rollout = build_rollout_side(cfg, derived, inputs, side)
    prompts = [side.encode(p) for p in side.task.problems(0, 8, cfg.run.seed)]
    seeds = [request_seed(cfg.run.seed, 7, i) for i in range(len(prompts))]
    pad, zeros = side.tokenizer.pad_token_id, torch.zeros(len(prompts))

    rollout.load_weights(trainer.weight_update(mode_name, fingerprint))
    before = copy.deepcopy(trainer.model.state_dict())
    rollout.start(prompts, seeds, PAUSE_AT)  # paused after PAUSE_AT decode steps under version 0
    other = rollout.engine.generate  # (a paused batch holds the pool: no other generate meanwhile)
    with pytest.raises(RuntimeError, match="paused"):
        other(prompts[:1])
    exp0 = pack_experience(prompts, [[1] * 4] * len(prompts), [[0.0] * 4] * len(prompts), zeros,
                           torch.linspace(-1, 1, len(prompts)), pad)
    exp0.old_logprobs = trainer.compute_logprobs(exp0, 1.0)
    trainer.train_step(exp0, 1.0)  # version 1: weight decay moves every weight
    after = copy.deepcopy(trainer.model.state_dict())
    rollout.load_weights(trainer.weight_update(mode_name, fingerprint))
    out = rollout.finish()
    assert out.weight_version == 0
    exp = pack_experience(prompts, out.token_ids, out.logprobs, zeros, zeros, pad)
    tagged = pack_experience(prompts, out.token_ids, [[float(v) for v in vs] for vs in out.token_versions], zeros,
                             zeros, pad)  # the versions laid out as the log-probs are
    versions = tagged.rollout_logprobs.round().long()  # (B, T)
    trainer.model.load_state_dict(before)
    lp0 = trainer.compute_logprobs(exp, cfg.rollout.temperature)  # (B, T)
    trainer.model.load_state_dict(after)
    lp1 = trainer.compute_logprobs(exp, cfg.rollout.temperature)  # (B, T)
    return exp, versions, lp0, lp1


@pytest.mark.parametrize("reprefill", [True, False])
def test_a_paused_batch_without_an_update_is_the_batch_generate_makes(tmp_path, reprefill):
    """Paused and resumed under the same weights (a step that skipped its update), a batch is generate()'s, token for
    token and log-prob for log-prob, every token of its one version: the pause itself changes nothing."""
    from jetflow.run.build import load_inputs
    from jetflow.run.sides import TrainerSide, build_rollout_side

    cfg = _cfg(tmp_path, "rollout.inflight_updates=reprefill")
    derived = derive(cfg)
    inputs = load_inputs(cfg)
    side = TrainerSide(cfg, derived, inputs)
    rollout = build_rollout_side(cfg, derived, inputs, side)
    rollout.load_weights(side.trainer.weight_update(derived.precision.mode.value, derived.precision.fingerprint))
    prompts = [side.encode(p) for p in side.task.problems(0, 8, cfg.run.seed)]
    seeds = [request_seed(cfg.run.seed, 7, i) for i in range(len(prompts))]
    whole = rollout.generate(prompts, seeds)
    rollout.reprefill = reprefill
    rollout.start(prompts, seeds, PAUSE_AT)
    paused = rollout.finish()
    assert paused.token_ids == whole.token_ids and paused.logprobs == whole.logprobs
    assert paused.token_versions == whole.token_versions == [[0] * len(t) for t in whole.token_ids]
    assert max(map(len, whole.token_ids)) > PAUSE_AT + 1  # some request ran past the pause


def test_reprefill_every_tokens_behaviour_logprob_is_its_versions_policy_given_its_prefix(tmp_path):
    exp, versions, lp0, lp1 = _spanning_batch(tmp_path, "reprefill")
    mask = exp.response_mask.bool()
    post = mask & (versions == 1)
    assert (mask & (versions == 0)).any() and post.any()
    spanning = ((versions == 0) & mask).any(1) & post.any(1)  # (B,) requests that span the swap
    assert spanning.sum() >= 2
    assert not torch.equal(lp0[post], lp1[post])  # the two versions' policies differ on these tokens
    expected = torch.where(versions == 1, lp1, lp0)  # (B, T) each token's own version's
    assert torch.equal(exp.rollout_logprobs[mask], expected[mask])


def test_keep_kv_pre_swap_tokens_are_exact_and_the_post_swap_gap_is_measured(tmp_path):
    exp, versions, lp0, lp1 = _spanning_batch(tmp_path, "keep_kv")
    mask = exp.response_mask.bool()
    pre, post = mask & (versions == 0), mask & (versions == 1)
    assert torch.equal(exp.rollout_logprobs[pre], lp0[pre])
    delta = (lp1[post] - exp.rollout_logprobs[post]).double()  # the new version's recomputation against behaviour
    kl_k3 = float((delta.exp() - 1 - delta).mean())
    print(f"keep_kv gap over {int(post.sum())} post-swap tokens: max |dlogp| {float(delta.abs().max()):.3g}, "
          f"KL k3 {kl_k3:.3g}")
    assert float(delta.abs().max()) > 0 and kl_k3 > 0


# the async tests' run: a short warm-up, 5 RL steps, held-out evaluations before steps 0 and 2 and after the last
# (each a sync and a greedy generation queued behind the batches in flight), a checkpoint every 2 steps
COMMON = ["train.sft_warmup_steps=4", "train.steps=5", "train.checkpoint_every=2", "eval.num_prompts=2",
          "eval.every=2", "train.prompts_per_step=2", "rollout.group_size=2", "run.progress=false",
          "run.loggers=[]", "run.num_threads=2", "run.name=r", "rollout.max_staleness=1"]
CLOCK = ("time/", "throughput/", "async/trainer_idle", "async/engine_idle")


def _train(out, *extra: str):
    from jetflow.run.runner import train
    return train(load_config("configs/tiny.yaml", [*COMMON, f"run.out_dir={out}", *extra]))


def _without_clock(run_dir, phase: str) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(CLOCK)} for r in read_metrics(run_dir, phase)]


def test_a_reprefill_run_trains_every_token_on_its_versions_exact_behaviour_logprob(tmp_path, monkeypatch):
    """k = 1 with re-prefilled in-flight updates: step t's batch starts under step t - 1's weights and ends under
    step t's. Every trained token's behaviour log-prob equals the trainer's recomputation under that token's version
    (its weights then, kept here), bit for bit; the staleness metrics are per token."""
    from jetflow.run.loop import RLLoop
    from jetflow.train.trainer import Trainer

    snapshots: dict[int, dict] = {}  # weight version -> the trainer's weights when it was sent
    steps: list[tuple] = []  # (trainer, experience, the versions of its tokens laid out as its log-probs) a step
    weight_update, update = Trainer.weight_update, RLLoop._update

    def snapshot(self, *args, **kwargs):
        snapshots[self.version] = copy.deepcopy(self.model.state_dict())
        return weight_update(self, *args, **kwargs)

    def record(self, exp, metrics):
        out, n = self.batch.out, len(exp.rollout_logprobs)
        tagged = pack_experience([[0]] * n, out.token_ids, [[float(v) for v in vs] for vs in out.token_versions],
                                 torch.zeros(n), torch.zeros(n), 0)
        steps.append((self.trainer, copy.deepcopy(exp), tagged.rollout_logprobs.round().long(), self.trainer.version))
        return update(self, exp, metrics)

    monkeypatch.setattr(Trainer, "weight_update", snapshot)
    monkeypatch.setattr(RLLoop, "_update", record)
    run_dir = _train(tmp_path, "rollout.inflight_updates=reprefill", "precision.numerics=exact",
                     "train.weight_decay=0.5")
    rows = read_metrics(run_dir, "rl")
    assert len(rows) == 5 and rows[0]["async/staleness_max"] == 0.0 and rows[0]["async/swapped_frac"] == 0.0
    swapped = [r["async/swapped_frac"] for r in rows[1:]]
    assert all(0 < f < 1 for f in swapped), swapped  # every later batch spans its update
    assert all(r["async/staleness_max"] == 1.0 and 0 < r["async/stale_frac"] < 1 for r in rows[1:])
    assert all(r["async/staleness_mean"] == r["async/stale_frac"] for r in rows)  # 0 or 1 version old
    assert all(r["async/swapped_kl_k3"] == 0.0 and r["async/swapped_abs_dlogp_max"] == 0.0 for r in rows[1:])

    trainer = steps[0][0]
    spanning = 0
    for step, (_, exp, versions, now) in enumerate(steps):
        mask = exp.response_mask.bool()
        expected = torch.zeros_like(exp.rollout_logprobs)  # (B, T) each token's version's recomputation
        for version in versions[mask].unique().tolist():
            trainer.model.load_state_dict(snapshots[version])
            expected = torch.where(versions == version, trainer.compute_logprobs(exp, 1.0), expected)
        assert torch.equal(expected[mask], exp.rollout_logprobs[mask]), step
        spanning += int(((versions == now - 1) & mask).any(1).logical_and(((versions == now) & mask).any(1)).sum())
    assert spanning > 0  # requests with tokens of two versions


def test_a_reprefill_run_that_dies_with_a_batch_in_flight_resumes_bit_for_bit(tmp_path, monkeypatch):
    """The checkpoint at step 2 keeps the batch of step 2, which took step 2's update half way before it was saved:
    the resumed run trains on it and ends as the uninterrupted run."""
    from jetflow.run.loop import RLLoop
    from safetensors.torch import load_file

    extra = ("rollout.inflight_updates=reprefill",)
    whole = _train(tmp_path / "whole", *extra)
    kill_at_step(monkeypatch, RLLoop, 3)
    with pytest.raises(SystemExit):
        _train(tmp_path / "cut", *extra)
    monkeypatch.undo()
    checkpoint = tmp_path / "cut" / "r" / "checkpoints" / "step_000002"
    saved = torch.load(checkpoint / "trainer.pt", weights_only=True)["rollouts_in_flight"]
    assert sorted(saved) == [2] and {v for vs in saved[2]["rollouts"]["token_versions"] for v in vs} == {1, 2}
    resumed = _train(tmp_path / "cut", *extra, "run.resume=true")
    for phase in ("rl", "eval"):
        assert _without_clock(resumed, phase) == _without_clock(whole, phase), phase
    a, b = load_file(str(resumed / "model" / "model.safetensors")), load_file(str(whole / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("extra, says", [
    (["rollout.max_staleness=0", "rollout.inflight_updates=reprefill"], "needs rollout.max_staleness > 0"),
    (["rollout.inflight_updates=keep_kv", "rollout.split_mismatch=true"], "with rollout.split_mismatch=True"),
    (["rollout.inflight_updates=keep_kv", "precision.kv_cache_fp8=true"], "with precision.kv_cache_fp8=True"),
    (["rollout.inflight_updates=reprefill", "rollout.backend=vllm"], "use rollout.backend=native"),
    (["rollout.inflight_updates=reprefill", "rollout.inflight_swap_step=-1"], "inflight_swap_step=-1 is out of range"),
])
def test_what_inflight_updates_do_not_run_is_one_line_before_the_model_loads(tmp_path, extra, says):
    with pytest.raises(ConfigError, match=says) as e:
        check_config(_cfg(tmp_path, *extra))
    assert "\n" not in str(e.value)
