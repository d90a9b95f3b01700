/* e^x in fp32 for the native kernels (specdec/modeling/csrc/*.c), on one lane (exp_f) and on eight (exp8, AVX2 + FMA).
 * Included by sources built with -ffp-contract=off: the FMAs are explicit. */
#ifndef SPECDEC_EXPF_H
#define SPECDEC_EXPF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x: the exponent's integer part by Cody-Waite reduction (ln 2 in two parts), then Cephes' degree-7 polynomial
 * for e^r on |r| <= ln2 / 2 (about 1 ulp), scaled by 2^n; +inf above 88.38, 0 below -87.34, NaN kept. exp_f and
 * exp8 are the same operations on one lane and on eight, so an element's result does not depend on where it falls. */
#define EXP_HI 88.3762626647949f /* 127.5 ln 2: n stays <= 127 */
#define EXP_LO -87.33654022216797f
#define EXP_LOG2E 1.44269502162933349609f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
static const float exp_poly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_f(float x) {
    if (x != x) return x;
    if (x > EXP_HI) return INFINITY;
    if (x < EXP_LO) return 0.f;
    const float n = nearbyintf(x * EXP_LOG2E);
    const float r = fmaf(-n, EXP_LN2_LO, fmaf(-n, EXP_LN2_HI, x));
    float p = exp_poly[0];
    for (int i = 1; i < 6; i++) p = fmaf(p, r, exp_poly[i]);
    const float e = fmaf(p, r * r, r) + 1.f;
    const uint32_t scale = (uint32_t)((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &scale, sizeof s);
    return e * s;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 exp8(__m256 x) {
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_setzero_ps(), n), _mm256_set1_ps(EXP_LN2_LO),
                                     _mm256_fmadd_ps(_mm256_sub_ps(_mm256_setzero_ps(), n),
                                                     _mm256_set1_ps(EXP_LN2_HI), xc));
    __m256 p = _mm256_set1_ps(exp_poly[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(exp_poly[i]));
    const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(e, _mm256_castsi256_ps(scale));
    y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, _mm256_set1_ps(EXP_HI), _CMP_GT_OQ));
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif

#endif
