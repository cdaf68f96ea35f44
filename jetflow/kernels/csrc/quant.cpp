// The 1x128 E4M3 activation quantizer of the exact FP8 linear, fused into one pass over x (and, at the
// end, the bf16 kind's rounding to the bf16 grid, jf_round_to_bf16).
//
// It computes the bytes and scales of jetflow.precision.quant.quantize_blocks(x, (1, 128)) (the numerical
// truth, vLLM's per_token_group_quant_fp8 contract), operation for operation:
//   absmax    = max(max |x| over the group, 1e-10f)
//   scale_inv = absmax * 2^margin / 448                     (fp32 multiply, fp32 division)
//   pow2:       scale_inv = 2^ceil(float(log2(double(max(scale_inv, 1e-10f)))))
//   code      = e4m3(clamp(x / scale_inv, -448, 448))       (fp32 division, round to nearest even)
// A group holding NaN or Inf is counted and its scale set to NaN; the caller then raises the
// quantizer's own error (the cast alone would hide it). Tests compare every byte with the torch code.
#include "convert.h"

static const float AMAX_EPS = 1e-10f;

// |x| max over n values, and whether all are finite (x - x is 0 for finite x, NaN for Inf / NaN)
static inline float group_amax(const float* x, int64_t n, bool* finite) {
  int64_t i = 0;
  float amax = 0.0f, nonfinite = 0.0f;
#if !defined(JF_NO_SIMD) && defined(__AVX512F__)
  __m512 vmax = _mm512_setzero_ps(), vnf = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    vnf = _mm512_add_ps(vnf, _mm512_sub_ps(v, v));
  }
  amax = _mm512_reduce_max_ps(vmax);
  nonfinite = _mm512_reduce_add_ps(vnf);
#elif !defined(JF_NO_SIMD) && defined(__AVX2__)
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax = _mm256_setzero_ps(), vnf = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    vmax = _mm256_max_ps(vmax, _mm256_and_ps(v, absmask));
    vnf = _mm256_add_ps(vnf, _mm256_sub_ps(v, v));
  }
  alignas(32) float t[8], u[8];
  _mm256_store_ps(t, vmax);
  _mm256_store_ps(u, vnf);
  for (int j = 0; j < 8; j++) amax = std::max(amax, t[j]), nonfinite += u[j];
#endif
  for (; i < n; i++) {
    const float a = std::fabs(x[i]);
    amax = a > amax ? a : amax;
    nonfinite += x[i] - x[i];
  }
  *finite = nonfinite == 0.0f;  // NaN compares false
  return amax;
}

// codes of clamp(x / scale, -448, 448) for n values (the same rounding as f32_to_e4m3, on the bits:
// normal values round their 23-bit mantissa to 3 bits, nearest even, the carry running into the exponent)
static inline void quantize_group(const float* x, int64_t n, float scale, uint8_t* q) {
  int64_t i = 0;
#if !defined(JF_NO_SIMD) && defined(__AVX512F__)
  const __m512 vs = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-E4M3_MAX), hi = _mm512_set1_ps(E4M3_MAX);
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vs), lo), hi);
    __m512 a = _mm512_abs_ps(v);
    __m512i bits = _mm512_castps_si512(a);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1));
    __m512i normal = _mm512_sub_epi32(
        _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), odd)), 20),
        _mm512_set1_epi32(120 << 3));
    __m512i sub = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(512.0f)),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m512i code = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ), normal, sub);
    __m512i sign = _mm512_srli_epi32(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000)), 24);
    _mm_storeu_si128((__m128i*)(q + i), _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign)));
  }
#elif !defined(JF_NO_SIMD) && defined(__AVX2__)
  const __m256 vs = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-E4M3_MAX), hi = _mm256_set1_ps(E4M3_MAX);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vs), lo), hi);
    __m256 a = _mm256_and_ps(v, absmask);
    __m256i bits = _mm256_castps_si256(a);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 20), _mm256_set1_epi32(1));
    __m256i normal = _mm256_sub_epi32(
        _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF), odd)), 20),
        _mm256_set1_epi32(120 << 3));
    __m256i sub = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.0f)),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i code = _mm256_blendv_epi8(normal, sub, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(0.015625f),
                                                                                     _CMP_LT_OQ)));
    __m256i sign = _mm256_srli_epi32(_mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32((int)0x80000000)), 24);
    alignas(32) int32_t t[8];
    _mm256_store_si256((__m256i*)t, _mm256_or_si256(code, sign));
    for (int j = 0; j < 8; j++) q[i + j] = (uint8_t)t[j];
  }
