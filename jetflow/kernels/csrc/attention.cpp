// Batch-invariant causal attention for jetflow's exact numerics (precision.numerics=exact).
//
// For a query at position p: s_j = (fma chain over d of q[d] * k_j[d]) * scale for keys j = 0..p;
// m = max_j s_j; p_j = jf_exp(s_j - m); l = p_0 + p_1 + ... (in order); o[d] = (fma chain over j of
// p_j * v_j[d]) / l. The result depends only on the query and its own keys: never on how many queries
// or sequences share the call, the thread, or whether the row is decoded from a cache or computed in
// a full forward.
#include "convert.h"

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
// Attention. q (B, H, T, D) contiguous; pos (B, T) int64: the query's position = the last key slot it
// sees; out (B, H, T, D) contiguous. GQA: query head h reads K/V head h / (H / Hkv).
//
// K/V are read in 64-slot blocks (the KV cache's pages): key slot j of row b, head hk lies in block
// jb = j / 64 at K element kv.k_at(b, jb) + hk*k_sh + d*k_sd + j % 64 (K transposed inside a block) and
// V element kv.v_at(b, jb) + hk*v_sh + (j % 64)*v_ss + d. A dense cache's blocks are consecutive
// (b*k_sb + jb*64); a paged cache's come from the row's block table. Elements are fp32, E4M3 codes
// (value = code * scale, one fp32 multiply: the fake-quantizer's value) or bf16 bits, converted at each
// load. Keys are visited in slot order whatever the layout, so every layout gives the same bits.

static const int64_t KV_BLOCK = 64;  // slots per block; a multiple of NR (score_block's keys never straddle two)
static const int AQ = 8;  // queries per tile (of one K/V head): they share each key's loads
static const int AV = VL >= 16 ? 4 : 2;  // queries per pass over V: 4 x 4 accumulators fit AVX-512's 32 registers

struct KVSource {
  const void *k, *v;
  int64_t k_sb, k_sh, k_sd, v_sb, v_sh, v_ss;  // dense: row strides k_sb, v_sb; paged: page strides
  const int32_t* table;  // paged: (B, table_ld) page ids; nullptr: dense
  int64_t table_ld;
  float k_scale, v_scale;  // E4M3 codes' scales (1 otherwise)
  int64_t k_at(int64_t b, int64_t jb) const { return table ? table[b * table_ld + jb] * k_sb : b * k_sb + jb * KV_BLOCK; }
  int64_t v_at(int64_t b, int64_t jb) const {
    return table ? table[b * table_ld + jb] * v_sb : b * v_sb + jb * KV_BLOCK * v_ss;
  }
};

// Loads of VL (or the first n) elements as fp32 lanes, and one element, per storage type.
static inline vf kv_load(const float* p, float) { return v_load(p); }
static inline vf kv_load(const uint8_t* p, float s) { return v_mul(v_load_e4m3(p), v_set1(s)); }
static inline vf kv_load(const uint16_t* p, float) { return v_load_bf16(p); }
static inline vf kv_load_n(const float* p, int n, float) { return v_load_n(p, n); }
template <class E>
static inline vf kv_load_n(const E* p, int n, float s) {  // lanes past n: code 0 (= 0.0), never read
  E buf[VL] = {};
  for (int i = 0; i < n; i++) buf[i] = p[i];
  return kv_load(buf, s);
}
static inline float kv_one(const float* p, float) { return *p; }
static inline float kv_one(const uint8_t* p, float s) { return E4M3_F32[*p] * s; }
static inline float kv_one(const uint16_t* p, float) { return bf16_to_f32(*p); }

