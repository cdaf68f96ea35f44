"""The canonical GEMM (jetflow.kernels.canonical, csrc/gemm.cpp): its FP8 arithmetic against an
independent float64 emulation (bit for bit), every build of the kernels against each other (native,
which uses AVX512_BF16's vdpbf16ps where the CPU has it; AVX-512 without it; AVX2; scalar), rows
independent of M, and tensor-parallel shards whose subtrees combine into the unsharded result."""

from __future__ import annotations

import pytest
import torch

from jetflow.kernels import canonical
from jetflow.kernels import invariant as inv
from jetflow.kernels.cpu_build import _cpu_flags
from jetflow.precision.quant import quantize_blocks

FLAGS = f" {_cpu_flags()} "
VARIANTS = ["native", "scalar"] + (["avx2"] if " avx2 " in FLAGS and " fma " in FLAGS else []) \
    + (["avx512"] if all(f" {f} " in FLAGS for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl")) else [])


def test_tree_width_and_tree_sum():
    assert [canonical.tree_width(k) for k in (64, 128, 256, 384, 512, 576, 1024, 1536, 2048, 4096, 14336)] == \
        [1, 1, 2, 1, 4, 1, 8, 4, 8, 8, 8]
    a, b, c, d = (torch.tensor([x]) for x in (1e8, 1.0, -1e8, 1.0))
    assert canonical.tree_sum([a, b, c, d]).item() == 0.0  # pairs first in fp32: (1e8 + 1) + (-1e8 + 1) = 1e8 - 1e8
    assert (((a + b) + c) + d).item() == 1.0  # a chain gives another result
    with pytest.raises(ValueError):
        canonical.tree_sum([a, b, c])
    with pytest.raises(ValueError):
        canonical.check_groups(576, 2)  # not whole blocks
    with pytest.raises(ValueError):
        inv.gemm(torch.randn(2, 384), inv.pack_weight(torch.randn(3, 384)), 3, groups=2)  # 3 blocks


def test_e4m3_conversion_of_every_code_equals_torch():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # NaN codes never reach a kernel
    ref = codes.view(torch.float8_e4m3fn).float()
    for variant in VARIANTS:
        got = inv.e4m3_to_float(codes, variant)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), variant  # signed zeros too


def fp8_reference(xq, wq) -> torch.Tensor:
    """The canonical FP8 arithmetic in float64 steps rounded to fp32 after every operation: per 128-K
    block a chain over the raw E4M3 values, pairs odd element first (a product of two E4M3 values is
    exact, and so is its float64 sum with an fp32 accumulator, so rounding that sum once to fp32 is the
    FMA), times sx * sw, added to the group sum; the groups through the pairwise tree."""
    a, b = xq.data.float(), wq.data.float()  # (M, K), (N, K) raw values
    m, k = a.shape
    n = b.shape[0]
    nb, groups = -(-k // 128), canonical.tree_width(k)
    sums = []
    for g in range(groups):
        s = torch.zeros(m, n)
        for blk in range(g * nb // groups, (g + 1) * nb // groups):
            acc = torch.zeros(m, n)
            ks = list(range(blk * 128, min(k, blk * 128 + 128)))
            order = [kk for i in range(0, len(ks), 2) for kk in reversed(ks[i:i + 2])]
            for kk in order:
                acc = (acc.double() + a[:, kk, None].double() * b[None, :, kk].double()).float()
            scale = xq.scale_inv[:, blk, None] * wq.scale_inv[torch.arange(n) // 128, blk][None, :]
            s = s + acc * scale
        sums.append(s)
    return canonical.tree_sum(sums)


@pytest.mark.parametrize("m,n,k", [(3, 40, 64), (5, 33, 576), (4, 130, 512), (2, 17, 129)])
def test_fp8_gemm_is_the_canonical_arithmetic_bit_for_bit(m, n, k):
    gen = torch.Generator().manual_seed(m * 7 + k)
    xq = quantize_blocks(torch.randn(m, k, generator=gen) * 3, (1, 128))
    wq = quantize_blocks(torch.randn(n, k, generator=gen) * 0.05, (128, 128))
    ref = fp8_reference(xq, wq)
    for variant in VARIANTS:
        got = inv.fp8_gemm(xq.data, xq.scale_inv, inv.pack_weight(wq.data, variant), wq.scale_inv, n, variant)
        assert torch.equal(got, ref), variant


def _operands(kind: str, m: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05
    if kind == "fp8":
        return quantize_blocks(x, (1, 128)), quantize_blocks(w, (128, 128))
    return (x.bfloat16().float(), w.bfloat16()) if kind == "bf16" else (x, w)


def _gemm(kind, x, w, n, variant="native", groups=None):
    if kind == "fp8":
        return inv.fp8_gemm(x.data, x.scale_inv, inv.pack_weight(w.data, variant), w.scale_inv, n, variant, groups)
    return inv.gemm(x, inv.pack_weight(w, variant), n, variant, groups)


def _rows(kind, x, rows):
    if kind == "fp8":
        return type(x)(x.data[rows].contiguous(), x.scale_inv[rows].contiguous(), x.block)
    return x[rows]


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("n,k", [(576, 576), (1536, 576), (576, 1536), (96, 1024), (37, 130), (17, 129)])
def test_builds_equal_and_rows_do_not_depend_on_m(kind, n, k):
    x, w = _operands(kind, 70, n, k, seed=n + k)
    y = _gemm(kind, x, w, n)
    for variant in VARIANTS[1:]:
        assert torch.equal(_gemm(kind, x, w, n, variant), y), variant
    for m, off in [(1, 0), (2, 5), (3, 60), (16, 1), (17, 40), (64, 3)]:
        assert torch.equal(_gemm(kind, _rows(kind, x, slice(off, off + m)), w, n), y[off:off + m]), (m, off)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
def test_tensor_parallel_shards_combine_into_the_unsharded_result(kind):
    """A row-parallel layer at TP = T: rank r holds K columns [r K/T, (r+1) K/T), computes its subtree
    with groups = G / T, and tree_sum of the T results is the TP = 1 result, bit for bit."""
    m, n, k = 9, 70, 2048
    x, w = _operands(kind, m, n, k, seed=5)
    full = _gemm(kind, x, w, n)
    G = canonical.tree_width(k)
    chain = _gemm(kind, x, w, n, groups=1)  # one chain of block partials: what a tree-less kernel would do
    assert not torch.equal(chain, full)  # the grouping is visible in the bits, so the test below can fail
    for T in (2, 4, 8):
        cols, blocks = k // T, k // T // 128
        parts = []
        for r in range(T):
            cs, bs = slice(r * cols, (r + 1) * cols), slice(r * blocks, (r + 1) * blocks)
            if kind == "fp8":
                xs = type(x)(x.data[:, cs].contiguous(), x.scale_inv[:, bs].contiguous(), x.block)
                ws = type(w)(w.data[:, cs].contiguous(), w.scale_inv[:, bs].contiguous(), w.block)
            else:
                xs, ws = x[:, cs].contiguous(), w[:, cs].contiguous()
            parts.append(_gemm(kind, xs, ws, n, groups=G // T))
        assert torch.equal(canonical.tree_sum(parts), full), T


def test_fp8_gemm_is_close_to_the_dequantized_product():
    x, w = _operands("fp8", 33, 200, 1536, seed=2)
    ref = x.dequantize().double() @ w.dequantize().double().t()
    got = _gemm("fp8", x, w, 200)
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6


def _quantizer_inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    codes = torch.arange(256, dtype=torch.uint8)
    grid = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float().sort().values
    mids = (grid[1:] + grid[:-1]) / 2  # ties: round to the even code
    edge = torch.cat([grid, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), torch.zeros(8), -torch.zeros(8),
                      torch.tensor([1e-12, -1e-12, 1e-40, -3e-41])])
    edge = edge[:edge.numel() // 128 * 128].reshape(-1, 128)
    return [torch.randn(40, 576, generator=gen) * s for s in (1e-3, 1.0, 100.0)] + [
        edge, torch.cat([edge, edge * 3.7], 1),  # every code, every tie, subnormals, signed zeros, a partial group
        torch.ldexp(torch.ones(30, 256), torch.randint(-30, 30, (30, 256), generator=gen)),  # pow2 amax: exact scales
        torch.zeros(3, 130), torch.randn(5, 200, generator=gen) * 1e-11]  # below the eps of the scale


@pytest.mark.parametrize("rule,margin", [("fp32", 0), ("pow2", 0), ("fp32", 2), ("pow2", 1)])
def test_fused_quantizer_equals_quantize_blocks_byte_for_byte(rule, margin):
    big = torch.randn(1300, 300, generator=torch.Generator().manual_seed(3))  # the threaded path (M * K > 2^18)
    for x in [*_quantizer_inputs(), big]:
        ref = quantize_blocks(x, (1, 128), scale_rule=rule, margin=margin)
        # x itself, and x as a transposed view (the wgrad's 128 x 1 groups: read in place, not copied)
        for view in (x, x.t().contiguous().t()):
            for variant in VARIANTS:
                data, scale_inv, bad = inv.quantize_1x128(view, rule, margin, variant)
                assert bad == 0
                what = (variant, tuple(x.shape), view.stride())
                assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8)), what
                assert torch.equal(scale_inv.view(torch.int32), ref.scale_inv.view(torch.int32)), what


def test_fused_quantizer_reports_nonfinite_groups():
    x = torch.randn(4, 256)
    x[1, 200], x[3, 3] = float("nan"), float("inf")
    for variant in VARIANTS:
        for view in (x, x.t().contiguous().t()):
            _, scale_inv, bad = inv.quantize_1x128(view, variant=variant)
            assert bad == 2 and scale_inv.isnan().nonzero().tolist() == [[1, 1], [3, 0]]


@pytest.mark.parametrize("m,n,k,rule,margin", [(16, 96, 576, "fp32", 0), (1, 40, 200, "pow2", 1), (33, 64, 1536, "fp32", 2)])
def test_quantize_and_fp8_gemm_in_one_call_equal_the_two_calls(m, n, k, rule, margin):
    """quantized_fp8_gemm (an exact FP8 linear's fprop in one kernel call) = quantize_1x128 then fp8_gemm,
    bit for bit, for 128x128 weight blocks and per-row scales (the sibling linears' layout), every build;
    None when a group holds NaN."""
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen) * 3
    w = quantize_blocks(torch.randn(n, k, generator=gen), (128, 128))
    per_row = torch.rand(n, -(-k // 128), generator=gen) + 0.5  # (N, K / 128): weight_rows_per_scale=1
    for variant in VARIANTS:
        packed = inv.pack_weight(w.data, variant)
        xq, sx, _ = inv.quantize_1x128(x, rule, margin, variant)
        for sw, rows in ((w.scale_inv, 128), (per_row, 1)):
            want = inv.fp8_gemm(xq, sx, packed, sw, n, variant, weight_rows_per_scale=rows)
            got = inv.quantized_fp8_gemm(x, rule, margin, packed, sw, n, variant, weight_rows_per_scale=rows)
            assert torch.equal(got, want), (variant, rows)
    bad = x.clone()
    bad[-1, k - 1] = float("nan")
    assert inv.quantized_fp8_gemm(bad, rule, margin, inv.pack_weight(w.data), w.scale_inv, n) is None


def test_exact_fp8_linear_refuses_nan_like_the_quantizer():
    from jetflow.precision import QuantRecipe, NonFiniteError, PrecisionLinear, defer_nonfinite
    layer = PrecisionLinear(256, 128, kind="fp8", recipe=QuantRecipe(), numerics="exact", name="probe")
    x = torch.randn(3, 256)
    x[1, 7] = float("nan")
    with torch.no_grad(), pytest.raises(NonFiniteError, match="probe.input"):
        layer(x)
    with defer_nonfinite() as record:  # a collective forward goes on; the NaN flows on
        y = layer(x)
    assert "probe.input" in record.message and y[1].isnan().all() and y[0].isfinite().all()


def test_exact_fp8_linear_backward_runs_the_kernels_on_the_same_fp8_operands():
    """dgrad and wgrad of an exact FP8 linear run on the CPU's FP8 kernels: the same quantized operands as
    the emulated backward (fast numerics), other summation order only."""
    from jetflow.precision import QuantRecipe, PrecisionLinear
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 100, 384, generator=gen)
    g = torch.randn(3, 100, 256, generator=gen)
    grads = {}
    for numerics in ("fast", "exact"):
        layer = PrecisionLinear(384, 256, kind="fp8", recipe=QuantRecipe(), numerics=numerics)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(256, 384, generator=torch.Generator().manual_seed(9)) * 0.05)
        xi = x.clone().requires_grad_()
        (layer(xi) * g).sum().backward()
        grads[numerics] = (xi.grad, layer.weight.grad)
    for fast, exact in zip(grads["fast"], grads["exact"]):
        assert ((exact - fast).abs().max() / fast.abs().max()).item() < 1e-5


def test_bf16_operands_out_of_the_dot_product_range_take_the_fma_path_in_every_build():
    """vdpbf16ps flushes denormals, so the native build multiplies bf16 operands with it only when every
    nonzero magnitude is >= 2^-56 (then nothing in the chain is denormal). A tiny activation (checked per
    call) or a tiny weight (checked when packed) takes the FMA path: every build gives the FMA chain's
    denormal results, where the instruction would have given 0."""
    x, w = _operands("bf16", 16, 96, 576, seed=3)
    tiny_x, tiny_w = x.clone(), w.clone()
    tiny_x[5] = 0.0
    tiny_x[5, 7] = 1.5 * 2.0 ** -126  # a normal bf16 value; its products with w are denormal
    tiny_w[10] = 0.0
    tiny_w[10, 300] = (2.0 ** -130 * torch.ones(1)).bfloat16()  # a bf16 denormal: the instruction reads 0
    for xs, ws, row, col in [(tiny_x, w, 5, slice(None)), (x, tiny_w, slice(None), 10)]:
        want = _gemm("bf16", xs, ws, 96, "scalar")
        part = want[row, col]
        assert (part != 0).all() and (part.abs() < 2.0 ** -126).all()  # denormal, not flushed
        for variant in VARIANTS[:1] + VARIANTS[2:]:
            assert torch.equal(_gemm("bf16", xs, ws, 96, variant), want), variant


def test_activations_off_the_bf16_grid_against_bf16_pairs_are_the_fma_chain():
    """gemm on bf16 weights with fp32 activations that are not bf16 values (a caller that skipped the
    rounding) computes the FMA chain on the full fp32 values in every build, not vdpbf16ps's truncation."""
    x, w = _operands("bf16", 12, 64, 256, seed=4)
    x = x + torch.randn(12, 256, generator=torch.Generator().manual_seed(1)) * 1e-3  # off the grid
    want = _gemm("bf16", x, w, 64, "scalar")
    for variant in VARIANTS[:1] + VARIANTS[2:]:
        assert torch.equal(_gemm("bf16", x, w, 64, variant), want), variant


@pytest.mark.parametrize("m, n, k", [(16, 200, 576), (300, 70, 333)])
def test_fp8_weight_packing_formats_give_the_same_bits(m, n, k):
    """On AVX512_BF16 `pack_weight` widens E4M3 weights to bf16 pairs once (int32 panels); the kernel also
    takes the E4M3 byte panels of the other builds (widened per call, for few row blocks (M = 16, decode)
    and for many (M = 300)). Both, and every build, give the same bits, on every finite E4M3 code (odd K:
    the last pair's high half is zero)."""
    x, w = _operands("fp8", m, n, k, seed=6)
    codes = torch.randint(0, 256, (n, k), generator=torch.Generator().manual_seed(7), dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0x08  # every finite E4M3 code (subnormals, zeros, both signs), no NaN
    w = type(w)(codes.view(torch.float8_e4m3fn), w.scale_inv, w.block)
    native = inv.pack_weight(w.data)
    want = inv.fp8_gemm(x.data, x.scale_inv, inv.pack_weight(w.data, "scalar"), w.scale_inv, n, "scalar")
    assert torch.equal(inv.fp8_gemm(x.data, x.scale_inv, native, w.scale_inv, n), want)
    if inv.isa() == "avx512_bf16":
        assert native.dtype == torch.int32 and native.shape[1] == (k + 1) // 2
        byte_panels = inv.pack_weight(w.data, "avx512")  # E4M3 bytes, same panel width
        assert byte_panels.dtype == torch.float8_e4m3fn
        assert torch.equal(inv.fp8_gemm(x.data, x.scale_inv, byte_panels, w.scale_inv, n), want)
    with pytest.raises(ValueError, match="does not fit"):
        inv.fp8_gemm(x.data[:, :256].contiguous(), x.scale_inv[:, :2].contiguous(), native, w.scale_inv[:, :2], n)


def test_bf16_grid_is_the_two_casts_bit_for_bit_forward_and_backward():
    from jetflow.precision.exact import bf16_grid
    gen = torch.Generator().manual_seed(11)
    bits = torch.randint(0, 2**31, (4096,), generator=gen, dtype=torch.int64)
    ties = (torch.randint(0, 2**15, (512,), generator=gen) << 16) | 0x8000  # exactly halfway: to even
    x = torch.cat([(bits | (bits & 1) << 31).to(torch.int32).view(torch.float32),  # every exponent, both signs
                   ties.to(torch.int32).view(torch.float32), -ties.to(torch.int32).view(torch.float32),
                   torch.tensor([0.0, -0.0, 1e-40, -1e-45, 3.3895e38, 3.4e38, float("inf"), float("-inf")]),
                   torch.randn(300_000, generator=gen)])  # the threaded path
    finite = ~x.isnan()
    for variant in VARIANTS:
        got = inv.round_to_bf16(x, variant)
        assert torch.equal(got[finite].view(torch.int32), x[finite].bfloat16().float().view(torch.int32)), variant
        assert got[~finite].isnan().all()
    w = torch.randn(64, 40, generator=gen).requires_grad_()
    g = torch.randn(64, 40, generator=gen)
    bf16_grid(w).backward(g)
    w_ref = w.detach().clone().requires_grad_()
    w_ref.bfloat16().float().backward(g)
    assert torch.equal(w.grad, w_ref.grad) and not torch.equal(w.grad, g)  # the gradient is rounded too


def test_weight_panels_are_the_transposed_columns_for_every_format_and_view():
    """pack_weight's panels (before any pair layout) against torch's own reshape-transpose of the
    zero-padded weight, for rows and for a transposed view (the dgrad's W^T), every element size."""
    gen = torch.Generator().manual_seed(5)
    for variant in VARIANTS:
        lib = inv.load_library(variant)
        nr = lib.jf_panel_width()
        for n, k in ((70, 45), (64, 128), (3, 300)):
            for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
                w = (torch.randn(n, k, generator=gen) * 3).to(dtype)
                for view in (w, w.t().contiguous().t()):
                    bits = view.view(torch.uint8) if dtype == torch.float8_e4m3fn else view
                    p = -(-n // nr)
                    ref = torch.nn.functional.pad(bits.contiguous(), (0, 0, 0, p * nr - n)).reshape(p, nr, k)
                    ref = ref.transpose(1, 2).contiguous()
                    got = torch.empty_like(ref)
                    lib.jf_pack_panels(bits.data_ptr(), bits.element_size(), n, k, bits.stride(0), bits.stride(1),
                                       got.data_ptr())
                    assert torch.equal(got, ref), (variant, n, k, dtype, view.stride())


def test_weight_grad_sums_tokens_in_128_row_blocks_where_zero_rows_add_nothing():
    """invariant.weight_grad (the exact weight gradients' sum over tokens on sequence packing's grid): close
    to float64; whole blocks of zero output-gradient rows (their inputs arbitrary) and zero rows after a
    sequence inside its last block leave the bits alone, so packed and padded layouts agree; a sequence
    moved across a block boundary changes them (the blocks are the order)."""
    g = torch.Generator().manual_seed(0)
    a_g, a_x = torch.randn(128, 24, generator=g), torch.randn(128, 40, generator=g)  # a sequence of 128 tokens
    b_g, b_x = torch.randn(50, 24, generator=g), torch.randn(50, 40, generator=g)  # one of 50
    want = inv.weight_grad(torch.cat([a_g, b_g]), torch.cat([a_x, b_x]))  # (24, 40)
    ref = torch.cat([a_g, b_g]).double().t() @ torch.cat([a_x, b_x]).double()
    torch.testing.assert_close(want.double(), ref, rtol=1e-5, atol=1e-5)
    pad_g, pad_x = torch.zeros(78, 24), torch.randn(78, 40, generator=g)  # padding: no gradient, any input
    gap_g, gap_x = torch.zeros(128, 24), torch.randn(128, 40, generator=g)
    padded = inv.weight_grad(torch.cat([a_g, gap_g, b_g, pad_g]), torch.cat([a_x, gap_x, b_x, pad_x]))
    assert torch.equal(padded, want)
    shifted = inv.weight_grad(torch.cat([a_g[:64], b_g, a_g[64:]]), torch.cat([a_x[:64], b_x, a_x[64:]]))
    assert not torch.equal(shifted, want)
    torch.testing.assert_close(shifted, want, rtol=1e-5, atol=1e-5)


def test_an_ordered_rmsnorms_weight_gradient_is_the_token_sum_of_weight_grad():
    """RMSNorm.ordered_wgrad (packing's grid): the same forward, the weight's gradient by weight_grad; off
    (the default) autograd's own sum, as before."""
    from jetflow.model.layers import RMSNorm
    norm = RMSNorm(40, 1e-6)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40, generator=g))
    x, dy = torch.randn(2, 96, 40, generator=g), torch.randn(2, 96, 40, generator=g)
    plain = norm(x)
    plain.backward(dy)
    autograd_sum, norm.weight.grad = norm.weight.grad, None
    norm.ordered_wgrad = True
    out = norm(x)
    assert torch.equal(out, plain)  # the same forward
    out.backward(dy)
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    prod = (dy * xn).reshape(-1, 40)
    assert torch.equal(norm.weight.grad, inv.weight_grad(torch.ones(192, 1), prod)[0])
    torch.testing.assert_close(norm.weight.grad.double(), prod.double().sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(autograd_sum, norm.weight.grad, rtol=1e-5, atol=1e-5)
