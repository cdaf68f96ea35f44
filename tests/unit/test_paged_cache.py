"""The paged KV cache (jetflow.model.paged_cache) in a Decoder's cached decoding: under exact numerics the
same hidden states, bit for bit, as the dense KVCache and as the full forward without a cache (the
trainer's), for fp32 pages and for E4M3 pages holding the FP8 K/V quantizer's codes (against today's
fake-quantized fp32 cache), fused decode step on and off; the pool's accounting."""

from __future__ import annotations

import pytest
import torch

from jetflow.model import Decoder, ModelConfig
from jetflow.model import paged_attention
from jetflow.model.paged_cache import PagePool
from jetflow.precision import apply_precision
from jetflow.precision.kv import KVQuantizer, attach_kv_quantizer

CFG = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=160, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=16, max_position_embeddings=256, rope_theta=10000.0)
B, P, STEPS = 3, 70, 4  # the prompt crosses a page boundary


def _model(numerics: str, fp8: bool) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(CFG).eval()
    if numerics == "exact":
        apply_precision(model, "fp32", numerics="exact")  # the batch-invariant linears
    model.numerics = numerics
    if fp8:
        q = KVQuantizer(CFG.num_layers)
        q.k_amax[:] = torch.tensor([2.5, 3.0])  # small: some K/V values saturate
        q.v_amax[:] = torch.tensor([1.0, 0.5])
        q.recalibrate()
        attach_kv_quantizer(model, q)
    return model


def _inputs():
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (B, P), generator=gen)
    steps = torch.randint(0, 64, (STEPS, B, 1), generator=gen)
    return prompt, steps


def _decode(model, cache):
    """Prefill, then STEPS decode steps with rows at different positions (row b at P + step + 2b: gaps)."""
    prompt, steps = _inputs()
    outs = []
    with torch.inference_mode():
        outs.append(model.forward_hidden(prompt, position_ids=torch.arange(P).expand(B, P), cache=cache))
        for s in range(STEPS):
            pos = torch.tensor([[P + s + 2 * b] for b in range(B)])
            outs.append(model.forward_hidden(steps[s], position_ids=pos, cache=cache))
    return outs


def _paged(model, dtype, shuffle=True):
    pool = PagePool(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, num_pages=12, dtype=dtype,
                    exact=model.numerics == "exact")
    pages = pool.alloc(3 * B)
    if shuffle:
        pages = pages[::-1]
    table = torch.tensor(pages, dtype=torch.int32).view(B, 3)
    return pool, pool.view(table)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_paged_decoding_equals_dense_cache_and_full_forward(fp8, fused, monkeypatch):
    model = _model("exact", fp8)
    want = _decode(model, model.new_cache(B, 3 * 64))  # today's dense cache (fake-quantized fp32 under FP8)
    if not fused:
        monkeypatch.setattr(paged_attention, "_fused", lambda *a: False)
    calls = {"n": 0}
    real = paged_attention.paged.decode_attention_paged

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)
    monkeypatch.setattr(paged_attention.paged, "decode_attention_paged", counted)
    pool, cache = _paged(model, torch.float8_e4m3fn if fp8 else torch.float32)
    got = _decode(model, cache)
    assert calls["n"] == (STEPS * CFG.num_layers if fused else 0)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # the trainer's full forward over row 0's sequence (its decode positions are contiguous)
    prompt, steps = _inputs()
    seq = torch.cat([prompt[:1], steps[:, 0].T], 1)  # (1, P + STEPS)
    with torch.inference_mode():
        full = model.forward_hidden(seq)
    assert torch.equal(full[0, :P], got[0][0])
    for s in range(STEPS):
        assert torch.equal(full[0, P + s], got[1 + s][0, 0])


def test_fp8_pages_hold_one_byte_a_value_and_refuse_an_uncalibrated_quantizer():
    model = _model("exact", fp8=False)
    fp32 = PagePool.page_bytes(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, torch.float32)
    fp8 = PagePool.page_bytes(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, torch.float8_e4m3fn)
    assert fp32 == 4 * fp8 == 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 64 * 4
    pool, cache = _paged(model, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="calibrated FP8"):
        _decode(model, cache)


def test_fast_numerics_paged_is_the_dense_cache_within_fp32_noise():
    model = _model("fast", fp8=False)
    want = _decode(model, model.new_cache(B, 3 * 64))
    got = _decode(model, _paged(model, torch.float32)[1])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_pool_alloc_free_and_budget():
    per_page = PagePool.page_bytes(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, torch.float32)
    pool = PagePool.for_budget(CFG, 5 * per_page + 7, torch.float32, exact=True)
    assert pool.num_pages == 4 and pool.free_pages == 4  # one page of the budget is the null page
    a = pool.alloc(3)
    assert a == [0, 1, 2] and pool.alloc(2) is None and pool.held_pages == 3
    pool.k[0, a[0]] = 1.0
    pool.free(a)
    b = pool.alloc(4)
    assert sorted(b) == [0, 1, 2, 3] and pool.peak_held == 4
    assert pool.k[0, 0].abs().sum() == 0  # zeroed when allocated
    with pytest.raises(ValueError, match="at least one page"):
        PagePool.for_budget(CFG, per_page, torch.float32, exact=True)
