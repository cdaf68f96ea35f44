"""The batch-invariant CPU kernels (jetflow.kernels.invariant) against float64 references, their
scalar reference build (bit for bit), the AVX2 build (bit for bit), and their invariance: a row's
result is the same bits whatever M, the tile it falls in, or the other queries in the call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jetflow.kernels import invariant as inv
from jetflow.kernels.cpu_build import _cpu_flags

HAS_AVX2 = " avx2 " in f" {_cpu_flags()} " and " fma " in f" {_cpu_flags()} "
# shapes of SmolLM2 (576 / 1536 / 192), of the tiny model (128 / 384) and odd ones (partial panels)
GEMM_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (128, 128), (384, 128), (37, 130), (5, 3)]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("n,k", GEMM_SHAPES)
def test_gemm_matches_fp64_and_is_row_invariant(n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w, x = torch.randn(n, k, generator=gen), torch.randn(333, k, generator=gen)
    packed = inv.pack_weight(w)
    y = inv.gemm(x, packed, n)  # (333, N)
    assert rel_err(y, x.double() @ w.double().t()) < 1e-5 * max(1.0, k / 256)
    for m in [1, 2, 3, 5, 7, 13, 16, 17, 31, 64, 100]:  # every M, every offset: the same bits
        for off in (0, 9):
            assert torch.equal(inv.gemm(x[off:off + m], packed, n), y[off:off + m]), (m, off)
    # a row placed among other rows (another tile, another position in it)
    other = torch.randn(50, k, generator=gen)
    other[29] = x[3]
    assert torch.equal(inv.gemm(other, packed, n)[29], y[3])


@pytest.mark.parametrize("n,k", GEMM_SHAPES[:4] + GEMM_SHAPES[-2:])
def test_gemm_vector_builds_equal_the_scalar_reference(n, k):
    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(n, k, generator=gen), torch.randn(70, k, generator=gen)
    y = inv.gemm(x, inv.pack_weight(w), n)
    assert torch.equal(y, inv.gemm(x, inv.pack_weight(w, "scalar"), n, "scalar"))
    if HAS_AVX2:
        assert torch.equal(y, inv.gemm(x, inv.pack_weight(w, "avx2"), n, "avx2"))


def test_gemm_threads_do_not_change_results():
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(1536, 576, generator=gen), torch.randn(500, 576, generator=gen)
    packed = inv.pack_weight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = inv.gemm(x, packed, 1536)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, inv.gemm(x, packed, 1536))


def test_matmul_gradients_equal_torch():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 200, generator=gen, requires_grad=True)
    x = torch.randn(3, 7, 200, generator=gen, requires_grad=True)
    g = torch.randn(3, 7, 96, generator=gen)
    (inv.matmul(x, w, inv.pack_weight(w)) * g).sum().backward()
    w2, x2 = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    (F.linear(x2, w2) * g).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)


def _qkv(B, H, Hkv, T, D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=gen), torch.randn(B, Hkv, T, D, generator=gen),
            torch.randn(B, Hkv, T, D, generator=gen))


@pytest.mark.parametrize("H,Hkv,D", [(6, 2, 64), (4, 4, 32), (9, 3, 64), (2, 1, 80)])
def test_attention_matches_fp64_and_decode_equals_prefill(H, Hkv, D):
    B, T, scale = 3, 70, D ** -0.5
    q, k, v = _qkv(B, H, Hkv, T, D)
    pos = torch.arange(T).expand(B, T)
    kt = k.transpose(2, 3).contiguous()
    out = inv.attention(q, kt, v, pos, scale)  # (B, H, T, D)
    ref = inv.reference_attention(q.double(), k.double(), v.double(), pos, scale)
    assert (out.double() - ref).abs().max().item() < 1e-5
    for t in (0, 1, 45, T - 1):  # one query at a time, over the full key range or just its own
        one = inv.attention(q[:, :, t:t + 1].contiguous(), kt, v, pos[:, t:t + 1], scale)
        assert torch.equal(one, out[:, :, t:t + 1]), t
        own = inv.attention(q[:, :, t:t + 1].contiguous(), kt[..., :t + 1], v[:, :, :t + 1], pos[:, t:t + 1], scale)
        assert torch.equal(own, out[:, :, t:t + 1]), t
    # per-row positions: row b's query at its own position, keys past it never read
    rows = torch.tensor([[5], [69], [0]])
    picked = inv.attention(torch.stack([q[b, :, rows[b, 0]] for b in range(B)])[:, :, None].contiguous(),
                           kt, v, rows, scale)
    for b in range(B):
        assert torch.equal(picked[b, :, 0], out[b, :, rows[b, 0]])


def test_attention_vector_builds_equal_the_scalar_reference():
    q, k, v = _qkv(2, 6, 2, 90, 64, seed=5)
    pos = torch.arange(90).expand(2, 90)
    kt = k.transpose(2, 3).contiguous()
    out = inv.attention(q, kt, v, pos, 0.125)
    assert torch.equal(out, inv.attention(q, kt, v, pos, 0.125, "scalar"))
    if HAS_AVX2:
        assert torch.equal(out, inv.attention(q, kt, v, pos, 0.125, "avx2"))


def test_attention_batch_invariance_and_gradients():
    q, k, v = _qkv(4, 4, 2, 33, 32, seed=9)
    pos = torch.arange(33).expand(4, 33)
    kt = k.transpose(2, 3).contiguous()
    full = inv.attention(q, kt, v, pos, 0.2)
    alone = inv.attention(q[2:3], kt[2:3], v[2:3], pos[2:3], 0.2)
    assert torch.equal(alone, full[2:3])
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    (inv.attention(qg, kg.transpose(2, 3).contiguous(), vg, pos, 0.2) ** 2).sum().backward()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    (inv.reference_attention(qr, kr, vr, pos, 0.2) ** 2).sum().backward()
    for a, b in ((qg, qr), (kg, kr), (vg, vr)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_attention_refuses_positions_past_the_keys():
    q, k, v = _qkv(1, 2, 1, 4, 16)
    with pytest.raises(ValueError, match="positions"):
        inv.attention(q, k.transpose(2, 3).contiguous(), v, torch.tensor([[0, 1, 2, 4]]), 0.25)
