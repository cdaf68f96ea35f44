"""FP8 linear (fprop, dgrad, wgrad) against a dequantize-then-fp32 reference, and the converter."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from jetflow.precision import QuantRecipe, PrecisionLinear, apply_precision, dequantize, fp8_linears, quantize_blocks

torch.manual_seed(0)


def fq(x, block, fmt="e4m3"):
    """Fake-quantize a 2-D tensor: the value an FP8 GEMM sees."""
    return dequantize(quantize_blocks(x, block, fmt))


def cosine(a, b):
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def make_pair(in_f=384, out_f=200, recipe=QuantRecipe(), bias=True):
    ref = nn.Linear(in_f, out_f, bias=bias)
    layer = PrecisionLinear.from_linear(ref, kind="fp8", recipe=recipe, gemm_backend="emulate", name="proj")
    return ref, layer


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_forward_backward_equal_dequantized_fp32_reference(fmt):
    recipe = QuantRecipe(fmt=fmt)
    gfmt = "e5m2" if fmt == "hybrid" else "e4m3"
    _, layer = make_pair(recipe=recipe)
    x = torch.randn(3, 50, 384, requires_grad=True)
    y = layer(x)
    gy = torch.randn_like(y)
    y.backward(gy)

    x2, g2, w = x.detach().reshape(-1, 384), gy.reshape(-1, 200), layer.weight.detach()
    y_ref = fq(x2, (1, 128)) @ fq(w, (128, 128)).t() + layer.bias.detach()
    dx_ref = fq(g2, (1, 128), gfmt) @ fq(w, (128, 128))
    dw_ref = fq(g2, (128, 1), gfmt).t() @ fq(x2, (128, 1))
    torch.testing.assert_close(y.detach().reshape(-1, 200), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.reshape(-1, 384), dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad, dw_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer.bias.grad, g2.sum(0), rtol=1e-5, atol=1e-5)


def test_gradients_stay_close_to_bf16_layer():
    ref, layer = make_pair(in_f=512, out_f=256)
    bf16 = PrecisionLinear.from_linear(nn.Linear(512, 256), kind="bf16", name="bf16")
    bf16.load_state_dict(ref.state_dict())
    x = torch.randn(256, 512)
    grads = {}
    for name, mod in (("fp8", layer), ("bf16", bf16)):
        mod.zero_grad()
        xi = x.clone().requires_grad_()
        out = mod(xi)
        out.backward(torch.ones_like(out) + torch.sin(out.detach()))
        grads[name] = (out.detach(), xi.grad, mod.weight.grad.clone())
    for a, b in zip(grads["fp8"], grads["bf16"]):
        assert cosine(a, b) >= 0.99


def test_activation_is_saved_for_backward_in_fp8():
    _, layer = make_pair()
    x = torch.randn(8, 384, requires_grad=True)
    y = layer(x)
    node = y.grad_fn
    while not hasattr(node, "saved_xt"):
        node = node.next_functions[0][0]
    saved = node.saved_xt  # X^T (K, M) in 1x128 groups along the tokens: X's 128x1 quantization
    ref = quantize_blocks(x.detach(), (128, 1))
    assert saved.data.dtype == torch.float8_e4m3fn and saved.block == (1, 128) and tuple(saved.shape) == (384, 8)
    assert torch.equal(saved.dequantize(), ref.dequantize().t())


def test_weight_quantized_once_per_version(monkeypatch):
    from jetflow.precision.family import family_of
    calls = []
    family = family_of(QuantRecipe())
    real = family.quantize_weight
    monkeypatch.setattr(family, "quantize_weight", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, layer = make_pair()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(4, 384)
    first = layer.quantized_weight()
    layer(x).sum().backward()
    layer(x).sum().backward()
    assert len(calls) == 1 and layer.quantized_weight() is first
    opt.step()
    second = layer.quantized_weight()
    assert len(calls) == 2 and second is not first
    assert not torch.equal(second.data.view(torch.uint8), first.data.view(torch.uint8))


def test_loaded_bytes_are_used_as_is():
    _, trainer = make_pair()
    rollout = PrecisionLinear(384, 200, kind="fp8", recipe=QuantRecipe(), gemm_backend="emulate", name="proj")
    rollout.bias.data.copy_(trainer.bias.data)
    rollout.weight.data.zero_()  # the rollout side's own master weight is irrelevant
    rollout.load_quantized(trainer.quantized_weight())
    x = torch.randn(5, 384)
    assert torch.equal(rollout(x), trainer(x))
    with pytest.raises(ValueError, match="shape"):
        rollout.load_quantized(quantize_blocks(torch.randn(10, 384), (128, 128)))


def test_fp8_linear_tracks_bf16_on_a_small_regression():
    """A few optimizer steps through FP8 dgrad/wgrad reduce the loss like the fp32 layer."""
    torch.manual_seed(1)
    target = nn.Linear(256, 128)
    x = torch.randn(512, 256)
    y = target(x).detach()
    losses = {}
    for kind in ("fp32", "fp8"):
        torch.manual_seed(2)
        model = nn.Sequential(nn.Linear(256, 128))
        apply_precision(model, kind, QuantRecipe(), gemm_backend="emulate")
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(30):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
        losses[kind] = loss.item()
    assert losses["fp8"] < 0.25 * F.mse_loss(torch.zeros_like(y), y).item()
    assert losses["fp8"] < 3 * losses["fp32"] + 1e-3


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 128)
        self.layers = nn.ModuleList(nn.ModuleDict({"q_proj": nn.Linear(128, 128), "router": nn.Linear(128, 4)})
                                    for _ in range(4))
        self.lm_head = nn.Linear(128, 10)


def test_apply_precision_respects_the_recipe_lists():
    model = Tiny()
    weight = model.layers[1]["q_proj"].weight
    apply_precision(model, "fp8", QuantRecipe(keep_first_layers=1, keep_last_layers=1))
    kinds = {n: m.kind for n, m in model.named_modules() if isinstance(m, PrecisionLinear)}
    assert kinds["lm_head"] == "bf16"
    assert kinds["layers.0.q_proj"] == "bf16" and kinds["layers.3.q_proj"] == "bf16"
    assert kinds["layers.1.q_proj"] == "fp8" and kinds["layers.2.q_proj"] == "fp8"
    assert all(kinds[f"layers.{i}.router"] == "bf16" for i in range(4))
    assert model.layers[1]["q_proj"].weight is weight  # parameters shared, not copied
    assert set(fp8_linears(model)) == {"layers.1.q_proj", "layers.2.q_proj"}
    assert "layers.1.q_proj.weight" in model.state_dict()


def test_bad_kind_and_missing_recipe_are_errors():
    with pytest.raises(ValueError, match="valid kinds"):
        apply_precision(Tiny(), "fp4")
    with pytest.raises(ValueError, match="QuantRecipe"):
        apply_precision(Tiny(), "fp8")


def test_bf16_layer_no_grad_cache_gives_the_same_values():
    torch.manual_seed(3)
    layer = PrecisionLinear.from_linear(nn.Linear(300, 200), kind="bf16", name="b")
    x = torch.randn(7, 300)
    with torch.no_grad():
        cached = layer(x)
        again = layer(x)
    assert torch.equal(cached, layer(x).detach()) and torch.equal(cached, again)
    ref = (x.bfloat16().float() @ layer.weight.detach().bfloat16().float().t()
           + layer.bias.detach().bfloat16().float()).bfloat16().float()
    torch.testing.assert_close(cached, ref, rtol=0, atol=0)
    with torch.no_grad():
        layer.weight.add_(1.0)  # a new version must not reuse the old rounding
        assert not torch.equal(layer(x), cached)
