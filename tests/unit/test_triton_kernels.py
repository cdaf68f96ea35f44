"""jetflow's Triton kernels (jetflow/kernels/triton/), tested on the CPU.

1. Under TRITON_INTERPRET=1 (in a child process, tests/unit/triton_interpret_cases.py, which also
   says which interpreter bugs are worked around where): each kernel on small shapes against the
   CPU reference, bitwise where the arithmetic is the same, else within a stated bound, and its row
   invariance (M = 1 vs 64 and a row at another tile position; decode rows vs prefill rows).
2. Each kernel specialization compiles for sm_90 (`triton.compile` with a GPUTarget, the bundled
   ptxas): the GEMMs and the bf16 attention use wgmma, the quantizer IEEE division.
The same kernels run on an H100 in tests/gpu (scripts/gpu_check.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from jetflow.kernels.invariant import reference_attention  # noqa: E402
from jetflow.kernels.triton import PINNED_VERSION, reference  # noqa: E402
from jetflow.precision.quant import quantize_blocks  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
U8 = torch.uint8


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    """Runs every interpreter case once (about 90 s on 2 contended cores); returns a loader of one case's tensors."""
    out = tmp_path_factory.mktemp("triton_interpret")
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(HERE / "triton_interpret_cases.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    timings = json.loads((out / "timings.json").read_text())
    print(f"\ninterpreter cases (triton {timings['triton']}), seconds: {timings['seconds']}")
    return lambda name: torch.load(out / f"{name}.pt")


def test_triton_is_the_pinned_version():
    """The interpreter tests and the GPU build must run one Triton (its casts and lowering differ by
    version): triton==3.6.0, the GPU image's version, is the pin."""
    assert triton.__version__ == PINNED_VERSION


def test_bit_roundings_equal_torch(interp):
    """round_to_bf16 and fp32_to_e4m3 (every E4M3 value, every tie between neighbours and a hair
    either side, bf16 ties, subnormals), bitwise against torch's casts."""
    r = interp("roundings")
    x = r["x"]
    assert torch.equal(r["bf16"].view(torch.int16), x.bfloat16().view(torch.int16))
    assert torch.equal(r["e4m3"].view(U8), x.clamp(-448, 448).to(torch.float8_e4m3fn).view(U8))


def test_pow2_rule_equals_the_cpu_quantizers(interp):
    """pow2_at_or_above(s) = 2^ceil(fp32(log2(s))) with log2 in float64, as the CPU's compute_scale_inv,
    on scales just above powers of two 2^-40 .. 2^3, where the fp32 rounding of log2 can land on the
    power itself (some of these cases do, so the rule is tested where it differs from an exact ceil)."""
    r = interp("roundings")
    s = r["s"]
    log2 = torch.log2(s.double()).float()
    rule = torch.ldexp(torch.ones_like(s), torch.ceil(log2).int())
    assert torch.equal(r["pow2"], rule)
    exact_ceil = torch.ldexp(torch.ones_like(s), torch.ceil(torch.log2(s.double())).int())
    assert int((rule != exact_ceil).sum()) > 0


def test_quantize_1x128_bytes_equal_the_cpu_quantizer(interp):
    """Bytes and scales equal jetflow.precision.quant's, for fp32 and pow2 scales, margins 0 and 1,
    fp32 and bf16 inputs, a K with a partial group (300 = 2 x 128 + 44), an all-zero group and values
    spanning 15 decades; a row quantized alone equals the same row in the batch."""
    r = interp("quantize")
    x = r["x"]
    for rule in ("fp32", "pow2"):
        for margin in (0, 1):
            ref = quantize_blocks(x, (1, 128), scale_rule=rule, margin=margin)
            assert torch.equal(r[f"{rule}_{margin}_data"].view(U8), ref.data.view(U8)), (rule, margin)
            assert torch.equal(r[f"{rule}_{margin}_scale"], ref.scale_inv), (rule, margin)
    ref = quantize_blocks(r["xb"], (1, 128))
    assert torch.equal(r["xb_data"].view(U8), ref.data.view(U8)) and torch.equal(r["xb_scale"], ref.scale_inv)
    assert torch.equal(r["row1_data"].view(U8), r["fp32_0_data"][5:6].view(U8))
    assert torch.equal(r["row1_scale"], r["fp32_0_scale"][5:6])


def test_quantize_1x128_marks_nonfinite_groups(interp):
    """A group holding Inf or NaN gets a NaN scale (the caller raises, as the CPU quantizer does)."""
    bad = interp("quantize")["bad_scale"]  # (3, 2): inf in row 1 group 1, nan in row 2 group 0
    assert torch.equal(torch.isnan(bad), torch.tensor([[False, False], [False, True], [True, False]]))


def _dequantized_product(a, sa, b, sb, rows_per_scale):
    """The exact product of the dequantized operands, float64 (a stated bound compares against it)."""
    k = a.shape[1]
    da = a.double() * sa.double().repeat_interleave(128, 1)[:, :k]
    db = b.double() * sb.double().repeat_interleave(rows_per_scale, 0)[:b.shape[0]].repeat_interleave(128, 1)[:, :k]
    return da @ db.t()


def _fp8_bound(a, sa, b, sb, rows_per_scale):
    """|kernel - exact| <= (3 kb + 2) * 2^-24 * (|A| @ |B|^T) for kb K blocks: per block one rounding of
    its sum, of the scale product and of the addition, each relative to a partial sum bounded by |A||B|."""
    k = a.shape[1]
    da = a.double().abs() * sa.double().repeat_interleave(128, 1)[:, :k]
    db = b.double().abs() * sb.double().repeat_interleave(rows_per_scale, 0)[:b.shape[0]].repeat_interleave(128, 1)[
        :, :k]
    return (-(-k // 128) * 3 + 2) * 2.0**-24 * (da @ db.t())


@pytest.mark.parametrize("rule", ["fp32", "pow2"])
def test_fp8_gemm_equals_its_reference_bitwise(interp, rule):
    """fprop, 1x128 x 128x128, M=64 N=320 K=300 (partial blocks in N and K): the kernel equals the
    reference arithmetic (jetflow.kernels.triton.reference.fp8_gemm) bit for bit in fp32 and bf16
    out (the interpreter's dot sums exactly: see triton_interpret_cases.py), and the exact product
    within the stated rounding bound."""
    r = interp("fp8_gemm")
    a, sa, b, sb = r[f"{rule}_a"], r[f"{rule}_sa"], r[f"{rule}_b"], r[f"{rule}_sb"]
    ref = reference.fp8_gemm(a, sa, b, sb, 128)
    assert torch.equal(r[f"{rule}_fp32"], ref)
    assert torch.equal(r[f"{rule}_bf16"].view(torch.int16), ref.bfloat16().view(torch.int16))
    err = (r[f"{rule}_fp32"].double() - _dequantized_product(a, sa, b, sb, 128)).abs()
    assert bool((err <= _fp8_bound(a, sa, b, sb, 128)).all())


def test_fp8_gemm_row_does_not_depend_on_m_or_its_tile_position(interp):
    r = interp("fp8_gemm")
    assert torch.equal(r["row0_alone"][0], r["fp32_fp32"][0])  # M = 1 vs M = 64
    assert torch.equal(r["row0_at_37"], r["fp32_fp32"][0])  # the same row at tile row 37 of 43


def test_fp8_gemm_dgrad_and_wgrad_layouts(interp):
    """dgrad dY @ W (b = the transposed view of W's bytes and 128x128 blocks) and wgrad dY^T @ X (both
    operands 1x128 along 200 tokens: a partial last block): bitwise equal to the reference."""
    r = interp("fp8_gemm_backward_layouts")
    w, sw = r["w"], r["sw"]
    assert torch.equal(r["dgrad"], reference.fp8_gemm(r["g"], r["sg"], w.t(), sw.t(), 128))
    ref = reference.fp8_gemm(r["gcol"].t(), r["sgcol"].t(), r["xcol"].t(), r["sxcol"].t(), 1)
    assert torch.equal(r["wgrad"], ref)
    operands = (r["gcol"].t(), r["sgcol"].t(), r["xcol"].t(), r["sxcol"].t(), 1)
    err = (r["wgrad"].double() - _dequantized_product(*operands)).abs()
    assert bool((err <= _fp8_bound(*operands)).all())


def test_gemms_compute_the_canonical_tree_and_tp_shards_combine_exactly(interp):
    """K = 512: four groups of one block combined by the pairwise tree (the reference computes the same
    tree; one group differs from it), and two half-K shards with two groups each, combined by
    tree_sum, equal the unsharded result bit for bit (FP8 and dense bf16)."""
    r = interp("gemm_tensor_parallel_shards")
    assert torch.equal(r["fp8_full"], reference.fp8_gemm(r["a"], r["sa"], r["b"], r["sb"], 128))
    assert torch.equal(r["fp8_one_group"], reference.fp8_gemm(r["a"], r["sa"], r["b"], r["sb"], 128, groups=1))
    assert not torch.equal(r["fp8_one_group"], r["fp8_full"])
    assert torch.equal(r["fp8_tp2"], r["fp8_full"])
    assert torch.equal(r["dense_tp2"], r["dense_full"])


@pytest.mark.parametrize("dot", ["fp32", "bf16"])
def test_dense_gemm_within_bound_and_row_invariant(interp, dot):
    """|kernel - exact| <= (K / BLOCK_K + 1) * 2^-24 * (|A| @ |B|^T) (each BLOCK_K partial rounded once,
    then added), with A, B rounded to bf16 first for the bf16 dot; rows independent of M and of
    their tile position; bf16 output = the fp32 result rounded to nearest even."""
    r = interp("dense_gemm")
    a, b = r["a"].double(), r["b"].double()
    if dot == "bf16":
        a, b = r["a"].bfloat16().double(), r["b"].bfloat16().double()
    blocks = -(-a.shape[1] // (32 if dot == "fp32" else 64)) + -(-a.shape[1] // 128)  # dot steps + block adds
    bound = (blocks + 1) * 2.0**-24 * (a.abs() @ b.abs().t())
    assert bool(((r[dot].double() - a @ b.t()).abs() <= bound).all())
    assert torch.equal(r[f"{dot}_row0_alone"][0], r[dot][0])
    assert torch.equal(r[f"{dot}_row0_at_37"], r[dot][0])
    if dot == "bf16":
        assert torch.equal(r["bf16_out"].view(torch.int16), r["bf16"].bfloat16().view(torch.int16))


ATTENTION_BOUND = {"fp32": 2.0**-18, "bf16": 2.0**-7}
"""|kernel - exact attention| <= bound * max|v|. fp32: a few dozen fp32 roundings of values <= max|v|
(2^-18 leaves room for exp2's 2 ulp and 70 slots). bf16: each weight pr is rounded to bf16 for the
pr . v dot (relative 2^-9, so at most 2^-9 max|v| in all) and the output to bf16 (2^-9 |o|)."""


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_attention_matches_reference_within_bound(interp, dtype):
    """Prefill, B=2, 4 query heads on 2 KV heads, 70 positions (two KV blocks), D=32, against
    reference_attention in float64; K in the exact cache's transposed layout gives the same bits."""
    r = interp("attention")
    q, k, v = r[f"{dtype}_q"], r[f"{dtype}_k"], r[f"{dtype}_v"]
    B, _, T, D = q.shape
    pos = torch.arange(T).expand(B, T)
    ref = reference_attention(q.double(), k.double(), v.double(), pos, D**-0.5)
    err = (r[f"{dtype}_prefill"].double() - ref).abs().max().item()
    assert err <= ATTENTION_BOUND[dtype] * v.double().abs().max().item(), err
    assert torch.equal(r[f"{dtype}_kt"], r[f"{dtype}_prefill"])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_attention_decode_rows_equal_prefill_rows(interp, dtype):
    """A token decoded alone (T = 1: its 2 query heads in one tile, the cache holding its prefix) is
    the same bits as that token inside the 70-token prefill, at slots 0, 1, 63, 64 and 69."""
    r = interp("attention")
    for t in (0, 1, 63, 64, 69):
        assert torch.equal(r[f"{dtype}_decode_{t}"][:, :, 0], r[f"{dtype}_prefill"][:, :, t]), t


def test_attention_rows_at_different_positions_in_one_call(interp):
    """One decode call with rows at positions 5, 70 and 89 (three sequences of different lengths)."""
    r = interp("attention")
    ref = reference_attention(r["mixed_q"].double(), r["mixed_k"].double(), r["mixed_v"].double(), r["mixed_pos"],
                              32**-0.5)
    err = (r["mixed"].double() - ref).abs().max().item()
    assert err <= ATTENTION_BOUND["fp32"] * r["mixed_v"].abs().max().item()


def test_attention_paged_equals_contiguous_and_fp8_kv(interp):
    """Paged KV (16-slot pages in shuffled order, 64-slot KV blocks) gives the contiguous result bit
    for bit; FP8 (E4M3) K/V with per-tensor scales match float64 attention on their dequantized values
    within the bf16 / fp32 bound, and their decode rows equal their prefill rows."""
    r = interp("attention_paged_fp8")
    assert torch.equal(r["paged"], r["contiguous"])
    q, k8, v8, ks, vs = r["q"], r["k8"], r["v8"], r["ks"], r["vs"]
    B, _, T, D = q.shape
    pos = torch.arange(T).expand(B, T)
    kd, vd = k8.double() * ks.double(), v8.double() * vs.double()
    for name in ("bf16", "fp32"):
        ref = reference_attention(q.double(), kd, vd, pos, D**-0.5)
        err = (r[f"fp8_{name}"].double() - ref).abs().max().item()
        assert err <= ATTENTION_BOUND[name] * vd.abs().max().item(), (name, err)
        assert torch.equal(r[f"fp8_{name}_decode_69"][:, :, 0], r[f"fp8_{name}"][:, :, 69])


def test_attention_reads_the_exact_pools_pages(interp):
    """What jetflow.model.paged_attention runs on CUDA for fp32 / bf16 pages: attn.attention on the pool's
    K^T pages (a transposed view) through a block table gives the bits of the same slots contiguous; E4M3
    pages give the bits of their values (code * scale in fp32, the K/V fake-quantizer's) stored densely."""
    r = interp("attention_pool_pages")
    for name in ("fp32", "bf16", "fp8_fp32", "fp8_bf16"):
        assert torch.equal(r[name], r[f"{name}_contiguous"]), name


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8"])
def test_paged_exact_attention_equals_the_cpp_paged_kernel(interp, fmt):
    """The Triton paged kernel with the C++ arithmetic (paged_exact) gives jf_attention_paged's bits
    (jetflow.kernels.paged.paged_attention) on fp32, bf16 and E4M3 pages read through a shuffled block
    table, for a 6-query chunk across a page boundary; with E4M3 pages also a decode step of two rows at
    different positions, whose first row equals the same query in the chunk."""
    from jetflow.kernels import paged

    r = interp("paged_exact")
    c = r[fmt]
    table, q, pos = r["table"], r["q"], r["pos"]
    ref = paged.paged_attention(q[:1], c["k"], c["v"], table[:1], pos[:1], 8**-0.5, c["ks"], c["vs"])
    assert torch.equal(c["chunk"], ref)
    if fmt == "fp8":
        ref = paged.paged_attention(c["decode_q"], c["k"], c["v"], table, torch.tensor([[67], [20]]), 8**-0.5,
                                    c["ks"], c["vs"])
        assert torch.equal(c["decode"], ref)
        assert torch.equal(c["decode"][0, :, 0], c["chunk"][0, :, 5])


def test_interpreter_fma_patch_rounds_once(interp):
    """The harness's fma (triton_interpret_cases.fma_f32) against exact rational arithmetic, rounded to
    nearest even by hand, on values whose products and sums need more than fp32's bits."""
    from fractions import Fraction

    import numpy as np

    x, y, z, got = (t.numpy() for t in interp("paged_exact")["fma"])
    for a, b, c, g in zip(x, y, z, got):
        exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
        near = np.float32(float(exact))  # within an ulp; the correct rounding is it or a neighbour
        cands = [near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))]
        best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.array(v).view(np.int32)) & 1))
        assert best == g, (a, b, c)


