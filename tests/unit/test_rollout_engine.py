"""RolloutEngine on a tiny random Decoder, against plain full forwards without a KV cache.

The reference for every check is the model itself run the simplest way: one request at a time, the
whole sequence in one forward, no cache, no padding, no mask."""

from __future__ import annotations

import copy

import pytest
import torch

from jetflow.model import CharTokenizer, Decoder, ModelConfig
from jetflow.precision import QuantRecipe, apply_precision
from jetflow.rollout import RolloutEngine, SamplingParams
from jetflow.rollout.sampling import filter_logits

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,?!"  # CharTokenizer: 3 specials + 31 characters = vocab 34
TOK = CharTokenizer(ALPHABET)
EOS, PAD = TOK.eos_token_id, TOK.pad_token_id
PROMPTS = [[5, 9, 14, 3], [7] * 11, [20, 21, 4, 30, 8, 8, 6], [11], [12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny GEMMs gain nothing from threads, and on a loaded shared machine a 2-thread OpenMP GEMM
    can wait milliseconds at every barrier: run this module single-threaded."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model() -> Decoder:
    # hidden 192 = 1.5 FP8 groups of 128: partial blocks are exercised under fp8
    cfg = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=192, intermediate_size=320, num_layers=2, num_heads=6,
                      num_kv_heads=2, head_dim=32, max_position_embeddings=256, rope_theta=10000.0)
    torch.manual_seed(0)
    m = Decoder(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norms != 1
    return m


def engine(model, max_batch=8, max_seq_len=64, **kw) -> RolloutEngine:
    kw.setdefault("eos_token_ids", [EOS])
    return RolloutEngine(model, pad_token_id=PAD, max_batch=max_batch, max_seq_len=max_seq_len, **kw)


@torch.no_grad()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    """(T, V) fp32 logits of one unpadded sequence, one forward, no cache."""
    return model(torch.tensor([ids]))[0].float()


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        t = int(full_logits(model, ids)[-1].argmax())
        ids.append(t)
        if t in eos:
            break
    return ids[len(prompt):]


def test_greedy_matches_full_forward_loop(model):
    """Different prompt lengths (right padding), more prompts than max_batch (waiting requests admitted
    as rows free up, or in static batches), and requests that stop on EOS at different steps."""
    n = 12
    free = [reference_greedy(model, p, n, set()) for p in PROMPTS]
    eos = free[0][3]  # a token that ends request 0 early, and others wherever it occurs
    refs = [reference_greedy(model, p, n, {eos}) for p in PROMPTS]
    assert len({len(r) for r in refs}) > 1  # requests finish at different steps
    for continuous in (True, False):
        eng = engine(model, max_batch=3, eos_token_ids=[eos], continuous=continuous)
        out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=n, temperature=0.0))
        assert out.token_ids == refs
        assert out.prompt_ids == PROMPTS
        assert out.finish_reasons == ["eos" if r[-1] == eos else "length" for r in refs]
        assert out.stats["prefills"] > (1 if continuous else 0) + len(PROMPTS) // 3
        for p, toks, lps in zip(PROMPTS, out.token_ids, out.logprobs):  # greedy: log_softmax(logits)
            ref = torch.log_softmax(full_logits(model, p + toks)[len(p) - 1:-1], -1)
            ref = ref[torch.arange(len(toks)), torch.tensor(toks)]
            torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-5, rtol=0)


def _max_logprob_diff(model, params: SamplingParams, seeds=None) -> float:
    eng = engine(model, max_batch=8, eos_token_ids=[])
    out = eng.generate(PROMPTS, params, seeds=seeds or list(range(len(PROMPTS))))
    worst = 0.0
    for p, toks, lps in zip(PROMPTS, out.token_ids, out.logprobs):
        assert len(toks) == params.max_new_tokens
        logits = full_logits(model, p + toks)[len(p) - 1:-1]  # (N, V): the logits each token was drawn from
        scores = filter_logits(logits, params.temperature, params.top_k, params.top_p)
        ref = torch.log_softmax(scores, -1)[torch.arange(len(toks)), torch.tensor(toks)]
        assert torch.isfinite(ref).all()  # every sampled token survived the filters of the full forward
        worst = max(worst, (torch.tensor(lps) - ref).abs().max().item())
    return worst


