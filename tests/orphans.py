"""The check the engine-process tests share: a trainer process killed outright (SIGKILL: no handler runs) does not
leave its rollout engine's process running (jetflow.run.engine_process: the child dies with its parent)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def assert_engine_dies_with_its_killed_parent(script: str, module_dir: Path, timeout: float = 20) -> None:
    """Run `script` (which starts an engine process, prints its pid and sleeps) in a Python process with
    `module_dir` on its PYTHONPATH, SIGKILL that process half a second after the pid is printed (the engine then
    holds the calls sent), and fail unless the engine's process is gone within `timeout` seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(module_dir), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    child = int(parent.stdout.readline())
    time.sleep(0.5)  # the calls reach the child
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the engine's process outlived its killed parent")
