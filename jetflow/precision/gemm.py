"""Scaled GEMM behind one entry point.

`fp8_matmul(a, b)` computes a @ b.T for block-quantized operands a (M, K) and b (N, K), both
blocked along the contraction dim K:
  a: 1 x 128 groups (activations, output gradients, or a transposed 128 x 1 operand)
  b: 128 x 128 blocks (weights) or 1 x 128 groups (the weight-gradient GEMM's second operand)

Backends:
  scaled_mm  Hopper (SM90, CUDA >= 12.9): cuBLASLt's block-scaled FP8 GEMM through torch
             (`F.scaled_mm`, or `torch._scaled_mm` where that is missing or an operand is E5M2),
             fp32 accumulation, bf16 output (the only output dtype cuBLAS offers for block scaling).
  emulate    anywhere: dequantize both operands to fp32, fp32 matmul. The same products with fp32
             accumulation; unlike the hardware path, the output is not rounded to bf16.
  triton     CUDA: jetflow's block-scaled FP8 Triton kernel (jetflow.kernels.triton.gemm): the FP8
             bytes on the tensor cores, each 128-K block's sum scaled and added in one fixed order,
             one tile configuration per (N, K), fp32 or bf16 output. Batch-invariant.
`auto` picks scaled_mm on a capable CUDA device, else emulate. Blackwell (SM100+) is left to the
emulation: torch offers DeepSeek-style 128-blocks on SM90 only.

Other block sizes of the fp8_block recipe (32-wide groups and blocks, say: no FP8 kernel here reads
them) run on the emulation under `auto`. Exact numerics are not a backend here: the exact fprop is
jetflow.precision.fp8_function.exact_fprop (the canonical FP8 GEMM); `fp8_kernel_matmul` serves the
exact linear's backward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from jetflow.kernels import invariant
from jetflow.precision.quant import QuantizedTensor

GEMM_BACKENDS = ("auto", "scaled_mm", "emulate", "triton")


@functools.lru_cache(maxsize=None)
def _device_supports_block_scaled_mm(device_index: int) -> bool:
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability(device_index)
    cuda = torch.version.cuda or "0.0"
    cuda_major, cuda_minor = (int(p) for p in cuda.split(".")[:2])
    return major == 9 and (cuda_major, cuda_minor) >= (12, 9)


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"gemm backend {backend!r}: valid backends are {GEMM_BACKENDS}")
    if backend != "auto":
        return backend
    if device.type == "cuda" and _device_supports_block_scaled_mm(device.index or 0):
        return "scaled_mm"
    return "emulate"


def fp8_matmul(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype = torch.float32,
               backend: str = "auto") -> torch.Tensor:
    """a @ b.T -> (M, N) in out_dtype; a (M, K) with (1, g) groups, b (N, K) with (128, 128) or (1, g)."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_matmul: contraction dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    if a.block[0] != 1:
        raise ValueError(f"fp8_matmul: a must be blocked 1 x g along K, got block {a.block}")
    kernel_blocks = a.block == (1, 128) and b.block in ((128, 128), (1, 128))
    backend = resolve_backend(backend, a.data.device) if kernel_blocks or backend != "auto" else "emulate"
    if backend == "triton":
        return _triton_blockwise(a, b, out_dtype)
    if backend == "scaled_mm":
        return _scaled_mm_blockwise(a, b).to(out_dtype)
    return (a.dequantize() @ b.dequantize().t()).to(out_dtype)


