"""How a run ends early and stays resumable.

Stop requests: SIGTERM (`kill`, a SLURM preemption), SIGINT (Ctrl-C) and SIGUSR1 (what SLURM's
`--signal=USR1@T` sends T seconds before the time limit) ask a run to stop at the next step boundary of
whatever phase it is in: the model load, a supervised warm-up step, a held-out evaluation, an RL step,
one of the final writes. The state is checkpointed where there is any, the run ends with `RunStopped`,
the run directory gets a STOPPED file (what the SLURM templates requeue on: a torchrun agent does not
pass exit codes on) and the CLI exits with EXIT_STOPPED. The same command with run.resume=true
continues from that checkpoint. A second Ctrl-C stops at once (KeyboardInterrupt, no checkpoint).

Faults: a rank or actor that died or hung ends the run with `RunFault` (one line, exit 1); its
checkpoints are intact, so it resumes like a stopped run.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request, resumable
EXIT_FAULT = 1
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
RESUME_HINT = "the same command with run.resume=true continues it"


class RunStopped(Exception):
    """The run stopped on a signal at a step boundary of `phase` (model load | warm-up | evaluation |
    rl | final writes), `at` a position such as "step 3" or "warm-up step 40"; resumable from
    `resumes_at` (the newest checkpoint's position, set by the rank that marks the run STOPPED)."""

    def __init__(self, signame: str, phase: str, at: str, run_dir: Path):
        super().__init__(signame, phase, at, run_dir)
        self.signame, self.phase, self.at, self.run_dir = signame, phase, at, run_dir
        self.resumes_at: str | None = None

    def where(self) -> str:
        return {"model load": "during the model load", "evaluation": f"after the held-out evaluation before {self.at}",
                "final writes": f"during the final writes (after {self.at})"}.get(self.phase, f"at {self.at}")

    def __str__(self) -> str:
        resume = (f"resumes at {self.resumes_at} from its newest checkpoint" if self.resumes_at is not None
                  else "no checkpoint yet, a resume starts over")
        return f"stopped by {self.signame} {self.where()} ({resume}) in {self.run_dir}; {RESUME_HINT}"


class RunFault(RuntimeError):
    """A rank or actor of the run died or hung (not the user's doing, nor a bug of jetflow's): the CLI
    prints it as one line and exits EXIT_FAULT; the run directory resumes from its newest checkpoint."""


COLLECTIVE_FAILURES = ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer", "Timed out")


def collective_fault(e: BaseException, distributed: bool) -> RunFault | None:
    """A collective that failed because another rank died (its connection closed) or hung (the
    process group's timeout), as a RunFault; None for any other error."""
    text = str(e).strip()
    if not (distributed and isinstance(e, RuntimeError) and not isinstance(e, RunFault)
            and any(s in text for s in COLLECTIVE_FAILURES)):
        return None
    first = (text.splitlines() or [""])[0]
    return RunFault(f"a collective with the other ranks failed ({first}): another rank died or hung; the checkpoints "
                    f"are intact: {RESUME_HINT}")


class StopRequests:
    """Catches the stop signals while it is entered (main thread only) and records the first.
    `after_run`: the run is past its last stop point (its summary, its report): a signal then only
    says so, and the run finishes."""

    def __init__(self, after_run: bool = False):
        self.signame: str | None = None
        self.after_run = after_run
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signame == "SIGINT":
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if self.signame is None:
            self.signame = signal.Signals(signum).name
            if self.after_run:
                print(f"[jetflow] {self.signame}: the run is at its end; finishing it and its report (Ctrl-C "
                      "again to stop at once)", file=sys.stderr)
            else:
                print(f"[jetflow] {self.signame}: stopping after this step (checkpoint, then exit {EXIT_STOPPED}); "
                      "Ctrl-C again to stop at once", file=sys.stderr)

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def take_back(self) -> None:
        """Handle the signals again after a library installed its own (ray.init sets SIGTERM to exit)."""
        if self._previous:
            for s in SIGNALS:
                signal.signal(s, self._handle)

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
