"""jetflow.launch.torchrun's one line for torchrun's worker failures (the real kill under torchrun:
tests/integration/test_fsdp.py)."""

import signal

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from jetflow.launch.torchrun import RESUME, describe
from jetflow.run.stop import EXIT_FAULT, EXIT_STOPPED


def _failure(exitcode: int, pid: int, timestamp: int = 100) -> ProcessFailure:
    f = ProcessFailure(local_rank=0, pid=pid, exitcode=exitcode, error_file="<N/A>")
    f.timestamp = timestamp
    return f


def test_the_rank_killed_by_a_signal_is_named_not_the_ones_torchrun_terminated():
    # torchrun's timestamps are whole seconds: rank 0 (SIGTERMed by torchrun) ties with rank 1 (SIGKILLed)
    failures = {0: _failure(-signal.SIGTERM, 10), 1: _failure(-signal.SIGKILL, 11)}
    line, code = describe(failures)
    assert line == f"jetflow: error: rank 1 (pid 11) was killed by SIGKILL; the other ranks stopped; {RESUME}"
    assert code == EXIT_FAULT and "\n" not in line


def test_ranks_that_said_why_themselves_pass_their_exit_code_on():
    assert describe({0: _failure(EXIT_STOPPED, 10), 1: _failure(EXIT_STOPPED, 11)}) == (None, EXIT_STOPPED)
    assert describe({1: _failure(2, 11)}) == (None, 2)  # a user error's line
    assert describe({0: _failure(EXIT_FAULT, 10, 101), 1: _failure(-signal.SIGTERM, 11, 102)}) == (None, EXIT_FAULT)


def test_another_exit_code_points_at_the_ranks_output():
    line, code = describe({1: _failure(3, 11)})
    assert code == 3 and line.startswith("jetflow: error: rank 1 (pid 11) exited with code 3 (its output is above)")
