"""LoRA on the Megatron-Core trainer at tensor parallelism 2 (`train.backend=megatron model.lora.rank>0`, issue 73):
TP-split adapters (jetflow.train.megatron.lora: column-parallel layers A replicated / B split along out, row-parallel
layers A split along in / B replicated), 2 CPU processes over gloo, exact numerics.

tests/integration/megatron_lora_worker.py (configs/tiny-tp.yaml, seeded random weights, rank 4 on every projection,
2 supervised steps on one left-padded batch; the native LoRA trainer on the same Decoder in the same process):
  - bit for bit (`torch.equal`), under fp32, bf16 and unified: the Megatron TP=2 trainer's log-probs and the step-0
    loss equal the native LoRA trainer's; after the steps, the native trainer's trained adapters loaded into the
    Megatron policy give the native trainer's log-probs (the forward on non-zero adapters); the native rollout
    engine synced from the Megatron trainer (the base, and the adapters gathered whole over TP) samples tokens
    whose log-probs the Megatron trainer recomputes bit for bit; both TP ranks hold the same whole adapters.
  - within a bound, not bit for bit: the adapters' gradients and the updated adapters. The backward is torch's
    on both trainers, and at TP=2 an input gradient of a column-parallel layer (lm_head's, q/k/v's, gate/up's)
    is a sum of the two ranks' partial products: another order than one process's. fp32: gradients within
    1e-5 of their norm, adapters within 2e-5 (tests/integration/test_fsdp_lora.py's bound for a one-process
    comparison); bf16 / unified, where the backward rounds each rank's partial dgrad to bf16 / FP8: gradients
    point the same way (cosine >= 0.9 per tensor; the worst tensor measured 0.9995 / 0.985 at step 2 on the
    AVX2-only Zen 3 kind: the bound leaves room for another kind's rounding, where a gradient of the wrong shard,
    transposed or unsummed is near 0) and the step-0 loss is equal.
`jetflow train` at TP=2 (unified, exact numerics, no warm-up, format rewards): mismatch KL k1 / k3 0 and equal
share 1 on every RL step, the updates after the first are the adapters alone, the run writes its adapter/ (the
native names) with the native base's digest checked; a resume from the step-2 checkpoint ends with the same
adapters, `torch.equal`.
"""

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from jetflow.metrics_log import read_metrics
from jetflow.run.files import COMPLETE
from torchrun_jobs import launch_worker, torchrun, wait_all

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "megatron_lora_worker.py"
MODES = ("fp32", "bf16", "unified")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core not installed (pip install megatron-core==0.16.1)")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """{mode: [rank 0's result, rank 1's]}."""
    tmp = tmp_path_factory.mktemp("megatron_lora")
    wait_all({"tp2": launch_worker(2, WORKER, "--out", tmp)})
    return {mode: [torch.load(tmp / f"{mode}.rank{r}.pt", weights_only=False) for r in (0, 1)] for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_megatron_tp2_lora_forward_is_the_native_trainers_and_the_engines(ranks, mode):
    for rank, result in enumerate(ranks[mode]):
        assert result["tp"] == 2 and result["mode"] == mode
        megatron, native = result["logprobs0"]
        assert torch.equal(megatron, native), (mode, rank)
        assert result["steps"][0]["loss"][0] == result["steps"][0]["loss"][1]
        adapters = result["steps"][-1]["adapters"][1]
        assert all(t.abs().max() > 0 for t in adapters.values())  # A and B trained: the adapters are in the product
        megatron, native = result["logprobs_trained"]
        assert torch.equal(megatron, native), (mode, rank, (megatron - native).abs().max())
        assert result["rollout"]["tokens"] > 0 and result["rollout"]["equal"], (mode, rank, result["rollout"])
    zero, one = ranks[mode]
    for a, b in zip(zero["steps"], one["steps"]):  # the replicated halves took the same steps on both ranks
        assert a["adapters"][0].keys() == b["adapters"][0].keys()
        assert all(torch.equal(a["adapters"][0][k], b["adapters"][0][k]) for k in a["adapters"][0])


@pytest.mark.parametrize("mode", MODES)
def test_megatron_tp2_lora_gradients_and_updates_are_the_native_trainers_to_summation_order(ranks, mode):
    result = ranks[mode][0]
    for i, step in enumerate(result["steps"]):
        (grads, native_grads), (adapters, native_adapters) = step["grads"], step["adapters"]
        assert grads.keys() == native_grads.keys() == adapters.keys() == native_adapters.keys()
        assert len(grads) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
        for name, g in grads.items():
            ref = native_grads[name]
            if i == 0 and name.endswith(".A"):  # B = 0 at the start: A's gradient is exactly zero on both
                assert torch.equal(g, ref) and not ref.any()
                continue
            if mode == "fp32":
                assert (g - ref).norm() <= 1e-5 * ref.norm(), (name, i)
            else:
                assert torch.nn.functional.cosine_similarity(g.flatten(), ref.flatten(), dim=0) >= 0.9, (name, i)
        if mode == "fp32":
            assert max((adapters[k] - native_adapters[k]).abs().max().item() for k in adapters) <= 2e-5
    # after the first weight update: under unified the FP8 linears hold their bytes alone, and the backward through
    # them still gives the native trainer's gradients (fp32 / bf16 keep their masters: the same bound as above)
    dropped = result["masters_dropped"]
    assert (len(dropped) > 0 and all(dropped)) if mode == "unified" else not dropped, dropped
    grads, native_grads = result["after_drop_grads"]
    for name, g in grads.items():
        cos = torch.nn.functional.cosine_similarity(g.flatten(), native_grads[name].flatten(), dim=0)
        assert cos >= (0.99999 if mode == "fp32" else 0.9), (name, float(cos))


COMMON = ["--config", "configs/tiny-tp.yaml", "train.backend=megatron", "train.tensor_parallel_size=2",
          "model.lora.rank=4", "precision.numerics=exact", "train.steps=3", "train.sft_warmup_steps=0",
          "task.format_weight=0.5", "train.checkpoint_every=1", "run.progress=false", "run.tensorboard=false",
          "run.num_threads=1", "run.name=r"]


def _train(out: Path, *overrides: str) -> Path:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([*torchrun(2), "-m", "jetflow.cli", "train", "--no-report", *COMMON, f"run.out_dir={out}",
                           *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out / "r"


def _adapters(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / "step_000003" / "adapter_model.safetensors"))


def test_jetflow_train_megatron_tp2_lora_is_exactly_on_policy_and_resumes(tmp_path):
    run = _train(tmp_path / "a")
    rows = read_metrics(run, "rl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["mismatch/num_tokens"] > 0
        assert r["mismatch/kl_k1"] == 0.0 and r["mismatch/kl_k3"] == 0.0 and r["mismatch/equal_frac"] == 1.0, r
    assert rows[1]["sync/bytes"] == rows[2]["sync/bytes"] < rows[0]["sync/bytes"] / 10  # the adapters alone
    assert (run / COMPLETE).exists() and (run / "adapter" / "adapter_model.safetensors").is_file()
    adapters = _adapters(run)
    assert adapters and all(t.abs().max() > 0 for k, t in adapters.items() if "lora_B" in k)  # B starts at zero
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight" in adapters  # whole, native names
    assert adapters["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"].shape == (512, 4)

    copy = tmp_path / "b" / "r"  # a resume from the step-2 checkpoint at TP=2 ends with the same adapters
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step_000003")
    (copy / COMPLETE).unlink()
    (copy / "checkpoints" / "latest").write_text("step_000002")
    _train(tmp_path / "b", "run.resume=true")
    again = _adapters(copy)
    assert adapters.keys() == again.keys() and all(torch.equal(adapters[k], again[k]) for k in adapters)
    assert [r["train/loss"] for r in read_metrics(copy, "rl")] == [r["train/loss"] for r in rows]
