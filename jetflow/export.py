"""`jetflow export`: an HF directory whose linear weights are FP8 blocks in the vLLM / DeepSeek layout.

Every FP8 linear of the recipe becomes `<m>.weight` float8_e4m3fn + `<m>.weight_scale_inv` float32;
what the recipe keeps in high precision is written in bf16; config.json gains `quantization_config`.
vLLM loads such a directory as a block-FP8 checkpoint. The bytes are exactly the trainer's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from jetflow.model import Decoder
from jetflow.precision import FP8Recipe, apply_precision, quantized_weights, to_checkpoint_tensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "char_tokenizer.json")


def fp8_state_dict(model: Decoder, recipe: FP8Recipe) -> dict[str, torch.Tensor]:
    """The model's tensors in the FP8 checkpoint layout (applies the recipe if not applied yet)."""
    if not quantized_weights(model):
        apply_precision(model, "fp8", recipe, num_layers=model.config.num_layers)
    quantized = quantized_weights(model)
    tensors = to_checkpoint_tensors(quantized)
    for name, tensor in model.state_dict().items():
        if name in tensors:
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        tensors[name] = tensor.detach().to(torch.bfloat16) if tensor.is_floating_point() else tensor
    return tensors


def export_fp8(model: Decoder, out_dir: str | Path, recipe: FP8Recipe, tokenizer_dir: str | Path | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = fp8_state_dict(model, recipe)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt", "jetflow_fingerprint": recipe.fingerprint()})
    config = model.config.to_hf(torch.bfloat16)
    config["quantization_config"] = recipe.vllm_quantization_config()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.exists():
                shutil.copy(src, out / name)
    return out
