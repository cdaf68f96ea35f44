"""The shared FP8 precision core. Imports nothing else of jetflow."""

from jetflow.precision.export import (from_checkpoint_tensors, load_quantized, quantized_weights, save_quantized,
                                      to_checkpoint_tensors)
from jetflow.precision.gemm import GEMM_BACKENDS, bf16_linear, fp8_matmul, resolve_backend
from jetflow.precision.linear import LINEAR_KINDS, PrecisionLinear, apply_precision, fp8_linear, fp8_linears
from jetflow.precision.quant import (NonFiniteError, QuantizedTensor, defer_nonfinite, dequantize, fake_quantize,
                                     quantize_blocks, quantize_colwise_groups, quantize_rowwise_groups, quantize_weight)
from jetflow.precision.modes import PRECISION_MODES, PrecisionMode
from jetflow.precision.recipe import FP8_MAX, FP8Recipe, RecipeMismatchError, check_fingerprint

__all__ = [
    "FP8Recipe", "FP8_MAX", "PRECISION_MODES", "PrecisionMode", "RecipeMismatchError", "check_fingerprint",
    "QuantizedTensor", "NonFiniteError", "defer_nonfinite", "quantize_blocks", "quantize_weight", "quantize_rowwise_groups",
    "quantize_colwise_groups", "dequantize", "fake_quantize",
    "GEMM_BACKENDS", "fp8_matmul", "bf16_linear", "resolve_backend",
    "LINEAR_KINDS", "PrecisionLinear", "apply_precision", "fp8_linear", "fp8_linears",
    "quantized_weights", "to_checkpoint_tensors", "from_checkpoint_tensors", "save_quantized", "load_quantized",
]