// Scores of up to AQ queries against the NR keys j0.. (the first n0 of the first vector, n1 of the
// second: VL and VL for a whole block): row r's chain over d in each lane, times scale, into sbuf.
// K points at key j0's (d = 0) element.
template <class E>
static inline void score_block(const float* const* qr, int64_t nr, const E* K, int64_t kt_sd, float ks, int64_t j0,
                               int64_t D, float scale, int n0, int n1, float* sbuf, int64_t spad) {
  vf acc[AQ][2];
  for (int r = 0; r < AQ; r++) acc[r][0] = acc[r][1] = v_zero();
  const bool whole = n0 == VL && n1 == VL;
  for (int64_t d = 0; d < D; d++) {
    const E* k = K + d * kt_sd;
    __builtin_prefetch(k + NR);  // the next block's keys: K rows are short, too short for the hardware prefetcher
    __builtin_prefetch(k + 2 * NR - 1);
    vf k0 = whole ? kv_load(k, ks) : kv_load_n(k, n0, ks), k1 = whole ? kv_load(k + VL, ks) : kv_load_n(k + VL, n1, ks);
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

// l[r] = the sum of row r's nmax weights in key order, one chain per row; the rows' chains interleaved
// (each add waits for the previous one of its row: interleaving lets the rows' adds overlap).
static inline void row_sums(const float* sbuf, int64_t spad, int64_t nr, int64_t nmax, float* l) {
  float acc[AQ] = {};
  for (int64_t j = 0; j < nmax; j++) {
#pragma GCC unroll 8
    for (int r = 0; r < AQ; r++)
      if (r < nr) acc[r] = acc[r] + sbuf[r * spad + j];
  }
  for (int r = 0; r < nr; r++) l[r] = acc[r];
}

// out[r][d0 + e] for e < W*VL: (fma chain over j < nmax of p[r][j] * v[j][d]) / l[r], rr queries.
template <int W, class E>
static inline void weighted_v(const KVSource& kv, int64_t b, int64_t hk, int64_t d0, int64_t nmax, const float* sbuf,
                              int64_t spad, int r0, int rr, const float* l, float* const* orow) {
  const E* base = (const E*)kv.v + hk * kv.v_sh + d0;
  vf acc[AV][W];
  for (int r = 0; r < AV; r++)
    for (int w = 0; w < W; w++) acc[r][w] = v_zero();
  for (int64_t jb = 0; jb * KV_BLOCK < nmax; jb++) {
    const E* V = base + kv.v_at(b, jb);
    const int64_t j1 = std::min<int64_t>(KV_BLOCK, nmax - jb * KV_BLOCK);
    for (int64_t jj = 0; jj < j1; jj++) {
      const E* vj = V + jj * kv.v_ss;
      vf x[W];
      for (int w = 0; w < W; w++) x[w] = kv_load(vj + w * VL, kv.v_scale);
      const int64_t j = jb * KV_BLOCK + jj;
      for (int r = 0; r < rr; r++) {
        vf a = v_set1(sbuf[(r0 + r) * spad + j]);
        for (int w = 0; w < W; w++) acc[r][w] = v_fma(a, x[w], acc[r][w]);
      }
    }
  }
  alignas(64) float tmp[W * VL];
  for (int r = 0; r < rr; r++) {
    for (int w = 0; w < W; w++) v_store(tmp + w * VL, acc[r][w]);
    for (int e = 0; e < W * VL; e++) orow[r0 + r][d0 + e] = tmp[e] / l[r0 + r];
  }
}

template <class E>
static void attention_core(const float* q, const KVSource& kv, const int64_t* pos, float* out, int64_t B, int64_t H,
                           int64_t Hkv, int64_t T, int64_t D, float scale) {
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
        const E* K = (const E*)kv.k + hk * kv.k_sh;
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
        // scores: s[r][j] = (fma chain over d of q[r][d] * k[j][d]) * scale for j < nmax, NR keys at a time
        // (the last group: lanes past nmax load 0, their scores land in sbuf's padding, never read)
        for (int64_t j0 = 0; j0 < nmax; j0 += NR) {
          const E* Kj = K + kv.k_at(b, j0 / KV_BLOCK) + j0 % KV_BLOCK;
          if (j0 + NR <= nmax)
            score_block(qr, nr, Kj, kv.k_sd, kv.k_scale, j0, D, scale, VL, VL, sbuf, spad);
          else
            score_block(qr, nr, Kj, kv.k_sd, kv.k_scale, j0, D, scale, (int)std::min<int64_t>(VL, nmax - j0),
                        (int)std::max<int64_t>(0, nmax - j0 - VL), sbuf, spad);
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
        }
        row_sums(sbuf, spad, nr, nmax, l);
        // out[r][d] = (fma chain over j of p[r][j] * v[j][d]) / l[r]; keys past a query's own add 0.
        // AV queries per pass over V (a decode step's GQA group shares one read of its V rows).
        for (int r0 = 0; r0 < nr; r0 += AV) {
          const int rr = (int)std::min<int64_t>(AV, nr - r0);
          int64_t d0 = 0;
          for (; d0 + 4 * VL <= D; d0 += 4 * VL) weighted_v<4, E>(kv, b, hk, d0, nmax, sbuf, spad, r0, rr, l, orow);
          for (; d0 + VL <= D; d0 += VL) weighted_v<1, E>(kv, b, hk, d0, nmax, sbuf, spad, r0, rr, l, orow);
          for (; d0 < D; d0++)
            for (int r = 0; r < rr; r++) {
              float a = 0.0f;
              for (int64_t j = 0; j < nmax; j++) {
                const E* vj = (const E*)kv.v + kv.v_at(b, j / KV_BLOCK) + hk * kv.v_sh + (j % KV_BLOCK) * kv.v_ss + d0;
                a = std::fma(sbuf[(r0 + r) * spad + j], kv_one(vj, kv.v_scale), a);
              }
              orow[r0 + r][d0] = a / l[r0 + r];
            }
        }
      }
    }
    std::free(sbuf);
  }
}

