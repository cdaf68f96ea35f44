"""Atomic run checkpoints: a step's directory is written under a temporary name and renamed into
place, and the `latest` pointer is replaced atomically, so a run killed at any moment leaves either
the previous checkpoint or the new one, never a half-written one.

checkpoints/step_000012/ model.safetensors, trainer.pt (optimizer, scheduler, version), state.json
(step, data position, counters), rng.pt (torch / python RNG states), manifest.json (the sha256 of
each of those files, written last). A LoRA run's (model.lora) holds its adapters alone in place of
model.safetensors, as a PEFT directory (adapter_config.json, adapter_model.safetensors: jetflow.model.peft),
and trainer.pt the adapters' AdamW state (the only parameters the optimizer has): the frozen base is
rebuilt from its source on resume. A resume verifies the manifest and falls back to the previous
checkpoint (two are kept) when the newest was damaged after it was written (a bad disk, a partial copy).
Checkpoints written during the supervised warm-up are named warmup_000040/ (its step); every one of
them comes before step_000000/ (the warm-up's end), which comes before the RL steps' checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from jetflow.model.checkpoint import CheckpointError, write_config, write_tokenizer
from jetflow.model.peft import ADAPTER_WEIGHTS, is_adapter_dir, read_adapter_dir, write_adapter_dir
from jetflow.model.protocol import ShardedAdapters, ShardedPolicy, hf_weights
from jetflow.precision.lora import ADAPTER, LoRAAdapter, adapter_parameters
from jetflow.writes import atomic_write_text, check_free_space, guarded, tree_bytes


CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "manifest.json"
_NAME = re.compile(r"(warmup|step)_(\d{6,})")


def checkpoint_name(step: int, warmup_step: int | None = None) -> str:
    """step_NNNNNN for RL step `step`; warmup_NNNNNN for a checkpoint in the middle of the warm-up."""
    return f"warmup_{warmup_step:06d}" if warmup_step is not None else f"step_{step:06d}"


def _order(path: Path) -> tuple[int, int]:
    """Oldest first: the warm-up's checkpoints, then the RL steps' (step_000000 is the warm-up's end)."""
    kind, number = _NAME.fullmatch(path.name).groups()
    return (kind == "step", int(number))


def list_checkpoints(root: Path) -> list[Path]:
    """The checkpoint directories under `root`, oldest first (partial `.tmp-` ones are not listed)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _NAME.fullmatch(p.name) and p.is_dir()), key=_order)


RESUME_HINT = "the same command with run.resume=true continues the run"


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module, trainer_state: dict, state: dict,
                    keep: int = 2, model_state: dict[str, torch.Tensor] | None = None, hf_config: bool = False,
                    tokenizer=None, name: str | None = None, extra_dirs: dict[str, Path] | None = None,
                    adapter_config: dict | None = None) -> Path:
    """`model_state`: the weights to write when the caller gathered them already (tensor parallelism:
    a collective every rank joins before rank 0 writes); default: the model's own.
    `hf_config`: also write the model's config.json, and `tokenizer` (a directory or a jetflow
    tokenizer) its files, so that the checkpoint directory describes itself: `jetflow generate --model
    <it>` and transformers read it as a Hugging Face directory. Like every file, they are in the manifest.
    `name`: the directory's name (default step_NNNNNN; see `checkpoint_name`).
    A disk that fails the write (full, read-only, I/O error) is one WriteError naming the file, after the
    partial checkpoint is removed; the older checkpoints are untouched (jetflow.writes).
    `extra_dirs`: {name: directory} moved into the checkpoint under `name` before its manifest (which
    then lists their files too): state other ranks wrote (jetflow.train.fsdp.state's sharded optimizer).
    `adapter_config`: a LoRA checkpoint: `model_state` is the adapters ({`<linear>.lora.A`: tensor}), written
    with this adapter_config.json as a PEFT directory in place of model.safetensors."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    with guarded(root, "the checkpoints directory", after=RESUME_HINT):
        root.mkdir(parents=True, exist_ok=True)
    existing = list_checkpoints(root)
    if existing:
        check_free_space(root, tree_bytes(existing[-1]), "checkpoint")
    else:
        check_free_space(root, _estimate_bytes(model, model_state), "checkpoint", "the weights and Adam's moments")
    final = root / (name or checkpoint_name(step))
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    kept = f"{existing[-1].name} and older are intact: " if existing else ""
    after = f"the partial {final.name} was removed; {kept}{RESUME_HINT}"
    _write_checkpoint_files(tmp, step, model, trainer_state, state, model_state, hf_config, tokenizer, after,
                            extra_dirs or {}, adapter_config)
    with guarded(final, "checkpoint", partial=tmp, after=after):
        if final.exists():  # replaced (a resume fell back past it): moved aside, deleted once the new one is in place
            aside = root / f".old-{final.name}"
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(final, aside)
        os.rename(tmp, final)
    atomic_write_text(root / "latest", final.name, "the checkpoint pointer", after=RESUME_HINT)
    older = [p for p in list_checkpoints(root) if p != final]
    for old in older[:max(len(older) - max(keep - 1, 0), 0)]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in root.glob(".*-*_*"):  # partial checkpoints of killed writers, replaced ones
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
    return final


def _estimate_bytes(model: nn.Module, model_state: dict[str, torch.Tensor] | None) -> int:
    """A first checkpoint's size: the weights, and Adam's two moments as large as the weights."""
    tensors = model_state.values() if model_state is not None else model.parameters()
    return 3 * sum(t.numel() * t.element_size() for t in tensors)


def _write_checkpoint_files(tmp: Path, step: int, model: nn.Module, trainer_state: dict, state: dict,
                            model_state: dict[str, torch.Tensor] | None, hf_config: bool = False,
                            tokenizer=None, after: str = "", extra_dirs: dict[str, Path] | None = None,
                            adapter_config: dict | None = None) -> None:
    def writing(name: str):
        return guarded(tmp / name, "checkpoint file", partial=tmp, after=after)

    with writing(""):
        tmp.mkdir()
        for name, directory in (extra_dirs or {}).items():
            shutil.move(str(directory), str(tmp / name))
    state_dict = model_state if model_state is not None else checkpoint_weights(model)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # tied: the embedding is the one copy
    if adapter_config is not None:  # LoRA: the adapters alone, a PEFT directory
        with writing(ADAPTER_WEIGHTS):
            write_adapter_dir(tmp, tensors, adapter_config)
    else:
        with writing("model.safetensors") as path:
            save_file(tensors, str(path))
    if hf_config:
        with writing("config.json"):
            write_config(model.config, tensors["model.embed_tokens.weight"].dtype, tmp)
    with writing("tokenizer files"):
        write_tokenizer(tokenizer, tmp)
    with writing("trainer.pt") as path:
        torch.save(trainer_state, path)
    with writing("rng.pt") as path:
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, path)
    with writing("state.json") as path:
        path.write_text(json.dumps({"step": step, **state}, indent=2))
    with writing(MANIFEST) as path:
        files = sorted(f for f in tmp.rglob("*") if f.is_file())  # with extra_dirs: their files, by relative path
        path.write_text(json.dumps({f.relative_to(tmp).as_posix(): file_sha256(f) for f in files}, indent=2))


