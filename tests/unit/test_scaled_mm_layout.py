"""The Hopper GEMM's operands, checked on the CPU against cuBLASLt's block-scaling contract.

The `scaled_mm` backend only runs on an SM90 GPU, but what it hands to `torch._scaled_mm` is built
by plain tensor code that runs anywhere. These tests check that code against three independent
things: the layout table of cuBLASLt's DeepSeek-style block scaling (cuBLAS docs, "scaling factors
layouts", enforced by torch's ScaledBlas.cpp since pytorch#166752), torch's own `_scaled_mm` shape
checks (its meta kernel), and an fp64 product that reads the operands block by block as cuBLAS does.
"""

import pytest
import torch

from jetflow.precision import fp8_matmul, quantize_blocks
from jetflow.precision.gemm import blockwise_operands

SHAPES = [(1, 256, 512), (7, 384, 576), (16, 1000, 1000), (128, 1536, 576), (333, 896, 4864), (5, 128, 128)]


def _cdiv(a, b):
    return -(-a // b)


def _dim_is(t, dim, size, stride):
    """Size and stride of one dim; a size-1 dim's stride is meaningless (torch reports 1 there)."""
    return t.shape[dim] == size and (t.stride(dim) == stride or (size == 1 and t.stride(dim) == 1))


def _check_cublas_layout(mat_a, mat_b, scale_a, scale_b, rhs_block):
    """cuBLASLt's contract for A (M, K) row-major x B (K, N) column-major with block scales."""
    m, k = mat_a.shape
    n = mat_b.shape[1]
    kb = _cdiv(k, 128)
    assert mat_a.stride() == (k, 1), "mat_a must be row-major"
    assert mat_b.stride() == (1, k), "mat_b must be column-major"
    assert k % 16 == 0 and n % 16 == 0, "cuBLAS wants K and N divisible by 16"
    assert scale_a.dtype == scale_b.dtype == torch.float32
    # 1x128 activations: (M, K/128), outer-dim-major, 16-byte aligned columns
    assert m % 4 == 0 and _dim_is(scale_a, 0, m, 1) and _dim_is(scale_a, 1, kb, m), scale_a.stride()
    if rhs_block == (128, 128):  # (K/128, N/128), K-block stride rounded up to 4
        l4 = _cdiv(kb, 4) * 4
        assert _dim_is(scale_b, 0, kb, 1) and _dim_is(scale_b, 1, _cdiv(n, 128), l4), \
            f"128x128 scales: want shape ({kb}, {_cdiv(n, 128)}) strides (1, {l4}), got {scale_b.stride()}"
    else:  # (K/128, N), row-major
        assert _dim_is(scale_b, 0, kb, n) and _dim_is(scale_b, 1, n, 1), scale_b.stride()


def _cublas_reference(mat_a, mat_b, scale_a, scale_b, rhs_block):
    """(M', N') in fp64: each 128-long K block's partial dot product times its two scales."""
    m, k = mat_a.shape
    n = mat_b.shape[1]
    a, b = mat_a.double(), mat_b.double()
    out = torch.zeros(m, n, dtype=torch.float64)
    for kb in range(_cdiv(k, 128)):
        sl = slice(kb * 128, (kb + 1) * 128)
        sb = scale_b[kb].double()
        sb = sb.repeat_interleave(128)[:n] if rhs_block == (128, 128) else sb
        out += scale_a[:, kb].double()[:, None] * (a[:, sl] @ b[sl, :]) * sb[None, :]
    return out


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("rhs_block", [(128, 128), (1, 128)])
def test_blockwise_operands_follow_cublas_contract(m, n, k, rhs_block):
    torch.manual_seed(0)
    a = quantize_blocks(torch.randn(m, k) * 3, (1, 128))
    b = quantize_blocks(torch.randn(n, k), rhs_block)
    mat_a, mat_b, scale_a, scale_b = blockwise_operands(a, b)
    _check_cublas_layout(mat_a, mat_b, scale_a, scale_b, rhs_block)

    # torch's own shape checks for _scaled_mm (its meta kernel) accept them
    out = torch._scaled_mm(*(t.to("meta") for t in (mat_a, mat_b, scale_a, scale_b)), out_dtype=torch.bfloat16)
    assert out.shape == (mat_a.shape[0], mat_b.shape[1])

    # what cuBLAS computes from these bytes is the emulation's a @ b.T, and zeros in the padding
    ref = _cublas_reference(mat_a, mat_b, scale_a, scale_b, rhs_block)
    emu = fp8_matmul(a, b, torch.float64, backend="emulate")  # fp32 dequantize + matmul
    torch.testing.assert_close(ref[:m, :n], emu, rtol=0, atol=1e-6 * emu.abs().max().item())
    assert not ref[m:].any() and not ref[:, n:].any()


def test_blockwise_operands_refuse_other_blocks():
    a = quantize_blocks(torch.randn(4, 256), (1, 128))
    with pytest.raises(ValueError, match="scaled_mm backend supports"):
        blockwise_operands(a, quantize_blocks(torch.randn(64, 256), (64, 64)))
