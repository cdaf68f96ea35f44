"""What a vLLM engine that runs vLLM's own kernels loads for a trainer update (executions fp32, bf16,
fp8, fp8_weights_dequantized; the exact execution loads updates into jetflow's own modules instead,
see jetflow.rollout.vllm.adapter), the checks of that payload against the engine's checkpoint, and two
fixes for vLLM 0.32's in-place reload on the CPU.

Imports vllm only inside `reprocess_cpu_moe_experts` (called on a running engine).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from jetflow.precision import QuantRecipe, PrecisionLinear, quantize_weight
from jetflow.precision.export import SCALE_SUFFIX
from jetflow.precision.linear import layer_index
from jetflow.precision.lora import is_adapter
from jetflow.precision.modes import PrecisionMode
from jetflow.sync import WeightUpdate



def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of every safetensors file of an HF directory (read from the headers)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return shapes


def is_linear_weight(name: str) -> bool:
    """A Llama / Qwen linear layer's weight (the modules a recipe may quantize): projections, lm_head,
    Mixtral's experts (`...experts.E.w1.weight`) and MoE routers (`...mlp.gate.weight`, which the
    recipe keeps in high precision)."""
    return (name.endswith(("_proj.weight", ".gate.weight")) or name == "lm_head.weight"
            or re.search(r"\.experts\.\d+\.w[123]\.weight$", name) is not None)


def engine_payload(update: WeightUpdate, execution: str, dtype: torch.dtype, recipe: QuantRecipe | None,
                   num_layers: int) -> dict[str, torch.Tensor]:
    """{checkpoint name: tensor} that an engine executing `execution` loads for `update`.

    fp8: every FP8 linear as `<m>.weight` (the trainer's float8 bytes, untouched) and
    `<m>.weight_scale_inv` (fp32): the layout of `export_fp8`. fp8_weights_dequantized: `<m>.weight`
    = fp8 * scale_inv in `dtype`. Everything else in `dtype`. A `mixed` update carries bf16 weights:
    the FP8 linears are quantized here with the recipe (the rollout side's own quantization)."""
    fp8_engine = execution in ("fp8", "fp8_weights_dequantized")
    if update.mode not in ("unified", "mixed", "fp32", "bf16"):
        raise ValueError(f"unknown update mode {update.mode!r}")
    if (update.mode in ("unified", "mixed")) != fp8_engine:
        raise ValueError(f"a {update.mode!r} update does not fit a vLLM rollout executing {execution!r} "
                         "(unified / mixed need execution 'fp8' or 'fp8_weights_dequantized'; fp32 / bf16 "
                         "need an unquantized execution)")
    quantized = dict(update.quantized) if update.mode == "unified" else {}
    tensors = {}
    for name, t in update.tensors.items():
        module = name.removesuffix(".weight")
        if update.mode == "mixed" and is_linear_weight(name) and not recipe.keeps_in_high_precision(
                module, layer_index(name), num_layers):
            quantized[module] = quantize_weight(t.float(), recipe.weight_block, recipe.forward_format,
                                                recipe.scale_rule, recipe.margin, name)
        else:
            tensors[name] = t.detach().to(dtype)
    for module, q in quantized.items():
        if execution == "fp8":  # the bytes and scales as they are: vLLM's block-FP8 layout
            tensors[f"{module}.weight"] = q.data
            tensors[f"{module}{SCALE_SUFFIX}"] = q.scale_inv.float()
        else:  # the FP8 grid in an unquantized engine
            tensors[f"{module}.weight"] = q.dequantize(torch.float32).to(dtype)
    return tensors


def check_payload(tensors: dict[str, torch.Tensor], checkpoint: dict[str, tuple[int, ...]], version: int) -> None:
    """The payload must name exactly the checkpoint's tensors, in its shapes: vLLM's layerwise reload
    needs every tensor of every layer, and a mistake must not half-load a running engine."""
    missing, unknown = sorted(set(checkpoint) - set(tensors)), sorted(set(tensors) - set(checkpoint))
    if missing or unknown:
        raise KeyError(f"weight update v{version} does not match the engine's checkpoint: missing {missing[:5]}, "
                       f"unknown {unknown[:5]}")
    for name, t in tensors.items():
        if tuple(t.shape) != checkpoint[name]:
            raise ValueError(f"weight update v{version}: {name} has shape {tuple(t.shape)}, the engine's "
                             f"checkpoint {checkpoint[name]}")


def unfusable_projections(config: dict, block_rows: int) -> list[str]:
    """Projections whose FP8 blocks have no faithful place in vLLM's fused q/k/v and gate/up matrices.

    vLLM stacks q, k, v (and gate, up) into one matrix with one grid of 128-row scale blocks; the
    recipe scales each projection separately. Unless every projection but the last of a stack fills
    whole blocks, a block of the fused grid would straddle two projections with two scales (SmolLM2:
    q_proj has 576 = 4.5 x 128 rows). Mixture-of-experts layers stack each expert's gate and up the same
    way into w13, and vLLM's `validate_fp8_block_shape_moe` refuses an expert width that is not a
    multiple of the block."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rows = {"q_proj": config["num_attention_heads"] * head_dim,
            "k_proj": config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim}
    if config.get("model_type") == "mixtral":  # every layer sparse; intermediate_size is the experts' width
        rows["experts' gate_proj (w1)"] = config["intermediate_size"]
    else:
        rows["gate_proj"] = config["intermediate_size"]
        if config.get("model_type") == "qwen3_moe":
            rows["experts' gate_proj"] = config["moe_intermediate_size"]
    return [f"{name} ({n} rows)" for name, n in rows.items() if n % block_rows]


def reprocess_tied_lm_head(model) -> None:
    """Re-run a tied lm_head's post-load processing after an in-place reload.

    vLLM's reload processes the layer that received the weights (embed_tokens) and only puts the
    shared tensor back into lm_head, without re-running lm_head's own processing. On a CPU that
    processing prepacks the weight for the GEMM kernel, so without this the logits would keep
    coming from the *old* embedding matrix (measured: log-prob errors of 0.2 after one update)."""
    head = model.lm_head
    head.quant_method.process_weights_after_loading(head)


def reprocess_cpu_moe_experts(model) -> int:
    """Re-run the CPU fused-MoE kernel's weight packing after an in-place reload; returns the number
    of MoE layers repacked.

    On a weight update vLLM (0.32, fused_moe/unquantized_fused_moe_method.py `_setup_kernel`) copies
    the reloaded w13 / w2 into the existing parameters but runs the experts kernel's own post-load
    step only on the first load. On a CPU that step prepacks the weights for its grouped GEMM, so
    without this the experts would compute with unpacked values read as packed ones (measured: tiny
    Qwen3-MoE log-probs off by 1.2 after one update; 2e-6 with it). GPU kernels do not prepack there."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and hasattr(layer, "w13_weight"):
            experts.process_weights_after_loading(layer)
            repacked += 1
    return repacked


def check_exact_update(policy, update: WeightUpdate) -> None:
    """An exact engine's update must be of a mode whose rollout kind is the policy's linears' (fp32,
    bf16, or fp8 for mixed / unified) and carry every tensor the policy holds: a partial update would
    leave the engine half on the old weights. With LoRA (model.lora) the policy's adapters are every update's
    `adapters`, and an adapter-only update (`base=False`) carries no base tensor at all. (jetflow.sync.apply_update
    checks the rest: the adapters' names, a base before adapters alone.)"""
    kinds = {m.kind for m in policy.modules() if isinstance(m, PrecisionLinear)}
    kind = "fp8" if "fp8" in kinds else "bf16" if "bf16" in kinds else "fp32"
    if update.mode not in {m.value for m in PrecisionMode} or PrecisionMode(update.mode).rollout_kind != kind:
        raise ValueError(f"a {update.mode!r} update does not fit an exact vLLM rollout whose linears are {kind} "
                         f"(updates of mode {[m.value for m in PrecisionMode if m.rollout_kind == kind]})")
    given = set(update.tensors) | {f"{module}.weight" for module in update.quantized}
    held = {n for n in dict(policy.named_parameters(remove_duplicate=True)) if not is_adapter(n)}
    if not update.base:  # the LoRA adapters alone: the base came with an earlier update
        held = set()
    missing, unknown = sorted(held - given), sorted(given - held)
    if missing or unknown:
        raise KeyError(f"weight update v{update.version} does not match the exact engine's policy: missing "
                       f"{missing[:5]}, unknown {unknown[:5]}")