def checkpoint_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint stores: HF-named weights (a Megatron policy gathers its TP shards: a
    collective, so every rank must call it)."""
    return hf_weights(model)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_damage(path: Path) -> str | None:
    """What is wrong with a checkpoint directory (None: intact). A checkpoint from before manifests
    existed is only checked for its files."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        weights = ADAPTER_WEIGHTS if is_adapter_dir(path) else "model.safetensors"
        missing = [n for n in (weights, "trainer.pt", "rng.pt", "state.json") if not (path / n).is_file()]
        return f"missing {', '.join(missing)}" if missing else None
    try:
        digests = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        return f"unreadable {MANIFEST} ({e})"
    for name, digest in digests.items():
        if not (path / name).is_file():
            return f"missing {name}"
        if file_sha256(path / name) != digest:
            return f"{name} does not match its sha256 in {MANIFEST}"
    return None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest intact checkpoint of a run: the one `latest` names, else (with a warning naming the
    damage) the newest older one that verifies. None when the run has no checkpoint; CheckpointError
    when it has some and none is intact (starting over would silently discard the run)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    pointer = root / "latest"
    named, damaged = _named_by_pointer(pointer)
    candidates = list_checkpoints(root)[::-1]  # newest first
    if named is not None and named in candidates:
        candidates.remove(named)
        candidates.insert(0, named)
    elif named is not None:
        damaged.append(f"{named} (named by {pointer.name}, missing)")
    for path in candidates:
        damage = checkpoint_damage(path)
        if damage is None:
            if damaged:
                print(f"[jetflow] warning: checkpoint {damaged[0]} is damaged; resuming from {path.name} instead",
                      file=sys.stderr)
            return path
        damaged.append(f"{path} ({damage})")
    if damaged:
        raise CheckpointError(f"no intact checkpoint in {root}: {'; '.join(damaged)}; restore one from a backup, "
                              "or start over with another run.name")
    return None