def test_cache_logprobs_match_full_forward_fp32(model):
    for params in (SamplingParams(max_new_tokens=20, temperature=1.0),
                   SamplingParams(max_new_tokens=20, temperature=0.8, top_k=10, top_p=0.9)):
        diff = _max_logprob_diff(model, params)
        print(f"fp32 {params}: max |cache - full| logprob = {diff:.3g}")
        assert diff <= 1e-5


@pytest.mark.parametrize("kind,bound", [("bf16", 0.02), ("fp8", 0.02)])
def test_cache_logprobs_match_full_forward_low_precision(model, kind, bound):
    """Under bf16 / the FP8 recipe the decode step (M = B rows) and the full forward (M = T rows)
    round different GEMM outputs, so they agree only loosely; the bound catches a real mismatch (a
    wrong position or mask shifts logprobs by O(1))."""
    m = apply_precision(copy.deepcopy(model), kind, QuantRecipe() if kind == "fp8" else None)
    shift = (full_logits(m, PROMPTS[1]) - full_logits(model, PROMPTS[1])).abs().max().item()
    assert shift > 1e-3  # the precision really changed the model
    diff = _max_logprob_diff(m, SamplingParams(max_new_tokens=20, temperature=1.0))
    print(f"{kind}: max |cache - full| logprob = {diff:.3g} (logit shift vs fp32 {shift:.3g})")
    assert diff <= bound


def test_seeded_request_reproduces_alone_and_in_any_batch(model):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95)
    eng = engine(model, max_batch=4, eos_token_ids=[])
    alone = eng.generate([PROMPTS[2]], params, seeds=[1234])
    batch = eng.generate(PROMPTS, params, seeds=[1, 2, 1234, 3, 4])  # two chunks, different padding
    assert batch.token_ids[2] == alone.token_ids[0]
    torch.testing.assert_close(torch.tensor(batch.logprobs[2]), torch.tensor(alone.logprobs[0]), atol=1e-5, rtol=0)
    other = eng.generate([PROMPTS[2]], params, seeds=[1235])
    assert other.token_ids[0] != alone.token_ids[0]


def test_stops_on_eos_stop_string_and_length(model):
    free = reference_greedy(model, PROMPTS[0], 30, set())
    greedy = dict(temperature=0.0)
    # EOS: the token generated at step 4 is declared EOS -> stops there, EOS included in token_ids
    out = engine(model, eos_token_ids=[free[4]], tokenizer=TOK).generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=30, **greedy))
    k = free.index(free[4])
    assert out.finish_reasons == ["eos"] and out.token_ids[0] == free[:k + 1]
    # stop string: two characters of the greedy text; generation stops on the token that completes
    # its first occurrence (text = decoded without special tokens) and the text ends before it
    plain = TOK.decode(free, skip_special_tokens=True)
    s = plain[5:7]
    k = next(k for k in range(1, 31) if s in TOK.decode(free[:k], skip_special_tokens=True))
    out = engine(model, eos_token_ids=[], tokenizer=TOK).generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=30, stop=("zzzz", s), **greedy))
    assert out.finish_reasons == ["stop"]
    assert out.token_ids[0] == free[:k]
    assert out.texts == [plain[:plain.index(s)]]
    # length
    out = engine(model, eos_token_ids=[], tokenizer=TOK).generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=5, **greedy))
    assert out.finish_reasons == ["length"] and out.token_ids[0] == free[:5]
    assert out.texts == [TOK.decode(free[:5], skip_special_tokens=True)]
    # ignore_eos runs to the length even through an EOS
    out = engine(model, eos_token_ids=[free[4]]).generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=10, ignore_eos=True, **greedy))
    assert out.finish_reasons == ["length"] and out.token_ids[0] == free[:10]
    with pytest.raises(ValueError, match="tokenizer"):
        engine(model).generate([PROMPTS[0]], SamplingParams(stop=("x",)))


