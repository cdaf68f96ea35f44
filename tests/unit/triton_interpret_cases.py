"""jetflow's Triton kernels under TRITON_INTERPRET=1 on CPU tensors: the child process of
tests/unit/test_triton_kernels.py, which compares what this writes with the CPU references.

    python tests/unit/triton_interpret_cases.py OUT_DIR [CASE ...]

Writes OUT_DIR/<case>.pt (the inputs and the kernels' outputs of each case) and OUT_DIR/timings.json.
A separate process because `@triton.jit` (triton.language's own functions included) decides when it
is imported whether it compiles or interprets: the pytest process has usually imported triton by then
(vLLM, Megatron), and TRITON_INTERPRET must not leak into its other tests or their subprocesses.

Interpreter workarounds (triton 3.6.0 and 3.9.0, measured):
- in the kernels (jetflow/kernels/triton/_bits.py): fp32 -> bf16 and fp32 -> fp8 are rounded on the
  bits, because the interpreter's casts truncate (bf16) or round ties away and lose the carry (fp8,
  triton PR #11897). The GPU runs the same code, so nothing here is interpreter-only.
- here, test-only (`patch_interpreter_fma`): the interpreter's `tl.fma` rounds twice (x * y + z in
  fp32); it is replaced by a correctly rounded fma (float64, round to odd, then fp32), as the GPU's.
- here, test-only (`patch_interpreter_dot`): the interpreter's `tl.dot` is replaced by a fixed-order
  sum of exact products in float64, rounded once to fp32. The interpreter's own dot reads bf16
  operands as integers (triton #11584), and it calls numpy's BLAS (OpenBLAS), whose result for a row
  depends on the row's position in the tile (measured: rows 6-11 of every 12 differ), which a GPU's
  MMA does not do and which would make decode rows differ from prefill rows for no reason of ours.
"""

from __future__ import annotations

import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (this is a fresh process)

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from jetflow.kernels.triton import _bits, attn as tattn, gemm as tgemm, paged_exact as tpaged, quant as tquant, rmsnorm  # noqa: E402
from jetflow.precision.quant import quantize_blocks  # noqa: E402


def _as_float64(handle) -> np.ndarray:
    """A tensor handle's values as float64 (bf16 and fp8 are stored as raw integers)."""
    dtype = handle.dtype.scalar
    if dtype == tl.bfloat16:
        as_fp32 = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return as_fp32.astype(np.float64)
    if dtype.primitive_bitwidth == 8 and dtype.is_floating():
        return interpreter._convert_float(handle.data, dtype, tl.float16, None).view(np.float16).astype(np.float64)
    return handle.data.astype(np.float64)


