"""mxfp8 / nvfp4 exports (issue 28): NVIDIA ModelOpt's layout as vLLM 0.32 reads it, checked with vLLM's
own classes (vllm/model_executor/layers/quantization/modelopt.py), and back into jetflow running the
same bytes (`jetflow.model.load`, `jetflow generate`).

vLLM's side, read from its source and called here:
- `ModelConfig._verify_quantization` (vllm/config/model.py) asks every quantization method's
  `override_quantization_method(quantization_config)` in its order: the export's config must select
  `modelopt_fp4` (NVFP4) / `modelopt_mxfp8` (MXFP8) and nothing before them; `from_config` reads
  `quant_algo`, `group_size` and `ignore` (the bf16 linears: `is_layer_excluded`).
- The weight schemes `KNvfp4Static` / `KNvfp4Dynamic` / `KMxfp8Static` (`SCHEME_FOR`) register, per
  linear of output widths [N] and input K: NVFP4 weight uint8 (N, K/2), weight_scale float8_e4m3fn
  (N, K/16), weight_scale_2 float32 (1,), input_scale float32 (1,); MXFP8 weight float8_e4m3fn (N, K),
  weight_scale uint8 (N, K/32). Their `process` turns scale_2 / input_scale into weight_global_scale,
  input_global_scale (and alpha = their product, `maybe_fuse_global_scales`).
- vLLM's own dequantization (`break_fp4_bytes` + `dequantize_to_dtype`, `dequant_mxfp8_to_bf16`) of the
  loaded parameters gives the values jetflow's trainer computed with.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import jetflow.model as jm
from jetflow.cli import main
from jetflow.config import load_config
from jetflow.export import export_fp8
from jetflow.model import Decoder, ModelConfig
from jetflow.precision import QuantRecipe, apply_precision, quantized_weights
from jetflow.precision import fp4
from jetflow.precision.nvfp4 import TENSOR_SCALE_DIVISOR
from jetflow.rollout import RolloutEngine, SamplingParams
from jetflow.run.build import build_policy

CONFIG = ModelConfig(vocab_size=96, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=32, tie_word_embeddings=False)
LINEARS = [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                                "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                                "mlp.down_proj")]


@pytest.fixture(scope="module", params=["mxfp8", "nvfp4"])
def exported(request, tmp_path_factory):
    """(family, the trainer model under the recipe, its export directory)."""
    torch.manual_seed(0)
    model = Decoder(CONFIG).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((p + 0.05 * torch.randn_like(p)).bfloat16())  # the high-precision tensors export in bf16
    recipe = QuantRecipe(family=request.param)
    apply_precision(model, "fp8", recipe, num_layers=CONFIG.num_layers)
    return request.param, model, export_fp8(model, tmp_path_factory.mktemp(request.param), recipe)


def test_export_loads_back_running_the_same_bytes(exported):
    family, model, out = exported
    back = jm.load(out)
    sent, got = quantized_weights(model), quantized_weights(back)
    assert sorted(got) == sorted(LINEARS)
    for name in LINEARS:
        assert got[name].kind == family
        assert all(torch.equal(a, b) for a, b in zip(sent[name].parts().values(), got[name].parts().values())), name
    ids = torch.randint(0, 96, (3, 17))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))


def test_vllm_detects_the_modelopt_method_and_its_excluded_layers(exported):
    """vLLM's own detection (ModelConfig._verify_quantization, run on a stand-in config holding only what
    it reads) picks the ModelOpt method; its config reads the export's algorithm, group and exclusions."""
    import vllm.config.model as vcm
    import vllm.model_executor.layers.quantization as vq

    family, _, out = exported
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    model_config = SimpleNamespace(quantization=None, model_arch_config=SimpleNamespace(quantization_config=qc),
                                   hf_config=None, allow_deprecated_quantization=False)
    vcm.ModelConfig._verify_quantization(model_config)
    expected = {"nvfp4": "modelopt_fp4", "mxfp8": "modelopt_mxfp8"}[family]
    assert model_config.quantization == expected
    config = vq.get_quantization_config(expected).from_config(qc)
    assert config.is_layer_excluded("lm_head") and not config.is_layer_excluded("model.layers.0.mlp.down_proj")
    if family == "nvfp4":
        assert config.group_size == 16 and config.quant_method == "NVFP4"


class _Layer(torch.nn.Module):
    pass


