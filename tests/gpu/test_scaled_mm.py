"""Hopper path: torch._scaled_mm with block scales equals the emulation (run on a lent GPU)."""

import pytest
import torch

from jetflow.precision import QuantRecipe, PrecisionLinear, fp8_matmul, quantize_blocks
from jetflow.precision.gemm import resolve_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _needs_hopper():
    if resolve_backend("auto", torch.device("cuda")) != "scaled_mm":
        pytest.skip("block-scaled torch._scaled_mm needs SM90 and CUDA >= 12.9")


@pytest.mark.parametrize("m, n, k", [(1, 256, 512), (7, 384, 576), (128, 1536, 576), (1024, 4096, 4096),
                                     (333, 1000, 1000)])
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
def test_scaled_mm_equals_emulation(m, n, k, b_block):
    _needs_hopper()
    torch.manual_seed(0)
    a = quantize_blocks(torch.randn(m, k, device="cuda"), (1, 128))
    b = quantize_blocks(torch.randn(n, k, device="cuda"), b_block)
    hw = fp8_matmul(a, b, torch.float32, backend="scaled_mm")
    emu = fp8_matmul(a, b, torch.float32, backend="emulate")
    # bf16 output of the hardware path: compare at bf16 resolution of the result's scale.
    tol = 2 ** -7 * emu.abs().max().item() + 1e-3
    assert (hw - emu).abs().max().item() <= tol


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fp8_linear_backward_on_gpu_matches_emulation(fmt):
    _needs_hopper()
    torch.manual_seed(1)
    recipe = QuantRecipe(fmt=fmt)
    layers = {}
    for backend in ("scaled_mm", "emulate"):
        torch.manual_seed(1)
        layer = PrecisionLinear(1024, 768, kind="fp8", recipe=recipe, gemm_backend=backend, device="cuda")
        x = torch.randn(256, 1024, device="cuda", requires_grad=True)
        y = layer(x.bfloat16() if backend == "scaled_mm" else x)
        y.float().pow(2).sum().backward()
        layers[backend] = (y.float(), x.grad, layer.weight.grad)
    for hw, emu in zip(layers["scaled_mm"], layers["emulate"]):
        cos = torch.nn.functional.cosine_similarity(hw.flatten().double(), emu.flatten().double(), dim=0)
        assert cos.item() > 0.999
