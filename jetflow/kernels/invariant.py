"""Batch-invariant GEMM and attention: each row's result is one fixed sequence of floating-point
operations, whatever else is in the call (the exact numerics mode, `precision.numerics=exact`).

    packed = pack_weight(w)                       # (N, K) fp32 / bf16 / E4M3 -> panels, once per weight version
    y = matmul(x, w, packed)                      # x (..., K) -> (..., N), rows independent of M and of TP
    y = fp8_gemm(xq, sx, packed, sw, n)           # E4M3 operands with their block scales -> (M, N) fp32
    o = attention(q, kt, v, pos, scale)           # each query sees key slots 0..pos, one order
    o = decode_attention(q, k, v, cos, sin, pos, kt_cache, v_cache, end, scale)  # RoPE + cache write + attention

Why: BLAS picks kernels by shape (gemv for one row, other blockings for other M; measured here: MKL's
fp32 rows differ between M = 1..128 and large M on one shape, and vary with the ISA), and SDPA's
reduction order depends on the sequence length, so a token decoded from a KV cache and the same token
inside the trainer's full forward come out a few ulps apart, which FP8 rounding then amplifies. These
kernels define every output element as one fixed sequence of correctly rounded operations: the GEMMs the
canonical reduction of jetflow.kernels.canonical (128-K block chains, groups, a pairwise tree;
csrc/gemm.cpp), which also makes a row-parallel layer's result independent of its tensor-parallel degree;
attention one chain per query (csrc/attention.cpp). So the rollout engine and the trainer compute the same bits.

Gradients: torch's kernels (only the forward that produces log-probs must be exact; attention's backward a
block of query rows at a time, so no (B, H, T, S) scores exist whole); a weight gradient with `ordered_wgrad`
(sequence packing's grid) sums its tokens in `weight_grad`'s one order instead, shared by packed and padded rows.

CUDA: the same contract on jetflow's Triton kernels (jetflow.kernels.triton): `pack_weight` keeps W as it is,
`matmul` / `gemm` / `fp8_gemm` run Triton GEMMs with the canonical reduction, `attention` the fixed-block
online-softmax kernel: not the CPU's bits, but a row again the same whatever M, the batch or the KV cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from jetflow.kernels import canonical
from jetflow.kernels import triton as cuda_kernels  # imports no triton until a kernel is used
from jetflow.kernels.cpu_build import KernelBuildError, load_library

__all__ = ["KernelBuildError", "attention", "check_device", "decode_attention", "fp8_gemm", "gemm", "matmul",
           "pack_weight", "panel_width", "prepare_gemm", "prepare_quantized_fp8_gemm", "quantized_fp8_gemm",
           "reference_attention", "weight_grad"]


def check_device(device: torch.device | str) -> None:
    """The exact kernels run on the CPU (C++) and on CUDA (Triton: MissingDependencyError without it)."""
    kind = torch.device(device).type
    if kind == "cuda":
        cuda_kernels.require()
    elif kind != "cpu":
        raise NotImplementedError(
            f"precision.numerics=exact runs on the CPU and on CUDA (got device {device}): use "
            "precision.numerics=fast here")


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


def panel_width(variant: str = "native") -> int:
    return load_library(variant).jf_panel_width()


def isa(variant: str = "native") -> str:
    """The instruction set a build computes with: avx512_bf16, avx512, avx2 or scalar."""
    return load_library(variant).jf_isa().decode()


_WEIGHT_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.int32: 3}
"""Packed weight dtype -> the kernels' format code; int32 = bf16 pairs (`pack_weight` on AVX512_BF16)."""


