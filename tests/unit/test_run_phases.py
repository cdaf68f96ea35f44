"""Stop requests in every phase of a run (issue 30): a real SIGTERM sent to this process while the run
is in its model load, its supervised warm-up, a held-out evaluation or its final writes is answered at
that phase's next step boundary, leaves a STOPPED directory, and `run.resume=true` finishes the run
exactly as an uninterrupted one (metrics without the clock, final weights and exports bit for bit).

Before (commit 5091338): a SIGTERM in the warm-up was answered only when the whole warm-up had ended,
which wrote its rows and its only checkpoint at its end; one during the model load or the report ended
the process with the default action (exit 143); one during the evaluation waited for the next RL step."""

from __future__ import annotations

import json
import os
import signal

import pytest
from safetensors.torch import load_file

from jetflow.config import load_config
from jetflow.metrics_log import read_metrics
from jetflow.run.stop import RunStopped
from crashes import kill_at_step

# a warm-up of 8 steps, 3 RL steps, held-out evaluations before steps 0 and 2 and after 3, checkpoints
# every 4 steps (warm-up steps included)
COMMON = ["train.sft_warmup_steps=8", "train.steps=3", "train.checkpoint_every=4", "eval.num_prompts=2",
          "eval.every=2", "train.prompts_per_step=2", "rollout.group_size=2", "run.progress=false",
          "run.tensorboard=false", "run.num_threads=1", "run.name=r"]
FILES = ("model/model.safetensors", "model-fp8/model.safetensors", "checkpoints/step_000003/model.safetensors")


