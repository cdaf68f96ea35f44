"""torchrun with jetflow's errors: `python -m jetflow.launch.torchrun` takes torchrun's arguments
(torch.distributed.run) and runs it, but a failed worker ends it with one line instead of torchrun's
traceback and failure table:

    python -m jetflow.launch.torchrun --nproc_per_node 2 -m jetflow.cli train --config configs/tiny.yaml ...

A rank killed by a signal (SIGKILL: the out-of-memory killer, a node's reaper) is named with its signal;
the other ranks, whose collectives fail, print their own line (jetflow.run.stop.RunFault) and torchrun
stops them. The run directory keeps its newest checkpoint, which the same command with run.resume=true
continues. A rank that exited with a jetflow exit code (a fault, a stop request, a user error) already
said why in its own line; the launcher exits with that code. A stop signal to the launcher (SLURM's
SIGUSR1 before the time limit, a SIGTERM) goes on to the ranks as with torchrun, which checkpoint and say
so; the launcher then exits with 128 + the signal's number, without torchrun's traceback.
templates/torchrun.sh runs this.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import TYPE_CHECKING

from jetflow.run.stop import EXIT_FAULT, EXIT_STOPPED

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

RESUME = "the run directory resumes from its newest checkpoint: the same command with run.resume=true continues it"


def _root_cause(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """(rank, failure) that started it: a rank killed by a signal torchrun did not send (it sends SIGTERM to
    the others once one failed), else the first by time (torchrun's timestamps are whole seconds)."""
    killed = [r for r, f in failures.items() if f.exitcode < 0 and -f.exitcode != signal.SIGTERM]
    if killed:
        rank = min(killed)
        return rank, failures[rank]
    rank = min(failures, key=lambda r: (failures[r].timestamp, r))
    return rank, failures[rank]


def describe(failures: dict[int, ProcessFailure]) -> tuple[str | None, int]:
    """The one line for these worker failures (None where the rank said it itself) and the exit code."""
    rank, failure = _root_cause(failures)
    if failure.exitcode < 0:
        return (f"jetflow: error: rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}; the other "
                f"ranks stopped; {RESUME}"), EXIT_FAULT
    if all(f.exitcode == EXIT_STOPPED for f in failures.values()):
        return None, EXIT_STOPPED
    if failure.exitcode in (EXIT_FAULT, 2):  # RunFault / UserError lines, printed by the ranks
        return None, failure.exitcode
    return f"jetflow: error: rank {rank} (pid {failure.pid}) exited with code {failure.exitcode} (its output is " \
           f"above); {RESUME}", failure.exitcode


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its per-rank failure lines
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as e:
        line, code = describe(e.failures)
        if line:
            print(line, file=sys.stderr)
        return code
    except SignalException as e:  # torchrun was signalled: it passed the signal on, and waited for the ranks
        return 128 + int(e.sigval)  # (who stop at a step boundary, with a checkpoint, and say so in one line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
