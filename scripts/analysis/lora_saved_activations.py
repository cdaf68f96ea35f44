"""Where jetflow.run.memory_estimate.SAVED_PER_LAYER_LORA comes from: the bytes autograd saves for backward per
token and decoder layer under model.lora (default targets), counted with saved-tensor hooks (each storage once,
parameters excluded) over a training forward of tiny models (the difference of 4 and 2 layers), split by finite
differences into a_h * h + a_kv * kv + a_i * i + a_r * rank.

    python scripts/analysis/lora_saved_activations.py

Printed (fp32 master weights, exact numerics, CPU, 2026-12-07):
    unified a_h 24.03 a_kv 8.0 a_i 24.0 a_r 28.0
    fp32    a_h 24.03 a_kv 8.0 a_i 24.0 a_r 28.0
    bf16    a_h 48.03 a_kv 8.0 a_i 28.0 a_r 28.0
(a_r = 4 B x the 7 adapted linears of a layer; tests/unit/test_lora_memory.py checks the formula at another shape.)
"""

from __future__ import annotations


from jetflow.bench.common import saved_activation_bytes
from jetflow.bench.workload import synthetic_experience
from jetflow.config import derive, load_config
from jetflow.run.build import apply_mode, build_model, load_inputs, with_lora
from jetflow.train.trainer import response_logprobs


def saved_per_token(mode: str, rank: int, h: int, i: int, layers: int, kv_heads: int, T: int = 256, B: int = 2) -> float:
    cfg = load_config("configs/tiny.yaml", [
        f"precision.mode={mode}", f"model.lora.rank={rank}", "precision.numerics=exact", f"model.tiny.hidden_size={h}",
        f"model.tiny.intermediate_size={i}", f"model.tiny.num_layers={layers}", "model.tiny.num_heads=4",
        f"model.tiny.num_kv_heads={kv_heads}", "model.tiny.max_position=4096"])
    inputs = load_inputs(cfg)
    model = with_lora(apply_mode(build_model(cfg, inputs.arch, inputs.tokenizer), derive(cfg).precision, "trainer"),
                      cfg, "trainer")
    exp = synthetic_experience(B, 16, T - 16, model.config.vocab_size, 0)
    return saved_activation_bytes(model, lambda: response_logprobs(model, exp)) / (B * T)


def per_layer(mode: str, rank: int, h: int, i: int, kv_heads: int) -> float:
    return (saved_per_token(mode, rank, h, i, 4, kv_heads) - saved_per_token(mode, rank, h, i, 2, kv_heads)) / 2


if __name__ == "__main__":
    for mode in ("unified", "fp32", "bf16"):  # h 256 (4 heads of 64), kv 128 (2 kv heads), i 768, rank 16
        base = per_layer(mode, 16, 256, 768, 2)
        a_i = (per_layer(mode, 16, 256, 1536, 2) - base) / 768
        a_kv = (per_layer(mode, 16, 256, 768, 4) - base) / 128
        a_r = (per_layer(mode, 32, 256, 768, 2) - base) / 16
        a_h = (base - a_i * 768 - a_kv * 128 - a_r * 16) / 256
        print(f"{mode:<7} a_h {a_h:.2f} a_kv {a_kv} a_i {a_i} a_r {a_r}")
