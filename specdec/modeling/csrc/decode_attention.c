/* Decode attention for a CPU batch: a few query rows per sequence against its slot of the KV cache.
 *
 * One call covers a whole layer: every sequence of the batch, every K/V head and the G query heads that share it
 * (GQA), every query row of the block. Query row s of sequence b sees the cache positions 0 .. vis[b, s] - 1 of its
 * slot (causal by position: a decode step, a verify block, a padded row of a batched step). Keys and values are
 * read in place (bf16 or fp32), widened to fp32 256 positions at a time into a per-thread work buffer kept across
 * calls; scores and softmax are fp32, the output is fp32. On AVX2 + FMA the score blocks and the probability x
 * value sums run as explicit 8-lane FMAs (the same operations the compiler makes of the portable loops).
 *
 * It replaces ~10 small torch ops per sequence and layer (specdec/modeling/attention.py), whose dispatch cost dominated a
 * batched decode step: specdec/modeling/native.py builds it with the host's C compiler on first use and falls back to the
 * torch path where there is none. Only libc and libm, no threads (the caller's process has one
 * intra-op thread per model server).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define POS_BLOCK 8   /* key positions whose scores one pass over a query computes */
#define POS_CHUNK 256 /* positions whose keys (values) are widened at a time: a multiple of POS_BLOCK */

