/* A linear layer for a few rows that streams the weight from memory once per call: y[r, :] = x[r, :] @ W^T (+ b).
 *
 * A decode step (one row), a verify block (1 + drafted rows) or a small batch of sessions is bound by reading the
 * weights, so extra rows should ride along for free. Hosts without native bf16 GEMMs (AVX2-only CPUs: oneDNN runs no
 * bf16 there, and torch's fp32/bf16 GEMMs cost 2.9-4.6x one row for eight) get that from this kernel: for each
 * small block of output features, the block's weight rows are read once (from memory) and every row group of the
 * call is multiplied with them while they sit in L1.
 *
 * Numerics: weights bf16 (widened to fp32 in registers: a 16-bit shift) or fp32; activations bf16 or fp32,
 * widened into an fp32 scratch; accumulation fp32; the output bf16 (rounded to nearest even, once) or fp32. Row
 * invariance by construction: y[r, n] is always the same sequence of operations — 8 fp32 lanes of fused
 * multiply-adds over k in increasing blocks, a fixed horizontal-sum tree, the tail of k in order, then the bias —
 * however many rows the call has, however the rows and columns are blocked, and whichever thread computes it. So a
 * row's result is bitwise the same alone, in a verify block, or batched. This file is compiled without -ffast-math and
 * with -ffp-contract=off (specdec/native.py), so the compiler may not reassociate or contract any of it.
 *
 * bf16 weights: a 32-byte load holds 16 weights; as eight 32-bit lanes, lane j holds w[2j] (low half) and w[2j+1]
 * (high half). `lane << 16` is w[2j] as fp32 and `lane & 0xffff0000` is w[2j+1]: two cheap ALU ops, no shuffle. The
 * activations are laid out to match once per call (each 16-block: its 8 even elements, then its 8 odd ones).
 *
 * One thread: splitting the output features over OpenMP threads (torch's libgomp, torch's intra-op count) made every
 * call a parallel region whose end waits for all its threads, and on a 2-core host shared with other processes a
 * region waited for a scheduler time slice (one 3072 x 576 row: 0.11 ms on one thread, 12 ms median on two; `ar`
 * on two threads 2.3 tokens/s against 20 on one). A one-row step is bound by one core's memory bandwidth anyway.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define ROW_BLOCK 16 /* rows per pass over the weight; a longer call makes ceil(rows / 16) passes */
#define PANEL 48     /* output features per panel (divisible by every tile width below) */
/* Software prefetch into L2, PF_AHEAD tiles ahead: a tile's 1-12 weight rows are short streams (in_features
 * elements each) that the hardware prefetcher picks up too late (1 row, default target: ~40 -> ~30 ms a forward's
 * linears, the plain sequential read of the same bytes ~24 ms on the same host). */
#define PF_AHEAD 4
#define PF_HINT _MM_HINT_T1

/* The horizontal sum of 8 lanes, always the same tree: ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)), four
 * accumulators at a time (their sums land in the four lanes of one register: fewer shuffles per output). */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* One tile: RG rows x NB output features over the vector part of k. xs: the rows' scratch (row stride xs_stride
 * floats); w: the first weight row (stride w_stride elements). Leaves one 8-lane accumulator per (row, feature). */
static inline __attribute__((always_inline)) void tile_bf16(const int RG, const int NB, int64_t kblocks,
                                                            const float *xs, int64_t xs_stride, const uint16_t *w,
                                                            int64_t w_stride, const char *pf, __m256 acc[4][8]) {
    const __m256i hi_mask = _mm256_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 4
    for (int i = 0; i < RG; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kblocks; b++) {
        if (pf) /* a later tile's weights, NB * 32 bytes per step: in L2 by the time it starts */
#pragma GCC unroll 8
            for (int j = 0; j < NB; j += 2) _mm_prefetch(pf + (b * NB + j) * 32, PF_HINT);
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + j * w_stride + 16 * b));
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, hi_mask));
#pragma GCC unroll 4
            for (int i = 0; i < RG; i++) {
                const float *xr = xs + i * xs_stride + 16 * b;
                acc[i][j] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xr), acc[i][j]);
                acc[i][j] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xr + 8), acc[i][j]);
            }
        }
    }
}

static inline __attribute__((always_inline)) void tile_f32(const int RG, const int NB, int64_t kblocks,
                                                           const float *xs, int64_t xs_stride, const float *w,
                                                           int64_t w_stride, const char *pf, __m256 acc[4][8]) {
#pragma GCC unroll 4
    for (int i = 0; i < RG; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kblocks; b++) {
        if (pf)
#pragma GCC unroll 8
            for (int j = 0; j < NB; j += 2) _mm_prefetch(pf + (b * NB + j) * 32, PF_HINT);
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) {
            const __m256 wv = _mm256_loadu_ps(w + j * w_stride + 8 * b);
#pragma GCC unroll 4
            for (int i = 0; i < RG; i++)
                acc[i][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs + i * xs_stride + 8 * b), acc[i][j]);
        }
    }
}

