/* RMSNorm of a batch of rows, optionally after the residual add that precedes it, with Hugging Face Llama's
 * rounding: in bf16, h = bf16(x + residual); y = bf16(h * rsqrt(mean(h^2) + eps)); out = bf16(weight * y), every
 * product and sum in fp32 (what torch computes for the same bf16 ops, up to the order of the mean's sum). In fp32
 * nothing is rounded. One call replaces the ~7 small torch ops of a norm (and the add), whose dispatch cost ~20 us
 * a norm: 61 norms a forward on the default target (specdec/modeling/native.py builds it beside decode_attention.c).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

static inline float bf16_load(const uint16_t *p, int64_t i) { return bf16_to_f32(p[i]); }

/* x, residual, sum_out, out: [rows, dim] contiguous, weight: [dim]; residual and sum_out may be NULL (no add).
 * With a residual, sum_out receives x + residual (the next residual stream). */
void specdec_rms_norm(int is_bf16, int64_t rows, int64_t dim, const void *x, const void *residual, void *sum_out,
                      const void *weight, float eps, void *out) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t o = r * dim;
        float ss = 0.f;
        if (is_bf16) {
            const uint16_t *xr = (const uint16_t *)x + o, *rr = residual ? (const uint16_t *)residual + o : NULL;
            uint16_t *sr = sum_out ? (uint16_t *)sum_out + o : NULL, *yr = (uint16_t *)out + o;
            const uint16_t *w = (const uint16_t *)weight;
            for (int64_t d = 0; d < dim; d++) {
                float h = bf16_load(xr, d);
                if (rr) {
                    h = bf16_rounded(h + bf16_load(rr, d));
                    sr[d] = f32_to_bf16(h);
                }
                ss += h * h;
            }
            const float inv = (float)(1.0 / sqrt((double)(ss / (float)dim + eps))); /* exact: no rsqrt estimate */
            const uint16_t *hr = rr ? sr : xr;
            for (int64_t d = 0; d < dim; d++)
                yr[d] = f32_to_bf16(bf16_load(w, d) * bf16_rounded(bf16_load(hr, d) * inv));
        } else {
            const float *xr = (const float *)x + o, *rr = residual ? (const float *)residual + o : NULL;
            float *sr = sum_out ? (float *)sum_out + o : NULL, *yr = (float *)out + o;
            const float *w = (const float *)weight;
            for (int64_t d = 0; d < dim; d++) {
                float h = xr[d];
                if (rr) {
                    h += rr[d];
                    sr[d] = h;
                }
                ss += h * h;
            }
            const float inv = (float)(1.0 / sqrt((double)(ss / (float)dim + eps)));
            const float *hr = rr ? sr : xr;
            for (int64_t d = 0; d < dim; d++) yr[d] = w[d] * (hr[d] * inv);
        }
    }
}
