// The canonical GEMM of jetflow's exact numerics (precision.numerics=exact): one fixed sequence of
// IEEE operations per output element, whatever the number of rows, the batch, the thread, the SIMD
// width or the tensor-parallel sharding of K.
//
// C[m, n] = sum_k A[m, k] W[n, k], computed as
//   1. K is cut into 128-wide blocks b (the last one may be shorter); each block's partial P_b is its
//      own chain from +0:
//        fp32 / bf16 weights  an FMA chain over k in order (bf16 values are exact in fp32; with bf16
//                             activations too, on AVX512_BF16's vdpbf16ps where the CPU has it);
//        E4M3 (FP8)           an FMA chain over the raw E4M3 values (products are exact in fp32) in
//                             pairs, odd element first: k = 1, 0, 3, 2, ... (the order of vdpbf16ps,
//                             which this kernel uses where the CPU has it), then scaled:
//                             P_b = P_b * (sa[m, b] * sw[n / 128, b]) (two roundings, no FMA).
//   2. the blocks form `groups` contiguous groups of equal size; a group's sum S_g = ((0 + P_first) +
//      P_next) + ... in block order;
//   3. the groups' sums are combined by a fixed pairwise tree: ((S_0 + S_1) + (S_2 + S_3)) + ...
// A tensor-parallel shard holding a contiguous 1/T of K (T dividing `groups`) computes the subtree of
// its groups with groups / T; the T results combined by the same tree give the full result bit for
// bit (jetflow.kernels.canonical.tree_sum). The Triton kernels compute the same structure on CUDA.
//
// Weights are packed per panel of NR columns: (P, K, NR) in their own format (fp32, bf16 bits, or
// E4M3 bytes), and converted in registers / a per-thread buffer: the low-precision bytes are what
// streams from memory. Where vdpbf16ps runs, E4M3 and bf16 weights are packed instead as bf16 pairs,
// (P, ceil(K/2), NR) dwords (pack.cpp's `jf_pack_pairs`, once per weight version; bf16 pairs swapped so that the
// instruction, which adds a pair's high product first, runs the chain in order): its operand layout,
// so a decode step converts nothing (converting an E4M3 panel per call cost ~30% of a 16-row
// GEMM).
//
// vdpbf16ps treats denormal inputs as 0 and flushes denormal results (DAZ, FTZ). With E4M3 operands
// nothing is ever denormal (products are multiples of 2^-18). With bf16 operands whose nonzero
// magnitudes are all >= 2^-56, every product and every partial sum is 0 or a multiple of 2^-126, never
// denormal, so the instruction computes the FMA chain's bits; operands outside that range (or
// activations off the bf16 grid) take the FMA path, here as in every other build.
#include "convert.h"

static const int64_t KB = 128;  // K block: one partial chain each (= the FP8 recipe's scale group)
static const int MAX_LEVELS = 4;  // tree of at most 8 groups: 4 levels of partial sums
static const int64_t PACK_SERIAL = 1 << 14;  // A's row blocks (MB x K) up to this size are packed by one thread: a
                                             // decode step's few rows are less work than a parallel region

enum { MODE_F32 = 0, MODE_PAIRS = 1, MODE_DP = 2, MODE_BF16 = 3 };

// ---------------------------------------------------------------------------------------------
// Block partials: acc[r][0..1] = the chain over one K block of row r against the panel's NR columns.
// Ap: packed A rows interleaved, (kc, GEMM_MR) floats (or (kc/2, GEMM_MR) bf16 pairs for DP).

static inline vf v_load_w(const float* p) { return v_load(p); }
static inline vf v_load_w(const uint16_t* p) { return v_load_bf16(p); }

template <int R, typename T>  // k's step of every row's chain against the panel's NR columns (fp32 or bf16)
static inline void chain_step(const float* Ap, const T* B, int64_t k, vf (*acc)[2]) {
  vf b0 = v_load_w(B + k * NR), b1 = v_load_w(B + k * NR + VL);
#pragma GCC unroll 16
  for (int r = 0; r < R; r++) {
    vf a = v_set1(Ap[k * GEMM_MR + r]);
    acc[r][0] = v_fma(a, b0, acc[r][0]);
    acc[r][1] = v_fma(a, b1, acc[r][1]);
  }
}

