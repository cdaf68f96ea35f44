"""Distributed faults in the supervised warm-up (issue 30), kept to two fast cases:

- torchrun (2 ranks): SIGTERM to the agent while the ranks are in the warm-up; both ranks stop at the
  same warm-up step within a step or two (not at the warm-up's end), write a checkpoint, mark the run
  STOPPED, and the same command with run.resume=true completes it.
- Ray: a trainer worker killed in the middle of the warm-up ends the run with one line naming it (not a
  RayActorError traceback), exit 1, and the resume continues from the warm-up's periodic checkpoint;
  a SIGTERM to the driver in the warm-up stops it after the current step (exit 75), and the run resumes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from jetflow.metrics_log import read_metrics
from torchrun_jobs import torchrun

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--config", "configs/tiny.yaml", "precision.mode=fp32", "train.steps=1", "train.prompts_per_step=4",
          "rollout.group_size=4", "run.progress=false", "run.tensorboard=false", "run.num_threads=1",
          "eval.num_prompts=0", "run.name=r", "run.resume=true"]


def test_sigterm_to_torchrun_in_the_warmup_stops_every_rank_at_one_step_and_resumes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    command = [*torchrun(2), "-m", "jetflow.cli", "train", "--no-report", *COMMON, "train.sft_warmup_steps=60",
               f"run.out_dir={tmp_path}"]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, deadline = tmp_path / "r" / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled in its warm-up"
        time.sleep(0.05)
    seen = len(metrics.read_text().splitlines())
    proc.send_signal(signal.SIGTERM)  # what SLURM sends the job step (torchrun passes it to its workers)
    log, _ = proc.communicate(timeout=120)
    stopped = json.loads((tmp_path / "r" / "STOPPED").read_text())
    assert stopped["phase"] == "warm-up" and stopped["stopped_at"] == stopped["resumes_at"], (stopped, log[-3000:])
    at = int(stopped["stopped_at"].split()[-1])
    assert seen <= at <= seen + 3 < 60, (seen, at)  # answered within a step or two, far from the end
    assert [r["step"] for r in read_metrics(tmp_path / "r", "sft")] == list(range(at))  # one row per step
    assert "stopped by SIGTERM at warm-up step" in log  # rank 0's line

    resumed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "r", "sft")] == list(range(60))
    assert [r["step"] for r in read_metrics(tmp_path / "r")] == [0] and (tmp_path / "r" / "COMPLETE").exists()


@pytest.fixture
def ray_cluster():
    """One local cluster for the test's three runs (each would start and stop its own otherwise: about 10 s
    each); a run that finds Ray initialized leaves it up and kills only its own actors."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}})
    yield
    ray.shutdown()


def test_a_ray_trainer_worker_killed_or_the_driver_signalled_in_the_warmup_and_the_run_resumes(
        tmp_path, monkeypatch, capsys, ray_cluster):
    from jetflow.cli import main
    from jetflow.run.ray_placement import RayPlacement

    warmup_step = RayPlacement.warmup_step

    def kill_worker_at_step_3(self, step):
        if step == 3:  # a queued exit, not a ray.kill, which the tiny step could outrun
            self.workers[0].__ray_call__.remote(lambda _self: os._exit(1))
        return warmup_step(self, step)

    monkeypatch.setattr(RayPlacement, "warmup_step", kill_worker_at_step_3)
    args = ["train", "--no-report", *COMMON, "train.sft_warmup_steps=6", "train.checkpoint_every=2", "run.orchestrator=ray",
            "rollout.num_engines=1", "run.ray_num_cpus=2", f"run.out_dir={tmp_path}"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("jetflow: error: a Ray trainer worker died during warm-up step 3 (")
    assert err.endswith("its checkpoints are intact: the same command with run.resume=true continues it")
    assert (tmp_path / "r" / "checkpoints" / "latest").read_text() == "warmup_000002"

    def sigterm_at_step_4(self, step):  # to the driver (ray.init installs a SIGTERM handler of its own)
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return warmup_step(self, step)

    monkeypatch.setattr(RayPlacement, "warmup_step", sigterm_at_step_4)
    assert main(args) == 75  # resumed at warm-up step 2, stopped after step 4
    assert json.loads((tmp_path / "r" / "STOPPED").read_text())["stopped_at"] == "warm-up step 5"

    monkeypatch.undo()
    assert main(args) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "r", "sft")] == list(range(6))
    assert (tmp_path / "r" / "COMPLETE").exists()