def _train(out, *extra: str):
    from jetflow.run.runner import train
    return train(load_config("configs/tiny.yaml", [*COMMON, f"run.out_dir={out}", *extra]))


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The run without interruption."""
    return _train(tmp_path_factory.mktemp("whole"))


def _without_clock(run_dir, phase: str = "rl") -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
            for r in read_metrics(run_dir, phase)]


def assert_same_run(run_dir, whole) -> None:
    assert (run_dir / "COMPLETE").exists() and not (run_dir / "STOPPED").exists()
    for phase in ("sft", "rl", "eval"):
        assert _without_clock(run_dir, phase) == _without_clock(whole, phase), phase
    for name in FILES:
        a, b = load_file(str(run_dir / name)), load_file(str(whole / name))
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), name
    def summary(d) -> dict:  # the config differs in run.out_dir and run.resume only
        return {k: v for k, v in json.loads((d / "summary.json").read_text()).items()
                if k not in ("step_time_mean", "config")}
    assert summary(run_dir) == summary(whole)
    assert not [p.name for p in run_dir.rglob(".*")]  # no temporary directory or file left behind


def sigterm_on_call(monkeypatch, owner, name: str, call: int) -> dict:
    """Make `owner.name` send SIGTERM to this process at its `call`-th call (0-based), then run."""
    original, calls = getattr(owner, name), {"n": 0}

    def signalled(*args, **kwargs):
        if calls["n"] == call:
            os.kill(os.getpid(), signal.SIGTERM)
        calls["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, signalled)
    return calls


def stop_and_resume(tmp_path, monkeypatch, owner, name: str, call: int) -> tuple[RunStopped, dict, object]:
    """Run with a SIGTERM at `owner.name`'s call `call`; returns (the stop, STOPPED, run dir), with the
    interrupted run resumed by the same command (run.resume=true) to the end."""
    handler = signal.getsignal(signal.SIGTERM)
    sigterm_on_call(monkeypatch, owner, name, call)
    with pytest.raises(RunStopped) as stopped:
        _train(tmp_path, "run.resume=true")
    monkeypatch.undo()
    run_dir = tmp_path / "r"
    marked = json.loads((run_dir / "STOPPED").read_text())
    assert not (run_dir / "LOCK").exists() and not (run_dir / "COMPLETE").exists()
    assert signal.getsignal(signal.SIGTERM) == handler  # the run's handler is gone with it
    stopped.value.files = sorted(p.name for p in run_dir.iterdir())
    stopped.value.rows = {p: [r["step"] for r in read_metrics(run_dir, p)] for p in ("sft", "rl", "eval")}
    _train(tmp_path, "run.resume=true")
    return stopped.value, marked, run_dir


def test_sigterm_in_the_warmup_stops_within_one_warmup_step_and_resumes_bit_for_bit(tmp_path, monkeypatch, whole):
    from jetflow.run.warmup import Warmup
    stop, marked, run_dir = stop_and_resume(tmp_path, monkeypatch, Warmup, "step", call=5)  # during step 5
    assert (stop.phase, stop.at, stop.resumes_at) == ("warm-up", "warm-up step 6", "warm-up step 6")
    assert marked == {"signal": "SIGTERM", "phase": "warm-up", "stopped_at": "warm-up step 6",
                      "resumes_at": "warm-up step 6"}
    assert "stopped by SIGTERM at warm-up step 6 (resumes at warm-up step 6 from its newest checkpoint)" in str(stop)
    assert stop.rows == {"sft": [0, 1, 2, 3, 4, 5], "rl": [], "eval": []}  # logged as they came
    assert_same_run(run_dir, whole)


def test_a_crash_in_the_warmup_resumes_from_its_periodic_checkpoint_bit_for_bit(tmp_path, monkeypatch, whole):
    """Before, the warm-up had no checkpoint of its own: a kill lost all of it."""
    from jetflow.run.warmup import Warmup
    kill_at_step(monkeypatch, Warmup, 7)
    with pytest.raises(SystemExit):
        _train(tmp_path)
    monkeypatch.undo()
    checkpoints = tmp_path / "r" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "warmup_000004"]  # every 4 steps
    assert json.loads((checkpoints / "warmup_000004" / "state.json").read_text())["warmup_step"] == 4
    _train(tmp_path, "run.resume=true")
    assert_same_run(tmp_path / "r", whole)


def test_a_stop_request_during_the_model_load_ends_the_run_cleanly(tmp_path, monkeypatch, whole):
    from jetflow.run import runner
    stop, marked, run_dir = stop_and_resume(tmp_path, monkeypatch, runner, "place", call=0)
    assert stop.phase == "model load" and marked["resumes_at"] is None
    assert "stopped by SIGTERM during the model load (no checkpoint yet, a resume starts over)" in str(stop)
    assert stop.rows == {"sft": [], "rl": [], "eval": []}
    assert_same_run(run_dir, whole)


def test_a_stop_request_during_an_evaluation_is_answered_after_it(tmp_path, monkeypatch, whole):
    from jetflow.run.loop import RLLoop
    stop, marked, run_dir = stop_and_resume(tmp_path, monkeypatch, RLLoop, "evaluate", call=1)  # before step 2
    assert (stop.phase, stop.at, stop.resumes_at) == ("evaluation", "step 2", "step 2")
    assert stop.rows == {"sft": list(range(8)), "rl": [0, 1], "eval": [0, 2]}  # not RL step 2
    assert_same_run(run_dir, whole)


def test_a_stop_during_the_final_writes_leaves_a_run_that_finishes_on_resume(tmp_path, monkeypatch, whole):
    from jetflow.run import sequence
    stop, marked, run_dir = stop_and_resume(tmp_path, monkeypatch, sequence, "write_model_dirs", call=0)
    assert (stop.phase, stop.resumes_at) == ("final writes", "step 3")
    assert "during the final writes (after step 3)" in str(stop)
    assert "model" in stop.files and "summary.json" not in stop.files  # stopped after the model, before the summary
    assert stop.rows == {"sft": list(range(8)), "rl": [0, 1, 2], "eval": [0, 2, 3]}
    assert_same_run(run_dir, whole)


def test_a_kill_in_the_middle_of_an_export_leaves_no_partial_directory_and_the_resume_finishes(
        tmp_path, monkeypatch, whole):
    import jetflow.export as export

    def killed(*args, **kwargs):
        raise SystemExit("killed while writing model-fp8/")

    monkeypatch.setattr(export, "write_fp8_dir", killed)
    with pytest.raises(SystemExit):
        _train(tmp_path)
    monkeypatch.undo()
    run_dir = tmp_path / "r"
    assert (run_dir / "model" / "model.safetensors").exists() and not (run_dir / "model-fp8").exists()
    assert not (run_dir / "COMPLETE").exists() and not (run_dir / "summary.json").exists()
    _train(tmp_path, "run.resume=true")
    assert_same_run(run_dir, whole)


def test_a_signal_while_the_report_is_written_finishes_it(tmp_path, monkeypatch, capsys):
    """Before, the report was written with the default signal handlers back in place: SIGTERM then
    ended the process with exit 143 (here it would have ended pytest)."""
    from jetflow.cli import main
    from jetflow.run import report
    handler = signal.getsignal(signal.SIGTERM)
    sigterm_on_call(monkeypatch, report, "write_run_report", call=0)
    args = ["train", "--config", "configs/tiny.yaml", *COMMON, f"run.out_dir={tmp_path}", "train.sft_warmup_steps=0",
            "train.steps=1", "eval.num_prompts=0"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "SIGTERM: the run is at its end; finishing it and its report" in err
    assert (tmp_path / "r" / "COMPLETE").exists() and (tmp_path / "r" / "report" / "report.md").exists()
    assert signal.getsignal(signal.SIGTERM) == handler


def test_a_collective_that_failed_with_another_rank_is_one_resumable_line(monkeypatch, capsys):
    """Before: rank 0 of a torchrun job whose rank 1 was killed printed gloo's RuntimeError traceback."""
    from jetflow.cli import main
    from jetflow.run import runner
    from jetflow.run.stop import RunFault, collective_fault
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:17795. This is typically caused by a remote worker crashing.\nmore")
    fault = collective_fault(gloo, distributed=True)
    assert isinstance(fault, RunFault) and "Connection closed by peer" in str(fault)
    assert "another rank died or hung" in str(fault) and "more" not in str(fault)
    assert collective_fault(gloo, distributed=False) is None  # one process: a bug's traceback stays
    assert collective_fault(RuntimeError("size mismatch"), distributed=True) is None

    def failed(cfg):
        raise fault
    monkeypatch.setattr(runner, "train", failed)
    assert main(["train", "--config", "configs/tiny.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jetflow: error: a collective with the other ranks failed")
    assert err.strip().endswith("the same command with run.resume=true continues it")
