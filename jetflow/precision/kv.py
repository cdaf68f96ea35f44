"""FP8 (E4M3) K/V quantization with per-layer scales recalibrated every step (FP8-RL's recipe).

K (after RoPE) and V of each layer are rounded to the E4M3 grid with one fp32 scale per layer and
tensor: value = fp8 * scale, scale = amax / 448 from calibration. The rollout engine applies it to
what it writes into its KV cache; under `unified` the trainer applies the very same quantization in
its attention, so both sides still compute one function.

Scales are static within a step: they come from the trainer's latest forward (amax observed while it
computed log-probs), travel to the rollout side with the weights, and the next step uses the new
ones. Values beyond a stale amax saturate at +-448 * scale, as in any static-scale FP8 KV cache.

The trainer keeps the rounded values in its dtype; the native rollout engine's paged cache
(jetflow.model.paged_cache) and the exact vLLM plugin's (vLLM's fp8 cache, jetflow.rollout.vllm.attention)
store the E4M3 codes themselves (`encode`), one byte a value, and their kernels
(jetflow.kernels.paged) compute code * scale at each load: the same values, so the same log-probs.
"""

from __future__ import annotations

import torch

from jetflow.kernels import invariant

E4M3_MAX = 448.0


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of x / scale (saturating at +-448): the bytes an FP8 KV cache stores (value = code * scale)."""
    return (x.float() / scale).to(torch.float8_e4m3fn)


def fake_quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round x to the E4M3 grid of `scale` (saturating); gradients pass straight through. The value is
    exactly code * scale (fp32), the value an FP8 cache's kernels compute from the stored code: `q + (x -
    x)` rather than `x + (q - x)`, which differs from q where x saturated (q - x is then inexact)."""
    q = (quantize_per_tensor(x.detach(), scale).float() * scale).to(x.dtype)
    return q + (x - x.detach())


class KVQuantizer:
    """Per-layer K/V scales; call `(layer, k, v)` to quantize, `calibrating=True` to observe amax."""

    page_dtype = torch.float8_e4m3fn  # what a paged cache stores once `ready`: the codes (jetflow.model.paged_cache)
    values = "FP8 E4M3 values"

    def __init__(self, num_layers: int, margin: int = 0, apply: bool = True):
        self.num_layers, self.margin = num_layers, margin
        self.apply = apply  # False: observe amax only (a bf16 trainer calibrating an FP8 rollout cache)
        self.k_scale = torch.ones(num_layers)
        self.v_scale = torch.ones(num_layers)
        self.k_amax = torch.zeros(num_layers)
        self.v_amax = torch.zeros(num_layers)
        self.calibrating = False
        self.calibrated = False

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.calibrating:
            self.k_amax[layer] = torch.maximum(self.k_amax[layer], k.detach().abs().amax().float().cpu())
            self.v_amax[layer] = torch.maximum(self.v_amax[layer], v.detach().abs().amax().float().cpu())
        if not self.apply or not self.calibrated:
            return k, v  # observing only, or no scale yet (before the first calibration)
        ks = self.k_scale[layer].to(k.device)
        vs = self.v_scale[layer].to(v.device)
        return fake_quantize_per_tensor(k, ks), fake_quantize_per_tensor(v, vs)

    @property
    def ready(self) -> bool:
        """Scales are set and applied: K/V go onto the E4M3 grid (an FP8 paged cache can store codes)."""
        return self.apply and self.calibrated

    def layer_scales(self, layer: int) -> tuple[float, float]:
        """(k_scale, v_scale) of `layer` as Python floats (exact: fp32 values), for the kernels."""
        return float(self.k_scale[layer]), float(self.v_scale[layer])

    def encode(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The E4M3 codes of k, v (what `__call__` would round them to is code * scale); needs `ready`."""
        if not self.ready:
            raise RuntimeError("FP8 KV codes need a calibrated quantizer that applies its scales")
        if self.calibrating:
            self(layer, k, v)  # observe amax
        ks, vs = self.k_scale[layer].to(k.device), self.v_scale[layer].to(v.device)
        return quantize_per_tensor(k.detach(), ks), quantize_per_tensor(v.detach(), vs)

    def recalibrate(self, dp=None) -> dict[str, torch.Tensor]:
        """Turn the observed amax into new scales (and clear it); returns them. With `dp` (a
        jetflow.distributed.DataParallel), the amax is first max-reduced over its ranks, so every
        rank sets the same scales."""
        if dp is not None:
            dp.max_(self.k_amax)
            dp.max_(self.v_amax)
        if not bool(torch.isfinite(self.k_amax).all() and torch.isfinite(self.v_amax).all()):
            raise ValueError("KV calibration saw NaN or Inf in K or V; refusing to set FP8 KV scales")
        factor = 2.0**self.margin / E4M3_MAX
        self.k_scale = torch.where(self.k_amax > 0, self.k_amax * factor, torch.ones_like(self.k_amax))
        self.v_scale = torch.where(self.v_amax > 0, self.v_amax * factor, torch.ones_like(self.v_amax))
        self.k_amax.zero_()
        self.v_amax.zero_()
        self.calibrated = True
        return self.scales()

    def scales(self) -> dict[str, torch.Tensor]:
        return {"k_scale": self.k_scale.clone(), "v_scale": self.v_scale.clone()}

    def state_dict(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale, "k_amax": self.k_amax, "v_amax": self.v_amax,
                "calibrated": self.calibrated}

    def load_state_dict(self, state: dict) -> None:
        for key in ("k_scale", "v_scale", "k_amax", "v_amax"):
            setattr(self, key, state[key].clone())
        self.calibrated = state["calibrated"]

    def load_scales(self, scales: dict[str, torch.Tensor]) -> None:
        k, v = scales["k_scale"], scales["v_scale"]
        if k.shape != (self.num_layers,) or v.shape != (self.num_layers,):
            raise ValueError(f"KV scales for {tuple(k.shape)} layers, this model has {self.num_layers}")
        if not bool((k > 0).all() and (v > 0).all() and torch.isfinite(k).all() and torch.isfinite(v).all()):
            raise ValueError("KV scales must be finite and positive")
        self.k_scale, self.v_scale = k.float().clone(), v.float().clone()
        self.calibrated = True


class BF16KVRounding:
    """K/V rounded to bf16 after RoPE, the bf16 mode's KV cache (a paged cache stores the bf16 values,
    two bytes a value instead of four). Applied by the rollout engine to what it caches and by the trainer
    in its attention, like the FP8 quantizer (the same call), so both sides still compute one function;
    gradients pass straight through. No scales: nothing to calibrate or to ship with the weights."""

    page_dtype = torch.bfloat16
    values = "bf16 values"
    ready = True  # applies from the start: nothing to calibrate
    calibrating = False

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _round_bf16(k), _round_bf16(v)

    def layer_scales(self, layer: int) -> tuple[float, float]:
        return 1.0, 1.0


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    """x on the bf16 grid (round to nearest even, invariant.round_to_bf16: one pass on the CPU), in x's
    dtype; straight-through gradient."""
    return invariant.round_to_bf16(x.detach()) + (x - x.detach())


def attach_kv_quantizer(model, quantizer: KVQuantizer | BF16KVRounding | None) -> None:
    """Make every attention layer of a jetflow Decoder apply `quantizer` to K and V (None detaches)."""
    for layer in model.model.layers:
        layer.self_attn.kv_quantizer = quantizer
