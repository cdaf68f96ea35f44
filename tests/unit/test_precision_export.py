"""Export in the vLLM / DeepSeek FP8 layout and import back to identical bytes."""

import json

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open

from jetflow.precision import (QuantRecipe, RecipeMismatchError, apply_precision, check_fingerprint, load_quantized,
                               quantized_weights, save_quantized)


def test_export_reimports_identical_bytes(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(576, 1536), nn.Linear(1536, 576))
    recipe = QuantRecipe(scale_rule="pow2")
    apply_precision(model, "fp8", recipe, gemm_backend="emulate")
    q = quantized_weights(model)
    path = tmp_path / "model.safetensors"
    save_quantized(path, q, recipe, extra={"0.bias": model[0].bias.detach()})
    with safe_open(str(path), "pt") as f:
        assert f.get_slice("0.weight").get_dtype() == "F8_E4M3"
        assert f.get_tensor("0.weight_scale_inv").dtype == torch.float32
        assert tuple(f.get_tensor("0.weight_scale_inv").shape) == (12, 5)  # ceil(1536/128), ceil(576/128)
        assert json.loads(f.metadata()["jetflow_recipe"])["scale_rule"] == "pow2"
    back, others, recipe_back = load_quantized(path)
    assert recipe_back == recipe and recipe_back.fingerprint() == recipe.fingerprint()
    assert set(back) == {"0", "1"} and set(others) == {"0.bias"}
    for name in q:
        assert torch.equal(back[name].data.view(torch.uint8), q[name].data.view(torch.uint8))
        assert torch.equal(back[name].scale_inv, q[name].scale_inv)


def test_vllm_quantization_config_and_fingerprint():
    a, b = QuantRecipe(), QuantRecipe(scale_rule="pow2")
    cfg = a.vllm_quantization_config()
    assert cfg["quant_method"] == "fp8" and cfg["weight_block_size"] == [128, 128]
    assert cfg["activation_scheme"] == "dynamic" and cfg["fmt"] == "e4m3"
    assert a.fingerprint() == QuantRecipe().fingerprint() != b.fingerprint()
    assert QuantRecipe.from_dict(a.to_dict()) == a
    check_fingerprint(a.fingerprint(), a.fingerprint())
    with pytest.raises(RecipeMismatchError, match=b.fingerprint()):
        check_fingerprint(a.fingerprint(), b.fingerprint())


def test_recipe_rejects_bad_values():
    with pytest.raises(ValueError, match="valid formats"):
        QuantRecipe(fmt="e3m4")
    with pytest.raises(ValueError, match="valid rules"):
        QuantRecipe(scale_rule="ue8m0x")
    with pytest.raises(ValueError, match="unknown QuantRecipe keys"):
        QuantRecipe.from_dict({"fmt": "e4m3", "blok": 3})
