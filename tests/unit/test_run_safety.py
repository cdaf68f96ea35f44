"""Faults and bad input that used to lose or corrupt a run (issue 15): each case as it failed before."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from jetflow.cli import main
from jetflow.metrics_log import MetricsLogger, read_metrics
from jetflow.model import CheckpointError, Decoder, ModelConfig, save_hf_dir
from jetflow.run.files import tidy_for_resume
from jetflow.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


def tiny_decoder() -> Decoder:
    torch.manual_seed(0)
    return Decoder(ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                               num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=32))


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    """A kill in the middle of a write leaves half a JSON line; before, the resume's json.loads crashed
    (and a row appended after it would have merged with it)."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "phase": "rl", "reward/mean": s / 10} for s in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "phase": "rl", "rew')
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    tidy_for_resume(tmp_path, {"next_step": 2, "sft_done": False})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1]
    log = MetricsLogger(tmp_path)
    log.log(2, {"reward/mean": 0.5})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    assert not (tmp_path / "metrics.jsonl.damaged").exists()  # a torn last line is no damage


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_a_checkpoint_crafted_to_run_code_is_refused(tmp_path):
    """Resume unpickled trainer.pt and rng.pt with weights_only=False: any code in them ran."""
    model = tiny_decoder()
    save_checkpoint(tmp_path, 1, model, {"version": 1, "optimizer": {"state": {}}}, {"next_step": 1, "sft_done": False})
    ckpt = latest_checkpoint(tmp_path)
    state, meta = load_checkpoint(ckpt, tiny_decoder())  # an honest checkpoint loads (weights_only=True)
    assert state["version"] == 1 and meta["next_step"] == 1

    torch.save({"version": 1, "payload": _RunsCode()}, ckpt / "trainer.pt")
    with pytest.raises(CheckpointError, match=r"trainer.pt: refused to load, it holds more than tensors"):
        load_checkpoint(ckpt, tiny_decoder())


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    """Before, a checkpoint damaged after it was written (a truncated copy, a bad disk) made the resume
    crash in safetensors, or load garbage; now its manifest's sha256 names the damage and the resume
    takes the previous checkpoint."""
    model = tiny_decoder()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, {"version": step}, {"next_step": step, "sft_done": True})
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000001", "step_000002"]
    assert json.loads((root / "step_000002" / "manifest.json").read_text()).keys() == {
        "model.safetensors", "trainer.pt", "rng.pt", "state.json"}
    assert latest_checkpoint(tmp_path) == root / "step_000002" and capsys.readouterr().err == ""

    weights = root / "step_000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])  # truncated: a copy that did not finish
    assert latest_checkpoint(tmp_path) == root / "step_000001"
    err = capsys.readouterr().err
    assert "step_000002 (model.safetensors does not match its sha256" in err and "resuming from step_000001" in err

    (root / "latest").write_text("step_000009")  # the pointer names a directory that is gone
    assert latest_checkpoint(tmp_path) == root / "step_000001"
    (root / "step_000001" / "rng.pt").unlink()
    with pytest.raises(CheckpointError, match=r"no intact checkpoint .*step_000009 \(named by latest, missing\).*"
                                              r"step_000002 .*step_000001 \(missing rng.pt\)"):
        latest_checkpoint(tmp_path)
    assert latest_checkpoint(tmp_path / "elsewhere") is None  # no checkpoint at all: a fresh start


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    """Before: a RuntimeError traceback from load_state_dict (size mismatch)."""
    save_checkpoint(tmp_path, 1, tiny_decoder(), {}, {"next_step": 1, "sft_done": True})
    other = Decoder(ModelConfig(model_type="llama", vocab_size=32, hidden_size=32, intermediate_size=32,
                                num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=32))
    with pytest.raises(CheckpointError, match=r"does not match the model .*size mismatch.*was the run's model changed"):
        load_checkpoint(latest_checkpoint(tmp_path), other)


def test_honest_rng_state_round_trips_under_weights_only(tmp_path):
    model = tiny_decoder()
    random.seed(5)
    torch.manual_seed(5)
    save_checkpoint(tmp_path, 0, model, {}, {"next_step": 0, "sft_done": True})
    expected = (random.random(), torch.rand(3))
    random.seed(6)
    torch.manual_seed(6)
    load_checkpoint(latest_checkpoint(tmp_path), model)
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])