#endif
  for (; i < n; i++) q[i] = f32_to_e4m3(std::min(std::max(x[i] / scale, -E4M3_MAX), E4M3_MAX));
}

// One row of K values -> its codes and ceil(K/128) scales; returns the number of groups holding NaN / Inf.
static int64_t quantize_row(const float* row, int64_t K, int pow2, float margin_scale, uint8_t* q, float* s) {
  const int64_t G = 128, nb = (K + G - 1) / G;
  int64_t bad = 0;
  for (int64_t b = 0; b < nb; b++) {
    const int64_t k0 = b * G, n = std::min(K, k0 + G) - k0;
    bool finite;
    const float amax = group_amax(row + k0, n, &finite);
    float scale = std::max(amax, AMAX_EPS) * margin_scale / E4M3_MAX;
    if (pow2) {
      const float l = (float)std::log2((double)std::max(scale, AMAX_EPS));
      scale = std::ldexp(1.0f, (int)std::ceil(l));
    }
    if (!finite) {
      bad++;
      s[b] = std::numeric_limits<float>::quiet_NaN();
      std::memset(q + k0, 0, n);
      continue;
    }
    s[b] = scale;
    quantize_group(row + k0, n, scale, q + k0);
  }
  return bad;
}

// x (M, K) fp32, element (m, k) at x[m * ldx + k * ldk] -> q (M, K) E4M3 codes (row stride K), s (M,
// ceil(K/128)) scale_inv. ldk = 1: rows in place; otherwise (a transposed view: the weight-gradient GEMM's
// 128 x 1 groups) RB rows at a time are gathered into a per-thread buffer first, reading RB adjacent
// values of each source line, instead of a strided copy of the whole matrix. Returns the number of
// groups holding NaN or Inf.
extern "C" int64_t jf_quantize_1x128(const float* x, int64_t M, int64_t K, int64_t ldx, int64_t ldk, int pow2,
                                     float margin_scale, uint8_t* q, float* s) {
  const int64_t nb = (K + 127) / 128;
  int64_t bad = 0;
  if (ldk == 1) {
#pragma omp parallel for schedule(static) reduction(+ : bad) if (M * K > (1 << 18))
    for (int64_t m = 0; m < M; m++) bad += quantize_row(x + m * ldx, K, pow2, margin_scale, q + m * K, s + m * nb);
    return bad;
  }
  const int64_t RB = 16, blocks = (M + RB - 1) / RB;
#pragma omp parallel reduction(+ : bad) if (M * K > (1 << 18))
  {
    float* buf = jf_alloc_f32(RB * K);
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
      const int64_t m0 = blk * RB, rows = std::min(RB, M - m0);
      for (int64_t k = 0; k < K; k++)
        for (int64_t r = 0; r < rows; r++) buf[r * K + k] = x[(m0 + r) * ldx + k * ldk];
      for (int64_t r = 0; r < rows; r++)
        bad += quantize_row(buf + r * K, K, pow2, margin_scale, q + (m0 + r) * K, s + (m0 + r) * nb);
    }
    std::free(buf);
  }
  return bad;
}

// x -> x rounded to the bf16 grid, kept in fp32 (torch's x.bfloat16().float(): round to nearest even on the
// bits; NaN -> the quiet NaN 0x7FC00000), n contiguous values: one pass instead of two casts.
extern "C" void jf_round_to_bf16(const float* x, int64_t n, float* out) {
#pragma omp parallel for schedule(static) if (n > (1 << 18))
  for (int64_t i = 0; i < n; i++) {
    uint32_t b;
    std::memcpy(&b, x + i, 4);
    const uint32_t r = (b & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    std::memcpy(out + i, &r, 4);
  }
}
