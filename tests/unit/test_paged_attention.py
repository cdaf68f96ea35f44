"""The exact attention over a paged KV cache (jetflow.kernels.paged) against the dense kernel
(jetflow.kernels.invariant) on the same values: the same bits for fp32, bf16 and E4M3 pages (E4M3: the
dense kernel fed code * scale, the FP8 fake-quantizer's values), pages in any order, in every build."""

from __future__ import annotations

import pytest
import torch

from jetflow.kernels import invariant as inv
from jetflow.kernels import paged
from jetflow.kernels.cpu_build import VARIANTS
from jetflow.model.attention import apply_rope
from jetflow.precision.kv import fake_quantize_per_tensor, quantize_per_tensor

BUILDS = [v for v in VARIANTS if v != "avx512" or inv.isa("native").startswith("avx512")]
PAGE = paged.PAGE


def _paged_copy(kt, v, dtype, gen, extra_pages=3):
    """Dense kt (B, Hkv, D, S), v (B, Hkv, S, D), S a multiple of 64 -> pages in a shuffled order (plus
    unused pages of noise), the block table, and the pages' dtype."""
    B, Hkv, D, S = kt.shape
    nb = S // PAGE
    n = B * nb + extra_pages
    order = torch.randperm(n, generator=gen)
    table = order[:B * nb].view(B, nb).to(torch.int32).contiguous()
    kp = torch.randn(n, Hkv, D, PAGE, generator=gen).to(dtype)
    vp = torch.randn(n, Hkv, PAGE, D, generator=gen).to(dtype)
    for b in range(B):
        for j in range(nb):
            kp[table[b, j]] = kt[b, :, :, j * PAGE:(j + 1) * PAGE].to(dtype)
            vp[table[b, j]] = v[b, :, j * PAGE:(j + 1) * PAGE].to(dtype)
    return kp, vp, table


@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("B,H,Hkv,T,D,S", [(3, 6, 2, 1, 64, 192), (2, 4, 4, 70, 32, 128), (2, 3, 1, 5, 6, 64)])
def test_paged_attention_equals_dense_attention(variant, dtype, B, H, Hkv, T, D, S):
    gen = torch.Generator().manual_seed(B * 1000 + T * 10 + D)
    q = torch.randn(B, H, T, D, generator=gen)
    kt = torch.randn(B, Hkv, D, S, generator=gen) * 3
    v = torch.randn(B, Hkv, S, D, generator=gen) * 3
    pos = torch.randint(0, S, (B, T), generator=gen)
    pos[0, 0] = 0
    ks_t, vs_t = torch.tensor(0.011), torch.tensor(0.023)  # small: some values saturate at 448 * scale
    ks, vs = (float(ks_t), float(vs_t)) if dtype == torch.float8_e4m3fn else (1.0, 1.0)
    if dtype == torch.float8_e4m3fn:  # the FP8 cache stores codes; the dense kernel reads code * scale
        kt_codes, v_codes = quantize_per_tensor(kt, ks_t), quantize_per_tensor(v, vs_t)
        kt_val, v_val = fake_quantize_per_tensor(kt, ks_t), fake_quantize_per_tensor(v, vs_t)
        assert torch.equal(kt_val, kt_codes.float() * ks_t) and torch.equal(v_val, v_codes.float() * vs_t)
        kp, vp, table = _paged_copy(kt_codes.float(), v_codes.float(), dtype, gen)
    else:
        kt_val, v_val = kt.to(dtype).float(), v.to(dtype).float()
        kp, vp, table = _paged_copy(kt, v, dtype, gen)
    want = inv.attention(q, kt_val, v_val, pos, 0.125, variant)
    got = paged.paged_attention(q, kp, vp, table, pos, 0.125, ks, vs, variant)
    assert torch.equal(got, want)
    if variant != "scalar":
        assert torch.equal(got, paged.paged_attention(q, kp, vp, table, pos, 0.125, ks, vs, "scalar"))


