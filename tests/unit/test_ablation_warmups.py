"""Shared supervised warm-ups (jetflow.ablate.warmups): a cell started from its group's warm-up is the cell
run whole, bit for bit, and the warm-up runs once for the group."""

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from jetflow.ablate import load_ablation, run_ablation
from jetflow.config import ConfigError
from jetflow.metrics_log import read_metrics

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["train.steps=2", "train.sft_warmup_steps=6", "train.prompts_per_step=2", "rollout.group_size=2",
          "eval.num_prompts=4", "task.format_weight=0.5", "run.num_threads=1", "run.progress=false",
          "run.tensorboard=false"]  # (a format reward: the groups' rewards differ, so the RL steps move the weights)
SHARED = {"ignore": ["algo.correction"]}


def ablation(tmp_path: Path, name: str, shared: dict | None) -> Path:
    spec = {"name": name, "base_config": str(ROOT / "configs/tiny.yaml"), "overrides": COMMON,
            "grid": {"precision.mode": ["bf16", "mixed", "unified"],
                     "algo.correction": {"values": ["none", "token_tis"], "only_when": {"precision.mode": "mixed"}}}}
    if shared is not None:
        spec["shared_warmup"] = shared
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def without_times(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]


def test_groups_follow_the_keys_the_warm_up_cannot_see(tmp_path):
    ab = load_ablation(ablation(tmp_path, "g", SHARED), tmp_path / "out")
    assert ab.warmup_groups() == {"bf16": "bf16", "mixed-none": "mixed-none", "mixed-token_tis": "mixed-none",
                                  "unified": "unified"}
    assert load_ablation(ablation(tmp_path, "n", None), tmp_path / "out").warmup_groups() == {}
    bad = ablation(tmp_path, "b", {"ignore": "algo.correction"})
    with pytest.raises(ConfigError, match="shared_warmup takes `ignore`, a list"):
        load_ablation(bad)


def test_a_cell_from_the_shared_warm_up_is_the_cell_run_whole(tmp_path):
    logs: list[str] = []
    shared_out, whole_out = tmp_path / "shared", tmp_path / "whole"
    assert run_ablation(ablation(tmp_path, "s", SHARED), out_dir=shared_out, only=["mixed-*"], command="test",
                        log=logs.append) == 0
    assert sum("shared warm-up mixed-none: starting" in line for line in logs) == 1  # once for both mixed cells
    assert run_ablation(ablation(tmp_path, "w", None), out_dir=whole_out, only=["mixed-token_tis"], command="test",
                        log=logs.append) == 0

    warmup = shared_out / "warmups" / "mixed-none"
    assert (warmup / "COMPLETE").exists() and read_metrics(warmup) == []  # no RL step
    shared, whole = shared_out / "runs" / "mixed-token_tis", whole_out / "runs" / "mixed-token_tis"
    # the correction is RL-only: mixed-token_tis's own warm-up is mixed-none's, so its RL starts where it would have
    for step in ("step_000000", "step_000002"):
        a, b = (load_file(str(run / "checkpoints" / step / "model.safetensors")) for run in (shared, whole))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), step
    assert without_times(read_metrics(shared, "sft")) == without_times(read_metrics(whole, "sft"))
    assert without_times(read_metrics(shared)) == without_times(read_metrics(whole))
    assert any(r["train/loss"] != 0 for r in read_metrics(whole))  # the RL steps did move the weights
    assert without_times(read_metrics(shared, "eval")) == without_times(read_metrics(whole, "eval"))
    assert (shared_out / "runs" / "mixed-none" / "COMPLETE").exists()


def test_arms_of_every_precision_share_one_warm_up_when_the_mode_is_ignored(tmp_path):
    """The paired design of configs/ablations/learning-length.yaml: with precision.mode ignored, each
    arm's RL starts from the one warm-up (the group's first cell's: bf16), as the papers' arms start from
    one pretrained model; the unified arm's first RL step then runs FP8 on those weights."""
    shared = {"ignore": ["algo.correction", "precision.mode"]}
    ab = load_ablation(ablation(tmp_path, "p", shared), tmp_path / "out")
    assert set(ab.warmup_groups().values()) == {"bf16"}
    logs: list[str] = []
    assert run_ablation(ablation(tmp_path, "p", shared), out_dir=tmp_path / "out", only=["bf16", "unified"],
                        command="test", log=logs.append) == 0
    assert sum("shared warm-up bf16: starting" in line for line in logs) == 1
    runs = tmp_path / "out" / "runs"
    start = [load_file(str(runs / arm / "checkpoints" / "step_000000" / "model.safetensors")) for arm in ("bf16", "unified")]
    assert all(torch.equal(start[0][k], start[1][k]) for k in start[0])  # one starting point
    end = [load_file(str(runs / arm / "checkpoints" / "step_000002" / "model.safetensors")) for arm in ("bf16", "unified")]
    assert any(not torch.equal(end[0][k], end[1][k]) for k in end[0])  # then each arm's own RL
    rl = read_metrics(runs / "unified")
    assert len(rl) == 2 and all(r["mismatch/kl_k1"] == 0.0 for r in rl)  # unified stays exactly on-policy


