"""GRPO with 2048-token responses on the tiny model (issue 39's Must-show: a run that completes with KL 0
and equal share 1 on every step). `jetflow train` on a config (default configs/tiny.yaml), unchanged but
for the overrides given on the command line, with one change this script makes: the rollout ignores EOS
and the task's stop string, so that every response runs to rollout.max_new_tokens (the engine's
SamplingParams.ignore_eos, which the config does not expose). Why: the tiny model from scratch ends an
answer after a few characters (EOS and the newline stop are each about 1 in 19 of its samples on 1-digit
sums), so no response would reach 2048 tokens otherwise.

--log-dir DIR: two files of JSON lines that metrics.jsonl lacks. weight_changes.jsonl: one line per weight
update the rollout engine receives (its version, its checksum, and against the previous update: how many
FP8 modules' bytes or scales and how many high-precision tensors changed, and the largest change of a
high-precision value), so that a reader can see the policy the engine samples from move between RL steps.
rewards.jsonl: each reward the task gave, one line per scored batch (a custom task's score_batch), so
that the rewards' spread within each group can be read.

    PYTHONPATH=. python scripts/analysis/long_train_grpo_2048.py [--config FILE] [--log-dir DIR] [overrides ...]
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch

from jetflow.cli import main
from jetflow.rollout import native
from jetflow.tasks import custom

_init, _load = native.NativeRollout.__init__, native.NativeRollout.load_weights


def _init_running_to_length(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.params = dataclasses.replace(self.params, ignore_eos=True, stop=())


def _logging_load(path: Path):
    previous: dict = {}

    def load_weights(self, update) -> None:
        _load(self, update)
        now = {**{f"q:{n}": [p.clone() for p in q.parts().values()] for n, q in update.quantized.items()},
               **{f"t:{n}": [t.detach().clone()] for n, t in update.tensors.items()}}
        row = {"version": update.version, "checksum": update.checksum or update.compute_checksum()}
        if previous:
            changed = [n for n in now if any(not torch.equal(a, b) for a, b in zip(now[n], previous[n]))]
            hp = [n for n in now if n.startswith("t:")]
            row.update(fp8_modules_changed=sum(n.startswith("q:") for n in changed),
                       fp8_modules=len(now) - len(hp), hp_tensors_changed=sum(n.startswith("t:") for n in changed),
                       hp_tensors=len(hp), hp_max_abs_change=max(
                           (float((now[n][0].float() - previous[n][0].float()).abs().max()) for n in hp), default=0.0))
        previous.clear()
        previous.update(now)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    return load_weights


def _logging_score(path: Path):
    score = custom.CustomTask.score_batch

    def score_batch(self, problems, completions):
        rewards = score(self, problems, completions)
        with path.open("a") as f:
            f.write(json.dumps({"rows": [p.meta["row"] for p in problems], "rewards": [r.total for r in rewards]}) + "\n")
        return rewards

    return score_batch


args = sys.argv[1:]
config = "configs/tiny.yaml"
if args[:1] == ["--config"]:
    config, args = args[1], args[2:]
if args[:1] == ["--log-dir"]:
    log_dir = Path(args[1])
    log_dir.mkdir(parents=True, exist_ok=True)
    native.NativeRollout.load_weights = _logging_load(log_dir / "weight_changes.jsonl")  # type: ignore[method-assign]
    custom.CustomTask.score_batch = _logging_score(log_dir / "rewards.jsonl")  # type: ignore[method-assign]
    args = args[2:]
native.NativeRollout.__init__ = _init_running_to_length  # type: ignore[method-assign]
sys.exit(main(["train", "--config", config, *args]))
