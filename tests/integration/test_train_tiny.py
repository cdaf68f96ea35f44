"""End-to-end runs of the tiny config: the three precision modes, kill + resume, and user errors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from jetflow.config import load_config
from jetflow.metrics_log import read_metrics
from jetflow.run.files import COMPLETE
from jetflow.run.report import write_run_report
from jetflow.run.runner import train

ROOT = Path(__file__).resolve().parents[2]
FAST = ["train.sft_warmup_steps=40", "train.prompts_per_step=4", "rollout.group_size=4", "run.progress=false",
        "run.tensorboard=false", "run.num_threads=1"]


def tiny_cfg(tmp_path, *overrides):
    return load_config(ROOT / "configs/tiny.yaml", [f"run.out_dir={tmp_path}", *FAST, *overrides])


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("modes")
    runs = {}
    for mode in ("bf16", "mixed", "unified"):
        runs[mode] = train(tiny_cfg(out, f"precision.mode={mode}", f"run.name={mode}", "train.steps=2"))
    return runs


def test_each_mode_completes_with_logs(mode_runs):
    for mode, run_dir in mode_runs.items():
        assert (run_dir / COMPLETE).exists() and (run_dir / "summary.json").exists()
        rows = read_metrics(run_dir)
        assert [r["step"] for r in rows] == [0, 1]
        for key in ("reward/mean", "mismatch/kl_k3", "time/rollout", "time/old_logprobs", "time/train", "time/sync",
                    "mismatch/kl_k3/pos_0of4", "throughput/tokens_per_s"):
            assert key in rows[0], key
        assert load_config(run_dir / "config.yaml").precision.mode == mode
        # the report (`jetflow train` writes it at the end) from a real run's files: the table and every plot
        report = write_run_report(run_dir).read_text()
        assert f"Precision mode: `{mode}`" in report and "| training reward (mean of 3 steps) |" in report
        for name in ("reward", "heldout", "mismatch_kl", "mismatch_position", "time_split"):
            assert (run_dir / "report" / f"{name}.png").read_bytes().startswith(b"\x89PNG"), name


def test_mixed_mismatch_dwarfs_unified(mode_runs):
    """Exact numerics (precision.numerics=auto on the CPU): bf16 and unified run one computation on
    both sides, so their mismatch is exactly 0 on every step whatever the machine; mixed (bf16
    trainer, FP8 rollout) is off-policy by construction."""
    kl = {m: json.loads((d / "summary.json").read_text())["mismatch_kl_k3_mean"] for m, d in mode_runs.items()}
    assert kl["unified"] == 0.0 and kl["bf16"] == 0.0, kl
    assert kl["mixed"] > 0.0, kl
    for mode in ("bf16", "unified"):
        assert all(r["mismatch/equal_frac"] == 1.0 for r in read_metrics(mode_runs[mode])), mode
    assert all(r["mismatch/equal_frac"] < 1.0 for r in read_metrics(mode_runs["mixed"]))


def _cli(*args, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "jetflow.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    common = ["train", "--config", "configs/tiny.yaml", f"run.out_dir={tmp_path}", *FAST, "train.steps=8",
              "train.checkpoint_every=1"]
    full = _cli(*common, "run.name=full")
    assert full.wait(timeout=600) == 0, full.stdout.read()

    victim = _cli(*common, "run.name=killed")
    latest = tmp_path / "killed" / "checkpoints" / "latest"
    deadline = time.time() + 600
    while time.time() < deadline and victim.poll() is None:
        name = latest.read_text().strip() if latest.exists() else ""
        if name.startswith("step_") and name >= "step_000002":  # mid-run (polling may miss one; not warmup_)
            break
        time.sleep(0.05)
    assert victim.poll() is None, f"the run ended before it could be killed:\n{victim.stdout.read()[-3000:]}"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed = tmp_path / "killed"
    assert not (killed / COMPLETE).exists() and not (killed / "summary.json").exists()

    resumed = _cli(*common, "run.name=killed", "run.resume=true")
    assert resumed.wait(timeout=600) == 0, resumed.stdout.read()
    a = load_file(str(tmp_path / "full" / "checkpoints" / "step_000008" / "model.safetensors"))
    b = load_file(str(killed / "checkpoints" / "step_000008" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [r["step"] for r in read_metrics(killed)] == list(range(8))
    assert (killed / COMPLETE).exists()


def test_user_errors_are_clear(tmp_path):
    bad = _cli("train", "--config", "configs/tiny.yaml", "precision.mode=fp4")
    out = bad.communicate(timeout=120)[0]
    assert bad.returncode == 2 and "precision.mode='fp4'" in out and "unified" in out

    cfg = load_config(None, [f"run.out_dir={tmp_path}", "run.name=math", "task.name=math",
                             "task.params.path=/nonexistent/data.jsonl"])
    with pytest.raises(Exception, match="/nonexistent/data.jsonl"):
        train(cfg)
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?"}\n')
    cfg = load_config(None, [f"run.out_dir={tmp_path}", "run.name=rows", "task.name=math",
                             f"task.params.path={bad_rows}"])
    with pytest.raises(Exception, match=r"bad.jsonl.*row 2"):
        train(cfg)

    train(tiny_cfg(tmp_path, "run.name=again", "train.steps=1", "train.sft_warmup_steps=2"))
    with pytest.raises(Exception, match="run.resume=true"):
        train(tiny_cfg(tmp_path, "run.name=again", "train.steps=1"))


def test_held_out_evaluation_before_during_after_and_across_a_resume(tmp_path):
    """eval.every=2 over 6 steps: held-out rows at steps 0, 2, 4, 6. A run of 3 steps resumed to 6
    redoes nothing it kept and drops its after-the-last evaluation at 3: its rows are the whole run's.
    (A constant learning rate: the cosine schedule depends on train.steps, so a 3-step run would take
    other steps than a 6-step one, and the evaluations could differ.)"""
    def eval_rows(run_dir):
        return [{k: v for k, v in r.items() if k != "time/eval"} for r in read_metrics(run_dir, phase="eval")]

    constant_lr = "train.min_lr_ratio=1.0"
    whole = train(tiny_cfg(tmp_path, "run.name=whole", "train.steps=6", "eval.every=2", "eval.num_prompts=8",
                           constant_lr))
    rows = eval_rows(whole)
    assert [r["step"] for r in rows] == [0, 2, 4, 6]
    assert all(r["eval/num_prompts"] == 8 and 0 <= r["eval/pass@1"] <= 1 for r in rows)

    part = ["run.name=part", "eval.every=2", "eval.num_prompts=8", constant_lr]
    train(tiny_cfg(tmp_path, *part, "train.steps=3"))
    assert [r["step"] for r in eval_rows(tmp_path / "part")] == [0, 2, 3]
    train(tiny_cfg(tmp_path, *part, "train.steps=6", "run.resume=true", "run.allow_changes=[train.steps]"))
    assert eval_rows(tmp_path / "part") == rows
    summary = json.loads((tmp_path / "part" / "summary.json").read_text())
    assert (summary["heldout_pass1_start"], summary["heldout_pass1_end"], summary["heldout_prompts"]) == (
        rows[0]["eval/pass@1"], rows[-1]["eval/pass@1"], 8)