def test_rms_norm_within_bound_and_row_invariant(interp):
    """The module's formula (jetflow.model.layers.RMSNorm) within 2^-20 relative (a sum of 576 squares,
    one division, rsqrt, two products); a row alone equals the row among 40; bf16 input rounds the
    normalized row to bf16 before the weight, as the module does."""
    from jetflow.model.layers import RMSNorm

    r = interp("rms_norm")
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(r["w"])
        ref, ref_bf16 = norm(r["x"].double().float()), norm(r["x"].bfloat16())
    assert ((r["y"] - ref).abs() <= 2.0**-20 * ref.abs().max()).all()
    assert torch.equal(r["row_alone"][0], r["y"][17])
    assert ((r["y_bf16_in"] - ref_bf16).abs() <= 2.0**-8 * ref_bf16.abs() + 1e-6).all()


def _restore(cls, state):
    """A quantized operand (jetflow.precision.mx.MXTensor / nvfp4.NVFP4Tensor) from its pickled state."""
    q = cls.__new__(cls)
    q.__setstate__(state)
    return q


@pytest.mark.parametrize("k", [320, 512])
def test_microscaled_gemms_equal_their_reference_bitwise(interp, k):
    """The mxfp8 / nvfp4 GEMMs (in-kernel dequantization to exact bf16 values, tensor-core dot, the
    canonical groups and tree, NVFP4's alpha) equal jetflow.kernels.triton.microscaled_reference on the
    operands' exact values bit for bit (fp32 and bf16 out), at K = 320 (a partial K block, 40 weight rows:
    a partial tile of 16x16 NVFP4 weight tiles) and K = 512 (4 groups; 1 group too); a row computed
    alone equals the row among 20; and the product is within fp32 summation of the fp64 one."""
    from jetflow.kernels.triton.microscaled_reference import microscaled_gemm as ref
    from jetflow.precision.mx import MXTensor
    from jetflow.precision.nvfp4 import NVFP4Tensor

    r = interp("microscaled_gemm")
    mx = r[f"mx_{k}"]
    a, b = _restore(MXTensor, mx["a"]), _restore(MXTensor, mx["b"])
    expected = ref(a.dequantize(), b.dequantize())
    assert torch.equal(mx["fp32"], expected) and torch.equal(mx["row3"][0], mx["fp32"][3])
    assert torch.equal(mx["bf16"].view(torch.int16), expected.bfloat16().view(torch.int16))
    nv = r[f"nv_{k}"]
    a, b = _restore(NVFP4Tensor, nv["a"]), _restore(NVFP4Tensor, nv["b"])
    expected = ref(a.block_values(), b.block_values(), da=a.tensor_scale, db=b.tensor_scale)
    assert torch.equal(nv["fp32"], expected) and torch.equal(nv["row3"][0], nv["fp32"][3])
    exact = (a.block_values().double() @ b.block_values().double().t()) * (a.tensor_scale * b.tensor_scale).double()[:, None]
    bound = (k + 2) * 2.0**-24 * (a.block_values().double().abs() @ b.block_values().double().abs().t()) * \
        (a.tensor_scale * b.tensor_scale).double()[:, None]
    assert bool(((nv["fp32"].double() - exact).abs() <= bound).all())
    if k == 512:
        assert torch.equal(nv["one_group"], ref(a.block_values(), b.block_values(), 1, a.tensor_scale, b.tensor_scale))


