"""A decode step's fused exact attention (jetflow.kernels.invariant.decode_attention: RoPE, the KV-cache
write and attention in two kernel calls) against the steps it replaces, run as torch ops and the
attention kernel (`apply_rope`, the cache write, `attention`): the same bits, in every build, and in a
Decoder's cached decoding (the fused path on and off)."""

from __future__ import annotations

import pytest
import torch

from jetflow.kernels import invariant as inv
from jetflow.model import Decoder, ModelConfig
from jetflow.model.attention import Attention, apply_rope

VARIANTS = ("native", "avx2", "scalar")


def _step(B, H, Hkv, D, max_len, seed):
    gen = torch.Generator().manual_seed(seed)
    width = (H + 2 * Hkv) * D + 8  # q, k, v as views of one projection output with padded rows
    qkv = torch.randn(B, width, generator=gen) * 2
    q = qkv[:, :H * D].view(B, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(B, Hkv, D)
    v = qkv[:, (H + Hkv) * D:(H + 2 * Hkv) * D].view(B, Hkv, D)
    angles = torch.randint(0, 200, (B, 1), generator=gen).float() * torch.rand(D // 2, generator=gen)
    emb = torch.cat((angles, angles), -1)  # (B, D)
    kt_cache = torch.randn(B, Hkv, D, max_len, generator=gen)
    v_cache = torch.randn(B, Hkv, max_len, D, generator=gen)
    pos = torch.randint(0, max_len - 3, (B,), generator=gen)
    pos[0] = 0  # a first token: attends to itself only
    return q, k, v, emb.cos(), emb.sin(), pos, kt_cache, v_cache


def _reference(q, k, v, cos, sin, pos, kt_cache, v_cache, end, scale, variant):
    """The unfused steps: torch's RoPE, the cache write, the attention kernel."""
    cos4, sin4 = cos[:, None, None], sin[:, None, None]  # (B, 1, 1, D)
    q_rot = apply_rope(q[:, :, None], cos4, sin4)  # (B, H, 1, D)
    k_rot = apply_rope(k[:, :, None], cos4, sin4)  # (B, H_kv, 1, D)
    rows = torch.arange(q.shape[0])
    kt_cache[rows, :, :, pos] = k_rot[:, :, 0]
    v_cache[rows, :, pos] = v
    out = inv.attention(q_rot, kt_cache[..., :end], v_cache[:, :, :end], pos[:, None], scale, variant)
    return out[:, :, 0]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("B,H,Hkv,D", [(16, 9, 3, 64), (3, 4, 4, 32), (5, 6, 2, 48), (2, 2, 1, 128), (4, 3, 3, 6)])
def test_fused_decode_step_is_rope_cache_write_and_attention(variant, B, H, Hkv, D):
    q, k, v, cos, sin, pos, kt_cache, v_cache = _step(B, H, Hkv, D, max_len=40, seed=B * D + H)
    end = int(pos.max()) + 1 + 2  # slots past every query: never attended
    kt_ref, v_ref = kt_cache.clone(), v_cache.clone()
    want = _reference(q, k, v, cos, sin, pos, kt_ref, v_ref, end, 0.125, variant)
    got = inv.decode_attention(q, k, v, cos, sin, pos, kt_cache, v_cache, end, 0.125, variant)
    assert torch.equal(got, want)
    assert torch.equal(kt_cache, kt_ref) and torch.equal(v_cache, v_ref)  # the same slots written, the rest untouched


def test_fused_decode_step_refuses_bad_input():
    q, k, v, cos, sin, pos, kt_cache, v_cache = _step(2, 4, 2, 32, max_len=8, seed=0)
    with pytest.raises(ValueError, match="positions must lie"):
        inv.decode_attention(q, k, v, cos, sin, pos + 8, kt_cache, v_cache, 8, 0.1)
    with pytest.raises(ValueError, match="shapes"):
        inv.decode_attention(q, k, v, cos, sin, pos, kt_cache[:1], v_cache, 8, 0.1)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_decoder_decoding_is_the_same_with_and_without_the_fused_step(qk_norm, monkeypatch):
    """Cached exact decoding of a tiny GQA Decoder (Qwen3's q/k norms too), rows at different positions:
    hidden states and cache equal with the fused step and with the unfused torch ops."""
    cfg = ModelConfig(vocab_size=50, hidden_size=96, intermediate_size=160, num_layers=2, num_heads=6, num_kv_heads=2,
                      head_dim=16, max_position_embeddings=64, rope_theta=10000.0, qk_norm=qk_norm)
    torch.manual_seed(0)
    model = Decoder(cfg).eval()
    model.numerics = "exact"
    prompts = torch.randint(0, 50, (3, 6))

    def decode(fused: bool):
        if not fused:
            monkeypatch.setattr(Attention, "_fused_decode", lambda *a: False)
        cache = model.new_cache(3, 16)
        with torch.no_grad():
            model.forward_hidden(prompts, cache=cache)
            outs = []
            for step in range(4):  # rows at different positions: row b decodes at 6 + step + b (gaps left)
                pos = torch.tensor([[6 + step], [6 + step + 1], [6 + step + 2]])
                ids = torch.randint(0, 50, (3, 1), generator=torch.Generator().manual_seed(step))
                outs.append(model.forward_hidden(ids, position_ids=pos, cache=cache))
        monkeypatch.undo()
        return torch.stack(outs), cache

    calls = {"n": 0}
    real = inv.decode_attention

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(inv, "decode_attention", counted)
    fused, fused_cache = decode(True)
    assert calls["n"] == 4 * cfg.num_layers  # every decode step of every layer took the fused path
    plain, plain_cache = decode(False)
    assert torch.equal(fused, plain)
    for a, b in zip(fused_cache.k + fused_cache.v, plain_cache.k + plain_cache.v):
        assert torch.equal(a, b)
