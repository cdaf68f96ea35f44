"""Llama-family decoder, KV cache, checkpoints (HF safetensors, GGUF import) and tokenizers.

    model = jetflow.model.load("path/to/hf_dir", precision=None, dtype=torch.float32, device="cpu")
    logits = model(input_ids)                          # (B, T, V)
"""

from __future__ import annotations

from pathlib import Path

import torch

from jetflow.model.checkpoint import (
    CheckpointError,
    load_config,
    load_hf_dir,
    load_state_dict_from_dir,
    save_hf_dir,
)
from jetflow.model.decoder import SUPPORTED, Decoder, ModelConfig, UnsupportedModelError
from jetflow.model.kv_cache import KVCache
from jetflow.model.tokenizer import CharTokenizer, Tokenizer, load_tokenizer


def load(path: str | Path, precision=None, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu", **precision_kwargs) -> Decoder:
    """Load a Decoder from a local HF directory; if `precision` is given (e.g. "bf16", or "fp8" with
    recipe=...), apply it with `jetflow.precision.apply_precision(model, precision, **precision_kwargs)`,
    which swaps the nn.Linear modules by name."""
    model = load_hf_dir(path, dtype=dtype, device=device)
    if precision is not None:
        from jetflow.precision import apply_precision

        model = apply_precision(model, precision, **precision_kwargs) or model
    elif precision_kwargs:
        raise TypeError(f"load(): {sorted(precision_kwargs)} given without precision")
    return model


__all__ = [
    "SUPPORTED", "CheckpointError", "CharTokenizer", "Decoder", "KVCache", "ModelConfig", "Tokenizer",
    "UnsupportedModelError", "load", "load_config", "load_hf_dir", "load_state_dict_from_dir",
    "load_tokenizer", "save_hf_dir",
]
