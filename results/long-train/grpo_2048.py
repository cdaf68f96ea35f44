"""GRPO with 2048-token responses on the tiny model (issue 39's Must-show: a run that completes with KL 0
and equal share 1 on every step). `jetflow train` on configs/tiny.yaml, unchanged but for the overrides
given on the command line, with one change this script makes: the rollout ignores EOS and the task's stop
string, so that every response runs to rollout.max_new_tokens (the engine's SamplingParams.ignore_eos,
which the config does not expose). Why: the tiny model on 1-digit sums ends an answer after a few
characters (from scratch, EOS and the newline stop are each about 1 in 19 of its samples), so no response
would reach 2048 tokens otherwise. The model need not learn anything here.

    PYTHONPATH=. python results/long-train/grpo_2048.py [jetflow train overrides ...]
"""

import dataclasses
import sys

from jetflow.cli import main
from jetflow.rollout import native

_init = native.NativeRollout.__init__


def _init_running_to_length(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.params = dataclasses.replace(self.params, ignore_eos=True, stop=())


native.NativeRollout.__init__ = _init_running_to_length
sys.exit(main(["train", "--config", "configs/tiny.yaml", *sys.argv[1:]]))
