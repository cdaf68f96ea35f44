"""Triton kernels for CUDA with the exact numerics contract: a row's result never depends on M, the
batch or whether it is decoded from a KV cache (see jetflow.kernels.invariant for the CPU twins).

    quant.quantize_1x128     1x128 E4M3 activation quantization, the CPU quantizer's bytes
    gemm.fp8_gemm            block-scaled FP8 GEMM (1x128 x 128x128 or 1x128 x 1x128), the canonical K order
    gemm.dense_gemm          dense GEMM (bf16 or fp32 operands), the canonical K order
    attn.attention           causal attention, prefill and decode, contiguous or paged, bf16/fp32/FP8 KV
    paged_exact.paged_attention
                             paged attention with the CPU kernel's arithmetic (csrc/attention.cpp's bits)
    rmsnorm.rms_norm         RMSNorm with one reduction tree per row (torch's CUDA reduction is not)

Triton is optional: this package imports it only when a kernel is asked for (`require()`), and a
missing Triton is a MissingDependencyError that names the pinned install. The kernels are the same
code on the GPU and under TRITON_INTERPRET=1 on the CPU (tests/unit/test_triton_kernels.py); see
compile_check.py for the sm_90 build check that needs no GPU.
"""

from __future__ import annotations

from jetflow.errors import MissingDependencyError

PINNED_VERSION = "3.6.0"
"""The Triton the kernels are tested with (CPU interpreter) and the GPU image ships."""
INSTALL = f"pip install triton=={PINNED_VERSION}"


def require():
    """The triton module, or a MissingDependencyError naming the install."""
    try:
        import triton
    except ImportError as e:
        raise MissingDependencyError(
            f"precision.numerics=exact on CUDA runs jetflow's Triton kernels, and Triton is not installed "
            f"({e}): {INSTALL}") from None
    return triton


def available() -> bool:
    try:
        require()
    except MissingDependencyError:
        return False
    return True


def quantize_1x128(x, scale_rule: str = "fp32", margin: int = 0):
    """See quant.quantize_1x128."""
    require()
    from jetflow.kernels.triton import quant
    return quant.quantize_1x128(x, scale_rule, margin)


def fp8_gemm(a, sa, b, sb, b_rows_per_scale: int, out_dtype=None, groups: int | None = None):
    """See gemm.fp8_gemm."""
    require()
    import torch

    from jetflow.kernels.triton import gemm
    return gemm.fp8_gemm(a, sa, b, sb, b_rows_per_scale, out_dtype or torch.float32, groups)


def dense_gemm(a, b, dot: str = "fp32", out_dtype=None, groups: int | None = None):
    """See gemm.dense_gemm."""
    require()
    import torch

    from jetflow.kernels.triton import gemm
    return gemm.dense_gemm(a, b, dot, out_dtype or torch.float32, groups)


def attention(q, k, v, pos, scale: float, block_table=None, k_scale=None, v_scale=None):
    """See attn.attention."""
    require()
    from jetflow.kernels.triton import attn
    return attn.attention(q, k, v, pos, scale, block_table, k_scale, v_scale)


def paged_attention(q, k_pages, v_pages, table, pos, scale: float, k_scale: float = 1.0, v_scale: float = 1.0):
    """See paged_exact.paged_attention."""
    require()
    from jetflow.kernels.triton import paged_exact
    return paged_exact.paged_attention(q, k_pages, v_pages, table, pos, scale, k_scale, v_scale)


def rms_norm(x, weight, eps: float):
    """See rmsnorm.rms_norm."""
    require()
    from jetflow.kernels.triton import rmsnorm
    return rmsnorm.rms_norm(x, weight, eps)
