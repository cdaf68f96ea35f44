"""Batch-invariant GEMMs for CUDA: block-scaled FP8 (the recipe's fprop, dgrad and wgrad) and dense.

    c = fp8_gemm(a, sa, b, sb, b_rows_per_scale, out_dtype)   # a (M, K) fp8 @ b (N, K)^T -> (M, N)
    c = dense_gemm(a, b, dot="bf16" | "fp32", out_dtype)      # a (M, K) @ b (N, K)^T -> (M, N)

Invariance: a row's result depends on that row and the weight only, never on M, the batch or the
tensor-parallel split of K. Each output tile computes the canonical reduction of
jetflow.kernels.canonical (no split-K, no stream-K): each 128-wide K block's partial from 0, `groups`
groups of blocks summed in order, the group sums combined by the pairwise tree; the tile
configuration is chosen from (N, K) alone (`fp8_config`, `dense_config`), so the same instructions
compute a row whether it is one of 1 or of 8192 rows. Rows past M load a copy of row 0 (never stored).

FP8 arithmetic, per output element (i, n) (DeepSeek-V3's scaling, with its promotion every 128 K):
    for each group g:                           # `groups` contiguous runs of 128-wide K blocks
        s_g = 0
        for kb in the group's blocks, in order:
            partial = sum_k a8[i, k] * b8[n, k]    # tl.dot on the FP8 bytes, fp32 (products are exact)
            s_g = s_g + partial * (sa[i, kb] * sb[n // b_rows_per_scale, kb])
    c = tree(s_0, s_1, ...) (fp32) or that rounded to bf16 (nearest even)
a: 1x128 groups (sa (M, ceil(K/128))); b: 128x128 blocks (b_rows_per_scale = 128, sb (ceil(N/128),
ceil(K/128))) or 1x128 groups (1, sb (N, ceil(K/128))). The same kernel serves the FP8 linear's three
GEMMs: fprop X @ W^T, dgrad dY @ W (b = W^T's bytes, blocks transposed) and wgrad dY^T @ X (both
operands 1x128 along tokens). `jetflow.kernels.triton.reference.fp8_gemm` is the same arithmetic in
torch. The GPU's FP8 MMA sums a block's 128 products in its own order and precision, so `partial` is
the exact sum only up to that; the rest of the chain is IEEE fp32 (no FMA contraction).

Dense: per 128-K block partial = tl.dot(a, b, partial) over its BLOCK_K steps from 0, then the groups
and the tree as above, with bf16 operands (`dot="bf16"`: values rounded
to bf16, nearest even, products exact, fp32 accumulation on the tensor cores) or fp32 operands
(`dot="fp32"`: input_precision="ieee", an FMA chain on the CUDA cores; slow, but no TF32 rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from jetflow.kernels.canonical import tree_width
from jetflow.kernels.triton._bits import round_to_bf16, to_bf16

SCALE_BLOCK = 128  # K block = the recipe's scale group: one scale multiply per block
K_BLOCK = tl.constexpr(SCALE_BLOCK)  # the same, readable inside the kernels
FP_FUSION = False  # no a*b+c -> fma contraction: the interpreter (numpy) never fuses


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def fp8_config(n: int, k: int) -> TileConfig:
    """The FP8 GEMM's one tile configuration for a weight of (N, K): never a function of M."""
    return TileConfig(block_m=128, block_n=128, block_k=SCALE_BLOCK, group_m=8, num_warps=8, num_stages=4)


