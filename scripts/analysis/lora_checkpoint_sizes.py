"""results/lora: the newest checkpoint of each run directory given: its files' bytes, its weights file's
(model.safetensors, or a LoRA run's adapter_model.safetensors), trainer.pt's, and the AdamW state's (every tensor
of trainer.pt's optimizer state) over the trained parameters.

    python scripts/analysis/lora_checkpoint_sizes.py <run dir> [<run dir> ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from jetflow.train.checkpoint import list_checkpoints


def sizes(run: Path) -> str:
    d = list_checkpoints(run / "checkpoints")[-1]
    files = {f.name: f.stat().st_size for f in d.iterdir() if f.is_file()}
    state = torch.load(d / "trainer.pt", weights_only=True)["optimizer"]["state"]
    adam = sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t))
    trained = sum(s["exp_avg"].numel() for s in state.values())
    weights = files.get("model.safetensors", files.get("adapter_model.safetensors", 0))
    return (f"{run.name}: {d.name} {sum(files.values()):,} B in its files; weights {weights:,} B; trainer.pt "
            f"{files['trainer.pt']:,} B; AdamW state {adam:,} B over {trained:,} trained parameters")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(sizes(Path(arg)))
