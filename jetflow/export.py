"""Models out of jetflow.

`jetflow export`: an HF directory whose linear weights are FP8 blocks in the vLLM / DeepSeek layout
(under the mxfp8 / nvfp4 recipes: NVIDIA ModelOpt's MXFP8 / NVFP4 layout, jetflow.precision.modelopt).
Every FP8 linear of the recipe becomes `<m>.weight` float8_e4m3fn + `<m>.weight_scale_inv` float32;
what the recipe keeps in high precision is written in bf16; config.json gains `quantization_config`,
whose `ignored_layers` names the linears kept in bf16 (vLLM builds those unquantized). MoE experts stay
one tensor per expert and projection (`...experts.E.gate_proj.weight` + `.weight_scale_inv`), the names
vLLM's fused-MoE loader maps into its stacked w13 / w2 (tests/unit/test_vllm_moe_contract.py).
vLLM loads such a directory as a block-FP8 checkpoint, and `jetflow.model.load` loads it back running
the very same bytes. The bytes are exactly the trainer's.

`write_final_model`: the end of a run, <run>/model/ (HF, bf16) and, under `unified`, <run>/model-fp8/.
`write_lora_model`: the end of a LoRA run (model.lora), <run>/adapter/ (PEFT), <run>/model/ (merged, bf16) and,
under `unified`, <run>/base-fp8/ (the frozen FP8 base's bytes, unmerged: no merged FP8 export is written).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from jetflow.model import ModelConfig
from jetflow.model.checkpoint import TOKENIZER_FILES  # noqa: F401  (jetflow.run.vllm_side reads it here)
from jetflow.model.checkpoint import save_hf_weights, write_tokenizer
from jetflow.model.peft import write_adapter_dir
from jetflow.model.protocol import ShardedPolicy, hf_weights
from jetflow.writes import guarded
from jetflow.precision import (
    PrecisionLinear,
    QuantRecipe,
    PrecisionMode,
    QuantizedTensor,
    apply_precision,
    fp8_linears,
    quantized_weights,
    to_checkpoint_tensors,
)
from jetflow.precision.export import quantization_config
from jetflow.precision.family import family_of
from jetflow.precision.lora import adapter_parameters, is_adapter
from jetflow.precision.nvfp4 import TENSOR_SCALE_DIVISOR

FINAL_MODEL_DIR = "model"
"""<run>/model/: the trained policy as a Hugging Face directory (bf16)."""
FINAL_FP8_DIR = "model-fp8"
"""<run>/model-fp8/: its FP8 export (runs under the `unified` mode only)."""
ADAPTER_DIR = "adapter"
"""<run>/adapter/: a LoRA run's adapters as a PEFT directory (jetflow.model.peft)."""
BASE_FP8_DIR = "base-fp8"
"""<run>/base-fp8/: a `unified` LoRA run's frozen base, the FP8 bytes its trainer computed with, unmerged."""


def fp8_state_dict(model: nn.Module, recipe: QuantRecipe) -> dict[str, torch.Tensor]:
    """The model's tensors in the FP8 checkpoint layout. `model`: a Decoder (the recipe is applied to
    it first unless its FP8 linears run it already) or a ShardedPolicy running `recipe` (a collective
    under tensor parallelism: every rank calls it)."""
    quantized = _quantized(model, recipe)
    tensors = to_checkpoint_tensors(quantized, nvfp4_input_scales(model, recipe))
    for name, tensor in hf_weights(model).items():
        if name in tensors or is_adapter(name):  # a LoRA base's export: the adapters are their own directory
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        tensors[name] = tensor.detach().to(torch.bfloat16) if tensor.is_floating_point() else tensor
    return tensors


def _quantized(model: nn.Module, recipe: QuantRecipe) -> dict[str, QuantizedTensor]:
    """The bytes the model's FP8 linears compute with under `recipe` (a trainer's, a loaded export's)."""
    if isinstance(model, ShardedPolicy):
        if model.recipe != recipe or model.kind != "fp8":
            raise ValueError(f"the policy's linears do not run recipe {recipe.fingerprint()} in FP8: no bytes "
                             "to export")
        return model.quantized_weights()
    layers = fp8_linears(model)
    if not layers or any(layer.recipe != recipe for layer in layers.values()):
        apply_precision(model, "fp8", recipe, num_layers=model.config.num_layers)
    return quantized_weights(model)


