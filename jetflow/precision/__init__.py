"""The low-precision core that the trainer and the rollout engine share. Of jetflow it imports only
jetflow.kernels (the batch-invariant CPU and Triton kernels, which import only jetflow.errors): model/,
train/, rollout/ and run/ import precision, never the other way.

  recipe.py        QuantRecipe: one recipe, its family (fp8_block, mxfp8, nvfp4) fixing each operand's
                   format, block shape and scales; the fingerprint both sides check
  modes.py         the precision vocabulary: the modes of a run (fp32, bf16, mixed, unified), kinds, numerics
  plan.py          Precision: a run's precision resolved once (mode, recipe, numerics, backend), handed to each side
  quant.py         fp8_block quantization (128x128 weight blocks, 1x128 groups), the numerical reference
  mx.py            the microscaled quantizers: MXFP8 (1x32 blocks, E8M0 scales),
  nvfp4.py         NVFP4 (E2M1 values in 16-element blocks, E4M3 block scales, an fp32 scale above),
  fp4.py           and the E2M1 codes NVFP4 rounds to and packs two per byte
  gemm.py          the scaled GEMM backends (fp8_matmul) and the bf16 GEMM
  family.py        one strategy per recipe family, chosen once (family_of): its quantizers, its linear,
                   its exact product, its export layout
  fp8_function.py  the fp8_block family: its linear's autograd function (fprop, dgrad, wgrad) and exact fprop
  microscaled.py   the mxfp8 / nvfp4 families: their linears (TE's three GEMMs) and exact products
  exact.py         exact_linear: the one linear every side computes under `precision.numerics=exact`
  exact_cache.py   what an exact linear keeps between calls (weight panels, the prepared product)
  linear.py        PrecisionLinear and apply_precision, which puts it into a model
  lora.py          LoRA: the adapted linear (a frozen base + scaled fp32 adapters), its converter and freezer
  kv.py            FP8 K/V quantization with per-layer scales
  export.py        quantized weights in the checkpoint layouts vLLM loads, and back: fp8_block's own,
  modelopt.py      and NVIDIA ModelOpt's for mxfp8 / nvfp4
"""

from jetflow.precision.export import (from_checkpoint_tensors, load_quantized, quantized_weights, save_quantized,
                                      to_checkpoint_tensors)
from jetflow.precision.gemm import GEMM_BACKENDS, bf16_linear, fp8_matmul, resolve_backend
from jetflow.precision.family import fp8_linear
from jetflow.precision.linear import PrecisionLinear, apply_precision, fp8_linears
from jetflow.precision.quant import (NonFiniteError, QuantizedTensor, defer_nonfinite, dequantize, fake_quantize,
                                     quantize_blocks, quantize_colwise_groups, quantize_rowwise_groups, quantize_weight)
from jetflow.precision.modes import LINEAR_KINDS, NUMERICS, PRECISION_MODES, PrecisionMode
from jetflow.precision.recipe import FP8_MAX, QuantRecipe, RecipeMismatchError, check_fingerprint

__all__ = [
    "QuantRecipe", "FP8_MAX", "PRECISION_MODES", "PrecisionMode", "RecipeMismatchError", "check_fingerprint",
    "QuantizedTensor", "NonFiniteError", "defer_nonfinite", "quantize_blocks", "quantize_weight", "quantize_rowwise_groups",
    "quantize_colwise_groups", "dequantize", "fake_quantize",
    "GEMM_BACKENDS", "fp8_matmul", "bf16_linear", "resolve_backend",
    "LINEAR_KINDS", "NUMERICS", "PrecisionLinear", "apply_precision", "fp8_linear", "fp8_linears",
    "quantized_weights", "to_checkpoint_tensors", "from_checkpoint_tensors", "save_quantized", "load_quantized",
]