def _named_by_pointer(pointer: Path) -> tuple[Path | None, list[str]]:
    """(the checkpoint `latest` names, [its damage]) where it names one by a valid name."""
    if not pointer.is_file():
        return None, []
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, [f"{pointer} (unreadable: {e})"]
    if not _NAME.fullmatch(name):
        return None, [f"{pointer} (names {name!r}, not a checkpoint)"]
    return pointer.parent / name, []


def _load_state(file: Path):
    """torch.load with weights_only=True: tensors, numbers, strings and containers only, so a
    checkpoint from someone else cannot run code on this machine while it is read."""
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{file}: refused to load, it holds more than tensors and plain data ({first}); "
                              "only load checkpoints you trust, and never with weights_only=False") from None
    except (OSError, EOFError, RuntimeError) as e:
        raise CheckpointError(f"cannot read {file}: {e}") from None


def load_checkpoint(path: str | Path, model: nn.Module) -> tuple[dict, dict]:
    """Restore model weights (a LoRA checkpoint's: the adapters, `load_adapters`) and RNG states; returns
    (trainer_state, state)."""
    path = Path(path)
    if is_adapter_dir(path):
        load_adapters(path, model)
        return _load_rest(path)
    try:
        tensors = load_file(str(path / "model.safetensors"))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot read {path / 'model.safetensors'}: {e}") from None
    if isinstance(model, ShardedPolicy):  # a Megatron policy: HF names into its shards
        model.load_hf_state_dict(tensors)
        missing, unexpected = [], []
    else:
        try:
            missing, unexpected = model.load_state_dict(tensors, strict=False)
        except (RuntimeError, ValueError) as e:  # a shape differs
            first = str(e).strip().splitlines()[-1].strip()
            raise CheckpointError(f"checkpoint {path} does not match the model ({first}); was the run's model "
                                  "changed?") from None
    missing = [k for k in missing if k != "lm_head.weight" or not model.config.tie_word_embeddings]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}; was the run's model changed?")
    return _load_rest(path)


def load_adapters(path: str | Path, model: nn.Module) -> None:
    """A LoRA checkpoint's (or PEFT directory's) adapters into `model`'s, which must be exactly its set, of its
    rank and alpha (the scale alpha / rank is not in the tensors: adapter_config.json says it)."""
    tensors, config = read_adapter_dir(path)
    adapters = [m for m in model.modules() if isinstance(m, LoRAAdapter)]
    for key, held_value in (("r", adapters[0].rank if adapters else None),
                            ("lora_alpha", adapters[0].alpha if adapters else None)):
        if adapters and config.get(key) != held_value:
            raise CheckpointError(f"the LoRA adapters in {path} have {key}={config.get(key)}, the model's "
                                  f"{held_value}; was model.lora changed?")
    sharded = isinstance(model, ShardedAdapters)  # the Megatron trainer's TP shards: whole in the native names
    held = {f"{n}.{ADAPTER}.{p}" for n in model.lora_names() for p in "AB"} if sharded else set(adapter_parameters(model))
    if set(tensors) != held:
        raise CheckpointError(f"the LoRA adapters in {path} do not match the model's: missing "
                              f"{sorted(held - set(tensors))[:3]}, unexpected {sorted(set(tensors) - held)[:3]}; was "
                              "model.lora (rank, targets) changed?")
    try:
        if sharded:
            model.load_adapter_state_dict(tensors)
        else:
            model.load_state_dict(tensors, strict=False)
    except (RuntimeError, ValueError) as e:  # a shape differs
        first = str(e).strip().splitlines()[-1].strip()
        raise CheckpointError(f"the LoRA adapters in {path} do not match the model's ({first}); was model.lora.rank "
                              "changed?") from None


LORA_BASE = "lora_base_sha256"
"""The trainer state's entry of the frozen base a LoRA run's adapters were trained on (jetflow.precision.lora.
base_digest): a resume and the final export compare the base they rebuild with it (check_lora_base)."""


def check_lora_base(checkpoint: str | Path, trained_on: str, digest: str, model_path: str) -> None:
    """CheckpointError (one line) when the base rebuilt from model.path (its sha256 `digest`) is not the one the
    checkpoint's adapters were trained on (`trained_on`, its LORA_BASE entry)."""
    if trained_on != digest:
        raise CheckpointError(f"{checkpoint} holds LoRA adapters trained on another base than the one rebuilt from "
                              f"model.path={model_path} (its sha256 differs): was that model changed since? Resume "
                              "or export with the base the run started from")


def _load_rest(path: Path) -> tuple[dict, dict]:
    """The RNG states restored; (trainer_state, state)."""
    rng = _load_state(path / "rng.pt")
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    trainer_state = _load_state(path / "trainer.pt")
    state = json.loads((path / "state.json").read_text())
    return trainer_state, state
