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


def synthetic_experience(batch: int, prompt_len: int, response_len: int, vocab_size: int, pad_id: int,
                         seed: int = 0, device: str | torch.device = "cpu") -> Experience:
    """A full (unpadded) batch of random tokens with random advantages: the same work for every mode.

    Every row has exactly prompt_len + response_len real tokens, so tokens/s is unambiguous.
    """
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab_size, (batch, prompt_len), generator=g)  # (B, P)
    responses = torch.randint(0, vocab_size, (batch, response_len), generator=g)  # (B, R)
    rewards = torch.randint(0, 2, (batch,), generator=g).float()  # (B,)
    advantages = torch.randn(batch, generator=g)  # (B,)
    zeros = [[0.0] * response_len for _ in range(batch)]
    return pack_experience(prompts.tolist(), responses.tolist(), zeros, rewards, advantages, pad_id, device)


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