// Prefetch of the next weight panel into L2 while this one computes: one or two cache lines per k step
// (pf: where this k block's share starts, step: bytes per k step; nullptr: nothing to fetch).
static inline void prefetch_next(const char* pf, int64_t step, int64_t k) {
  if (pf == nullptr) return;
  __builtin_prefetch(pf + k * step, 0, 2);
  if (step > 64) __builtin_prefetch(pf + k * step + 64, 0, 2);
}

template <int R>  // E4M3 values in an fp32 panel: pairs, odd element first (vdpbf16ps's order)
static inline void block_pairs(const float* Ap, const float* B, int64_t kc, vf (*acc)[2]) {
  int64_t k = 0;
  for (; k + 1 < kc; k += 2) {
    __builtin_prefetch(B + (k + 24) * NR);
    chain_step<R>(Ap, B, k + 1, acc);
    chain_step<R>(Ap, B, k, acc);
  }
  if (k < kc) chain_step<R>(Ap, B, k, acc);
}

template <int R, typename T>  // fp32 values, or bf16 bits converted in registers: the chain in order
static inline void block_in_order(const float* Ap, const T* B, int64_t kc, vf (*acc)[2], const char* pf,
                                  int64_t step) {
  for (int64_t k = 0; k < kc; k++) {
    prefetch_next(pf, step, k);
    __builtin_prefetch(B + (k + 12) * NR);  // decode streams the weights from memory: fetch ahead
    __builtin_prefetch(B + (k + 12) * NR + 16);
    chain_step<R>(Ap, B, k, acc);
  }
}

