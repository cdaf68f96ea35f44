// Batch-invariant CPU kernels for jetflow's exact numerics mode (precision.numerics=exact).
//
// Every output element is computed by one fixed sequence of IEEE operations that depends only on the
// element's own inputs: never on M (the number of rows), the tile a row falls in, the batch, the
// thread that computes it, or the SIMD width. Concretely:
//   gemm       C[m, n] = fma chain over k = 0, 1, ..., K-1 starting from +0 (one accumulator per
//              element; K blocking continues the chain through C, which is exact).
//   attention  for a query at position p: s_j = (fma chain over d of q[d] * k_j[d]) * scale for keys
//              j = 0..p; m = max_j s_j; p_j = jf_exp(s_j - m); l = p_0 + p_1 + ... (in order);
//              o[d] = (fma chain over j of p_j * v_j[d]) / l.
// FMA is correctly rounded, so a vector lane, a scalar `std::fma` tail and another vector width all
// give the same bits; the vector code below only decides how many of those chains run at once.
// Built once per machine with -march=native (jetflow/kernels/cpu.py); compile with -DJF_NO_SIMD for
// the scalar reference that tests compare the vector build against.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <omp.h>

#if !defined(JF_NO_SIMD) && defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vf;
static const int VL = 16;
static inline vf v_zero() { return _mm512_setzero_ps(); }
static inline vf v_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void v_store(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf v_set1(float x) { return _mm512_set1_ps(x); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf v_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf v_pow2i(vf n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline vf v_select_lt(vf x, float t, vf if_lt) {  // x < t ? if_lt : x
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(t), _CMP_LT_OQ), x, if_lt);
}
static const int GEMM_MR = 14;
#elif !defined(JF_NO_SIMD) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vf;
static const int VL = 8;
static inline vf v_zero() { return _mm256_setzero_ps(); }
static inline vf v_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void v_store(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf v_set1(float x) { return _mm256_set1_ps(x); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf v_round(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf v_pow2i(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf v_select_lt(vf x, float t, vf if_lt) {
  return _mm256_blendv_ps(x, if_lt, _mm256_cmp_ps(x, _mm256_set1_ps(t), _CMP_LT_OQ));
}
static const int GEMM_MR = 6;
#else
typedef float vf;  // scalar reference: the same chains, one at a time
static const int VL = 1;
static inline vf v_zero() { return 0.0f; }
static inline vf v_load(const float* p) { return *p; }
static inline void v_store(float* p, vf v) { *p = v; }
static inline vf v_set1(float x) { return x; }
static inline vf v_fma(vf a, vf b, vf c) { return std::fma(a, b, c); }
static inline vf v_mul(vf a, vf b) { return a * b; }
static inline vf v_add(vf a, vf b) { return a + b; }
static inline vf v_sub(vf a, vf b) { return a - b; }
static inline vf v_round(vf a) { return std::nearbyint(a); }
static inline vf v_pow2i(vf n) {
  int32_t bits = ((int32_t)n + 127) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}
static inline vf v_select_lt(vf x, float t, vf if_lt) { return x < t ? if_lt : x; }
static const int GEMM_MR = 4;
#endif

static const int NR = 2 * VL;  // GEMM panel width (columns of the packed weight)
static const int KC = 256;     // GEMM K block: the chain continues through C between blocks

// ---------------------------------------------------------------------------------------------
// exp for x <= 0 (softmax weights): x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-7 polynomial
// (Cephes expf), times 2^n. The same operations in every lane and in the scalar reference.
static const float EXP_LOW = -87.0f;
static const float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
static const float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f, P3 = 4.1665795894e-2f,
                   P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;

static inline vf v_exp_nonpos(vf x) {
  x = v_select_lt(x, EXP_LOW, v_set1(EXP_LOW));  // clamp: exp(-87) ~ 1.6e-38, below that the weight is 0 anyway
  vf n = v_round(v_mul(x, v_set1(LOG2E)));
  vf r = v_fma(n, v_set1(-LN2_HI), x);
  r = v_fma(n, v_set1(-LN2_LO), r);
  vf p = v_set1(P0);
  p = v_fma(p, r, v_set1(P1));
  p = v_fma(p, r, v_set1(P2));
  p = v_fma(p, r, v_set1(P3));
  p = v_fma(p, r, v_set1(P4));
  p = v_fma(p, r, v_set1(P5));
  vf r2 = v_mul(r, r);
  p = v_fma(p, r2, r);
  p = v_add(p, v_set1(1.0f));
  return v_mul(p, v_pow2i(n));
}

static inline float s_exp_nonpos(float x) {  // the scalar twin, for tails: bit-identical to a lane
  x = x < EXP_LOW ? EXP_LOW : x;
  float n = std::nearbyint(x * LOG2E);
  float r = std::fma(n, -LN2_HI, x);
  r = std::fma(n, -LN2_LO, r);
  float p = P0;
  p = std::fma(p, r, P1);
  p = std::fma(p, r, P2);
  p = std::fma(p, r, P3);
  p = std::fma(p, r, P4);
  p = std::fma(p, r, P5);
  float r2 = r * r;
  p = std::fma(p, r2, r);
  p = p + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// ---------------------------------------------------------------------------------------------
// GEMM: C (M, N) = A (M, K) @ W^T, W packed as (P, K, NR): panel p holds columns p*NR .. p*NR+NR-1.

template <int R>
static inline void gemm_micro(const float* Ap, const float* B, int64_t kc, float* C, int64_t ldc, bool first,
                              int ncols) {
  // Ap: packed A block (kc, GEMM_MR) (rows interleaved); B: panel block (kc, NR)
  vf acc[R][2];
  alignas(64) float tmp[NR];
  for (int r = 0; r < R; r++) {
    if (first) {
      acc[r][0] = v_zero();
      acc[r][1] = v_zero();
    } else if (ncols == NR) {
      acc[r][0] = v_load(C + r * ldc);
      acc[r][1] = v_load(C + r * ldc + VL);
    } else {
      for (int j = 0; j < NR; j++) tmp[j] = j < ncols ? C[r * ldc + j] : 0.0f;
      acc[r][0] = v_load(tmp);
      acc[r][1] = v_load(tmp + VL);
    }
  }
  for (int64_t k = 0; k < kc; k++) {
    __builtin_prefetch(B + (k + 12) * NR);  // decode streams the weight from memory: fetch ahead
    __builtin_prefetch(B + (k + 12) * NR + 16);
    vf b0 = v_load(B + k * NR), b1 = v_load(B + k * NR + VL);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      vf a = v_set1(Ap[k * GEMM_MR + r]);
      acc[r][0] = v_fma(a, b0, acc[r][0]);
      acc[r][1] = v_fma(a, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; r++) {
    if (ncols == NR) {
      v_store(C + r * ldc, acc[r][0]);
      v_store(C + r * ldc + VL, acc[r][1]);
    } else {
      v_store(tmp, acc[r][0]);
      v_store(tmp + VL, acc[r][1]);
      for (int j = 0; j < ncols; j++) C[r * ldc + j] = tmp[j];
    }
  }
}

static void gemm_rows(int R, const float* Ap, const float* B, int64_t kc, float* C, int64_t ldc, bool first,
                      int ncols) {
  switch (R) {
#define JF_CASE(n) \
  case n:          \
    if (n <= GEMM_MR) gemm_micro<(n <= GEMM_MR ? n : 1)>(Ap, B, kc, C, ldc, first, ncols); break;
    JF_CASE(1) JF_CASE(2) JF_CASE(3) JF_CASE(4) JF_CASE(5) JF_CASE(6) JF_CASE(7)
    JF_CASE(8) JF_CASE(9) JF_CASE(10) JF_CASE(11) JF_CASE(12) JF_CASE(13) JF_CASE(14)
#undef JF_CASE
    default: break;
  }
}

extern "C" int jf_panel_width(void) { return NR; }

extern "C" const char* jf_isa(void) {
#if !defined(JF_NO_SIMD) && defined(__AVX512F__)
  return "avx512";
#elif !defined(JF_NO_SIMD) && defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

// A (M, K) with row stride lda; W packed (ceil(N/NR), K, NR); C (M, N) with row stride ldc.
extern "C" void jf_gemm(const float* A, int64_t M, int64_t K, int64_t lda, const float* W, int64_t N, float* C,
                        int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K == 0) {
    for (int64_t m = 0; m < M; m++) std::fill(C + m * ldc, C + m * ldc + N, 0.0f);
    return;
  }
  const int64_t P = (N + NR - 1) / NR, MB = (M + GEMM_MR - 1) / GEMM_MR;
  float* Ap = (float*)std::aligned_alloc(64, ((MB * K * GEMM_MR * sizeof(float) + 63) / 64) * 64);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < MB; b++) {  // A packed per micro block: (K, GEMM_MR), rows past M are zeros
    float* dst = Ap + b * K * GEMM_MR;
    for (int r = 0; r < GEMM_MR; r++) {
      int64_t m = b * GEMM_MR + r;
      if (m < M)
        for (int64_t k = 0; k < K; k++) dst[k * GEMM_MR + r] = A[m * lda + k];
      else
        for (int64_t k = 0; k < K; k++) dst[k * GEMM_MR + r] = 0.0f;
    }
  }
  // Row chunks whose packed A stays in L2 while the weight panels stream past; with few chunks
  // (decode), (chunk, panel) pairs are the parallel tasks instead. Either way one thread computes a
  // whole output element.
  const int64_t chunk = std::max<int64_t>(1, (512 * 1024) / (K * GEMM_MR * (int64_t)sizeof(float)));
  const int64_t nchunks = (MB + chunk - 1) / chunk;
  auto work = [&](int64_t i, int64_t p0, int64_t p1) {
    const int64_t b0 = i * chunk, b1 = std::min(MB, b0 + chunk);
    for (int64_t p = p0; p < p1; p++) {
      const int ncols = (int)std::min<int64_t>(NR, N - p * NR);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min<int64_t>(KC, K - k0);
        const float* Bp = W + (p * K + k0) * NR;
        for (int64_t b = b0; b < b1; b++) {
          const int R = (int)std::min<int64_t>(GEMM_MR, M - b * GEMM_MR);
          gemm_rows(R, Ap + (b * K + k0) * GEMM_MR, Bp, kc, C + b * GEMM_MR * ldc + p * NR, ldc, k0 == 0, ncols);
        }
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
  std::free(Ap);
}

// ---------------------------------------------------------------------------------------------
// Attention. q (B, H, T, D) contiguous; kt: K transposed, element (b, h, d, s) at
// kt[b*kt_sb + h*kt_sh + d*kt_sd + s]; v: element (b, h, s, d) at v[b*v_sb + h*v_sh + s*v_ss + d];
// pos (B, T) int64: the query's position = the last key slot it sees; out (B, H, T, D) contiguous.
// GQA: query head h reads K/V head h / (H / Hkv).

static const int AQ = 8;  // queries per tile (of one K/V head): they share each key's loads

extern "C" void jf_attention(const float* q, const float* kt, int64_t kt_sb, int64_t kt_sh, int64_t kt_sd,
                             const float* v, int64_t v_sb, int64_t v_sh, int64_t v_ss, const int64_t* pos, float* out,
                             int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t D, float scale) {
  const int64_t G = H / Hkv, nq = G * T, tiles = (nq + AQ - 1) / AQ;
  int64_t smax = 0;  // the longest key range any query needs
  for (int64_t i = 0; i < B * T; i++) smax = std::max<int64_t>(smax, pos[i] + 1);
  const int64_t spad = ((smax + NR - 1) / NR) * NR;
#pragma omp parallel
  {
    float* sbuf = (float*)std::aligned_alloc(64, AQ * spad * sizeof(float));  // scores, then weights
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t bh = 0; bh < B * Hkv; bh++) {
      for (int64_t tile = 0; tile < tiles; tile++) {
        const int64_t b = bh / Hkv, hk = bh % Hkv;
        const float* K = kt + b * kt_sb + hk * kt_sh;
        const float* V = v + b * v_sb + hk * v_sh;
        // the tile's queries: index i = t * G + g (position-major, so a tile spans few positions)
        const int64_t i0 = tile * AQ, nr = std::min<int64_t>(AQ, nq - i0);
        const float* qr[AQ];
        float* orow[AQ];
        int64_t n[AQ];
        int64_t nmax = 0;
        for (int r = 0; r < nr; r++) {
          const int64_t t = (i0 + r) / G, h = hk * G + (i0 + r) % G;
          qr[r] = q + ((b * H + h) * T + t) * D;
          orow[r] = out + ((b * H + h) * T + t) * D;
          n[r] = pos[b * T + t] + 1;
          nmax = std::max(nmax, n[r]);
        }
        // scores: s[r][j] = (fma chain over d of q[r][d] * k[j][d]) * scale, for j < nmax
        int64_t j0 = 0;
        for (; j0 + NR <= nmax; j0 += NR) {
          vf acc[AQ][2];
          for (int r = 0; r < AQ; r++) acc[r][0] = acc[r][1] = v_zero();
          for (int64_t d = 0; d < D; d++) {
            vf k0 = v_load(K + d * kt_sd + j0), k1 = v_load(K + d * kt_sd + j0 + VL);
            for (int r = 0; r < nr; r++) {
              vf a = v_set1(qr[r][d]);
              acc[r][0] = v_fma(a, k0, acc[r][0]);
              acc[r][1] = v_fma(a, k1, acc[r][1]);
            }
          }
          for (int r = 0; r < nr; r++) {
            v_store(sbuf + r * spad + j0, v_mul(acc[r][0], v_set1(scale)));
            v_store(sbuf + r * spad + j0 + VL, v_mul(acc[r][1], v_set1(scale)));
          }
        }
        for (; j0 < nmax; j0++)
          for (int r = 0; r < nr; r++) {
            float s = 0.0f;
            for (int64_t d = 0; d < D; d++) s = std::fma(qr[r][d], K[d * kt_sd + j0], s);
            sbuf[r * spad + j0] = s * scale;
          }
        // weights: p = exp(s - max) on the query's own keys, exactly 0 past them; l = sum in key order
        float l[AQ];
        for (int r = 0; r < nr; r++) {
          float* s = sbuf + r * spad;
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < n[r]; j++) m = std::max(m, s[j]);
          int64_t j = 0;
          for (; j + VL <= n[r]; j += VL) v_store(s + j, v_exp_nonpos(v_sub(v_load(s + j), v_set1(m))));
          for (; j < n[r]; j++) s[j] = s_exp_nonpos(s[j] - m);
          for (j = n[r]; j < nmax; j++) s[j] = 0.0f;
          float sum = 0.0f;
          for (j = 0; j < nmax; j++) sum = sum + s[j];
          l[r] = sum;
        }
        // out[r][d] = (fma chain over j of p[r][j] * v[j][d]) / l[r]; keys past a query's own add 0
        for (int r0 = 0; r0 < nr; r0 += 2) {
          const int rr = (int)std::min<int64_t>(2, nr - r0);
          int64_t d0 = 0;
          for (; d0 + 4 * VL <= D; d0 += 4 * VL) {
            vf acc[2][4];
            for (int r = 0; r < 2; r++)
              for (int w = 0; w < 4; w++) acc[r][w] = v_zero();
            for (int64_t j = 0; j < nmax; j++) {
              const float* vj = V + j * v_ss + d0;
              vf x0 = v_load(vj), x1 = v_load(vj + VL), x2 = v_load(vj + 2 * VL), x3 = v_load(vj + 3 * VL);
              for (int r = 0; r < rr; r++) {
                vf a = v_set1(sbuf[(r0 + r) * spad + j]);
                acc[r][0] = v_fma(a, x0, acc[r][0]);
                acc[r][1] = v_fma(a, x1, acc[r][1]);
                acc[r][2] = v_fma(a, x2, acc[r][2]);
                acc[r][3] = v_fma(a, x3, acc[r][3]);
              }
            }
            alignas(64) float tmp[4 * VL];
            for (int r = 0; r < rr; r++) {
              for (int w = 0; w < 4; w++) v_store(tmp + w * VL, acc[r][w]);
              for (int e = 0; e < 4 * VL; e++) orow[r0 + r][d0 + e] = tmp[e] / l[r0 + r];
            }
          }
          for (; d0 + VL <= D; d0 += VL) {
            vf acc[2] = {v_zero(), v_zero()};
            for (int64_t j = 0; j < nmax; j++) {
              vf x = v_load(V + j * v_ss + d0);
              for (int r = 0; r < rr; r++) acc[r] = v_fma(v_set1(sbuf[(r0 + r) * spad + j]), x, acc[r]);
            }
            alignas(64) float tmp[VL];
            for (int r = 0; r < rr; r++) {
              v_store(tmp, acc[r]);
              for (int e = 0; e < VL; e++) orow[r0 + r][d0 + e] = tmp[e] / l[r0 + r];
            }
          }
          for (; d0 < D; d0++)
            for (int r = 0; r < rr; r++) {
              float a = 0.0f;
              for (int64_t j = 0; j < nmax; j++) a = std::fma(sbuf[(r0 + r) * spad + j], V[j * v_ss + d0], a);
              orow[r0 + r][d0] = a / l[r0 + r];
            }
        }
      }
    }
    std::free(sbuf);
  }
}
