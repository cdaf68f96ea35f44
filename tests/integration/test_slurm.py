"""A real one-node SLURM cluster on this machine (scripts/slurm_up.sh: munged, slurmctld, slurmd, all
state in a temp directory) runs `jetflow launch slurm` for the tiny config, 2 RL steps on 1 node:
torchrun with 2 processes, and a Ray cluster job (run.orchestrator=ray). Each job must complete with
exit 0 and leave a complete run directory; the daemons are stopped by their pids afterwards, also
when a test fails.

Needs root (SlurmUser=root). Missing packages are apt-get installed when running as root, else the
test is skipped. Deselect with `-m "not slurm"`.
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from jetflow.cli import main
from jetflow.distributed import free_port
from jetflow.metrics_log import read_metrics

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "sinfo")
JOB_TIMEOUT_S = 360



def _alive(pid: int) -> bool:
    """True for a running process; a zombie (killed, not yet reaped by init) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _ensure_slurm_installed() -> None:
    if all(shutil.which(b) for b in (*DAEMONS, *CLIENTS)):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("SLURM / munge not installed and cannot apt-get them (needs root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "slurmctld", "slurmd", "slurm-client", "munge"]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"apt-get install of SLURM failed: {done.stderr.strip()[-300:]}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node cluster: yields the environment for its clients (SLURM_CONF)."""
    if os.geteuid() != 0:
        pytest.skip("a local SLURM cluster needs root (SlurmUser=root)")
    _ensure_slurm_installed()
    state = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "SLURMCTLD_PORT": str(free_port()), "SLURMD_PORT": str(free_port())}
    pids: dict[str, int] = {}
    try:
        up = subprocess.run(["bash", str(ROOT / "scripts/slurm_up.sh"), str(state)], env=env, capture_output=True,
                            text=True, timeout=120)
        pids = {d: int(p.read_text()) for d in DAEMONS if (p := state / f"{d}.pid").is_file()}
        logs = "\n".join(f"--- {f.name}\n{f.read_text()[-2000:]}" for f in sorted((state / "log").glob("*.log")))
        assert up.returncode == 0, f"slurm_up.sh failed:\n{up.stdout}{up.stderr}\n{logs}"
        assert set(pids) == set(DAEMONS), pids
        yield {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    finally:
        down = subprocess.run(["bash", str(ROOT / "scripts/slurm_down.sh"), str(state)], capture_output=True,
                              text=True, timeout=60)
        for pid in pids.values():  # whatever slurm_down.sh left: by pid, never by name
            if _alive(pid):
                os.kill(pid, 9)
        time.sleep(0.2)
        left = {d: p for d, p in pids.items() if _alive(p)}
        assert down.returncode == 0 and not left, f"daemons still running: {left}\n{down.stderr}"


def _job_state(job: str, env: dict) -> dict[str, str]:
    line = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)


ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED")


def _submit(capsys, out_dir: Path, name: str, *launch_args: str, steps: int = 2,
            extra: tuple[str, ...] = ()) -> tuple[str, Path, Path]:
    """`jetflow launch slurm` a tiny run; returns (job id, run dir, job output file)."""
    overrides = [f"train.steps={steps}", "train.sft_warmup_steps=20", f"run.out_dir={out_dir}", f"run.name={name}",
                 "run.progress=false", "run.tensorboard=false", *extra]
    cpus = str(min(2, os.cpu_count() or 1))
    assert main(["launch", "slurm", "--config", "configs/tiny.yaml", "--nodes", "1", "--cpus-per-task", cpus,
                 *launch_args, *overrides]) == 0
    job = capsys.readouterr().out.split("submitted SLURM job ")[1].split(":")[0]
    kind = launch_args[launch_args.index("--kind") + 1]
    return job, out_dir / name, out_dir / name / "launch" / f"{kind}-{job}.out"


def _wait_for_job(job: str, env: dict, output: Path) -> dict[str, str]:
    """Until the job has ended; asserts it COMPLETED with exit 0."""
    deadline = time.time() + JOB_TIMEOUT_S
    info = _job_state(job, env)
    while info.get("JobState") in ACTIVE and time.time() < deadline:
        time.sleep(2)
        info = _job_state(job, env)
    log = output.read_text() if output.exists() else "(no job output)"
    if info.get("JobState") in ACTIVE:
        subprocess.run(["scancel", job], env=env)
        pytest.fail(f"job {job} still {info['JobState']} after {JOB_TIMEOUT_S} s:\n{log}")
    assert (info.get("JobState"), info.get("ExitCode")) == ("COMPLETED", "0:0"), f"{info}\n{log}"
    return info


def _rl_steps(run_dir: Path) -> list[int]:
    if not (run_dir / "metrics.jsonl").exists():
        return []
    return [r["step"] for r in read_metrics(run_dir) if r["phase"] == "rl"]


def _assert_complete_run(run_dir: Path, kind: str, steps: int, log: str) -> None:
    assert (run_dir / "COMPLETE").exists() and (run_dir / "config.yaml").exists(), log
    assert not (run_dir / "STOPPED").exists(), log
    assert (run_dir / "launch" / f"{kind}.sbatch").exists()
    assert _rl_steps(run_dir) == list(range(steps)), log
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / latest).is_dir()


def _run_job(slurm: dict, capsys, out_dir: Path, name: str, *launch_args: str) -> tuple[Path, str]:
    """`jetflow launch slurm` a 2-step tiny run, wait for the job; returns (run dir, job output)."""
    job, run_dir, output = _submit(capsys, out_dir, name, *launch_args)
    _wait_for_job(job, slurm, output)
    log = output.read_text()
    _assert_complete_run(run_dir, launch_args[launch_args.index("--kind") + 1], 2, log)
    assert log.count("run complete:") == 1, log  # one process reports
    return run_dir, log


@pytest.fixture
def job_env(slurm, monkeypatch):
    """The cluster's client environment; sbatch exports it to the job (MASTER_PORT, RAY_* included)."""
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    return slurm


def test_torchrun_job_two_processes_completes(job_env, tmp_path, capsys):
    run_dir, _ = _run_job(job_env, capsys, tmp_path, "slurm-tiny", "--kind", "torchrun", "--nproc-per-node", "2")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["data_parallel_size"] == 2, summary


def test_a_job_signalled_before_its_time_limit_checkpoints_requeues_and_resumes(job_env, tmp_path, capsys):
    """SIGUSR1 to the batch shell is what `#SBATCH --signal=B:USR1@600` sends 600 s before the time
    limit (sent here with scancel, as slurmctld would). Before, the templates asked for no signal and
    did not requeue: the time limit killed the run and everything since its last checkpoint was lost.
    Now: torchrun's two workers checkpoint at the same step boundary, the job requeues itself, and its
    second run resumes there and completes every step once."""
    # enough steps that the signal, sent once the first RL step is logged, lands mid-run: at 12 an idle
    # machine ran every step (about 0.3 s each) before it arrived (the run was in its final writes); no
    # held-out evaluation (every 5 steps by default)
    steps = 40
    job, run_dir, output = _submit(capsys, tmp_path, "slurm-requeue", "--kind", "torchrun", "--nproc-per-node", "2",
                                   steps=steps, extra=("eval.num_prompts=0",))
    script = (run_dir / "launch" / "torchrun.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@600" in script and "#SBATCH --requeue" in script
    deadline = time.time() + JOB_TIMEOUT_S
    while not _rl_steps(run_dir):  # the RL steps have begun
        assert time.time() < deadline and _job_state(job, job_env).get("JobState") in ACTIVE, output.read_text()
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=job_env, check=True)
    # a requeued job waits for its old credential to expire: 10 s on this cluster (slurm_up.sh's
    # cred_expire; SLURM's default is 120 s); starting it earlier fails with "Job credential revoked"
    info = _wait_for_job(job, job_env, output)
    log = output.read_text()
    assert info.get("Restarts") == "1", f"{info}\n{log}"
    stopped = re.search(r"stopped by SIGUSR1 at step (\d+) \(resumes at step \1 ", log)
    assert stopped and 1 <= int(stopped.group(1)) < steps, log
    assert log.count("jetflow: stopped by SIGUSR1") == 1, log  # rank 0 reports
    assert f"requeueing job {job}" in log and "continuing the run" in log and log.count("run complete:") == 1, log
    _assert_complete_run(run_dir, "torchrun", steps, log)


def test_ray_job_completes_and_stops_ray(job_env, tmp_path, capsys, monkeypatch):
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    # Ray's session directory (its unix sockets must stay under 108 characters) kept apart from
    # any other Ray instance on this machine; the head port outside Ray's worker port range
    ray_tmp = Path(tempfile.mkdtemp(prefix="jf-ray-", dir="/tmp"))
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    monkeypatch.setenv("RAY_PORT", str(free_port()))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    try:
        run_dir, log = _run_job(job_env, capsys, tmp_path, "slurm-ray", "--kind", "ray")
        assert "orchestrator=ray" in log and (run_dir / "summary.json").exists()
        deadline = time.time() + 60  # the job waited for its `ray start` steps; nothing of Ray is left
        while (left := _processes_mentioning(str(ray_tmp))) and time.time() < deadline:
            time.sleep(1)
        assert not left, left
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text.encode() in (proc / "cmdline").read_bytes() and _alive(int(proc.name)):
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids
