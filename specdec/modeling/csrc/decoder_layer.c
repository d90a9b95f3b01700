/* One Llama-family decoder layer for a decode step or a verify block, in one call: the layer's linears on the
 * streaming kernel (stream_linear.c), its RMSNorms (rms_norm.c), RoPE, the KV-cache write, the decode attention
 * (decode_attention.c), SiLU x up and both residual adds.
 *
 * Why: a one-row step of the default target spends ~25 ms in its linears and ~15 ms between them in ~25 small torch
 * ops per layer and their Python dispatch (views, slices, the RoPE's roll, the cache write, the activation, the
 * adds). On hosts where every linear of the layer runs on the streaming kernel (AVX2-only CPUs) that glue is all
 * that stands between a step and its memory-bandwidth bound; `specdec.modeling.model.CausalLM.forward` hands it the layers
 * then (docs/benchmarks.md, "AVX2-only hosts").
 *
 * Numerics: the same operations in the same order as the torch path (specdec/modeling/model.py), each rounded where torch
 * rounds it to the model's dtype: RoPE as round(round(x * cos) + round(roll(x) * sin_signed)) (sin carries
 * rotate_half's sign), the attention's fp32 output rounded once, silu(gate) rounded, then its product with up, and
 * the residual adds rounded. The products of two bf16 values are exact in fp32, so the RoPE, the adds and the
 * products are bitwise those of the torch path; SiLU uses its own exp (expf.h, about 1 ulp) where ATen uses
 * Sleef's, so an activation may differ from the torch path's by one rounding of the model's dtype. The elementwise
 * steps run 8 elements at a time on AVX2 (the same operations as one at a time, so the same bits). Every operation
 * is per row: a row's result is bitwise the same alone or in a block (row invariance by construction, as the
 * streaming linear's).
 * Compiled without -ffast-math and with -ffp-contract=off (specdec/modeling/native.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "expf.h"

int specdec_stream_linear(int x_bf16, int w_bf16, int y_bf16, int64_t rows, int64_t in_f, int64_t out_f,
                          const void *x, const void *w, const void *bias, void *y);
void specdec_rms_norm(int is_bf16, int64_t rows, int64_t dim, const void *x, const void *residual, void *sum_out,
                      const void *weight, float eps, void *out);
int specdec_decode_attention(int is_bf16, int B, int S, int H, int KV, int D,
                             const void *q, int64_t qs_b, int64_t qs_s, int64_t qs_h,
                             const void *k, int64_t ks_slot, int64_t ks_pos, int64_t ks_head,
                             const void *v, int64_t vs_slot, int64_t vs_pos, int64_t vs_head,
                             const int64_t *slots, const int64_t *vis, float scale, float *out);

static inline float ld(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* f rounded to the model's dtype, as a float (what torch holds after an op on bf16 tensors) */
static inline float rnd(float f, int bf16) { return bf16 ? bf16_rounded(f) : f; }

static inline void st(void *p, int64_t i, int bf16, float f) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(f);
    else
        ((float *)p)[i] = f;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 8 elements from i, as fp32; stored rounded to the model's dtype; f rounded to it and back (rnd on 8 lanes) */
static inline __m256 ld8(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16x8_to_f32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}
static inline void st8(void *p, int64_t i, int bf16, __m256 f) {
    if (bf16)
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), f32x8_to_bf16(f));
    else
        _mm256_storeu_ps((float *)p + i, f);
}
static inline __m256 rnd8(__m256 f, int bf16) {
    return bf16 ? bf16x8_to_f32(f32x8_to_bf16(f)) : f;
}
#define VEC 8 /* elements the loops below take at a time; the rest (past the last multiple of 8) one at a time */
#else
#define VEC 0
#endif