def dense_config(n: int, k: int, dot: str) -> TileConfig:
    """The dense GEMM's one tile configuration per (N, K, operand precision): never a function of M."""
    if dot == "bf16":
        return TileConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
    return TileConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=2)


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program: column-major groups of GROUP_M row tiles (L2 reuse of B)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _store(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn, OUT_BF16: tl.constexpr):
    ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if OUT_BF16:
        tl.store(ptrs, round_to_bf16(acc), mask=mask)
    else:
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def _fp8_group(a_ptr, b_ptr, sa_ptr, sb_ptr, rm, rn, K, stride_am, stride_ak, stride_bn, stride_bk, stride_sak,
               stride_sbk, first_block, num_blocks, B_ROWS_PER_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One canonical group: 0 + each 128-K block's partial (tl.dot on the FP8 bytes) * (sa * sb), in order."""
    offs_k = tl.arange(0, BLOCK_K)  # (BK,)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(first_block, first_block + num_blocks):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptr + rm[:, None] * stride_am + (kb * BLOCK_K + offs_k)[None, :] * stride_ak,
                    mask=k_ok[None, :], other=0.0)  # (BM, BK) fp8
        b = tl.load(b_ptr + (kb * BLOCK_K + offs_k)[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=k_ok[:, None], other=0.0)  # (BK, BN) fp8
        partial = tl.dot(a, b)  # (BM, BN) fp32, a fresh sum per K block
        sa = tl.load(sa_ptr + kb * stride_sak)  # (BM,): sa_ptr points at the tile's rows
        sb = tl.load(sb_ptr + kb * stride_sbk)  # (BN,): sb_ptr at the columns' scale rows
        acc = acc + partial * (sa[:, None] * sb[None, :])
    return acc


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K,
                     stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                     stride_sam, stride_sak, stride_sbn, stride_sbk,
                     B_ROWS_PER_SCALE: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, GROUPS: tl.constexpr):
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    rm = tl.where(offs_m < M, offs_m, 0).to(tl.int64)  # rows past M read row 0
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    sa_rows = sa_ptr + rm * stride_sam  # (BM,)
    sb_rows = sb_ptr + (rn // B_ROWS_PER_SCALE) * stride_sbn  # (BN,)
    per = tl.cdiv(K, BLOCK_K) // GROUPS  # blocks per group
    # the canonical tree over GROUPS group sums (1, 2, 4 or 8): ((g0 + g1) + (g2 + g3)) + ...
    acc = _fp8_group(a_ptr, b_ptr, sa_rows, sb_rows, rm, rn, K, stride_am, stride_ak, stride_bn, stride_bk,
                     stride_sak, stride_sbk, 0, per, B_ROWS_PER_SCALE, BLOCK_M, BLOCK_N, BLOCK_K)
    if GROUPS >= 2:
        acc = acc + _fp8_group(a_ptr, b_ptr, sa_rows, sb_rows, rm, rn, K, stride_am, stride_ak, stride_bn, stride_bk,
                               stride_sak, stride_sbk, per, per, B_ROWS_PER_SCALE, BLOCK_M, BLOCK_N, BLOCK_K)
    if GROUPS >= 4:
        right = _fp8_group(a_ptr, b_ptr, sa_rows, sb_rows, rm, rn, K, stride_am, stride_ak, stride_bn, stride_bk,
                           stride_sak, stride_sbk, 2 * per, per, B_ROWS_PER_SCALE, BLOCK_M, BLOCK_N, BLOCK_K)
        right = right + _fp8_group(a_ptr, b_ptr, sa_rows, sb_rows, rm, rn, K, stride_am, stride_ak, stride_bn,
                                   stride_bk, stride_sak, stride_sbk, 3 * per, per, B_ROWS_PER_SCALE, BLOCK_M, BLOCK_N,
                                   BLOCK_K)
        acc = acc + right
    if GROUPS >= 8:
        upper = _fp8_group(a_ptr, b_ptr, sa_rows, sb_rows, rm, rn, K, stride_am, stride_ak, stride_bn, stride_bk,
                           stride_sak, stride_sbk, 4 * per, per, B_ROWS_PER_SCALE, BLOCK_M, BLOCK_N, BLOCK_K)
        upper = upper + _fp8_group(a_ptr, b_ptr, sa_rows, sb_rows, rm, rn, K, stride_am, stride_ak, stride_bn,
                                   stride_bk, stride_sak, stride_sbk, 5 * per, per, B_ROWS_PER_SCALE, BLOCK_M, BLOCK_N,
                                   BLOCK_K)
        right = _fp8_group(a_ptr, b_ptr, sa_rows, sb_rows, rm, rn, K, stride_am, stride_ak, stride_bn, stride_bk,
                           stride_sak, stride_sbk, 6 * per, per, B_ROWS_PER_SCALE, BLOCK_M, BLOCK_N, BLOCK_K)
        right = right + _fp8_group(a_ptr, b_ptr, sa_rows, sb_rows, rm, rn, K, stride_am, stride_ak, stride_bn,
                                   stride_bk, stride_sak, stride_sbk, 7 * per, per, B_ROWS_PER_SCALE, BLOCK_M, BLOCK_N,
                                   BLOCK_K)
        acc = acc + (upper + right)
    _store(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn, OUT_BF16)


@triton.jit
def _dense_group(a_ptr, b_ptr, rm, rn, K, stride_am, stride_ak, stride_bn, stride_bk, first_block, num_blocks,
                 DOT_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One canonical group: 0 + each 128-K block's partial (a chain of BLOCK_K dots from 0), in order."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(first_block, first_block + num_blocks):
        partial = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for sub in range(0, K_BLOCK // BLOCK_K):
            k0 = kb * K_BLOCK + sub * BLOCK_K
            k_ok = offs_k < K - k0
            a = tl.load(a_ptr + rm[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak, mask=k_ok[None, :],
                        other=0.0)
            b = tl.load(b_ptr + (k0 + offs_k)[:, None] * stride_bk + rn[None, :] * stride_bn, mask=k_ok[:, None],
                        other=0.0)
            if DOT_BF16:
                partial = tl.dot(to_bf16(a), to_bf16(b), partial)
            else:
                partial = tl.dot(a.to(tl.float32), b.to(tl.float32), partial, input_precision="ieee")
        acc = acc + partial
    return acc


@triton.jit(do_not_specialize=["M"])
def _dense_gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                       DOT_BF16: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, GROUPS: tl.constexpr):
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    per = tl.cdiv(K, K_BLOCK) // GROUPS
    acc = _dense_group(a_ptr, b_ptr, rm, rn, K, stride_am, stride_ak, stride_bn, stride_bk, 0, per, DOT_BF16,
                       BLOCK_M, BLOCK_N, BLOCK_K)
    if GROUPS >= 2:
        acc = acc + _dense_group(a_ptr, b_ptr, rm, rn, K, stride_am, stride_ak, stride_bn, stride_bk, per, per,
                                 DOT_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
    if GROUPS >= 4:
        right = _dense_group(a_ptr, b_ptr, rm, rn, K, stride_am, stride_ak, stride_bn, stride_bk, 2 * per, per,
                             DOT_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
        right = right + _dense_group(a_ptr, b_ptr, rm, rn, K, stride_am, stride_ak, stride_bn, stride_bk, 3 * per,
                                     per, DOT_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
        acc = acc + right
    if GROUPS >= 8:
        upper = _dense_group(a_ptr, b_ptr, rm, rn, K, stride_am, stride_ak, stride_bn, stride_bk, 4 * per, per,
                             DOT_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
        upper = upper + _dense_group(a_ptr, b_ptr, rm, rn, K, stride_am, stride_ak, stride_bn, stride_bk, 5 * per,
                                     per, DOT_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
        right = _dense_group(a_ptr, b_ptr, rm, rn, K, stride_am, stride_ak, stride_bn, stride_bk, 6 * per, per,
                             DOT_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
        right = right + _dense_group(a_ptr, b_ptr, rm, rn, K, stride_am, stride_ak, stride_bn, stride_bk, 7 * per,
                                     per, DOT_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
        acc = acc + (upper + right)
    _store(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn, OUT_BF16)


def _out(m: int, n: int, out_dtype: torch.dtype, device) -> torch.Tensor:
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype {out_dtype}: the kernels write float32 or bfloat16")
    return torch.empty(m, n, dtype=out_dtype, device=device)


def _k_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Unit stride along K (the last dim), so that tiles load as rows of K (a transposed view of a
    weight in dgrad, or of a 128x1-quantized tensor in wgrad, is copied once)."""
    return t if t.stride(1) == 1 else t.contiguous()


def _grid(m: int, n: int, cfg: TileConfig) -> tuple[int]:
    return (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)


def _check_groups(k: int, groups: int | None) -> int:
    """groups, default tree_width(K) (jetflow.kernels.canonical), checked."""
    groups = tree_width(k) if groups is None else groups
    if groups not in (1, 2, 4, 8) or (groups > 1 and (k % SCALE_BLOCK or (k // SCALE_BLOCK) % groups)):
        raise ValueError(f"groups={groups}: 1, 2, 4 or 8 whole-block groups of K={k} (jetflow.kernels.canonical)")
    return groups


def fp8_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, b_rows_per_scale: int,
             out_dtype: torch.dtype = torch.float32, groups: int | None = None) -> torch.Tensor:
    """a (M, K) fp8 with sa (M, ceil(K/128)) @ b (N, K) fp8 with sb (ceil(N/r), ceil(K/128)), r =
    b_rows_per_scale (128: weight blocks, 1: 1x128 groups) -> (M, N) in out_dtype (fp32 or bf16);
    `groups` canonical groups over K (default tree_width(K)), combined by the pairwise tree."""
    (m, k), n = a.shape, b.shape[0]
    kb = triton.cdiv(k, SCALE_BLOCK)
    if b.shape[1] != k or tuple(sa.shape) != (m, kb) or tuple(sb.shape) != (triton.cdiv(n, b_rows_per_scale), kb):
        raise ValueError(f"fp8_gemm shapes: a {tuple(a.shape)}, sa {tuple(sa.shape)}, b {tuple(b.shape)}, "
                         f"sb {tuple(sb.shape)}, b_rows_per_scale {b_rows_per_scale}")
    if b_rows_per_scale not in (1, SCALE_BLOCK):
        raise ValueError(f"b_rows_per_scale={b_rows_per_scale}: 1 (1x128 groups) or 128 (128x128 blocks)")
    groups = _check_groups(k, groups)
    a, b = _k_contiguous(a), _k_contiguous(b)
    c = _out(m, n, out_dtype, a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    cfg = fp8_config(n, k)
    _fp8_gemm_kernel[_grid(m, n, cfg)](
        a, b, c, sa, sb, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), B_ROWS_PER_SCALE=b_rows_per_scale,
        OUT_BF16=out_dtype == torch.bfloat16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, GROUPS=groups, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        enable_fp_fusion=FP_FUSION)
    return c


def dense_gemm(a: torch.Tensor, b: torch.Tensor, dot: str = "fp32",
               out_dtype: torch.dtype = torch.float32, groups: int | None = None) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T -> (M, N); operands fp32 or bf16, multiplied as `dot` says ("bf16":
    rounded to bf16, tensor cores; "fp32": IEEE fp32 FMAs); `groups` canonical groups over K (default tree_width(K))."""
    if dot not in ("bf16", "fp32"):
        raise ValueError(f"dot={dot!r}: 'bf16' or 'fp32'")
    (m, k), n = a.shape, b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"dense_gemm shapes: a {tuple(a.shape)}, b {tuple(b.shape)}")
    groups = _check_groups(k, groups)
    a, b = _k_contiguous(a), _k_contiguous(b)
    c = _out(m, n, out_dtype, a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    cfg = dense_config(n, k, dot)
    _dense_gemm_kernel[_grid(m, n, cfg)](
        a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        DOT_BF16=dot == "bf16", OUT_BF16=out_dtype == torch.bfloat16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, GROUPS=groups, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        enable_fp_fusion=FP_FUSION)
    return c
