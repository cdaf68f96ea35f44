"""Scaled GEMM behind one entry point.

`fp8_matmul(a, b)` computes a @ b.T for block-quantized operands a (M, K) and b (N, K), both
blocked along the contraction dim K:
  a: 1 x 128 groups (activations, output gradients, or a transposed 128 x 1 operand)
  b: 128 x 128 blocks (weights) or 1 x 128 groups (the weight-gradient GEMM's second operand)

Backends:
  scaled_mm  Hopper (SM90+, CUDA >= 12.9): torch._scaled_mm with block scales, fp32 accumulation,
             bf16 output (the only output dtype cuBLAS offers for block scaling).
  emulate    anywhere: dequantize both operands to fp32, fp32 matmul. The same math as the
             hardware path up to accumulation order.
`auto` picks scaled_mm on a capable CUDA device, else emulate.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from jetflow.precision.quant import QuantizedTensor

GEMM_BACKENDS = ("auto", "scaled_mm", "emulate")


@functools.lru_cache(maxsize=None)
def _device_supports_block_scaled_mm(device_index: int) -> bool:
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability(device_index)
    cuda = torch.version.cuda or "0.0"
    cuda_major, cuda_minor = (int(p) for p in cuda.split(".")[:2])
    return major >= 9 and (cuda_major, cuda_minor) >= (12, 9)


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
    backend = resolve_backend(backend, a.data.device)
    if backend == "scaled_mm":
        return _scaled_mm_blockwise(a, b).to(out_dtype)
    return (a.dequantize() @ b.dequantize().t()).to(out_dtype)


def _pad_rows(t: torch.Tensor, multiple: int, value: float = 0.0) -> torch.Tensor:
    extra = -t.shape[0] % multiple
    if extra == 0:
        return t
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # F.pad has no float8 kernels
        return torch.cat([t, torch.zeros(extra, *t.shape[1:], dtype=t.dtype, device=t.device)])
    return F.pad(t, (0, 0, 0, extra), value=value)


def _pad_cols(t: torch.Tensor, multiple: int, value: float = 0.0) -> torch.Tensor:
    return _pad_rows(t.t(), multiple, value).t()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def blockwise_operands(a: QuantizedTensor, b: QuantizedTensor):
    """The four `torch._scaled_mm` arguments for a @ b.T with block scales, laid out as cuBLASLt's
    block-scaling contract (cuBLAS docs, "scaling factors layouts"; checked by torch's ScaledBlas.cpp)
    wants them; returns (mat_a (M', K'), mat_b (K', N'), scale_a, scale_b). Padding is exact: padded
    data are zeros (scale 1), and the caller slices the (M, N) result out of the (M', N') product.

      mat_a   (M4, K128)  row-major; M padded to 4 (16-byte aligned scale columns), K to whole 128-blocks
      mat_b   (K128, N16) column-major; cuBLAS wants both of mat_b's dims divisible by 16
      scale_a (M4, K/128) outer-dim-major: strides (1, M4)
      scale_b 128x128 blocks: (K/128, N/128) with strides (1, L4), L4 = K/128 rounded up to 4 (without
              that padding cuBLASLt silently computes wrong answers, pytorch#166752);
              1x128 groups: (K/128, N16) row-major
    """
    group = a.block[1]
    if group != 128 or b.block[1] != 128 or b.block[0] not in (1, 128):
        raise ValueError(f"scaled_mm backend supports 1x128 x (128x128 | 1x128) blocks, got {a.block} x {b.block}")
    a_data = _pad_rows(_pad_cols(a.data, 128), 4)  # (M4, K128)
    b_data = _pad_rows(_pad_cols(b.data, 128), 16)  # (N16, K128)
    scale_a = _pad_rows(a.scale_inv, 4, 1.0).t().contiguous().t()  # (M4, kb), strides (1, M4)
    if b.block[0] == 128:
        nb, kb = b.scale_inv.shape
        padded = b.scale_inv.new_ones(nb, _round_up(kb, 4))
        padded[:, :kb] = b.scale_inv
        scale_b = padded[:, :kb].t()  # (kb, nb), strides (1, L4)
    else:
        scale_b = _pad_rows(b.scale_inv, 16, 1.0).t().contiguous()  # (kb, N16)
    return a_data.contiguous(), b_data.contiguous().t(), scale_a, scale_b


def _scaled_mm_blockwise(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """torch._scaled_mm with 1x128 x 128x128 (or 1x128 x 1x128) block scales; bf16 out, (M, N)."""
    mat_a, mat_b, scale_a, scale_b = blockwise_operands(a, b)
    out = torch._scaled_mm(mat_a, mat_b, scale_a, scale_b, out_dtype=torch.bfloat16)
    return out[:a.shape[0], :b.shape[0]]


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                weight_on_grid: bool = False) -> torch.Tensor:
    """A bf16 GEMM: bf16 operands, fp32 accumulation, bf16-rounded output, returned in x's dtype.

    On CUDA this is a real bf16 GEMM. On the CPU, bf16 matmul is a slow fallback (FACTS.md), so the
    operands are rounded to the bf16 grid and multiplied in fp32: the same values a bf16 tensor-core
    GEMM produces, up to accumulation order. `weight_on_grid` says the fp32 weight is already rounded
    to bf16 (a cached copy), which saves re-rounding a large weight on every decode step.
    """
    if x.is_cuda:
        out = F.linear(x.bfloat16(), weight.bfloat16(), None if bias is None else bias.bfloat16())
        return out.to(x.dtype)
    w = weight if weight_on_grid else weight.bfloat16().float()
    out = F.linear(x.bfloat16().float(), w, None if bias is None else bias.bfloat16().float())
    return out.bfloat16().to(x.dtype)
