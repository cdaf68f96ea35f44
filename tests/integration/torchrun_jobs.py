"""Torchrun jobs started by the integration tests: the launcher command, a worker script started with its
output captured, and waiting for several jobs that run at the same time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jetflow.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]


def torchrun(nproc: int = 2) -> list[str]:
    """`python -m torch.distributed.run` for nproc local processes on a free port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port())]


def launch_worker(nproc: int, worker: Path, *args: str | int | Path) -> subprocess.Popen:
    """Start `worker` (a script) under torchrun from the repository root, one thread per rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen([*torchrun(nproc), str(worker), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)


def wait_all(procs: dict, timeout: float = 300) -> None:
    """Wait for jobs started together, {name: Popen}: a job past `timeout` kills them all and fails the test
    naming it; a job that failed fails the test with the tail of its output."""
    for name, proc in procs.items():
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"torchrun run {name} timed out")
        assert proc.returncode == 0, f"torchrun run {name} failed:\n{log[-4000:]}"
