"""Stop requests: SIGTERM (`kill`, a SLURM preemption), SIGINT (Ctrl-C) and SIGUSR1 (what SLURM's
`--signal=USR1@T` sends T seconds before the time limit) ask a run to stop at the next RL step
boundary: a checkpoint is written, then the run ends with `RunStopped`, the run directory gets a
STOPPED file (what the SLURM templates requeue on: a torchrun agent does not pass exit codes on) and
the CLI exits with EXIT_STOPPED. The same command with run.resume=true continues from that checkpoint.
A second Ctrl-C stops at once (KeyboardInterrupt, no checkpoint)."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request, resumable
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class RunStopped(Exception):
    """The run stopped on a signal at a step boundary; resumable from `resumes_at` (the newest
    checkpoint's step: the boundary's own, unless the last steps were bad and no checkpoint was written)."""

    def __init__(self, signame: str, stopped_at: int, run_dir: Path):
        super().__init__(signame, stopped_at, run_dir)
        self.signame, self.stopped_at, self.run_dir = signame, stopped_at, run_dir
        self.resumes_at: int | None = None  # set by the rank that marks the run directory STOPPED

    def __str__(self) -> str:
        where = (f"resumes at step {self.resumes_at} from its newest checkpoint" if self.resumes_at is not None
                 else "no checkpoint yet, a resume starts over")
        return (f"stopped by {self.signame} at step {self.stopped_at} ({where}) in {self.run_dir}; "
                "the same command with run.resume=true continues it")


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
