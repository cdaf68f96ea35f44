// Weight and activation format conversions for the canonical GEMM (gemm.cpp): E4M3 and bf16 to fp32,
// and both to the bf16 pairs AVX512_BF16's vdpbf16ps reads (JF_DPBF16: the build has the instruction).
#pragma once
#include "simd.h"

#if !defined(JF_NO_SIMD) && defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define JF_DPBF16 1
#endif

// Packed weight formats (invariant/packing.py's WEIGHT_FORMATS): fp32, bf16 bits or E4M3 bytes in (P, K, NR)
// panels; on AVX512_BF16 (pack.cpp's jf_pack_pairs) bf16 pairs, (P, ceil(K/2), NR) dwords
enum { WF_F32 = 0, WF_BF16 = 1, WF_E4M3 = 2, WF_PAIRS = 3 };

// ---------------------------------------------------------------------------------------------
// Conversions. Every E4M3 and bf16 value is exact in fp32, so any correct conversion gives the same
// bits; the tables are the reference (and the scalar build's path). Codes 0x7F / 0xFF (NaN) never
// reach a kernel: the quantizer refuses non-finite values.

static float E4M3_F32[256];
static uint16_t E4M3_BF16[256];
static const bool TABLES_READY = [] {
  for (int c = 0; c < 256; c++) {
    int e = (c >> 3) & 15, m = c & 7;
    float v = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp((float)m, -9);
    E4M3_F32[c] = (c & 0x80) ? -v : v;
    uint32_t bits;
    std::memcpy(&bits, &E4M3_F32[c], 4);
    E4M3_BF16[c] = (uint16_t)(bits >> 16);  // exact: 3 mantissa bits
  }
  return true;
}();

static const float E4M3_MAX = 448.0f;

// |v| <= 448, finite -> E4M3 code, round to nearest even (normal: 3 mantissa bits; subnormal: m * 2^-9)
static inline uint8_t f32_to_e4m3(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
  const uint32_t abs_bits = bits & 0x7FFFFFFF;
  float a;
  std::memcpy(&a, &abs_bits, 4);
  if (a < 0.015625f) {  // below 2^-6: subnormal codes 0..7 (8 rounds up to the smallest normal, code 8)
    return sign | (uint8_t)std::nearbyint(a * 512.0f);
  }
  int e = (int)(abs_bits >> 23) - 127;  // -6 .. 8
  uint32_t mant = abs_bits & 0x7FFFFF, m = mant >> 20, rest = mant & 0xFFFFF;
  if (rest > 0x80000 || (rest == 0x80000 && (m & 1))) m++;
  if (m == 8) m = 0, e++;
  return sign | (uint8_t)(((e + 7) << 3) | m);
}

// E4M3 code of clamp(x / scale, -448, 448): the bytes of torch's (x / scale).to(float8_e4m3fn) (it saturates)
static inline uint8_t f32_to_e4m3_scaled(float x, float scale) {
  return f32_to_e4m3(std::min(std::max(x / scale, -E4M3_MAX), E4M3_MAX));
}

static inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// n E4M3 codes -> fp32 values (n a multiple of VL, or any n in the scalar build)
static inline void e4m3_to_f32(const uint8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if !defined(JF_NO_SIMD) && defined(__AVX512F__)
  const __m512i m7f = _mm512_set1_epi32(0x7f), m80 = _mm512_set1_epi32(0x80), bias = _mm512_set1_epi32(120 << 23),
                eight = _mm512_set1_epi32(8);
  const __m512 sub_scale = _mm512_set1_ps(1.0f / 512);  // subnormal E4M3: m * 2^-9
  for (; i + 16 <= n; i += 16) {
    __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(src + i)));
    __m512i mag = _mm512_and_si512(u, m7f);
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(u, m80), 24);
    __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), bias));
    __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), sub_scale);
    __m512 v = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(mag, eight), sub, normal);
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign)));
  }
#elif !defined(JF_NO_SIMD) && defined(__AVX2__)
  const __m256i m7f = _mm256_set1_epi32(0x7f), m80 = _mm256_set1_epi32(0x80), bias = _mm256_set1_epi32(120 << 23),
                seven = _mm256_set1_epi32(7);
  const __m256 sub_scale = _mm256_set1_ps(1.0f / 512);
  for (; i + 8 <= n; i += 8) {
    __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(src + i)));
    __m256i mag = _mm256_and_si256(u, m7f);
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(u, m80), 24);
    __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), bias));
    __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), sub_scale);
    __m256 v = _mm256_blendv_ps(sub, normal, _mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, seven)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign)));
  }
#endif
  for (; i < n; i++) dst[i] = E4M3_F32[src[i]];
}

static inline void bf16_to_f32_n(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if !defined(JF_NO_SIMD) && defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
  }
#elif !defined(JF_NO_SIMD) && defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
  }
