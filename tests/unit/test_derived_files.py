"""Derived files never block a resume (issue 30): metrics.jsonl, mismatch_positions.jsonl, summary.json,
the report and TensorBoard events are derived from the run, whose truth is its checkpoints. A damaged
row is set aside (<file>.damaged) with a warning that names it; a path in the way is moved aside.
Also: the checkpoint pointer, the run's config.yaml, and config values that failed late."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from jetflow.cli import main
from jetflow.config import ConfigError, load_config
from jetflow.metrics_log import MetricsLogger, read_jsonl, read_metrics
from jetflow.model import CheckpointError, Decoder, ModelConfig
from jetflow.run.files import tidy_for_resume
from jetflow.train.checkpoint import checkpoint_name, latest_checkpoint, save_checkpoint

RUN = ["--config", "configs/tiny.yaml", "train.sft_warmup_steps=0", "train.steps=3", "train.checkpoint_every=1",
       "train.prompts_per_step=2", "rollout.group_size=2", "eval.num_prompts=0", "run.progress=false",
       "run.tensorboard=false", "run.num_threads=1", "run.name=r"]


def rows_text(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_a_garbled_middle_metrics_line_is_reported_and_set_aside_and_the_run_resumes(tmp_path, capsys):
    """Before (5091338): `run.resume=true` exited 1 with `ValueError: .../metrics.jsonl: line 2 is not
    JSON` (a traceback), and the run could not go on until the file was repaired by hand."""
    assert main(["train", "--no-report", *RUN, f"run.out_dir={tmp_path}"]) == 0
    run_dir = tmp_path / "r"
    # as if stopped after step 2's checkpoint, with the row of step 1 garbled on disk
    for name in ("COMPLETE", "summary.json"):
        (run_dir / name).unlink()
    shutil.rmtree(run_dir / "checkpoints" / "step_000003")
    (run_dir / "checkpoints" / "latest").write_text("step_000002")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    garbled = lines[1][:40] + "\x00\x00 garbage\n"
    (run_dir / "metrics.jsonl").write_text(lines[0] + garbled + "".join(lines[2:]))
    capsys.readouterr()

    assert main(["train", "--no-report", *RUN, f"run.out_dir={tmp_path}", "run.resume=true"]) == 0
    err = capsys.readouterr().err
    assert "1 damaged line(s) in" in err and "metrics.jsonl line 2 (not JSON" in err
    assert "set aside in metrics.jsonl.damaged; the run goes on without it" in err
    assert "has no rows for RL step(s) 1; the run goes on from its checkpoint without them" in err
    assert (run_dir / "metrics.jsonl.damaged").read_text() == "# line 2: " + err.split("line 2 (")[1].split(")")[0] \
        + "\n" + garbled
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 2] and (run_dir / "COMPLETE").exists()


def test_every_kind_of_damaged_row_is_skipped_by_readers_and_set_aside_on_resume(tmp_path, capsys):
    """Before: a row that was JSON but not an object was a TypeError, one without `phase` a KeyError, a
    line that was not UTF-8 a UnicodeDecodeError; all on resume, all tracebacks."""
    good = [{"step": s, "phase": "rl", "reward/mean": 0.1 * s} for s in range(4)]
    bad = [b"[1, 2]", b'{"x": 1}', b'{"step": "one", "phase": "rl"}', b"\xff\xfe{}", b"\x00\x00\x00", b"{"]
    data = b"".join(json.dumps(r).encode() + b"\n" + line + b"\n" for r, line in zip(good, bad[:4]))
    data += bad[4] + b"\n" + bad[5] + b"\n" + b'{"step": 4, "phase": "rl", "rew'  # and a torn last line
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(data)
    assert read_metrics(tmp_path) == good
    err = capsys.readouterr().err
    assert "warning: skipped 6 damaged line(s)" in err and "metrics.jsonl line 2 (not a JSON object but a list)" in err
    assert "line 4 (no step, phase)" in err and "line 6 (step 'one' is not a whole number)" in err and "and 3 more" in err

    tidy_for_resume(tmp_path, {"next_step": 3, "sft_done": True})
    assert read_jsonl(path) == good[:3] and capsys.readouterr().err.count("warning") == 1
    damaged = (tmp_path / "metrics.jsonl.damaged").read_bytes()
    assert all(line in damaged for line in bad) and b"# line 8: not UTF-8 text" in damaged
    assert b'"step": 4' not in damaged  # the torn last line is dropped, not damage


def test_damaged_positions_file_tensorboard_and_metrics_paths_are_set_aside(tmp_path, capsys):
    """Before: a garbled mismatch_positions.jsonl line made the end-of-run report fail; a file where
    tensorboard/ belongs (or a directory where metrics.jsonl belongs) made the resume exit 2."""
    from jetflow.run.report import position_curve
    (tmp_path / "mismatch_positions.jsonl").write_text('garbage\n{"step": 0, "kl_k3": [0.5], "count": [2]}\n')
    tidy_for_resume(tmp_path, {})
    assert position_curve(tmp_path) == ([0], [0.5])
    assert "mismatch_positions.jsonl line 1 (not JSON" in capsys.readouterr().err

    (tmp_path / "tensorboard").write_text("not a directory")
    (tmp_path / "metrics.jsonl").mkdir()
    log = MetricsLogger(tmp_path, loggers=["tensorboard"])
    log.log(0, {"reward/mean": 1.0})
    log.close()
    err = capsys.readouterr().err
    assert "tensorboard is not a directory; set aside as tensorboard.damaged" in err
    assert "metrics.jsonl is not a file; set aside as metrics.jsonl.damaged" in err
    assert (tmp_path / "tensorboard").is_dir() and any((tmp_path / "tensorboard").iterdir())
    assert read_metrics(tmp_path) == [{"step": 0, "phase": "rl", "reward/mean": 1.0}]


def test_lost_rows_and_lost_checkpoints_are_named_on_resume(tmp_path, capsys):
    """Before: a resume without metrics.jsonl, or without any checkpoint, went on silently (the summary
    then counted only the steps after the resume; a run without checkpoints silently started over)."""
    tidy_for_resume(tmp_path, {"next_step": 4, "sft_done": True})
    assert "metrics.jsonl is missing; the run goes on from its checkpoint" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text(rows_text([{"step": s, "phase": "rl"} for s in range(3)]))
    tidy_for_resume(tmp_path, {})
    assert "has no checkpoint: starting over; its 3 metric row(s) are dropped" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def tiny_decoder() -> Decoder:
    torch.manual_seed(0)
    return Decoder(ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                               num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=32))


def test_warmup_checkpoints_come_before_the_rl_ones_and_a_garbled_pointer_falls_back(tmp_path, capsys):
    """Before: a `latest` pointer that was not UTF-8 made the resume crash (UnicodeDecodeError)."""
    model = tiny_decoder()
    for warmup_step in (4, 8):
        save_checkpoint(tmp_path, 0, model, {}, {"next_step": 0, "sft_done": False, "warmup_step": warmup_step},
                        name=checkpoint_name(0, warmup_step))
    root = tmp_path / "checkpoints"
    assert latest_checkpoint(tmp_path) == root / "warmup_000008"
    save_checkpoint(tmp_path, 0, model, {}, {"next_step": 0, "sft_done": True})  # the warm-up's end
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000000", "warmup_000008"]  # two kept
    (root / "latest").write_bytes(b"\xff\x00junk")
    assert latest_checkpoint(tmp_path) == root / "step_000000"
    assert "latest (unreadable: 'utf-8' codec can't decode" in capsys.readouterr().err
    (root / "step_000000" / "rng.pt").unlink()  # the newest damaged: the warm-up's last one
    (root / "latest").write_text("step_000000")
    assert latest_checkpoint(tmp_path) == root / "warmup_000008"
    save_checkpoint(tmp_path, 0, model, {}, {"next_step": 0, "sft_done": True})  # replaced whole
    assert latest_checkpoint(tmp_path) == root / "step_000000"
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    (root / "latest").write_text("../../etc")  # not a checkpoint's name: damage, never a path outside the run
    assert latest_checkpoint(tmp_path) == root / "step_000000"
    assert "latest (names '../../etc', not a checkpoint)" in capsys.readouterr().err
    shutil.rmtree(root / "step_000000")
    shutil.rmtree(root / "warmup_000008")
    with pytest.raises(CheckpointError, match=r"no intact checkpoint .*names '../../etc'"):
        latest_checkpoint(tmp_path)


def test_a_damaged_config_yaml_on_resume_says_how_to_go_on(tmp_path, capsys):
    """Before: one line, but only `not valid YAML (...)`, not what to do."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("model: [unclosed\n")
    assert main(["train", "--no-report", *RUN, f"run.out_dir={tmp_path}", "run.resume=true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.yaml is damaged" in err and "delete it to resume" in err


@pytest.mark.parametrize("override, message", [
    # before (5091338): a RuntimeError / ValueError traceback when the model was built (exit 1)
    ("model.tiny.hidden_size=0", r"model.tiny.hidden_size=0 is out of range; it must be >= 1"),
    ("model.tiny.num_kv_heads=3", r"model.tiny.num_heads=4 must be a multiple of num_kv_heads=3"),
    # before: ran a model without layers, exit 0
    ("model.tiny.num_layers=0", r"model.tiny.num_layers=0 is out of range; it must be >= 1"),
    # before: a TypeError traceback at the first RL step
    ("algo.correction_params={bogus: 1}", r"algo.correction_params: bogus is not a parameter of none"),
    ("algo.correction=token_tis", None),  # its own parameters pass
    # before: accepted (a ratio clipped below at a negative value; a memory share over 1)
    ("algo.clip_low=1.5", r"algo.clip_low=1.5 is out of range; it must be in \[0, 1\)"),
    ("rollout.vllm_gpu_memory_utilization=2", r"rollout.vllm_gpu_memory_utilization=2.0 is out of range"),
    # before: a RuntimeError traceback from torch
    ("run.num_threads=-1", r"run.num_threads=-1 is out of range"),
    ("run.ray_num_cpus=-1", r"run.ray_num_cpus=-1 is out of range"),
    # before: wrote the run outside run.out_dir (/tmp/c3/cfg/../x), exit 0
    ("run.name=../x", r"run.name='../x' is out of range; it must be one directory name"),
    # before: accepted; the change it meant to allow was refused later under its real name
    ("run.allow_changes=[trian.steps]", r"run.allow_changes: trian.steps is not a config key"),
])
def test_config_values_that_failed_late_are_refused_up_front(override, message, tmp_path):
    from jetflow.run.validate import validate_run
    cfg = load_config("configs/tiny.yaml", [f"run.out_dir={tmp_path}", override])
    if message is None:
        validate_run(cfg)
        return
    with pytest.raises(ConfigError, match=message):
        validate_run(cfg)
    assert not (tmp_path / "tiny").exists()


def test_an_archived_metrics_file_is_read_where_the_plain_one_is_absent(tmp_path):
    """results/ keeps a finished run's per-step files gzipped (metrics.jsonl.gz): the readers take it."""
    import gzip
    rows = [{"step": 0, "phase": "rl", "x": 1.0}, {"step": 0, "phase": "eval", "eval/pass@1": 0.5}]
    (tmp_path / "metrics.jsonl.gz").write_bytes(gzip.compress(rows_text(rows).encode()))
    assert read_jsonl(tmp_path / "metrics.jsonl") == rows
    assert read_metrics(tmp_path, "eval") == rows[1:]
    (tmp_path / "metrics.jsonl").write_text(rows_text(rows[:1]))  # the plain file, where there is one, wins
    assert read_jsonl(tmp_path / "metrics.jsonl") == rows[:1]
