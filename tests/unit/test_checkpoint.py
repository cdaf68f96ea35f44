"""HF checkpoint directories: round trips (single file and sharded), transformers reading what jetflow
writes, error messages, and the GGUF tensor-name / RoPE-permutation mapping."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import jetflow.model as jm
from jetflow.model import CheckpointError, ModelConfig, UnsupportedModelError, load_state_dict_from_dir, save_hf_dir
from jetflow.model.gguf import hf_name, unpermute_rope_rows

IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82, 81, 82, 84, 59, 4]])


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


@torch.no_grad()
@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_round_trip_single_file_and_hf_reads_it(make_tiny_hf, tmp_path, family, tied):
    from transformers import AutoModelForCausalLM

    hf, src = make_tiny_hf(family, tied)
    model = jm.load(src)
    out = save_hf_dir(model, tmp_path / "saved")
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    stored = load_file(out / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not tied)  # tied: omitted, as HF does

    again = jm.load(out)
    assert again.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    assert torch.equal(again(IDS), model(IDS))

    hf2 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf2) is type(hf)
    assert (hf2(IDS).logits - model(IDS)).abs().max().item() <= 1e-5
    assert (hf2(IDS).logits - hf(IDS).logits).abs().max().item() <= 1e-5


@torch.no_grad()
def test_round_trip_sharded(make_tiny_hf, tmp_path):
    from transformers import AutoModelForCausalLM

    _, src = make_tiny_hf("llama")
    model = jm.load(src)
    out = save_hf_dir(model, tmp_path / "sharded", max_shard_bytes=40_000)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert set(load_state_dict_from_dir(out)) == set(model.state_dict())
    again = jm.load(out)
    assert torch.equal(again(IDS), model(IDS))
    hf2 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (hf2(IDS).logits - model(IDS)).abs().max().item() <= 1e-5
    # saving single-file again into the same directory removes the old shards
    save_hf_dir(model, out)
    assert not list(out.glob("model-*-of-*.safetensors")) and not (out / "model.safetensors.index.json").exists()
    assert torch.equal(jm.load(out)(IDS), model(IDS))


def test_load_dtype_and_tokenizer_copy(make_tiny_hf, tmp_path):
    _, src = make_tiny_hf("qwen3", tied=True)
    model = jm.load(src, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tok_dir = tmp_path / "tok"
    jm.CharTokenizer("abc").save(tok_dir)
    out = save_hf_dir(model, tmp_path / "out", tokenizer_dir=tok_dir)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert jm.load_tokenizer(out).alphabet == "abc"


def test_precision_hook_is_applied(make_tiny_hf, monkeypatch):
    """load(precision=...) hands the model to jetflow.precision.apply_precision."""
    import jetflow.precision

    seen = []
    monkeypatch.setattr(jetflow.precision, "apply_precision",
                        lambda m, p, **kw: seen.append((m, p, kw)) or m, raising=False)
    _, src = make_tiny_hf("llama")
    model = jm.load(src, precision="fp8", recipe="R")
    assert seen == [(model, "fp8", {"recipe": "R"})]
    assert jm.load(src, precision=None) is not None and len(seen) == 1
    with pytest.raises(TypeError, match="without precision"):
        jm.load(src, recipe="R")


@torch.no_grad()
def test_real_precision_swaps_linears(make_tiny_hf):
    """With the lead's converter: every projection becomes a PrecisionLinear and the forward uses it."""
    precision = pytest.importorskip("jetflow.precision")
    if not hasattr(precision, "PrecisionLinear"):
        pytest.skip("jetflow.precision.PrecisionLinear not available yet")
    _, src = make_tiny_hf("qwen2")
    ref = jm.load(src)(IDS)
    model = jm.load(src, precision="bf16")
    assert isinstance(model.model.layers[0].self_attn.q_proj, precision.PrecisionLinear)
    out = model(IDS)
    assert not torch.equal(out, ref)  # bf16 GEMMs took effect ...
    assert (out - ref).abs().max().item() <= 0.05 * ref.abs().max().item()  # ... and stay close


