"""SLURM launch: render a batch script from templates/<kind>.sbatch and submit it with sbatch.

    jetflow launch slurm --config configs/tiny.yaml --nodes 2 --nproc-per-node 4 --gpus-per-node 4 --dry-run
    jetflow launch slurm --config configs/tiny.yaml --kind ray --nodes 4 train.steps=50

Both templates stop a run before the time limit with a checkpoint, requeue the job and resume it
(`--signal=B:USR1@stop_signal_s`, templates/requeue.sh).

Kinds: `torchrun` (one SLURM task per node runs templates/torchrun.sh, i.e. torchrun for that node's
processes) and `ray` (a Ray head on the first node, workers on the others, then `jetflow train ...
run.orchestrator=ray` as the driver). The templates are package data: the script names them where
this jetflow is installed, and runs the Python that rendered it. The run config and its overrides go
through the pre-run checks of the config (jetflow.run.validate.check_config) before anything is
rendered or written, so a bad key or value fails here and not in the queue. `submit` writes the script
to <run.out_dir>/<run.name>/launch/<kind>.sbatch (the job's output goes beside it, <kind>-<jobid>.out)
and runs `sbatch` on it.
"""

from __future__ import annotations

import re
import shlex
import shutil
import string
import subprocess
import sys
from pathlib import Path

from jetflow.config import Config, load_config
from jetflow.errors import UsageError, UserError
from jetflow.run.validate import check_config

TEMPLATES = Path(__file__).resolve().parent / "templates"
KINDS = ("torchrun", "ray")
KIND_OVERRIDES = {"torchrun": (), "ray": ("run.orchestrator=ray",)}  # what each template adds to the command
# `#SBATCH` lines with one of these placeholders are dropped when the option is not given (None / 0)
OPTIONAL = ("gpus_per_node", "partition", "time")
STOP_SIGNAL_S = 600  # time to finish the current RL step and write a checkpoint
TEMPLATE_ONLY = "template only"  # lines marked so (the shellcheck directive for placeholders) are dropped


class SubmitError(UserError, RuntimeError):
    """sbatch refused the script (no controller, bad partition, ...)."""


class SlurmTemplate(string.Template):
    """Placeholders are lower-case and braced, `${job_name}`; `$$` is a literal `$`.

    Everything else with a `$` is left alone, so the templates are plain bash that uses upper-case
    shell variables (`$SLURM_NNODES`, `${NODES[0]}`, `${MASTER_PORT:-29500}`) without escaping.
    """

    flags = 0  # type: ignore[assignment]  # not IGNORECASE: ${MASTER_PORT} is the shell's
    # string.Template's documented override points (typeshed types the compiled forms of these attributes)
    pattern = (
        r"\$(?:(?P<escaped>\$)|(?P<named>(?!))|\{(?P<braced>[a-z_][a-z0-9_]*)\}|(?P<invalid>(?!)))")  # type: ignore[assignment]


def template_path(kind: str) -> Path:
    if kind not in KINDS:
        raise UsageError(f"launch kind {kind!r} is not valid; choose one of {list(KINDS)}")
    return TEMPLATES / f"{kind}.sbatch"


def launch_dir(cfg: Config, workdir: str | Path = ".") -> Path:
    """<run.out_dir>/<run.name>/launch (a relative run.out_dir is under the job's working directory)."""
    return Path(workdir).resolve() / cfg.run.out_dir / cfg.run.name / "launch"


def render_slurm(kind: str, cfg_path: str | Path, overrides: list[str] | tuple[str, ...] = (), nodes: int = 1,
                 nproc_per_node: int = 1, *, cpus_per_task: int | None = None, gpus_per_node: int = 0,
                 partition: str | None = None, time: str | None = None, job_name: str | None = None,
                 stop_signal_s: int = STOP_SIGNAL_S, workdir: str | Path = ".") -> str:
    """The batch script for `jetflow train --config cfg_path *overrides` on `nodes` nodes.

    cpus_per_task (the one task per node) defaults to nproc_per_node; workdir (the job's working
    directory: a relative run.out_dir is under it) to the current directory. stop_signal_s: SIGUSR1 that
    many seconds before the time limit; the run checkpoints at its next step boundary, and the job
    requeues itself and resumes (templates/requeue.sh).
    """
    # a bad key or value fails here, before anything is written; checked with what the kind's template adds
    cfg = load_config(cfg_path, [*overrides, *KIND_OVERRIDES[kind]] if kind in KIND_OVERRIDES else overrides)
    check_config(cfg)
    for name, value in (("nodes", nodes), ("nproc_per_node", nproc_per_node), ("cpus_per_task", cpus_per_task),
                        ("stop_signal_s", stop_signal_s)):
        if value is not None and value < 1:
            raise UsageError(f"launch: {name}={value} must be >= 1")
    if gpus_per_node < 0:
        raise UsageError(f"launch: gpus_per_node={gpus_per_node} must be >= 0")
    workdir = Path(workdir).resolve()
    out = launch_dir(cfg, workdir)
    values = {
        "job_name": job_name or f"jetflow-{cfg.run.name}",
        "nodes": nodes,
        "nproc_per_node": nproc_per_node,
        "cpus_per_task": cpus_per_task or nproc_per_node,
        "gpus_per_node": gpus_per_node or None,
        "partition": partition,
        "time": time,
        "workdir": workdir,
        "output": out / f"{kind}-%j.out",
        "config": shlex.quote(str(Path(cfg_path).resolve())),
        "overrides": shlex.join(overrides),
        "run_dir": shlex.quote(str(out.parent)),
        "stop_signal_s": stop_signal_s,
        "templates": shlex.quote(str(TEMPLATES)),
        "python": shlex.quote(sys.executable),
    }
    for key in ("job_name", "partition", "time", "workdir", "output"):  # #SBATCH values are not shell-quoted
        if values[key] is not None and re.search(r"\s", str(values[key])):
            raise UsageError(f"launch: {key}={str(values[key])!r} must not contain whitespace")
    text = template_path(kind).read_text()
    lines = [line for line in text.splitlines(keepends=True) if TEMPLATE_ONLY not in line
             and not any(values[k] is None and f"${{{k}}}" in line for k in OPTIONAL)]
    return SlurmTemplate("".join(lines)).substitute(values)


def submit(kind: str, cfg_path: str | Path, overrides: list[str] | tuple[str, ...] = (), nodes: int = 1,
           nproc_per_node: int = 1, *, sbatch: str = "sbatch", **options) -> tuple[str, Path]:
    """Render, write to <run dir>/launch/<kind>.sbatch, `sbatch` it; returns (job id, script path)."""
    script = render_slurm(kind, cfg_path, overrides, nodes, nproc_per_node, **options)
    exe = shutil.which(sbatch)
    if exe is None:
        raise FileNotFoundError(f"{sbatch!r} not found on PATH: submit from a SLURM login node, or use --dry-run "
                                "to print the script")
    path = launch_dir(load_config(cfg_path, overrides), options.get("workdir", ".")) / f"{kind}.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    done = subprocess.run([exe, "--parsable", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SubmitError(f"sbatch {path} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0], path
