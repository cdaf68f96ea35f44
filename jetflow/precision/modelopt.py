"""The mxfp8 and nvfp4 recipes' weights in NVIDIA ModelOpt's checkpoint layout, which vLLM 0.32 loads
(vllm/model_executor/layers/quantization/modelopt.py: ModelOptMxFp8Config `modelopt_mxfp8`,
ModelOptNvFp4Config `modelopt_fp4`), and back. Checked against vLLM's own classes in
tests/unit/test_microscaled_export.py.

    mxfp8  <m>.weight           float8_e4m3fn (N, K)
           <m>.weight_scale     uint8 (N, K / 32)           E8M0 biased exponents
    nvfp4  <m>.weight           uint8 (N, K / 2)            two E2M1 codes a byte, the even element low
           <m>.weight_scale     float8_e4m3fn (N, K / 16)   jetflow's 16x16 tile scales, one row per weight row
           <m>.weight_scale_2   float32 ()                  d_w = amax_w / 2688 (vLLM's weight_global_scale)
           <m>.input_scale      float32 ()                  a static d_x for vLLM's own W4A4 kernels
config.json: quantization_config = {"quant_method": "modelopt", "quant_algo": "MXFP8" | "NVFP4",
"group_size": 16 (nvfp4), "ignore": [the linears kept in bf16], "jetflow_recipe", "jetflow_fingerprint"}.

The input scale: jetflow's engines scale each token row itself (jetflow.precision.nvfp4) and never
read it; vLLM's NVFP4 GEMMs quantize activations with one static scale per layer, and the export
writes the one jetflow.export calibrates (amax over a calibration forward / 2688), 1.0 without one.
"""

from __future__ import annotations

import torch

from jetflow.precision.mx import MXTensor
from jetflow.precision.nvfp4 import NVFP4_BLOCK, NVFP4Tensor
from jetflow.precision.recipe import QuantRecipe

ALGOS = {"mxfp8": "MXFP8", "nvfp4": "NVFP4"}
SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")
"""The tensors beside a ModelOpt `<m>.weight` that are not model parameters."""


def quantization_config(recipe: QuantRecipe, ignored_layers=()) -> dict:
    """config.json's `quantization_config` for an mxfp8 / nvfp4 export (NVFP4 adds its group size:
    jetflow.precision.microscaled.NVFP4)."""
    return {"quant_method": "modelopt", "quant_algo": ALGOS[recipe.family], "ignore": sorted(ignored_layers),
            "jetflow_recipe": recipe.to_dict(), "jetflow_fingerprint": recipe.fingerprint()}


def family_of(qc: dict) -> str | None:
    """mxfp8 / nvfp4 for a ModelOpt config of those algorithms (vLLM's own test: quant_method
    `modelopt*`, quant_algo at the top or under `quantization`), else None."""
    if not str(qc.get("quant_method", "")).lower().startswith("modelopt"):
        return None
    algo = str((qc.get("quantization") or qc).get("quant_algo", "")).upper()
    return {"MXFP8": "mxfp8", "NVFP4": "nvfp4"}.get(algo)


def to_tensors(module: str, q, input_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """One linear's ModelOpt tensors."""
    if isinstance(q, MXTensor):
        if q.block != (1, 32):
            raise ValueError(f"{module}: MXFP8 weights export in (1, 32) blocks, got {q.block}")
        return {f"{module}.weight": q.data.contiguous(), f"{module}.weight_scale": q.scale.contiguous()}
    if q.block != (NVFP4_BLOCK, NVFP4_BLOCK) or q.tensor_scale.dim():
        raise ValueError(f"{module}: NVFP4 weights export from 16x16 blocks with one tensor scale")
    rows = q.scale.repeat_interleave(NVFP4_BLOCK, dim=0)[:q.shape[0]]  # (N, ceil(K / 16))
    return {f"{module}.weight": q.data.contiguous(), f"{module}.weight_scale": rows.contiguous(),
            f"{module}.weight_scale_2": q.tensor_scale.float().reshape(()),
            f"{module}.input_scale": torch.tensor(float(input_scale), dtype=torch.float32)}


def from_tensors(module: str, tensors: dict[str, torch.Tensor]):
    """One linear's quantized weight from its ModelOpt tensors (MXFP8 when the weight is float8, NVFP4
    when it is packed uint8 beside a weight_scale_2)."""
    weight, scale = tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"]
    if weight.dtype == torch.float8_e4m3fn:
        expected = (weight.shape[0], -(-weight.shape[1] // 32))
        if scale.dtype != torch.uint8 or tuple(scale.shape) != expected:
            raise ValueError(f"{module}.weight_scale: {scale.dtype} {tuple(scale.shape)}, expected uint8 {expected} "
                             "(MXFP8 E8M0 scales)")
        return MXTensor(weight, scale, (1, 32))
    if weight.dtype != torch.uint8 or f"{module}.weight_scale_2" not in tensors:
        raise ValueError(f"{module}.weight: {weight.dtype} beside a weight_scale is neither MXFP8 (float8_e4m3fn) "
                         "nor NVFP4 (uint8 with a weight_scale_2)")
    rows, cols = weight.shape[0], 2 * weight.shape[1]
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (rows, cols // NVFP4_BLOCK):
        raise ValueError(f"{module}.weight_scale: {scale.dtype} {tuple(scale.shape)}, expected float8_e4m3fn "
                         f"{(rows, cols // NVFP4_BLOCK)} (NVFP4 block scales)")
    tiles = scale[::NVFP4_BLOCK]  # (ceil(N / 16), K / 16)
    if not torch.equal(tiles.repeat_interleave(NVFP4_BLOCK, 0)[:rows].view(torch.uint8), scale.view(torch.uint8)):
        raise ValueError(f"{module}.weight_scale: the rows of a 16-row tile differ (a 1x16-block checkpoint); "
                         "jetflow's nvfp4 recipe runs 16x16 weight blocks")
    d = tensors[f"{module}.weight_scale_2"].float().reshape(())
    return NVFP4Tensor(weight, tiles.contiguous(), d, (NVFP4_BLOCK, NVFP4_BLOCK), cols)
