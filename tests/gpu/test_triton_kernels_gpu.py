"""jetflow's Triton kernels on a CUDA GPU (an H100: scripts/gpu_check.sh): the claims the CPU tests make
under the interpreter (tests/unit/test_triton_kernels.py), now on the hardware.

Exact claims (torch.equal): the bit roundings equal the hardware's conversions; the quantizer's bytes
equal the CPU quantizer's; a GEMM row does not depend on M or on its position in the tile; a decoded
attention row equals its prefill row; paged KV equals contiguous KV; the paged attention with the
C++ arithmetic (paged_exact) gives the CPU kernel's bits. Bounds: the FP8 GEMM against
its reference arithmetic and the exact product (the MMA sums a block's products in its own order and
precision), attention against float64.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from jetflow.kernels.invariant import reference_attention  # noqa: E402
from jetflow.kernels.triton import _bits, attn, gemm, paged_exact, quant, reference  # noqa: E402
from jetflow.precision import QuantRecipe, PrecisionLinear, quantize_blocks  # noqa: E402
from jetflow.precision.quant import NonFiniteError, QuantizedTensor  # noqa: E402

CUDA = torch.device("cuda")
U8 = torch.uint8


@triton.jit
def _casts_kernel(x_ptr, bf16_bits_ptr, bf16_hw_ptr, e4m3_bits_ptr, e4m3_hw_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + i, mask=ok)
    tl.store(bf16_bits_ptr + i, _bits.round_to_bf16(x), mask=ok)
    tl.store(bf16_hw_ptr + i, x.to(tl.bfloat16), mask=ok)
    y = tl.minimum(tl.maximum(x, -448.0), 448.0)
    tl.store(e4m3_bits_ptr + i, _bits.fp32_to_e4m3(y), mask=ok)
    tl.store(e4m3_hw_ptr + i, y.to(tl.float8e4nv), mask=ok)


def test_bit_roundings_equal_the_hardware_casts():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 20, generator=gen) * torch.logspace(-12, 4, 1 << 20)[torch.randperm(1 << 20, generator=gen)]
    ties = (x.bfloat16().float().view(torch.int32) + 0x8000).view(torch.float32)
    grid = torch.arange(256, dtype=U8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = ((grid[1:].double() + grid[:-1].double()) / 2).float()
    x = torch.cat([x, ties, grid, mids]).to(CUDA)
    n = x.numel()
    out = [torch.empty(n, dtype=dtype, device=CUDA)
           for dtype in (torch.bfloat16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fn)]
    _casts_kernel[(triton.cdiv(n, 1024),)](x, *out, n, BLOCK=1024)
    assert torch.equal(out[0].view(torch.int16), out[1].view(torch.int16))
    assert torch.equal(out[0].view(torch.int16), x.bfloat16().view(torch.int16))
    assert torch.equal(out[2].view(U8), out[3].view(U8))
    assert torch.equal(out[2].view(U8), x.clamp(-448, 448).to(torch.float8_e4m3fn).view(U8))


@pytest.mark.parametrize("rule", ["fp32", "pow2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_1x128_bytes_equal_the_cpu_quantizer(rule, dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(2048, 4160, generator=gen) * torch.logspace(-10, 3, 4160)).to(dtype)  # 4160 = 32.5 groups
    data, scale = quant.quantize_1x128(x.to(CUDA), rule)
    ref = quantize_blocks(x, (1, 128), scale_rule=rule)
    assert torch.equal(data.cpu().view(U8), ref.data.view(U8))
    assert torch.equal(scale.cpu(), ref.scale_inv)
    alone = quant.quantize_1x128(x[7:8].to(CUDA), rule)[0]
    assert torch.equal(alone.view(U8), data[7:8].view(U8))
    on_cuda = quantize_blocks(x.to(CUDA), (1, 128), scale_rule=rule)  # the precision core's dispatch to it
    assert torch.equal(on_cuda.data.cpu().view(U8), ref.data.view(U8)) and torch.equal(on_cuda.scale_inv.cpu(), ref.scale_inv)
    bad = x.to(CUDA).clone()
    bad[3, 200] = float("nan")
    with pytest.raises(NonFiniteError, match=r"block \(3, 1\)"):
        quantize_blocks(bad, (1, 128), scale_rule=rule)


def _fp8(m, n, k, seed, b_block=(128, 128), device=CUDA):
    gen = torch.Generator().manual_seed(seed)
    a = quantize_blocks((torch.randn(m, k, generator=gen) * 2).to(device), (1, 128))
    b = quantize_blocks((torch.randn(n, k, generator=gen) * 0.05).to(device), b_block)
    return a, b


def _run(a: QuantizedTensor, b: QuantizedTensor, out_dtype=torch.float32):
    return gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, b.block[0], out_dtype)


def _rows(q: QuantizedTensor, idx) -> QuantizedTensor:
    return QuantizedTensor(q.data[idx], q.scale_inv[idx], q.block)


@pytest.mark.parametrize("n, k", [(4096, 4096), (1536, 576), (14336, 4096), (4096, 14336)])
def test_fp8_gemm_rows_do_not_depend_on_m_or_position(n, k):
    a, b = _fp8(4096, n, k, 2)
    full = _run(a, b)
    for m in (1, 7, 64, 129, 1000):
        assert torch.equal(_run(_rows(a, slice(0, m)), b), full[:m]), m
    perm = torch.randperm(4096, device=CUDA)
    assert torch.equal(_run(_rows(a, perm), b), full[perm])
    assert torch.equal(_run(a, b, torch.bfloat16), full.bfloat16())


def _bound(a: QuantizedTensor, b: QuantizedTensor, rel: float) -> torch.Tensor:
    return rel * (a.dequantize().abs().double() @ b.dequantize().abs().double().t())


@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
def test_fp8_gemm_accuracy(b_block):
    """Against the exact product of the dequantized operands: within 2^-12 of |A| @ |B|^T (Hopper's
    FP8 MMA keeps about 14 bits while it sums a block, DeepSeek-V3 sec. 3.3.2; the kernel promotes
    every 128-K block to fp32). The measured worst ratio is printed."""
    a, b = _fp8(512, 1536, 4160, 3, b_block)
    out = _run(a, b).double()
    exact = a.dequantize().double() @ b.dequantize().double().t()
    ref = reference.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, b.block[0]).double()
    scale = _bound(a, b, 1.0)
    print(f"fp8 gemm {b_block}: max |err| / (|A||B|) kernel {((out - exact).abs() / scale).max().item():.3g}, "
          f"reference {((ref - exact).abs() / scale).max().item():.3g}, "
          f"kernel == reference in {(out == ref).double().mean().item():.1%} of elements")
    assert bool(((out - exact).abs() <= _bound(a, b, 2.0**-12)).all())


def test_fp8_gemm_dgrad_and_wgrad_layouts():
    gen = torch.Generator().manual_seed(4)
    m, n, k = 1000, 1536, 4096
    w = quantize_blocks((torch.randn(n, k, generator=gen) * 0.05).to(CUDA), (128, 128))
    dy = (torch.randn(m, n, generator=gen) * 1e-3).to(CUDA)
    x = torch.randn(m, k, generator=gen).to(CUDA)
    gq = quantize_blocks(dy, (1, 128))
    dgrad = _run(gq, w.t()).double()
    exact = gq.dequantize().double() @ w.dequantize().double()
    assert bool(((dgrad - exact).abs() <= _bound(gq, w.t(), 2.0**-12)).all())
    gt, xt = quantize_blocks(dy, (128, 1)).t(), quantize_blocks(x, (128, 1)).t()
    wgrad = _run(gt, xt).double()
    exact = gt.dequantize().double() @ xt.dequantize().double().t()
    assert bool(((wgrad - exact).abs() <= _bound(gt, xt, 2.0**-12)).all())


@pytest.mark.parametrize("dot", ["bf16", "fp32"])
def test_dense_gemm_rows_invariant_and_accurate(dot):
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(2048, 4096, generator=gen).to(CUDA), torch.randn(2048, 4096, generator=gen).to(CUDA)
    full = gemm.dense_gemm(a, b, dot)
    for m in (1, 5, 100):
        assert torch.equal(gemm.dense_gemm(a[:m], b, dot), full[:m]), m
    perm = torch.randperm(2048, device=CUDA)
    assert torch.equal(gemm.dense_gemm(a[perm], b, dot), full[perm])
    aa, bb = (a.bfloat16(), b.bfloat16()) if dot == "bf16" else (a, b)
    exact = aa.double() @ bb.double().t()
    assert bool(((full.double() - exact).abs() <= 2.0**-16 * (aa.double().abs() @ bb.double().abs().t())).all())


def _qkv(dtype, B=3, H=8, Hkv=2, T=300, D=128, seed=6):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, T, D, generator=gen).to(CUDA, dtype) for h in (H, Hkv, Hkv)]


def _paged(k, page=16, seed=7):
    B, Hkv, S, D = k.shape
    n = S // page
    perm = torch.randperm(B * n, generator=torch.Generator().manual_seed(seed)).to(CUDA)
    table = perm.view(B, n).to(torch.int32)
    pages = torch.zeros(B * n, Hkv, page, D, dtype=k.dtype, device=CUDA)
    pages[table.flatten().long()] = k.view(B, Hkv, n, page, D).transpose(1, 2).reshape(B * n, Hkv, page, D)
    return pages, table


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_decode_rows_equal_prefill_rows(dtype):
    q, k, v = _qkv(dtype, T=320)
    B, _, T, D = q.shape
    pos = torch.arange(T, device=CUDA).expand(B, T)
    prefill = attn.attention(q, k, v, pos, D**-0.5)
    for t in (0, 1, 63, 64, 200, 319):
        step = attn.attention(q[:, :, t:t + 1], k, v, pos[:, t:t + 1], D**-0.5)
        assert torch.equal(step[:, :, 0], prefill[:, :, t]), t
    kp, table = _paged(k)
    vp, _ = _paged(v)
    assert torch.equal(attn.attention(q, kp, vp, pos, D**-0.5, block_table=table), prefill)
    ref = reference_attention(q.double(), k.double(), v.double(), pos, D**-0.5)
    bound = (2.0**-7 if dtype == torch.bfloat16 else 2.0**-16) * v.double().abs().max().item()
    assert (prefill.double() - ref).abs().max().item() <= bound


@pytest.mark.parametrize("page_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_paged_exact_attention_equals_the_cpu_kernel(page_dtype):
    """The Triton paged kernel with the C++ arithmetic (paged_exact) on the GPU gives the CPU's
    jf_attention_paged bits (SmolLM2's heads: 9 on 3 KV heads, D = 64), for a 300-token prefill of
    three rows over shuffled 64-slot pages and for a decode step at three different positions."""
    from jetflow.kernels import paged

    gen = torch.Generator().manual_seed(8)
    B, H, Hkv, T, D, nb = 3, 9, 3, 300, 64, 5
    q = torch.randn(B, H, T, D, generator=gen)
    k, v = torch.randn(B * nb + 2, Hkv, D, 64, generator=gen), torch.randn(B * nb + 2, Hkv, 64, D, generator=gen)
    ks, vs = (0.0107, 0.0093) if page_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    k, v = (k / ks).to(page_dtype), (v / vs).to(page_dtype)
    table = torch.randperm(B * nb + 2, generator=gen)[:B * nb].view(B, nb).to(torch.int32)
    pos = torch.arange(T).expand(B, T).contiguous()
    cpu = paged.paged_attention(q, k, v, table, pos, D**-0.5, ks, vs)
    gpu = paged_exact.paged_attention(q.to(CUDA), k.to(CUDA), v.to(CUDA), table.to(CUDA), pos.to(CUDA), D**-0.5, ks, vs)
    assert torch.equal(gpu.cpu(), cpu)
    dpos = torch.tensor([[299], [64], [7]])
    dq = q[torch.arange(B), :, dpos[:, 0]][:, :, None]  # (B, H, 1, D)
    step = paged_exact.paged_attention(dq.to(CUDA), k.to(CUDA), v.to(CUDA), table.to(CUDA), dpos.to(CUDA), D**-0.5,
                                       ks, vs)
    assert torch.equal(step.cpu()[:, :, 0], cpu[torch.arange(B), :, dpos[:, 0]])


def test_attention_fp8_kv():
    q, k, v = _qkv(torch.bfloat16, T=320)
    B, _, T, D = q.shape
    pos = torch.arange(T, device=CUDA).expand(B, T)
    ks, vs = k.float().abs().amax() / 448, v.float().abs().amax() / 448
    k8, v8 = (k.float() / ks).to(torch.float8_e4m3fn), (v.float() / vs).to(torch.float8_e4m3fn)
    kp, table = _paged(k8.view(U8))
    vp, _ = _paged(v8.view(U8))
    kp, vp = kp.view(torch.float8_e4m3fn), vp.view(torch.float8_e4m3fn)
    out = attn.attention(q, kp, vp, pos, D**-0.5, block_table=table, k_scale=ks, v_scale=vs)
    step = attn.attention(q[:, :, 250:251], kp, vp, pos[:, 250:251], D**-0.5, block_table=table, k_scale=ks, v_scale=vs)
    assert torch.equal(step[:, :, 0], out[:, :, 250])
    ref = reference_attention(q.double(), k8.double() * ks.double(), v8.double() * vs.double(), pos, D**-0.5)
    assert (out.double() - ref).abs().max().item() <= 2.0**-7 * (v8.double() * vs.double()).abs().max().item()


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fp8_linear_on_triton(fmt):
    """PrecisionLinear under exact numerics on CUDA: rows independent of M; the triton backend's
    backward (dgrad, wgrad; E5M2 gradients under hybrid) close to the emulation's."""
    recipe = QuantRecipe(fmt=fmt)
    torch.manual_seed(8)
    layer = PrecisionLinear(1024, 768, kind="fp8", recipe=recipe, gemm_backend="triton", numerics="exact",
                            device="cuda")
    x = torch.randn(300, 1024, device=CUDA)
    with torch.no_grad():
        full = layer(x)
        assert torch.equal(layer(x[:3]), full[:3])
    grads = {}
    for backend in ("triton", "emulate"):
        layer.gemm_backend, layer.weight.grad = backend, None
        xx = x.clone().requires_grad_(True)
        layer(xx).pow(2).sum().backward()
        grads[backend] = (xx.grad, layer.weight.grad)
    for hw, emu in zip(grads["triton"], grads["emulate"]):
        cos = torch.nn.functional.cosine_similarity(hw.flatten().double(), emu.flatten().double(), dim=0)
        assert cos.item() > 0.999


@pytest.mark.parametrize("width", [576, 1024, 4096])
def test_rms_norm_rows_invariant(width):
    """jetflow's Triton RMSNorm: a row of 1, 3 or 15 equals the same row of 4096 (torch.equal), and
    agrees with the module's torch formula within 2^-20 relative."""
    from jetflow.kernels.triton import rmsnorm
    from jetflow.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(4096, width, generator=gen) * 3).to(CUDA)
    norm = RMSNorm(width, 1e-5).to(CUDA)
    full = rmsnorm.rms_norm(x, norm.weight, 1e-5)
    for m in (1, 3, 15):
        assert torch.equal(rmsnorm.rms_norm(x[:m], norm.weight, 1e-5), full[:m]), m
    with torch.no_grad():
        ref = norm(x)
    assert bool(((full - ref).abs() <= 2.0**-20 * ref.abs().max()).all())


