"""Continuous batching over the paged KV cache (jetflow.rollout.engine + scheduler), exact numerics on a
tiny random model: a request's tokens and log-probs are the same (torch.equal) whatever it ran beside,
when it was admitted mid-decode, when its pages were reused, when it was preempted and recomputed, with
E4M3 pages (against today's fake-quantized fp32 cache) and against the trainer's full forward."""

from __future__ import annotations

import pytest
import torch

from jetflow.model import Decoder, ModelConfig
from jetflow.model.logprobs import token_logprobs
from jetflow.model.paged_cache import PagePool
from jetflow.precision import apply_precision
from jetflow.precision.kv import BF16KVRounding, KVQuantizer, attach_kv_quantizer
from jetflow.rollout import RolloutEngine, SamplingParams
from jetflow.rollout.sampling import filter_logits

CFG = ModelConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, max_position_embeddings=512, rope_theta=10000.0)
EOS, PAD = 3, 47
PROMPTS = [[5 + (7 * i + j) % 40 for j in range(n)] for i, n in enumerate([60, 9, 70, 33, 5])]
SEEDS = [11, 12, 13, 14, 15]
PARAMS = SamplingParams(max_new_tokens=24, temperature=1.0)
PAGE_BYTES = PagePool.page_bytes(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, torch.float32)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Decoder(CFG).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    apply_precision(m, "fp32", numerics="exact")
    m.numerics = "exact"
    return m


def _engine(model, **kw):
    return RolloutEngine(model, eos_token_ids=[EOS], pad_token_id=PAD, max_seq_len=128, **kw)


def _alone(model, params):
    """Each request generated alone in a roomy engine: the reference."""
    eng = _engine(model, max_batch=1)
    outs = [eng.generate([p], params, seeds=[s]) for p, s in zip(PROMPTS, SEEDS)]
    return [o.token_ids[0] for o in outs], [o.logprobs[0] for o in outs]


@pytest.fixture(scope="module")
def alone(model):
    ref = _alone(model, PARAMS)
    assert len({len(t) for t in ref[0]}) > 1  # the requests finish at different steps
    return ref


def _assert_same(out, alone):
    tokens, logprobs = alone
    assert out.token_ids == tokens
    for got, want in zip(out.logprobs, logprobs):
        assert torch.equal(torch.tensor(got), torch.tensor(want))


def test_requests_admitted_mid_decode_equal_alone(model, alone):
    out = _engine(model, max_batch=2).generate(PROMPTS, PARAMS, seeds=SEEDS)
    _assert_same(out, alone)
    assert out.stats["prefills"] >= 4 and out.stats["preemptions"] == 0  # admitted as rows freed up


def test_static_batches_equal_alone(model, alone):
    _assert_same(_engine(model, max_batch=2, continuous=False).generate(PROMPTS, PARAMS, seeds=SEEDS), alone)


def test_pages_freed_and_reused_under_a_small_budget(model, alone):
    """5 pages (+ the null page): not every request's pages fit at once; finished requests' pages serve
    the waiting ones."""
    eng = _engine(model, max_batch=4, kv_cache_bytes=6 * PAGE_BYTES)
    out = eng.generate(PROMPTS, PARAMS, seeds=SEEDS)
    _assert_same(out, alone)
    assert eng.pool.num_pages == 5 and eng.pool.peak_held <= 5
    assert eng.memory_stats()["kv_cache_bytes"] == eng.pool.peak_held * PAGE_BYTES
    assert eng.pool.free_pages == 5  # every page back in the pool


def test_preempted_request_is_recomputed_with_the_same_tokens(model):
    """3 pages: the two long prompts (60 and 70 positions, 24 new tokens each) cannot both grow; the
    youngest is preempted, its pages freed, and it is recomputed later from its prompt with its sampler
    restarted."""
    params = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True)
    ref = _alone(model, params)
    eng = _engine(model, max_batch=2, kv_cache_bytes=4 * PAGE_BYTES)
    order = [0, 2, 1, 3, 4]  # the long ones first, side by side
    out = eng.generate([PROMPTS[i] for i in order], params, seeds=[SEEDS[i] for i in order])
    assert out.stats["preemptions"] >= 1
    _assert_same(out, ([ref[0][i] for i in order], [ref[1][i] for i in order]))


