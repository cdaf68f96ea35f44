"""jetflow's Decoder against Hugging Face transformers (the independent reference), in fp32.

Tiny random Llama (Llama 3 RoPE scaling), Qwen2 (q/k/v biases) and Qwen3 (q/k norms) models, tied
and untied, are saved with `save_pretrained` and loaded with `jetflow.model.load`. Checked: logits
of a plain batch, of a left-padded batch (row by row against HF on the unpadded rows), and that
decoding with the KV cache reproduces a full forward.
"""

import copy

import pytest
import torch
import torch.nn as nn

import jetflow.model as jm
from jetflow.model import Decoder, KVCache

CASES = [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True)]
IDS = [f"{f}-{'tied' if t else 'untied'}" for f, t in CASES]
TOL_HF = 1e-4  # fp32, jetflow vs transformers
TOL_CACHE = 1e-5  # fp32, jetflow with cache vs jetflow without


@pytest.fixture(params=CASES, ids=IDS)
def pair(request, make_tiny_hf):
    family, tied = request.param
    hf, path = make_tiny_hf(family, tied)
    return hf, jm.load(path)


def left_padded(lengths, vocab=100, seed=1):
    """Random rows of the given lengths, left-padded (pad id 0) to the longest: ids, mask, rows."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    T = max(lengths)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = r
        mask[b, T - len(r):] = True
    return ids, mask, rows


@torch.no_grad()
def test_state_dict_keys_mirror_hf(pair):
    hf, model = pair
    assert set(model.state_dict()) == set(hf.state_dict())
    for k, v in hf.state_dict().items():
        assert model.state_dict()[k].shape == v.shape, k
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


@torch.no_grad()
def test_logits_match_hf(pair):
    hf, model = pair
    ids = torch.randint(0, 100, (3, 20), generator=torch.Generator().manual_seed(0))
    ref = hf(ids).logits
    out = model(ids)
    assert out.shape == (3, 20, 100)
    assert (out - ref).abs().max().item() <= TOL_HF


@torch.no_grad()
def test_left_padded_batch_matches_hf_rows(pair):
    hf, model = pair
    ids, mask, rows = left_padded([13, 6, 1, 9])
    out = model(ids, attention_mask=mask)  # (B, T, V)
    assert torch.isfinite(out).all(), "padding rows must not produce NaN"
    for b, r in enumerate(rows):
        ref = hf(r[None]).logits[0]  # (n, V), the row alone, no padding
        assert (out[b, ids.shape[1] - len(r):] - ref).abs().max().item() <= TOL_HF, f"row {b}"


@torch.no_grad()
def test_kv_cache_decode_matches_full_forward(pair):
    _, model = pair
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    full = model(ids)
    cache = model.new_cache(batch_size=2, max_len=16)
    parts = [model(ids[:, :5], cache=cache)]  # prefill (is_causal path)
    assert cache.length == 5
    parts.append(model(ids[:, 5:9], cache=cache))  # a chunk on top of a filled cache (explicit mask)
    for t in range(9, 16):  # token by token
        parts.append(model(ids[:, t:t + 1], cache=cache))
    assert cache.length == 16
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= TOL_CACHE


@torch.no_grad()
def test_kv_cache_left_padded_decode(pair):
    """Left-padded prompts, prefill then one token at a time with a growing mask, equal the full
    padded forward, and the real tokens equal HF on each unpadded row."""
    hf, model = pair
    ids, mask, rows = left_padded([11, 4, 8], seed=3)
    new = torch.randint(1, 100, (3, 6), generator=torch.Generator().manual_seed(4))
    all_ids = torch.cat([ids, new], dim=1)
    all_mask = torch.cat([mask, torch.ones_like(new, dtype=torch.bool)], dim=1)
    full = model(all_ids, attention_mask=all_mask)

    cache = KVCache.for_model(model.config, batch_size=3, max_len=32, dtype=torch.float32, device="cpu")
    T0 = ids.shape[1]
    parts = [model(ids, attention_mask=mask, cache=cache)]
    for t in range(new.shape[1]):
        parts.append(model(new[:, t:t + 1], attention_mask=all_mask[:, :T0 + t + 1], cache=cache))
    got = torch.cat(parts, dim=1)
    real = all_mask  # compare only real tokens: padded slots are meaningless by design
    assert (got - full)[real].abs().max().item() <= TOL_CACHE
    for b, r in enumerate(rows):
        ref = hf(torch.cat([r, new[b]])[None]).logits[0]
        assert (got[b, T0 - len(r):] - ref).abs().max().item() <= TOL_HF, f"row {b}"


@torch.no_grad()
def test_explicit_position_ids_and_mask_default(make_tiny_hf):
    _, path = make_tiny_hf("llama")
    model = jm.load(path)
    ids, mask, _ = left_padded([7, 3])
    derived = model(ids, attention_mask=mask)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    assert torch.equal(model(ids, position_ids=pos, attention_mask=mask), derived)
    # all-true mask == no mask (and the default positions are arange)
    ids2 = ids[:, :5]
    assert torch.allclose(model(ids2, attention_mask=torch.ones_like(ids2, dtype=torch.bool)), model(ids2), atol=1e-6)
    assert torch.equal(model(ids2, position_ids=torch.arange(5).expand(2, 5)), model(ids2))


def test_every_linear_is_called_as_a_module(make_tiny_hf):
    """The precision converter swaps nn.Linear modules by name; each must be called in forward."""
    _, path = make_tiny_hf("qwen3")
    model = jm.load(path)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert len(names) == 2 * 7 + 1
    called = set()
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, inp, out, n=n: called.add(n))
    model(torch.tensor([[1, 2, 3]]))
    assert called == set(names)
    # and a swapped module takes effect
    before = model(torch.tensor([[1, 2, 3]]))
    model.model.layers[1].mlp.down_proj = _Zero(model.model.layers[1].mlp.down_proj)
    assert not torch.allclose(model(torch.tensor([[1, 2, 3]])), before)


class _Zero(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.out = lin.out_features

    def forward(self, x):
        return x.new_zeros(*x.shape[:-1], self.out)


def test_kv_cache_bounds_and_reset():
    cfg = jm.ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8)
    model = Decoder(cfg).eval()
    cache = model.new_cache(batch_size=1, max_len=6)
    assert cache.k[0].shape == (1, 2, 6, 8)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]]), cache=cache)
        model(torch.tensor([[5, 6]]), cache=cache)
        assert cache.length == 6
        with pytest.raises(RuntimeError, match="KVCache overflow"):
            model(torch.tensor([[7]]), cache=cache)
        assert cache.length == 6  # a refused write leaves the cache as it was
        cache.reset()
        assert cache.length == 0
        model(torch.tensor([[1]]), cache=cache)
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.tensor([[1, 2]]), attention_mask=torch.ones(1, 3, dtype=torch.bool))


@torch.no_grad()
def test_bf16_close_to_hf_bf16(make_tiny_hf):
    hf, path = make_tiny_hf("qwen2")
    model = jm.load(path, dtype=torch.bfloat16)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(5))
    ref = copy.deepcopy(hf).to(torch.bfloat16)(ids).logits.float()  # a copy: hf is shared by other tests
    out = model(ids).float()
    assert (out - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