def test_over_long_request_is_an_error_naming_the_limit(model):
    eng = engine(model, max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        eng.generate([[5] * 10], SamplingParams(max_new_tokens=7))
    out = eng.generate([[5] * 10], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids[0]) == 6  # exactly at the limit is fine


def test_weight_version_is_returned(model):
    eng = engine(model)
    assert eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2)).weight_version == 0
    eng.weight_version = 7
    assert eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2)).weight_version == 7


def test_memory_stats(model):
    eng = engine(model, max_batch=4, max_seq_len=32)
    c = model.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # K and V, fp32, every layer
    mem = eng.memory_stats()
    assert mem["kv_cache_bytes"] == 0 and mem["kv_bytes_per_token"] == per_token
    assert mem["kv_pool_bytes"] == (4 + 1) * 64 * per_token  # 4 requests of one page, and the null page
    eng.generate([PROMPTS[0], PROMPTS[1]], SamplingParams(max_new_tokens=3))
    mem = eng.memory_stats()
    assert mem["kv_cache_bytes"] == 2 * 64 * per_token  # the peak of pages held: one per request
    assert mem["model_bytes"] == sum(p.numel() * 4 for p in model.parameters()) + model.rope_inv_freq.numel() * 4
    assert eng.peak_memory_bytes >= mem["kv_cache_bytes"] + mem["model_bytes"]


def test_weights_updated_in_place_are_used(model):
    """The engine caches packed copies of the fp32 linear weights; an in-place update (as the trainer
    -> rollout sync does it) must reach the next generate call."""
    m = copy.deepcopy(model)
    eng = engine(m, eos_token_ids=[])
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = eng.generate(PROMPTS[:2], params)
    assert before.token_ids == [reference_greedy(m, p, 8, set()) for p in PROMPTS[:2]]
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p + 0.5 * torch.randn(p.shape, generator=g))
    eng.weight_version = 1
    after = eng.generate(PROMPTS[:2], params)
    assert after.token_ids == [reference_greedy(m, p, 8, set()) for p in PROMPTS[:2]]
    assert after.token_ids != before.token_ids


def test_prepacked_linears_are_the_model_within_fp32_noise(model):
    """On the CPU the fp32 linears run on oneDNN-prepacked weights during generate: the same
    sampled tokens and log-probs as the plain modules (<= 1e-5), every linear packed, and the
    model's own forwards back in place afterwards."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    packed_eng, plain_eng = engine(model), engine(model, pack_linears=False)
    packed = packed_eng.generate(PROMPTS, params, seeds=list(range(len(PROMPTS))))
    plain = plain_eng.generate(PROMPTS, params, seeds=list(range(len(PROMPTS))))
    assert packed.token_ids == plain.token_ids
    diff = max((torch.tensor(a) - torch.tensor(b)).abs().max().item() for a, b in zip(packed.logprobs, plain.logprobs))
    assert diff <= 1e-5
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert packed_eng.memory_stats()["packed_weight_bytes"] == sum(m.weight.numel() * 4 for m in linears)
    assert plain_eng.memory_stats()["packed_weight_bytes"] == 0
    assert not any("forward" in m.__dict__ for m in linears)


def test_only_fp32_linears_are_packed(model):
    m = apply_precision(copy.deepcopy(model), "bf16", None)
    m.model.layers[0].mlp.down_proj.kind = "fp32"  # a PrecisionLinear computing in fp32 is packed too
    eng = engine(m)
    eng.generate(PROMPTS[:2], SamplingParams(max_new_tokens=3))
    kept_fp32 = [x for x in m.modules() if isinstance(x, torch.nn.Linear) and getattr(x, "kind", "fp32") == "fp32"]
    assert kept_fp32 == [m.model.layers[0].mlp.down_proj]
    assert eng.memory_stats()["packed_weight_bytes"] == sum(x.weight.numel() * 4 for x in kept_fp32)
