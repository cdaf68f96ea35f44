"""Paged attention in Triton with the CPU's exact arithmetic: the bits of csrc/attention.cpp's
jf_attention_paged (jetflow.kernels.paged.paged_attention), on a GPU.

    o = paged_attention(q, k_pages, v_pages, table, pos, scale, k_scale, v_scale)

The arguments and layout are paged.paged_attention's: q (B, H, T, D); k_pages (N, H_kv, D, PAGE) (K
transposed inside a page), v_pages (N, H_kv, PAGE, D), the last dim contiguous; table (B, nb) int32
page ids (slot j of row b: page table[b, j // PAGE], offset j % PAGE); pos (B, T): query (b, t) sees
slots 0..pos[b, t]. Pages hold fp32, bf16 or E4M3 codes (value = code * k_scale / v_scale, one fp32
multiply, converted in registers: the FP8 K/V fake-quantizer's value). Returns (B, H, T, D) in q's dtype.

Arithmetic per query (the C++ kernel's, operation for operation; fp32 throughout, no fma contraction):
    s_j = (fma chain over d = 0..D-1 of q[d] * k_j[d], from 0) * scale    for j = 0..p
    m   = max_j s_j
    p_j = exp_nonpos(s_j - m)       Cephes expf: round(x log2 e), two-step ln2 reduction, degree-7 fma polynomial
    l   = ((0 + p_0) + p_1) + ...   in key order
    o   = (fma chain over j of p_j * v_j, from 0) / l                      (IEEE division)
This is not the online-softmax order of attn.attention (the CUDA trainer's kernel): it is the CPU
path's order, so a GPU can reproduce CPU log-probs bit for bit. The kernel makes two passes over the
keys (the max first, as the C++ keeps all scores); the sequential sums run one key at a time, the
key's weights and V row taken from the block's tiles by masked sums (exact: one nonzero term; the
accumulator never holds -0, so a +0 in place of a -0 in V adds the same).
Tile shapes never change a row's bits (rows are independent; keys past a row's position add 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # query rows (t, g) of one K/V head per program
BLOCK_N = 16  # keys per score tile (the sequential sums then walk them one by one)

# csrc/attention.cpp's constants (the kernel rounds each literal to fp32, as the C++ `f` suffix does)
EXP_LOW = tl.constexpr(-87.0)
LOG2E = tl.constexpr(1.44269504088896341)
LN2_HI = tl.constexpr(0.693359375)
LN2_LO = tl.constexpr(-2.12194440e-4)
P0, P1, P2 = tl.constexpr(1.9875691500e-4), tl.constexpr(1.3981999507e-3), tl.constexpr(8.3334519073e-3)
P3, P4, P5 = tl.constexpr(4.1665795894e-2), tl.constexpr(1.6666665459e-1), tl.constexpr(5.0000001201e-1)
ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: (y + ROUND) - ROUND rounds |y| < 2^22 to an integer, ties to even
FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}


@triton.jit
def exp_nonpos(x):
    """csrc/attention.cpp's v_exp_nonpos for x <= 0, operation for operation."""
    x = tl.where(x < EXP_LOW, EXP_LOW, x)
    n = (x * LOG2E + ROUND) - ROUND
    r = tl.fma(n, -LN2_HI, x)
    r = tl.fma(n, -LN2_LO, r)
    p = tl.fma(r, P0, P1)  # P0 * r + P1: one rounding either way
    p = tl.fma(p, r, P2)
    p = tl.fma(p, r, P3)
    p = tl.fma(p, r, P4)
    p = tl.fma(p, r, P5)
    r2 = r * r
    p = tl.fma(p, r2, r)
    p = p + 1.0
    two_n = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return p * two_n


@triton.jit
def _kv_value(x, s, FMT: tl.constexpr):
    """A page element as fp32: fp32 and bf16 as they are, an E4M3 code times its scale."""
    if FMT == 2:
        return x.to(tl.float32) * s
    return x.to(tl.float32)