def test_rl_draws_share_one_warm_up_and_are_the_runs_resumed_from_it_with_another_seed(tmp_path):
    """run.rl_seed: RL replicates of one start. The draws of a grid share its warm-up, are pooled in a line and
    paired between lines by draw, and each is bit for bit what the warm-up resumed with run.seed set to the draw
    gives (how results/learning-length's replicates were made by hand)."""
    from jetflow.ablate.length_study import gather
    from jetflow.ablate.warmups import start_from_warmup
    from jetflow.config import load_config
    from jetflow.run.runner import train

    spec = {"name": "d", "base_config": str(ROOT / "configs/tiny.yaml"), "overrides": COMMON,
            "grid": {"precision.mode": ["bf16", "mixed"], "run.rl_seed": [5, 6]},
            "shared_warmup": {"ignore": ["precision.mode", "run.rl_seed"]}}
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    out, logs = tmp_path / "out", []
    ab = load_ablation(path, out)
    assert ab.warmup_groups() == dict.fromkeys(["bf16-draw5", "bf16-draw6", "mixed-draw5", "mixed-draw6"], "bf16-draw5")
    assert run_ablation(path, out_dir=out, command="test", log=logs.append) == 0
    assert sum("shared warm-up bf16-draw5: starting" in line for line in logs) == 1
    results = gather(ab)
    assert {key: sorted(draws) for key, draws in results.items()} == {("all cells", "bf16"): [(0, 5), (0, 6)],
                                                                     ("all cells", "mixed"): [(0, 5), (0, 6)]}

    def weights(run: Path, step: str) -> dict:
        return load_file(str(run / "checkpoints" / step / "model.safetensors"))

    runs = out / "runs"
    start, ends = weights(runs / "bf16-draw5", "step_000000"), [weights(runs / f"bf16-draw{d}", "step_000002") for d in (5, 6)]
    assert all(torch.equal(start[k], weights(runs / "bf16-draw6", "step_000000")[k]) for k in start)  # one start
    assert any(not torch.equal(ends[0][k], ends[1][k]) for k in start)  # two draws

    hand = tmp_path / "hand"
    start_from_warmup(out / "warmups" / "bf16-draw5", hand / "draw5")
    train(load_config(runs / "bf16-draw5" / "config.yaml", ["run.rl_seed=null", "run.seed=5", f"run.out_dir={hand}",
                                                           "run.name=draw5", "run.resume=true"]))
    by_hand = weights(hand / "draw5", "step_000002")
    assert all(torch.equal(by_hand[k], ends[0][k]) for k in start)
    for phase in ("rl", "eval"):
        assert without_times(read_metrics(hand / "draw5", phase)) == without_times(read_metrics(runs / "bf16-draw5", phase))


def test_a_warm_up_copied_from_another_ablation_is_used_when_only_unread_keys_differ(tmp_path):
    """A shared warm-up may be another ablation's, copied in under this group's name: it may differ in its name
    and the keys the warm-up does not read (shared_warmup.ignore), and nothing else."""
    import shutil

    first = tmp_path / "first"
    assert run_ablation(ablation(tmp_path, "s", SHARED), out_dir=first, only=["mixed-token_tis"], command="test",
                        log=lambda s: None) == 0

    def reuse(name: str, overrides: list[str]) -> Path:
        spec = {"name": name, "base_config": str(ROOT / "configs/tiny.yaml"),
                "overrides": [*COMMON, "precision.mode=mixed", *overrides],
                "grid": {"algo.correction": ["token_tis", "none"]}, "shared_warmup": SHARED}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        shutil.copytree(first / "warmups" / "mixed-none", tmp_path / name / "warmups" / "token_tis")
        return path

    logs: list[str] = []
    assert run_ablation(reuse("again", []), out_dir=tmp_path / "again", only=["token_tis"], command="test",
                        log=logs.append) == 0
    assert not any("shared warm-up" in line for line in logs)  # not rerun
    a, b = (load_file(str(run / "checkpoints" / "step_000002" / "model.safetensors"))
            for run in (first / "runs" / "mixed-token_tis", tmp_path / "again" / "runs" / "token_tis"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigError, match=r"shared warm-up 'token_tis'.*train.sft_lr"):
        run_ablation(reuse("other", ["train.sft_lr=1e-3"]), out_dir=tmp_path / "other", command="test")
