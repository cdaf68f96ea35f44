"""Batch- and decode-invariant causal attention for CUDA: prefill and decode in one kernel, over
contiguous or paged KV, bf16 / fp32 or FP8 (E4M3, per-tensor scales) keys and values.

    o = attention(q, k, v, pos, scale)                          # contiguous KV
    o = attention(q, k_pages, v_pages, pos, scale, block_table=table, k_scale=ks, v_scale=vs)

q (B, H, T, D); pos (B, T): query (b, t) sees the key slots 0..pos[b, t] of its own row (slot =
position, sequences start at slot 0). Contiguous: k, v (B, H_kv, S, D), any strides (the exact KV
cache's K, kept as (B, H_kv, D, S), is passed as its transposed view). Paged: k, v (P, H_kv, PAGE, D)
and block_table (B, pages) int32: slot s of row b is at page block_table[b, s // PAGE], offset s % PAGE.
Returns (B, H, T, D) in q's dtype.

Arithmetic, per query row (its own position p):
    for each KV block j = 0, 1, ... of BLOCK_N slots from slot 0, in order, up to the block holding p:
        s   = (q . k_slot) * (scale * log2 e)                 slots past p: -inf
        m'  = max(m, max_slot s);  alpha = 1 if m' == m else 2^(m - m')
        pr  = 2^(s - m')                                      (exactly 0 past p)
        l   = l * alpha + sum(pr);  acc = acc * alpha + pr . v
    o = acc / l                                               (IEEE division)
One KV-split order: every query walks the same fixed blocks from slot 0, with no split of the KV
range (no flash-decoding split-K). A block wholly past p is an exact no-op (alpha = 1, pr = 0), so a
query computed in a decode step (T = 1, its G query heads share a tile) and the same query inside a
prefill tile give the same bits; the tile shape (BLOCK_M, BLOCK_N), warps and stages never depend on
T, B or the batch. Dots: bf16 q -> bf16 operands (pr rounded to bf16 for pr . v, as FlashAttention
does), fp32 q -> fp32 operands with input_precision="ieee". FP8 K/V enter the dot as code * scale
(one fp32 multiply, converted in registers): the values the FP8 K/V fake-quantizer gives, so FP8 pages
give the bits of those values stored densely (jetflow.model.paged_attention relies on it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetflow.kernels.triton._bits import round_to_bf16, to_bf16

BLOCK_M = 64  # query rows (t, g) per tile: one wgmma row block
BLOCK_N = 64  # KV slots per block: the fixed reduction blocks
LOG2E = 1.4426950408889634
FP_FUSION = False  # no a*b+c -> fma contraction: the interpreter (numpy) never fuses


@triton.jit(do_not_specialize=["T", "S"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, table_ptr, k_scale_ptr, v_scale_ptr, qk_scale, T, S, G,
                      stride_qb, stride_qh, stride_qt, stride_qd,
                      stride_kp, stride_kh, stride_ks, stride_kd,
                      stride_vp, stride_vh, stride_vs, stride_vd,
                      stride_ob, stride_oh, stride_ot, stride_od,
                      stride_pb, stride_pt, stride_tb, H_KV,
                      D: tl.constexpr, D_PAD: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                      KV_FP8: tl.constexpr, DOT_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // H_KV).to(tl.int64)
    hk = (bh % H_KV).to(tl.int64)
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) row i = t * G + g
    row_ok = i < T * G
    t = (i // G).to(tl.int64)
    h = hk * G + (i % G)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    pos = tl.load(pos_ptr + b * stride_pb + t * stride_pt, mask=row_ok, other=0).to(tl.int32)  # (BM,)
    q = tl.load(q_ptr + b * stride_qb + h[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BM, D)
    if DOT_BF16:
        q = to_bf16(q)
    else:
        q = q.to(tl.float32)
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    hi = tl.minimum(tl.max(tl.where(row_ok, pos, 0)) + 1, S)  # slots any row of the tile needs
    for start in range(0, hi, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)  # (BN,)
        load_ok = slots < hi
        if PAGED:
            page = tl.load(table_ptr + b * stride_tb + slots // PAGE_SIZE, mask=load_ok, other=0).to(tl.int64)
            k_rows = page * stride_kp + (slots % PAGE_SIZE) * stride_ks
            v_rows = page * stride_vp + (slots % PAGE_SIZE) * stride_vs
        else:
            k_rows = b * stride_kp + slots.to(tl.int64) * stride_ks
            v_rows = b * stride_vp + slots.to(tl.int64) * stride_vs
        kt = tl.load(k_ptr + hk * stride_kh + k_rows[None, :] + d[:, None] * stride_kd,
                     mask=load_ok[None, :] & d_ok[:, None], other=0.0)  # (D, BN)
        v = tl.load(v_ptr + hk * stride_vh + v_rows[:, None] + d[None, :] * stride_vd,
                    mask=load_ok[:, None] & d_ok[None, :], other=0.0)  # (BN, D)
        if KV_FP8:  # code * scale in fp32: the FP8 K/V fake-quantizer's values
            kt = kt.to(tl.float32) * k_scale
            v = v.to(tl.float32) * v_scale
        if DOT_BF16:
            qk = tl.dot(q, to_bf16(kt))  # (BM, BN) fp32
        else:
            qk = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
        s = qk * qk_scale
        s = tl.where(slots[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # (BM,)
        alpha = tl.where(m_new == m, 1.0, tl.math.exp2(m - m_new))
        p = tl.math.exp2(s - m_new[:, None])  # (BM, BN), 0 past each row's position
        l = l * alpha + tl.sum(p, axis=1)
        if DOT_BF16:
            pv = tl.dot(round_to_bf16(p), to_bf16(v))
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m = m_new
    o = tl.math.div_rn(acc, l[:, None])
    o_ptrs = o_ptr + b * stride_ob + h[:, None] * stride_oh + t[:, None] * stride_ot + d[None, :] * stride_od
    mask = row_ok[:, None] & d_ok[None, :]
    if OUT_BF16:
        tl.store(o_ptrs, round_to_bf16(o), mask=mask)
    else:
        tl.store(o_ptrs, o, mask=mask)


def _scale_tensor(x, device) -> torch.Tensor:
    """A per-tensor FP8 scale as a 1-element fp32 tensor on `device` (read by the kernel: no sync);
    a placeholder 1 without FP8."""
    if x is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    return torch.as_tensor(x, dtype=torch.float32).to(device).reshape(1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, scale: float,
              block_table: torch.Tensor | None = None, k_scale=None, v_scale=None) -> torch.Tensor:
    """See the module docstring. q (B, H, T, D) fp32 / bf16; k, v (B, H_kv, S, D) or, with a
    block_table (B, pages), (P, H_kv, PAGE, D); fp32, bf16 or float8_e4m3fn (then k_scale and
    v_scale: per-tensor fp32 scales, value = fp8 * scale); pos (B, T) -> (B, H, T, D) in q's dtype."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"attention: q dtype {q.dtype}; float32 or bfloat16")
    if v.shape != k.shape or k.shape[3] != D or H % Hkv or pos.shape != (B, T):
        raise ValueError(f"attention shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"pos {tuple(pos.shape)}")
    fp8 = k.dtype == torch.float8_e4m3fn
    if fp8 != (v.dtype == torch.float8_e4m3fn) or (fp8 and (k_scale is None or v_scale is None)):
        raise ValueError("attention: FP8 KV needs both K and V in float8_e4m3fn, with k_scale and v_scale")
    paged = block_table is not None
    if paged:
        if block_table.dim() != 2 or block_table.shape[0] != B:
            raise ValueError(f"attention: block_table must be (B, pages) = ({B}, ...), got {tuple(block_table.shape)}")
        page_size, slots = k.shape[2], block_table.shape[1] * k.shape[2]
        table = block_table.to(torch.int32).contiguous()
        stride_tb = table.stride(0)
    else:
        if k.shape[0] != B:
            raise ValueError(f"attention: contiguous KV must have batch {B}, got {tuple(k.shape)}")
        page_size, slots, table, stride_tb = 1, k.shape[2], pos, 0  # table unused
    out = torch.empty(B, H, T, D, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    ks = _scale_tensor(k_scale if fp8 else None, q.device)
    vs = _scale_tensor(v_scale if fp8 else None, q.device)
    G = H // Hkv
    grid = (triton.cdiv(T * G, BLOCK_M), B * Hkv)
    _attention_kernel[grid](
        q, k, v, out, pos, table, ks, vs, float(scale) * LOG2E, T, slots, G,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), pos.stride(0), pos.stride(1), stride_tb, Hkv,
        D=D, D_PAD=max(16, triton.next_power_of_2(D)), PAGED=paged, PAGE_SIZE=page_size, KV_FP8=fp8,
        DOT_BF16=q.dtype == torch.bfloat16, OUT_BF16=q.dtype == torch.bfloat16, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        num_warps=4, num_stages=2, enable_fp_fusion=FP_FUSION)
    return out
