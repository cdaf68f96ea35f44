"""`jetflow train` with train.backend=megatron and tensor parallelism 2 under torchrun (CPU, gloo): the
same per-step loss as one process (fp32, <= 1e-5), and a resume from a mid-run checkpoint (every TP
rank gets its own optimizer shard back) ends at the same weights as the uninterrupted run. The same
resume with expert parallelism 2 on the tiny MoE (every EP rank gets its own experts' moments back)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core", reason="Megatron-Core is not installed (pip install -e '.[megatron]')")

from torchrun_jobs import torchrun  # noqa: E402
from jetflow.metrics_log import read_metrics  # noqa: E402
from jetflow.run.files import COMPLETE  # noqa: E402
from numeric_bounds import loss_gap

ROOT = Path(__file__).resolve().parents[2]

# Two PPO epochs: the second epoch's loss depends on the updated weights, so equal losses mean equal
# updates (a first epoch's clipped loss is -mean(advantage) whatever the weights).
COMMON = ["--config", "configs/tiny.yaml", "precision.mode=fp32", "train.backend=megatron", "train.steps=3",
          "train.sft_warmup_steps=10", "train.prompts_per_step=4", "rollout.group_size=4", "algo.ppo_epochs=2",
          "train.checkpoint_every=1", "run.progress=false", "run.tensorboard=false", "run.num_threads=1"]


def _train(launcher: list[str], *overrides: str, common: list[str] = COMMON) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([*launcher, "-m", "jetflow.cli", "train", *common, *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_tensor_parallel_run_matches_one_process_and_resumes(tmp_path):
    _train([sys.executable], f"run.out_dir={tmp_path}", "run.name=tp1")
    _train(torchrun(), f"run.out_dir={tmp_path}", "run.name=tp2", "train.tensor_parallel_size=2")
    one, two = read_metrics(tmp_path / "tp1"), read_metrics(tmp_path / "tp2")
    assert [r["step"] for r in two] == [0, 1, 2]
    assert any(abs(r["train/loss"]) > 1e-3 for r in one), "no learning signal: the comparison would be vacuous"
    for a, b in zip(one, two):
        assert loss_gap(a["train/loss"], b["train/loss"]) <= 1e-5, (a["step"], a["train/loss"], b["train/loss"])
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4, abs=1e-6)

    run = tmp_path / "tp2"
    saved = torch.load(run / "checkpoints" / "step_000003" / "trainer.pt", weights_only=False)
    assert len(saved["tp_states"]) == 2  # one optimizer shard per tensor-parallel rank
    final = load_file(str(run / "checkpoints" / "step_000003" / "model.safetensors"))
    before = load_file(str(run / "checkpoints" / "step_000002" / "model.safetensors"))
    assert any(not torch.equal(before[k], final[k]) for k in final), "the last step changed nothing"

    resumed = interrupt_and_resume(run, lambda: _train(torchrun(), f"run.out_dir={tmp_path}", "run.name=tp2",
                                                       "train.tensor_parallel_size=2", "run.resume=true"))
    for name, tensor in final.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=1e-6, msg=name)


def interrupt_and_resume(run: Path, resume) -> dict[str, torch.Tensor]:
    """Drop what the run's last step (3) wrote, as if it was killed after step 2, resume, and return
    the weights the resumed step 3 saved."""
    shutil.rmtree(run / "checkpoints" / "step_000003")
    (run / "checkpoints" / "latest").write_text("step_000002")
    (run / COMPLETE).unlink()
    resume()
    assert (run / COMPLETE).exists() and [r["step"] for r in read_metrics(run)] == [0, 1, 2]
    return load_file(str(run / "checkpoints" / "step_000003" / "model.safetensors"))


def test_expert_parallel_run_resumes_with_every_ranks_expert_moments(tmp_path):
    moe = ["--config", "configs/tiny-moe.yaml", "train.backend=megatron", "train.steps=3", "train.sft_warmup_steps=4",
           "train.prompts_per_step=4", "rollout.group_size=4", "algo.ppo_epochs=2", "train.checkpoint_every=1",
           "run.progress=false", "run.tensorboard=false", "run.num_threads=1", f"run.out_dir={tmp_path}",
           "run.name=ep2", "train.expert_parallel_size=2"]
    _train(torchrun(), common=moe)
    run = tmp_path / "ep2"
    saved = torch.load(run / "checkpoints" / "step_000003" / "trainer.pt", weights_only=False)
    assert len(saved["tp_states"]) == 2  # one optimizer state per EP rank (different experts)
    final = load_file(str(run / "checkpoints" / "step_000003" / "model.safetensors"))
    resumed = interrupt_and_resume(run, lambda: _train(torchrun(), "run.resume=true", common=moe))
    assert final.keys() == resumed.keys()
    for name, tensor in final.items():  # the same layout and the same sums: bit for bit
        assert torch.equal(resumed[name], tensor), name