def test_export_into_its_own_source_directory_is_refused(tmp_path, capsys):
    """`jetflow export --model X --out X` overwrote X's weights with the FP8 export."""
    save_hf_dir(tiny_decoder(), tmp_path / "m")
    before = (tmp_path / "m" / "model.safetensors").read_bytes()
    assert main(["export", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "m" / ".." / "m")]) == 2
    assert "is the source model's directory" in capsys.readouterr().err
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before


def test_export_into_a_non_empty_directory_is_refused_unless_overwrite(tmp_path, capsys):
    """Before: it replaced whatever config.json and weights the directory held, silently."""
    save_hf_dir(tiny_decoder(), tmp_path / "m")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text('{"mine": true}')
    args = ["export", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "out")]
    assert main(args) == 2
    assert "is not empty" in capsys.readouterr().err
    assert (tmp_path / "out" / "config.json").read_text() == '{"mine": true}'
    assert main([*args, "--overwrite"]) == 0 and (tmp_path / "out" / "model.safetensors").exists()


def test_resume_with_a_changed_config_is_refused_unless_allowed_and_then_takes_effect(tmp_path):
    """`run.resume=true` with a changed config ran silently, overwrote config.yaml, and the restored
    scheduler kept the old learning rate."""
    from jetflow.config import ConfigError, load_config
    from jetflow.run.runner import train
    from jetflow.train.trainer import lr_lambda

    base = ["train.sft_warmup_steps=0", "train.prompts_per_step=2", "rollout.group_size=2", "run.progress=false",
            "run.tensorboard=false", f"run.out_dir={tmp_path}", "run.name=r"]
    run_dir = train(load_config("configs/tiny.yaml", [*base, "train.steps=1"]))
    saved = (run_dir / "config.yaml").read_text()
    changed = [*base, "train.steps=2", "train.lr=1e-3", "run.resume=true"]
    with pytest.raises(ConfigError, match=r"train.lr, train.steps differ from its config.yaml.*"
                                          r"run.allow_changes=\[train.lr,train.steps\]"):
        train(load_config("configs/tiny.yaml", changed))
    assert (run_dir / "config.yaml").read_text() == saved  # untouched

    train(load_config("configs/tiny.yaml", [*changed, "run.allow_changes=[train.lr,train.steps]"]))
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    # step 1 runs at the new lr on the new schedule (2 steps, cosine to 0.1), not the checkpoint's
    assert rows[1]["train/lr"] == pytest.approx(1e-3 * lr_lambda(0, 2, 0.1)(1))
    assert "lr: 0.001" in (run_dir / "config.yaml").read_text()


def test_a_run_directory_has_one_owner_and_a_dead_owners_lock_is_taken_over(tmp_path, capsys):
    """Two runs with the same name both ran and interleaved metrics.jsonl."""
    import socket
    import subprocess

    from jetflow.config import load_config
    from jetflow.run.files import RunDirectoryInUse
    from jetflow.run.runner import train

    base = ["train.sft_warmup_steps=0", "train.prompts_per_step=2", "rollout.group_size=2", "train.steps=1",
            "run.progress=false", "run.tensorboard=false", f"run.out_dir={tmp_path}", "run.name=r", "run.resume=true"]
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    lock = run_dir / "LOCK"
    live = os.getppid()  # alive for the whole test, and not this process
    lock.write_text(json.dumps({"pid": live, "host": socket.gethostname()}))
    with pytest.raises(RunDirectoryInUse, match=rf"run directory {run_dir} is in use by pid {live} on"):
        train(load_config("configs/tiny.yaml", base))
    assert not (run_dir / "metrics.jsonl").exists()

    dead = subprocess.Popen(["true"])
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    train(load_config("configs/tiny.yaml", base))
    assert f"taking over {lock} from pid {dead.pid}, which is gone" in capsys.readouterr().err
    assert (run_dir / "COMPLETE").exists() and not lock.exists()  # released at the end


