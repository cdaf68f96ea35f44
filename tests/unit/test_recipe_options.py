"""The recipe options of the FP8 cost study (issue 70): bf16 dgrad and / or wgrad (forward-only FP8 with
both), and fp8_block blocks other than 128 (32-wide) under exact numerics. References: the bf16 GEMM
computed by hand in fp32 on bf16-rounded operands, and the default recipe's own GEMMs."""

from __future__ import annotations

import pytest
import torch

from jetflow.config import ConfigError
from jetflow.precision import QuantRecipe
from jetflow.precision.family import fp8_linear, quantize_weight_for_recipe
from jetflow.precision.linear import PrecisionLinear
from jetflow.precision.quant import dequantize, quantize_blocks


def _grads(recipe: QuantRecipe, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, numerics: str = "fast"):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    y = fp8_linear(x, w, None, quantize_weight_for_recipe(w, recipe), recipe, "emulate", "t", numerics)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


@pytest.fixture
def operands():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, 256, generator=gen)  # (M, K)
    w = torch.randn(192, 256, generator=gen) * 0.05  # (N, K)
    g = torch.randn(48, 192, generator=gen)  # (M, N) the output's gradient
    return x, w, g


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_bf16_backward_gemms_are_the_bf16_products_and_leave_the_rest_alone(operands, numerics):
    x, w, g = operands
    y0, gx0, gw0 = _grads(QuantRecipe(), x, w, g, numerics)
    y_d, gx_d, gw_d = _grads(QuantRecipe(dgrad="bf16"), x, w, g, numerics)
    y_w, gx_w, gw_w = _grads(QuantRecipe(wgrad="bf16"), x, w, g, numerics)
    y_b, gx_b, gw_b = _grads(QuantRecipe(dgrad="bf16", wgrad="bf16"), x, w, g, numerics)
    for y in (y_d, y_w, y_b):  # the forward is the recipe's FP8 GEMM whatever the backward
        assert torch.equal(y, y0)
    assert torch.equal(gx_d, _bf16(g) @ _bf16(w)) and torch.equal(gx_b, gx_d)  # dX = dY @ W on bf16 operands
    assert torch.equal(gw_w, _bf16(g).t() @ _bf16(x)) and torch.equal(gw_b, gw_w)  # dW = dY^T @ X
    assert torch.equal(gw_d, gw0) and torch.equal(gx_w, gx0)  # the other GEMM stays FP8
    # and the FP8 gradients are the coarser ones: further from the fp32 gradient than bf16's
    ref_x, ref_w = g @ w, g.t() @ x
    assert (gx0 - ref_x).norm() > 4 * (gx_d - ref_x).norm()
    assert (gw0 - ref_w).norm() > 4 * (gw_w - ref_w).norm()


def test_recipe_fields_are_checked_and_keep_earlier_fingerprints():
    assert QuantRecipe().fingerprint() == "3ceda4903d9a"  # every run before the fields existed logged this one
    assert "dgrad" not in QuantRecipe().to_dict()
    assert QuantRecipe(wgrad="bf16").fingerprint() != QuantRecipe().fingerprint()
    assert QuantRecipe.from_dict(QuantRecipe(dgrad="bf16").to_dict()) == QuantRecipe(dgrad="bf16")
    with pytest.raises(ValueError, match="dgrad='fp16'"):
        QuantRecipe(dgrad="fp16")
    for family in ("mxfp8", "nvfp4"):
        with pytest.raises(ValueError, match=f"wgrad='bf16' does not apply to the {family} family"):
            QuantRecipe(family=family, wgrad="bf16")


def test_fine_blocks_exact_product_is_row_invariant_and_the_dequantized_product(operands):
    """32-wide groups and 32x32 weight blocks: no FP8 kernel reads them, so the exact product is the
    canonical fp32 GEMM on the dequantized operands: a row's bits do not depend on the batch, and the
    values are those of the plain fp32 product of the dequantized operands."""
    x, w, _ = operands
    recipe = QuantRecipe(weight_block=(32, 32), group_size=32)
    layer = PrecisionLinear.from_linear(torch.nn.Linear(256, 192, bias=False), kind="fp8", recipe=recipe,
                                        numerics="exact")
    layer.weight.data.copy_(w)
    with torch.no_grad():
        y = layer(x)  # (48, 192)
        assert torch.equal(layer(x[5:6]), y[5:6]) and torch.equal(layer(x[:7]), y[:7])
    ref = dequantize(quantize_blocks(x, (1, 32))) @ dequantize(quantize_blocks(w, (32, 32))).t()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    coarse = dequantize(quantize_blocks(x, (1, 128))) @ dequantize(quantize_blocks(w, (128, 128))).t()
    exact = x @ w.t()
    assert (y - exact).norm() < (coarse - exact).norm()  # finer blocks, smaller error (the point of them)
    x.requires_grad_(True)
    y_grad = layer(x)  # the trainer's path (autograd) computes the same forward bits
    assert torch.equal(y_grad.detach(), y)


def test_fine_blocks_refuse_the_engines_that_lay_out_128_rows():
    from jetflow.config import load_config
    from jetflow.run.validate import check_config

    cfg = load_config("configs/tiny.yaml", ["precision.weight_block=[32,32]", "precision.group_size=32",
                                            "rollout.backend=vllm"])
    with pytest.raises(ConfigError, match=r"weight_block=\[32, 32\] group_size=32 with rollout.backend=vllm"):
        check_config(cfg)
    check_config(load_config("configs/tiny.yaml", ["precision.weight_block=[32,32]", "precision.group_size=32"]))