CALIBRATION_TOKENS = 256


def nvfp4_input_scales(model: nn.Module, recipe: QuantRecipe) -> dict[str, float]:
    """NVFP4's static input scale of each quantized linear, for vLLM's own W4A4 kernels (jetflow's engines
    scale each token row themselves and never read it): the amax of the linear's input over one
    calibration forward, the first CALIBRATION_TOKENS token ids as one sequence (a function of the
    weights only: a resumed run exports what the uninterrupted one does), divided by 2688. A linear the
    forward does not reach (an expert no token chose), and a sharded policy's, get 1.0."""
    if not family_of(recipe).static_input_scales or isinstance(model, ShardedPolicy):
        return {}
    amax: dict[str, float] = {}

    def record(name):
        def hook(module, args):
            amax[name] = max(amax.get(name, 0.0), float(args[0].detach().abs().amax()))
        return hook
    hooks = [layer.register_forward_pre_hook(record(name)) for name, layer in fp8_linears(model).items()]
    try:
        with torch.no_grad():
            device = next(model.parameters()).device
            model(torch.arange(min(model.config.vocab_size, CALIBRATION_TOKENS), device=device)[None])
    finally:
        for h in hooks:
            h.remove()
    return {name: a / TENSOR_SCALE_DIVISOR for name, a in amax.items() if a > 0}


def export_fp8(model: nn.Module, out_dir: str | Path, recipe: QuantRecipe, tokenizer_dir=None) -> Path:
    return write_fp8_dir(fp8_state_dict(model, recipe), model.config, recipe, out_dir, tokenizer_dir)


def write_fp8_dir(tensors: dict[str, torch.Tensor], config: ModelConfig, recipe: QuantRecipe, out_dir: str | Path,
                  tokenizer=None) -> Path:
    """Write `fp8_state_dict`'s tensors, config.json with `quantization_config`, and the tokenizer
    (a directory or a jetflow tokenizer)."""
    out = Path(out_dir)
    written = [out / "model.safetensors", out / "config.json"]

    def remove_partial() -> None:  # what this export wrote (a tokenizer file left is harmless)
        for path in written:
            path.unlink(missing_ok=True)

    with guarded(out, "the FP8 export", partial=remove_partial):
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(written[0]),
                  metadata={"format": "pt", "jetflow_fingerprint": recipe.fingerprint()})
        hf = config.to_hf(torch.bfloat16)
        hf["quantization_config"] = quantization_config(recipe, high_precision_linears(tensors))
        written[1].write_text(json.dumps(hf, indent=2))
        write_tokenizer(tokenizer, out)
    return out