def fp8_kernel_matmul(a: QuantizedTensor, b: QuantizedTensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b.T -> (M, N) fp32 on the CPU's FP8 kernels (jetflow.kernels.invariant.fp8_gemm: the FP8 bytes
    read as they are), for E4M3 a in 1x128 groups and b in 128x128 blocks or 1x128 groups, any K (one
    group: no tree). The backward GEMMs of exact linears (dgrad: b = W^T, `packed` its cached panels,
    `QuantizedTensor.panels_t`; wgrad: b = X^T)."""
    if packed is None:
        packed = invariant.pack_weight(b.data)
    rows = 128 if b.block == (128, 128) else 1
    return invariant.fp8_gemm(a.data, a.scale_inv, packed, b.scale_inv, b.shape[0], groups=1,
                              weight_rows_per_scale=rows)


def _triton_blockwise(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """jetflow's Triton FP8 GEMM, 1x128 x (128x128 | 1x128): (M, N) in out_dtype (bf16 or fp32 written
    by the kernel, other dtypes cast from fp32)."""
    if not a.data.is_cuda:
        raise ValueError(f"gemm backend 'triton' runs on CUDA tensors, got {a.data.device}")
    if a.block != (1, 128) or b.block not in ((128, 128), (1, 128)):
        raise ValueError(f"triton backend supports 1x128 x (128x128 | 1x128) blocks, got {a.block} x {b.block}")
    kernel_dtype = out_dtype if out_dtype == torch.bfloat16 else torch.float32
    out = invariant.cuda_kernels.fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, b.block[0], kernel_dtype)
    return out.to(out_dtype)


def _pad_to(t: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    """t (r, c) padded at the bottom and right to (rows, cols) with `value`; t itself if no padding."""
    if t.shape == (rows, cols):
        return t
    out = t.new_zeros(rows, cols)
    if value:
        out.fill_(value)
    out[:t.shape[0], :t.shape[1]] = t
    return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def scaled_mm_api(a: QuantizedTensor, b: QuantizedTensor) -> str:
    """Which torch entry point runs a @ b.T: "v2" (`F.scaled_mm`, explicit scaling recipes) when
    torch has it and both operands are E4M3 (its DeepSeek recipes take E4M3 only), else "v1"
    (`torch._scaled_mm`, which infers the recipe from the scale shapes and also takes one E5M2
    operand: the gradients under the `hybrid` format)."""
    e4m3 = a.data.dtype == b.data.dtype == torch.float8_e4m3fn
    return "v2" if e4m3 and hasattr(F, "scaled_mm") else "v1"


def blockwise_operands(a: QuantizedTensor, b: QuantizedTensor, api: str):
    """The operands of a @ b.T for torch's block-scaled FP8 GEMM, laid out as cuBLASLt's contract
    wants them (cuBLAS docs, "1D and 128x128 2D block scaling"; pytorch#166752); returns
    (mat_a (M', K'), mat_b (K', N'), scale_a, scale_b). Padding is exact: padded data are zeros
    (scale 1), and the caller slices the (M, N) result out of the (M', N') product.

      mat_a    (M4, K') row-major: M padded to 4 (16-byte aligned scale columns), K to 128-blocks
      mat_b    (K', N') column-major: N padded to 16 (cuBLAS wants both dims divisible by 16), to
               whole 128-blocks for v2's 128x128 scales
      scale_a  (M4, K'/128), strides (1, M4)
      scale_b  128x128 blocks, v2: (L4, N'/128), strides (1, L4), L4 = K'/128 rounded up to 4;
               128x128 blocks, v1: (K'/128, N'/128), strides (1, K'/128) with K padded to 512, so
                 that K'/128 == L4: torch versions disagree on whether v1 wants the K-block stride
                 rounded up to 4, and both accept it when it already is;
               1x128 groups: (N', K'/128), strides (1, N') for v2; the same memory as (K'/128, N')
                 row-major for v1.
    """
    group = a.block[1]
    if group != 128 or b.block[1] != 128 or b.block[0] not in (1, 128):
        raise ValueError(f"scaled_mm backend supports 1x128 x (128x128 | 1x128) blocks, got {a.block} x {b.block}")
    if api not in ("v1", "v2"):
        raise ValueError(f"scaled_mm api {api!r}: expected 'v1' or 'v2'")
    weight_blocks = b.block[0] == 128
    (m, k), n = a.shape, b.shape[0]
    k_pad = _round_up(k, 512 if weight_blocks and api == "v1" else 128)
    n_pad = _round_up(n, 128 if weight_blocks and api == "v2" else 16)
    m_pad, kb = _round_up(m, 4), k_pad // 128
    mat_a = _pad_to(a.data, m_pad, k_pad).contiguous()  # (M4, K') row-major
    mat_b = _pad_to(b.data, n_pad, k_pad).contiguous().t()  # (K', N') column-major
    scale_a = _pad_to(a.scale_inv, m_pad, kb, 1.0).t().contiguous().t()  # (M4, kb), strides (1, M4)
    if weight_blocks:
        l4 = _round_up(kb, 4)  # == kb under v1 (K' is a multiple of 512)
        scale_b = _pad_to(b.scale_inv, _round_up(n_pad, 128) // 128, l4, 1.0).contiguous().t()  # (L4, N'/128), strides (1, L4)
    else:
        scale_b = _pad_to(b.scale_inv, n_pad, kb, 1.0).t().contiguous()  # (kb, N') row-major
        if api == "v2":
            scale_b = scale_b.t()  # (N', kb), strides (1, N')
    return mat_a, mat_b, scale_a, scale_b


def _scaled_mm_blockwise(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """cuBLASLt's block-scaled FP8 GEMM, 1x128 x 128x128 (or 1x128 x 1x128); bf16 out, (M, N)."""
    api = scaled_mm_api(a, b)
    mat_a, mat_b, scale_a, scale_b = blockwise_operands(a, b, api)
    if api == "v2":
        recipe_b = F.ScalingType.BlockWise128x128 if b.block[0] == 128 else F.ScalingType.BlockWise1x128
        out = F.scaled_mm(mat_a, mat_b, scale_a, F.ScalingType.BlockWise1x128, scale_b, recipe_b,
                          output_dtype=torch.bfloat16)
    else:
        out = torch._scaled_mm(mat_a, mat_b, scale_a, scale_b, out_dtype=torch.bfloat16)
    return out[:a.shape[0], :b.shape[0]]


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                weight_on_grid: bool = False) -> torch.Tensor:
    """A bf16 GEMM: bf16 operands, fp32 accumulation, bf16-rounded output, returned in x's dtype.

    On CUDA this is a real bf16 GEMM. On the CPU, bf16 matmul is a slow fallback (FACTS.md), so the
    operands are rounded to the bf16 grid and multiplied in fp32: the same values a bf16 tensor-core
    GEMM produces, up to accumulation order. `weight_on_grid` says the fp32 weight is already rounded
    to bf16 (a cached copy), which saves re-rounding a large weight on every decode step. (Exact
    numerics: jetflow.precision.exact.)
    """
    if x.is_cuda:
        out = F.linear(x.bfloat16(), weight.bfloat16(), None if bias is None else bias.bfloat16())
        return out.to(x.dtype)
    w = weight if weight_on_grid else weight.bfloat16().float()
    out = F.linear(x.bfloat16().float(), w, None if bias is None else bias.bfloat16().float())
    return out.bfloat16().to(x.dtype)
