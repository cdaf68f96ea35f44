"""LoRA on the FSDP trainer (`train.backend=fsdp model.lora.rank>0`, issue 73) under torchrun, 2 CPU processes
over gloo: nothing is sharded (jetflow.run.megatron_side.build_trainer_model): every rank builds the frozen
base from the model source and holds the adapters whole, and their gradients are summed over the ranks.

- exact on-policy: mismatch KL k1 / k3 0 and equal share 1 on every RL step (unified, exact numerics);
- the adapters after the run torch.equal the native trainer's torchrun data parallelism at the same world size
  (the same replicated trainer), every step's loss and gradient norm equal;
- against the one-process native run, the rows whose inputs are the same in both: the two supervised warm-up
  steps (fixed data) and a first RL step from the untrained model (the same samples) within fp32 summation
  order (losses within FP32_GAP, gradient norms within 1e-4, the adapters after it within ADAPTER_GAP). Not the
  RL steps after a warm-up: their samples come from weights that differ in summation order, and one sampled
  token that differs changes the step's gradient by percents (the AVX2-only Zen 3 kind: 0.643 against 0.628),
  a chaotic comparison.
- a resume at 2 ranks from the step before the end writes the same adapters bit for bit.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from jetflow.metrics_log import read_metrics
from jetflow.run.files import COMPLETE
from numeric_bounds import loss_gap
from torchrun_jobs import torchrun

ROOT = Path(__file__).resolve().parents[2]
# two supervised warm-up steps and format rewards (task.format_weight) so that the RL steps have a gradient
COMMON = ["--config", "configs/tiny.yaml", "train.steps=3", "train.sft_warmup_steps=2", "train.prompts_per_step=4",
          "rollout.group_size=4", "run.progress=false", "run.tensorboard=false", "run.num_threads=1",
          "eval.num_prompts=0", "train.checkpoint_every=1", "run.name=r", "train.micro_batch_size=2",
          "task.format_weight=0.5", "model.lora.rank=4", "precision.mode=unified", "precision.numerics=exact"]
FP32_GAP = 1e-5  # as tests/integration/test_fsdp.py
# AdamW steps (lr 5e-4) from gradients that differ in fp32 summation order: five measured 3.6e-6 at most;
# a step from another gradient moves an adapter weight by about lr
ADAPTER_GAP = 2e-5


def _run(launcher: list[str], out: Path, *overrides: str) -> tuple[Path, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([*launcher, "-m", "jetflow.cli", "train", "--no-report", *COMMON, f"run.out_dir={out}",
                           *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out / "r", proc.stdout + proc.stderr


def _adapters(run: Path, step: int = 3) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_lora")
    fsdp, log = _run(torchrun(2), root / "fsdp", "train.backend=fsdp")
    native2, _ = _run(torchrun(2), root / "native2")
    native1, _ = _run([sys.executable], root / "native1")
    cold = ("train.sft_warmup_steps=0", "train.steps=1")  # a first RL step from the untrained model
    fsdp_cold, _ = _run(torchrun(2), root / "fsdp_cold", "train.backend=fsdp", *cold)
    native1_cold, _ = _run([sys.executable], root / "native1_cold", *cold)
    return fsdp, log, native2, native1, fsdp_cold, native1_cold


def test_fsdp_lora_is_exact_on_policy_and_trains_the_native_trainers_adapters(runs):
    fsdp, log, native2, native1, fsdp_cold, native1_cold = runs
    assert "LoRA rank 4" in log and "base and adapters replicated on every rank" in log
    rl = read_metrics(fsdp, "rl")
    assert [r["step"] for r in rl] == [0, 1, 2]
    for r in rl:
        assert r["mismatch/kl_k1"] == 0.0 and r["mismatch/kl_k3"] == 0.0 and r["mismatch/equal_frac"] == 1.0, r
    assert all(abs(r["train/loss"]) > 1e-3 for r in rl), "an RL step without a learning signal: vacuous"
    assert (fsdp / COMPLETE).exists() and (fsdp / "adapter" / "adapter_model.safetensors").is_file()

    adapters = _adapters(fsdp)
    assert adapters and all(t.abs().max() > 0 for k, t in adapters.items() if "lora_B" in k)  # B starts at zero
    same = _adapters(native2)  # the native trainer's data parallelism at 2 ranks: the same computation
    assert adapters.keys() == same.keys() and all(torch.equal(adapters[k], same[k]) for k in adapters)
    assert [(r["train/loss"], r["train/grad_norm"]) for r in read_metrics(fsdp)] == [
        (r["train/loss"], r["train/grad_norm"]) for r in read_metrics(native2)]

    # one process: the same global batches, the gradients summed in another order (see the module docstring)
    same_inputs = [(read_metrics(fsdp, "sft"), read_metrics(native1, "sft")),
                   (read_metrics(fsdp_cold, "rl"), read_metrics(native1_cold, "rl"))]
    for a, b in same_inputs:
        assert [r["step"] for r in a] == [r["step"] for r in b] and a
        for x, y in zip(a, b):
            assert loss_gap(x["train/loss"], y["train/loss"]) <= FP32_GAP, (x["phase"], x["step"])
            assert x["train/grad_norm"] == pytest.approx(y["train/grad_norm"], rel=1e-4, abs=1e-6)
    cold, one = _adapters(fsdp_cold, 1), _adapters(native1_cold, 1)
    assert any(t.abs().max() > 0 for k, t in cold.items() if "lora_B" in k)
    assert max((cold[k] - one[k]).abs().max().item() for k in cold) <= ADAPTER_GAP


def test_fsdp_lora_resumes_bit_for_bit_at_two_ranks(runs, tmp_path):
    fsdp = runs[0]
    shutil.copytree(fsdp.parent, tmp_path / "copy")
    copy = tmp_path / "copy" / fsdp.name
    shutil.rmtree(copy / "checkpoints" / "step_000003")
    (copy / COMPLETE).unlink()
    (copy / "checkpoints" / "latest").write_text("step_000002")
    _run(torchrun(2), copy.parent, "train.backend=fsdp", "run.resume=true")
    final, again = _adapters(fsdp), _adapters(copy)
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)
    assert [r["train/loss"] for r in read_metrics(copy, "rl")] == [r["train/loss"] for r in read_metrics(fsdp, "rl")]
