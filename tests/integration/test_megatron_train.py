"""`jetflow train` with train.backend=megatron under torchrun (CPU, gloo), against one process.

One module fixture runs the same fp32 config four ways: Megatron in one process, the native trainer in
one process, Megatron TP=2 and Megatron PP=2 (2 ranks each). Checked: TP=2 and PP=2 give one process's
per-step losses (TP <= 1e-5: its partial sums; PP <= 1e-6: the same sums per stage), Megatron in one
process gives the native trainer's losses and the same rollouts; a TP=2 resume from a mid-run checkpoint
(every TP rank gets its own optimizer shard back) ends at the uninterrupted run's weights. The TP=2 and
PP=2 runs also keep a reference policy (algo.log_ref_kl, sharded like the policy; the loss unchanged):
kl/ref is 0 before the first update and > 0 after it, and the resume gets the reference of reference.pt
back. The same resume with expert parallelism 2: tests/integration/test_megatron_ep.py."""

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
# updates (a first epoch's clipped loss is -mean(advantage) whatever the weights). 30 warm-up steps: every
# one of the 3 RL steps then has a reward signal (with 10 only the first had: a vacuous comparison after it).
COMMON = ["--config", "configs/tiny.yaml", "precision.mode=fp32", "train.steps=3", "train.sft_warmup_steps=30",
          "train.prompts_per_step=4", "rollout.group_size=4", "algo.ppo_epochs=2", "train.checkpoint_every=1",
          "eval.num_prompts=0", "run.progress=false", "run.tensorboard=false", "run.num_threads=1"]
MEGATRON = ["train.backend=megatron"]
REFERENCE = ["algo.log_ref_kl=true"]  # a reference policy and its kl/ref, no KL term in the loss
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE", "PYTHONWARNINGS": "ignore"}


def _start(launcher: list[str], *overrides: str, common: list[str] = COMMON) -> subprocess.Popen:
    return subprocess.Popen([*launcher, "-m", "jetflow.cli", "train", "--no-report", *common, *overrides], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(*procs: subprocess.Popen) -> None:
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-6000:]


def _train(launcher: list[str], *overrides: str, common: list[str] = COMMON) -> None:
    _finish(_start(launcher, *overrides, common=common))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """tp1 (Megatron, one process), native (one process), tp2 and pp2 (Megatron under torchrun). The two
    one-process runs side by side (one thread each on the two cores), then the two 2-rank runs."""
    root = tmp_path_factory.mktemp("megatron-train")
    _finish(_start([sys.executable], f"run.out_dir={root}", "run.name=tp1", *MEGATRON),
            _start([sys.executable], f"run.out_dir={root}", "run.name=native"))
    _train(torchrun(), f"run.out_dir={root}", "run.name=tp2", *MEGATRON, *REFERENCE, "train.tensor_parallel_size=2")
    _train(torchrun(), f"run.out_dir={root}", "run.name=pp2", *MEGATRON, *REFERENCE, "train.pipeline_parallel_size=2")
    return root


def test_megatron_in_one_process_trains_like_the_native_trainer(runs):
    """fp32, two implementations of the same model (summation order only): the same rollouts, losses within
    1e-4, on-policy to 1e-8. Gradient norms within 1e-2 relative: the 30 warm-up and the RL updates come
    first, and AdamW divides each entry by its own running RMS, so a last-bit gradient difference on a
    near-zero entry moves that weight by up to the learning rate (measured here: 2.0e-4, 4.2e-4, 2.7e-3
    at steps 0-2; AMD EPYC Zen 3)."""
    meg, nat = read_metrics(runs / "tp1"), read_metrics(runs / "native")
    assert [r["step"] for r in meg] == [r["step"] for r in nat] == [0, 1, 2]
    loss_diff = [abs(a["train/loss"] - b["train/loss"]) for a, b in zip(meg, nat)]
    norm_rel = [abs(a["train/grad_norm"] - b["train/grad_norm"]) / b["train/grad_norm"] for a, b in zip(meg, nat)]
    assert max(loss_diff) <= 1e-4, loss_diff
    assert max(norm_rel) <= 1e-2, norm_rel
    assert [r["reward/mean"] for r in meg] == [r["reward/mean"] for r in nat]  # the same rollouts
    assert all(r["train/grad_norm"] > 0 for r in meg)  # every step carried a learning signal
    assert all(r["mismatch/kl_k3"] < 1e-8 for r in meg)  # Megatron trainer vs native fp32 rollout


