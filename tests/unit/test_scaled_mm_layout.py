"""The Hopper GEMM's operands, checked on the CPU against cuBLASLt's block-scaling contract.

The `scaled_mm` backend only runs on an SM90 GPU, but what it hands to torch is built by plain
tensor code that runs anywhere. These tests check that code against independent things:
- torch's own checks of `F.scaled_mm` (v2), shapes *and strides*, which its meta kernel runs on the
  CPU exactly as ScaledBlas.cpp does on CUDA, and those of `torch._scaled_mm` (v1: shapes only);
- the layout table of cuBLASLt's DeepSeek-style block scaling (cuBLAS docs; pytorch#166752),
  written out here for v1, whose meta kernel does not check strides;
- an fp64 product that reads the operands block by block as cuBLAS does, against the emulation.
"""

import pytest
import torch
import torch.nn.functional as F

from jetflow.precision import fp8_matmul, quantize_blocks
from jetflow.precision.gemm import blockwise_operands, scaled_mm_api

SHAPES = [(1, 256, 512), (7, 384, 576), (16, 1000, 1000), (128, 1536, 576), (333, 896, 4864), (5, 128, 128)]
RHS_BLOCKS = [(128, 128), (1, 128)]


def _cdiv(a, b):
    return -(-a // b)


def _meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")  # same strides, no data


def _dim_is(t, dim, size, stride):
    """Size and stride of one dim; a size-1 dim's stride is meaningless (torch reports 1 there)."""
    return t.shape[dim] == size and (t.stride(dim) == stride or (size == 1 and t.stride(dim) == 1))


def _check_v1_layout(mat_a, mat_b, scale_a, scale_b, rhs_block):
    """cuBLASLt's contract, as `torch._scaled_mm` receives it: A (M, K) row-major, B (K, N)
    column-major; the 128x128 scales' K-block stride must be a multiple of 4 (L4)."""
    m, k = mat_a.shape
    n = mat_b.shape[1]
    kb = _cdiv(k, 128)
    assert mat_a.stride() == (k, 1) and mat_b.stride() == (1, k)
    assert k % 16 == 0 and n % 16 == 0, "cuBLAS wants K and N divisible by 16"
    assert m % 4 == 0 and _dim_is(scale_a, 0, m, 1) and _dim_is(scale_a, 1, kb, m), scale_a.stride()
    if rhs_block == (128, 128):
        assert kb % 4 == 0, "v1 pads K so that K/128 == L4"
        assert _dim_is(scale_b, 0, kb, 1) and _dim_is(scale_b, 1, _cdiv(n, 128), kb), scale_b.stride()
    else:
        assert _dim_is(scale_b, 0, kb, n) and _dim_is(scale_b, 1, n, 1), scale_b.stride()


def _run_on_meta(api, ops, rhs_block):
    if api == "v2":
        recipe_b = F.ScalingType.BlockWise128x128 if rhs_block == (128, 128) else F.ScalingType.BlockWise1x128
        return F.scaled_mm(*map(_meta, ops[:3]), F.ScalingType.BlockWise1x128, _meta(ops[3]), recipe_b,
                           output_dtype=torch.bfloat16)
    return torch._scaled_mm(*map(_meta, ops), out_dtype=torch.bfloat16)


def _cublas_reference(api, mat_a, mat_b, scale_a, scale_b, rhs_block):
    """(M', N') in fp64: each 128-long K block's partial dot product times its two scales."""
    n = mat_b.shape[1]
    a, b = mat_a.double(), mat_b.double()
    out = torch.zeros(a.shape[0], n, dtype=torch.float64)
    for kb in range(_cdiv(a.shape[1], 128)):
        sl = slice(kb * 128, (kb + 1) * 128)
        if rhs_block == (128, 128):
            sb = scale_b[kb].double().repeat_interleave(128)[:n]  # (L4 | kb, N'/128) both APIs
        else:
            sb = (scale_b[:, kb] if api == "v2" else scale_b[kb]).double()  # v2 (N', kb), v1 (kb, N')
        out += scale_a[:, kb].double()[:, None] * (a[:, sl] @ b[sl, :]) * sb[None, :]
    return out


def _operands(m, n, k, rhs_block, fmt_a="e4m3"):
    torch.manual_seed(0)
    a = quantize_blocks(torch.randn(m, k) * 3, (1, 128), fmt=fmt_a)
    b = quantize_blocks(torch.randn(n, k), rhs_block)
    return a, b


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("rhs_block", RHS_BLOCKS)
@pytest.mark.parametrize("api", ["v2", "v1"])
def test_blockwise_operands_follow_cublas_contract(m, n, k, rhs_block, api):
    a, b = _operands(m, n, k, rhs_block)
    ops = blockwise_operands(a, b, api)
    if api == "v1":
        _check_v1_layout(*ops, rhs_block)
    out = _run_on_meta(api, ops, rhs_block)  # torch's own checks (v2: strides too)
    assert out.shape == (ops[0].shape[0], ops[1].shape[1])

    # what cuBLAS computes from these bytes is the emulation's a @ b.T, and zeros in the padding
    ref = _cublas_reference(api, *ops, rhs_block)
    emu = fp8_matmul(a, b, torch.float64, backend="emulate")  # fp32 dequantize + matmul
    torch.testing.assert_close(ref[:m, :n], emu, rtol=0, atol=1e-6 * emu.abs().max().item())
    assert not ref[m:].any() and not ref[:, n:].any()


def test_v2_meta_kernel_checks_scale_strides():
    """The meta check above can fail: v2 refuses 128x128 scales whose K-block stride is not L4."""
    a, b = _operands(16, 384, 576, (128, 128))
    mat_a, mat_b, scale_a, scale_b = blockwise_operands(a, b, "v2")
    unpadded = scale_b[:5].contiguous()  # (K/128, N/128) row-major: the layout torch used to take
    row_major = scale_b.contiguous()  # the right shape (L4, N/128), the wrong strides
    for wrong in (unpadded, row_major):
        with pytest.raises(RuntimeError, match="128x128"):
            _run_on_meta("v2", (mat_a, mat_b, scale_a, wrong), (128, 128))


@pytest.mark.parametrize("rhs_block", RHS_BLOCKS)
def test_e5m2_gradients_take_v1(rhs_block):
    """Under `hybrid`, dgrad and wgrad multiply an E5M2 gradient by an E4M3 operand: v2's DeepSeek
    recipes take E4M3 only, so these go to torch._scaled_mm."""
    a, b = _operands(64, 256, 576, rhs_block, fmt_a="e5m2")
    assert scaled_mm_api(a, b) == "v1"
    assert scaled_mm_api(*_operands(64, 256, 576, rhs_block)) == "v2"
    ops = blockwise_operands(a, b, "v1")
    _check_v1_layout(*ops, rhs_block)
    _run_on_meta("v1", ops, rhs_block)
    ref = _cublas_reference("v1", *ops, rhs_block)
    emu = fp8_matmul(a, b, torch.float64, backend="emulate")
    torch.testing.assert_close(ref[:64, :256], emu, rtol=0, atol=1e-6 * emu.abs().max().item())


def test_blockwise_operands_refuse_other_blocks():
    a = quantize_blocks(torch.randn(4, 256), (1, 128))
    with pytest.raises(ValueError, match="scaled_mm backend supports"):
        blockwise_operands(a, quantize_blocks(torch.randn(64, 256), (64, 64)), "v2")