/* RoPE in place on `heads` heads of hd elements starting at row, with this row's cos / signed sin. */
static void rope_row(void *row, int heads, int hd, const void *cos, const void *sin, int64_t cs_off, int bf16,
                     float *tmp) {
    const int half = hd / 2;
    for (int h = 0; h < heads; h++) {
        const int64_t o = (int64_t)h * hd;
        for (int d = 0; d < hd; d++) tmp[d] = ld(row, o + d, bf16);
        int d = 0;
#if VEC
        if (half % VEC == 0) /* a vector never straddles the halves */
            for (; d < hd; d += VEC) {
                const __m256 a = rnd8(_mm256_mul_ps(_mm256_loadu_ps(tmp + d), ld8(cos, cs_off + d, bf16)), bf16);
                const __m256 b = rnd8(_mm256_mul_ps(_mm256_loadu_ps(tmp + (d < half ? d + half : d - half)),
                                                    ld8(sin, cs_off + d, bf16)), bf16);
                st8(row, o + d, bf16, _mm256_add_ps(a, b));
            }
#endif
        for (; d < hd; d++) {
            const float a = rnd(tmp[d] * ld(cos, cs_off + d, bf16), bf16);
            const float b = rnd(tmp[d < half ? d + half : d - half] * ld(sin, cs_off + d, bf16), bf16);
            st(row, o + d, bf16, a + b);
        }
    }
}

/* y[i] = silu(g[i]) rounded, times u[i], for i < n (one row of SiLU x up) */
static void silu_mul(const void *g, const void *u, void *y, int64_t n, int bf16) {
    int64_t i = 0;
#if VEC
    for (; i + VEC <= n; i += VEC) {
        const __m256 gv = ld8(g, i, bf16);
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f),
                                                         exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        st8(y, i, bf16, _mm256_mul_ps(rnd8(s, bf16), ld8(u, i, bf16)));
    }
#endif
    for (; i < n; i++) {
        const float gi = ld(g, i, bf16);
        st(y, i, bf16, rnd(gi / (1.0f + exp_f(-gi)), bf16) * ld(u, i, bf16));
    }
}

/* y[i] = e^x[i] for i < n, fp32, as SiLU computes it (8 at a time, then one at a time): what the tests check
 * expf.h against. */
void specdec_exp(const float *x, float *y, int64_t n) {
    int64_t i = 0;
#if VEC
    for (; i + VEC <= n; i += VEC) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
#endif
    for (; i < n; i++) y[i] = exp_f(x[i]);
}

/* y[i] = a[i] + b[i] (b NULL: a[i]) in the model's dtype, a fp32 when a32 */
static void add_rows(const void *a, int a32, const void *b, void *y, int64_t n, int bf16) {
    int64_t i = 0;
#if VEC
    for (; i + VEC <= n; i += VEC) {
        const __m256 av = a32 ? _mm256_loadu_ps((const float *)a + i) : ld8(a, i, bf16);
        st8(y, i, bf16, b ? _mm256_add_ps(av, ld8(b, i, bf16)) : av);
    }
#endif
    for (; i < n; i++) {
        const float ai = a32 ? ((const float *)a)[i] : ld(a, i, bf16);
        st(y, i, bf16, b ? ai + ld(b, i, bf16) : ai);
    }
}

/* x:        [B * S, D] of the model's dtype (bf16 if bf16, else fp32), the residual stream; overwritten with the
 *           layer's output
 * weights:  of the same dtype, the fused layouts of specdec/modeling/fusion.py, each as specdec_stream_pack lays it out
 *           (stream_linear.c): w_qkv [(H + 2 KV) hd, D] (bias b_qkv [(H + 2 KV) hd] or NULL), w_o [D, H hd],
 *           w_gate_up [2 I, D] (gate rows first), w_down [D, I]; ln1, ln2 [D]
 * cos, sin: [B * S, hd] of the model's dtype, each row's position (sin with rotate_half's sign folded in)
 * k, v:     the layer's caches [slots, max_len, KV, hd] with element strides; each row's k and v are written at
 *           (slots[b], vis[b, s] - 1)
 * slots:    [B] int64; vis: [B, S] int64, keys visible to each row (its position + 1)
 * Returns 0, or nonzero where a work buffer could not be allocated (x is then unspecified). */
