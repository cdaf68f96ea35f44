"""Asynchronous rollouts with bounded staleness (rollout.max_staleness, jetflow.run.ahead): the engine in its own
process generates step t's samples under the weights of step t - k while the trainer trains, every sample's
behaviour log-prob is exactly the trainer's under the version that made it (unified, exact numerics), a run
stopped with batches in flight resumes bit for bit, and what is not built is one line before the model loads."""

from __future__ import annotations

import copy

import pytest
import torch

from jetflow.config import ConfigError, derive, load_config
from jetflow.metrics_log import read_metrics
from jetflow.run.validate import check_config, validate_run
from crashes import kill_at_step
from orphans import assert_engine_dies_with_its_killed_parent

# a short warm-up, 5 RL steps, held-out evaluations before steps 0 and 2 and after the last (each a sync and
# a greedy generation queued behind the batches in flight), a checkpoint every 2 steps
COMMON = ["train.sft_warmup_steps=4", "train.steps=5", "train.checkpoint_every=2", "eval.num_prompts=2",
          "eval.every=2", "train.prompts_per_step=2", "rollout.group_size=2", "run.progress=false",
          "run.loggers=[]", "run.num_threads=2", "run.name=r"]


def _config(out, *extra: str):
    return load_config("configs/tiny.yaml", [*COMMON, f"run.out_dir={out}", *extra])


def _train(out, *extra: str):
    from jetflow.run.runner import train
    return train(_config(out, *extra))


def _without_clock(run_dir, phase: str) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "async/trainer_idle",
                                                             "async/engine_idle"))}
            for r in read_metrics(run_dir, phase)]


