/* Decode attention for a CPU batch: a few query rows per sequence against its slot of the KV cache.
 *
 * One call covers a whole layer: every sequence of the batch, every K/V head and the G query heads that share it
 * (GQA), every query row of the block. Query row s of sequence b sees the cache positions 0 .. vis[b, s] - 1 of its
 * slot (causal by position: a decode step, a verify block, a padded row of a batched step). Keys and values are
 * read in place (bf16 or fp32, converted per row), scores and softmax are fp32, the output is fp32.
 *
 * It replaces ~10 small torch ops per sequence and layer (specdec/attention.py), whose dispatch cost dominated a
 * batched decode step: specdec/native.py builds it with the host's C compiler on first use and falls back to the
 * torch path where there is none. Only libc and libm, no threads (the caller's process has one
 * intra-op thread per model server).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

static inline void load_row(const void *base, int64_t offset, int is_bf16, int D, float *dst) {
    if (is_bf16) {
        const uint16_t *p = (const uint16_t *)base + offset;
        for (int d = 0; d < D; d++) dst[d] = bf16_to_f32(p[d]);
    } else {
        memcpy(dst, (const float *)base + offset, sizeof(float) * (size_t)D);
    }
}

/* q:      [B, S, H, D], element strides qs_b, qs_s, qs_h (D contiguous)
 * k, v:   [slots, max_len, KV, D] caches, element strides *_slot, *_pos, *_head (D contiguous)
 * slots:  [B] int64, the cache slot of each sequence
 * vis:    [B, S] int64, keys visible to each query row (>= 1)
 * out:    [B, S, H, D] fp32, contiguous
 * Returns 0, or 1 if a work buffer could not be allocated. */
static inline __attribute__((always_inline)) int attend(
        int is_bf16, int B, int S, int H, int KV, const int D,
        const void *q, int64_t qs_b, int64_t qs_s, int64_t qs_h,
        const void *k, int64_t ks_slot, int64_t ks_pos, int64_t ks_head,
        const void *v, int64_t vs_slot, int64_t vs_pos, int64_t vs_head,
        const int64_t *slots, const int64_t *vis, float scale, float *out) {
    /* Positions outer: one position's keys (values) of every K/V head are one contiguous read, so the cache
       streams through once per sequence (a K/V head at a time read 1/KV of each span per pass: 1.4× slower
       on the default target at 8 sessions, where the kernel runs at the host's memory bandwidth). */
    const int G = H / KV, R = H * S; /* query rows of a sequence: r = h * S + s, read K/V head h / G */
    int64_t n_max = 1;
    for (int64_t i = 0; i < (int64_t)B * S; i++) n_max = vis[i] > n_max ? vis[i] : n_max;
    float *restrict qf = malloc(sizeof(float) * (size_t)R * D);
    float *restrict acc = malloc(sizeof(float) * (size_t)R * D);
    float *restrict kv_row = malloc(sizeof(float) * (size_t)KV * D);
    float *restrict scores = malloc(sizeof(float) * (size_t)R * n_max);
    if (!qf || !acc || !kv_row || !scores) {
        free(qf); free(acc); free(kv_row); free(scores);
        return 1;
    }
    for (int b = 0; b < B; b++) {
        const int64_t slot = slots[b];
        const int64_t *row_vis = vis + (int64_t)b * S;
        int64_t n = 1;
        for (int s = 0; s < S; s++) n = row_vis[s] > n ? row_vis[s] : n;
        for (int r = 0; r < R; r++) {
            float *qr = qf + (int64_t)r * D;
            load_row(q, b * qs_b + (r % S) * qs_s + (int64_t)(r / S) * qs_h, is_bf16, D, qr);
            for (int d = 0; d < D; d++) qr[d] *= scale;
        }
        for (int64_t j = 0; j < n; j++) {
            const int64_t base = slot * ks_slot + j * ks_pos;
            for (int kh = 0; kh < KV; kh++) load_row(k, base + kh * ks_head, is_bf16, D, kv_row + kh * D);
            for (int r = 0; r < R; r++) {
                const float *qr = qf + (int64_t)r * D, *kr = kv_row + (r / S / G) * D;
                float dot = 0.f;
                for (int d = 0; d < D; d++) dot += qr[d] * kr[d];
                scores[r * n + j] = dot;
            }
        }
        for (int r = 0; r < R; r++) {
            float *sc = scores + r * n;
            const int64_t nv = row_vis[r % S] < n ? row_vis[r % S] : n;
            float m = sc[0], total = 0.f;
            for (int64_t j = 1; j < nv; j++) m = sc[j] > m ? sc[j] : m;
            for (int64_t j = 0; j < nv; j++) {
                const float x = sc[j] - m;
                sc[j] = expf(x > -80.f ? x : -80.f);
                total += sc[j];
            }
            const float inv = 1.f / total;
            for (int64_t j = 0; j < nv; j++) sc[j] *= inv;
            for (int64_t j = nv; j < n; j++) sc[j] = 0.f;
        }
        memset(acc, 0, sizeof(float) * (size_t)R * D);
        for (int64_t j = 0; j < n; j++) {
            const int64_t base = slot * vs_slot + j * vs_pos;
            for (int kh = 0; kh < KV; kh++) load_row(v, base + kh * vs_head, is_bf16, D, kv_row + kh * D);
            for (int r = 0; r < R; r++) {
                const float p = scores[r * n + j], *vr = kv_row + (r / S / G) * D;
                float *ar = acc + (int64_t)r * D;
                for (int d = 0; d < D; d++) ar[d] += p * vr[d];
            }
        }
        for (int r = 0; r < R; r++)
            memcpy(out + (((int64_t)b * S + r % S) * H + r / S) * D, acc + (int64_t)r * D, sizeof(float) * (size_t)D);
    }
    free(qf); free(acc); free(kv_row); free(scores);
    return 0;
}

/* The kernel, specialised for the common head dims so their loops unroll into whole vectors. */
int specdec_decode_attention(int is_bf16, int B, int S, int H, int KV, int D,
                             const void *q, int64_t qs_b, int64_t qs_s, int64_t qs_h,
                             const void *k, int64_t ks_slot, int64_t ks_pos, int64_t ks_head,
                             const void *v, int64_t vs_slot, int64_t vs_pos, int64_t vs_head,
                             const int64_t *slots, const int64_t *vis, float scale, float *out) {
#define ATTEND(DIM) attend(is_bf16, B, S, H, KV, DIM, q, qs_b, qs_s, qs_h, k, ks_slot, ks_pos, ks_head, \
                           v, vs_slot, vs_pos, vs_head, slots, vis, scale, out)
    switch (D) {
    case 64: return ATTEND(64);
    case 128: return ATTEND(128);
    default: return ATTEND(D);
    }
#undef ATTEND
}
