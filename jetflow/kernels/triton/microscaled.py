"""Batch-invariant GEMMs of the mxfp8 and nvfp4 recipes for CUDA (jetflow.precision.microscaled).

    c = mx_gemm(a, sa, b, sb)                                   # MXFP8: E4M3 codes, E8M0 scale bytes per 1x32
    c = nvfp4_gemm(a, sa, da, b, sb, db, b_rows_per_scale)      # NVFP4: packed E2M1, E4M3 scales per 16, fp32 d

a (M, K) and b (N, K) are the operands as their GEMM reads them (blocks along K); c = a @ b^T, (M, N).
Per output element, the canonical reduction of jetflow.kernels.canonical (as gemm.py's kernels):

    for each 128-wide K block kb:   partial = sum_k value_a[i, k] * value_b[n, k]   (tl.dot, fp32 accumulate)
    each of the `groups` groups: 0 + its block partials in order; the groups through the pairwise tree
    NVFP4: c = that * (da[i] * db)   (the tensor scales' alpha, one fp32 product and one multiply)

value = code * block scale, dequantized in the kernel on the bits (Hopper has no FP4 tensor cores, and
MXFP8's scale changes every 32 K): exact in fp32 and in bf16 (NVFP4: a 2-bit times a 4-bit significand
between 2^-10 and 2688; MXFP8: a 4-bit significand times 2^(e - 127), exact in bf16 unless a block's
scale is below 2^-118, i.e. a block whose amax is below ~2^-109, where bf16's subnormals end), so the
dot runs on bf16 tensor cores with exact products. jetflow.kernels.triton.microscaled_reference is
the same arithmetic in torch. The tile configuration depends on (N, K) only (gemm.fp8_config's), so a
row's result never depends on M or on the batch; rows past M read row 0 and are not stored.

`NATIVE=True` (Blackwell, sm_100) runs each 128-K block through `tl.dot_scaled` on the codes and
scales themselves (the block-scaled MMA, tcgen05 kind::mxf8f6f4 / kind::mxf4nvf4) with the groups and
the tree as above; within a group the blocks accumulate in the MMA's accumulator (acc = MMA(block,
acc)): triton 3.6 fails to compile a fresh dot_scaled partial added to an accumulator for sm_100 (its
OptimizeAccumulatorInit pass). Still one fixed order per element, so batch invariant, but not the
dequantizing kernel's bits. Triton 3.6 keeps every group's accumulator in tensor memory at once, so the
native tile is 128 x `native_block_n(groups)` (512 TMEM columns; wider tiles compile to a trap).
Compile-checked for sm_100 (compile_check.SM100_SPECS); the wrappers launch the dequantizing kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetflow.kernels.triton._bits import round_to_bf16
from jetflow.kernels.triton.gemm import FP_FUSION, _check_groups, _grid, _out, _store, _tile, fp8_config

K_BLOCK = tl.constexpr(128)


def native_block_n(groups: int) -> int:
    """BLOCK_N of the native (sm_100) kernel: the groups' 128 x BLOCK_N fp32 accumulators fit tensor memory."""
    return min(128, 256 // groups)


@triton.jit
def _e2m1_value(code):
    """fp32 values of E2M1 codes (int32, 0..15): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    e = (code >> 1) & 3
    half = (code & 1).to(tl.float32) * 0.5
    binade = tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0))
    v = tl.where(e == 0, half, (1.0 + half) * binade)
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def _e8m0_value(s):
    """2^(s - 127) for E8M0 bytes (int32): the exponent field on the bits (s = 0: the subnormal 2^-127)."""
    bits = tl.where(s == 0, 0x00400000, s << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _values(ptr, s_ptr, rows, offs_k, k_ok, stride_r, stride_sr, ROWS_PER_SCALE: tl.constexpr,
            NVFP4: tl.constexpr):
    """(R, 128) fp32 values (code * block scale, exact) of the operand rows `rows` at K offsets `offs_k`."""
    mask = k_ok[None, :]
    srow = (rows // ROWS_PER_SCALE)[:, None] * stride_sr
    if NVFP4:
        byte = tl.load(ptr + rows[:, None] * stride_r + (offs_k // 2)[None, :], mask=mask, other=0)
        code = (byte.to(tl.int32) >> ((offs_k % 2) * 4)[None, :]) & 0xF
        scale = tl.load(s_ptr + srow + (offs_k // 16)[None, :], mask=mask, other=0.0).to(tl.float32)
        values = _e2m1_value(code) * scale
    else:
        code = tl.load(ptr + rows[:, None] * stride_r + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + srow + (offs_k // 32)[None, :], mask=mask, other=0)
        values = code * _e8m0_value(s.to(tl.int32))
    return values


@triton.jit
def _native_block(acc, a_ptr, sa_ptr, b_ptr, sb_ptr, rm, rn, kb, K, stride_am, stride_sam, stride_bn, stride_sbn,
                  B_ROWS_PER_SCALE: tl.constexpr, NVFP4: tl.constexpr):
    """acc + one 128-K block by the block-scaled MMA (tl.dot_scaled) on the codes and scales."""
    if NVFP4:
        offs = kb * 64 + tl.arange(0, 64)  # packed bytes: two codes each
        ok = offs < (K + 1) // 2
        offs_s = kb * 8 + tl.arange(0, 8)
        s_ok = offs_s < (K + 15) // 16
        a = tl.load(a_ptr + rm[:, None] * stride_am + offs[None, :], mask=ok[None, :], other=0)
        b = tl.load(b_ptr + offs[:, None] + rn[None, :] * stride_bn, mask=ok[:, None], other=0)
        sa = tl.load(sa_ptr + rm[:, None] * stride_sam + offs_s[None, :], mask=s_ok[None, :], other=0.0)
        sb = tl.load(sb_ptr + (rn // B_ROWS_PER_SCALE)[:, None] * stride_sbn + offs_s[None, :], mask=s_ok[None, :],
                     other=0.0)
        acc = tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1", acc)
    else:
        offs = kb * 128 + tl.arange(0, 128)
        ok = offs < K
        offs_s = kb * 4 + tl.arange(0, 4)
        s_ok = offs_s < (K + 31) // 32
        a = tl.load(a_ptr + rm[:, None] * stride_am + offs[None, :], mask=ok[None, :], other=0.0)
        b = tl.load(b_ptr + offs[:, None] + rn[None, :] * stride_bn, mask=ok[:, None], other=0.0)
        sa = tl.load(sa_ptr + rm[:, None] * stride_sam + offs_s[None, :], mask=s_ok[None, :], other=0)
        sb = tl.load(sb_ptr + rn[:, None] * stride_sbn + offs_s[None, :], mask=s_ok[None, :], other=0)
        acc = tl.dot_scaled(a, sa, "e4m3", b, sb, "e4m3", acc)
    return acc


@triton.jit
def _group(a_ptr, sa_ptr, b_ptr, sb_ptr, rm, rn, K, stride_am, stride_sam, stride_bn, stride_sbn, first_block,
           num_blocks, B_ROWS_PER_SCALE: tl.constexpr, NVFP4: tl.constexpr, NATIVE: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One canonical group: 0 + each 128-K block's partial, in order (native: the blocks accumulated in
    the MMA's accumulator, see the module docstring)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(first_block, first_block + num_blocks):
        if NATIVE:
            acc = _native_block(acc, a_ptr, sa_ptr, b_ptr, sb_ptr, rm, rn, kb, K, stride_am, stride_sam, stride_bn,
                                stride_sbn, B_ROWS_PER_SCALE, NVFP4)
        else:
            offs_k = kb * K_BLOCK + tl.arange(0, K_BLOCK)
            k_ok = offs_k < K
            a = _values(a_ptr, sa_ptr, rm, offs_k, k_ok, stride_am, stride_sam, 1, NVFP4)  # (BM, 128)
            b = _values(b_ptr, sb_ptr, rn, offs_k, k_ok, stride_bn, stride_sbn, B_ROWS_PER_SCALE, NVFP4)  # (BN, 128)
            partial = tl.dot(round_to_bf16(a), tl.trans(round_to_bf16(b)))  # exact bf16 values, fp32 sums
            acc = acc + partial
    return acc


@triton.jit(do_not_specialize=["M"])
def _microscaled_gemm_kernel(a_ptr, sa_ptr, da_ptr, b_ptr, sb_ptr, db_ptr, c_ptr, M, N, K, stride_am, stride_sam,
                             stride_bn, stride_sbn, stride_cm, stride_cn, NVFP4: tl.constexpr, NATIVE: tl.constexpr,
                             B_ROWS_PER_SCALE: tl.constexpr, ROW_DA: tl.constexpr, OUT_BF16: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                             GROUPS: tl.constexpr):
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.where(offs_m < M, offs_m, 0).to(tl.int64)  # rows past M read row 0
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    per = tl.cdiv(K, K_BLOCK) // GROUPS
    # the canonical tree over GROUPS group sums (1, 2, 4 or 8): ((g0 + g1) + (g2 + g3)) + ...
    acc = _group(a_ptr, sa_ptr, b_ptr, sb_ptr, rm, rn, K, stride_am, stride_sam, stride_bn, stride_sbn, 0, per,
                 B_ROWS_PER_SCALE, NVFP4, NATIVE, BLOCK_M, BLOCK_N)
    if GROUPS >= 2:
        acc = acc + _group(a_ptr, sa_ptr, b_ptr, sb_ptr, rm, rn, K, stride_am, stride_sam, stride_bn, stride_sbn, per,
                           per, B_ROWS_PER_SCALE, NVFP4, NATIVE, BLOCK_M, BLOCK_N)
    if GROUPS >= 4:
        right = _group(a_ptr, sa_ptr, b_ptr, sb_ptr, rm, rn, K, stride_am, stride_sam, stride_bn, stride_sbn, 2 * per,
                       per, B_ROWS_PER_SCALE, NVFP4, NATIVE, BLOCK_M, BLOCK_N)
        right = right + _group(a_ptr, sa_ptr, b_ptr, sb_ptr, rm, rn, K, stride_am, stride_sam, stride_bn, stride_sbn,
                               3 * per, per, B_ROWS_PER_SCALE, NVFP4, NATIVE, BLOCK_M, BLOCK_N)
        acc = acc + right
    if GROUPS >= 8:
        upper = _group(a_ptr, sa_ptr, b_ptr, sb_ptr, rm, rn, K, stride_am, stride_sam, stride_bn, stride_sbn, 4 * per,
                       per, B_ROWS_PER_SCALE, NVFP4, NATIVE, BLOCK_M, BLOCK_N)
        upper = upper + _group(a_ptr, sa_ptr, b_ptr, sb_ptr, rm, rn, K, stride_am, stride_sam, stride_bn, stride_sbn,
                               5 * per, per, B_ROWS_PER_SCALE, NVFP4, NATIVE, BLOCK_M, BLOCK_N)
        right = _group(a_ptr, sa_ptr, b_ptr, sb_ptr, rm, rn, K, stride_am, stride_sam, stride_bn, stride_sbn, 6 * per,
                       per, B_ROWS_PER_SCALE, NVFP4, NATIVE, BLOCK_M, BLOCK_N)
        right = right + _group(a_ptr, sa_ptr, b_ptr, sb_ptr, rm, rn, K, stride_am, stride_sam, stride_bn, stride_sbn,
                               7 * per, per, B_ROWS_PER_SCALE, NVFP4, NATIVE, BLOCK_M, BLOCK_N)
        acc = acc + (upper + right)
    if NVFP4:  # the tensor scales' alpha: one fp32 product, one multiply
        db = tl.load(db_ptr)
        if ROW_DA:
            acc = acc * (tl.load(da_ptr + rm) * db)[:, None]
        else:
            acc = acc * (tl.load(da_ptr) * db)
    _store(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn, OUT_BF16)


def _launch(a, sa, da, b, sb, db, k: int, nvfp4: bool, b_rows_per_scale: int, out_dtype, groups) -> torch.Tensor:
    m, n = a.shape[0], b.shape[0]
    groups = _check_groups(k, groups)
    c = _out(m, n, out_dtype, a.device)
    if m == 0 or n == 0:
        return c
    cfg = fp8_config(n, k)
    _microscaled_gemm_kernel[_grid(m, n, cfg)](
        a, sa, da, b, sb, db, c, m, n, k, a.stride(0), sa.stride(0), b.stride(0), sb.stride(0), c.stride(0),
        c.stride(1), NVFP4=nvfp4, NATIVE=False, B_ROWS_PER_SCALE=b_rows_per_scale, ROW_DA=da.numel() == m and m > 1,
        OUT_BF16=out_dtype == torch.bfloat16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        GROUPS=groups, num_warps=cfg.num_warps, num_stages=2, enable_fp_fusion=FP_FUSION)
    return c


def mx_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, out_dtype=torch.float32,
            groups: int | None = None) -> torch.Tensor:
    """a (M, K) E4M3 codes with sa (M, ceil(K/32)) E8M0 bytes @ b (N, K) with sb (N, ceil(K/32)) -> (M, N)."""
    (m, k), n = a.shape, b.shape[0]
    if b.shape[1] != k or tuple(sa.shape) != (m, -(-k // 32)) or tuple(sb.shape) != (n, -(-k // 32)):
        raise ValueError(f"mx_gemm shapes: a {tuple(a.shape)}, sa {tuple(sa.shape)}, b {tuple(b.shape)}, "
                         f"sb {tuple(sb.shape)}")
    one = torch.ones(1, device=a.device)
    return _launch(a.contiguous(), sa.contiguous(), one, b.contiguous(), sb.contiguous(), one, k, False, 1, out_dtype,
                   groups)


def nvfp4_gemm(a: torch.Tensor, sa: torch.Tensor, da: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
               db: torch.Tensor, k: int, b_rows_per_scale: int = 16, out_dtype=torch.float32,
               groups: int | None = None) -> torch.Tensor:
    """a (M, ceil(K/2)) packed E2M1 with sa (M, ceil(K/16)) E4M3 and da (M,) or () @ b (N, ceil(K/2)) with sb
    (ceil(N/r), ceil(K/16)), r = b_rows_per_scale (16: 16x16 weight tiles, 1: 1x16), and db () -> (M, N)."""
    m, n = a.shape[0], b.shape[0]
    kb, ks = -(-k // 2), -(-k // 16)
    if a.shape[1] != kb or b.shape[1] != kb or tuple(sa.shape) != (m, ks) or \
            tuple(sb.shape) != (-(-n // b_rows_per_scale), ks) or da.numel() not in (1, m) or db.numel() != 1:
        raise ValueError(f"nvfp4_gemm shapes: a {tuple(a.shape)}, sa {tuple(sa.shape)}, da {tuple(da.shape)}, "
                         f"b {tuple(b.shape)}, sb {tuple(sb.shape)}, db {tuple(db.shape)}, K {k}")
    return _launch(a.contiguous(), sa.contiguous(), da.float().reshape(-1).contiguous(), b.contiguous(),
                   sb.contiguous(), db.float().reshape(-1), k, True, b_rows_per_scale, out_dtype, groups)