def vllm_layer(monkeypatch, family: str, n: int, k: int, tensors: dict[str, torch.Tensor], name: str):
    """A stand-in linear with the parameters vLLM's ModelOpt schemes register for widths [n] x k, loaded
    from the export's tensors by vLLM's default weight loader and processed as after loading."""
    import vllm.model_executor.parameter as vp
    from vllm.model_executor.layers.quantization import modelopt as mo
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    monkeypatch.setattr(vp, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vp, "get_tensor_model_parallel_world_size", lambda: 1)
    layer, shapes = _Layer(), mo.Shapes([n], k, torch.bfloat16)
    if family == "nvfp4":
        schemes = [(mo.SCHEME_FOR[mo.kNvfp4Static], mo.WEIGHT), (mo.SCHEME_FOR[mo.kNvfp4Dynamic], mo.ACT)]
    else:
        schemes = [(mo.SCHEME_FOR[mo.kMxfp8Static], mo.WEIGHT)]
    ctx = mo.CkptCtx(group_size=16 if family == "nvfp4" else None)
    for scheme, role in schemes:
        scheme.create_weights(layer, role, ctx, shapes, default_weight_loader)
    params = dict(layer.named_parameters())
    stored = {key.removeprefix(f"{name}."): t for key, t in tensors.items() if key.startswith(f"{name}.")}
    assert sorted(params) == sorted(stored)
    for key, p in params.items():
        assert p.dtype == stored[key].dtype, key
        loaded = stored[key].reshape(1) if stored[key].dim() == 0 else stored[key]  # a ModelOpt scalar
        assert tuple(p.shape) == tuple(loaded.shape), key
        p.weight_loader(p, loaded)
    for scheme, role in schemes:
        scheme.process(layer, role)
    mo.maybe_fuse_global_scales(layer)
    return layer


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"])
def test_vllm_loads_each_linear_and_dequantizes_it_to_the_trainers_values(exported, monkeypatch, name):
    family, model, out = exported
    tensors = load_file(out / "model.safetensors")
    q = quantized_weights(model)[name]
    n, k = q.shape
    layer = vllm_layer(monkeypatch, family, n, k, tensors, name)
    if family == "mxfp8":
        from vllm.model_executor.layers.quantization.utils.mxfp8_utils import dequant_mxfp8_to_bf16

        ours = q.dequantize()
        assert torch.equal(dequant_mxfp8_to_bf16(layer.weight, layer.weight_scale).float(), ours.bfloat16().float())
        assert torch.equal(layer.weight.float() * torch.exp2(layer.weight_scale.float() - 127).repeat_interleave(32, 1),
                           ours)
        return
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (break_fp4_bytes,
                                                                                       dequantize_to_dtype)

    assert torch.equal(break_fp4_bytes(layer.weight, torch.float32), fp4.e2m1_values(q.codes()))
    assert torch.equal(layer.weight_scale.float(), q.scale.float().repeat_interleave(16, 0)[:n])  # 16x16 tiles
    assert torch.equal(layer.weight_global_scale, q.tensor_scale)  # d_w = amax / 2688
    assert layer.input_global_scale.item() > 0 and torch.equal(layer.alpha, layer.input_global_scale * q.tensor_scale)
    vllm_values = dequantize_to_dtype(layer.weight, layer.weight_scale, layer.weight_global_scale, torch.float32,
                                      swizzle=False)
    torch.testing.assert_close(vllm_values, q.dequantize(), rtol=2**-23, atol=0)  # e2m1 * (s * d) vs (e2m1 * s) * d


def test_nvfp4_input_scale_is_the_calibrated_amax_over_2688(exported):
    family, model, out = exported
    if family != "nvfp4":
        pytest.skip("MXFP8 activations are quantized dynamically (no stored scale)")
    tensors = load_file(out / "model.safetensors")
    seen = {}
    hook = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("amax", a[0].abs().amax().item()))
    with torch.no_grad():
        model(torch.arange(96)[None])  # the calibration forward: every token id of this vocabulary
    hook.remove()
    assert tensors["model.layers.0.mlp.down_proj.input_scale"].item() == \
        torch.tensor(seen["amax"]).div(TENSOR_SCALE_DIVISOR).item()


@pytest.mark.parametrize("family", ["mxfp8", "nvfp4"])
def test_export_then_jetflow_generate_round_trip(family, tmp_path, capsys):
    """`jetflow export` of the tiny model under the recipe, then `jetflow generate` on the export: the
    completions the trainer-side model (the recipe applied to the same weights) decodes greedily."""
    cfg = load_config(None, ["model.path=tiny", f"precision.family={family}"])
    model, tok = build_policy(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16())
    trainer = apply_precision(model, "fp8", cfg.precision.recipe(), num_layers=model.config.num_layers)
    out = export_fp8(trainer, tmp_path / "export", cfg.precision.recipe(), tokenizer_dir=tok)
    prompts = ["3+4=", "12+5="]
    ids = [tok.encode(p) for p in prompts]
    engine = RolloutEngine(trainer, [tok.eos_token_id], tok.pad_token_id, max_batch=2, max_seq_len=24, tokenizer=tok)
    expected = engine.generate(ids, SamplingParams(max_new_tokens=6, temperature=0.0)).texts
    capsys.readouterr()
    assert main(["generate", "--model", str(out), *prompts, "--max-new-tokens", "6", "--no-chat"]) == 0
    texts = re.findall(r"=== \[\d+\] [^\n]*\n(.*?)\n--- \(\d+ tokens", capsys.readouterr().out, flags=re.DOTALL)
    assert texts == expected and len(texts) == 2
