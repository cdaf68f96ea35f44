"""Quantized weights in the vLLM / DeepSeek FP8 checkpoint layout, and back.

Layout: `<module>.weight` float8_e4m3fn (N, K) and `<module>.weight_scale_inv` float32
(ceil(N/128), ceil(K/128)); config.json carries `quantization_config` (see
FP8Recipe.vllm_quantization_config). The bytes written are the bytes the trainer computed with.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from jetflow.precision.linear import fp8_linears
from jetflow.precision.quant import QuantizedTensor
from jetflow.precision.recipe import FP8Recipe

SCALE_SUFFIX = ".weight_scale_inv"


def quantized_weights(model: nn.Module) -> dict[str, QuantizedTensor]:
    """{module name: this step's QuantizedTensor} for every FP8 linear (cached bytes, not recomputed)."""
    return {name: layer.quantized_weight() for name, layer in fp8_linears(model).items()}


def to_checkpoint_tensors(quantized: dict[str, QuantizedTensor]) -> dict[str, torch.Tensor]:
    """{module: QuantizedTensor} -> {module.weight: fp8, module.weight_scale_inv: fp32}."""
    out: dict[str, torch.Tensor] = {}
    for module, q in quantized.items():
        out[f"{module}.weight"] = q.data.contiguous()
        out[f"{module}{SCALE_SUFFIX}"] = q.scale_inv.contiguous()
    return out


def from_checkpoint_tensors(tensors: dict[str, torch.Tensor],
                            block: tuple[int, int] = (128, 128)) -> dict[str, QuantizedTensor]:
    """Inverse of `to_checkpoint_tensors`: every `<m>.weight` that has a `<m>.weight_scale_inv`."""
    out: dict[str, QuantizedTensor] = {}
    for key, scale in tensors.items():
        if not key.endswith(SCALE_SUFFIX):
            continue
        module = key[: -len(SCALE_SUFFIX)]
        weight = tensors.get(f"{module}.weight")
        if weight is None:
            raise KeyError(f"{key} has no matching {module}.weight")
        if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{module}.weight has dtype {weight.dtype}, expected float8 beside a scale_inv")
        rows, cols = weight.shape
        expected = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != expected:
            raise ValueError(f"{key}: shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} "
                             f"in {block} blocks (expected {expected})")
        out[module] = QuantizedTensor(weight, scale.float(), tuple(block))
    return out


def save_quantized(path: str | Path, quantized: dict[str, QuantizedTensor], recipe: FP8Recipe,
                   extra: dict[str, torch.Tensor] | None = None) -> None:
    """Write a safetensors file with the FP8 layout (plus `extra` high-precision tensors)."""
    tensors = dict(extra or {})
    tensors.update(to_checkpoint_tensors(quantized))
    metadata = {"jetflow_fingerprint": recipe.fingerprint(), "jetflow_recipe": json.dumps(recipe.to_dict())}
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)


def load_quantized(path: str | Path) -> tuple[dict[str, QuantizedTensor], dict[str, torch.Tensor], FP8Recipe | None]:
    """Read a file written by `save_quantized`: (quantized modules, other tensors, recipe or None)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no quantized checkpoint at {path}")
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    recipe = FP8Recipe.from_dict(json.loads(metadata["jetflow_recipe"])) if "jetflow_recipe" in metadata else None
    block = recipe.weight_block if recipe else (128, 128)
    quantized = from_checkpoint_tensors(tensors, block)
    used = {f"{m}.weight" for m in quantized} | {f"{m}{SCALE_SUFFIX}" for m in quantized}
    others = {k: v for k, v in tensors.items() if k not in used}
    return quantized, others, recipe