def _cli_train(tmp_path, name: str, *extra: str) -> list[str]:
    import sys
    return [sys.executable, "-m", "jetflow.cli", "train", "--no-report", "--config", "configs/tiny.yaml", "train.sft_warmup_steps=0",
            "train.prompts_per_step=2", "rollout.group_size=2", "train.steps=60", "run.num_threads=1",
            "run.progress=false", "run.tensorboard=false", f"run.out_dir={tmp_path}", f"run.name={name}",
            "run.resume=true", *extra]


def _rows_without_clock(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in read_metrics(run_dir)]


def test_sigterm_checkpoints_at_the_step_boundary_and_the_same_command_resumes_bit_exact(tmp_path):
    """SIGTERM (a SLURM preemption) ended the run with no checkpoint. Now: a checkpoint at the next
    step boundary, exit code 75, and the same command (run.resume=true) finishes the run exactly as an
    uninterrupted one."""
    import re
    import signal
    import subprocess
    import time

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # held-out evaluations only before the first RL step and after the last, so the signal lands in an RL
    # step (a busy machine once delivered it during step 5's evaluation, a stop the test did not expect)
    command = _cli_train(tmp_path, "r", "eval.every=0")
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    metrics = tmp_path / "r" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count('"phase": "rl"') >= 3):  # 3 RL steps (eval rows too)
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 3"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-2000:]
    stopped = re.search(r"stopped by SIGTERM at step (\d+) \(resumes at step \1 from its newest checkpoint\)", err)
    assert stopped, err[-2000:]
    step = int(stopped.group(1))
    assert 3 <= step < 60 and [r["step"] for r in read_metrics(tmp_path / "r")] == list(range(step))
    assert json.loads((latest_checkpoint(tmp_path / "r") / "state.json").read_text())["next_step"] == step
    assert json.loads((tmp_path / "r" / "STOPPED").read_text()) == {
        "signal": "SIGTERM", "phase": "rl", "stopped_at": f"step {step}", "resumes_at": f"step {step}"}

    assert subprocess.run(command, env=env, capture_output=True).returncode == 0  # the same command
    assert not (tmp_path / "r" / "STOPPED").exists() and (tmp_path / "r" / "COMPLETE").exists()
    whole = _cli_train(tmp_path, "whole", "eval.every=0")
    assert subprocess.run(whole, env=env, capture_output=True).returncode == 0
    assert _rows_without_clock(tmp_path / "r") == _rows_without_clock(tmp_path / "whole")


def test_user_errors_are_one_line_and_exit_2_and_debug_shows_the_traceback(tmp_path, capsys):
    """YAML syntax errors, checkpoint, model and data errors printed tracebacks; only ConfigError and
    FileNotFoundError were one line."""
    from jetflow.config import ConfigError
    from jetflow.errors import MissingDependencyError, UserError
    from jetflow.model import UnsupportedModelError
    from jetflow.train.trainer import TrainingDiverged

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jetflow: error: ConfigError:") and "not valid YAML" in err
    with pytest.raises(ConfigError, match="not valid YAML"):
        main(["--debug", "train", "--config", str(bad)])
    for error in (CheckpointError, UnsupportedModelError, TrainingDiverged, MissingDependencyError):
        assert issubclass(error, UserError), error

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "gpt2"}')
    assert main(["generate", "--model", str(tmp_path / "m"), "hi"]) == 2
    assert capsys.readouterr().err.startswith("jetflow: error: ")


def test_no_checkpoint_replaces_the_last_good_one_during_a_bad_streak(tmp_path, capsys):
    from jetflow.config import derive, load_config
    from jetflow.run.build import load_inputs
    from jetflow.run.sides import TrainerSide

    cfg = load_config("configs/tiny.yaml")
    side = TrainerSide(cfg, derive(cfg), load_inputs(cfg))
    side.save(tmp_path, 2, True)
    side.trainer.consecutive_bad = 1  # the last step was skipped (NaN loss or gradient)
    side.save(tmp_path, 3, True)
    assert latest_checkpoint(tmp_path).name == "step_000002"
    assert "no checkpoint at step 3" in capsys.readouterr().err
    side.trainer.consecutive_bad = 0
    side.save(tmp_path, 4, True)
    assert latest_checkpoint(tmp_path).name == "step_000004"


# ---- more cases of our own (results/reliability.md, 12 onwards) ----------------------------------------