@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("B,H,Hkv,D", [(5, 9, 3, 64), (3, 4, 2, 32), (2, 3, 3, 6)])
def test_paged_decode_step_is_rope_quantize_write_and_attention(variant, dtype, B, H, Hkv, D):
    """The fused decode step on pages: torch's RoPE, the FP8 quantizer's bytes written at the row's slot
    (page table[b, pos // 64]), then the paged attention; the other slots untouched."""
    gen = torch.Generator().manual_seed(B * D + H)
    q, k, v = (torch.randn(B, n, D, generator=gen) * 2 for n in (H, Hkv, Hkv))
    angles = torch.randint(0, 200, (B, 1), generator=gen).float() * torch.rand(D // 2, generator=gen)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()  # (B, D)
    S = 3 * PAGE
    kt = torch.randn(B, Hkv, D, S, generator=gen)
    vd = torch.randn(B, Hkv, S, D, generator=gen)
    ks_t, vs_t = torch.tensor(0.013), torch.tensor(0.007)
    ks, vs = (float(ks_t), float(vs_t)) if dtype == torch.float8_e4m3fn else (1.0, 1.0)
    if dtype == torch.float8_e4m3fn:
        kt, vd = quantize_per_tensor(kt, ks_t).float(), quantize_per_tensor(vd, vs_t).float()
    kp, vp, table = _paged_copy(kt, vd, dtype, gen)
    pos = torch.randint(0, S, (B,), generator=gen)
    pos[0] = 0
    # the reference: torch's RoPE, the quantizer, the write, the paged kernel
    q_rot = apply_rope(q[:, :, None], cos[:, None, None], sin[:, None, None])  # (B, H, 1, D)
    k_rot = apply_rope(k[:, :, None], cos[:, None, None], sin[:, None, None])[:, :, 0]  # (B, H_kv, D)
    kp_ref, vp_ref = kp.clone(), vp.clone()
    pages, slots = table[torch.arange(B), pos // PAGE].long(), pos % PAGE
    if dtype == torch.float8_e4m3fn:
        kp_ref[pages, :, :, slots] = quantize_per_tensor(k_rot, ks_t)
        vp_ref[pages, :, slots] = quantize_per_tensor(v, vs_t)
    else:
        kp_ref[pages, :, :, slots] = k_rot
        vp_ref[pages, :, slots] = v
    want = paged.paged_attention(q_rot, kp_ref, vp_ref, table, pos[:, None], 0.125, ks, vs, variant)[:, :, 0]
    got = paged.decode_attention_paged(q, k, v, cos, sin, pos, kp, vp, table, 0.125, ks, vs, variant)
    assert torch.equal(got, want)
    assert torch.equal(kp.view(torch.uint8), kp_ref.view(torch.uint8))
    assert torch.equal(vp.view(torch.uint8), vp_ref.view(torch.uint8))


def test_paged_attention_refuses_a_short_table_and_bad_page_ids():
    q = torch.randn(1, 2, 1, 8)
    kp, vp = torch.zeros(2, 2, 8, PAGE), torch.zeros(2, 2, PAGE, 8)
    with pytest.raises(ValueError, match="block table"):
        paged.paged_attention(q, kp, vp, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([[PAGE]]), 0.1)
    with pytest.raises(ValueError, match="page ids"):
        paged.paged_attention(q, kp, vp, torch.full((1, 1), 5, dtype=torch.int32), torch.tensor([[3]]), 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_pages_interleaved_as_in_vllms_cache_give_the_bits_of_contiguous_pages(dtype):
    """vLLM's CPU cache (N, H_kv, 64, 2 D): each (block, head) holds K^T (D, 64) then V (64, D), read by the
    kernel in place through strided views (jetflow.rollout.vllm.attention.cache_views' layout)."""
    gen = torch.Generator().manual_seed(7)
    B, H, Hkv, T, D, S = 2, 4, 2, 3, 32, 128
    q = torch.randn(B, H, T, D, generator=gen)
    kp, vp, table = _paged_copy(torch.randn(B, Hkv, D, S, generator=gen), torch.randn(B, Hkv, S, D, generator=gen),
                                dtype, gen)
    n = kp.shape[0]
    vllm_cache = torch.cat([kp.reshape(n, Hkv, 1, D * PAGE), vp.reshape(n, Hkv, 1, PAGE * D)], 2)  # (N, H_kv, 2, 64 D)
    halves = vllm_cache.view(n, Hkv, PAGE, 2 * D).view(n, Hkv, 2, PAGE * D)
    kt_view, v_view = halves[:, :, 0].view(n, Hkv, D, PAGE), halves[:, :, 1].view(n, Hkv, PAGE, D)
    assert not kt_view.is_contiguous() and torch.equal(kt_view.float(), kp.float())
    pos = torch.tensor([[5, 70, 127], [0, 64, 100]])
    assert torch.equal(paged.paged_attention(q, kt_view, v_view, table, pos, 0.125, 0.5, 0.25),
                       paged.paged_attention(q, kp, vp, table, pos, 0.125, 0.5, 0.25))
