// Batch-invariant causal attention for jetflow's exact numerics (precision.numerics=exact).
//
// For a query at position p: s_j = (fma chain over d of q[d] * k_j[d]) * scale for keys j = 0..p;
// m = max_j s_j; p_j = jf_exp(s_j - m); l = p_0 + p_1 + ... (in order); o[d] = (fma chain over j of
// p_j * v_j[d]) / l. The result depends only on the query and its own keys: never on how many queries
// or sequences share the call, the thread, or whether the row is decoded from a cache or computed in
// a full forward.
#include "simd.h"

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
// Attention. q (B, H, T, D) contiguous; kt: K transposed, element (b, h, d, s) at
// kt[b*kt_sb + h*kt_sh + d*kt_sd + s]; v: element (b, h, s, d) at v[b*v_sb + h*v_sh + s*v_ss + d];
// pos (B, T) int64: the query's position = the last key slot it sees; out (B, H, T, D) contiguous.
// GQA: query head h reads K/V head h / (H / Hkv).

static const int AQ = 8;  // queries per tile (of one K/V head): they share each key's loads
static const int AV = VL >= 16 ? 4 : 2;  // queries per pass over V: 4 x 4 accumulators fit AVX-512's 32 registers

// Scores of up to AQ queries against the NR keys j0.. (the first n0 of the first vector, n1 of the
// second: VL and VL for a whole block): row r's chain over d in each lane, times scale, into sbuf.
static inline void score_block(const float* const* qr, int64_t nr, const float* K, int64_t kt_sd, int64_t j0,
                               int64_t D, float scale, int n0, int n1, float* sbuf, int64_t spad) {
  vf acc[AQ][2];
  for (int r = 0; r < AQ; r++) acc[r][0] = acc[r][1] = v_zero();
  const bool whole = n0 == VL && n1 == VL;
  for (int64_t d = 0; d < D; d++) {
    const float* k = K + d * kt_sd + j0;
    __builtin_prefetch(k + NR);  // the next block's keys: K rows are short, too short for the hardware prefetcher
    __builtin_prefetch(k + 2 * NR - 1);
    vf k0 = whole ? v_load(k) : v_load_n(k, n0), k1 = whole ? v_load(k + VL) : v_load_n(k + VL, n1);
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
        // scores: s[r][j] = (fma chain over d of q[r][d] * k[j][d]) * scale for j < nmax, NR keys at a time
        int64_t j0 = 0;
        for (; j0 + NR <= nmax; j0 += NR) score_block(qr, nr, K, kt_sd, j0, D, scale, VL, VL, sbuf, spad);
        if (j0 < nmax)  // the last block: lanes past nmax load 0, their scores land in sbuf's padding (never read)
          score_block(qr, nr, K, kt_sd, j0, D, scale, (int)std::min<int64_t>(VL, nmax - j0),
                      (int)std::max<int64_t>(0, nmax - j0 - VL), sbuf, spad);
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
          for (; d0 + 4 * VL <= D; d0 += 4 * VL) {
            vf acc[AV][4];
            for (int r = 0; r < AV; r++)
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
            vf acc[AV];
            for (int r = 0; r < AV; r++) acc[r] = v_zero();
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
