"""The machine misbehaving under a run (issue 44): a full disk, a read-only file system, I/O errors at
each write. Each: one line naming the file and the cause, no partial output left, the previous
checkpoint untouched, and the same command resumes once the cause is gone.

A real full disk is a small tmpfs (needs root and mount rights: skipped without); the other cases
raise the OS error at the write."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from jetflow.cli import main
from jetflow.metrics_log import MetricsLogger, read_metrics
from jetflow.model import Decoder, ModelConfig
from jetflow.train.checkpoint import latest_checkpoint, list_checkpoints, save_checkpoint
from jetflow.writes import WriteError, check_free_space

RUN = ["train", "--no-report", "--config", "configs/tiny.yaml", "train.sft_warmup_steps=0", "train.prompts_per_step=2",
       "rollout.group_size=2", "eval.num_prompts=0", "run.progress=false", "run.num_threads=1", "run.loggers=[]",
       "run.name=r", "run.resume=true", "train.checkpoint_every=1"]


def tiny_decoder() -> Decoder:
    torch.manual_seed(0)
    return Decoder(ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                               num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=32))


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs: a disk that can really fill up."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and mount rights for a small tmpfs")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave_bytes: int) -> Path:
    """A file that leaves `leave_bytes` free on `disk`."""
    filler = disk / f"filler-{uuid.uuid4().hex[:6]}"
    with open(filler, "wb") as f:
        f.truncate(0)
        free = shutil.disk_usage(disk).free - leave_bytes
        f.write(b"\0" * max(free, 0))
    return filler


def last_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jetflow: error")]
    assert len(err) == 1, err
    return err[0]


def test_disk_full_at_a_checkpoint_is_one_line_the_old_one_stays_and_the_same_command_resumes(small_disk, capsys):
    """Before: a traceback ending in `RuntimeError: basic_ios::clear: iostream error` (torch.save on a
    full disk), naming neither the disk nor the file. Now: a warning before the checkpoint (less room
    than the previous one took), then one line; step_000001 intact; freed, the same command finishes."""
    args = [*RUN, f"run.out_dir={small_disk}", "train.steps=3"]
    assert main([*args[:-1], "train.steps=1"]) == 0  # step_000001 (and the run's model/) on the small disk
    run_dir = small_disk / "r"
    before = (run_dir / "checkpoints" / "step_000001" / "manifest.json").read_text()
    filler = fill(small_disk, 300_000)
    capsys.readouterr()
    assert main([*args, "run.allow_changes=[train.steps]"]) == 2
    captured = capsys.readouterr()
    assert "will likely not fit" in captured.err  # the early warning, before the write
    err = [line for line in captured.err.splitlines() if line.startswith("jetflow: error")]
    assert len(err) == 1 and "No space left on device [ENOSPC]" in err[0] and str(run_dir) in err[0], err
    assert "cannot write checkpoint file" in err[0] and "step_000001 and older are intact" in err[0]
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_000001"]
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))  # its partial output removed
    assert (run_dir / "checkpoints" / "step_000001" / "manifest.json").read_text() == before
    assert latest_checkpoint(run_dir).name == "step_000001"
    assert all(line.endswith("}") for line in (run_dir / "metrics.jsonl").read_text().splitlines())

    filler.unlink()
    assert main([*args, "run.allow_changes=[train.steps]"]) == 0
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
    assert (run_dir / "COMPLETE").exists()


def test_a_read_only_disk_at_a_checkpoint_is_one_line_and_touches_nothing(small_disk):
    model = tiny_decoder()
    save_checkpoint(small_disk, 1, model, {}, {"next_step": 1, "sft_done": True})
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        with pytest.raises(WriteError, match=r"cannot write checkpoint file .*step_000002: Read-only file system "
                                             r"\[EROFS\]; make that file system writable.*step_000001 and older"):
            save_checkpoint(small_disk, 2, model, {}, {"next_step": 2, "sft_done": True})
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    assert latest_checkpoint(small_disk).name == "step_000001"


def test_torch_saves_unexplained_runtime_error_on_a_full_disk_is_named_from_the_disk(tmp_path, monkeypatch):
    """torch.save says only `[enforce fail at inline_container.cc] unexpected pos` on a full disk: the
    cause is read from the file system (here: no space left)."""
    import jetflow.train.checkpoint as ckpt
    import jetflow.writes as writes
    model = tiny_decoder()
    save_checkpoint(tmp_path, 1, model, {}, {"next_step": 1, "sft_done": True})

    def full(obj, path, *a, **k):
        Path(path).write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    monkeypatch.setattr(ckpt.torch, "save", full)
    monkeypatch.setattr(writes.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 30, 10 << 30, 0))
    with pytest.raises(WriteError, match=r"checkpoint file .*step_000002/trainer.pt: No space left on device"):
        save_checkpoint(tmp_path, 2, model, {}, {"next_step": 2, "sft_done": True})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000001"]


def test_free_space_is_checked_before_a_checkpoint_against_the_previous_ones_size(tmp_path, monkeypatch, capsys):
    import jetflow.writes as writes
    monkeypatch.setattr(writes.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100, 100 - 15, 15 << 20))
    check_free_space(tmp_path, 10 << 20, "checkpoint")
    assert "has 15.0 MiB free: room for one more checkpoint (about 10.0 MiB each)" in capsys.readouterr().err
    check_free_space(tmp_path, 20 << 20, "checkpoint")
    assert "the next checkpoint (about 20.0 MiB, as large as the previous one) will likely not fit" in \
        capsys.readouterr().err
    check_free_space(tmp_path, 5 << 20, "checkpoint")
    assert capsys.readouterr().err == ""


class FailingFile:
    """A raw file whose write takes part of the data, then fails like a full disk or a bad sector."""

    def __init__(self, real, code: int):
        self.real, self.code = real, code

    def write(self, data) -> int:
        self.real.write(bytes(data[:len(data) // 2]))
        raise OSError(self.code, os.strerror(self.code))

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("code, cause", [(errno.ENOSPC, "No space left on device [ENOSPC]"),
                                         (errno.EIO, "Input/output error [EIO]")])
def test_a_failed_metrics_row_is_one_line_and_cut_off(tmp_path, code, cause):
    log = MetricsLogger(tmp_path)
    log.log(0, {"reward/mean": 0.5})
    log._file = FailingFile(log._file, code)
    with pytest.raises(WriteError, match=rf"cannot write the metrics file {tmp_path}/metrics.jsonl: "
                                         rf"{cause.replace('[', '.').replace(']', '.')}"):
        log.log(1, {"reward/mean": 0.25})
    log._file = log._file.real
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n")  # no half row


def test_an_io_error_writing_the_final_model_is_one_line_and_the_same_command_finishes(tmp_path, monkeypatch,
                                                                                        capsys):
    import jetflow.export as export
    real = export.save_hf_weights
    monkeypatch.setattr(export, "save_hf_weights", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO,
                                                                                                 "Input/output error")))
    args = [*RUN, f"run.out_dir={tmp_path}", "train.steps=1"]
    assert main(args) == 2
    line = last_error_line(capsys)
    assert f"cannot write the final model {tmp_path}/r/model: Input/output error [EIO]" in line
    assert "checkpoints are intact" in line
    assert not (tmp_path / "r" / "model").exists() and not (tmp_path / "r" / ".tmp-model").exists()
    monkeypatch.setattr(export, "save_hf_weights", real)
    assert main(args) == 0 and (tmp_path / "r" / "COMPLETE").exists() and (tmp_path / "r" / "model").is_dir()


def test_a_full_disk_in_an_export_or_the_summary_is_one_line_without_partial_files(tmp_path, monkeypatch):
    import jetflow.export as export
    from jetflow.config import Config
    from jetflow.precision import QuantRecipe
    from jetflow.run.files import write_summary

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(export, "save_file", full)
    with pytest.raises(WriteError, match=rf"cannot write the FP8 export {tmp_path}/out: No space left"):
        export.export_fp8(tiny_decoder(), tmp_path / "out", QuantRecipe())
    assert list((tmp_path / "out").iterdir()) == []

    monkeypatch.setattr(Path, "write_text", lambda self, text: full())
    with pytest.raises(WriteError, match=rf"cannot write the run summary {tmp_path}/summary.json: No space .*"
                                         r"run.resume=true finishes it"):
        write_summary(tmp_path, Config())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no summary, no COMPLETE, no temporary file


def test_a_read_only_output_directory_is_one_line_before_anything_is_loaded(small_disk, capsys):
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        assert main([*RUN, f"run.out_dir={small_disk}/runs", "train.steps=1"]) == 2
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    assert f"cannot write the run directory {small_disk}/runs/r: Read-only file system [EROFS]" in \
        last_error_line(capsys)


def test_a_full_disk_while_drawing_the_report_is_one_warning_and_leaves_no_partial_report(tmp_path, monkeypatch,
                                                                                          capsys):
    import matplotlib.figure

    from jetflow.config import Config, config_text
    from jetflow.run.report import report_at_end
    (tmp_path / "config.yaml").write_text(config_text(Config()))
    rows = [{"step": s, "phase": "rl", "reward/mean": 0.1 * s, "mismatch/kl_k3": 1e-4, "time/step": 1.0}
            for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def full(self, path, *a, **k):
        Path(path).write_bytes(b"half a png")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    assert report_at_end(tmp_path) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write the run report {tmp_path}/report: No space left on device " \
        "[ENOSPC]" in err and f"retry with `jetflow report {tmp_path}`" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "metrics.jsonl"]


def test_a_full_disk_at_the_vllm_engines_start_up_checkpoint_is_one_line_without_a_partial_directory(tmp_path,
                                                                                                   monkeypatch):
    from jetflow.model import CharTokenizer
    from jetflow.run import vllm_side

    def full(model, out_dir):
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{}")  # what a writer leaves before the disk fills
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(vllm_side, "save_hf_dir", full)
    with pytest.raises(WriteError, match=rf"cannot write the vLLM engine's start-up checkpoint {tmp_path}/engine: "
                                         r"No space left on device \[ENOSPC\].*run.resume=true continues it"):
        vllm_side.write_engine_checkpoint(tiny_decoder(), CharTokenizer("ab"), tmp_path / "engine", "bf16", None)
    assert not (tmp_path / "engine").exists()