@pytest.mark.parametrize("op", ["rms_norm", "log_softmax", "silu_exact"])
def test_diagnostic_torch_row_ops_on_cuda(op):
    """Diagnostic for the exact mode on CUDA: whether torch's own kernels give a row the same bits in a
    call of M = 1, 3, 15 rows as in one of 4096 (the model's RMSNorm, log-softmax over a 32k vocab,
    its SiLU). A failure names an op whose CUDA kernel picks its reduction layout by the row count:
    it then needs a row-invariant kernel (rms_norm: jetflow.kernels.triton.rmsnorm) in exact numerics."""
    from jetflow.model.layers import RMSNorm, silu_exact

    gen = torch.Generator().manual_seed(10)
    width = 32768 if op == "log_softmax" else 1024
    x = (torch.randn(4096, width, generator=gen) * 3).to(CUDA)
    fn = {"rms_norm": RMSNorm(width, 1e-5).to(CUDA), "log_softmax": lambda t: torch.log_softmax(t, dim=-1),
          "silu_exact": silu_exact}[op]
    with torch.no_grad():
        full = fn(x)
        differ = [m for m in (1, 3, 15) if not torch.equal(fn(x[:m].clone()), full[:m])]
    assert not differ, f"torch {op} on CUDA: rows differ when the call has {differ} rows instead of 4096"


@pytest.mark.parametrize("kind", ["fp8", "bf16", "fp32"])
def test_tensor_parallel_shards_combine_into_the_unsharded_result(kind):
    """The canonical tree on the GPU: K = 4096 (tree_width 8) cut into T = 2, 4, 8 contiguous shards,
    each computing its subtree (groups = 8 // T), combined by tree_sum: the TP = 1 result bit for bit."""
    from jetflow.kernels.canonical import tree_sum
    gen = torch.Generator(device="cuda").manual_seed(4)
    m, n, k = 96, 512, 4096
    x = torch.randn(m, k, device="cuda", generator=gen)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.05

    def run(xs, ws, groups=None):
        if kind == "fp8":
            a, b = quantize_blocks(xs, (1, 128)), quantize_blocks(ws, (128, 128))
            return gemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, 128, torch.float32, groups)
        return gemm.dense_gemm(xs, ws, kind, torch.float32, groups)

    full = run(x, w)
    for t in (2, 4, 8):
        cols = k // t
        parts = [run(x[:, r * cols:(r + 1) * cols].contiguous(), w[:, r * cols:(r + 1) * cols].contiguous(), 8 // t)
                 for r in range(t)]
        assert torch.equal(tree_sum(parts), full), t