def test_pipeline_parallel_run_matches_one_process(runs):
    one, two = read_metrics(runs / "tp1"), read_metrics(runs / "pp2")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [0, 1, 2]
    assert any(abs(r["train/loss"]) > 1e-3 for r in one), "no learning signal: the comparison would be vacuous"
    for a, b in zip(one, two):
        assert loss_gap(a["train/loss"], b["train/loss"]) <= 1e-6, (a["step"], a["train/loss"], b["train/loss"])
    assert_reference_kl(two)


def assert_reference_kl(rows: list[dict]) -> None:
    """The reference policy of a model-parallel run (the k3 estimator, algo.kl_estimator's default): no KL
    to the trainer before the first update (the same weights, sharded alike, the same exact forward), some
    after it."""
    assert rows[0]["kl/ref"] == 0.0 and all(r["kl/ref"] > 0.0 for r in rows[1:]), [r["kl/ref"] for r in rows]
    assert all(r["ref/bytes"] > 0 for r in rows)


def test_tensor_parallel_run_matches_one_process_and_resumes(runs):
    one, two = read_metrics(runs / "tp1"), read_metrics(runs / "tp2")
    assert [r["step"] for r in two] == [0, 1, 2]
    assert any(abs(r["train/loss"]) > 1e-3 for r in one), "no learning signal: the comparison would be vacuous"
    for a, b in zip(one, two):
        assert loss_gap(a["train/loss"], b["train/loss"]) <= 1e-5, (a["step"], a["train/loss"], b["train/loss"])
        # gradient norms after 30 warm-up and the RL updates: AdamW's per-entry scaling (see the native test)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-2, abs=1e-6)

    assert_reference_kl(two)

    run = runs / "tp2"  # resumed in place: no other test reads it
    saved = torch.load(run / "checkpoints" / "step_000003" / "trainer.pt", weights_only=False)
    assert len(saved["tp_states"]) == 2  # one optimizer shard per tensor-parallel rank
    final = load_file(str(run / "checkpoints" / "step_000003" / "model.safetensors"))
    before = load_file(str(run / "checkpoints" / "step_000002" / "model.safetensors"))
    assert any(not torch.equal(before[k], final[k]) for k in final), "the last step changed nothing"

    resumed = interrupt_and_resume(run, lambda: _train(torchrun(), f"run.out_dir={runs}", "run.name=tp2",
                                                       *MEGATRON, *REFERENCE, "train.tensor_parallel_size=2",
                                                       "run.resume=true"))
    for name, tensor in final.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=1e-6, msg=name)
    # the resumed step 2 measured its KL to reference.pt's weights (its current ones would give 0)
    assert read_metrics(run)[2]["kl/ref"] == pytest.approx(two[2]["kl/ref"], rel=1e-3)


def interrupt_and_resume(run: Path, resume) -> dict[str, torch.Tensor]:
    """Drop what the run's last step (3) wrote, as if it was killed after step 2, resume, and return
    the weights the resumed step 3 saved."""
    shutil.rmtree(run / "checkpoints" / "step_000003")
    (run / "checkpoints" / "latest").write_text("step_000002")
    (run / COMPLETE).unlink()
    resume()
    assert (run / COMPLETE).exists() and [r["step"] for r in read_metrics(run)] == [0, 1, 2]
    return load_file(str(run / "checkpoints" / "step_000003" / "model.safetensors"))
