"""Where jetflow.run.memory_estimate.SAVED_PER_LAYER comes from: the bytes autograd saves for backward per
token and decoder layer, counted with saved-tensor hooks (each storage once, parameters excluded) over
a training forward of tiny models, and split by finite differences into a_h * h + a_kv * kv + a_i * i.

    PYTHONPATH=. python scripts/analysis/memory_estimate_saved_activations.py

Printed (fp32 master weights, exact numerics, CPU, 2026-11-27):
    fp32    a_h 32.0  a_kv 8.0  a_i 24.0
    bf16    a_h 48.0  a_kv 12.0  a_i 30.0
    unified a_h 20.0  a_kv 8.0  a_i 20.0
"""

from __future__ import annotations


from jetflow.bench.common import saved_activation_bytes
from jetflow.bench.train_step import build_trainers
from jetflow.bench.workload import bench_config, synthetic_experience
from jetflow.train.trainer import response_logprobs


def saved_per_token(mode: str, h: int, i: int, layers: int, heads: int, kv_heads: int, T: int = 256, B: int = 2) -> float:
    cfg = bench_config("tiny", [f"model.tiny.hidden_size={h}", f"model.tiny.intermediate_size={i}",
                                f"model.tiny.num_layers={layers}", f"model.tiny.num_heads={heads}",
                                f"model.tiny.num_kv_heads={kv_heads}", "model.tiny.max_position=4096"])
    trainers, vocab, pad = build_trainers(cfg, (mode,))
    model = trainers[mode].model
    exp = synthetic_experience(B, 16, T - 16, vocab, pad)
    return saved_activation_bytes(model, lambda: response_logprobs(model, exp)) / (B * T)


def main() -> None:
    for mode in ("fp32", "bf16", "unified"):
        base = saved_per_token(mode, 256, 384, 2, 4, 1)  # head_dim 64: kv = 64
        layer = (saved_per_token(mode, 256, 384, 4, 4, 1) - base) / 2
        a_kv = (saved_per_token(mode, 256, 384, 2, 4, 4) - base) / 2 / (4 * 64 - 64)
        a_i = (saved_per_token(mode, 256, 768, 2, 4, 1) - base) / 2 / 384
        a_h = (layer - a_kv * 64 - a_i * 384) / 256
        print(f"{mode:8s}a_h {a_h:.1f}  a_kv {a_kv:.1f}  a_i {a_i:.1f}  (one layer at h=256, kv=64, i=384: {layer:.0f} B)",
              flush=True)


if __name__ == "__main__":
    main()
