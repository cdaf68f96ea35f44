"""results/lora: a run's memory phase by phase, in one process (the trainer side, its rollout engine, two RL
steps, a checkpoint), as `jetflow train` builds them: peak RSS (ru_maxrss) and current RSS after each, then the
AdamW state's and the gradients' bytes and the trained parameters.

    python scripts/analysis/lora_memory_phases.py                         # SmolLM2, unified, full fine-tuning
    python scripts/analysis/lora_memory_phases.py model.lora.rank=16      # the same with LoRA rank 16

Any other key=value overrides the built-in defaults (configs/default.yaml) like `jetflow train`'s; evaluation
off, one thread, run files in a temporary directory.
"""

from __future__ import annotations

import resource
import sys
import tempfile
from pathlib import Path

import torch

from jetflow.config import derive, load_config
from jetflow.run.build import load_inputs
from jetflow.run.sides import TrainerSide


def report(label: str) -> None:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux
    now = int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 1e9
    print(f"{label:<28} peak {peak:6.2f} GB   now {now:6.2f} GB", flush=True)


def main(overrides: list[str]) -> None:
    out = Path(tempfile.mkdtemp())
    cfg = load_config(None, [*overrides, "eval.num_prompts=0", "run.num_threads=1", f"run.out_dir={out}"])
    torch.set_num_threads(1)
    derived = derive(cfg)
    inputs = load_inputs(cfg)
    report("inputs")
    side = TrainerSide(cfg, derived, inputs)
    report("trainer side (model, AdamW)")
    loop = side.rl_loop()
    report("rollout engine")
    for step in range(2):
        loop.step(step)
        report(f"step {step}")
    adam = sum(t.numel() * t.element_size() for s in side.trainer.optimizer.state.values() for t in s.values()
               if torch.is_tensor(t))
    grads = sum(p.grad.numel() * p.grad.element_size() for p in side.model.parameters() if p.grad is not None)
    trained = sum(p.numel() for p in side.model.parameters() if p.requires_grad)
    print(f"AdamW state {adam:,} B; gradients held {grads:,} B; trained parameters {trained:,}")
    side.save(out / "r", 2, True)
    report("checkpoint")


if __name__ == "__main__":
    main(sys.argv[1:])
