"""CPU time of one weight gradient: torch's matmul (BLAS) against jetflow.kernels.invariant.weight_grad (the
exact weight gradients' token order), on random fp32 tensors, best of 3.

    PYTHONPATH=. python scripts/analysis/long_train_weight_grad_cost.py
"""

import time

import torch

from jetflow.kernels import invariant as inv

SHAPES = (("head group", 256, 49152, 576), ("mlp up (2112 tok)", 2112, 1536, 576),
          ("mlp down (2112 tok)", 2112, 576, 1536))  # (name, tokens M, N, K): dW (N, K) = g (M, N)^T @ x (M, K)


def cpu_seconds(fn, g: torch.Tensor, x: torch.Tensor, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        fn(g, x)
        best = min(best, time.process_time() - t0)
    return best


if __name__ == "__main__":
    torch.set_num_threads(2)
    for name, m, n, k in SHAPES:
        g, x = torch.randn(m, n), torch.randn(m, k)
        blas = cpu_seconds(lambda a, b: a.t() @ b, g, x)
        exact = cpu_seconds(inv.weight_grad, g, x)
        print(f"{name}: torch mm {blas * 1e3:.0f} ms CPU, weight_grad {exact * 1e3:.0f} ms CPU, ratio {exact / blas:.2f}")