int specdec_decoder_layer(int bf16, int B, int S, int D, int H, int KV, int hd, int64_t I, float eps, float scale,
                          void *x, const void *ln1, const void *ln2, const void *w_qkv, const void *b_qkv,
                          const void *w_o, const void *w_gate_up, const void *w_down,
                          const void *cos, const void *sin,
                          void *k, int64_t ks_slot, int64_t ks_pos, int64_t ks_head,
                          void *v, int64_t vs_slot, int64_t vs_pos, int64_t vs_head,
                          const int64_t *slots, const int64_t *vis) {
    const int64_t R = (int64_t)B * S, QKV = (int64_t)(H + 2 * KV) * hd, A = (int64_t)H * hd;
    const size_t es = bf16 ? 2 : 4;
    /* h / x2 / o / m: [R, D] each; qkv: [R, QKV]; att: [R, A] fp32 and in the model's dtype; gu: [R, 2I] */
    char *buf = malloc((size_t)R * ((4 * (size_t)D + (size_t)QKV + (size_t)A + 3 * (size_t)I) * es
                                    + (size_t)A * sizeof(float)) + (size_t)hd * sizeof(float) + 64);
    if (!buf) return 1;
    char *p = buf;
    void *h = p; p += (size_t)R * D * es;
    void *x2 = p; p += (size_t)R * D * es;
    void *o = p; p += (size_t)R * D * es;
    void *m = p; p += (size_t)R * D * es;
    void *qkv = p; p += (size_t)R * QKV * es;
    void *att = p; p += (size_t)R * A * es;
    void *gu = p; p += (size_t)R * 2 * I * es;
    void *act = p; p += (size_t)R * I * es;
    float *att32 = (float *)(((uintptr_t)p + 15) & ~(uintptr_t)15); p = (char *)(att32 + R * A);
    float *tmp = (float *)(((uintptr_t)p + 15) & ~(uintptr_t)15);
    int rc = 0;

    specdec_rms_norm(bf16, R, D, x, NULL, NULL, ln1, eps, h);
    if ((rc = specdec_stream_linear(bf16, bf16, bf16, R, D, QKV, h, w_qkv, b_qkv, qkv))) goto done;
    for (int b = 0; b < B; b++) {
        for (int s = 0; s < S; s++) {
            const int64_t r = (int64_t)b * S + s, pos = vis[r] - 1;
            char *row = (char *)qkv + (size_t)r * QKV * es;
            rope_row(row, H + KV, hd, cos, sin, r * hd, bf16, tmp); /* q and k heads, as the torch path */
            char *kr = (char *)k + (size_t)(slots[b] * ks_slot + pos * ks_pos) * es;
            char *vr = (char *)v + (size_t)(slots[b] * vs_slot + pos * vs_pos) * es;
            for (int j = 0; j < KV; j++) {
                memcpy(kr + (size_t)j * ks_head * es, row + (size_t)(H + j) * hd * es, (size_t)hd * es);
                memcpy(vr + (size_t)j * vs_head * es, row + (size_t)(H + KV + j) * hd * es, (size_t)hd * es);
            }
        }
    }
    if ((rc = specdec_decode_attention(bf16, B, S, H, KV, hd, qkv, (int64_t)S * QKV, QKV, hd, k, ks_slot, ks_pos,
                                       ks_head, v, vs_slot, vs_pos, vs_head, slots, vis, scale, att32)))
        goto done;
    add_rows(att32, 1, NULL, att, R * A, bf16);
    if ((rc = specdec_stream_linear(bf16, bf16, bf16, R, A, D, att, w_o, NULL, o))) goto done;
    specdec_rms_norm(bf16, R, D, x, o, x2, ln2, eps, h); /* x2 = x + o; h = norm(x2) */
    if ((rc = specdec_stream_linear(bf16, bf16, bf16, R, D, 2 * I, h, w_gate_up, NULL, gu))) goto done;
    for (int64_t r = 0; r < R; r++)
        silu_mul((char *)gu + (size_t)(r * 2 * I) * es, (char *)gu + (size_t)(r * 2 * I + I) * es,
                 (char *)act + (size_t)(r * I) * es, I, bf16);
    if ((rc = specdec_stream_linear(bf16, bf16, bf16, R, I, D, act, w_down, NULL, m))) goto done;
    add_rows(x2, 0, m, x, R * D, bf16);
done:
    free(buf);
    return rc;
}