// Dense fp32 K/V: kt (b, h, d, s) at kt[b*kt_sb + h*kt_sh + d*kt_sd + s]; v (b, h, s, d) at
// v[b*v_sb + h*v_sh + s*v_ss + d].
extern "C" void jf_attention(const float* q, const float* kt, int64_t kt_sb, int64_t kt_sh, int64_t kt_sd,
                             const float* v, int64_t v_sb, int64_t v_sh, int64_t v_ss, const int64_t* pos, float* out,
                             int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t D, float scale) {
  const KVSource kv{kt, v, kt_sb, kt_sh, kt_sd, v_sb, v_sh, v_ss, nullptr, 0, 1.0f, 1.0f};
  attention_core<float>(q, kv, pos, out, B, H, Hkv, T, D, scale);
}

// Paged K/V (jetflow.model.paged_cache): page p's K^T (h, d, s) at kp[p*k_ps + h*k_sh + d*k_sd + s], its V
// (h, s, d) at vp[p*v_ps + h*v_sh + s*v_ss + d]; row b's block jb is page table[b*table_ld + jb].
// fmt: 0 fp32, 1 bf16 bits, 2 E4M3 codes (value = code * k_scale / v_scale).
extern "C" void jf_attention_paged(const float* q, int fmt, const void* kp, int64_t k_ps, int64_t k_sh, int64_t k_sd,
                                   const void* vp, int64_t v_ps, int64_t v_sh, int64_t v_ss, float k_scale,
                                   float v_scale, const int32_t* table, int64_t table_ld, const int64_t* pos,
                                   float* out, int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t D, float scale) {
  const KVSource kv{kp, vp, k_ps, k_sh, k_sd, v_ps, v_sh, v_ss, table, table_ld, k_scale, v_scale};
  if (fmt == 2)
    attention_core<uint8_t>(q, kv, pos, out, B, H, Hkv, T, D, scale);
  else if (fmt == 1)
    attention_core<uint16_t>(q, kv, pos, out, B, H, Hkv, T, D, scale);
  else
    attention_core<float>(q, kv, pos, out, B, H, Hkv, T, D, scale);
}