def test_config_round_trip():
    for cfg in [ModelConfig(), ModelConfig(model_type="qwen2", qkv_bias=True, tie_word_embeddings=True),
                ModelConfig(model_type="qwen3", qk_norm=True, head_dim=128, eos_token_id=[1, 2]),
                ModelConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})]:
        assert ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg
    # the pre-transformers-5 spelling of RoPE settings
    legacy = ModelConfig().to_hf()
    del legacy["rope_parameters"]
    legacy["rope_theta"] = 1234.0
    assert ModelConfig.from_hf(legacy).rope_theta == 1234.0


# ---- errors ---------------------------------------------------------------------------------------


def test_unsupported_architecture(make_tiny_hf, tmp_path):
    _, src = make_tiny_hf("llama")
    d = copy_dir(src, tmp_path / "gpt2")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        jm.load(d)
    msg = str(e.value)
    assert "gpt2" in msg and all(s in msg for s in ("llama", "qwen2", "qwen3", "LlamaForCausalLM"))
    cfg.update(model_type="llama", architectures=["MistralForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="MistralForCausalLM"):
        jm.load(d)


def test_missing_files(make_tiny_hf, tmp_path):
    _, src = make_tiny_hf("llama")
    with pytest.raises(CheckpointError, match="config.json"):
        jm.load(tmp_path / "nowhere")
    d = copy_dir(src, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        jm.load(d)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_state_dict_from_dir(d)


def test_missing_shard(make_tiny_hf, tmp_path):
    _, src = make_tiny_hf("llama")
    d = save_hf_dir(jm.load(src), tmp_path / "sh", max_shard_bytes=40_000)
    (d / "model-00002-of-" f"{len(list(d.glob('model-*.safetensors'))):05d}.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing shard file .*model-00002-of-"):
        jm.load(d)


def test_corrupt_safetensors(make_tiny_hf, tmp_path):
    _, src = make_tiny_hf("llama")
    d = copy_dir(src, tmp_path / "corrupt")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")
    with pytest.raises(CheckpointError, match=r"cannot read safetensors file .*model\.safetensors"):
        jm.load(d)
    d2 = copy_dir(src, tmp_path / "truncated")
    data = (d2 / "model.safetensors").read_bytes()
    (d2 / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        jm.load(d2)


def test_missing_extra_and_misshaped_tensors(make_tiny_hf, tmp_path):
    _, src = make_tiny_hf("qwen2")
    sd = load_file(src / "model.safetensors")

    def variant(name, tensors):
        d = copy_dir(src, tmp_path / name)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d

    missing = {k: v for k, v in sd.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(CheckpointError, match=r"missing tensors: \['model.layers.1.self_attn.k_proj.bias'\]"):
        jm.load(variant("missing", missing))
    extra = dict(sd, **{"model.layers.0.mlp.gate_proj.weight_scale_inv": torch.ones(1, 1)})
    with pytest.raises(CheckpointError, match=r"unexpected tensors .*weight_scale_inv \(in model.safetensors\)"):
        jm.load(variant("extra", extra))
    bad = dict(sd, **{"model.norm.weight": torch.ones(63)})
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' in .*model.safetensors has shape \(63,\)"):
        jm.load(variant("shape", bad))


# ---- GGUF name mapping and RoPE permutation ------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim (the operation to undo)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


@pytest.mark.parametrize("n_head,n_kv", [(9, 9), (9, 3), (4, 2)])
def test_gguf_rope_unpermute_inverts_llama_cpp(n_head, n_kv):
    head_dim = 8
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_kv * head_dim, 24)).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head, n_kv)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_kv), w)


def test_gguf_names():
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(ValueError, match="unknown GGUF tensor"):
        hf_name("blk.0.ffn_gate_exps.weight")
