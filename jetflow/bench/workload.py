"""What the step-level benchmarks share: the model a bench runs on, a synthetic training batch, and
the machine's load while it ran (the CPU machines are shared, so every result says how busy it was).
"""

from __future__ import annotations

import os

import torch

from jetflow.config import Config, load_config
from jetflow.rl.experience import Experience, pack_experience

MODEL_HELP = "`smollm2` (SmolLM2-135M-Instruct, the default), `tiny` (2 layers, from scratch) or a HF directory"


def bench_config(model: str = "smollm2", overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """A run config for a bench on `model` (no progress bar, no TensorBoard), plus `key=value` overrides."""
    return load_config(None, [f"model.path={model}", "run.progress=false", "run.tensorboard=false",
                              *overrides])


LENGTHS = ("fixed", "long-tail")
"""Response-length distributions of a synthetic batch: fixed (every response at the max) | long-tail
(most short, a few at the max: every 8th row, at least one, at the max; the others at max / 8)."""


def response_lengths(batch: int, response_len: int, dist: str = "fixed") -> list[int]:
    """Each row's response length under `dist` (LENGTHS)."""
    if dist == "fixed":
        return [response_len] * batch
    if dist == "long-tail":
        return [response_len if i % 8 == 0 else max(1, response_len // 8) for i in range(batch)]
    raise ValueError(f"length distribution {dist!r}: one of {', '.join(LENGTHS)}")


def synthetic_experience(batch: int, prompt_len: int, response_len: int, vocab_size: int, pad_id: int,
                         seed: int = 0, device: str | torch.device = "cpu", dist: str = "fixed") -> Experience:
    """A batch of random tokens with random advantages: the same work for every mode.

    Every row has prompt_len prompt tokens and a response of `response_lengths(batch, response_len, dist)`
    tokens (fixed: all response_len, so the batch is unpadded and tokens/s unambiguous; long-tail: the
    shorter responses right-padded).
    """
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab_size, (batch, prompt_len), generator=g)  # (B, P)
    responses = torch.randint(0, vocab_size, (batch, response_len), generator=g)  # (B, R)
    rewards = torch.randint(0, 2, (batch,), generator=g).float()  # (B,)
    advantages = torch.randn(batch, generator=g)  # (B,)
    lengths = response_lengths(batch, response_len, dist)
    return pack_experience(prompts.tolist(), [r[:n] for r, n in zip(responses.tolist(), lengths)],
                           [[0.0] * n for n in lengths], rewards, advantages, pad_id, device)


class LoadAverage:
    """1-minute load average before and after a block (os.getloadavg), rounded for the record."""

    def __enter__(self) -> "LoadAverage":
        self.before = os.getloadavg()[0]
        self.after = self.before
        return self

    def __exit__(self, *exc) -> None:
        self.after = os.getloadavg()[0]

    def record(self) -> dict:
        return {"before": round(self.before, 2), "after": round(self.after, 2), "cpu_count": os.cpu_count()}

    def sentence(self) -> str:
        return (f"Machine load average (1 min) before / after: {self.before:.1f} / {self.after:.1f} on "
                f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
                f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}.")
