"""Arithmetic per trained token of jetflow's exact train step (issue 39's "4096-token responses within 1.3x of
the per-token cost at 256"), counted from the model's shapes, to set the measured ratio beside the one the
FLOPs alone allow.

    python scripts/analysis/long_train_flops.py

What the step computes per column of a packed row (`jetflow bench train-step` with chunked log-probs, activation
checkpointing and packing, exact numerics):
- every linear (the decoder layers' and the lm_head's) forward 3 times (compute_logprobs' no-grad pass, the
  training forward, the checkpoint's / chunked head's recompute in backward) and its two backward GEMMs:
  5 x 2 x params FLOPs;
- attention forward 3 times (2 GEMM-shaped products, QK^T and PV: 4 H D t FLOPs at context t) and its backward
  (jetflow.kernels.invariant._Attention: the scores recomputed, QK^T and PV, then dV, dP, dQ, dK: 6 products):
  3 x 4 H D t + 6 x 2 H D t = 24 H D t per layer;
- a sequence takes its length rounded up to 128 columns on packing's grid (padding columns computed too).
Elementwise work (norms, RoPE, softmax, SiLU, AdamW) is left out. A trained token is a real (prompt or
response) token, as the bench counts them.
"""

from __future__ import annotations

import math

SHAPES = {  # hidden, layers, heads, kv_heads, head_dim, intermediate, vocab
    "SmolLM2-135M": (576, 30, 9, 3, 64, 1536, 49152),
    "Qwen2.5-1.5B": (1536, 28, 12, 2, 128, 8960, 151936),
    "Llama-3.1-8B": (4096, 32, 32, 8, 128, 14336, 128256),
}
GRID = 128


def per_token_flops(shape, prompt: int, response: int) -> tuple[float, float]:
    """(FLOPs per real token, attention's share of them) of one sequence of prompt + response tokens."""
    c, layers, h, hkv, d, inter, vocab = shape
    layer_params = c * h * d * 2 + c * hkv * d * 2 + 3 * c * inter  # q, o; k, v; gate, up, down
    linear = 5 * 2 * (layers * layer_params + c * vocab)  # per column
    n = prompt + response
    columns = math.ceil(n / GRID) * GRID
    mean_context = (n + 1) / 2  # position p attends to p + 1 keys; padding columns left out of the attention
    attention = 24 * h * d * layers * mean_context * n / columns  # per column, averaged over the row
    per_column = linear + attention
    return per_column * columns / n, attention / per_column


def main() -> None:
    print("| model | response | FLOPs / trained token (G) | attention's share | vs 256 |")
    print("|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        base = per_token_flops(shape, 64, 256)[0]
        for response in (256, 1024, 2048, 4096):
            f, share = per_token_flops(shape, 64, response)
            print(f"| {name} | {response} | {f / 1e9:.2f} | {share:.1%} | {f / base:.2f}x |")


if __name__ == "__main__":
    main()
