"""Llama-family decoder, KV cache, checkpoints (HF safetensors, GGUF import) and tokenizers.

    model = jetflow.model.load("path/to/dir", precision=None, dtype=torch.float32, device="cpu")
    logits = model(input_ids)                          # (B, T, V)

`load` takes a directory holding config.json + safetensors: a Hugging Face directory, a `jetflow
export` FP8 directory (loaded running its FP8 bytes) or a run checkpoint (they carry config.json). A run
directory, or an older checkpoint without config.json, loads through `jetflow.run.sources.load_model`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from jetflow.model.checkpoint import (
    CheckpointError,
    load_hf_dir,
    load_model_config,
    load_state_dict_from_dir,
    save_hf_dir,
)
from jetflow.model.decoder import SUPPORTED, Decoder, ModelConfig, UnsupportedModelError
from jetflow.model.kv_cache import KVCache
from jetflow.model.tokenizer import CharTokenizer, Tokenizer, TokenizerError, load_tokenizer


def load(path: str | Path, precision=None, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu", **precision_kwargs) -> Decoder:
    """Load a Decoder from a model directory (config.json + safetensors); if `precision` is given (e.g.
    "bf16", or "fp8" with recipe=...), apply it (`with_precision`)."""
    return with_precision(load_hf_dir(path, dtype=dtype, device=device), precision, **precision_kwargs)


def with_precision(model: Decoder, precision=None, **precision_kwargs) -> Decoder:
    """`jetflow.precision.apply_precision(model, precision, **precision_kwargs)`, which swaps the
    nn.Linear modules by name. An FP8 export loads with its FP8 linears running the exported bytes
    (precision=None). Asked for "fp8" under its own recipe (or no recipe) it keeps those bytes; any
    other precision or recipe is applied to its dequantized weights."""
    if precision is None:
        if precision_kwargs:
            raise TypeError(f"load(): {sorted(precision_kwargs)} given without precision")
        return model
    from jetflow.precision import apply_precision
    from jetflow.precision.export import load_quantized_weights

    kept = _exported_bytes(model, precision, precision_kwargs)
    model = apply_precision(model, precision, **precision_kwargs) or model
    if kept:
        load_quantized_weights(model, kept)  # apply_precision forgot them: hand them back
    return model


def _exported_bytes(model: Decoder, precision: str, precision_kwargs: dict) -> dict:
    """The FP8 bytes a loaded export runs, if `precision` asks for fp8 under their recipe (then also
    made the `recipe` of precision_kwargs). Requantizing their dequantized values instead need not give
    the same bytes back."""
    from jetflow.precision import fp8_linears, quantized_weights

    layers = fp8_linears(model)
    if precision != "fp8" or not layers:
        return {}
    recipe = next(iter(layers.values())).recipe
    if precision_kwargs.setdefault("recipe", recipe) != recipe:
        return {}
    return quantized_weights(model)


__all__ = [
    "SUPPORTED", "CheckpointError", "CharTokenizer", "Decoder", "KVCache", "ModelConfig", "Tokenizer", "TokenizerError",
    "UnsupportedModelError", "load", "load_hf_dir", "load_model_config", "load_state_dict_from_dir",
    "load_tokenizer", "save_hf_dir", "with_precision",
]
