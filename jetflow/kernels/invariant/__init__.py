"""Batch-invariant GEMM and attention: each row's result is one fixed sequence of floating-point
operations, whatever else is in the call (the exact numerics mode, `precision.numerics=exact`).

    packed = pack_weight(w)                       # (N, K) fp32 / bf16 / E4M3 -> panels, once per weight version
    y = matmul(x, w, packed)                      # x (..., K) -> (..., N), rows independent of M and of TP
    y = fp8_gemm(xq, sx, packed, sw, n)           # E4M3 operands with their block scales -> (M, N) fp32
    o = attention(q, kt, v, pos, scale)           # each query sees key slots 0..pos, one order
    o = decode_attention(q, k, v, cos, sin, pos, kt_cache, v_cache, end, scale)  # RoPE + cache write + attention

Why: BLAS picks kernels by shape (gemv for one row, other blockings for other M; measured here: MKL's
fp32 rows differ between M = 1..128 and large M on one shape, and vary with the ISA), and SDPA's
reduction order depends on the sequence length, so a token decoded from a KV cache and the same token
inside the trainer's full forward come out a few ulps apart, which FP8 rounding then amplifies. These
kernels define every output element as one fixed sequence of correctly rounded operations: the GEMMs the
canonical reduction of jetflow.kernels.canonical (128-K block chains, groups, a pairwise tree;
csrc/gemm.cpp), which also makes a row-parallel layer's result independent of its tensor-parallel degree;
attention one chain per query (csrc/attention.cpp). So the rollout engine and the trainer compute the same bits.

Gradients: torch's kernels (only the forward that produces log-probs must be exact; attention's backward a
block of query rows at a time, so no (B, H, T, S) scores exist whole); a weight gradient with `ordered_wgrad`
(sequence packing's grid) sums its tokens in `weight_grad`'s one order instead, shared by packed and padded rows.

CUDA: the same contract on jetflow's Triton kernels (jetflow.kernels.triton): `pack_weight` keeps W as it is,
`matmul` / `gemm` / `fp8_gemm` run Triton GEMMs with the canonical reduction, `attention` the fixed-block
online-softmax kernel: not the CPU's bits, but a row again the same whatever M, the batch or the KV cache.

The package's modules, one job each (callers use the names exported here):
    packing        `pack_weight`, `panel_width`: the CPU GEMMs' weight panels (csrc/pack.cpp)
    quantizers     `quantize_1x128`, `round_to_bf16`, `e4m3_to_float` (csrc/quant.cpp)
    gemm_ops       `gemm`, `prepare_gemm`, `fp8_gemm`, `quantized_fp8_gemm`, `prepare_quantized_fp8_gemm`,
                   `matmul` (autograd: `_Matmul`), `weight_grad` (csrc/gemm.cpp; Triton on CUDA)
    attention_ops  `attention` (autograd: `_Attention`), `decode_attention`, `reference_attention`
                   (csrc/attention.cpp, csrc/rope.cpp; Triton on CUDA)
    _lib           what they share: `check_device`, the library handle (`load_library`, looked up on this
                   package, so replacing `invariant.load_library` reaches every kernel), `isa`, pointers
"""

from __future__ import annotations

from jetflow.kernels.cpu_build import KernelBuildError
from jetflow.kernels.invariant._lib import check_device
from jetflow.kernels.invariant.attention_ops import attention, decode_attention, reference_attention
from jetflow.kernels.invariant.gemm_ops import (fp8_gemm, gemm, matmul, prepare_gemm, prepare_quantized_fp8_gemm,
                                                quantized_fp8_gemm, weight_grad)
from jetflow.kernels.invariant.packing import pack_weight, panel_width

# The package's other attributes that callers, tests and scripts use (outside __all__, as before the split):
from jetflow.kernels.cpu_build import load_library as load_library  # the one place to replace the library
from jetflow.kernels.invariant._lib import cuda_kernels as cuda_kernels, isa as isa
from jetflow.kernels.invariant.attention_ops import ATTENTION_BACKWARD_ROWS as ATTENTION_BACKWARD_ROWS
from jetflow.kernels.invariant.attention_ops import _Attention as _Attention
from jetflow.kernels.invariant.gemm_ops import _Matmul as _Matmul
from jetflow.kernels.invariant.quantizers import e4m3_to_float as e4m3_to_float
from jetflow.kernels.invariant.quantizers import quantize_1x128 as quantize_1x128
from jetflow.kernels.invariant.quantizers import round_to_bf16 as round_to_bf16

__all__ = ["KernelBuildError", "attention", "check_device", "decode_attention", "fp8_gemm", "gemm", "matmul",
           "pack_weight", "panel_width", "prepare_gemm", "prepare_quantized_fp8_gemm", "quantized_fp8_gemm",
           "reference_attention", "weight_grad"]
