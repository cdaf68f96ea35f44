"""A stale batch's mismatch split into numerics and staleness (rollout.split_mismatch, jetflow.run.staleness_split,
jetflow.rl.mismatch.split_mismatch, issue 72): numerics is the behaviour log-probs against the trainer's under the
version that sampled (0 under exact numerics), staleness that against the trainer's current weights."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from jetflow.config import load_config
from jetflow.metrics_log import read_metrics
from jetflow.rl import mismatch_metrics, split_mismatch

COMMON = ["train.sft_warmup_steps=4", "train.steps=4", "eval.num_prompts=0", "train.prompts_per_step=2",
          "rollout.group_size=2", "run.progress=false", "run.loggers=[]", "run.num_threads=2", "run.name=r",
          "train.weight_decay=0.5", "rollout.split_mismatch=true"]  # weight decay: every version differs


def _k3(deltas: list[float]) -> float:
    return sum(math.exp(d) - 1 - d for d in deltas) / len(deltas)


def test_the_split_is_the_two_gaps_in_a_row():
    behaviour = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]], dtype=torch.float64)
    sampling = torch.tensor([[-1.1, -2.0, -0.4], [-0.1, -2.5, 0.0]], dtype=torch.float64)
    current = torch.tensor([[-0.9, -2.2, -0.4], [-0.3, -2.5, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = split_mismatch(behaviour, sampling, current, mask)
    rows = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    numerics = [float(sampling[r] - behaviour[r]) for r in rows]
    staleness = [float(current[r] - sampling[r]) for r in rows]
    assert out["mismatch/numerics_kl_k3"] == pytest.approx(_k3(numerics), rel=1e-12)
    assert out["mismatch/staleness_kl_k3"] == pytest.approx(_k3(staleness), rel=1e-12)
    assert out["mismatch/numerics_equal_frac"] == pytest.approx(2 / 5)
    total = mismatch_metrics(behaviour, current, mask)["mismatch/kl_k1"]
    assert out["mismatch/numerics_kl_k1"] + out["mismatch/staleness_kl_k1"] == pytest.approx(total, rel=1e-12)
    assert split_mismatch(behaviour, behaviour, behaviour, mask)["mismatch/numerics_kl_k3"] == 0.0


def _run(tmp_path, monkeypatch, *extra: str):
    """A run with rollout.split_mismatch; (its rl rows, each step's (experience, sampling version), the trainer,
    the trainer's weights of each version sent)."""
    from jetflow.run.loop import RLLoop
    from jetflow.run.runner import train
    from jetflow.train.trainer import Trainer

    snapshots: dict[int, dict] = {}
    steps: list[tuple] = []
    weight_update, update = Trainer.weight_update, RLLoop._update

    def snapshot(self, *args, **kwargs):
        snapshots[self.version] = copy.deepcopy(self.model.state_dict())
        return weight_update(self, *args, **kwargs)

    def record(self, exp, metrics):
        steps.append((copy.deepcopy(exp), self.batch.out.weight_version, self.trainer))
        return update(self, exp, metrics)

    monkeypatch.setattr(Trainer, "weight_update", snapshot)
    monkeypatch.setattr(RLLoop, "_update", record)
    run_dir = train(load_config("configs/tiny.yaml", [*COMMON, f"run.out_dir={tmp_path}", *extra]))
    return read_metrics(run_dir, "rl"), steps, snapshots


def test_under_exact_numerics_every_nat_is_staleness(tmp_path, monkeypatch):
    """...and the split changes nothing else: the run without it logs the same rows, the split's keys aside."""
    from jetflow.run.runner import train

    rows, steps, _ = _run(tmp_path / "split", monkeypatch, "rollout.max_staleness=2", "precision.numerics=exact")
    monkeypatch.undo()
    plain = read_metrics(train(load_config("configs/tiny.yaml", [*COMMON, f"run.out_dir={tmp_path / 'plain'}",
                                                                 "rollout.max_staleness=2", "precision.numerics=exact",
                                                                 "rollout.split_mismatch=false"])), "rl")
    split_keys = ("mismatch/numerics_", "mismatch/staleness_")
    clock = ("time/", "throughput/", "async/trainer_idle", "async/engine_idle")
    assert [{k: v for k, v in r.items() if not k.startswith(clock + split_keys)} for r in rows] == \
        [{k: v for k, v in r.items() if not k.startswith(clock)} for r in plain]
    assert all(k.startswith(split_keys) for r in rows for k in r if k not in plain[0])
    assert [version for _, version, _ in steps] == [0, 0, 0, 1]
    for step, r in enumerate(rows):
        assert r["mismatch/numerics_kl_k3"] == 0.0 and r["mismatch/numerics_equal_frac"] == 1.0, step
        assert r["mismatch/staleness_kl_k3"] == r["mismatch/kl_k3"], step
        assert r["mismatch/staleness_kl_k1"] == pytest.approx(r["mismatch/kl_k1"], abs=1e-12), step
    assert rows[0]["mismatch/staleness_kl_k3"] == 0.0 and all(r["mismatch/staleness_kl_k3"] > 0 for r in rows[1:])


def test_the_numerics_part_is_the_trainers_recomputation_under_the_sampling_version(tmp_path, monkeypatch):
    """mixed (bf16 trainer, FP8 engine): the numerics part is not 0, and it is the gap to the trainer's log-probs
    recomputed here from its weights of the sampling version (kept by the test)."""
    rows, steps, snapshots = _run(tmp_path, monkeypatch, "rollout.max_staleness=1", "precision.mode=mixed")
    trainer = steps[0][2]
    for step, ((exp, version, _), r) in enumerate(zip(steps, rows)):
        mask = exp.response_mask.bool()
        trainer.model.load_state_dict(snapshots[version])
        sampling = trainer.compute_logprobs(exp, 1.0)
        deltas = (sampling.double() - exp.rollout_logprobs.double())[mask].tolist()
        assert r["mismatch/numerics_kl_k3"] == pytest.approx(_k3(deltas), rel=1e-9, abs=1e-15), step
        assert r["mismatch/numerics_kl_k3"] > 0, step
        assert r["mismatch/numerics_kl_k1"] + r["mismatch/staleness_kl_k1"] == pytest.approx(r["mismatch/kl_k1"],
                                                                                               rel=1e-9, abs=1e-12)
    assert rows[0]["mismatch/staleness_kl_k3"] == 0.0 and all(r["mismatch/staleness_kl_k3"] > 0 for r in rows[1:])