#ifdef JF_DPBF16
// bf16 pairs on AVX512_BF16 (each dword: a low and a high bf16; the instruction adds the high product
// first): E4M3 pairs hold k = 2i low, 2i + 1 high (block_pairs' order); bf16 pairs are packed swapped,
// k = 2i high, so the chain runs in order (block_in_order's bits)
template <int R>
static inline void block_dp(const uint32_t* Ap, const uint32_t* B, int64_t kp, vf (*acc)[2], const char* pf,
                            int64_t step) {
  for (int64_t i = 0; i < kp; i++) {
    prefetch_next(pf, step, i);
    __m512bh b0 = (__m512bh)_mm512_loadu_si512(B + i * NR), b1 = (__m512bh)_mm512_loadu_si512(B + i * NR + 16);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      __m512bh a = (__m512bh)_mm512_set1_epi32((int)Ap[i * GEMM_MR + r]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// One tile: rows [m0, m0 + R) x the panel's NR columns, over the whole K range, through the groups
// and the tree.

struct Gemm {
  int mode;
  const void* Ap;  // packed A, (MB, K, GEMM_MR) floats or (MB, K2, GEMM_MR) dwords (DP)
  int64_t M, K, K2, N, nb, groups;
  int64_t rows;  // rows per row block (<= GEMM_MR; `row_block_rows`)
  const float* sa;  // FP8: (M, nb) scales of A's rows, row stride sa_ld
  int64_t sa_ld;
  const float* sw;  // FP8: (ceil(N / 128), nb) weight block scales, row stride sw_ld; or, with
  int64_t sw_ld;    // sw_rows == 1, (nb, P * NR) one scale per weight row (1x128 groups), transposed
  int sw_rows;
  float* C;
  int64_t ldc;
};

template <int R>
static void tile(const Gemm& g, int mode, int64_t rb, const void* Bp, int64_t p, const char* pf, int64_t step) {
  const int64_t m0 = rb * g.rows;
  const int ncols = (int)std::min<int64_t>(NR, g.N - p * NR);
  const int64_t bpg = g.nb / g.groups;  // blocks per group
  alignas(64) float level[MAX_LEVELS][R * NR];  // the tree's pending partial sums
  alignas(64) float sum[R * NR];                // the current group's sum
  int top = 0;
  for (int64_t grp = 0; grp < g.groups; grp++) {
    for (int64_t j = 0; j < bpg; j++) {
      const int64_t b = grp * bpg + j, k0 = b * KB, kc = std::min(KB, g.K - k0);
      vf acc[R][2];
      for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = v_zero();
      if (mode == MODE_F32) {
        block_in_order<R>((const float*)g.Ap + (rb * g.K + k0) * GEMM_MR, (const float*)Bp + k0 * NR, kc, acc,
                            pf ? pf + k0 * step : nullptr, step);
      } else if (mode == MODE_BF16) {
        block_in_order<R>((const float*)g.Ap + (rb * g.K + k0) * GEMM_MR, (const uint16_t*)Bp + k0 * NR, kc, acc,
                            pf ? pf + k0 * step : nullptr, step);
      } else if (mode == MODE_PAIRS) {
        block_pairs<R>((const float*)g.Ap + (rb * g.K + k0) * GEMM_MR, (const float*)Bp + k0 * NR, kc, acc);
      } else {
#ifdef JF_DPBF16
        block_dp<R>((const uint32_t*)g.Ap + (rb * g.K2 + k0 / 2) * GEMM_MR, (const uint32_t*)Bp + (k0 / 2) * NR,
                    (kc + 1) / 2, acc, pf ? pf + (k0 / 2) * step : nullptr, step);
#endif
      }
      for (int r = 0; r < R; r++) {
        vf a0 = acc[r][0], a1 = acc[r][1];
        if (g.sa != nullptr && g.sw_rows != 1) {  // FP8: the block's scale, (sa * sw) first
          const float s = m0 + r < g.M ? g.sa[(m0 + r) * g.sa_ld + b] * g.sw[(p * NR / KB) * g.sw_ld + b] : 0.0f;
          a0 = v_mul(a0, v_set1(s));
          a1 = v_mul(a1, v_set1(s));
        } else if (g.sa != nullptr) {  // FP8, a scale per weight row (column of C)
          const vf sa = v_set1(m0 + r < g.M ? g.sa[(m0 + r) * g.sa_ld + b] : 0.0f);
          a0 = v_mul(a0, v_mul(sa, v_load(g.sw + b * g.sw_ld + p * NR)));
          a1 = v_mul(a1, v_mul(sa, v_load(g.sw + b * g.sw_ld + p * NR + VL)));
        }
        float* s = sum + r * NR;
        vf s0 = j == 0 ? v_zero() : v_load(s), s1 = j == 0 ? v_zero() : v_load(s + VL);
        v_store(s, v_add(s0, a0));
        v_store(s + VL, v_add(s1, a1));
      }
    }
    // push the group's sum: merge with pending subtrees while this group closes a pair
    int64_t idx = grp;
    int lvl = 0;
    while (idx & 1) {
      for (int e = 0; e < R * NR; e += VL) v_store(sum + e, v_add(v_load(level[lvl] + e), v_load(sum + e)));
      idx >>= 1;
      lvl++;
    }
    std::memcpy(level[lvl], sum, sizeof(sum));
    top = lvl;
  }
  const float* out = level[top];
  for (int r = 0; r < R && m0 + r < g.M; r++)
    for (int c = 0; c < ncols; c++) g.C[(m0 + r) * g.ldc + p * NR + c] = out[r * NR + c];
}

static void tile_rows(int R, const Gemm& g, int mode, int64_t rb, const void* Bp, int64_t p, const char* pf,
                      int64_t step) {
  switch (R) {
#define JF_CASE(n)                                              \
  case n:                                                       \
    if (n <= GEMM_MR) tile<(n <= GEMM_MR ? n : 1)>(g, mode, rb, Bp, p, pf, step); \
    break;
    JF_CASE(1) JF_CASE(2) JF_CASE(3) JF_CASE(4) JF_CASE(5) JF_CASE(6) JF_CASE(7)
    JF_CASE(8) JF_CASE(9) JF_CASE(10) JF_CASE(11) JF_CASE(12) JF_CASE(13) JF_CASE(14)
#undef JF_CASE
    default: break;
  }
}

// A per-thread buffer for a converted weight panel (grown as needed, kept for the next call).
static float* panel_buffer(int64_t floats) {
  static thread_local float* buf = nullptr;
  static thread_local int64_t cap = 0;
  if (floats > cap) {
    std::free(buf);
    cap = floats;
    buf = jf_alloc_f32(cap);
  }
  return buf;
}

// Runs every (row block, panel) tile: row chunks whose packed A stays in L2 while panels stream past;
// with few chunks (decode), (chunk, panel) pairs are the parallel tasks. One thread computes a whole
// output element.
static void run(const Gemm& g, const void* W, int wfmt) {
  const int64_t P = (g.N + NR - 1) / NR, MB = (g.M + g.rows - 1) / g.rows;
  const int64_t chunk = std::max<int64_t>(1, (512 * 1024) / (g.K * GEMM_MR * (int64_t)sizeof(float)));
  const int64_t nchunks = (MB + chunk - 1) / chunk;
  auto work = [&](int64_t i, int64_t p0, int64_t p1) {
    const int64_t b0 = i * chunk, b1 = std::min(MB, b0 + chunk);
    for (int64_t p = p0; p < p1; p++) {
      const void* Bp;
      int mode = g.mode;
      if (wfmt == WF_F32) {
        Bp = (const float*)W + p * g.K * NR;
      } else if (wfmt == WF_PAIRS && mode == MODE_DP) {  // the instruction's layout: nothing to convert
        Bp = (const uint32_t*)W + p * g.K2 * NR;
      } else if (wfmt == WF_PAIRS) {  // an operand out of vdpbf16ps's exact range: the FMA chain
#ifdef JF_DPBF16
        float* buf = panel_buffer(g.K * NR);
        pairs_panel_to_f32((const uint32_t*)W + p * g.K2 * NR, g.K, buf);
        Bp = buf;
#else
        Bp = nullptr;
#endif
      } else if (wfmt == WF_BF16 && b1 - b0 <= 2) {  // few row blocks: convert in registers
        Bp = (const uint16_t*)W + p * g.K * NR;
        mode = MODE_BF16;
      } else if (wfmt == WF_BF16) {
        float* buf = panel_buffer(g.K * NR);
        bf16_to_f32_n((const uint16_t*)W + p * g.K * NR, buf, g.K * NR);
        Bp = buf;
      } else if (mode == MODE_PAIRS) {
        float* buf = panel_buffer(g.K * NR);
        e4m3_to_f32((const uint8_t*)W + p * g.K * NR, buf, g.K * NR);
        Bp = buf;
      } else {
#ifdef JF_DPBF16
        uint32_t* buf = (uint32_t*)panel_buffer(g.K2 * NR);
        e4m3_panel_to_pairs((const uint8_t*)W + p * g.K * NR, g.K, buf);
        Bp = buf;
#else
        Bp = nullptr;
#endif
      }
      // While this panel computes, the next one streams into L2: its bytes split over this panel's passes
      // (one per row block), a cache line or two per k step. A decode GEMM read each panel from memory
      // in its first pass only and waited on it (measured: 30 layers' 4 GEMMs at 16 rows, FP8 322-377 ->
      // 259-296 us a layer, fp32 555-621 -> 425-485). Only where the kernel reads the weight's own bytes: a converted
      // buffer is already in cache.
      const bool direct = wfmt == WF_F32 || (wfmt == WF_PAIRS && mode == MODE_DP) || mode == MODE_BF16;
      const int64_t steps = mode == MODE_DP ? g.K2 : g.K, row_bytes = NR * (mode == MODE_BF16 ? 2 : 4);
      const int64_t step = (((row_bytes + (b1 - b0) - 1) / (b1 - b0) + 63) / 64) * 64;  // bytes per k step
      const char* next = direct && p + 1 < P ? (const char*)Bp + steps * row_bytes : nullptr;
      for (int64_t b = b0; b < b1; b++) {
        const int64_t share = (b - b0) * steps * step;  // this pass's part of the next panel
        tile_rows((int)std::min<int64_t>(g.rows, g.M - b * g.rows), g, mode, b, Bp, p,
                  next != nullptr && share < steps * row_bytes ? next + share : nullptr, step);
      }
    }
  };
  if (nchunks >= 4 * (int64_t)omp_get_max_threads()) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < nchunks; i++) work(i, 0, P);
  } else {  // contiguous panel ranges per thread: each streams one region of the weight in order
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < nchunks * P; t++) work(t / P, t % P, t % P + 1);
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points (jetflow/kernels/invariant/: gemm_ops.py; jf_panel_width packing.py, jf_isa _lib.py,
// jf_e4m3_to_f32 quantizers.py)

extern "C" int jf_panel_width(void) { return NR; }

extern "C" const char* jf_isa(void) {
#if defined(JF_DPBF16)
  return "avx512_bf16";
#elif !defined(JF_NO_SIMD) && defined(__AVX512F__)
  return "avx512";
#elif !defined(JF_NO_SIMD) && defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

extern "C" void jf_e4m3_to_f32(const uint8_t* src, int64_t n, float* dst) { e4m3_to_f32(src, dst, n); }

// Rows per row block: M split into ceil(M / GEMM_MR) blocks of equal size (16 decode rows: 2 x 8, not
// 14 + 2), so no block runs a few rows against a whole weight panel. A row's arithmetic does not depend
// on its block.
static int64_t row_block_rows(int64_t M) {
  const int64_t blocks = (M + GEMM_MR - 1) / GEMM_MR;
  return (M + blocks - 1) / blocks;
}

static bool trivial(int64_t M, int64_t K, int64_t N, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return true;
  if (K == 0) {
    for (int64_t m = 0; m < M; m++) std::fill(C + m * ldc, C + m * ldc + N, 0.0f);
    return true;
  }
  return false;
}

// Packs rows [0, M) of A into row blocks of (K, GEMM_MR) floats (rows past a block are zeros).
static float* pack_rows_f32(const float* A, int64_t M, int64_t K, int64_t lda, int64_t RB, int64_t MB) {
  float* Ap = jf_alloc_f32(MB * K * GEMM_MR);
#pragma omp parallel for schedule(static) if (MB * K > PACK_SERIAL)
  for (int64_t b = 0; b < MB; b++) {
    float* dst = Ap + b * K * GEMM_MR;
    for (int r = 0; r < GEMM_MR; r++) {
      const int64_t m = b * RB + r;
      for (int64_t k = 0; k < K; k++) dst[k * GEMM_MR + r] = r < RB && m < M ? A[m * lda + k] : 0.0f;
    }
  }
  return Ap;
}

// A (M, K) fp32 with row stride lda; W packed (ceil(N/NR), K, NR) fp32 (wfmt 0) or bf16 bits (wfmt 1),
// or (ceil(N/NR), ceil(K/2), NR) bf16 pairs (wfmt 3, `jf_pack_pairs`); with bf16 weights A's values are
// on the bf16 grid (the bf16 kind: both operands bf16). C (M, N) with row stride ldc; `groups` as above
// (1 = one group: a chain of block partials).
extern "C" void jf_gemm(const float* A, int64_t M, int64_t K, int64_t lda, const void* W, int wfmt, int64_t N,
                        float* C, int64_t ldc, int64_t groups) {
  if (trivial(M, K, N, C, ldc)) return;
  const int64_t RB = row_block_rows(M), MB = (M + RB - 1) / RB, nb = (K + KB - 1) / KB, K2 = (K + 1) / 2;
#ifdef JF_DPBF16
  bool dp = wfmt == WF_PAIRS;
  for (int64_t m = 0; dp && m < M; m++)
    for (int64_t k = 0; k < K; k++) {
      uint32_t bits;
      std::memcpy(&bits, A + m * lda + k, 4);
      if ((bits & 0xFFFF) || !dp_exact_bf16(bits)) {
        dp = false;
        break;
      }
    }
  if (dp) {  // (K2, GEMM_MR) bf16 pairs per row block, swapped as the weights': (k = 2i + 1) | (k = 2i) << 16
    uint32_t* Ap = (uint32_t*)jf_alloc_f32(MB * K2 * GEMM_MR);
#pragma omp parallel for schedule(static) if (MB * K > PACK_SERIAL)
    for (int64_t b = 0; b < MB; b++) {
      uint32_t* dst = Ap + b * K2 * GEMM_MR;
      for (int r = 0; r < GEMM_MR; r++) {
        const int64_t m = b * RB + r;
        const uint32_t* a = (const uint32_t*)(A + m * lda);
        for (int64_t i = 0; i < K2; i++)
          dst[i * GEMM_MR + r] = r < RB && m < M ? (a[2 * i] & 0xFFFF0000u) | (2 * i + 1 < K ? a[2 * i + 1] >> 16 : 0u) : 0u;
      }
    }
    Gemm g{MODE_DP, Ap, M, K, K2, N, nb, groups, RB, nullptr, 0, nullptr, 0, 128, C, ldc};
    run(g, W, wfmt);
    std::free(Ap);
    return;
  }
#endif
  float* Ap = pack_rows_f32(A, M, K, lda, RB, MB);
  Gemm g{MODE_F32, Ap, M, K, K2, N, nb, groups, RB, nullptr, 0, nullptr, 0, 128, C, ldc};
  run(g, W, wfmt);
  std::free(Ap);
}

// A (M, K) E4M3 codes with row stride lda and sa (M, ceil(K/128)) fp32 scales (row stride sa_ld);
// W packed (ceil(N/NR), K, NR) E4M3 codes (wfmt 2) or (ceil(N/NR), ceil(K/2), NR) bf16 pairs (wfmt 3,
// `jf_pack_pairs`) with sw (ceil(N/128), ceil(K/128)) (row stride sw_ld) for 128x128 blocks (sw_rows
// 128), or sw (ceil(K/128), >= P*NR) for 1x128 groups (sw_rows 1: the weight-gradient GEMM's operand),
// the scale of weight row n in column n.
extern "C" void jf_gemm_fp8(const uint8_t* A, int64_t M, int64_t K, int64_t lda, const float* sa, int64_t sa_ld,
                            const uint8_t* W, int wfmt, const float* sw, int64_t sw_ld, int sw_rows, int64_t N,
                            float* C, int64_t ldc, int64_t groups) {
  if (trivial(M, K, N, C, ldc)) return;
  const int64_t RB = row_block_rows(M), MB = (M + RB - 1) / RB, nb = (K + KB - 1) / KB, K2 = (K + 1) / 2;
#ifdef JF_DPBF16
  uint32_t* Ap = (uint32_t*)jf_alloc_f32(MB * K2 * GEMM_MR);
#pragma omp parallel for schedule(static) if (MB * K > PACK_SERIAL)
  for (int64_t b = 0; b < MB; b++) {  // (K2, GEMM_MR) bf16 pairs: (k = 2i) | (k = 2i + 1) << 16
    uint32_t* dst = Ap + b * K2 * GEMM_MR;
    for (int r = 0; r < GEMM_MR; r++) {
      const int64_t m = b * RB + r;
      for (int64_t i = 0; i < K2; i++) {
        uint32_t lo = 0, hi = 0;
        if (r < RB && m < M) {
          lo = E4M3_BF16[A[m * lda + 2 * i]];
          hi = 2 * i + 1 < K ? E4M3_BF16[A[m * lda + 2 * i + 1]] : 0;
        }
        dst[i * GEMM_MR + r] = lo | (hi << 16);
      }
    }
  }
  Gemm g{MODE_DP, Ap, M, K, K2, N, nb, groups, RB, sa, sa_ld, sw, sw_ld, sw_rows, C, ldc};
#else
  float* Ap = jf_alloc_f32(MB * K * GEMM_MR);
#pragma omp parallel for schedule(static) if (MB * K > PACK_SERIAL)
  for (int64_t b = 0; b < MB; b++) {
    float* dst = Ap + b * K * GEMM_MR;
    for (int r = 0; r < GEMM_MR; r++) {
      const int64_t m = b * RB + r;
      for (int64_t k = 0; k < K; k++) dst[k * GEMM_MR + r] = r < RB && m < M ? E4M3_F32[A[m * lda + k]] : 0.0f;
    }
  }
  Gemm g{MODE_PAIRS, Ap, M, K, K2, N, nb, groups, RB, sa, sa_ld, sw, sw_ld, sw_rows, C, ldc};
#endif
  run(g, W, wfmt);
  std::free(Ap);
}

extern "C" int64_t jf_quantize_1x128(const float* x, int64_t M, int64_t K, int64_t ldx, int64_t ldk, int pow2,
                                     float margin_scale, uint8_t* q, float* s);

// jf_gemm_fp8 of x (M, K) fp32 (row stride ldx) quantized first by jf_quantize_1x128 (1x128 E4M3 groups,
// scale rule pow2, margin): the fprop of an exact FP8 linear in one call, the codes and scales in a
// buffer of its own. Returns jf_quantize_1x128's count of groups holding NaN / Inf, and computes nothing
// when it is not 0 (the caller's quantizer then reports them).
extern "C" int64_t jf_linear_fp8(const float* x, int64_t M, int64_t K, int64_t ldx, int pow2, float margin_scale,
                                 const uint8_t* W, int wfmt, const float* sw, int64_t sw_ld, int sw_rows, int64_t N,
                                 float* C, int64_t ldc, int64_t groups) {
  const int64_t nb = (K + KB - 1) / KB;
  uint8_t* codes = (uint8_t*)std::malloc(std::max<int64_t>(1, M * K));
  float* scales = jf_alloc_f32(std::max<int64_t>(1, M * nb));
  const int64_t bad = jf_quantize_1x128(x, M, K, ldx, 1, pow2, margin_scale, codes, scales);
  if (bad == 0) jf_gemm_fp8(codes, M, K, K, scales, nb, W, wfmt, sw, sw_ld, sw_rows, N, C, ldc, groups);
  std::free(codes);
  std::free(scales);
  return bad;
}
