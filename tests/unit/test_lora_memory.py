"""The memory estimate under model.lora (jetflow.run.memory_estimate): the trainer's weights, gradients and AdamW
state against the bytes of the trainer's own model (fp32, bf16, unified), and the activations a layer saves for
the backward against autograd's saved tensors, counted with hooks on tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jetflow.bench.common import saved_activation_bytes
from jetflow.config import derive, load_config
from jetflow.precision.lora import adapter_parameters
from jetflow.rl.experience import pack_experience
from jetflow.run.build import apply_mode, build_model, load_inputs, with_lora
from jetflow.run.memory_estimate import estimate_run, layer_bytes_per_token
from jetflow.train.trainer import response_logprobs

TINY = str(Path(__file__).resolve().parents[2] / "configs/tiny.yaml")


def _model(mode: str, *overrides: str):
    cfg = load_config(TINY, [f"precision.mode={mode}", "precision.numerics=exact", *overrides])
    inputs = load_inputs(cfg)
    model = with_lora(apply_mode(build_model(cfg, inputs.arch, inputs.tokenizer), derive(cfg).precision, "trainer"),
                      cfg, "trainer")
    return cfg, inputs, model


@pytest.mark.parametrize("mode", ["fp32", "bf16", "unified"])
def test_the_trainers_weights_gradients_and_adam_state_are_the_lora_models(mode):
    """trainer weights = the bytes of every parameter the LoRA trainer holds (the FP8 linears hold bytes, counted
    as copies); gradients and AdamW = the adapters' (1 and 2 fp32 copies); the full run's estimate is larger."""
    cfg, inputs, model = _model(mode, "model.lora.rank=8")
    estimate = estimate_run(cfg, derive(cfg), inputs.arch, 16)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    adapters = sum(p.numel() for p in adapter_parameters(model).values())
    assert estimate.term("trainer weights") == held
    assert estimate.term("gradients") == 4 * adapters and estimate.term("AdamW state") == 8 * adapters
    full = load_config(TINY, [f"precision.mode={mode}", "precision.numerics=exact"])
    assert estimate_run(full, derive(full), inputs.arch, 16).term("AdamW state") > 10 * estimate.term("AdamW state")


def _saved_per_token(mode: str, layers: int, *overrides: str) -> float:
    """Bytes autograd saves for the backward of a training forward per token (each storage once, parameters
    excluded), as scripts/analysis/memory_estimate_saved_activations.py counts them."""
    cfg, inputs, model = _model(mode, f"model.tiny.num_layers={layers}", "model.tiny.max_position=512", *overrides)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (16,), generator=gen).tolist() for _ in range(2)]
    responses = [torch.randint(3, model.config.vocab_size, (112,), generator=gen).tolist() for _ in range(2)]
    zeros = torch.zeros(2)
    exp = pack_experience(prompts, responses, [[0.0] * 112] * 2, zeros, zeros, 0, "cpu")
    return saved_activation_bytes(model, lambda: response_logprobs(model, exp)) / (2 * 128)


@pytest.mark.parametrize("mode", ["unified", "bf16"])
def test_a_lora_layers_saved_activations_are_what_the_estimate_counts(mode):
    """One decoder layer's saved bytes per token (the difference of a 3- and a 2-layer model) at a shape the
    coefficients were not fitted on (h 128, i 384, kv 64, rank 8), against layer_bytes_per_token: equal but for
    the few bytes of a layer's 0-d tensors; LoRA's are not the full fine-tuning's."""
    over = ("model.lora.rank=8",)
    measured = _saved_per_token(mode, 3, *over) - _saved_per_token(mode, 2, *over)
    cfg, inputs, _ = _model(mode, *over)
    kind = derive(cfg).precision.trainer_kind
    assert abs(measured - layer_bytes_per_token(inputs.arch, kind, cfg.model.lora)) <= 16, measured
    assert layer_bytes_per_token(inputs.arch, kind, cfg.model.lora) != layer_bytes_per_token(inputs.arch, kind)
