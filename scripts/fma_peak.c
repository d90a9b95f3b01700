/* One core's peak rate of 8-lane fp32 fused multiply-adds (AVX2 + FMA), the bound of the streaming linear's
 * multi-row calls (docs/benchmarks.md, "AVX2-only hosts: the streaming linear"): twelve independent accumulators,
 * no loads, so nothing but the FMA ports and the clock limits it.
 *
 *     gcc -O3 -mavx2 -mfma scripts/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

int main(void) {
    __m256 acc[12];
    for (int i = 0; i < 12; i++) acc[i] = _mm256_set1_ps(1.0f + (float)i * 1e-7f);
    const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    const long n = 200000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long k = 0; k < n; k++)
        for (int i = 0; i < 12; i++) acc[i] = _mm256_fmadd_ps(acc[i], m, c);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    float sink = 0.f;
    for (int i = 0; i < 12; i++) sink += acc[i][0];
    printf("%.1f G multiply-adds/s on one core (%.2f s; %g)\n", (double)n * 12 * 8 / s / 1e9, s, sink);
    return 0;
}
