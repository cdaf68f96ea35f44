// Weight packing for the canonical GEMM (gemm.cpp): (N, K) weights -> the panels the kernels read, once
// per weight version (jetflow/kernels/invariant/packing.py's pack_weight).
#include "convert.h"

// W (N, K), element (n, k) at W[n * ldn + k * ldk], `esize`-byte values (fp32, bf16 or E4M3 bits) ->
// panels (P, K, NR): panel p holds columns n = p * NR .. p * NR + NR - 1 (zero past N), k-major. One
// pass, in parallel over panels, reading W along its unit-stride dimension (rows of W, or of W^T for a
// transposed view) instead of a strided copy of the whole matrix.
template <typename T>
static void pack_panels(const T* W, int64_t N, int64_t K, int64_t ldn, int64_t ldk, int64_t P, T* dst) {
#pragma omp parallel for schedule(static) if (N * K > (1 << 16))
  for (int64_t p = 0; p < P; p++) {
    T* panel = dst + p * K * NR;
    const int64_t cols = std::min<int64_t>(NR, N - p * NR);
    if (cols < NR)
      for (int64_t k = 0; k < K; k++) std::fill(panel + k * NR + cols, panel + (k + 1) * NR, T(0));
    if (ldk == 1) {
      for (int64_t j = 0; j < cols; j++) {
        const T* row = W + (p * NR + j) * ldn;
        for (int64_t k = 0; k < K; k++) panel[k * NR + j] = row[k];
      }
    } else {
      for (int64_t k = 0; k < K; k++)
        for (int64_t j = 0; j < cols; j++) panel[k * NR + j] = W[(p * NR + j) * ldn + k * ldk];
    }
  }
}

extern "C" void jf_pack_panels(const void* W, int esize, int64_t N, int64_t K, int64_t ldn, int64_t ldk, void* dst) {
  const int64_t P = (N + NR - 1) / NR;
  if (esize == 4)
    pack_panels((const uint32_t*)W, N, K, ldn, ldk, P, (uint32_t*)dst);
  else if (esize == 2)
    pack_panels((const uint16_t*)W, N, K, ldn, ldk, P, (uint16_t*)dst);
  else
    pack_panels((const uint8_t*)W, N, K, ldn, ldk, P, (uint8_t*)dst);
}

// E4M3 (wfmt WF_E4M3) or bf16 (WF_BF16) weight panels (P, K, NR) -> bf16 pairs (P, ceil(K/2), NR), the
// layout vdpbf16ps reads. Returns 0; 1 where the build has no vdpbf16ps; 2 for a bf16 weight with a
// value out of the instruction's exact range (keep the bf16 panels: the FMA path).
extern "C" int jf_pack_pairs(const void* W, int wfmt, int64_t P, int64_t K, uint32_t* dst) {
#ifdef JF_DPBF16
  const int64_t K2 = (K + 1) / 2;
  if (wfmt == WF_BF16) {
    const uint16_t* w = (const uint16_t*)W;
    for (int64_t i = 0; i < P * K * NR; i++)
      if (!dp_exact_bf16((uint32_t)w[i] << 16)) return 2;
  }
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < P; p++) {
    if (wfmt == WF_E4M3)
      e4m3_panel_to_pairs((const uint8_t*)W + p * K * NR, K, dst + p * K2 * NR);
    else
      bf16_panel_to_pairs((const uint16_t*)W + p * K * NR, K, dst + p * K2 * NR);
  }
  return 0;
#else
  (void)W, (void)wfmt, (void)P, (void)K, (void)dst;
  return 1;
#endif
}