def pack_weight(w: Tensor, variant: str = "native") -> Tensor:
    """(N, K) weight -> (ceil(N / NR), K, NR) panels (zero-padded columns) in the weight's own format:
    float32, bfloat16 or float8_e4m3fn (FP8 bytes): the GEMM reads those bytes and converts them in
    registers. Where the build uses AVX512_BF16's vdpbf16ps, E4M3 and bf16 weights are packed instead as
    the instruction's operand, bf16 pairs: (ceil(N / NR), ceil(K / 2), NR) int32, each the bf16 values of
    k = 2i and 2i + 1 (E4M3: 2i in the low half; bf16: swapped, so the chain runs in order; exact: every
    E4M3 value is a bf16 value; 2 bytes a weight, half of fp32), converted once per weight version instead of
    per call. The result is opaque: pass it to `gemm` (bf16 weights) or `fp8_gemm` (E4M3 weights). On CUDA the
    Triton GEMMs read the (N, K) weight itself (returned as it is)."""
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        raise ValueError(f"pack_weight: float32, bfloat16 or float8_e4m3fn weights, got {w.dtype}")
    w = w.detach()
    if w.is_cuda:
        return w.contiguous()
    lib = load_library(variant)
    nr = lib.jf_panel_width()
    n, k = w.shape
    p = -(-n // nr)
    bits = w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w  # any strides (W^T views too)
    panels = torch.empty(p, k, nr, dtype=bits.dtype)  # columns past N: zero bytes, 0.0 in every format
    lib.jf_pack_panels(_ptr(bits), bits.element_size(), n, k, bits.stride(0), bits.stride(1), _ptr(panels))
    if w.dtype != torch.float32 and isa(variant) == "avx512_bf16":
        pairs = torch.empty(p, -(-k // 2), nr, dtype=torch.int32)
        if lib.jf_pack_pairs(_ptr(panels), _WEIGHT_FORMATS[w.dtype], p, k, _ptr(pairs)) == 0:
            return pairs  # else a bf16 weight with a value below 2^-56: the FMA path reads the bf16 panels
    return panels.view(w.dtype) if w.dtype == torch.float8_e4m3fn else panels


def _check_packed(lib, packed: Tensor, k: int, n: int, dtypes: tuple, what: str) -> int:
    """The kernels' format code of `packed` after checking it fits K and N."""
    rows = -(-k // 2) if packed.dtype == torch.int32 else k
    if packed.dtype not in dtypes or packed.dim() != 3 or packed.shape[1] != rows \
            or packed.shape[2] != lib.jf_panel_width() or packed.shape[0] * packed.shape[2] < n:
        raise ValueError(f"packed weight {tuple(packed.shape)} {packed.dtype} does not fit {what} and N={n} "
                         "(pack it with pack_weight, same variant)")
    return _WEIGHT_FORMATS[packed.dtype]


def _groups(k: int, groups: int | None) -> int:
    groups = canonical.tree_width(k) if groups is None else int(groups)
    canonical.check_groups(k, groups)
    return groups


def gemm(x2: Tensor, packed: Tensor, n: int, variant: str = "native", groups: int | None = None) -> Tensor:
    """x2 (M, K) fp32 @ W^T -> (M, N) fp32, the canonical reduction (jetflow.kernels.canonical) with
    `groups` groups (default tree_width(K)); W given as `pack_weight(W)` (fp32 or bf16); no autograd."""
    if x2.is_cuda:
        dot = "bf16" if packed.dtype == torch.bfloat16 else "fp32"
        return cuda_kernels.dense_gemm(x2, packed[:n], dot, groups=_groups(x2.shape[1], groups))
    return prepare_gemm(packed, n, x2.shape[1], variant, groups)(x2)


def prepare_gemm(packed: Tensor, n: int, k: int, variant: str = "native",
                 groups: int | None = None) -> Callable[[Tensor], Tensor]:
    """`gemm(x2, packed, n, variant, groups)` on the CPU with the weight's checks done once: a function
    of x2 (M, K) that allocates the output and calls the kernel. An exact linear keeps one per weight
    version (jetflow.precision.exact) instead of repeating the checks on each of a decode step's four GEMM
    calls a layer."""
    lib = load_library(variant)
    groups = _groups(k, groups)
    wfmt = _check_packed(lib, packed, k, n, (torch.float32, torch.bfloat16, torch.int32), f"K={k}")
    kernel = lib.jf_gemm

    def run(x2: Tensor) -> Tensor:
        m = _rows(x2, k)
        x2 = x2.float()
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        kernel(_ptr(x2), m, k, x2.stride(0), _ptr(packed), wfmt, n, _ptr(out), n, groups)
        return out
    return run


def _rows(x2: Tensor, k: int) -> int:
    """M of a CPU GEMM's x2 (M, K), refusing any other K (the kernel would read past x2)."""
    if x2.dim() != 2 or x2.shape[1] != k or x2.is_cuda:
        raise ValueError(f"x {tuple(x2.shape)} on {x2.device}: a CPU (M, {k}) tensor expected")
    return x2.shape[0]


def fp8_gemm(xq: Tensor, sx: Tensor, packed: Tensor, sw: Tensor, n: int, variant: str = "native",
             groups: int | None = None, weight_rows_per_scale: int = 128) -> Tensor:
    """xq (M, K) E4M3 with sx (M, ceil(K/128)) @ W^T -> (M, N) fp32, W (N, K) E4M3 given as
    `pack_weight(W)` with its block scales sw: (ceil(N/128), ceil(K/128)) for 128x128 blocks, or
    (N, ceil(K/128)) for 1x128 groups (`weight_rows_per_scale=1`: the weight-gradient GEMM's second
    operand). Each 128-K block's chain over the raw FP8 values times sx * sw, then the groups and the
    tree (jetflow.kernels.canonical)."""
    m, k = xq.shape
    if xq.dtype != torch.float8_e4m3fn or packed.dtype not in (torch.float8_e4m3fn, torch.int32):
        raise ValueError(f"fp8_gemm: E4M3 operands, got {xq.dtype} and {packed.dtype}")
    if tuple(sx.shape) != (m, -(-k // canonical.BLOCK_K)):
        raise ValueError(f"fp8_gemm scales: sx {tuple(sx.shape)} for x {tuple(xq.shape)}")
    if xq.is_cuda:
        groups = _groups(k, groups)
        _check_weight_scales(k, sw, n, weight_rows_per_scale)
        return cuda_kernels.fp8_gemm(xq, sx, packed[:n], sw, weight_rows_per_scale, torch.float32, groups=groups)
    lib = load_library(variant)
    wfmt, sw, sw_ld, groups = _fp8_weight_args(lib, k, packed, sw, n, groups, weight_rows_per_scale)
    if xq.stride(1) != 1:
        xq = xq.contiguous()
    sx = sx.float().contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    lib.jf_gemm_fp8(_ptr(xq), m, k, xq.stride(0), _ptr(sx), sx.shape[1], _ptr(packed), wfmt, _ptr(sw), sw_ld,
                    weight_rows_per_scale, n, _ptr(out), n, groups)
    return out


def quantized_fp8_gemm(x2: Tensor, scale_rule: str, margin: int, packed: Tensor, sw: Tensor, n: int,
                       variant: str = "native", groups: int | None = None,
                       weight_rows_per_scale: int = 128) -> Tensor | None:
    """fp8_gemm(*quantize_1x128(x2, scale_rule, margin)[:2], packed, sw, n, ...) on the CPU, the same bits
    in one kernel call (an exact FP8 linear's fprop: a decode step pays it per linear); None, computing
    nothing, when a 1x128 group of x2 holds NaN / Inf (the caller's quantizer reports it)."""
    return prepare_quantized_fp8_gemm(scale_rule, margin, packed, sw, n, x2.shape[1], variant, groups,
                                      weight_rows_per_scale)(x2)


def prepare_quantized_fp8_gemm(scale_rule: str, margin: int, packed: Tensor, sw: Tensor, n: int, k: int,
                               variant: str = "native", groups: int | None = None,
                               weight_rows_per_scale: int = 128) -> Callable[[Tensor], Tensor | None]:
    """`quantized_fp8_gemm(x2, scale_rule, margin, packed, sw, n, ...)` with the weight's checks done once
    (as `prepare_gemm`): a function of x2 (M, K)."""
    if scale_rule not in ("fp32", "pow2"):
        raise ValueError(f"scale_rule={scale_rule!r}: 'fp32' or 'pow2'")
    lib = load_library(variant)
    wfmt, sw, sw_ld, groups = _fp8_weight_args(lib, k, packed, sw, n, groups, weight_rows_per_scale)
    kernel, pow2, margin_scale = lib.jf_linear_fp8, int(scale_rule == "pow2"), float(2.0**margin)

    def run(x2: Tensor) -> Tensor | None:
        m = _rows(x2, k)
        x2 = x2.float()
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        bad = kernel(_ptr(x2), m, k, x2.stride(0), pow2, margin_scale, _ptr(packed), wfmt, _ptr(sw), sw_ld,
                     weight_rows_per_scale, n, _ptr(out), n, groups)
        return None if bad else out
    return run


def _check_weight_scales(k: int, sw: Tensor, n: int, weight_rows_per_scale: int) -> None:
    if weight_rows_per_scale not in (1, canonical.BLOCK_K):
        raise ValueError(f"weight_rows_per_scale={weight_rows_per_scale}: 1 or {canonical.BLOCK_K}")
    if sw.shape[1] != -(-k // canonical.BLOCK_K) or sw.shape[0] * weight_rows_per_scale < n:
        raise ValueError(f"fp8_gemm scales: sw {tuple(sw.shape)} for K={k}, N={n}")


def _fp8_weight_args(lib, k: int, packed: Tensor, sw: Tensor, n: int, groups: int | None,
                     weight_rows_per_scale: int) -> tuple[int, Tensor, int, int]:
    """The CPU FP8 GEMM's weight arguments after checking them: (format code, scales as the kernel reads
    them, their row stride, groups)."""
    groups = _groups(k, groups)
    _check_weight_scales(k, sw, n, weight_rows_per_scale)
    wfmt = _check_packed(lib, packed, k, n, (torch.float8_e4m3fn, torch.int32), f"K={k}")
    if weight_rows_per_scale == 1:  # (nb, P * NR): the scales of a panel's columns are one vector load
        width = packed.shape[0] * packed.shape[2]
        sw = sw.float().t()  # no copy for a caller that keeps them so: the transpose of (nb, width) rows
        if sw.shape[1] != width:
            sw = F.pad(sw, (0, width - sw.shape[1]))
        sw, sw_ld = sw.contiguous(), width
    else:
        sw, sw_ld = sw.float().contiguous(), sw.shape[1]
    return wfmt, sw, sw_ld, groups


def quantize_1x128(x2: Tensor, scale_rule: str = "fp32", margin: int = 0,
                   variant: str = "native") -> tuple[Tensor, Tensor, int]:
    """x2 (M, K) fp32 -> (codes (M, K) float8_e4m3fn, scale_inv (M, ceil(K/128)) fp32, number of groups
    holding NaN / Inf): the bytes of jetflow.precision.quant.quantize_blocks(x2, (1, 128)) in one pass
    (csrc/quant.cpp; a group with NaN / Inf gets a NaN scale, and the caller raises)."""
    if scale_rule not in ("fp32", "pow2"):
        raise ValueError(f"scale_rule={scale_rule!r}: 'fp32' or 'pow2'")
    m, k = x2.shape
    x2 = x2.float()  # any strides: a transposed view (the wgrad's 128 x 1 groups) is read as it is, not copied
    codes = torch.empty(m, k, dtype=torch.uint8)
    scales = torch.empty(m, -(-k // canonical.BLOCK_K), dtype=torch.float32)
    bad = load_library(variant).jf_quantize_1x128(_ptr(x2), m, k, x2.stride(0), x2.stride(1), int(scale_rule == "pow2"),
                                                  float(2.0**margin), _ptr(codes), _ptr(scales))
    return codes.view(torch.float8_e4m3fn), scales, int(bad)


def round_to_bf16(t: Tensor, variant: str = "native") -> Tensor:
    """t rounded to the bf16 grid, in t's dtype: t.bfloat16().to(t.dtype), the same bits (round to nearest
    even); fp32 on the CPU in one pass (csrc/quant.cpp) instead of two casts and a bf16 intermediate."""
    if t.is_cuda or t.dtype != torch.float32:
        return t.bfloat16().to(t.dtype)
    t = t.contiguous()
    out = torch.empty_like(t)
    load_library(variant).jf_round_to_bf16(_ptr(t), t.numel(), _ptr(out))
    return out


def e4m3_to_float(codes: Tensor, variant: str = "native") -> Tensor:
    """The kernels' own conversion of E4M3 bytes to fp32 (for tests: it must equal torch's)."""
    codes = codes.contiguous().view(torch.uint8).reshape(-1)
    out = torch.empty(codes.numel(), dtype=torch.float32)
    load_library(variant).jf_e4m3_to_f32(_ptr(codes), codes.numel(), _ptr(out))
    return out


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, packed, groups, ordered_wgrad):
        ctx.save_for_backward(x, weight)
        ctx.ordered_wgrad = ordered_wgrad
        x2 = x.reshape(-1, x.shape[-1])
        y = gemm(x2, packed, weight.shape[0], groups=groups)
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])  # (M, N), (M, K)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (g2 @ weight.to(g2.dtype)).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (weight_grad(g2, x2) if ctx.ordered_wgrad else g2.t() @ x2.to(g2.dtype)).to(weight.dtype)
        return grad_x, grad_w, None, None, None


def weight_grad(g2: Tensor, x2: Tensor) -> Tensor:
    """g2^T @ x2: (M, N), (M, K) -> (N, K) fp32 over the M tokens in the FP8 wgrad's order (128-token blocks, chains
    from 0, added in order): a zero row of g2 adds exact zeros, so only which tokens share a block counts."""
    return gemm(g2.float().t(), pack_weight(x2.float().t()), x2.shape[1], groups=1)


def matmul(x: Tensor, weight: Tensor, packed: Tensor, groups: int | None = None, ordered_wgrad: bool = False) -> Tensor:
    """x (..., K) @ weight^T (weight (N, K), `packed = pack_weight(weight)` or of its bf16 copy): the canonical
    reduction (jetflow.kernels.canonical), so a row's result depends neither on the other rows nor on how K is
    sharded. Differentiable in x and weight (backward through torch's matmul; `ordered_wgrad`: the weight's by
    `weight_grad`). Operands on the bf16 grid: pack the weight as bfloat16 (half the bytes; on CUDA the
    product then runs on bf16 tensor cores: `gemm` reads the packed dtype)."""
    check_device(x.device)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _Matmul.apply(x, weight, packed, groups, ordered_wgrad)
    y = gemm(x.reshape(-1, x.shape[-1]), packed, weight.shape[0], groups=groups)  # no graph to record
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def reference_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, scale: float) -> Tensor:
    """The same function in plain torch ops (differentiable; the backward of `attention` and the
    tests' reference): q (B, H, T, D), k and v (B, H_kv, S, D), pos (B, T)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, T, S)
    future = torch.arange(k.shape[2], device=q.device)[None, None, None, :] > pos[:, None, :, None]
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v  # (B, H, T, D)


ATTENTION_BACKWARD_ROWS = 128
"""Query rows per block of the attention backward: a block's scores (B, H, 128, S) are the largest tensor
it holds, instead of the whole layer's (B, H, T, S)."""


class _Attention(torch.autograd.Function):
    """The exact kernel forward; the backward differentiates `reference_attention` a block of
    ATTENTION_BACKWARD_ROWS query rows at a time (each against the keys up to the block's last position):
    dq's rows written per block, dk and dv summed over the blocks in order in fp32. The blocks depend on
    the shapes and positions only, so the gradients are the same bits on every run (and with activation
    checkpointing on or off)."""

    @staticmethod
    def forward(ctx, q, kt, v, pos, scale, variant):
        ctx.save_for_backward(q, kt, v, pos)
        ctx.scale = scale
        return _attention_values(q, kt, v, pos, scale, variant)

    @staticmethod
    def backward(ctx, grad):
        q, kt, v, pos = ctx.saved_tensors  # (B, H, T, D), (B, Hkv, D, S), (B, Hkv, S, D), (B, T)
        need = ctx.needs_input_grad[:3]
        dq = torch.empty_like(q) if need[0] else None
        dkt = torch.zeros(kt.shape, dtype=torch.float32, device=kt.device) if need[1] else None
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device) if need[2] else None
        for t0 in range(0, q.shape[2] if any(need) else 0, ATTENTION_BACKWARD_ROWS):
            t1 = min(t0 + ATTENTION_BACKWARD_ROWS, q.shape[2])
            s = int(pos[:, t0:t1].max()) + 1  # keys past it get no weight from this block: exact zeros
            with torch.enable_grad():
                qb = q[:, :, t0:t1].detach().requires_grad_(need[0])  # (B, H, b, D)
                ktb = kt[..., :s].detach().requires_grad_(need[1])  # (B, Hkv, D, s)
                vb = v[:, :, :s].detach().requires_grad_(need[2])  # (B, Hkv, s, D)
                out = reference_attention(qb, ktb.transpose(-1, -2), vb, pos[:, t0:t1], ctx.scale)  # (B, H, b, D)
                wrt = [t for t in (qb, ktb, vb) if t.requires_grad]
                grads = iter(torch.autograd.grad(out, wrt, grad[:, :, t0:t1]))
            if need[0]:
                dq[:, :, t0:t1] = next(grads)
            if need[1]:
                dkt[..., :s] += next(grads)
            if need[2]:
                dv[:, :, :s] += next(grads)
        return (dq, None if dkt is None else dkt.to(kt.dtype), None if dv is None else dv.to(v.dtype),
                None, None, None)


def _positions(pos: Tensor, slots: int, what: str) -> Tensor:
    """Query positions as the kernels read them (int64, contiguous), each a key slot in [0, slots)."""
    pos = pos.to(torch.int64).contiguous()
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= slots):
        raise ValueError(f"{what}: query positions must lie in [0, {slots}) (the key slots given), "
                         f"got {int(pos.min())}..{int(pos.max())}")
    return pos


def _attention_values(q: Tensor, kt: Tensor, v: Tensor, pos: Tensor, scale: float, variant: str) -> Tensor:
    B, H, T, D = q.shape
    Hkv, S = kt.shape[1], kt.shape[3]
    if kt.shape != (B, Hkv, D, S) or v.shape != (B, Hkv, S, D) or pos.shape != (B, T) or H % Hkv:
        raise ValueError(f"attention shapes: q {tuple(q.shape)}, kt {tuple(kt.shape)}, v {tuple(v.shape)}, "
                         f"pos {tuple(pos.shape)}")
    if q.is_cuda:  # Triton; query positions past the slots given see every slot (no sync to check them)
        dtype = q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32
        k, v = kt.transpose(-1, -2).to(dtype), v.to(dtype)  # (B, H_kv, S, D) views when dtypes agree
        return cuda_kernels.attention(q.to(dtype), k, v, pos, scale).to(q.dtype)
    dtype = q.dtype
    q = q.float().contiguous()
    if kt.dtype != torch.float32 or kt.stride(3) != 1:
        kt = kt.float().contiguous()
    if v.dtype != torch.float32 or v.stride(3) != 1:
        v = v.float().contiguous()
    pos = _positions(pos, S, "attention")
    out = torch.empty(B, H, T, D, dtype=torch.float32)
    load_library(variant).jf_attention(_ptr(q), _ptr(kt), kt.stride(0), kt.stride(1), kt.stride(2), _ptr(v),
                                    v.stride(0), v.stride(1), v.stride(2), _ptr(pos), _ptr(out), B, H, Hkv, T, D,
                                    float(scale))
    return out.to(dtype)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, kt_cache: Tensor,
                     v_cache: Tensor, end: int, scale: float, variant: str = "native") -> Tensor:
    """One decode step of exact attention on the CPU, one new token per row: the bits of `apply_rope` on q
    and k, the KV-cache write (`KVCache.update` at slot pos[b]) and `attention`, in two kernel calls
    instead of ~25 torch ops (csrc/rope.cpp, then jf_attention).

    q (B, H, D), k and v (B, H_kv, D): unit stride along D, heads D apart (views of the projections'
    rows); cos, sin (B, D); pos (B,) int64, each row's position = its slot; kt_cache (B, H_kv, D, max_len)
    and v_cache (B, H_kv, max_len, D) one layer's fp32 cache (K transposed), written at slot pos[b]; `end`:
    key slots [0, end) are attended. Returns (B, H, D) fp32. No autograd (a decode step)."""
    B, H, D = q.shape
    Hkv = k.shape[1]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float32 or t.stride(2) != 1 or t.stride(1) != D:
            raise ValueError(f"decode_attention: {name} {tuple(t.shape)} must be fp32 rows of heads D apart")
    if D % 2 or D > 512 or k.shape != (B, Hkv, D) or v.shape != (B, Hkv, D) or H % Hkv \
            or kt_cache.shape[:3] != (B, Hkv, D) or v_cache.shape[:2] != (B, Hkv) or kt_cache.stride(3) != 1 \
            or v_cache.stride(3) != 1 or end > min(kt_cache.shape[3], v_cache.shape[2]):
        raise ValueError(f"decode_attention shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"caches {tuple(kt_cache.shape)} {tuple(v_cache.shape)}, end {end}")
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    pos = _positions(pos, end, "decode_attention")
    lib = load_library(variant)
    q_rot = torch.empty(B, H, 1, D, dtype=torch.float32)
    lib.jf_rope_decode(_ptr(q), q.stride(0), _ptr(k), k.stride(0), _ptr(v), v.stride(0), _ptr(cos), _ptr(sin), D,
                       _ptr(pos), _ptr(q_rot), _ptr(kt_cache), *kt_cache.stride()[:3], _ptr(v_cache),
                       *v_cache.stride()[:3], B, H, Hkv, D)
    out = torch.empty(B, H, 1, D, dtype=torch.float32)
    lib.jf_attention(_ptr(q_rot), _ptr(kt_cache), *kt_cache.stride()[:3], _ptr(v_cache), *v_cache.stride()[:3],
                     _ptr(pos), _ptr(out), B, H, Hkv, 1, D, float(scale))
    return out.view(B, H, D)


def attention(q: Tensor, kt: Tensor, v: Tensor, pos: Tensor, scale: float, variant: str = "native") -> Tensor:
    """Causal attention by position: query (b, t) at position pos[b, t] attends key slots 0..pos[b, t]
    of its own row (slot = position: sequences start at slot 0).
    q (B, H, T, D); kt (B, H_kv, D, S): keys transposed, unit stride along S (a KV cache keeps K this
    way); v (B, H_kv, S, D), unit stride along D; pos (B, T). Returns (B, H, T, D). A query's result
    is the same bits whatever B, T, S or the other queries are (two-pass softmax: the max over the
    query's keys, then exp, the sum and the weighted sum of V in key order)."""
    check_device(q.device)
    if torch.is_grad_enabled() and (q.requires_grad or kt.requires_grad or v.requires_grad):
        return _Attention.apply(q, kt, v, pos, float(scale), variant)
    return _attention_values(q, kt, v, pos, float(scale), variant)  # no graph to record (a decode step)
