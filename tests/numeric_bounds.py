"""How far apart two fp32 training trajectories may be when they differ in summation order only.

Two implementations of one training step (TP vs one process, data-parallel ranks vs one process,
Megatron-Core vs the native decoder) add the same terms in other orders. Each fp32 sum then differs by
a few units in the last place of its result, so a loss compared across them must be compared in units
of its own size: at a loss of 20 one fp32 ulp is 1.9e-6, and an absolute bound of 1e-5 is 5 ulps (the
Megatron MoE test failed exactly so on the Intel Xeon kind: 2.85e-5 at a loss of 19.9). AdamW carries
the difference into later steps without shrinking it (its update lr * m / sqrt(v) is scale-free), so
the bound is the same at every step of these short runs.

`loss_gap(a, b)` is |a - b| / max(1, |a|): an absolute difference for losses up to 1, a relative one
above. Each test keeps its own bound on it, and its reason beside the assertion.
"""

from __future__ import annotations

from collections.abc import Iterable


def loss_gap(a: float, b: float) -> float:
    """|a - b| in units of max(1, |a|)."""
    return abs(a - b) / max(1.0, abs(a))


def max_loss_gap(xs: Iterable[float], ys: Iterable[float]) -> float:
    """The largest `loss_gap` of two equally long loss curves, step by step."""
    xs, ys = list(xs), list(ys)
    if len(xs) != len(ys):
        raise AssertionError(f"loss curves of {len(xs)} and {len(ys)} steps")
    return max((loss_gap(a, b) for a, b in zip(xs, ys)), default=0.0)