typedef struct {
    int w_bf16, y_bf16;
    int64_t in_f, out_f, kvec; /* kvec: the k handled by the vector loop (a multiple of 16 for bf16, 8 for fp32) */
    const float *xs;           /* [rows][xs_stride] scratch: widened (and, for bf16 weights, interleaved) rows */
    int64_t xs_stride;
    const float *xt; /* [rows][in_f - kvec] the k tail, in order */
    const void *w, *bias;
    void *y;
} job_t;

/* Finish (row, feature) outputs: horizontal sum, the k tail in order, the bias, the store. WB, YB: bf16 weights,
 * bf16 output (compile-time constants). */
static inline __attribute__((always_inline)) void finish(const job_t *J, const int RG, const int NB, const int WB,
                                                         const int YB, int64_t r0, int64_t n0, __m256 acc[4][8]) {
    const int64_t tail = J->in_f - J->kvec;
#pragma GCC unroll 4
    for (int i = 0; i < RG; i++) {
        float sums[8];
#pragma GCC unroll 2
        for (int j = 0; j < NB; j += 4) { /* a short group repeats its last accumulator; those lanes are dropped */
            const __m256 a = acc[i][j], b = acc[i][j + 1 < NB ? j + 1 : j], c = acc[i][j + 2 < NB ? j + 2 : j],
                         d = acc[i][j + 3 < NB ? j + 3 : j];
            float q[4];
            _mm_storeu_ps(q, hsum4(a, b, c, d));
            for (int t = 0; t < 4 && j + t < NB; t++) sums[j + t] = q[t];
        }
#pragma GCC unroll 8
        for (int j = 0; j < NB; j++) {
            const int64_t n = n0 + j;
            float s = sums[j];
            if (tail) {
                const float *xt = J->xt + (r0 + i) * tail;
                if (WB) {
                    const uint16_t *wt = (const uint16_t *)J->w + n * J->in_f + J->kvec;
                    for (int64_t k = 0; k < tail; k++) s = fmaf(xt[k], bf16_to_f32(wt[k]), s);
                } else {
                    const float *wt = (const float *)J->w + n * J->in_f + J->kvec;
                    for (int64_t k = 0; k < tail; k++) s = fmaf(xt[k], wt[k], s);
                }
            }
            if (J->bias) s += WB ? bf16_to_f32(((const uint16_t *)J->bias)[n]) : ((const float *)J->bias)[n];
            if (YB)
                ((uint16_t *)J->y)[(r0 + i) * J->out_f + n] = f32_to_bf16(s);
            else
                ((float *)J->y)[(r0 + i) * J->out_f + n] = s;
        }
    }
}

/* RG rows x NB features from n0; with `prefetch`, the NB weight rows PF_AHEAD tiles on are fetched meanwhile (a
 * tile's weight rows are contiguous, so the whole matrix streams in order). */
static inline __attribute__((always_inline)) void run_tile_t(const job_t *J, const int RG, const int NB,
                                                             const int WB, const int YB, int64_t r0, int64_t n0,
                                                             int prefetch) {
    __m256 acc[4][8];
    const float *xs = J->xs + r0 * J->xs_stride;
    const int64_t esize = WB ? 2 : 4;
    const char *pf = prefetch && n0 + (PF_AHEAD + 1) * NB <= J->out_f
                         ? (const char *)J->w + (n0 + PF_AHEAD * NB) * J->in_f * esize
                         : NULL;
    if (WB)
        tile_bf16(RG, NB, J->kvec / 16, xs, J->xs_stride, (const uint16_t *)J->w + n0 * J->in_f, J->in_f, pf, acc);
    else
        tile_f32(RG, NB, J->kvec / 8, xs, J->xs_stride, (const float *)J->w + n0 * J->in_f, J->in_f, pf, acc);
    finish(J, RG, NB, WB, YB, r0, n0, acc);
}

#define run_tile(J, RG, NB, r0, n0, prefetch) run_tile_t(J, RG, NB, WB, YB, r0, n0, prefetch)

/* Features [n0, n1) for rows [r0, r1) (at most ROW_BLOCK): per tile-wide column block, every row group in turn,
 * so the block's weights come from memory once (prefetched during the block before) and from L1 for the other
 * groups. Tile widths keep the accumulators within the 16 ymm registers: 1 row x 8 features, 2 x 6, 3 x 4, 4 x 3;
 * the column tail runs 1 feature wide. */
