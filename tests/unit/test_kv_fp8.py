"""FP8 KV cache: per-layer scales, the E4M3 grid, and trainer/rollout agreement; the bf16 mode's K/V rounding."""

import pytest
import torch

from jetflow.model import Decoder, ModelConfig
from jetflow.precision.kv import BF16KVRounding, KVQuantizer, attach_kv_quantizer, fake_quantize_per_tensor


def test_fake_quantize_matches_plain_reference_and_passes_gradients():
    torch.manual_seed(0)
    x = (torch.randn(4, 2, 16, 8) * 3).requires_grad_()
    scale = torch.tensor(x.detach().abs().max().item() / 448)
    y = fake_quantize_per_tensor(x, scale)
    ref = (x.detach() / scale).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(y.detach(), ref)
    rel = ((y - x).abs() / x.abs().clamp_min(1e-3)).detach()
    assert rel[x.detach().abs() > scale * 2**-6].max() <= 2**-4 + 1e-6  # E4M3 half-ulp in the normal range
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # straight-through


def test_bf16_rounding_is_round_to_nearest_even_and_passes_gradients():
    # 1 + 2^-8 is halfway between bf16's 1 and 1 + 2^-7: ties go to the even mantissa (1); 1 + 3 * 2^-8 -> 1 + 2^-6
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -3.0, 2**-130], requires_grad=True)
    k, v = BF16KVRounding()(0, x, 2 * x)
    assert k.tolist() == [1.0, 1 + 2**-6, -3.0, 2**-130] and k.dtype == torch.float32
    assert torch.equal(v.detach(), (2 * x).detach().bfloat16().float())
    (k.sum() + v.sum()).backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))  # straight-through on both


def test_recalibrate_sets_amax_over_448_and_validates():
    q = KVQuantizer(num_layers=2)
    q.calibrating = True
    q(0, torch.full((1, 1, 2, 4), -896.0), torch.full((1, 1, 2, 4), 4.48))
    q(1, torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    scales = q.recalibrate()
    assert scales["k_scale"].tolist() == [2.0, 1.0] and scales["v_scale"].tolist() == pytest.approx([0.01, 1.0])
    assert q.k_amax.sum() == 0 and q.calibrated
    with pytest.raises(ValueError, match="positive"):
        q.load_scales({"k_scale": torch.tensor([0.0, 1.0]), "v_scale": torch.ones(2)})
    q.calibrating = True
    q(0, torch.tensor([[[[float("inf")]]]]), torch.zeros(1, 1, 1, 1))
    with pytest.raises(ValueError, match="NaN or Inf"):
        q.recalibrate()


def test_cached_decode_equals_full_forward_with_fp8_kv():
    torch.manual_seed(1)
    model = Decoder(ModelConfig(vocab_size=40, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=16))
    quantizer = KVQuantizer(2)
    attach_kv_quantizer(model, quantizer)
    ids = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        quantizer.calibrating = True
        plain = model(ids)
        quantizer.calibrating = False
        quantizer.recalibrate()
        full = model(ids)
        cache = model.new_cache(2, 16)
        steps = [model(ids[:, :5], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(5, 12)]
    decoded = torch.cat(steps, dim=1)
    assert (full - plain).abs().max() > 1e-4  # the quantizer does change the numbers
    torch.testing.assert_close(decoded, full, atol=1e-5, rtol=1e-5)
