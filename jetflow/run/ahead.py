"""Bounded staleness (rollout.max_staleness = k > 0): rollouts generated ahead of the steps that train on them.

The schedule is fixed, so that a run reproduces and resumes bit for bit: right after step s's weight sync,
the batch of step s + k is submitted to the engine's process (at step 0, the batches of steps 0..k), which
generates it under the weights of step s while this process trains steps s..s + k - 1. Step t's samples are
therefore exactly k weight versions old (t < k: t versions), and each batch carries the version that made
it, checked when it is taken. Where the peers' schedules (verl, AReaL, NeMo-RL) let a batch be as stale as
the engine happens to run, up to the bound, this one is always at the bound: a run is a function of its seed.

With in-flight weight updates (rollout.inflight_updates), the batch of step s + k takes step s + 1's weights half
way (jetflow.run.inflight): its tokens are k or k - 1 versions old, each tagged.

The batches in flight at a checkpoint are waited for and kept in it (`in_flight`): the resumed run trains
on the same samples, where regenerating them would need the weight versions before the checkpoint.

The engine is the engine's process of a local run (jetflow.run.engine_process) or, under run.orchestrator=ray,
the engine actors (jetflow.run.ray_rollout): both queue calls in order and reply to `collect`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable

from jetflow.rollout.types import Rollouts
from jetflow.run.engine_process import ProcessRollout
from jetflow.tasks import Problem

if TYPE_CHECKING:
    from jetflow.run.ray_rollout import RayRollout


@dataclass
class Requests:
    """One step's requests: each prompt once (a problem's group_size times), with its seed."""
    prompts: list[list[int]]
    seeds: list[int]
    problems: list[Problem] | None  # a multi-turn run's problems, one per prompt (None: one turn)


@dataclass
class Batch:
    """A step's rollouts as the loop takes them."""
    out: Rollouts
    expected_version: int  # the version sent before the batch was submitted: the one it must carry
    wait_s: float  # this process's wait for it (0 when it was ready)
    engine_s: float  # the engine's seconds generating it (as measured when it was made)


class RolloutsAhead:
    def __init__(self, engine: ProcessRollout | RayRollout, max_staleness: int, steps: int,
                 restored: dict[int, dict] | None = None, pause_at: int | None = None):
        self.engine, self.k, self.steps = engine, max_staleness, steps
        self.pause_at = pause_at  # in-flight updates: the decode step at which a batch takes the next update
        self._submitted: dict[int, tuple[int, int]] = {}  # step -> (ticket, the version it was submitted under)
        self._ready: dict[int, tuple[Rollouts, int, float]] = {}  # step -> (rollouts, version, engine seconds)
        for step, saved in (restored or {}).items():
            self._ready[int(step)] = (Rollouts(**saved["rollouts"]), int(saved["version"]), float(saved["engine_s"]))

    def submit_through(self, step: int, requests_of: Callable[[int], Requests]) -> None:
        """After step `step`'s sync: submit the steps up to step + k (before the run's end) not submitted yet,
        under the weights just sent; the batches of the steps before `step` are done with."""
        for done in [t for t in self._ready if t < step]:
            del self._ready[done]
        for t in range(step, min(step + self.k, self.steps - 1) + 1):
            if t not in self._submitted and t not in self._ready:
                r = requests_of(t)
                pause = self.pause_at if t == step + self.k else None  # (at step 0 batch k alone: jetflow.run.inflight)
                self._submitted[t] = (self.engine.submit(r.prompts, r.seeds, problems=r.problems, pause_at=pause),
                                      self.engine.weight_version)

    def take(self, step: int) -> Batch:
        """Step `step`'s batch, waited for if the engine is still on it (kept until the next step begins: a
        checkpoint at this step's start still holds it)."""
        t0 = time.perf_counter()
        if step not in self._ready:
            self._collect(step)
        out, version, engine_s = self._ready[step]
        return Batch(out, version, time.perf_counter() - t0, engine_s)

    def _collect(self, step: int) -> None:
        ticket, version = self._submitted.pop(step)
        out = self.engine.collect(ticket)
        self._ready[step] = (out, version, self.engine.busy_s)

    def in_flight(self, from_step: int) -> dict[int, dict]:
        """The batches of steps >= `from_step` submitted so far, each waited for, as plain containers (a
        checkpoint's trainer state loads with weights_only)."""
        for step in sorted(self._submitted):
            self._collect(step)
        return {step: {"rollouts": asdict(out), "version": version, "engine_s": engine_s}
                for step, (out, version, engine_s) in sorted(self._ready.items()) if step >= from_step}
