"""The user's own files misbehaving (issue 44): a damaged tokenizer, config or chat template in the model
directory, a prompt past the model's positions, a character the tokenizer lacks. Each: one line that
names the file (or the prompt), exit code 2, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from jetflow.cli import main
from jetflow.model import CharTokenizer, Decoder, ModelConfig, save_hf_dir
from jetflow.model.tokenizer import TokenizerError, load_tokenizer


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jetflow: error: "), err
    return err.strip()


def copy_model(src: Path, dst: Path) -> Path:
    """The model directory's small files copied (they get damaged), its weights linked."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        else:
            shutil.copy2(f, dst / f.name)
    return dst


@pytest.fixture
def char_model(tmp_path) -> Path:
    """A tiny model with a CharTokenizer of the plain arithmetic alphabet, 32 positions."""
    torch.manual_seed(0)
    alphabet = "0123456789+-*= \n"
    model = Decoder(ModelConfig(model_type="llama", vocab_size=3 + len(alphabet), hidden_size=16,
                                intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                                max_position_embeddings=32))
    d = save_hf_dir(model, tmp_path / "tiny")
    CharTokenizer(alphabet).save(d)
    return d


def test_a_character_the_tokenizer_lacks_is_one_line_naming_it(char_model, capsys):
    """Before: a ValueError traceback from the character tokenizer."""
    assert main(["generate", "--model", str(char_model), "--max-new-tokens", "2", "1+2=", "3+é="]) == 2
    line = one_error_line(capsys)
    assert "TokenizerError: prompt 1: character 'é' (U+00E9, at position 2 of the text) is not in the CharTokenizer " \
        f"alphabet of {char_model / 'char_tokenizer.json'}; it knows only" in line
    assert main(["generate", "--model", str(char_model), "--max-new-tokens", "2", "1+2="]) == 0


def test_a_prompt_past_the_models_positions_is_refused_with_the_counts(char_model, capsys):
    """Before: exit 0, tokens generated at positions the model never saw, no warning."""
    assert main(["generate", "--model", str(char_model), "--max-new-tokens", "8", "1+2=" * 7]) == 2
    assert one_error_line(capsys).endswith(
        "UsageError: prompt 0 is 28 tokens and --max-new-tokens 8 needs room for 8 more (36 positions), but the "
        "model has 32 positions (max_position_embeddings); lower --max-new-tokens to 4 or shorten the prompt")
    assert main(["generate", "--model", str(char_model), "--max-new-tokens", "8", "1+2=" * 9]) == 2
    assert one_error_line(capsys).endswith("shorten the prompt to at most 24 tokens")
    assert main(["generate", "--model", str(char_model), "--max-new-tokens", "4", "1+2=" * 7]) == 0


def test_a_prompt_past_smollm2s_8192_positions_is_refused(smollm2_dir, capsys):
    prompt = "one two three four " * 2100  # about 8400 tokens
    n = len(load_tokenizer(smollm2_dir).encode(load_tokenizer(smollm2_dir).apply_chat_template(
        [{"role": "user", "content": prompt}])))
    assert n > 8192
    assert main(["generate", "--model", str(smollm2_dir), prompt]) == 2
    assert one_error_line(capsys).endswith(
        f"prompt 0 is {n} tokens and --max-new-tokens 64 needs room for 64 more ({n + 64} positions), but the model "
        f"has 8192 positions (max_position_embeddings); shorten the prompt to at most 8128 tokens")


@pytest.mark.parametrize("name, text, expected", [
    ("tokenizer.json", '{"version": "1.0", "truncation": null, "model": {"type": "BPE", "vo',
     r"cannot read {d}/tokenizer.json: EOF while parsing .*; restore it from the model's source"),
    ("tokenizer_config.json", '{"eos_token": "<|im_end|>",,}',
     r"cannot parse {d}/tokenizer_config.json: Expecting property name .*; restore it"),
    ("chat_template.jinja", "{% for m in messages %}{{ m['content'] }",
     r"the chat template in {d}/chat_template.jinja is not valid Jinja: .* at line 1; restore it"),
    ("config.json", '{"model_type": "llama", "hidden_size": 576',
     r"cannot parse {d}/config.json: Expecting ',' delimiter: line 1 column 43 .*; restore it"),
    ("config.json", '{"model_type": "llama", "vocab_size": 49152}',
     r"{d}/config.json has no 'num_attention_heads', which the model needs; restore the file"),
])
def test_a_damaged_file_in_the_users_model_directory_is_one_line_naming_it(smollm2_dir, tmp_path, capsys, name, text,
                                                                           expected):
    """Before (tokenizer.json): a traceback ending in `Exception: EOF while parsing a string at line 1
    column 25`, naming no file. `jetflow generate` and `jetflow train` both read the files."""
    import re
    d = copy_model(smollm2_dir, tmp_path / "m")
    (d / name).write_text(text)
    assert main(["generate", "--model", str(d), "hi"]) == 2
    assert re.search(expected.format(d=re.escape(str(d))), one_error_line(capsys))
    assert main(["train", f"model.path={d}", "train.steps=1", f"run.out_dir={tmp_path}/runs"]) == 2
    assert re.search(expected.format(d=re.escape(str(d))), one_error_line(capsys))
    assert not (tmp_path / "runs").exists()  # refused before the run directory was made


def test_a_damaged_char_tokenizer_file_is_one_line(char_model):
    (char_model / "char_tokenizer.json").write_text('{"type": "char", "alphabet": 12}')
    with pytest.raises(TokenizerError, match=r"char_tokenizer.json is not a CharTokenizer file"):
        load_tokenizer(char_model)
    (char_model / "char_tokenizer.json").write_bytes(b"\xff\xfe garbage")
    with pytest.raises(TokenizerError, match=r"cannot parse .*char_tokenizer.json"):
        load_tokenizer(char_model)
    (char_model / "char_tokenizer.json").write_text(json.dumps({"type": "char", "alphabet": "ab",
                                                                "chat_template": "{% if %}"}))
    with pytest.raises(TokenizerError, match=r"the chat template in .*char_tokenizer.json is not valid Jinja"):
        load_tokenizer(char_model)