def test_every_behaviour_logprob_is_the_trainers_under_the_version_that_sampled_it(tmp_path, monkeypatch):
    """k = 2: step t trains on samples of the weights it had at step t - 2 (t < 2: step 0's). The trainer's
    recomputation of each trained token under that version (its weights then, kept here) equals the
    engine's log-prob bit for bit; under the current weights it does not (the samples are stale)."""
    from jetflow.run.loop import RLLoop
    from jetflow.train.trainer import Trainer

    snapshots: dict[int, dict] = {}  # weight version -> the trainer's weights when it was sent
    steps: list[tuple] = []  # (trainer, experience, batch version, trainer version) of each step
    weight_update, update = Trainer.weight_update, RLLoop._update

    def snapshot(self, *args, **kwargs):
        snapshots[self.version] = copy.deepcopy(self.model.state_dict())
        return weight_update(self, *args, **kwargs)

    def record(self, exp, metrics):
        steps.append((self.trainer, copy.deepcopy(exp), self.batch.out.weight_version, self.trainer.version))
        return update(self, exp, metrics)

    monkeypatch.setattr(Trainer, "weight_update", snapshot)
    monkeypatch.setattr(RLLoop, "_update", record)
    # weight decay moves the weights at every step, whatever the rewards (a step whose groups all score alike
    # has no gradient), so that every version differs from the one before
    run_dir = _train(tmp_path, "rollout.max_staleness=2", "precision.numerics=exact", "train.weight_decay=0.5")
    rows = read_metrics(run_dir, "rl")
    assert [r["async/staleness_mean"] for r in rows] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert [r["async/stale_frac"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [version for _, _, version, _ in steps] == [0, 0, 0, 1, 2]  # step t - 2's weights
    assert rows[0]["mismatch/kl_k3"] == 0.0 and all(r["mismatch/kl_k3"] > 0 for r in rows[1:])

    trainer = steps[0][0]
    for step, (_, exp, version, now) in enumerate(steps):
        mask = exp.response_mask.bool()
        trainer.model.load_state_dict(snapshots[version])
        behaviour = trainer.compute_logprobs(exp, 1.0)
        assert torch.equal(behaviour[mask], exp.rollout_logprobs[mask]), step
        if version != now:
            trainer.model.load_state_dict(snapshots[now])
            assert not torch.equal(trainer.compute_logprobs(exp, 1.0)[mask], exp.rollout_logprobs[mask]), step


def test_a_run_that_dies_with_batches_in_flight_resumes_bit_for_bit(tmp_path, monkeypatch):
    """The checkpoint at step 2 holds the batches of steps 2 and 3, made under the weights of steps 0 and 1,
    which the resumed run no longer has: it trains on the kept ones and ends as the uninterrupted run."""
    from jetflow.run.loop import RLLoop
    from safetensors.torch import load_file

    whole = _train(tmp_path / "whole", "rollout.max_staleness=2")
    kill_at_step(monkeypatch, RLLoop, 3)
    with pytest.raises(SystemExit):
        _train(tmp_path / "cut", "rollout.max_staleness=2")
    monkeypatch.undo()
    checkpoint = tmp_path / "cut" / "r" / "checkpoints" / "step_000002"
    saved = torch.load(checkpoint / "trainer.pt", weights_only=True)["rollouts_in_flight"]
    assert sorted(saved) == [2, 3] and [saved[t]["version"] for t in (2, 3)] == [0, 1]
    resumed = _train(tmp_path / "cut", "rollout.max_staleness=2", "run.resume=true")
    for phase in ("rl", "eval"):
        assert _without_clock(resumed, phase) == _without_clock(whole, phase), phase
    a, b = load_file(str(resumed / "model" / "model.safetensors")), load_file(str(whole / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_engine_process_computes_the_synchronous_engines_samples(tmp_path):
    """The batch of step 0 (step 0's weights under either schedule) is the same, token for token and log-prob
    for log-prob, whether the engine runs in this process or its own (the correction as async's `auto` makes it)."""
    sync = _train(tmp_path / "sync", "train.steps=1", "eval.num_prompts=0", "algo.correction=token_tis")
    async_ = _train(tmp_path / "async", "train.steps=1", "eval.num_prompts=0", "rollout.max_staleness=1")
    (row,), (row_async,) = _without_clock(sync, "rl"), _without_clock(async_, "rl")
    assert {k: v for k, v in row_async.items() if not k.startswith("async/")} == row
    assert row_async["async/staleness_max"] == 0.0


@pytest.mark.parametrize("extra, says", [
    (["rollout.max_staleness=-1"], "rollout.max_staleness=-1 is out of range"),
    (["rollout.max_staleness=1", "run.orchestrator=ray", "rollout.inflight_updates=keep_kv"],
     "with run.orchestrator=ray and rollout.inflight_updates=keep_kv: not built"),
    (["rollout.max_staleness=1", "run.orchestrator=ray", "rollout.split_mismatch=true"],
     "with run.orchestrator=ray and rollout.split_mismatch=True: not built"),
    (["rollout.max_staleness=1", "rollout.backend=vllm"], "use rollout.backend=native"),
    (["rollout.max_staleness=1", "algo.dynamic_sampling=true"], "algo.dynamic_sampling=true"),
    (["rollout.max_staleness=1", "rollout.split_mismatch=true", "model.lora.rank=4"],
     "rollout.split_mismatch=true with model.lora.rank=4"),
    (["rollout.max_staleness=1", "rollout.split_mismatch=true", "precision.kv_cache_fp8=true"],
     "rollout.split_mismatch=true with precision.kv_cache_fp8=True"),
])
def test_what_async_does_not_run_is_one_line_before_the_model_loads(tmp_path, extra, says):
    with pytest.raises(ConfigError, match=says.replace("[", r"\[")) as e:
        check_config(_config(tmp_path, *extra))
    assert "\n" not in str(e.value)


def test_more_than_one_trainer_process_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="with 2 trainer processes") as e:
        validate_run(_config(tmp_path, "rollout.max_staleness=1"), processes=2)
    assert "\n" not in str(e.value)


def test_staleness_makes_the_auto_correction_decoupled_ppos_truncated_weight(tmp_path):
    assert derive(_config(tmp_path)).correction == "none"  # unified, synchronous: nothing to correct
    assert derive(_config(tmp_path, "rollout.max_staleness=1")).correction == "token_tis"
    assert derive(_config(tmp_path, "rollout.max_staleness=1", "algo.correction=none")).correction == "none"


def test_a_dead_engine_process_is_one_line(tmp_path, monkeypatch):
    """The engine's process killed mid-run: the trainer says so, with the exit code, instead of hanging."""
    import os
    import signal

    from jetflow.errors import UserError
    from jetflow.run.engine_process import EngineProcessDied, ProcessRollout

    collect = ProcessRollout.collect

    def killed(self, ticket):
        os.kill(self.process.pid, signal.SIGKILL)
        return collect(self, ticket)

    monkeypatch.setattr(ProcessRollout, "collect", killed)
    with pytest.raises(EngineProcessDied, match=r"process died while serving call \d+ \(exit code -9: killed by "
                                                r"SIGKILL\); .* run.resume=true continues it") as e:
        _train(tmp_path, "rollout.max_staleness=1", "eval.num_prompts=0")
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)


def test_max_staleness_0_is_the_synchronous_loop(tmp_path, monkeypatch):
    """The default starts no engine process and generates ahead of nothing: the loop of before the key
    (results/async/README.md compares its metrics.jsonl with a run of the commit before, row for row)."""
    from jetflow.run import engine_process

    def refuse(*args, **kwargs):
        raise AssertionError("rollout.max_staleness=0 started an engine process")

    monkeypatch.setattr(engine_process.EngineProcess, "__init__", refuse)
    run_dir = _train(tmp_path, "train.steps=2", "rollout.max_staleness=0")
    assert all(not k.startswith("async/") for r in read_metrics(run_dir, "rl") for k in r)


def test_the_engine_process_dies_with_a_killed_trainer(tmp_path):
    """A trainer killed outright (SIGKILL, an OOM kill) in the middle of a generation takes its engine's process
    with it, instead of leaving it to finish the generation alone (before: it ran on, a long one for minutes)."""

    (tmp_path / "slow_engine.py").write_text(
        "import time\n"
        "class Slow:\n"
        "    def generate(self, *args, **kwargs):\n"
        "        time.sleep(600)\n"
        "def build(cfg, derived):\n"
        "    return Slow()\n")
    script = (
        "import time\n"
        "from jetflow.config import derive, load_config\n"
        "from jetflow.run.engine_process import ProcessRollout\n"
        "from slow_engine import build\n"
        "cfg = load_config('configs/tiny.yaml')\n"
        "engine = ProcessRollout(build, cfg, derive(cfg), 1)\n"
        "engine.submit([[1, 2]], [0])\n"
        "print(engine.process.pid, flush=True)\n"
        "time.sleep(600)\n")
    assert_engine_dies_with_its_killed_parent(script, tmp_path)  # the call reaches the child, which sleeps in it
