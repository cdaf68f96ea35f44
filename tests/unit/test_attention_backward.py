"""The exact attention's backward (jetflow.kernels.invariant._Attention), computed a block of
ATTENTION_BACKWARD_ROWS query rows at a time: its gradients lie within an fp32 summation bound of the
float64 truth (as the unblocked fp32 reference's do), and they are the same bits on every run.
(Activation checkpointing on / off: tests/unit/test_activation_checkpointing.py, torch.equal.)"""

from __future__ import annotations

import torch

from jetflow.kernels import invariant as inv

U = 2.0 ** -24  # fp32's unit roundoff


def _inputs(B=2, H=4, Hkv=2, T=300, D=32, seed=0):
    """T = 300: blocks of 128, 128 and 44 rows; row 1 left-padded (its first 40 queries at position 0)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=gen)  # (B, H, T, D)
    k, v = torch.randn(B, Hkv, T, D, generator=gen), torch.randn(B, Hkv, T, D, generator=gen)  # (B, Hkv, S, D)
    pos = torch.arange(T).expand(B, T).clone()  # (B, T)
    pos[1] = (pos[1] - 40).clamp(min=0)
    dout = torch.randn(B, H, T, D, generator=gen)  # (B, H, T, D)
    return q, k, v, pos, dout


def _grads(fn, q, k, v, pos, dout, scale):
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(qg, kg, vg, pos, scale)
    return torch.autograd.grad(out, (qg, kg, vg), dout)


def _blocked(q, k, v, pos, scale):
    return inv.attention(q, k.transpose(2, 3).contiguous(), v, pos, scale)


def _magnitudes(q, k, v, pos, dout, scale):
    """Per element of (dq, dk, dv), float64: the sum of |terms| of its last GEMM, the softmax gradient's
    factor dS = P * (dP - delta) taken as P * (|dP| + |delta|) (its inputs' own errors scale with these)."""
    group = q.shape[1] // k.shape[1]
    q, dout = q.double(), dout.double()
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))  # (B, H, S, D)
    s = (q @ k.transpose(-1, -2)) * scale  # (B, H, T, S)
    future = torch.arange(k.shape[2])[None, None, None, :] > pos[:, None, :, None]
    p = torch.softmax(s.masked_fill(future, float("-inf")), -1)  # (B, H, T, S)
    dp = dout @ v.transpose(-1, -2)  # (B, H, T, S)
    delta = (p * dp).sum(-1, keepdim=True)  # (B, H, T, 1)
    ds = p * (dp.abs() + delta.abs())  # (B, H, T, S)
    dq = ds @ k.abs() * scale  # (B, H, T, D)
    dk = (ds.transpose(-1, -2) @ q.abs() * scale).unflatten(1, (-1, group)).sum(2)  # (B, Hkv, S, D)
    dv = (p.transpose(-1, -2) @ dout.abs()).unflatten(1, (-1, group)).sum(2)  # (B, Hkv, S, D)
    return dq, dk, dv


def test_blocked_backward_within_the_fp32_summation_bound_of_float64():
    """Bound: a sum of n fp32 terms is off by at most n * u * sum |terms| (u = 2^-24), to first order;
    each gradient's last GEMM sums over S or T positions (with factors its prior sums of D, S and T terms
    and the head group made, each off by their own n * u relatively), so every element is held to
    (T + S + D) * G * u * (its sum of |terms|), G the heads per KV head. The unblocked fp32 reference
    (the previous backward) is held to the same bound, and so is the blocked one."""
    q, k, v, pos, dout = _inputs()
    _, H, T, D = q.shape
    scale = D ** -0.5
    truth = _grads(inv.reference_attention, q.double(), k.double(), v.double(), pos, dout.double(), scale)
    n = (T + k.shape[2] + D) * (H // k.shape[1])
    bounds = [n * U * m for m in _magnitudes(q, k, v, pos, dout, scale)]
    for fn in (inv.reference_attention, _blocked):
        for got, ref, bound in zip(_grads(fn, q, k, v, pos, dout, scale), truth, bounds):
            assert bool(((got.double() - ref).abs() <= bound).all()), fn


def test_blocked_backward_is_the_same_bits_every_run():
    """Two runs: torch.equal. The blocks depend on shapes and positions only; a bf16 input's gradient
    comes back in bf16."""
    q, k, v, pos, dout = _inputs(seed=3)
    scale = 0.2
    first = _grads(_blocked, q, k, v, pos, dout, scale)
    again = _grads(_blocked, q, k, v, pos, dout, scale)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    bf = _grads(_blocked, *(t.bfloat16() for t in (q, k, v)), pos, dout.bfloat16(), scale)
    assert all(g.dtype == torch.bfloat16 and bool(g.isfinite().all()) for g in bf)


def test_blocked_backward_only_the_gradients_asked_for():
    q, k, v, pos, dout = _inputs(T=20)
    kt = k.transpose(2, 3).contiguous().requires_grad_()
    out = inv.attention(q, kt, v, pos, 0.3)  # q and v need no gradient
    (dk,) = torch.autograd.grad(out, (kt,), dout)
    ref = _grads(_blocked, q, k, v, pos, dout, 0.3)[1]  # with every gradient asked for
    assert dk.shape == kt.shape and torch.equal(dk.transpose(2, 3), ref)
