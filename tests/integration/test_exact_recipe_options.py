"""The FP8 cost study's recipe options stay exactly on-policy (issue 70): unified with 32-wide blocks
(fp8_block groups and weight blocks no FP8 kernel reads: run on their dequantized values) gives the rollout
the trainer's log-probs bit for bit, and a whole `jetflow train` run with those blocks and forward-only FP8
(bf16 dgrad and wgrad) keeps mismatch KL 0 and equal share 1 on every step while its gradients differ from
the default recipe's."""

from __future__ import annotations

import torch

from jetflow.metrics_log import read_metrics
from jetflow.run.runner import train
from test_exact_on_policy import assert_exact, mixed_length_prompts, tiny
from test_train_tiny import tiny_cfg

FINE = ["precision.weight_block=[32,32]", "precision.group_size=32"]


def test_tiny_unified_fine_blocks_rollout_logprobs_equal_trainer_bit_for_bit():
    cfg, model, tok, task = tiny("unified", False)
    cfg.precision.weight_block, cfg.precision.group_size = [32, 32], 32
    assert_exact(cfg, model, tok, task, mixed_length_prompts(tok, 16, 3, 60), new_tokens=256)


def test_train_with_the_options_stays_exact_and_changes_the_update(tmp_path):
    runs = {name: train(tiny_cfg(tmp_path, "precision.mode=unified", f"run.name={name}", "train.steps=2", *extra))
            for name, extra in (("default", []), ("options", [*FINE, "precision.dgrad=bf16", "precision.wgrad=bf16"]))}
    rows = {name: read_metrics(d) for name, d in runs.items()}
    assert len(rows["options"]) == 2
    for row in rows["options"]:
        assert row["mismatch/kl_k3"] == 0.0 and row["mismatch/equal_frac"] == 1.0
    # the same warm-up data and step count, another recipe: the warm-up's first gradient norm already differs
    sft = {name: read_metrics(d, phase="sft") for name, d in runs.items()}
    assert sft["default"][0]["train/grad_norm"] != sft["options"][0]["train/grad_norm"]
    assert torch.isfinite(torch.tensor([r["train/loss"] for r in rows["options"]])).all()
