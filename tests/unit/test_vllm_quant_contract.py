"""The 1x128 activation quantizer meets vLLM's FP8 kernel contract (`per_token_group_quant_fp8`, read
from vLLM's source, FACTS.md), byte for byte and scale for scale, so that a rollout engine running
vLLM's kernels quantizes activations exactly as the trainer does:

    absmax = max(1e-10, max|x|)            (the reduction is seeded with eps)
    scale  = absmax / 448                  (a division, fp32)
    pow2:    scale = 2^ceil(log2(max(scale, 1e-10)))
    q      = clamp(x / scale, -448, 448) -> E4M3, round to nearest even

The reference below is written independently of jetflow and of torch's float8 cast: numpy float32
arithmetic per group, and E4M3 rounding by searching the 256 E4M3 code points (ties to the even
code)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jetflow.precision import quantize_rowwise_groups

GROUP = 128
E4M3_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
E4M3_VALUES = E4M3_BYTES.view(torch.float8_e4m3fn).float().numpy()  # decoding a code point is exact
FINITE = ~np.isnan(E4M3_VALUES)


def e4m3_round(v: np.ndarray) -> np.ndarray:
    """Round float32 values (already within +-448) to E4M3 codes as IEEE does: the magnitude to the
    nearest non-negative code point (ties to the even code), then the sign bit of the input."""
    codes = np.array([c for c in range(128) if FINITE[c]])  # 0x00 .. 0x7E, ascending values
    values = E4M3_VALUES[codes].astype(np.float64)
    out = np.empty(v.shape, dtype=np.uint8)
    for i, x in np.ndenumerate(v.astype(np.float64)):
        dist = np.abs(values - abs(x))
        best = codes[dist == dist.min()]
        code = int(best[0] if len(best) == 1 else [c for c in best if c % 2 == 0][0])
        out[i] = code | (0x80 if np.signbit(x) else 0)
    return out


def reference(x: np.ndarray, pow2: bool) -> tuple[np.ndarray, np.ndarray]:
    """(codes (M, K) uint8, scales (M, ceil(K/128)) float32) per vLLM's contract, in float32."""
    x = x.astype(np.float32)
    m, k = x.shape
    groups = -(-k // GROUP)
    codes = np.zeros((m, k), dtype=np.uint8)
    scales = np.zeros((m, groups), dtype=np.float32)
    eps, fp8_max = np.float32(1e-10), np.float32(448.0)
    for r in range(m):
        for g in range(groups):
            y = x[r, g * GROUP:(g + 1) * GROUP]
            absmax = np.maximum(np.max(np.abs(y)), eps)
            s = np.float32(absmax / fp8_max)
            if pow2:
                s = np.float32(np.exp2(np.ceil(np.log2(np.maximum(s, eps)))))
            scales[r, g] = s
            codes[r, g * GROUP:(g + 1) * GROUP] = e4m3_round(np.clip(y / s, -fp8_max, fp8_max))
    return codes, scales


def cases() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    near = torch.full((2, GROUP), 447.9)
    near[0, 5], near[1, 7] = 448.0, -452.0  # the group's absmax sits at the top of the grid
    near[1] *= 1.7
    mixed = torch.randn(3, 200, generator=gen)  # a partial second group (72 columns)
    mixed[1, 128:] = 0.0
    mixed[2, :128] = 1e-30
    return {
        "zeros": torch.zeros(2, 256),
        "tiny": torch.full((2, GROUP), 1e-30) * torch.tensor([1.0, -1.0])[:, None],
        "subnormal_fp32": torch.full((1, GROUP), 1e-40),
        "below_eps_and_above": torch.tensor([[5e-11] * 64 + [3e-10] * 64]),
        "near_448": near,
        "fp8_subnormal_range": torch.randn(2, GROUP, generator=gen) * 1e-3 + torch.tensor([[1.0] + [0.0] * 127]),
        "random": torch.randn(8, 384, generator=gen) * torch.logspace(-4, 4, 8)[:, None],
        "mixed_groups": mixed,
    }


@pytest.mark.parametrize("rule", ["fp32", "pow2"])
@pytest.mark.parametrize("name", list(cases()))
def test_activation_quantizer_meets_vllm_contract(name, rule):
    x = cases()[name]
    q = quantize_rowwise_groups(x, GROUP, scale_rule=rule)
    codes, scales = reference(x.numpy(), pow2=rule == "pow2")
    got_scales = q.scale_inv.numpy()
    assert np.array_equal(got_scales.view(np.uint32), scales.view(np.uint32)), \
        f"scales differ: {got_scales[got_scales != scales][:4]} vs {scales[got_scales != scales][:4]}"
    got_codes = q.data.view(torch.uint8).numpy()
    assert np.array_equal(got_codes, codes), f"{int((got_codes != codes).sum())} bytes differ"


def test_contract_cases_reach_the_edges():
    """The cases above do exercise what they are named for (a test that cannot fail is a defect)."""
    c = cases()
    q = quantize_rowwise_groups(c["near_448"], GROUP)
    assert q.data.float().abs().max().item() == 448.0
    q = quantize_rowwise_groups(c["tiny"], GROUP)
    assert q.scale_inv.max().item() == np.float32(1e-10 / 448) and bool((q.data.float() == 0).all())
    q = quantize_rowwise_groups(c["fp8_subnormal_range"], GROUP)
    codes = q.data.view(torch.uint8) & 0x7F
    assert bool(((codes > 0) & (codes < 8)).any())  # E4M3 subnormal codes are 1..7