#endif
  for (; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

#ifdef JF_DPBF16
// 32 E4M3 codes -> 32 bf16 (u16 lanes)
static inline __m512i e4m3x32_to_bf16(const uint8_t* p) {
  alignas(64) static const uint16_t SUB[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};  // m * 2^-9
  const __m512i sub_table = _mm512_load_si512(SUB);
  __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
  __m512i mag = _mm512_and_si512(u, _mm512_set1_epi16(0x7f));
  __m512i sign = _mm512_slli_epi16(_mm512_and_si512(u, _mm512_set1_epi16(0x80)), 8);
  __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  __m512i sub = _mm512_permutexvar_epi16(mag, sub_table);  // index: the low 5 bits (mag < 8 here)
  __m512i v = _mm512_mask_blend_epi16(_mm512_cmpge_epu16_mask(mag, _mm512_set1_epi16(8)), sub, normal);
  return _mm512_or_si512(v, sign);
}

// permutex2var indices: word 2j takes the first operand's column j (+16 for the high half), 2j+1 the second's
struct PairIndex {
  uint16_t w[2][32];
  PairIndex() {
    for (int h = 0; h < 2; h++)
      for (int j = 0; j < 16; j++) w[h][2 * j] = (uint16_t)(16 * h + j), w[h][2 * j + 1] = (uint16_t)(32 + 16 * h + j);
  }
};
static const PairIndex PAIR_INDEX_TABLE;
static const uint16_t (&PAIR_INDEX)[2][32] = PAIR_INDEX_TABLE.w;

// A (K, NR=32) E4M3 panel -> (ceil(K/2), 32) dwords: dword (i, j) = bf16(w[2i][j]) | bf16(w[2i+1][j]) << 16
static void e4m3_panel_to_pairs(const uint8_t* src, int64_t K, uint32_t* dst) {
  const __m512i lo_idx = _mm512_loadu_si512(PAIR_INDEX[0]), hi_idx = _mm512_loadu_si512(PAIR_INDEX[1]);
  const uint8_t zeros[32] = {0};
  for (int64_t i = 0; 2 * i < K; i++) {
    __m512i even = e4m3x32_to_bf16(src + 2 * i * NR);
    __m512i odd = e4m3x32_to_bf16(2 * i + 1 < K ? src + (2 * i + 1) * NR : zeros);
    _mm512_storeu_si512(dst + i * NR, _mm512_permutex2var_epi16(even, lo_idx, odd));
    _mm512_storeu_si512(dst + i * NR + 16, _mm512_permutex2var_epi16(even, hi_idx, odd));
  }
}

// A (K, NR=32) bf16 panel -> (ceil(K/2), 32) pair dwords, swapped: dword (i, j) = bf16 w[2i+1][j] |
// w[2i][j] << 16 (vdpbf16ps adds the high product first, so the chain runs k = 2i, 2i + 1: in order)
static void bf16_panel_to_pairs(const uint16_t* src, int64_t K, uint32_t* dst) {
  const __m512i lo_idx = _mm512_loadu_si512(PAIR_INDEX[0]), hi_idx = _mm512_loadu_si512(PAIR_INDEX[1]);
  for (int64_t i = 0; 2 * i < K; i++) {
    __m512i even = _mm512_loadu_si512(src + 2 * i * NR);
    __m512i odd = 2 * i + 1 < K ? _mm512_loadu_si512(src + (2 * i + 1) * NR) : _mm512_setzero_si512();
    _mm512_storeu_si512(dst + i * NR, _mm512_permutex2var_epi16(odd, lo_idx, even));
    _mm512_storeu_si512(dst + i * NR + 16, _mm512_permutex2var_epi16(odd, hi_idx, even));
  }
}

// (ceil(K/2), NR) swapped bf16 pair dwords -> (K, NR) fp32: the FMA path's panel when an operand is out
// of vdpbf16ps's exact range
static void pairs_panel_to_f32(const uint32_t* src, int64_t K, float* dst) {
  for (int64_t i = 0; 2 * i < K; i++)
    for (int c = 0; c < NR; c++) {
      const uint32_t d = src[i * NR + c];
      dst[2 * i * NR + c] = bf16_to_f32((uint16_t)(d >> 16));
      if (2 * i + 1 < K) dst[(2 * i + 1) * NR + c] = bf16_to_f32((uint16_t)(d & 0xFFFF));
    }
}
#endif

// True when vdpbf16ps computes the FMA chain's bits for bf16 value `bits` (fp32 bits): 0, or a
// magnitude >= 2^-56 (see gemm.cpp's header), or not finite (inf / NaN propagate alike).
static inline bool dp_exact_bf16(uint32_t bits) {
  const uint32_t mag = bits & 0x7FFFFFFFu;
  return mag == 0 || mag >= ((127u - 56u) << 23);
}

// bf16 weight bits converted in registers (decode: few rows share each weight load, so a converted
// panel buffer would cost as much as it saves)
static inline vf v_load_bf16(const uint16_t* p) {
#if !defined(JF_NO_SIMD) && defined(__AVX512F__)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#elif !defined(JF_NO_SIMD) && defined(__AVX2__)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
#else
  return bf16_to_f32(*p);
#endif
}

// VL E4M3 codes -> fp32 lanes (the KV cache's FP8 pages: attention.cpp converts each load)
static inline vf v_load_e4m3(const uint8_t* p) {
  alignas(64) float t[VL];
  e4m3_to_f32(p, t, VL);
  return v_load(t);
}
