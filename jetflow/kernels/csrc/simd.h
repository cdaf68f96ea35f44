// SIMD abstraction shared by jetflow's batch-invariant CPU kernels (gemm.cpp, attention.cpp).
//
// `vf` is one vector of fp32 lanes (AVX-512: 16, AVX2: 8, scalar reference: 1). Every kernel is
// written once against these helpers; each helper is one IEEE operation per lane (FMA correctly
// rounded), so a lane, a scalar `std::fma` tail and another vector width give the same bits. The
// ISA is fixed at compile time: -march=native (the machine's), -mavx2 -mfma, or -DJF_NO_SIMD (the
// scalar reference the tests compare the others against, bit for bit).
#pragma once
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
static inline vf v_load_n(const float* p, int n) {  // lanes [0, n) from p (n in [0, VL]), 0 past them: never reads past p + n
  return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
}
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
static inline vf v_load_n(const float* p, int n) {
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
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
static inline vf v_load_n(const float* p, int n) { return n > 0 ? *p : 0.0f; }
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

static const int NR = 2 * VL;  // GEMM panel width (columns of the packed weight): 2 vectors

static inline float* jf_alloc_f32(int64_t n) {  // 64-byte aligned, size rounded up as aligned_alloc wants
  return (float*)std::aligned_alloc(64, ((n * (int64_t)sizeof(float) + 63) / 64) * 64);
}
