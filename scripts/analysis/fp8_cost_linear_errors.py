"""Each quantizable linear's own error under 128- and 32-wide blocks, on the activations it sees: the
relative error of its output (x_q @ w_q^T against x @ w^T in fp32) and of each operand's quantization,
on a batch sampled from a run's model as `jetflow audit` samples it (the bf16 trainer's copy).

    python scripts/analysis/fp8_cost_linear_errors.py RUN_DIR [prompts]
"""

from __future__ import annotations

import copy
import sys

import torch

from jetflow.bench.audit import audit_config, quantized_linears, rollout_batch
from jetflow.config import derive
from jetflow.precision import QuantRecipe
from jetflow.precision.quant import dequantize, quantize_blocks
from jetflow.run.build import apply_mode, load_inputs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main(run_dir: str, prompts: int = 8) -> None:
    cfg, model = audit_config(run_dir, None, ["rollout.group_size=4"])
    assert model is not None
    bf16 = copy.deepcopy(cfg)
    bf16.precision.mode, bf16.precision.numerics = "bf16", "fast"
    apply_mode(model, derive(bf16).precision, "trainer")
    exp, _, _ = rollout_batch(cfg, model, load_inputs(cfg), prompts)
    linears = quantized_linears(model, QuantRecipe())
    inputs: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: inputs.__setitem__(n, a[0].detach().reshape(-1, a[0].shape[-1])))
             for n, m in linears.items()]
    with torch.no_grad():
        model.forward_hidden(exp.input_ids, attention_mask=exp.attention_mask)
    for h in hooks:
        h.remove()
    print(f"{run_dir}: {int(exp.response_mask.sum())} response tokens\n")
    print("| linear | shape | output err, 128 / 32 | activation err, 1x128 / 1x32 | weight err, 128x128 / 32x32 |")
    print("|---|---|---|---|---|")
    for name, m in linears.items():
        x, w = inputs[name], m.weight.detach().float()  # (M, K), (N, K)
        xq = {g: dequantize(quantize_blocks(x, (1, g))) for g in (128, 32)}
        wq = {b: dequantize(quantize_blocks(w, (b, b))) for b in (128, 32)}
        ref = x @ w.t()
        out = {b: rel(xq[b] @ wq[b].t(), ref) for b in (128, 32)}
        print(f"| {name} | {tuple(w.shape)} | {out[128]:.4f} / {out[32]:.4f} | {rel(xq[128], x):.4f} / "
              f"{rel(xq[32], x):.4f} | {rel(wq[128], w):.4f} / {rel(wq[32], w):.4f} |")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
