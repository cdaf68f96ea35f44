// The compute roofs of the exact kernels' inner instructions on this CPU, per thread and with every
// thread at once: AVX512_BF16's vdpbf16ps (the FP8 / bf16 GEMM: 32 multiply-adds a zmm instruction) and
// AVX-512 FMA (the fp32 GEMM: 16), 12 independent accumulators each (enough to hide the latency).
//   gcc -O3 -funroll-all-loops -march=native -fopenmp roofline.c -o /tmp/roofline && /tmp/roofline
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

#define STEPS 20000000L

static double dp_rate(void) {  // vdpbf16ps instructions per second on this thread
  __m512 acc[12];
  for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = a;
  double t = omp_get_wtime();
  for (long s = 0; s < STEPS; s++) {
    for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __asm__ volatile("" : "+v"(a));
  }
  t = omp_get_wtime() - t;
  float sum = 0;
  for (int i = 0; i < 12; i++) sum += _mm512_reduce_add_ps(acc[i]);
  if (sum == 1.0f) printf(" ");
  return 12.0 * STEPS / t;
}

static double fma_rate(void) {  // vfmadd231ps zmm instructions per second on this thread
  __m512 acc[12];
  for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_ps();
  __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.999f);
  double t = omp_get_wtime();
  for (long s = 0; s < STEPS; s++) {
    for (int i = 0; i < 12; i++) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
    __asm__ volatile("" : "+v"(a));
  }
  t = omp_get_wtime() - t;
  float sum = 0;
  for (int i = 0; i < 12; i++) sum += _mm512_reduce_add_ps(acc[i]);
  if (sum == 1.0f) printf(" ");
  return 12.0 * STEPS / t;
}

int main(void) {
  printf("one thread: vdpbf16ps %.2f G/s (%.0f G multiply-adds/s), FMA %.2f G/s (%.0f G multiply-adds/s)\n",
         dp_rate() / 1e9, 32 * dp_rate() / 1e9, fma_rate() / 1e9, 16 * fma_rate() / 1e9);
  double dp = 0, fma = 0;
#pragma omp parallel reduction(+ : dp)
  dp += dp_rate();
#pragma omp parallel reduction(+ : fma)
  fma += fma_rate();
  printf("%d threads: vdpbf16ps %.0f G multiply-adds/s, FMA %.0f G multiply-adds/s\n", omp_get_max_threads(),
         32 * dp / 1e9, 16 * fma / 1e9);
  return 0;
}