@triton.jit
def _scores(q_row, row_ok, k_ptr, table_ptr, b, hk, start, nmax, scale, k_scale, stride_kp, stride_kh, stride_kd,
            stride_tb, D: tl.constexpr, FMT: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """s (BM, BN) for keys start..start+BN: the fma chain over d, then * scale."""
    slots = start + tl.arange(0, BLOCK_N)
    ok = slots < nmax
    page = tl.load(table_ptr + b * stride_tb + slots // PAGE, mask=ok, other=0).to(tl.int64)
    k_base = k_ptr + page * stride_kp + hk * stride_kh + slots % PAGE  # (BN,) K^T inside a page
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for d in range(D):
        qd = tl.load(q_row + d, mask=row_ok, other=0.0).to(tl.float32)  # (BM,)
        kd = _kv_value(tl.load(k_base + d * stride_kd, mask=ok, other=0.0), k_scale, FMT)  # (BN,)
        acc = tl.fma(qd[:, None], kd[None, :], acc)
    return acc * scale


@triton.jit(do_not_specialize=["T", "G"])
def _paged_exact_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, table_ptr, scales_ptr, T, G, H_KV,
                        stride_kp, stride_kh, stride_kd, stride_vp, stride_vh, stride_vs, stride_tb,
                        D: tl.constexpr, D_PAD: tl.constexpr, FMT: tl.constexpr, PAGE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // H_KV).to(tl.int64)
    hk = (bh % H_KV).to(tl.int64)
    H = H_KV * G
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) row i = t * G + g
    row_ok = i < T * G
    t = (i // G).to(tl.int64)
    h = hk * G + (i % G)
    row = ((b * H + h) * T + t) * D  # (BM,) q / o offsets of each row: (B, H, T, D) contiguous
    q_row = q_ptr + row
    pos = tl.load(pos_ptr + b * T + t, mask=row_ok, other=0).to(tl.int32)  # (BM,)
    nmax = tl.max(tl.where(row_ok, pos, 0)) + 1
    scale = tl.load(scales_ptr)
    k_scale = tl.load(scales_ptr + 1)
    v_scale = tl.load(scales_ptr + 2)
    cols = tl.arange(0, BLOCK_N)
    # pass 1: each row's max score over its own keys
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for start in range(0, nmax, BLOCK_N):
        s = _scores(q_row, row_ok, k_ptr, table_ptr, b, hk, start, nmax, scale, k_scale, stride_kp, stride_kh,
                    stride_kd, stride_tb, D, FMT, PAGE, BLOCK_M, BLOCK_N)
        own = (start + cols)[None, :] <= pos[:, None]
        m = tl.maximum(m, tl.max(tl.where(own, s, float("-inf")), axis=1))
    # pass 2: the same scores, their weights, and the two sums in key order
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    total = tl.zeros((BLOCK_M,), tl.float32)  # l: the sum of the weights
    acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    for start in range(0, nmax, BLOCK_N):
        s = _scores(q_row, row_ok, k_ptr, table_ptr, b, hk, start, nmax, scale, k_scale, stride_kp, stride_kh,
                    stride_kd, stride_tb, D, FMT, PAGE, BLOCK_M, BLOCK_N)
        own = (start + cols)[None, :] <= pos[:, None]
        p = tl.where(own, exp_nonpos(s - m[:, None]), 0.0)  # (BM, BN): exactly 0 past a row's position
        slots = start + cols
        page = tl.load(table_ptr + b * stride_tb + slots // PAGE, mask=slots < nmax, other=0).to(tl.int64)
        v_rows = page * stride_vp + hk * stride_vh + (slots % PAGE) * stride_vs  # (BN,)
        v = tl.load(v_ptr + v_rows[:, None] + d[None, :], mask=(slots < nmax)[:, None] & d_ok[None, :], other=0.0)
        v = _kv_value(v, v_scale, FMT)  # (BN, D_PAD) fp32
        for jj in tl.static_range(BLOCK_N):  # key by key: both sums in key order
            pj = tl.sum(tl.where(cols[None, :] == jj, p, 0.0), axis=1)  # (BM,) column jj, exactly
            vj = tl.sum(tl.where(cols[:, None] == jj, v, 0.0), axis=0)  # (D_PAD,) row jj, exactly
            total = total + pj
            acc = tl.fma(pj[:, None], vj[None, :], acc)
    o = tl.math.div_rn(acc, total[:, None])
    tl.store(o_ptr + row[:, None] + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor,
                    pos: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """See the module docstring (the CPU twin: jetflow.kernels.paged.paged_attention)."""
    B, H, T, D = q.shape
    n, hkv, page = k_pages.shape[0], k_pages.shape[1], k_pages.shape[3]
    if k_pages.dtype not in FORMATS or v_pages.dtype != k_pages.dtype or tuple(k_pages.shape) != (n, hkv, D, page) \
            or tuple(v_pages.shape) != (n, hkv, page, D) or k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        raise ValueError(f"paged_attention pages: K {tuple(k_pages.shape)} {k_pages.dtype}, V {tuple(v_pages.shape)} "
                         f"{v_pages.dtype}; want (N, H_kv, {D}, PAGE) and (N, H_kv, PAGE, {D}), the last dim contiguous")
    if H % hkv or pos.shape != (B, T) or table.dim() != 2 or table.shape[0] != B:
        raise ValueError(f"paged_attention shapes: q {tuple(q.shape)}, table {tuple(table.shape)}, pos {tuple(pos.shape)}")
    dtype = q.dtype
    q = q.float().contiguous()
    out = torch.empty(B, H, T, D, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out.to(dtype)
    scales = torch.tensor([float(scale), float(k_scale), float(v_scale)], dtype=torch.float32).to(q.device)
    table = table.to(torch.int32).contiguous()
    G = H // hkv
    grid = (triton.cdiv(T * G, BLOCK_M), B * hkv)
    _paged_exact_kernel[grid](
        q, k_pages, v_pages, out, pos.to(torch.int64).contiguous(), table, scales,
        T, G, hkv, k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), v_pages.stride(0), v_pages.stride(1),
        v_pages.stride(2), table.stride(0),
        D=D, D_PAD=max(16, triton.next_power_of_2(D)), FMT=FORMATS[k_pages.dtype], PAGE=page,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4, num_stages=1, enable_fp_fusion=False)
    return out.to(dtype)