def test_a_request_that_cannot_fit_the_pool_is_refused_before_any_work(model):
    eng = _engine(model, max_batch=2, kv_cache_bytes=2 * PAGE_BYTES)  # one page
    with pytest.raises(ValueError, match="KV pages"):
        eng.generate([PROMPTS[0]], PARAMS, seeds=[1])


def _fp8_model(model):
    q = KVQuantizer(CFG.num_layers)
    q.k_amax[:] = torch.tensor([3.0, 2.0])  # small enough that some values saturate
    q.v_amax[:] = torch.tensor([0.5, 0.7])
    q.recalibrate()
    attach_kv_quantizer(model, q)
    return q


def _assert_equal_to_the_full_forward(model, out) -> None:
    """The engine's log-probs equal the trainer's: one full forward per sequence, no cache, bit for bit."""
    with torch.inference_mode():
        for p, toks, lps in zip(PROMPTS, out.token_ids, out.logprobs):
            logits = model(torch.tensor([p + toks]))[0, len(p) - 1:-1]  # (N, V)
            scores = filter_logits(logits, PARAMS.temperature, PARAMS.top_k, PARAMS.top_p)
            assert torch.equal(token_logprobs(scores, torch.tensor(toks)), torch.tensor(lps))


def test_fp8_pages_equal_the_fake_quantized_fp32_cache_and_the_full_forward(model):
    _fp8_model(model)
    try:
        fp8 = _engine(model, max_batch=2)
        ref = _engine(model, max_batch=2, fp8_pages=False)  # fp32 pages holding the rounded values (today's)
        out = fp8.generate(PROMPTS, PARAMS, seeds=SEEDS)
        want = ref.generate(PROMPTS, PARAMS, seeds=SEEDS)
        assert fp8.memory_stats()["kv_page_dtype"] == "float8_e4m3fn"
        assert fp8.memory_stats()["kv_bytes_per_token"] * 4 == ref.memory_stats()["kv_bytes_per_token"]
        _assert_same(out, (want.token_ids, want.logprobs))
        _assert_equal_to_the_full_forward(model, out)
    finally:
        attach_kv_quantizer(model, None)


def test_bf16_pages_hold_the_bf16_modes_kv_and_equal_the_trainers_full_forward(model):
    """The bf16 mode's K/V rounding (jetflow.run.build.kv_rounding): the engine's pages are bf16, half of fp32's
    bytes, and its log-probs equal the full forward's with the same rounding in its attention (the trainer's),
    bit for bit; the rounding changes the numbers (the fp32 cache's log-probs differ)."""
    fp32 = _engine(model, max_batch=2).generate(PROMPTS, PARAMS, seeds=SEEDS)
    attach_kv_quantizer(model, BF16KVRounding())
    try:
        eng = _engine(model, max_batch=2)
        out = eng.generate(PROMPTS, PARAMS, seeds=SEEDS)
        stats = eng.memory_stats()
        assert stats["kv_page_dtype"] == "bfloat16" and stats["kv_bytes_per_token"] * 2 == PAGE_BYTES // 64
        assert out.logprobs != fp32.logprobs
        _assert_equal_to_the_full_forward(model, out)
    finally:
        attach_kv_quantizer(model, None)


def test_per_request_length_caps(model):
    """`max_new_tokens` per request: each stops at its own cap, its tokens a prefix of the uncapped run."""
    params = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True)
    eng = _engine(model, max_batch=2)
    full = eng.generate(PROMPTS[:3], params, seeds=SEEDS[:3])
    out = eng.generate(PROMPTS[:3], params, seeds=SEEDS[:3], max_new_tokens=[3, 10, 1])
    assert [len(t) for t in out.token_ids] == [3, 10, 1] and out.finish_reasons == ["length"] * 3
    assert all(t == f[:len(t)] for t, f in zip(out.token_ids, full.token_ids))
    with pytest.raises(ValueError, match="one value in"):
        eng.generate(PROMPTS[:1], params, seeds=[1], max_new_tokens=[11])
