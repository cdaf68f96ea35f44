"""Quantized weights in the checkpoint layouts vLLM loads, and back.

fp8_block: the vLLM / DeepSeek FP8 layout, `<module>.weight` float8_e4m3fn (N, K) and
`<module>.weight_scale_inv` float32 (ceil(N/128), ceil(K/128)); config.json carries
`quantization_config` (QuantRecipe.vllm_quantization_config). mxfp8 / nvfp4: NVIDIA ModelOpt's layout
(jetflow.precision.modelopt). The bytes written are the bytes the trainer computed with, and bytes
read back are handed to the quantized linears as they are (`load_quantized_weights`), never requantized.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from jetflow.precision import modelopt
from jetflow.precision.family import STRATEGIES, family_of
from jetflow.precision.fp8_function import SCALE_SUFFIX
from jetflow.precision.linear import fp8_linears
from jetflow.precision.quant import QuantizedTensor
from jetflow.precision.recipe import FP8_DTYPES, QuantRecipe


def is_scale_name(name: str) -> bool:
    """A quantization tensor beside a weight (a scale, ModelOpt's input scale), not a model parameter."""
    return name.endswith(SCALE_SUFFIX) or name.endswith(modelopt.SUFFIXES)


def quantization_config(recipe: QuantRecipe, ignored_layers=()) -> dict:
    """config.json's `quantization_config` for an export under `recipe` (vLLM's block-FP8 or ModelOpt's)."""
    return family_of(recipe).quantization_config(recipe, ignored_layers)


def quantized_weights(model: nn.Module) -> dict[str, QuantizedTensor]:
    """{module name: this step's QuantizedTensor} for every FP8 linear (cached bytes, not recomputed)."""
    return {name: layer.quantized_weight() for name, layer in fp8_linears(model).items()}


def to_checkpoint_tensors(quantized: dict[str, QuantizedTensor],
                          input_scales: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """{module: QuantizedTensor} -> {module.weight: fp8, module.weight_scale_inv: fp32}; MXFP8 / NVFP4
    tensors in ModelOpt's names (`input_scales`: NVFP4's static input scale per module, default 1.0)."""
    out: dict[str, torch.Tensor] = {}
    for module, q in quantized.items():
        out.update(STRATEGIES[q.kind].checkpoint_tensors(module, q, (input_scales or {}).get(module, 1.0)))
    return out


def from_checkpoint_tensors(tensors: dict[str, torch.Tensor],
                            block: tuple[int, int] = (128, 128)) -> dict[str, QuantizedTensor]:
    """Inverse of `to_checkpoint_tensors`: every `<m>.weight` that has a `<m>.weight_scale_inv` (FP8
    blocks of `block`) or a `<m>.weight_scale` (ModelOpt's MXFP8 or NVFP4)."""
    out: dict[str, QuantizedTensor] = {}
    for key, scale in tensors.items():
        if key.endswith(".weight_scale"):
            module = key.removesuffix(".weight_scale")
            if f"{module}.weight" not in tensors:
                raise KeyError(f"{key} has no matching {module}.weight")
            out[module] = modelopt.from_tensors(module, tensors)
            continue
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


def split_quantized(tensors: dict[str, torch.Tensor], block: tuple[int, int] = (128, 128)
                    ) -> tuple[dict[str, QuantizedTensor], dict[str, torch.Tensor]]:
    """(quantized modules, the other tensors) of a checkpoint in the FP8 (or ModelOpt) layout. A float8
    or uint8 tensor without its scale is an error: its bytes alone do not say what values they stand for.
    ModelOpt's static input scales are dropped (jetflow's engines scale each token row themselves)."""
    quantized = from_checkpoint_tensors(tensors, block)
    used = {f"{m}.weight" for m in quantized}
    others = {k: v for k, v in tensors.items() if k not in used and not is_scale_name(k)}
    unscaled = sorted(k for k, v in others.items() if v.dtype in (*FP8_DTYPES.values(), torch.uint8))
    if unscaled:
        raise ValueError(f"{unscaled[0]} is float8 but has no {SCALE_SUFFIX[1:]} beside it")
    return quantized, others


def recipe_from_quantization_config(qc: dict) -> QuantRecipe:
    """Inverse of `quantization_config`. A block-FP8 config written by another tool (no `jetflow_recipe`)
    gets the default recipe with its weight block; a ModelOpt MXFP8 / NVFP4 one its family's recipe."""
    if family := modelopt.family_of(qc):
        recipe = QuantRecipe.from_dict(qc["jetflow_recipe"]) if "jetflow_recipe" in qc else QuantRecipe(family=family)
        if recipe.family != family:
            raise ValueError(f"quantization_config: quant_algo {family} but jetflow_recipe has {recipe.family}")
        return _checked_fingerprint(qc, recipe)
    if qc.get("quant_method") != "fp8" or "weight_block_size" not in qc:
        raise ValueError(f"quantization_config {json.dumps(qc)[:120]} is not block FP8 (quant_method fp8 with "
                         "weight_block_size) nor ModelOpt MXFP8 / NVFP4, as `jetflow export` writes")
    block = tuple(int(b) for b in qc["weight_block_size"])
    recipe = QuantRecipe.from_dict(qc["jetflow_recipe"]) if "jetflow_recipe" in qc else QuantRecipe(weight_block=block)
    if recipe.weight_block != block:
        raise ValueError(f"quantization_config: weight_block_size {list(block)} but jetflow_recipe has "
                         f"{list(recipe.weight_block)}")
    return _checked_fingerprint(qc, recipe)


def _checked_fingerprint(qc: dict, recipe: QuantRecipe) -> QuantRecipe:
    if "jetflow_fingerprint" in qc and qc["jetflow_fingerprint"] != recipe.fingerprint():
        raise ValueError(f"quantization_config: jetflow_fingerprint {qc['jetflow_fingerprint']} is not the "
                         f"fingerprint {recipe.fingerprint()} of its jetflow_recipe (edited by hand?)")
    return recipe


def load_quantized_weights(model: nn.Module, quantized: dict[str, QuantizedTensor]) -> None:
    """Hand every FP8 linear of `model` its bytes from `quantized` (module name -> QuantizedTensor):
    its forward then uses them as they are (PrecisionLinear.load_quantized), whatever its master
    weight holds. The FP8 linears and `quantized` must name the same modules."""
    layers = fp8_linears(model)
    unstored = sorted(set(layers) - set(quantized))
    if unstored:
        raise ValueError(f"the recipe computes {unstored[:3]} in FP8, but no FP8 weights are stored for them")
    high = sorted(set(quantized) - set(layers))
    if high:
        raise ValueError(f"FP8 weights are stored for {high[:3]}, which the recipe keeps in high precision")
    for name, layer in layers.items():
        layer.load_quantized(quantized[name])


def save_quantized(path: str | Path, quantized: dict[str, QuantizedTensor], recipe: QuantRecipe,
                   extra: dict[str, torch.Tensor] | None = None) -> None:
    """Write a safetensors file with the FP8 layout (plus `extra` high-precision tensors)."""
    tensors = dict(extra or {})
    tensors.update(to_checkpoint_tensors(quantized))
    metadata = {"jetflow_fingerprint": recipe.fingerprint(), "jetflow_recipe": json.dumps(recipe.to_dict())}
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)


def load_quantized(path: str | Path) -> tuple[dict[str, QuantizedTensor], dict[str, torch.Tensor], QuantRecipe | None]:
    """Read a file written by `save_quantized`: (quantized modules, other tensors, recipe or None)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no quantized checkpoint at {path}")
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    recipe = QuantRecipe.from_dict(json.loads(metadata["jetflow_recipe"])) if "jetflow_recipe" in metadata else None
    block = recipe.weight_block if recipe else (128, 128)
    quantized, others = split_quantized(tensors, block)
    return quantized, others, recipe
