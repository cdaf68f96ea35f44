"""Compile every kernel for Hopper (sm_90) without a GPU: a CI check that the CUDA build works.

    for spec in SPECS: compile_sm90(spec)       # triton.compile(..., target=GPUTarget("cuda", 90, 32))

Each spec is one specialization the wrappers launch (the tile configurations of gemm.py and
attn.py, each dtype combination), compiled with the bundled ptxas. `expect` lists PTX that the
specialization must contain: wgmma (Hopper's tensor-core MMA) for the GEMMs and the bf16 attention,
div.rn.f32 (IEEE division) where the quantizer must reproduce the CPU's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jetflow.kernels.triton import attn, gemm, microscaled, paged_exact, quant, rmsnorm

HOPPER = ("cuda", 90, 32)  # backend, compute capability, warp size
BLACKWELL = ("cuda", 100, 32)


@dataclass(frozen=True)
class Spec:
    name: str
    kernel: object  # a triton JITFunction
    pointers: dict[str, str]  # pointer argument -> element type ("fp32", "bf16", "fp8e4nv", "fp8e5", "i32", ...)
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int = 3
    floats: tuple[str, ...] = ()  # fp32 scalar arguments; every other scalar is an i32
    expect: tuple[str, ...] = field(default=())


def signature(spec: Spec) -> dict[str, str]:
    sig = {}
    for name in spec.kernel.arg_names:
        if name in spec.constexprs:
            sig[name] = "constexpr"
        elif name in spec.pointers:
            sig[name] = "*" + spec.pointers[name]
        else:
            sig[name] = "fp32" if name in spec.floats else "i32"
    return sig


def _fp8_gemm(name: str, a: str, b: str, out: str, rows_per_scale: int, groups: int = 8) -> Spec:
    cfg = gemm.fp8_config(4096, 4096)
    return Spec(name, gemm._fp8_gemm_kernel, {"a_ptr": a, "b_ptr": b, "c_ptr": out, "sa_ptr": "fp32", "sb_ptr": "fp32"},
                {"B_ROWS_PER_SCALE": rows_per_scale, "OUT_BF16": out == "bf16", "BLOCK_M": cfg.block_m,
                 "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m, "GROUPS": groups},
                cfg.num_warps, cfg.num_stages, expect=("wgmma",))


def _dense(dot: str, operand: str, out: str, groups: int = 8) -> Spec:
    cfg = gemm.dense_config(4096, 4096, dot)
    return Spec(f"dense_{dot}_dot_{operand}_in_{out}_out_{groups}_groups", gemm._dense_gemm_kernel,
                {"a_ptr": operand, "b_ptr": operand, "c_ptr": out},
                {"DOT_BF16": dot == "bf16", "OUT_BF16": out == "bf16", "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                 "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m, "GROUPS": groups},
                cfg.num_warps, cfg.num_stages, expect=("wgmma",) if dot == "bf16" else ())


def _attention(q: str, kv: str, paged: bool) -> Spec:
    return Spec(f"attention_q_{q}_kv_{kv}_{'paged' if paged else 'contiguous'}", attn._attention_kernel,
                {"q_ptr": q, "k_ptr": kv, "v_ptr": kv, "o_ptr": q, "pos_ptr": "i64", "table_ptr": "i32",
                 "k_scale_ptr": "fp32", "v_scale_ptr": "fp32"},
                {"D": 128, "D_PAD": 128, "PAGED": paged, "PAGE_SIZE": 16 if paged else 1, "KV_FP8": kv == "fp8e4nv",
                 "DOT_BF16": q == "bf16", "OUT_BF16": q == "bf16", "BLOCK_M": attn.BLOCK_M,
                 "BLOCK_N": attn.BLOCK_N},
                4, 2, floats=("qk_scale",), expect=("wgmma",) if q == "bf16" else ())


def _paged_exact(kv: str) -> Spec:
    """The paged attention with the C++ arithmetic (fp32 CUDA-core fma, no MMA): `fma.rn.f32` must
    appear (the chains are fused multiply-adds, one rounding each) and `div.rn.f32`."""
    fmt = {"fp32": 0, "bf16": 1, "fp8e4nv": 2}[kv]
    return Spec(f"paged_exact_attention_kv_{kv}", paged_exact._paged_exact_kernel,
                {"q_ptr": "fp32", "k_ptr": kv, "v_ptr": kv, "o_ptr": "fp32", "pos_ptr": "i64", "table_ptr": "i32",
                 "scales_ptr": "fp32"},
                {"D": 64, "D_PAD": 64, "FMT": fmt, "PAGE": 64, "BLOCK_M": paged_exact.BLOCK_M,
                 "BLOCK_N": paged_exact.BLOCK_N}, 4, 1, expect=("fma.rn.f32", "div.rn.f32"))


def _quant(x: str, pow2: bool) -> Spec:
    return Spec(f"quantize_1x128_{x}_{'pow2' if pow2 else 'fp32'}_scales", quant._quantize_1x128_kernel,
                {"x_ptr": x, "q_ptr": "fp8e4nv", "s_ptr": "fp32"},
                {"MARGIN_SCALE": 1.0, "POW2": pow2, "BLOCK_M": quant.BLOCK_M, "GROUP": quant.GROUP},
                4, 3, expect=("div.rn.f32",))


def _microscaled(nvfp4: bool, native: bool, out: str = "fp32", groups: int = 8) -> Spec:
    """The mxfp8 / nvfp4 GEMM: dequantizing to bf16 tensor cores (sm_90: wgmma) or, native, the
    block-scaled MMA of tl.dot_scaled (sm_100)."""
    cfg = gemm.fp8_config(4096, 4096)
    codes, scales = ("u8", "fp8e4nv") if nvfp4 else ("fp8e4nv", "u8")
    fmt = "nvfp4" if nvfp4 else "mxfp8"
    return Spec(f"{fmt}_gemm_{'dot_scaled' if native else 'dequantized'}_{out}_out_{groups}_groups",
                microscaled._microscaled_gemm_kernel,
                {"a_ptr": codes, "sa_ptr": scales, "da_ptr": "fp32", "b_ptr": codes, "sb_ptr": scales,
                 "db_ptr": "fp32", "c_ptr": out},
                {"NVFP4": nvfp4, "NATIVE": native, "B_ROWS_PER_SCALE": 16 if nvfp4 else 1, "ROW_DA": nvfp4,
                 "OUT_BF16": out == "bf16", "BLOCK_M": cfg.block_m,
                 "BLOCK_N": microscaled.native_block_n(groups) if native else cfg.block_n, "GROUP_M": cfg.group_m,
                 "GROUPS": groups}, cfg.num_warps, 2,
                expect=(f"tcgen05.mma.cta_group::1.kind::{'mxf4nvf4' if nvfp4 else 'mxf8f6f4'}.block_scale",)
                if native else ("wgmma",))


def _rms_norm(x: str, out: str) -> Spec:
    return Spec(f"rms_norm_{x}_in_{out}_out", rmsnorm._rms_norm_kernel, {"x_ptr": x, "w_ptr": "fp32", "y_ptr": out},
                {"BLOCK_C": 4096, "X_BF16": x == "bf16", "OUT_BF16": out == "bf16"}, 4, 1, floats=("eps",))


SPECS: list[Spec] = [
    _quant("fp32", False), _quant("bf16", True),
    _fp8_gemm("fp8_gemm_fprop_bf16_out", "fp8e4nv", "fp8e4nv", "bf16", 128),
    _fp8_gemm("fp8_gemm_fprop_fp32_out", "fp8e4nv", "fp8e4nv", "fp32", 128),
    _fp8_gemm("fp8_gemm_fprop_one_group", "fp8e4nv", "fp8e4nv", "fp32", 128, groups=1),
    _fp8_gemm("fp8_gemm_wgrad_1x128_groups", "fp8e4nv", "fp8e4nv", "fp32", 1),
    _fp8_gemm("fp8_gemm_dgrad_e5m2_grad", "fp8e5", "fp8e4nv", "fp32", 128),
    _dense("bf16", "fp32", "fp32"), _dense("bf16", "bf16", "bf16"), _dense("fp32", "fp32", "fp32"),
    _dense("bf16", "bf16", "fp32", groups=1),
    _attention("bf16", "bf16", False), _attention("fp32", "fp32", False), _attention("bf16", "fp8e4nv", True),
    _attention("fp32", "fp8e4nv", True),
    _paged_exact("fp32"), _paged_exact("bf16"), _paged_exact("fp8e4nv"),
    _rms_norm("fp32", "fp32"), _rms_norm("bf16", "fp32"),
    _microscaled(False, False), _microscaled(True, False), _microscaled(False, False, groups=1),
    _microscaled(True, False, "bf16", groups=1),
]

SM100_SPECS: list[Spec] = [_microscaled(False, True), _microscaled(True, True), _microscaled(True, True, groups=1)]
"""Blackwell's block-scaled MMA (tl.dot_scaled on MXFP8 / NVFP4 codes and scales), compiled for sm_100."""


def compile_sm90(spec: Spec, target: tuple = HOPPER):
    """triton.compile for sm_90 (or `target`, e.g. BLACKWELL); returns the compiled kernel (its .asm
    holds ptx and cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=spec.kernel, signature=signature(spec), constexprs=dict(spec.constexprs))
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages, "enable_fp_fusion": False}
    return triton.compile(src, target=GPUTarget(*target), options=options)
