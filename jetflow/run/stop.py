"""Stop requests: SIGTERM (`kill`, a SLURM preemption), SIGINT (Ctrl-C) and SIGUSR1 (what SLURM's
`--signal=USR1@T` sends T seconds before the time limit) ask a run to stop at the next RL step
boundary: a checkpoint is written, then the run ends with `RunStopped` and the CLI exits with
EXIT_STOPPED. The same command with run.resume=true continues from that checkpoint. A second Ctrl-C
stops at once (KeyboardInterrupt, no checkpoint)."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request, resumable
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class RunStopped(Exception):
    """The run stopped on a signal after writing a checkpoint; resumable."""

    def __init__(self, signame: str, next_step: int, run_dir: Path):
        super().__init__(f"stopped by {signame}: checkpoint written at step {next_step} in {run_dir}; "
                         "the same command with run.resume=true continues from it")
        self.signame, self.next_step, self.run_dir = signame, next_step, run_dir


class StopRequests:
    """Catches the stop signals while a run is in progress (main thread only) and records the first."""

    def __init__(self):
        self.signame: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signame == "SIGINT":
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if self.signame is None:
            self.signame = signal.Signals(signum).name
            print(f"[jetflow] {self.signame}: stopping after this step (checkpoint, then exit "
                  f"{EXIT_STOPPED}); Ctrl-C again to stop at once", file=sys.stderr)

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
