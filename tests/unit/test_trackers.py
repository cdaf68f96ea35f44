"""run.loggers (jetflow.trackers): a tiny run's metrics, config and report figures in TensorBoard, W&B (offline) and
MLflow (a local store), read back with each library's own reader; a resume continues the same runs."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from jetflow.cli import main
from jetflow.config import ConfigError, derive, load_config, run_loggers
from jetflow.metrics_log import read_jsonl
from jetflow.trackers import mlflow_name, step_key, tag

pytest.importorskip("wandb")
pytest.importorskip("mlflow")


def wandb_records(path: Path) -> list:
    """The records of a .wandb file, decoded by W&B's own protobuf schema (wandb.proto). The file is a
    LevelDB-style log (W&B's transaction log): a 7-byte header ':W&B', 0xBEE1, version; then 32 KiB
    blocks of chunks, each with a (crc32, length, type) header; a record is a FULL chunk or FIRST,
    MIDDLE..., LAST. wandb >= 0.22 no longer ships its Python reader of this framing."""
    from wandb.proto import wandb_internal_pb2
    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, block, records, record = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding at the end of a block
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        record = chunk if kind in (1, 2) else record + chunk  # FULL, FIRST | MIDDLE, LAST
        if kind in (1, 4):
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            records.append(parsed)
    return records


def wandb_history(run_dir: Path, run_id: str) -> tuple[list[dict], dict, int]:
    """(history rows, config, number of .wandb files) of W&B run `run_id` under <run>/wandb."""
    # one directory per W&B process: offline-run-<time>-<id>, or offline-run-<time>-<id>-<n> when a resume
    # (or the report) starts in the same second as the process before it
    files = sorted(f for f in (run_dir / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb")
                   if re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", f.parent.name))
    rows, config = [], {}
    for f in files:
        for r in wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                row = {}
                for i in r.history.item:  # a plain key, or an image's fields under nested keys
                    name = i.key or i.nested_key[0]
                    row[name] = json.loads(i.value_json) if i.key or len(i.nested_key) == 1 else "media"
                rows.append(row)
            elif kind == "config":
                config.update({i.key: json.loads(i.value_json) for i in r.config.update})
    return rows, config, len(files)


def expected(run_dir: Path) -> list[tuple[str, str, int, float]]:
    """(phase, tracker name, step, value) of every finite metric in metrics.jsonl."""
    return [(r["phase"], tag(r["phase"], k), r["step"], v) for r in read_jsonl(run_dir / "metrics.jsonl")
            for k, v in r.items() if k not in ("step", "phase") and v is not None]


def assert_every_metric_in_both(run_dir: Path) -> dict:
    from mlflow.tracking import MlflowClient
    ids = json.loads((run_dir / "trackers.json").read_text())
    rows, config, _ = wandb_history(run_dir, ids["wandb"]["id"])
    assert config["train"]["steps"] >= 2 and config["run"]["loggers"] == ["tensorboard", "wandb", "mlflow"]
    client = MlflowClient(tracking_uri=ids["mlflow"]["tracking_uri"])
    histories: dict[str, dict[int, float]] = {}
    want = expected(run_dir)
    assert len({name for _, name, _, _ in want}) > 20 and {"sft", "rl"} <= {p for p, *_ in want}
    for phase, name, step, value in want:
        assert any(row.get(step_key(phase)) == step and row.get(name) == pytest.approx(value) for row in rows), \
            (name, step)
        key = mlflow_name(name)
        if key not in histories:
            histories[key] = {m.step: m.value for m in client.get_metric_history(ids["mlflow"]["run_id"], key)}
        assert histories[key][step] == pytest.approx(value), (name, step)
    assert client.get_run(ids["mlflow"]["run_id"]).data.params["train.prompts_per_step"] == "2"
    board = tensorboard_events(run_dir)
    for _, name, step, value in want:
        assert any(e.step == step and e.value == pytest.approx(value, rel=1e-6) for e in board.Scalars(name)), name
    return ids


def tensorboard_events(run_dir: Path):
    """Every event file of <run>/tensorboard, read by TensorBoard's own EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    board = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    board.Reload()
    return board


def test_a_tiny_run_logs_every_metric_config_and_figure_to_wandb_and_mlflow_and_a_resume_continues(tmp_path):
    args = ["train", "--config", "configs/tiny.yaml", "train.sft_warmup_steps=2", "train.prompts_per_step=2",
            "rollout.group_size=2", "train.steps=2", "eval.num_prompts=0", "run.progress=false", "run.num_threads=1",
            "run.loggers=[tensorboard,wandb,mlflow]", f"run.out_dir={tmp_path}", "run.name=r"]
    assert main(args) == 0
    run_dir = tmp_path / "r"
    assert (run_dir / "mlruns" / "mlflow.db").is_file()
    ids = assert_every_metric_in_both(run_dir)

    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=ids["mlflow"]["tracking_uri"])
    figures = sorted(p.name for p in (run_dir / "report").glob("*.png"))
    assert figures and sorted(a.path.removeprefix("report/") for a in client.list_artifacts(ids["mlflow"]["run_id"],
                                                                                            "report")) \
        == sorted([*figures, "report.md"])
    rows, _, _ = wandb_history(run_dir, ids["wandb"]["id"])
    assert {f"report/{Path(f).stem}" for f in figures} <= {k for row in rows for k in row}
    assert {f"report/{Path(f).stem}" for f in figures} <= set(tensorboard_events(run_dir).Tags()["images"])

    # a resume (two more steps) continues the same W&B and MLflow runs
    assert main([*args, "train.steps=4", "run.allow_changes=[train.steps]", "run.resume=true"]) == 0
    assert json.loads((run_dir / "trackers.json").read_text()) == ids
    assert_every_metric_in_both(run_dir)
    assert max(m.step for m in client.get_metric_history(ids["mlflow"]["run_id"], "reward/mean")) == 3
    assert len(client.search_runs([client.get_run(ids["mlflow"]["run_id"]).info.experiment_id])) == 1
    assert wandb_history(run_dir, ids["wandb"]["id"])[2] >= 2  # one offline file per session, one run id


def test_run_tensorboard_is_an_alias_and_unknown_loggers_are_refused(tmp_path):
    assert run_loggers(load_config("configs/tiny.yaml", []).run) == ["tensorboard"]
    assert run_loggers(load_config("configs/tiny.yaml", ["run.tensorboard=false"]).run) == []
    assert run_loggers(load_config("configs/tiny.yaml", ["run.loggers=[mlflow]", "run.tensorboard=true"]).run) \
        == ["mlflow", "tensorboard"]
    assert derive(load_config("configs/tiny.yaml", ["run.tensorboard=false"])).loggers == ()  # the run's, derived once
    with pytest.raises(ConfigError, match=r"run.loggers: unknown logger\(s\) 'neptune'; valid loggers are "
                                          r"tensorboard, wandb, mlflow"):
        derive(load_config("configs/tiny.yaml", ["run.loggers=[neptune]"]))


def test_a_missing_tracker_library_is_one_line_with_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"run.loggers: wandb not installed: pip install 'jetflow\[trackers\]'"):
        derive(load_config("configs/tiny.yaml", ["run.loggers=[wandb]"]))
