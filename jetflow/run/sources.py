"""What kind of model directory a path is, and how each kind loads: the one place that decides.

    hf          config.json + model.safetensors (or shards + model.safetensors.index.json)
    fp8-export  the same with `quantization_config` in config.json: `jetflow export`'s directory, FP8
                linears as float8_e4m3fn + weight_scale_inv (vLLM / DeepSeek layout); loads running
                the exported bytes (jetflow.model.checkpoint.load_fp8_dir)
    checkpoint  <run>/checkpoints/step_NNNNNN/: model.safetensors (HF names), trainer.pt, rng.pt,
                state.json, manifest.json, and config.json + tokenizer files where the run wrote them
                (`save_checkpoint(hf_config=True)`); without them the model and the tokenizer are the
                run's, described by its config.yaml two levels up
    run         <run.out_dir>/<run.name>/ (config.yaml): its final model/ (`jetflow.export.
                write_final_model`) if written, else its newest intact checkpoint

A LoRA run's checkpoint (adapters alone, a PEFT directory) and its adapter/ are no model: a CheckpointError
says where the model is.

`load_model`, `load_model_tokenizer` and `jetflow generate --model` go through `resolve_model_dir`;
a directory of none of these kinds is one CheckpointError saying what was expected. (`jetflow.model.load`
reads the directories that hold config.json: every kind but a run and an older checkpoint.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from jetflow.config import load_config as load_run_config
from jetflow.model.checkpoint import CONFIG_FILE, SINGLE_FILE, CheckpointError, load_hf_dir, load_weights, read_json
from jetflow.export import FINAL_MODEL_DIR
from jetflow.model.peft import ADAPTER_CONFIG, is_adapter_dir
from jetflow.model import with_precision
from jetflow.model.decoder import Decoder, ModelConfig
from jetflow.model.tokenizer import CHAR_TOKENIZER_FILE
from jetflow.model.tokenizer import load_tokenizer as load_tokenizer_files
from jetflow.run.build import build_tokenizer, model_architecture
from jetflow.run.files import CONFIG_FILE as RUN_CONFIG
from jetflow.train.checkpoint import CHECKPOINTS_DIR, latest_checkpoint

HF, FP8_EXPORT, CHECKPOINT, RUN = "hf", "fp8-export", "checkpoint", "run"
STATE_FILE = "state.json"
"""A run checkpoint's marker (jetflow.train.checkpoint writes it beside model.safetensors)."""

EXPECTED = ("a Hugging Face directory (config.json + model.safetensors), a `jetflow export` FP8 directory, "
            "a run checkpoint (<run>/checkpoints/step_NNNNNN/) or a run directory (config.yaml + model/ "
            "or checkpoints/)")


