// A decode step's rotary embedding and KV-cache write for jetflow's exact numerics, in one pass over the
// new token's q, k and v (invariant/attention_ops.py's decode_attention, then jf_attention reads the
// cache; paged.py's decode_attention_paged, then jf_attention_paged).
//
// rope(x)[d] = x[d] * cos[d] + rotate_half(x)[d] * sin[d], rotate_half(x) = (-x[D/2:], x[:D/2]): two
// products and a sum, each rounded, as torch computes HF's apply_rotary_pos_emb (mul, neg, cat, mul, add):
// the same bits in every lane, tail and build (-ffp-contract=off: no FMA).
#include "convert.h"

static inline void rope_row(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t half = D / 2;
  int64_t d = 0;
  const vf minus_one = v_set1(-1.0f);
  for (; d + VL <= half; d += VL) {
    vf lo = v_load(x + d), hi = v_load(x + half + d);
    v_store(out + d, v_add(v_mul(lo, v_load(c + d)), v_mul(v_mul(hi, minus_one), v_load(s + d))));
    v_store(out + half + d, v_add(v_mul(hi, v_load(c + half + d)), v_mul(lo, v_load(s + half + d))));
  }
  for (; d < half; d++) {
    out[d] = x[d] * c[d] + (-x[half + d]) * s[d];
    out[half + d] = x[half + d] * c[half + d] + x[d] * s[half + d];
  }
}

// Row b (one new token at slot pos[b]): q (B, H * D) with row stride q_ld, k and v (B, Hkv * D) with row
// strides k_ld, v_ld; cos, sin (B, D) with row stride cs_ld. Writes q_out (B, H, D) contiguous = rope(q),
// K^T cache element (b, g, d, pos[b]) at kt[b*kt_sb + g*kt_sh + d*kt_sd + pos[b]] = rope(k), and
// V cache (b, g, pos[b], d) at vc[b*v_sb + g*v_sh + pos[b]*v_ss + d] = v.
extern "C" void jf_rope_decode(const float* q, int64_t q_ld, const float* k, int64_t k_ld, const float* v,
                               int64_t v_ld, const float* cos, const float* sin, int64_t cs_ld, const int64_t* pos,
                               float* q_out, float* kt, int64_t kt_sb, int64_t kt_sh, int64_t kt_sd, float* vc,
                               int64_t v_sb, int64_t v_sh, int64_t v_ss, int64_t B, int64_t H, int64_t Hkv, int64_t D) {
  for (int64_t b = 0; b < B; b++) {
    const float *c = cos + b * cs_ld, *s = sin + b * cs_ld;
    const int64_t p = pos[b];
    for (int64_t h = 0; h < H; h++) rope_row(q + b * q_ld + h * D, c, s, D, q_out + (b * H + h) * D);
    alignas(64) float rotated[512];
    for (int64_t g = 0; g < Hkv; g++) {
      rope_row(k + b * k_ld + g * D, c, s, D, rotated);
      float* kcol = kt + b * kt_sb + g * kt_sh + p;
      for (int64_t d = 0; d < D; d++) kcol[d * kt_sd] = rotated[d];
      std::memcpy(vc + b * v_sb + g * v_sh + p * v_ss, v + b * v_ld + g * D, D * sizeof(float));
    }
  }
}

// The same into a paged cache (jetflow.model.paged_cache): row b's K/V at position p = pos[b] go to page
// table[b*table_ld + p / 64], slot p % 64 (K^T element (g, d, s) at kp[page*k_ps + g*k_sh + d*k_sd + s], V
// (g, s, d) at vp[page*v_ps + g*v_sh + s*v_ss + d]). fmt 0: fp32; 2: E4M3 codes of rope(k) / k_scale and
// v / v_scale (torch's (x / scale).to(float8_e4m3fn), which saturates: the FP8 KV quantizer's bytes).
extern "C" void jf_rope_decode_paged(const float* q, int64_t q_ld, const float* k, int64_t k_ld, const float* v,
                                     int64_t v_ld, const float* cos, const float* sin, int64_t cs_ld,
                                     const int64_t* pos, float* q_out, int fmt, void* kp, int64_t k_ps, int64_t k_sh,
                                     int64_t k_sd, void* vp, int64_t v_ps, int64_t v_sh, int64_t v_ss, float k_scale,
                                     float v_scale, const int32_t* table, int64_t table_ld, int64_t B, int64_t H,
                                     int64_t Hkv, int64_t D) {
  for (int64_t b = 0; b < B; b++) {
    const float *c = cos + b * cs_ld, *s = sin + b * cs_ld;
    const int64_t p = pos[b], page = table[b * table_ld + p / 64], slot = p % 64;
    for (int64_t h = 0; h < H; h++) rope_row(q + b * q_ld + h * D, c, s, D, q_out + (b * H + h) * D);
    alignas(64) float rotated[512];
    for (int64_t g = 0; g < Hkv; g++) {
      rope_row(k + b * k_ld + g * D, c, s, D, rotated);
      const int64_t kcol = page * k_ps + g * k_sh + slot, vrow = page * v_ps + g * v_sh + slot * v_ss;
      const float* vsrc = v + b * v_ld + g * D;
      if (fmt == 2) {
        uint8_t *kc = (uint8_t*)kp + kcol, *vc = (uint8_t*)vp + vrow;
        for (int64_t d = 0; d < D; d++) kc[d * k_sd] = f32_to_e4m3_scaled(rotated[d], k_scale);
        for (int64_t d = 0; d < D; d++) vc[d] = f32_to_e4m3_scaled(vsrc[d], v_scale);
      } else {
        float* kc = (float*)kp + kcol;
        for (int64_t d = 0; d < D; d++) kc[d * k_sd] = rotated[d];
        std::memcpy((float*)vp + vrow, vsrc, D * sizeof(float));
      }
    }
  }
}
