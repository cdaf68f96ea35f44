"""LoRA (model.lora) in the exact vLLM plugin (rollout.backend=vllm, jetflow.rollout.vllm): each adapted linear
computed by the policy's PrecisionLinear with jetflow.precision.lora's adapter, the first update bringing the base
and the adapters and every later one the adapters alone. After RL steps that changed the adapters (tiny model,
rank 4) the engine's sampled tokens' log-probs `torch.equal` the trainer's recomputation under fp32, bf16 and
unified, exact numerics; a `jetflow train ... rollout.backend=vllm model.lora.rank=8` run logs mismatch KL 0 and
equal share 1 on every step; an adapter-only update before the base, or with other adapters, is refused
untouched (LoRA on vLLM's own kernels, fast numerics, is refused in one line: tests/unit/test_lora.py). Engines
start in this process; skipped where vLLM cannot be imported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from jetflow.cli import main
from jetflow.config import derive, load_config
from jetflow.precision.lora import adapter_parameters
from jetflow.run.build import load_inputs
from jetflow.run.sides import TrainerSide
from jetflow.sync import MissingBaseError
from on_policy import assert_rollout_logprobs_equal_the_trainers
from vllm_available import vllm_importable  # noqa: F401  (an autouse fixture: skips the module without vLLM)

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny.yaml")
LORA = ["model.lora.rank=4", "train.sft_warmup_steps=0", "eval.num_prompts=0", "precision.numerics=exact",
        "rollout.backend=vllm"]



@pytest.mark.parametrize("mode", ["fp32", "bf16", "unified"])
def test_vllm_logprobs_equal_the_trainers_after_steps_that_changed_the_adapters(mode, tmp_path):
    cfg = load_config(TINY, [f"precision.mode={mode}", *LORA, "train.prompts_per_step=4", "rollout.group_size=4",
                             "rollout.max_new_tokens=12", "train.lr=1e-2",
                             "task.format_weight=0.5"])  # vLLM's samples score 0 on the sums alone: no gradient
    side = TrainerSide(cfg, derive(cfg), load_inputs(cfg))
    loop = side.rl_loop(tmp_path)
    rollout = loop.rollout
    try:
        assert "LoRA rank 4 on 14 linears" in rollout.description
        rows = [loop.step(step) for step in range(3)]
        adapters = adapter_parameters(side.model)
        assert any(bool(p.abs().max() > 0) for n, p in adapters.items() if n.endswith(".B"))  # B left zero
        assert [r["sync/bytes"] for r in rows[1:]] == [sum(p.numel() * 4 for p in adapters.values())] * 2
        assert all(r["mismatch/kl_k3"] == 0.0 and r["mismatch/equal_frac"] == 1.0 for r in rows)
        loop.sync()  # the adapters of the last step, alone
        held = adapter_parameters(rollout.policy)
        assert all(torch.equal(held[n], p) for n, p in adapters.items())
        prompts = assert_rollout_logprobs_equal_the_trainers(side, rollout, cfg)

        # refused untouched: adapters alone that are not the engine's, a stale version
        before = rollout.generate(prompts[:2], [1, 2], greedy=True)
        foreign = side.trainer.weight_update(mode, derive(cfg).precision.fingerprint)
        foreign.version, foreign.checksum = rollout.weight_version + 1, ""
        foreign.adapters.pop(next(iter(foreign.adapters)))
        with pytest.raises(KeyError, match="LoRA adapters differ"):
            rollout.load_weights(foreign)
        after = rollout.generate(prompts[:2], [1, 2], greedy=True)
        assert after.logprobs == before.logprobs
    finally:
        rollout.close()


def test_an_adapter_only_update_before_the_base_is_refused(tmp_path):
    cfg = load_config(TINY, ["precision.mode=unified", *LORA])
    side = TrainerSide(cfg, derive(cfg), load_inputs(cfg))
    loop = side.rl_loop(tmp_path)
    try:
        first = side.trainer.weight_update("unified", derive(cfg).precision.fingerprint)
        side.trainer.version += 1
        later = side.trainer.weight_update("unified", derive(cfg).precision.fingerprint)
        assert first.base and not later.base and not later.tensors and not later.quantized
        with pytest.raises(MissingBaseError, match="adapters alone"):
            loop.rollout.load_weights(later)
        assert loop.rollout.weight_version == -1
        loop.rollout.load_weights(first)
        loop.rollout.load_weights(later)
        assert loop.rollout.weight_version == later.version
    finally:
        loop.rollout.close()


def test_a_lora_run_on_vllm_logs_mismatch_kl_zero_on_every_step(tmp_path, capsys):
    assert main(["train", "--config", TINY, "rollout.backend=vllm", "model.lora.rank=8", "precision.numerics=exact",
                 "train.steps=3", "train.sft_warmup_steps=0", "eval.num_prompts=0", "task.format_weight=0.5",
                 f"run.out_dir={tmp_path}", "run.progress=false", "run.loggers=[]"]) == 0
    err = capsys.readouterr().err
    assert "vLLM execution=exact" in err and "+ LoRA rank 8 on 14 linears" in err
    rows = [json.loads(line) for line in (tmp_path / "tiny/metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "mismatch/kl_k3" in r]
    assert len(rows) == 3 and any(r["train/grad_norm"] > 0 for r in rows)
    assert all(r["mismatch/kl_k3"] == 0.0 and r["mismatch/kl_k1"] == 0.0 and r["mismatch/equal_frac"] == 1.0
               for r in rows)
    assert rows[1]["sync/bytes"] == rows[2]["sync/bytes"] < rows[0]["sync/bytes"]  # the adapters alone after the first