static inline __attribute__((always_inline)) void panel_t(const job_t *J, const int WB, const int YB, int64_t r0,
                                                          int64_t r1, int64_t n0, int64_t n1) {
    const int64_t rows = r1 - r0;
    int64_t n = n0;
    if (rows == 1) {
        for (; n + 8 <= n1; n += 8) run_tile(J, 1, 8, r0, n, 1);
    } else if (rows == 2) {
        for (; n + 6 <= n1; n += 6) run_tile(J, 2, 6, r0, n, 1);
    } else if (rows == 3) {
        for (; n + 4 <= n1; n += 4) run_tile(J, 3, 4, r0, n, 1);
    } else {
        const int64_t r4 = r0 + rows / 4 * 4; /* 4-row groups 3 features wide, then a 1-3 row rest */
        for (; n + 12 <= n1; n += 12) {
            for (int64_t c = n; c < n + 12; c += 3)
                for (int64_t r = r0; r < r4; r += 4) run_tile(J, 4, 3, r, c, r == r0);
            switch (r1 - r4) {
            case 3: for (int64_t c = n; c < n + 12; c += 4) run_tile(J, 3, 4, r4, c, 0); break;
            case 2: for (int64_t c = n; c < n + 12; c += 6) run_tile(J, 2, 6, r4, c, 0); break;
            case 1: run_tile(J, 1, 8, r4, n, 0); run_tile(J, 1, 4, r4, n + 8, 0); break;
            }
        }
    }
    for (; n < n1; n++) {
        int64_t r = r0;
        for (; r + 4 <= r1; r += 4) run_tile(J, 4, 1, r, n, 0);
        switch (r1 - r) {
        case 3: run_tile(J, 3, 1, r, n, 0); break;
        case 2: run_tile(J, 2, 1, r, n, 0); break;
        case 1: run_tile(J, 1, 1, r, n, 0); break;
        }
    }
}

static void panel(const job_t *J, int64_t r0, int64_t r1, int64_t n0, int64_t n1) {
    if (J->w_bf16)
        J->y_bf16 ? panel_t(J, 1, 1, r0, r1, n0, n1) : panel_t(J, 1, 0, r0, r1, n0, n1);
    else
        J->y_bf16 ? panel_t(J, 0, 1, r0, r1, n0, n1) : panel_t(J, 0, 0, r0, r1, n0, n1);
}

static __thread float *scratch;
static __thread size_t scratch_floats;

/* x: [rows, in_f] (bf16 if x_bf16 else fp32), w: [out_f, in_f] (bf16 if w_bf16 else fp32), bias: [out_f] of the
 * weight's dtype or NULL, y: [rows, out_f] (bf16 if y_bf16 else fp32); all contiguous. Returns 0, or -1 where the
 * scratch could not be allocated. */
int specdec_stream_linear(int x_bf16, int w_bf16, int y_bf16, int64_t rows, int64_t in_f, int64_t out_f,
                          const void *x, const void *w, const void *bias, void *y) {
    const int64_t kvec = w_bf16 ? in_f / 16 * 16 : in_f / 8 * 8, tail = in_f - kvec;
    const int64_t xs_stride = kvec + 16; /* a little slack between rows */
    const size_t need = (size_t)(ROW_BLOCK * xs_stride + ROW_BLOCK * tail + 16);
    if (need > scratch_floats) {
        free(scratch);
        scratch = aligned_alloc(64, (need * sizeof(float) + 63) / 64 * 64);
        scratch_floats = scratch ? need : 0;
        if (!scratch) return -1;
    }
    for (int64_t rb = 0; rb < rows; rb += ROW_BLOCK) {
        const int64_t nr = rows - rb < ROW_BLOCK ? rows - rb : ROW_BLOCK;
        float *xs = scratch, *xt = scratch + ROW_BLOCK * xs_stride;
        for (int64_t i = 0; i < nr; i++) { /* widen (and interleave, for bf16 weights) the rows once per call */
            const int64_t row = rb + i;
            float *dst = xs + i * xs_stride;
            for (int64_t k = 0; k < in_f; k++) {
                const float v = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[row * in_f + k])
                                       : ((const float *)x)[row * in_f + k];
                if (k >= kvec)
                    xt[i * tail + (k - kvec)] = v;
                else if (w_bf16)
                    dst[(k & ~(int64_t)15) + ((k & 1) ? 8 : 0) + ((k & 15) >> 1)] = v;
                else
                    dst[k] = v;
            }
        }
        job_t J = {w_bf16, y_bf16, in_f, out_f, kvec, xs, xs_stride, xt, w, bias,
                   y_bf16 ? (void *)((uint16_t *)y + rb * out_f) : (void *)((float *)y + rb * out_f)};
        for (int64_t n0 = 0; n0 < out_f; n0 += PANEL) panel(&J, 0, nr, n0, n0 + PANEL < out_f ? n0 + PANEL : out_f);
    }
    return 0;
}

int specdec_stream_linear_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

#else /* a build for a CPU without AVX2 + FMA: no kernel (specdec.native.stream_linear_supported is False) */

int specdec_stream_linear(int x_bf16, int w_bf16, int y_bf16, int64_t rows, int64_t in_f, int64_t out_f,
                          const void *x, const void *w, const void *bias, void *y) {
    return -2;
}

int specdec_stream_linear_supported(void) { return 0; }

#endif