@dataclass(frozen=True)
class ModelSource:
    """A model directory resolved to what loads: a run directory resolves to its final model or its
    newest checkpoint."""

    kind: str
    """hf | fp8-export | checkpoint."""
    weights_dir: Path
    """The directory holding the safetensors (and config.json, except in an older checkpoint)."""
    run_dir: Path | None = None
    """A checkpoint's run (its config.yaml describes the model and tokenizer a checkpoint lacks)."""

    @property
    def quantized(self) -> bool:
        """Stored in FP8: loads with FP8 linears running the stored bytes (the `unified` rollout)."""
        return self.kind == FP8_EXPORT

    def load(self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Decoder:
        if (self.weights_dir / CONFIG_FILE).is_file():
            return load_hf_dir(self.weights_dir, dtype=dtype, device=device)
        return load_weights(self.weights_dir, run_model_config(self.run_dir), dtype=dtype, device=device)

    def tokenizer(self):
        """Its own tokenizer files, else (a checkpoint without them) its run's tokenizer."""
        if _has_tokenizer(self.weights_dir) or self.run_dir is None:
            return load_tokenizer_files(self.weights_dir)  # none: a FileNotFoundError naming the files
        return run_tokenizer(self.run_dir)


def resolve_model_dir(path: str | Path) -> ModelSource:
    """What `path` holds: see the module docstring. CheckpointError if it is none of the kinds."""
    d = Path(path)
    kind = directory_kind(d)
    if kind is None and is_adapter_dir(d):
        raise CheckpointError(f"{d} holds LoRA adapters alone (a PEFT directory: {ADAPTER_CONFIG}, adapter_model."
                              "safetensors) for a frozen base: load the base with peft.PeftModel.from_pretrained, or the "
                              f"merged model its run writes at the end ({FINAL_MODEL_DIR}/)")
    if kind == RUN:
        return _resolve_run(d)
    if kind is None:
        where = "does not exist" if not d.exists() else "is not a model directory"
        raise CheckpointError(f"{d} {where}: expected {EXPECTED}")
    run = _run_of_checkpoint(d) if kind == CHECKPOINT else None
    if kind == CHECKPOINT and run is None and not (d / CONFIG_FILE).is_file():
        raise CheckpointError(f"checkpoint {d} has no {CONFIG_FILE} (written before checkpoints carried one) and "
                              f"no run config {d.parent.parent / RUN_CONFIG} describes its model")
    return ModelSource(kind, d, run)


def directory_kind(d: Path) -> str | None:
    """hf | fp8-export | checkpoint | run, by the files `d` holds; None for anything else."""
    if (d / CONFIG_FILE).is_file():
        if "quantization_config" in read_json(d / CONFIG_FILE):
            return FP8_EXPORT
        return CHECKPOINT if (d / STATE_FILE).is_file() else HF
    if (d / SINGLE_FILE).is_file() and (d / STATE_FILE).is_file():
        return CHECKPOINT
    if (d / RUN_CONFIG).is_file():
        return RUN
    return None


def _resolve_run(run_dir: Path) -> ModelSource:
    """A run's final model if it wrote one, else its newest intact checkpoint."""

    final = run_dir / FINAL_MODEL_DIR
    if (final / CONFIG_FILE).is_file():
        return resolve_model_dir(final)
    checkpoint = latest_checkpoint(run_dir)  # CheckpointError when all are damaged
    if checkpoint is None:
        raise CheckpointError(f"run directory {run_dir} has no {FINAL_MODEL_DIR}/ and no checkpoint yet: no model to "
                              "load")
    return resolve_model_dir(checkpoint)


def _run_of_checkpoint(d: Path) -> Path | None:
    """<run> for <run>/checkpoints/step_NNNNNN when <run>/config.yaml exists."""

    checkpoints = d.resolve().parent
    run = checkpoints.parent
    return run if checkpoints.name == CHECKPOINTS_DIR and (run / RUN_CONFIG).is_file() else None


def _has_tokenizer(d: Path) -> bool:
    return (d / CHAR_TOKENIZER_FILE).is_file() or (d / "tokenizer.json").is_file()


# The model and tokenizer a run was built with, from its config.yaml (jetflow.run.build's recipe) --------

def run_model_config(run_dir: Path) -> ModelConfig:
    """The ModelConfig of the model a run trains (model.path: tiny, smollm2 or an HF directory)."""
    return model_architecture(load_run_config(run_dir / RUN_CONFIG))


def run_tokenizer(run_dir: Path):
    return build_tokenizer(load_run_config(run_dir / RUN_CONFIG))


def load_model(path: str | Path, precision=None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", **precision_kwargs) -> Decoder:
    """`jetflow.model.load` for every kind of model directory (a run: its final model or newest
    checkpoint)."""
    return with_precision(resolve_model_dir(path).load(dtype, device), precision, **precision_kwargs)


def load_model_tokenizer(path: str | Path):
    """The tokenizer of a tokenizer directory or file, or of any model directory (a checkpoint
    without tokenizer files: its run's)."""
    p = Path(path)
    if p.is_file() or _has_tokenizer(p) or directory_kind(p) is None:
        return load_tokenizer_files(p)  # its FileNotFoundError names the files it looked for
    return resolve_model_dir(p).tokenizer()
