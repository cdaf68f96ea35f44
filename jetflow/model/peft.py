"""LoRA adapters as a PEFT directory (Hugging Face peft's LoRA format), the one layout jetflow writes adapters in:
a LoRA run's <run>/adapter/ and each of its checkpoints (jetflow.train.checkpoint).

    adapter_config.json        peft_type LORA, r, lora_alpha, target_modules, lora_dropout 0, bias none,
                               task_type CAUSAL_LM, base_model_name_or_path (null when the base is not a
                               directory or hub name, e.g. the tiny model)
    adapter_model.safetensors  base_model.model.<linear>.lora_A.weight (rank, in) and .lora_B.weight (out, rank),
                               fp32, <linear> the HF module name (model.layers.N.self_attn.q_proj)

peft 0.21.2's `PeftModel.from_pretrained(<HF base>, <dir>)` loads it onto the base
(tests/unit/test_lora_export.py checks the logits against the trainer's). jetflow's own names are the
adapter's parameters, `<linear>.lora.A` / `<linear>.lora.B` (jetflow.precision.lora)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from jetflow.model.checkpoint import CheckpointError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_JETFLOW = re.compile(r"(.+)\.lora\.(A|B)")
_PEFT = re.compile(re.escape(PEFT_PREFIX) + r"(.+)\.lora_(A|B)\.weight")


def peft_name(name: str) -> str:
    """`model.layers.0.self_attn.q_proj.lora.A` -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    m = _JETFLOW.fullmatch(name)
    if m is None:
        raise ValueError(f"{name!r} is not an adapter parameter (<linear>.lora.A or .B)")
    return f"{PEFT_PREFIX}{m[1]}.lora_{m[2]}.weight"


def jetflow_name(name: str) -> str:
    """The inverse of `peft_name`."""
    m = _PEFT.fullmatch(name)
    if m is None:
        raise ValueError(f"{name!r} is not a PEFT LoRA tensor name ({PEFT_PREFIX}<module>.lora_A.weight)")
    return f"{m[1]}.lora.{m[2]}"


def peft_target_modules(targets: list[str] | tuple[str, ...], adapted: list[str]) -> list[str]:
    """PEFT's target_modules: jetflow's targets where each is a name PEFT matches as jetflow does (a module
    name or its last dotted parts); where one is an fnmatch pattern, the adapted linears' full names (PEFT
    matches a list entry as the name or its dotted suffix, and a full name selects that module alone)."""
    if any(c in t for t in targets for c in "*?["):
        return sorted(adapted)
    return sorted(targets)


def adapter_config(rank: int, alpha: float, target_modules: list[str], base: str | None) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": target_modules, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": base, "modules_to_save": None}


def write_adapter_dir(path: str | Path, adapters: dict[str, torch.Tensor], config: dict) -> Path:
    """Write {jetflow adapter name: tensor} and `config` (adapter_config's) into `path` (created)."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {peft_name(n): t.detach().float().contiguous().cpu() for n, t in adapters.items()}
    save_file(tensors, str(d / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (d / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return d


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_WEIGHTS).is_file()


def read_adapter_dir(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """({jetflow adapter name: tensor}, adapter_config) of a PEFT LoRA directory."""
    d = Path(path)
    try:
        tensors = load_file(str(d / ADAPTER_WEIGHTS))
        config = json.loads((d / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"cannot read the LoRA adapters in {d}: {e}") from None
    return {jetflow_name(n): t for n, t in tensors.items()}, config