def high_precision_linears(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The linear modules an FP8 export stores in high precision: every 2-D weight that is not FP8,
    but the token embedding (the router of an MoE layer, lm_head, layers the recipe keeps)."""
    return sorted(name.removesuffix(".weight") for name, t in tensors.items()
                  if name.endswith(".weight") and t.dim() == 2 and t.element_size() > 1
                  and name != "model.embed_tokens.weight")


def write_final_model(run_dir: str | Path, model: nn.Module, tokenizer, mode: str | PrecisionMode,
                      recipe: QuantRecipe | None = None, is_main: bool = True) -> Path | None:
    """The trained policy as models a user can take away: <run>/model/ (a Hugging Face directory:
    bf16 weights, config.json, tokenizer) and, under the `unified` mode, <run>/model-fp8/ (its FP8
    export: the bytes the trainer computed with, under `recipe`).

    model: the trainer's Decoder, or a ShardedPolicy (Megatron), whose weights are gathered: a
        collective under tensor parallelism, so every rank calls this and only `is_main` writes.
    tokenizer: a directory or a jetflow tokenizer (CharTokenizer / Tokenizer).
    Each directory is written under a temporary name and then renamed into place, so a run killed
    meanwhile never leaves a half-written model that `jetflow generate --model <run>` would pick up.
    Returns <run>/model (None where not is_main)."""
    mode = PrecisionMode(mode)
    if mode is PrecisionMode.UNIFIED and recipe is None:
        raise ValueError("write_final_model: the unified mode exports FP8 weights and needs the run's recipe")
    weights = {name: t.detach().to(torch.bfloat16) for name, t in hf_weights(model).items()}  # gathered
    fp8 = fp8_state_dict(model, recipe) if mode is PrecisionMode.UNIFIED else None  # gathered too
    if not is_main:
        return None
    run_dir = Path(run_dir)
    final = _write_dir(run_dir / FINAL_MODEL_DIR, lambda d: save_hf_weights(weights, model.config, d, tokenizer))
    if fp8 is not None:
        _write_dir(run_dir / FINAL_FP8_DIR, lambda d: write_fp8_dir(fp8, model.config, recipe, d, tokenizer))
    return final


def _write_dir(final: Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` into a fresh temporary sibling of `final`, then put it in `final`'s place."""
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    with guarded(final, "the final model", partial=tmp, after="the run's checkpoints are intact: the same command "
                 "with run.resume=true writes it again"):
        tmp.mkdir(parents=True)
        write(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    return final


def base_weight(layer: PrecisionLinear) -> torch.Tensor:
    """The weight a linear's base computes with, in fp32: the dequantized recipe bytes of an FP8 linear, the
    bf16 grid of a bf16 one, the fp32 weight of an fp32 one."""
    if layer.kind == "fp8":
        return layer.quantized_weight().dequantize(torch.float32)
    w = layer.weight.detach()
    return (w.bfloat16() if layer.kind == "bf16" else w).float()


def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A LoRA model's HF-named weights with each adapted linear's weight merged, in fp32:
    W + scale * B @ A, W its base's (`base_weight`), the product and the sum in float64 rounded once; the
    adapters themselves left out. (The merged layer computes W x + scale * B (A x) in one product: equal in
    exact arithmetic, not bit for bit.)"""
    weights = {n: t.detach() for n, t in model.state_dict().items() if not is_adapter(n)}
    for name, layer in model.named_modules():
        if isinstance(layer, PrecisionLinear) and layer.lora is not None:
            a, b = layer.lora.A.detach().double(), layer.lora.B.detach().double()
            weights[f"{name}.weight"] = (base_weight(layer).double() + layer.lora.scale * (b @ a)).float()
    return weights


def write_lora_model(run_dir: str | Path, model: nn.Module, tokenizer, mode: str | PrecisionMode,
                     adapter_config: dict, recipe: QuantRecipe | None = None) -> Path:
    """The end of a LoRA run, from the trainer's model (its frozen base and trained adapters): <run>/adapter/
    (PEFT: `adapter_config` and the adapters, jetflow.model.peft), <run>/model/ (`merged_weights` in bf16, as
    write_final_model writes a policy) and, under `unified`, <run>/base-fp8/: the base's FP8 bytes exactly as
    the trainer computed with them, unmerged (W + scale * B @ A is off the FP8 grid: requantized it would be
    another policy, so no merged FP8 export is written; base-fp8 + adapter is the trained policy). Each
    directory is written under a temporary name and renamed into place. Returns <run>/model."""
    mode, run_dir = PrecisionMode(mode), Path(run_dir)
    adapters = adapter_parameters(model)
    merged = {name: t.to(torch.bfloat16) for name, t in merged_weights(model).items()}
    _write_dir(run_dir / ADAPTER_DIR, lambda d: write_adapter_dir(d, adapters, adapter_config))
    final = _write_dir(run_dir / FINAL_MODEL_DIR, lambda d: save_hf_weights(merged, model.config, d, tokenizer))
    if mode is PrecisionMode.UNIFIED:
        if recipe is None:
            raise ValueError("write_lora_model: the unified mode exports the FP8 base and needs the run's recipe")
        base = fp8_state_dict(model, recipe)
        _write_dir(run_dir / BASE_FP8_DIR, lambda d: write_fp8_dir(base, model.config, recipe, d, tokenizer))
    return final