# -- sm_90 compile check ------------------------------------------------------------------------
# Compiles of 15-55 s each on a 2-core CPU (ptxas), kept for `-m long`: each repeats a kernel that a default
# compile already covers with the same PTX expectations, at a larger K unroll (8 groups instead of 1) or with
# fp32 instead of bf16 operands. The interpreter tests above check every variant's arithmetic.
LONG_COMPILES = {
    "fp8_gemm_fprop_bf16_out", "fp8_gemm_fprop_fp32_out", "fp8_gemm_wgrad_1x128_groups",
    "dense_fp32_dot_fp32_in_fp32_out_8_groups", "dense_bf16_dot_fp32_in_fp32_out_8_groups",
    "attention_q_fp32_kv_fp32_contiguous", "attention_q_fp32_kv_fp8e4nv_paged",
    "mxfp8_gemm_dequantized_fp32_out_8_groups", "nvfp4_gemm_dequantized_fp32_out_8_groups",
    "mxfp8_gemm_dot_scaled_fp32_out_8_groups",
}


def _params(specs):
    return [pytest.param(s, id=s.name, marks=[pytest.mark.long] if s.name in LONG_COMPILES else []) for s in specs]


def _specs():
    from jetflow.kernels.triton.compile_check import SPECS
    return _params(SPECS)