static __thread float *work; /* a call's queries, keys and values widened to fp32, and its scores */
static __thread size_t work_floats;

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
    /* Per sequence: its keys, then its values, widened to fp32 a chunk of positions at a time (position-major,
       every K/V head of a position one contiguous read, so the cache streams through once), every query row
       against each chunk. A score is the dot
       of its query and key in 8-lane partial sums and a fixed sum of the lanes, computed for POS_BLOCK positions at
       once (independent accumulators, not one latency-bound chain per dot); a row's output sums probability x
       value over the positions in order, its accumulators held in registers across them. Every row's numbers are
       the same whatever the other rows of the call (row invariance). */
    const int G = H / KV, R = H * S; /* query rows of a sequence: r = h * S + s, read K/V head h / G */
    int64_t n_max = 1;
    for (int64_t i = 0; i < (int64_t)B * S; i++) n_max = vis[i] > n_max ? vis[i] : n_max;
    const int64_t n_pad = (n_max + POS_BLOCK - 1) / POS_BLOCK * POS_BLOCK;
    const size_t need = (size_t)R * D * 2 + (size_t)POS_CHUNK * KV * D + (size_t)R * n_pad;
    if (need > work_floats) { /* kept across calls: a fresh mapping per call cost more than the attention */
        free(work);
        work = aligned_alloc(64, (need * sizeof(float) + 63) / 64 * 64);
        work_floats = work ? need : 0;
        if (!work) return 1;
    }
    float *restrict qf = work, *restrict acc = qf + (size_t)R * D, *restrict kvf = acc + (size_t)R * D;
    float *restrict scores = kvf + (size_t)POS_CHUNK * KV * D;
    for (int b = 0; b < B; b++) {
        const int64_t slot = slots[b];
        const int64_t *row_vis = vis + (int64_t)b * S;
        int64_t n = 1;
        for (int s = 0; s < S; s++) n = row_vis[s] > n ? row_vis[s] : n;
        const int64_t np = (n + POS_BLOCK - 1) / POS_BLOCK * POS_BLOCK;
        for (int r = 0; r < R; r++) {
            float *qr = qf + (int64_t)r * D;
            load_row(q, b * qs_b + (r % S) * qs_s + (int64_t)(r / S) * qs_h, is_bf16, D, qr);
            for (int d = 0; d < D; d++) qr[d] *= scale;
        }
        /* scores, POS_CHUNK positions' keys widened at a time (the last block's padding zero) */
        for (int64_t c0 = 0; c0 < np; c0 += POS_CHUNK) {
            const int64_t c1 = np - c0 < POS_CHUNK ? np : c0 + POS_CHUNK, real = (n < c1 ? n : c1) - c0;
            for (int64_t j = 0; j < real; j++)
                for (int kh = 0; kh < KV; kh++)
                    load_row(k, slot * ks_slot + (c0 + j) * ks_pos + kh * ks_head, is_bf16, D, kvf + (j * KV + kh) * D);
            memset(kvf + real * KV * D, 0, sizeof(float) * (size_t)(c1 - c0 - real) * KV * D);
            for (int r = 0; r < R; r++) {
                const float *qr = qf + (int64_t)r * D;
                const int kh = r / S / G;
                float *sc = scores + (int64_t)r * np;
                for (int64_t j0 = c0; j0 < c1; j0 += POS_BLOCK) {
                    float part[POS_BLOCK][8];
#if defined(__AVX2__) && defined(__FMA__)
                    __m256 pv[POS_BLOCK];
                    for (int t = 0; t < POS_BLOCK; t++) pv[t] = _mm256_setzero_ps();
                    for (int d0 = 0; d0 + 8 <= D; d0 += 8) {
                        const __m256 qv = _mm256_loadu_ps(qr + d0);
                        for (int t = 0; t < POS_BLOCK; t++)
                            pv[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kvf + ((j0 - c0 + t) * KV + kh) * D + d0),
                                                    pv[t]);
                    }
                    for (int t = 0; t < POS_BLOCK; t++) _mm256_storeu_ps(part[t], pv[t]);
#else
                    for (int t = 0; t < POS_BLOCK; t++)
                        for (int l = 0; l < 8; l++) part[t][l] = 0.f;
                    for (int d0 = 0; d0 + 8 <= D; d0 += 8)
                        for (int t = 0; t < POS_BLOCK; t++) {
                            const float *kr = kvf + ((j0 - c0 + t) * KV + kh) * D + d0;
                            for (int l = 0; l < 8; l++) part[t][l] += qr[d0 + l] * kr[l];
                        }
#endif
                    for (int t = 0; t < POS_BLOCK; t++) {
                        const float *p = part[t], *kr = kvf + ((j0 - c0 + t) * KV + kh) * D;
                        float dot = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
                        for (int d = D / 8 * 8; d < D; d++) dot += qr[d] * kr[d];
                        sc[j0 + t] = dot;
                    }
                }
            }
        }
        for (int r = 0; r < R; r++) {
            float *sc = scores + (int64_t)r * np;
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
        }
        /* probability x value, summed over the positions in order: POS_CHUNK positions' values widened at a time,
           each row's sums carried in `acc` between chunks (exact: the same additions in the same order) */
        memset(acc, 0, sizeof(float) * (size_t)R * D);
        for (int64_t c0 = 0; c0 < n; c0 += POS_CHUNK) {
            const int64_t c1 = n - c0 < POS_CHUNK ? n : c0 + POS_CHUNK;
            for (int64_t j = c0; j < c1; j++)
                for (int kh = 0; kh < KV; kh++)
                    load_row(v, slot * vs_slot + j * vs_pos + kh * vs_head, is_bf16, D, kvf + ((j - c0) * KV + kh) * D);
            for (int r = 0; r < R; r++) {
                const float *sc = scores + (int64_t)r * np;
                const int64_t nv = row_vis[r % S] < n ? row_vis[r % S] : n, end = nv < c1 ? nv : c1;
                const int kh = r / S / G;
                float *ar = acc + (int64_t)r * D;
#if defined(__AVX2__) && defined(__FMA__)
                if (D % 64 == 0) { /* 64 dims at a time, their 8 accumulator vectors in registers across the chunk */
                    for (int d0 = 0; d0 < D; d0 += 64) {
                        __m256 av[8];
                        for (int c = 0; c < 8; c++) av[c] = _mm256_loadu_ps(ar + d0 + 8 * c);
                        for (int64_t j = c0; j < end; j++) {
                            const __m256 p = _mm256_broadcast_ss(sc + j);
                            const float *vr = kvf + ((j - c0) * KV + kh) * D + d0;
                            for (int c = 0; c < 8; c++) av[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), av[c]);
                        }
                        for (int c = 0; c < 8; c++) _mm256_storeu_ps(ar + d0 + 8 * c, av[c]);
                    }
                    continue;
                }
#endif
                for (int64_t j = c0; j < end; j++) {
                    const float p = sc[j], *vr = kvf + ((j - c0) * KV + kh) * D;
                    for (int d = 0; d < D; d++) ar[d] += p * vr[d];
                }
            }
        }
        for (int r = 0; r < R; r++)
            memcpy(out + (((int64_t)b * S + r % S) * H + r / S) * D, acc + (int64_t)r * D, sizeof(float) * (size_t)D);
    }
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
