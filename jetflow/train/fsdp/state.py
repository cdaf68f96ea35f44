"""The FSDP backend's optimizer state in a checkpoint: sharded, with torch.distributed.checkpoint (DCP).

A checkpoint of an FSDP run is the ordinary one (jetflow.train.checkpoint: whole HF-named weights in
model.safetensors, so the directory still loads as a Hugging Face model, trainer.pt, rng.pt,
state.json, manifest.json) with the AdamW moments moved out of trainer.pt into `optimizer/`: a DCP
directory where every rank wrote its own shards (`__<rank>_0.distcp`) and rank 0 the `.metadata`.
trainer.pt keeps `optimizer: None` in their place. DCP reads the shards back into whatever layout
the resuming run has, so a run resumes at another world size (2 ranks -> 1, 1 -> 2).

The files are written by every rank into a staging directory first; rank 0 moves it into the
checkpoint before its manifest and its atomic rename (jetflow.train.checkpoint.save_checkpoint's
`extra_dirs`), so a run killed at any moment still leaves a whole checkpoint or none. Every rank must
see the same file system (one node, or a shared run directory).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn as nn

from jetflow.model.checkpoint import CheckpointError

OPTIMIZER_DIR = "optimizer"


def without_optimizers(state: dict) -> dict:
    """`state` (TrainerSide.state()) with each optimizer state (the trainer's, the warm-up's) set to None."""
    out = {**state, "optimizer": None}
    if "warmup" in state:
        out["warmup"] = {**state["warmup"], "optimizer": None}
    return out


def save_optimizers(policy: nn.Module, optimizers: dict[str, torch.optim.Optimizer], directory: Path,
                    rank: int) -> None:
    """Every rank: its shards of each optimizer's state into the DCP directory `directory` (replaced)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)  # a killed writer's leftovers
    dist.barrier()
    # an optimizer that has not stepped yet (the RL trainer's during the warm-up) has no state to save,
    # and asking torch for its state dict would initialize it (a step of lr 0)
    state = {name: get_optimizer_state_dict(policy, opt) for name, opt in optimizers.items() if opt.state}
    dcp.save(state, checkpoint_id=str(directory))


def load_optimizers(policy: nn.Module, optimizers: dict[str, torch.optim.Optimizer], checkpoint: Path) -> None:
    """Every rank: each optimizer's state from the checkpoint's DCP directory, resharded to this run's ranks
    (an optimizer the checkpoint holds no state for, one that had not stepped, stays as it is)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    directory = checkpoint / OPTIMIZER_DIR
    if not (directory / ".metadata").is_file():
        raise CheckpointError(f"{checkpoint} has no sharded optimizer state ({OPTIMIZER_DIR}/): it was not written by "
                              "train.backend=fsdp; resume it with the backend that wrote it")
    saved = {key.split(".")[0] for key in dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata}
    state = {name: get_optimizer_state_dict(policy, opt) for name, opt in optimizers.items() if name in saved}
    dcp.load(state, checkpoint_id=str(directory))
    for name in state:
        set_optimizer_state_dict(policy, optimizers[name], state[name])