def patch_interpreter_dot() -> None:
    """tl.dot(a, b, d) = fp32(sum over k in order of a[i, k] * b[k, j], in float64) + d (see above)."""
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        x, y = _as_float64(a), _as_float64(b)  # (M, K), (K, N)
        if x.ndim != 2:
            raise NotImplementedError("patched interpreter dot: 2-D operands only")
        s = np.zeros((x.shape[0], y.shape[1]), dtype=np.float64)
        for k in range(x.shape[1]):
            s += x[:, k, None] * y[None, k, :]  # products of fp32 / bf16 / fp8 values are exact in fp64
        return interpreter.TensorHandle(s.astype(np.float32) + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


def fma_f32(x, y, z) -> np.ndarray:
    """fp32 fma(x, y, z) with one rounding: x * y is exact in float64, the float64 sum is rounded to odd
    (TwoSum's error moves an even result one ulp toward the true value), and rounding that to fp32 is
    then the single correct rounding (53 >= 24 + 2 bits)."""
    x, y, z = (np.asarray(a, dtype=np.float64) for a in (x, y, z))
    p = x * y
    s = p + z
    bb = s - p
    err = (p - (s - bb)) + (z - bb)  # p + z == s + err exactly
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even & np.isfinite(s), np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def patch_interpreter_fma() -> None:
    """tl.fma with one rounding, as the GPU's fma.rn.f32 (the interpreter computes x * y + z in fp32:
    two roundings)."""
    def create_fma(self, x, y, z):
        return interpreter.TensorHandle(fma_f32(x.data, y.data, z.data), z.dtype.scalar)

    interpreter.InterpreterBuilder.create_fma = create_fma


# --- a kernel to check the bit-level roundings one by one --------------------------------------
@triton.jit
def _roundings_kernel(x_ptr, bf16_ptr, e4m3_ptr, s_ptr, pow2_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(bf16_ptr + i, _bits.round_to_bf16(x))
    tl.store(e4m3_ptr + i, _bits.fp32_to_e4m3(tl.minimum(tl.maximum(x, -448.0), 448.0)))
    tl.store(pow2_ptr + i, _bits.pow2_at_or_above(tl.load(s_ptr + i)))


CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _e4m3_grid() -> torch.Tensor:
    """Every finite E4M3 value, the midpoints between neighbours (the ties) and a hair either side."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].unique()  # sorted, includes -448 .. 448
    mids = (vals[1:].double() + vals[:-1].double()) / 2
    hair = torch.nextafter(mids.float(), torch.tensor(float("inf"))), torch.nextafter(mids.float(), torch.tensor(-1e9))
    return torch.cat([vals, mids.float(), *hair])


@case
def roundings():
    gen = torch.Generator().manual_seed(0)
    x = _e4m3_grid()
    bf = torch.randn(2000, generator=gen) * torch.logspace(-30, 30, 2000)
    ties = (bf.bfloat16().float().view(torch.int32) + 0x8000).view(torch.float32)  # exactly halfway
    x = torch.cat([x, bf, ties, torch.tensor([0.0, -0.0, 2.0**-10, -(2.0**-10), 1e-30, 448.0, 3e38])])
    e = torch.arange(-40, 4).double()
    k = torch.arange(0, 10).double()
    s = (2.0 ** e[:, None] * (1 + k[None, :] * 2.0**-23)).flatten().float()  # just above powers of two
    s = torch.cat([s, (torch.rand(1000, generator=gen) * 1e-3).clamp(min=1e-12)])
    n = triton.next_power_of_2(max(len(x), len(s)))
    x = torch.cat([x, torch.zeros(n - len(x))])
    s = torch.cat([s, torch.ones(n - len(s))])
    out = {"x": x, "s": s, "bf16": torch.empty(n, dtype=torch.bfloat16),
           "e4m3": torch.empty(n, dtype=torch.float8_e4m3fn), "pow2": torch.empty(n)}
    _roundings_kernel[(1,)](x, out["bf16"], out["e4m3"], s, out["pow2"], N=n)
    return out


def _wide_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows whose groups span many decades, an all-zero group and an exact-448-multiple value."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-12, 3, k)
    x[min(3, m - 1), :128] = 0
    x[0, 5] = 448 * 1e-3
    return x


@case
def quantize():
    out = {}
    x = _wide_activations(37, 300, 1)
    out["x"] = x
    for rule in ("fp32", "pow2"):
        for margin in (0, 1):
            d, s = tquant.quantize_1x128(x, rule, margin)
            out[f"{rule}_{margin}_data"], out[f"{rule}_{margin}_scale"] = d, s
    xb = (torch.randn(20, 256, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    out["xb"] = xb
    out["xb_data"], out["xb_scale"] = tquant.quantize_1x128(xb)
    out["row1_data"], out["row1_scale"] = tquant.quantize_1x128(x[5:6])  # one row alone
    bad = torch.randn(3, 200, generator=torch.Generator().manual_seed(3))
    bad[1, 150], bad[2, 3] = float("inf"), float("nan")
    out["bad_scale"] = tquant.quantize_1x128(bad)[1]
    return out


def _fp8_operands(m: int, n: int, k: int, seed: int, rule: str, b_block: tuple[int, int]):
    gen = torch.Generator().manual_seed(seed)
    a = quantize_blocks(torch.randn(m, k, generator=gen) * 2, (1, 128), scale_rule=rule)
    b = quantize_blocks(torch.randn(n, k, generator=gen) * 0.05, b_block, scale_rule=rule)
    return a, b


def _gemm(a, b, out_dtype):
    return tgemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, b.block[0], out_dtype)


@case
def fp8_gemm():
    out = {}
    for rule in ("fp32", "pow2"):
        a, b = _fp8_operands(64, 320, 300, 4, rule, (128, 128))
        out.update({f"{rule}_a": a.data, f"{rule}_sa": a.scale_inv, f"{rule}_b": b.data, f"{rule}_sb": b.scale_inv})
        out[f"{rule}_fp32"] = _gemm(a, b, torch.float32)
        out[f"{rule}_bf16"] = _gemm(a, b, torch.bfloat16)
    a, b = _fp8_operands(64, 320, 300, 4, "fp32", (128, 128))
    out["row0_alone"] = _gemm(_rows(a, [0]), b, torch.float32)  # M = 1
    out["row0_at_37"] = _gemm(_rows(a, [1] * 37 + [0] + [2] * 5), b, torch.float32)[37]  # row 0 at tile row 37
    return out


def _rows(q, idx):
    from jetflow.precision.quant import QuantizedTensor
    return QuantizedTensor(q.data[idx], q.scale_inv[idx], q.block)


@case
def fp8_gemm_backward_layouts():
    """dgrad dY (M, N) @ W (N, K): b = W^T's bytes and blocks (a transposed view); wgrad dY^T @ X with
    both operands 1x128 along the tokens (M = 200: a partial last block)."""
    gen = torch.Generator().manual_seed(5)
    m, n, k = 200, 256, 320
    w = quantize_blocks(torch.randn(n, k, generator=gen) * 0.05, (128, 128))
    dy = torch.randn(m, n, generator=gen) * 1e-3
    x = torch.randn(m, k, generator=gen)
    gq = quantize_blocks(dy, (1, 128))
    wt = w.t()
    dgrad = tgemm.fp8_gemm(gq.data, gq.scale_inv, wt.data, wt.scale_inv, 128, torch.float32)  # (M, K)
    gcol, xcol = quantize_blocks(dy, (128, 1)), quantize_blocks(x, (128, 1))
    gt, xt = gcol.t(), xcol.t()
    wgrad = tgemm.fp8_gemm(gt.data, gt.scale_inv, xt.data, xt.scale_inv, 1, torch.float32)  # (N, K)
    return {"w": w.data, "sw": w.scale_inv, "g": gq.data, "sg": gq.scale_inv, "dgrad": dgrad,
            "gcol": gcol.data, "sgcol": gcol.scale_inv, "xcol": xcol.data, "sxcol": xcol.scale_inv, "wgrad": wgrad}


@case
def gemm_tensor_parallel_shards():
    """K = 512 (4 blocks: tree_width 4): the full product, and at TP = 2 the two shards' subtrees
    (groups = 2 each), for the FP8 and the dense bf16 GEMM."""
    from jetflow.kernels.canonical import tree_sum
    a, b = _fp8_operands(8, 64, 512, 9, "fp32", (128, 128))
    out = {"a": a.data, "sa": a.scale_inv, "b": b.data, "sb": b.scale_inv, "fp8_full": _gemm(a, b, torch.float32)}
    halves = [tgemm.fp8_gemm(a.data[:, h * 256:(h + 1) * 256], a.scale_inv[:, 2 * h:2 * h + 2],
                             b.data[:, h * 256:(h + 1) * 256], b.scale_inv[:, 2 * h:2 * h + 2], 128, torch.float32,
                             groups=2) for h in range(2)]
    out["fp8_tp2"] = tree_sum(halves)
    out["fp8_one_group"] = tgemm.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, 128, torch.float32, groups=1)
    gen = torch.Generator().manual_seed(10)
    x, w = torch.randn(8, 512, generator=gen), torch.randn(64, 512, generator=gen)
    out["dense_full"] = tgemm.dense_gemm(x, w, "bf16")
    out["dense_tp2"] = tree_sum([tgemm.dense_gemm(x[:, h * 256:(h + 1) * 256].contiguous(),
                                                  w[:, h * 256:(h + 1) * 256].contiguous(), "bf16", groups=2)
                                 for h in range(2)])
    return out


@case
def dense_gemm():
    gen = torch.Generator().manual_seed(6)
    a, b = torch.randn(64, 200, generator=gen), torch.randn(96, 200, generator=gen)
    out = {"a": a, "b": b}
    for dot in ("fp32", "bf16"):
        out[dot] = tgemm.dense_gemm(a, b, dot)
        out[f"{dot}_row0_alone"] = tgemm.dense_gemm(a[:1], b, dot)
        out[f"{dot}_row0_at_37"] = tgemm.dense_gemm(a[[1] * 37 + [0] + [2] * 5], b, dot)[37]
    out["bf16_out"] = tgemm.dense_gemm(a, b, "bf16", torch.bfloat16)
    return out


def _qkv(dtype, seed, B=2, H=4, Hkv=2, T=70, D=32):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=gen).to(dtype) for h in (H, Hkv, Hkv))
    return q, k, v


DECODE_STEPS = (0, 1, 63, 64, 69)  # first slot, inside the first block, its last slot, the next block


@case
def attention():
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        q, k, v = _qkv(dtype, 7)
        B, _, T, D = q.shape
        pos = torch.arange(T).expand(B, T).contiguous()
        scale = D**-0.5
        out[f"{name}_q"], out[f"{name}_k"], out[f"{name}_v"] = q, k, v
        out[f"{name}_prefill"] = tattn.attention(q, k, v, pos, scale)
        for t in DECODE_STEPS:  # a decode step: one token per row, the cache holding slots 0..t
            out[f"{name}_decode_{t}"] = tattn.attention(q[:, :, t:t + 1], k, v, pos[:, t:t + 1], scale)
        kt = k.transpose(-1, -2).contiguous()  # the exact KV cache's layout (B, H_kv, D, S)
        out[f"{name}_kt"] = tattn.attention(q, kt.transpose(-1, -2), v, pos, scale)
    # rows at different positions in one decode call (a batch of sequences of different lengths)
    q, k, v = _qkv(torch.float32, 8, B=3, T=1)
    kk, vv = _qkv(torch.float32, 9, B=3, T=90)[1:]
    rowpos = torch.tensor([[5], [70], [89]])
    out.update(mixed_q=q, mixed_k=kk, mixed_v=vv, mixed_pos=rowpos,
               mixed=tattn.attention(q, kk, vv, rowpos, 32**-0.5))
    return out


def _paged(k: torch.Tensor, page: int, seed: int):
    """(B, H_kv, S, D) -> pages (P, H_kv, page, D) in shuffled order and the block table (B, S/page)."""
    B, Hkv, S, D = k.shape
    n = S // page
    perm = torch.randperm(B * n, generator=torch.Generator().manual_seed(seed))
    pages = torch.zeros(B * n + 3, Hkv, page, D, dtype=k.dtype)  # spare pages stay unused
    table = perm.view(B, n).to(torch.int32)
    for b in range(B):
        for j in range(n):
            pages[table[b, j]] = k[b, :, j * page:(j + 1) * page]
    return pages, table


@case
def attention_paged_fp8():
    out = {}
    q, k, v = _qkv(torch.bfloat16, 10, T=80)
    B, _, T, D = q.shape
    pos = torch.arange(T).expand(B, T).contiguous()
    contiguous = tattn.attention(q, k, v, pos, D**-0.5)
    kp, table = _paged(k, 16, 11)
    vp, _ = _paged(v, 16, 11)
    out.update(q=q, k=k, v=v, contiguous=contiguous, paged=tattn.attention(q, kp, vp, pos, D**-0.5, block_table=table))
    # FP8 (E4M3) K/V with per-tensor scales, paged, bf16 and fp32 queries
    ks, vs = k.float().abs().amax() / 448, v.float().abs().amax() / 448
    k8, v8 = (k.float() / ks).to(torch.float8_e4m3fn), (v.float() / vs).to(torch.float8_e4m3fn)
    k8p, _ = _paged(k8.view(torch.uint8), 16, 11)
    v8p, _ = _paged(v8.view(torch.uint8), 16, 11)
    k8p, v8p = k8p.view(torch.float8_e4m3fn), v8p.view(torch.float8_e4m3fn)
    out.update(k8=k8, v8=v8, ks=ks, vs=vs)
    for name, qq in (("bf16", q), ("fp32", q.float())):
        out[f"fp8_{name}"] = tattn.attention(qq, k8p, v8p, pos, D**-0.5, block_table=table, k_scale=ks, v_scale=vs)
        out[f"fp8_{name}_decode_69"] = tattn.attention(qq[:, :, 69:70], k8p, v8p, pos[:, 69:70], D**-0.5,
                                                       block_table=table, k_scale=ks, v_scale=vs)
    return out


@case
def attention_pool_pages():
    """attn.attention reading the exact pool's layout (K^T pages (N, H_kv, D, 64), V (N, H_kv, 64, D)) through
    a block table, as jetflow.model.paged_attention does on CUDA, vs the same slots contiguous: decode rows
    at positions 70 and 5, fp32 and bf16 queries; fp32 and E4M3 pages (vs code * scale, dense)."""
    gen = torch.Generator().manual_seed(22)
    k, v = torch.randn(2, 1, 128, 16, generator=gen), torch.randn(2, 1, 128, 16, generator=gen)  # (B, H_kv, S, D)
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    kt_pages, v_pages = torch.zeros(4, 1, 16, 64), torch.zeros(4, 1, 64, 16)
    for b in range(2):
        for j in range(2):
            kt_pages[table[b, j]] = k[b, :, j * 64:(j + 1) * 64].transpose(-1, -2)
            v_pages[table[b, j]] = v[b, :, j * 64:(j + 1) * 64]
    q, pos = torch.randn(2, 2, 1, 16, generator=gen), torch.tensor([[70], [5]])
    out = {}
    for name, qq in (("fp32", q), ("bf16", q.bfloat16())):
        out[name] = tattn.attention(qq, kt_pages.transpose(-1, -2), v_pages, pos, 0.25, block_table=table)
        out[f"{name}_contiguous"] = tattn.attention(qq, k, v, pos, 0.25)
    # E4M3 pages vs their values code * scale stored densely (what PagedKVCache.gather gives)
    ks, vs = 0.0107, 0.0093
    k8, v8 = (k / ks).to(torch.float8_e4m3fn), (v / vs).to(torch.float8_e4m3fn)
    kt8, v8p = (kt_pages / ks).to(torch.float8_e4m3fn), (v_pages / vs).to(torch.float8_e4m3fn)
    for name, qq in (("fp32", q), ("bf16", q.bfloat16())):
        out[f"fp8_{name}"] = tattn.attention(qq, kt8.transpose(-1, -2), v8p, pos, 0.25, block_table=table,
                                             k_scale=ks, v_scale=vs)
        kd, vd = (k8.float() * ks).to(qq.dtype), (v8.float() * vs).to(qq.dtype)
        out[f"fp8_{name}_contiguous"] = tattn.attention(qq, kd, vd, pos, 0.25)
    return out


def _exact_pages(fmt: str, seed: int):
    """Pages in jetflow.model.paged_cache's layout: K (N, H_kv, D, 64), V (N, H_kv, 64, D), one KV head
    (the interpreter runs a program per KV head: seconds each), D = 8, 5 pages (one spare); fp32, bf16 or
    E4M3 codes with their scales."""
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(5, 1, 8, 64, generator=gen), torch.randn(5, 1, 64, 8, generator=gen)
    if fmt == "bf16":
        return k.bfloat16(), v.bfloat16(), 1.0, 1.0
    if fmt == "fp8":
        ks, vs = 0.0107, 0.0093
        return (k / ks).to(torch.float8_e4m3fn), (v / vs).to(torch.float8_e4m3fn), ks, vs
    return k, v, 1.0, 1.0


@case
def paged_exact():
    """paged_exact.paged_attention: a 6-query chunk at positions 62..67 (across a page boundary, 2 query
    heads on 1 KV head) per page format, and with E4M3 pages a decode step of two rows at positions 67
    and 20."""
    gen = torch.Generator().manual_seed(20)
    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)  # shuffled pages; page 4 unused
    q = torch.randn(2, 2, 6, 8, generator=gen)
    pos = torch.arange(62, 68).expand(2, 6).contiguous()
    x, y, z = (torch.randn(300, generator=gen) * 2.0 ** torch.randint(-12, 12, (300,), generator=gen) for _ in range(3))
    out = {"table": table, "q": q, "pos": pos, "fma": (x, y, z, torch.from_numpy(fma_f32(x.numpy(), y.numpy(), z.numpy())))}
    for fmt in ("fp32", "bf16", "fp8"):
        k, v, ks, vs = _exact_pages(fmt, 21)
        out[fmt] = {"k": k, "v": v, "ks": ks, "vs": vs,
                    "chunk": tpaged.paged_attention(q[:1], k, v, table[:1], pos[:1], 8**-0.5, ks, vs)}
        if fmt == "fp8":
            dq = torch.stack([q[0, :, 5:6], q[1, :, 0:1]])  # (2, 2, 1, 8): row 0 = the chunk's last query
            out[fmt]["decode_q"] = dq
            out[fmt]["decode"] = tpaged.paged_attention(dq, k, v, table, torch.tensor([[67], [20]]), 8**-0.5,
                                                             ks, vs)
    return out


@case
def rms_norm():
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(40, 576, generator=gen) * 3  # 576: a width that is not a power of two (SmolLM2)
    w = 1 + 0.1 * torch.randn(576, generator=gen)
    out = {"x": x, "w": w, "y": rmsnorm.rms_norm(x, w, 1e-5), "row_alone": rmsnorm.rms_norm(x[17:18], w, 1e-5)}
    out["y_bf16_in"] = rmsnorm.rms_norm(x.bfloat16(), w, 1e-5)
    return out


@case
def microscaled_gemm():
    """The mxfp8 / nvfp4 GEMMs (jetflow.kernels.triton.microscaled): K = 320 (a partial K block; 40 rows of
    N: a partial tile of 16x16 weight tiles) and K = 512 (4 canonical groups), a row alone."""
    from jetflow.kernels.triton import microscaled as tms
    from jetflow.precision.mx import quantize_mx
    from jetflow.precision.nvfp4 import quantize_nvfp4

    gen = torch.Generator().manual_seed(13)
    out = {}
    for k in (320, 512):
        x = torch.randn(20, k, generator=gen) * torch.logspace(-3, 2, 20)[:, None]
        w = torch.randn(40, k, generator=gen) * 0.05
        xm, wm = quantize_mx(x), quantize_mx(w)
        xn, wn = quantize_nvfp4(x, per_row=True), quantize_nvfp4(w, (16, 16))
        out[f"mx_{k}"] = {"a": xm.__getstate__(), "b": wm.__getstate__(),
                          "fp32": tms.mx_gemm(xm.data, xm.scale, wm.data, wm.scale),
                          "bf16": tms.mx_gemm(xm.data, xm.scale, wm.data, wm.scale, torch.bfloat16),
                          "row3": tms.mx_gemm(xm.data[3:4], xm.scale[3:4], wm.data, wm.scale)}
        args = (wn.data, wn.scale, wn.tensor_scale, k, 16)
        out[f"nv_{k}"] = {"a": xn.__getstate__(), "b": wn.__getstate__(),
                          "fp32": tms.nvfp4_gemm(xn.data, xn.scale, xn.tensor_scale, *args),
                          "row3": tms.nvfp4_gemm(xn.data[3:4], xn.scale[3:4], xn.tensor_scale[3:4], *args)}
    out["nv_512"]["one_group"] = tms.nvfp4_gemm(xn.data, xn.scale, xn.tensor_scale, *args, groups=1)
    return out


def main(out_dir: str, names: list[str]) -> None:
    patch_interpreter_dot()
    patch_interpreter_fma()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    timings = {}
    for name in names or CASES:
        t0 = time.perf_counter()
        result = CASES[name]()
        timings[name] = round(time.perf_counter() - t0, 3)
        torch.save(result, out / f"{name}.pt")
    (out / "timings.json").write_text(json.dumps({"triton": triton.__version__, "seconds": timings}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
