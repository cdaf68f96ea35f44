"""The resume tests' crash: a run killed at a given step of one of its phases (the RL loop's or the warm-up's
`step`), with no chance to checkpoint, as SIGKILL would leave it."""

from __future__ import annotations


def kill_at_step(monkeypatch, phase: type, at: int) -> None:
    """Make `phase.step` (RLLoop.step, Warmup.step: `step(self, t)`) raise SystemExit("killed") when it is called
    for step `at`; the steps before run as they are. `monkeypatch.undo()` restores it."""
    original = phase.step

    def step(self, t, *args, **kwargs):
        if t == at:
            raise SystemExit("killed")
        return original(self, t, *args, **kwargs)

    monkeypatch.setattr(phase, "step", step)