def test_every_long_compile_names_a_spec():
    from jetflow.kernels.triton.compile_check import SM100_SPECS, SPECS
    assert LONG_COMPILES <= {s.name for s in [*SPECS, *SM100_SPECS]}


@pytest.mark.parametrize("spec", _specs())
def test_kernel_compiles_for_sm90(spec):
    from jetflow.kernels.triton.compile_check import compile_sm90

    compiled = compile_sm90(spec)
    ptx = compiled.asm["ptx"]
    assert len(compiled.asm["cubin"]) > 0 and ".target sm_90" in ptx
    for needle in spec.expect:
        assert needle in ptx, f"{spec.name}: no {needle} in the sm_90 PTX"
    assert "div.full.f32" not in ptx  # every division IEEE (Triton's `/` would be div.full)


def _sm100_specs():
    from jetflow.kernels.triton.compile_check import SM100_SPECS
    return _params(SM100_SPECS)


@pytest.mark.parametrize("spec", _sm100_specs())
def test_block_scaled_kernel_compiles_for_sm100(spec):
    """The mxfp8 / nvfp4 GEMM's native variant (tl.dot_scaled on the codes and scales) compiles for
    Blackwell to its block-scaled MMA (tcgen05 kind::mxf8f6f4 / kind::mxf4nvf4), not to a trap."""
    from jetflow.kernels.triton.compile_check import BLACKWELL, compile_sm90

    compiled = compile_sm90(spec, BLACKWELL)
    ptx = compiled.asm["ptx"]
    assert len(compiled.asm["cubin"]) > 0 and ".target sm_100" in ptx and "trap;" not in ptx
    for needle in spec.expect:
        assert needle in ptx, f"{spec.name}: no {needle} in the sm_100 PTX"