def test_a_config_file_that_is_not_a_mapping_is_one_line(tmp_path, capsys):
    """Before: TypeError 'Cannot merge incompatible container types' with a traceback."""
    (tmp_path / "list.yaml").write_text("- model\n- train\n")
    assert main(["train", "--config", str(tmp_path / "list.yaml")]) == 2
    assert "a config is a mapping of sections (model:, train:, ...), got a list" in capsys.readouterr().err


def test_a_mapping_override_replaces_the_free_form_params():
    """Before: `task.params={path: x}` merged into the base config's arithmetic params, so switching a
    config's task by override was impossible (`unknown option(s) digits, num_operands, style`)."""
    from jetflow.config import load_config

    cfg = load_config("configs/tiny.yaml", ["task.name=math", "task.params={path: data.jsonl}"])
    assert cfg.task.params == {"path": "data.jsonl"}
    assert load_config("configs/tiny.yaml", ["task.params.digits=2"]).task.params["style"] == "plain"  # merges
    from jetflow.config import ConfigError, derive
    from jetflow.run.validate import check_task_and_model
    math = load_config("configs/tiny.yaml", ["task.name=math"])  # the tiny model reads data-file tasks
    with pytest.raises(ConfigError, match=r"unknown option\(s\) digits.*task.params=\{\.\.\.\} replaces"):
        check_task_and_model(math, derive(math))


@pytest.mark.parametrize("overrides, message", [
    (["model.device=cuda"], "model.device=cuda: this torch is a CPU build"),  # before: AssertionError traceback
    (["train.steps=0", "train.sft_warmup_steps=0"], "the run would do nothing"),  # before: ran nothing, exit 0
    (["rollout.max_new_tokens=100000"], "responses would pass the model's 128 positions"),  # before: ran silently
])
def test_runs_that_cannot_do_what_was_asked_are_refused(tmp_path, capsys, overrides, message):
    if "cuda" in overrides[0] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    args = ["train", "--no-report", "--config", "configs/tiny.yaml", f"run.out_dir={tmp_path}", "train.sft_warmup_steps=2",
            "train.steps=1", "run.progress=false", "run.tensorboard=false", *overrides]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_data_file_that_is_not_utf8_names_its_row(tmp_path):
    from jetflow.tasks import MathTask

    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"question": "1+1", "answer": "2"}\n\xff\xfe\n')
    with pytest.raises(ValueError, match=r"d.jsonl: row 2: not UTF-8 text"):
        MathTask(str(path))


def test_a_full_disk_while_checkpointing_is_one_line_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    """Before: a SafetensorError traceback and a .tmp-step directory left behind."""
    import jetflow.train.checkpoint as ckpt

    model = tiny_decoder()
    save_checkpoint(tmp_path, 1, model, {}, {"next_step": 1, "sft_done": True})

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    from jetflow.writes import WriteError
    with pytest.raises(WriteError, match=r"cannot write checkpoint file .*step_000002/model.safetensors: No space "
                                         r"left on device \[ENOSPC\].*step_000001 and older are intact"):
        save_checkpoint(tmp_path, 2, model, {}, {"next_step": 2, "sft_done": True})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()] == ["step_000001"]
    assert latest_checkpoint(tmp_path).name == "step_000001"


def test_a_damaged_model_file_or_another_models_tokenizer_is_refused_at_load(make_tiny_hf, tmp_path):
    """Before: a NaN weight failed later as a NonFiniteError traceback in the FP8 quantizer; a
    tokenizer with more tokens than the embedding ran silently."""
    from jetflow.model import load_hf_dir
    from jetflow.model.checkpoint import check_loaded_model

    _, src = make_tiny_hf("llama")
    model = load_hf_dir(src)

    class Tok:
        vocab_size = model.config.vocab_size

    check_loaded_model(model, Tok(), src)  # an intact pair passes
    Tok.vocab_size += 7
    with pytest.raises(CheckpointError, match=r"the tokenizer has \d+ tokens, the model's embedding \d+"):
        check_loaded_model(model, Tok(), src)
    Tok.vocab_size -= 7
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, :2] = float("nan")
    with pytest.raises(CheckpointError, match=r"weight model.layers.0.mlp.down_proj.weight holds 2 NaN/Inf"):
        check_loaded_model(model, Tok(), src)
