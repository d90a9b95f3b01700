/* A linear layer for a few rows that streams the weight from memory once per call: y[r, :] = x[r, :] @ W^T (+ b).
 *
 * A decode step (one row), a verify block (1 + drafted rows) or a small batch of sessions is bound by reading the
 * weights, so extra rows should ride along for free. Hosts without native bf16 GEMMs (AVX2-only CPUs: oneDNN runs no
 * bf16 there, and torch's fp32/bf16 GEMMs cost 2.9-4.6x one row for eight) get that from this kernel.
 *
 * Layout (`specdec_stream_pack`, once per weight; `specdec.modeling.linear.Linear` keeps the packed copy): the output
 * features in panels of 16, each panel k-major: packed[p][k][0..15] = W[16 p + (0..15)][k], zero past out_f. A
 * panel is one contiguous stream of 32 (bf16) or 64 (fp32) bytes per k. Within a bf16 panel's 16 values the order
 * is f0-3, f8-11, f4-7, f12-15: `unpacklo(0, raw)` then gives features 0-7 and `unpackhi(0, raw)` 8-15, each
 * already fp32 (a bf16 is the high half of its fp32): one shuffle per 8 weights, on a port the FMAs do not use.
 *
 * Arithmetic: an outer product per k, as a GEMM micro-kernel does. A tile of RG rows x NV vectors of 8 features
 * keeps RG * NV accumulators in registers (8-12 of the 16: enough independent chains to cover the FMA latency);
 * per k it loads its weights once and broadcasts each row's x[r][k] (each row group's x is laid out k-major, so the
 * broadcasts sit at fixed offsets from one pointer).
 * - 1-3 rows: the tiles of a block of panels, 1 x 8 vectors over 4 panels, 2 x 6 over 3, or 3 x 4 over 2: they
 *   read 2-4 panels side by side, streams the hardware prefetcher keeps ahead of.
 * - 4 and more rows: the rows in groups of 3-6. Groups of 5-6 take one panel per block, each group's tile 2
 *   vectors wide; where a group has 3-4 rows, a block is 3 panels and each group takes two tiles 3 vectors wide
 *   (the second from the middle panel's second half), so it still keeps 9-12 accumulators. The first group reads
 *   the block from memory and the others from cache, while every tile prefetches its share of the next block into
 *   L2, so memory keeps streaming while the later groups compute.
 * The k step of the tiles of 3 and more rows is inline assembly (panel_k, tile3v_k, tile34_k): the same FMAs in the
 * same order as the C of tile_k, with the registers placed by hand. From C, GCC spilled accumulators inside the k
 * loop of tiles that use all 16 registers (6 x 2 with the weights in L2: 80 % of the FMA peak, 92 % in assembly).
 * Every tile also prefetches its own panels PF_DIST k ahead into L1: the hardware prefetcher alone leaves the loads
 * of a few-row call waiting on memory, and the waits add to the FMAs instead of hiding them (default target's
 * shapes, emulated AVX2: 3 rows 30 -> 26 ms, 1 row 21 -> 19.5; a one-panel tile of 4 rows, 128 k ahead: 8 % less).
 * What bounds it (docs/benchmarks.md, "The kernel's layout and tiles"): one row streams at the core's memory
 * bandwidth; with the weights in L2 calls of 3-16 rows reach 80-92 % of the core's FMA peak; from memory, the
 * later groups' prefetches overlap the next panel's reads only in part (software prefetches wait on the core's
 * few line fill buffers; prefetching every other line, or interleaving chunks of k across panels, measured slower).
 *
 * Numerics: weights bf16 (exact in fp32) or fp32; activations bf16 or fp32, widened to fp32; y[r][n] is the fp32
 * chain acc = fma(x[r][k], W[n][k], acc) over k = 0, 1, ..., in order from acc = 0, then + bias, then (bf16 output)
 * one rounding to nearest even. That is the same sequence of operations whatever the row count of the call, the
 * tile or group a row falls in, or the thread: row invariance by construction, so a row's result is bitwise the same
 * alone, in a verify block or batched. This file is compiled without -ffast-math and with -ffp-contract=off
 * (specdec/modeling/native.py), so the compiler may not reassociate or contract any of it.
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

#define PANEL 16 /* output features per packed panel */

/* The packed weight's element count (a multiple of PANEL * in_f). */
int64_t specdec_stream_packed_size(int64_t in_f, int64_t out_f) { return (out_f + PANEL - 1) / PANEL * PANEL * in_f; }

/* w: [out_f, in_f] contiguous, bf16 if w_bf16 else fp32 → packed: specdec_stream_packed_size elements, same dtype. */
void specdec_stream_pack(int w_bf16, int64_t in_f, int64_t out_f, const void *w, void *packed) {
    static const int bf16_order[PANEL] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    const int64_t panels = (out_f + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < in_f; k++)
            for (int t = 0; t < PANEL; t++) { /* written in order, read from 16 weight rows */
                const int64_t n = p * PANEL + (w_bf16 ? bf16_order[t] : t), at = (p * in_f + k) * PANEL + t;
                if (w_bf16)
                    ((uint16_t *)packed)[at] = n < out_f ? ((const uint16_t *)w)[n * in_f + k] : 0;
                else
                    ((float *)packed)[at] = n < out_f ? ((const float *)w)[n * in_f + k] : 0.f;
            }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define ROW_BLOCK 48 /* rows per pass over the weight (their fp32 x stays in L2); a longer call makes more passes */
#define GROUP 6      /* most rows per tile (6 x 2 vectors: 12 accumulators) */
#define KSTEP 8      /* k per unrolled step of a tile */
/* k ahead a tile prefetches its own panels: further for a one-panel tile of a few rows (a single stream, nearly all
 * of its time waiting on memory) */
#define PF_DIST(RG, NV) ((NV) <= 2 && (RG) <= 4 ? 128 : 32)
#define PF_MIN_ROWS 4 /* calls of this many rows also prefetch the next block (later row groups read from cache) */

typedef struct {
    int64_t in_f, out_f, panels;
    const float *x;       /* this row block's rows as fp32, each row group k-major: see specdec_stream_linear */
    const void *w, *bias; /* packed weight; bias [out_f] of the weight's dtype or NULL */
    void *y;              /* this row block's output rows, row stride out_f */
} job_t;

/* 8 outputs of one row: acc (+ bias), stored at feature n (fewer where the panel's padding starts). */
static inline __attribute__((always_inline)) void store8(const job_t *J, const int WB, const int YB, int64_t row,
                                                         int64_t n, __m256 acc) {
    const int64_t valid = J->out_f - n < 8 ? J->out_f - n : 8;
    if (valid <= 0) return;
    if (J->bias) {
        __m256 b;
        if (valid == 8)
            b = WB ? bf16x8_to_f32(_mm_loadu_si128((const __m128i *)((const uint16_t *)J->bias + n)))
                   : _mm256_loadu_ps((const float *)J->bias + n);
        else {
            float t[8] = {0};
            for (int64_t i = 0; i < valid; i++)
                t[i] = WB ? bf16_to_f32(((const uint16_t *)J->bias)[n + i]) : ((const float *)J->bias)[n + i];
            b = _mm256_loadu_ps(t);
        }
        acc = _mm256_add_ps(acc, b);
    }
    if (YB) {
        const __m128i h16 = f32x8_to_bf16(acc);
        uint16_t *dst = (uint16_t *)J->y + row * J->out_f + n;
        if (valid == 8)
            _mm_storeu_si128((__m128i *)dst, h16);
        else {
            uint16_t t[8];
            _mm_storeu_si128((__m128i *)t, h16);
            memcpy(dst, t, (size_t)valid * sizeof *dst);
        }
    } else {
        float *dst = (float *)J->y + row * J->out_f + n;
        if (valid == 8)
            _mm256_storeu_ps(dst, acc);
        else {
            float t[8];
            _mm256_storeu_ps(t, acc);
            memcpy(dst, t, (size_t)valid * sizeof *dst);
        }
    }
}

/* Weight vector j of a tile (features 8 (v + j) .. + 7) at k, as fp32: for bf16, a panel's 32 bytes are loaded
 * (into *raw) with its first half's vector and unpacked for each half. */
static inline __attribute__((always_inline)) __m256 wvec(const int WB, const int ODD, const int j, const uint16_t *wb,
                                                         const float *wf, int64_t pstride, int64_t k, __m256i zero,
                                                         __m256i *raw) {
    const int q = (ODD + j) >> 1, half = (ODD + j) & 1; /* panel (from the tile's first) and half of vector j */
    if (!WB) return _mm256_loadu_ps(wf + q * pstride + k * PANEL + 8 * half);
    if (j == 0 || half == 0) *raw = _mm256_loadu_si256((const __m256i *)(wb + q * pstride + k * PANEL));
    return _mm256_castsi256_ps(half ? _mm256_unpackhi_epi16(zero, *raw) : _mm256_unpacklo_epi16(zero, *raw));
}

/* One k of a tile: acc[i][j] += x[i][k] * w[j][k] (xk: the group's x at k, one value per row). A tall tile keeps
 * its NV weight vectors in registers and takes one broadcast at a time, a wide one keeps its RG broadcasts: at most
 * 16 ymm registers either way. */
static inline __attribute__((always_inline)) void tile_k(const int RG, const int NV, const int ODD, const int WB,
                                                         const float *xk, const uint16_t *wb, const float *wf,
                                                         int64_t pstride, int64_t k, __m256 acc[GROUP][8]) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i raw = zero;
    if (NV <= RG) {
        __m256 wv[8];
#pragma GCC unroll 8
        for (int j = 0; j < NV; j++) wv[j] = wvec(WB, ODD, j, wb, wf, pstride, k, zero, &raw);
#pragma GCC unroll 6
        for (int i = 0; i < RG; i++) {
            const __m256 xb = _mm256_broadcast_ss(xk + i);
#pragma GCC unroll 8
            for (int j = 0; j < NV; j++) acc[i][j] = _mm256_fmadd_ps(xb, wv[j], acc[i][j]);
        }
    } else {
        __m256 xb[GROUP];
#pragma GCC unroll 6
        for (int i = 0; i < RG; i++) xb[i] = _mm256_broadcast_ss(xk + i);
#pragma GCC unroll 8
        for (int j = 0; j < NV; j++) {
            const __m256 wj = wvec(WB, ODD, j, wb, wf, pstride, k, zero, &raw);
#pragma GCC unroll 6
            for (int i = 0; i < RG; i++) acc[i][j] = _mm256_fmadd_ps(xb[i], wj, acc[i][j]);
        }
    }
}

/* In the assembly below: weight vector `reg` as fp32 from the bf16 panel row `mem`, its low (half "l") or high
 * ("h") 8 features, unpacked against a zero made in place (a zeroing idiom, which takes no execution port). */
#define UNPACK_BF16(half, mem, reg)                                                                                 \
    "vpxor %%" reg ", %%" reg ", %%" reg "\n\tvpunpck" half "wd %[" mem "], %%" reg ", %%" reg "\n\t"

/* One k of a one-panel tile of RG (3-6) rows x 16 features, as inline assembly: the same FMAs as tile_k in the same
 * order (so the same results), with the registers placed by hand. Compiled from C, the 12 accumulators, the zero,
 * the two weight vectors and the broadcast (all 16 ymm registers) made GCC spill accumulators inside the k loop:
 * 6 rows with the weights in L2 ran at 80 % of the FMA peak. ymm12-13 hold the weight vectors, ymm14 the
 * broadcast. */
#define PK_ROW(i)                                                                                                   \
    "vbroadcastss " #i "*4(%[xp]), %%ymm14\n\t"                                                                     \
    "vfmadd231ps %%ymm12, %%ymm14, %t[a" #i "0]\n\t"                                                                \
    "vfmadd231ps %%ymm13, %%ymm14, %t[a" #i "1]\n\t"
#define PK_W_BF16 UNPACK_BF16("l", "w0", "ymm12") UNPACK_BF16("h", "w0", "ymm13")
#define PK_W_F32 "vmovups %[w0], %%ymm12\n\tvmovups %[w1], %%ymm13\n\t"
#define PK_ACC(i) [a##i##0] "+x"(a[i][0]), [a##i##1] "+x"(a[i][1])
#define PK_OPERANDS(...) /* the tile's accumulators, as PK_ACC(i) for each row: only those, or GCC spills */        \
    : __VA_ARGS__                                                                                                   \
    : [w0] "m"(*(const __m256i *)w0), [w1] "m"(*(const __m256i *)w1), [xp] "r"(xk),                                 \
      [xs] "m"(*(const float(*)[RG])xk) /* the rows' x at k, read through xp */                                     \
    : "xmm12", "xmm13", "xmm14"
#define PK_RG3 PK_ROW(0) PK_ROW(1) PK_ROW(2) PK_OPERANDS(PK_ACC(0), PK_ACC(1), PK_ACC(2))
#define PK_RG4 PK_ROW(0) PK_ROW(1) PK_ROW(2) PK_ROW(3) PK_OPERANDS(PK_ACC(0), PK_ACC(1), PK_ACC(2), PK_ACC(3))
#define PK_RG5                                                                                                      \
    PK_ROW(0) PK_ROW(1) PK_ROW(2) PK_ROW(3) PK_ROW(4) PK_OPERANDS(PK_ACC(0), PK_ACC(1), PK_ACC(2), PK_ACC(3), PK_ACC(4))
#define PK_RG6                                                                                                      \
    PK_ROW(0) PK_ROW(1) PK_ROW(2) PK_ROW(3) PK_ROW(4) PK_ROW(5)                                                     \
    PK_OPERANDS(PK_ACC(0), PK_ACC(1), PK_ACC(2), PK_ACC(3), PK_ACC(4), PK_ACC(5))
static inline __attribute__((always_inline)) void panel_k(const int RG, const int WB, const float *xk,
                                                          const char *w0, __m256 a[GROUP][8]) {
    const char *w1 = w0 + 32; /* an fp32 panel's features 8-15 (unused for bf16) */
    if (WB) switch (RG) {
        case 3: __asm__(PK_W_BF16 PK_RG3); break;
        case 4: __asm__(PK_W_BF16 PK_RG4); break;
        case 5: __asm__(PK_W_BF16 PK_RG5); break;
        default: __asm__(PK_W_BF16 PK_RG6); break;
        }
    else switch (RG) {
        case 3: __asm__(PK_W_F32 PK_RG3); break;
        case 4: __asm__(PK_W_F32 PK_RG4); break;
        case 5: __asm__(PK_W_F32 PK_RG5); break;
        default: __asm__(PK_W_F32 PK_RG6); break;
        }
}

/* One k of a tile of 3 or 4 rows x 3 vectors across two panels (ODD: from the first panel's second half), in inline
 * assembly for the same reason: the same FMAs as tile_k in the same order. ymm12-14 hold the weight vectors, ymm15
 * the broadcast. */
#define P3_ROW(i)                                                                                                   \
    "vbroadcastss " #i "*4(%[xp]), %%ymm15\n\t"                                                                     \
    "vfmadd231ps %%ymm12, %%ymm15, %t[a" #i "0]\n\t"                                                                \
    "vfmadd231ps %%ymm13, %%ymm15, %t[a" #i "1]\n\t"                                                                \
    "vfmadd231ps %%ymm14, %%ymm15, %t[a" #i "2]\n\t"
#define P3_EVEN UNPACK_BF16("l", "q0", "ymm12") UNPACK_BF16("h", "q0", "ymm13") UNPACK_BF16("l", "q1", "ymm14")
#define P3_ODD UNPACK_BF16("h", "q0", "ymm12") UNPACK_BF16("l", "q1", "ymm13") UNPACK_BF16("h", "q1", "ymm14")
#define P3_ACC(i) [a##i##0] "+x"(a[i][0]), [a##i##1] "+x"(a[i][1]), [a##i##2] "+x"(a[i][2])
#define P3_OPERANDS(...)                                                                                            \
    : __VA_ARGS__                                                                                                   \
    : [q0] "m"(*(const __m256i *)q0), [q1] "m"(*(const __m256i *)q1), [xp] "r"(xk),                                 \
      [xs] "m"(*(const float(*)[RG])xk)                                                                             \
    : "xmm12", "xmm13", "xmm14", "xmm15"
#define P3_RG3 P3_ROW(0) P3_ROW(1) P3_ROW(2) P3_OPERANDS(P3_ACC(0), P3_ACC(1), P3_ACC(2))
#define P3_RG4 P3_ROW(0) P3_ROW(1) P3_ROW(2) P3_ROW(3) P3_OPERANDS(P3_ACC(0), P3_ACC(1), P3_ACC(2), P3_ACC(3))
static inline __attribute__((always_inline)) void tile3v_k(const int RG, const int ODD, const float *xk,
                                                           const uint16_t *q0, const uint16_t *q1, __m256 a[GROUP][8]) {
    if (RG == 3 && ODD) __asm__(P3_ODD P3_RG3);
    else if (RG == 3) __asm__(P3_EVEN P3_RG3);
    else if (ODD) __asm__(P3_ODD P3_RG4);
    else __asm__(P3_EVEN P3_RG4);
}

/* One k of a 3 x 4 tile (three rows, two panels): the rows' broadcasts in ymm13-15, each weight vector in turn in
 * ymm12. */
#define P34_VEC(half, q, j)                                                                                         \
    UNPACK_BF16(half, q, "ymm12")                                                                                   \
    "vfmadd231ps %%ymm12, %%ymm13, %t[a0" #j "]\n\t"                                                                \
    "vfmadd231ps %%ymm12, %%ymm14, %t[a1" #j "]\n\t"                                                                \
    "vfmadd231ps %%ymm12, %%ymm15, %t[a2" #j "]\n\t"
static inline __attribute__((always_inline)) void tile34_k(const float *xk, const uint16_t *q0, const uint16_t *q1,
                                                           __m256 a[GROUP][8]) {
    __asm__("vbroadcastss 0(%[xp]), %%ymm13\n\tvbroadcastss 4(%[xp]), %%ymm14\n\tvbroadcastss 8(%[xp]), %%ymm15\n\t"
            P34_VEC("l", "q0", 0) P34_VEC("h", "q0", 1) P34_VEC("l", "q1", 2) P34_VEC("h", "q1", 3)
            : [a00] "+x"(a[0][0]), [a01] "+x"(a[0][1]), [a02] "+x"(a[0][2]), [a03] "+x"(a[0][3]),
              [a10] "+x"(a[1][0]), [a11] "+x"(a[1][1]), [a12] "+x"(a[1][2]), [a13] "+x"(a[1][3]),
              [a20] "+x"(a[2][0]), [a21] "+x"(a[2][1]), [a22] "+x"(a[2][2]), [a23] "+x"(a[2][3])
            : [q0] "m"(*(const __m256i *)q0), [q1] "m"(*(const __m256i *)q1), [xp] "r"(xk),
              [xs] "m"(*(const float(*)[3])xk)
            : "xmm12", "xmm13", "xmm14", "xmm15");
}

/* One tile: RG rows from r (a row group's first) x NV vectors of 8 features from vector v (feature 8 v; ODD: v is
 * odd, the tile starts in a panel's second half), over all k; meanwhile pf_lines cache lines from pf are prefetched
 * into L2, spread over the k. */
static inline __attribute__((always_inline)) void tile(const job_t *J, const int RG, const int NV, const int ODD,
                                                       const int WB, const int YB, int64_t r, int64_t v,
                                                       const char *pf, int64_t pf_lines) {
    __m256 acc[GROUP][8];
    const int64_t K = J->in_f, pstride = K * PANEL; /* elements between panels */
    const uint16_t *wb = (const uint16_t *)J->w + (v >> 1) * pstride;
    const float *wf = (const float *)J->w + (v >> 1) * pstride;
    const float *xg = J->x + r * K; /* the group's rows, k-major: xg[k * RG + i] */
#pragma GCC unroll 6
    for (int i = 0; i < RG; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NV; j++) acc[i][j] = _mm256_setzero_ps();
#define STEP(kk)                                                                                                    \
    do {                                                                                                            \
        if (NV == 2 && !ODD && RG >= 3)                                                                             \
            panel_k(RG, WB, xg + (kk) * RG,                                                                         \
                    WB ? (const char *)(wb + (kk) * PANEL) : (const char *)(wf + (kk) * PANEL), acc);               \
        else if (WB && RG == 3 && NV == 4)                                                                          \
            tile34_k(xg + (kk) * RG, wb + (kk) * PANEL, wb + pstride + (kk) * PANEL, acc);                          \
        else if (WB && (RG == 3 || RG == 4) && NV == 3)                                                             \
            tile3v_k(RG, ODD, xg + (kk) * RG, wb + (kk) * PANEL, wb + pstride + (kk) * PANEL, acc);                 \
        else                                                                                                        \
            tile_k(RG, NV, ODD, WB, xg + (kk) * RG, wb, wf, pstride, kk, acc);                                      \
    } while (0)
    int64_t pf_acc = 0, k = 0;
    for (; k + KSTEP <= K; k += KSTEP) {
        if (pf_lines) /* pf_lines / K lines per k, as evenly as integers allow */
            for (pf_acc += KSTEP * pf_lines; pf_acc >= K; pf_acc -= K, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
        if (k + PF_DIST(RG, NV) < K) /* the tile's own panels, PF_DIST k ahead, into L1: a line per 2 (bf16) or 1 k */
#pragma GCC unroll 4
            for (int q = 0; q < (ODD + NV + 1) / 2; q++) {
                const char *ahead = WB ? (const char *)(wb + q * pstride + (k + PF_DIST(RG, NV)) * PANEL)
                                       : (const char *)(wf + q * pstride + (k + PF_DIST(RG, NV)) * PANEL);
                for (int b = 0; b < KSTEP * PANEL * (WB ? 2 : 4); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
            }
#pragma GCC unroll 8
        for (int u = 0; u < KSTEP; u++) STEP(k + u);
    }
    for (; k < K; k++) STEP(k);
#undef STEP
#pragma GCC unroll 6
    for (int i = 0; i < RG; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NV; j++) store8(J, WB, YB, r + i, 8 * (v + j), acc[i][j]);
}

/* The row groups of a call's `rows` rows: one up to 3 rows (its tiles are wider), else groups of at most GROUP rows,
 * as few as that allows, as even as they split (3-6 rows each). */
static inline int64_t row_groups(int64_t rows) { return rows <= 3 ? 1 : (rows + GROUP - 1) / GROUP; }
static inline int64_t group_rows(int64_t rows, int64_t g) {
    const int64_t n = row_groups(rows);
    return rows / n + (g < rows % n);
}

/* The panels of one block: as wide as the tiles of this row count (4 panels for one row, 3 for two, 2 for three;
 * from 4 rows, 3 where a row group has 3-4 rows, else 1). */
static inline int64_t block_panels(int64_t rows) {
    if (rows <= 3) return rows == 1 ? 4 : rows == 2 ? 3 : 2;
    return group_rows(rows, row_groups(rows) - 1) <= 4 ? 3 : 1; /* groups of 3-4 rows take 3 x 3-vector tiles */
}

/* The tiles that cover rows [0, rows) x panels [p, p + np), in order: `emit` runs (or counts) one. Tile shapes keep
 * 8-12 independent accumulators within the 16 ymm registers: 1 row x 8 vectors, 2 x 6, 3 x 4, then per row group
 * one panel (2 vectors) wide for 5-6 rows, or two tiles 3 vectors wide across a block of 3 panels (the second from
 * the middle panel's second half) for 3-4 rows; narrower tiles where the weight's panels end. */
#define COVER_X3(emit, RG, r)                                                                                       \
    do {                                                                                                            \
        if (np == 3) { emit(RG, 3, 0, r, v0); emit(RG, 3, 1, r, v0 + 3); }                                          \
        else for (int64_t q = 0; q < np; q++) emit(RG, 2, 0, r, v0 + 2 * q);                                        \
    } while (0)
#define COVER(emit)                                                                                                 \
    do {                                                                                                            \
        const int64_t v0 = 2 * p; (void)v0;                                                                         \
        if (rows == 1) {                                                                                            \
            switch (np) {                                                                                           \
            case 4: emit(1, 8, 0, 0, v0); break;                                                                    \
            case 3: emit(1, 6, 0, 0, v0); break;                                                                    \
            case 2: emit(1, 4, 0, 0, v0); break;                                                                    \
            default: emit(1, 2, 0, 0, v0); break;                                                                   \
            }                                                                                                       \
        } else if (rows == 2) {                                                                                     \
            switch (np) {                                                                                           \
            case 3: emit(2, 6, 0, 0, v0); break;                                                                    \
            case 2: emit(2, 4, 0, 0, v0); break;                                                                    \
            default: emit(2, 2, 0, 0, v0); break;                                                                   \
            }                                                                                                       \
        } else if (rows == 3) {                                                                                     \
            if (np == 3) { emit(3, 3, 0, 0, v0); emit(3, 3, 1, 0, v0 + 3); }                                        \
            else if (np == 2) emit(3, 4, 0, 0, v0);                                                                 \
            else emit(3, 2, 0, 0, v0);                                                                              \
        } else {                                                                                                    \
            for (int64_t g = 0, r = 0; g < row_groups(rows); r += group_rows(rows, g), g++)                         \
                switch (group_rows(rows, g)) {                                                                      \
                case 6: for (int64_t q = 0; q < np; q++) emit(6, 2, 0, r, v0 + 2 * q); break;                       \
                case 5: for (int64_t q = 0; q < np; q++) emit(5, 2, 0, r, v0 + 2 * q); break;                       \
                case 4: COVER_X3(emit, 4, r); break;                                                                \
                default: COVER_X3(emit, 3, r); break;                                                               \
                }                                                                                                   \
        }                                                                                                           \
    } while (0)

/* Panels [p, p + np) for all rows of the row block: the first row group reads them from memory, the others from
 * cache. Meanwhile every tile prefetches its share of the next block into L2, so memory keeps streaming while the
 * later groups compute. */
static inline __attribute__((always_inline)) void block_t(const job_t *J, const int WB, const int YB, int64_t rows,
                                                          int64_t p, int64_t np) {
    const int64_t bytes = J->in_f * PANEL * (WB ? 2 : 4), after = J->panels - p - np; /* bytes: one panel's */
    const int64_t lines = rows < PF_MIN_ROWS || after <= 0 ? 0 : (after < np ? after : np) * bytes / 64;
    const char *pf = (const char *)J->w + (p + np) * bytes;
    int64_t tiles = 0, t = 0;
#define COUNT(RG, NV, ODD, r, v) (tiles++)
    COVER(COUNT);
#undef COUNT
#define RUN(RG, NV, ODD, r, v)                                                                                      \
    do {                                                                                                            \
        const int64_t from = t * lines / tiles, to = (t + 1) * lines / tiles;                                       \
        tile(J, RG, NV, ODD, WB, YB, r, v, pf + 64 * from, to - from);                                              \
        t++;                                                                                                        \
    } while (0)
    COVER(RUN);
#undef RUN
}

static void block(const job_t *J, int WB, int YB, int64_t rows, int64_t p, int64_t np) {
    if (WB)
        YB ? block_t(J, 1, 1, rows, p, np) : block_t(J, 1, 0, rows, p, np);
    else
        YB ? block_t(J, 0, 1, rows, p, np) : block_t(J, 0, 0, rows, p, np);
}

static __thread float *scratch; /* a row block's x, widened to fp32, each row group k-major */
static __thread size_t scratch_floats;

/* x: [rows, in_f] (bf16 if x_bf16 else fp32), w: the weight as specdec_stream_pack lays it out (bf16 if w_bf16 else
 * fp32), bias: [out_f] of the weight's dtype or NULL, y: [rows, out_f] (bf16 if y_bf16 else fp32); all contiguous.
 * Returns 0, or -1 where the scratch could not be allocated. */
int specdec_stream_linear(int x_bf16, int w_bf16, int y_bf16, int64_t rows, int64_t in_f, int64_t out_f,
                          const void *x, const void *w, const void *bias, void *y) {
    const int64_t panels = (out_f + PANEL - 1) / PANEL;
    const size_t need = (size_t)((rows < ROW_BLOCK ? rows : ROW_BLOCK) * in_f);
    if (need > scratch_floats) {
        free(scratch);
        scratch = aligned_alloc(64, (need * sizeof(float) + 63) / 64 * 64);
        scratch_floats = scratch ? need : 0;
        if (!scratch) return -1;
    }
    for (int64_t rb = 0; rb < rows; rb += ROW_BLOCK) {
        const int64_t nr = rows - rb < ROW_BLOCK ? rows - rb : ROW_BLOCK;
        /* the rows widened once per call, each group's k-major (group g from row r: scratch[r * in_f + k * rg + i]),
         * so a tile's broadcasts sit at fixed offsets from one pointer */
        for (int64_t g = 0, r = 0; g < row_groups(nr); r += group_rows(nr, g), g++) {
            const int64_t rg = group_rows(nr, g);
            for (int64_t i = 0; i < rg; i++) {
                const int64_t row = rb + r + i;
                float *dst = scratch + r * in_f + i;
                if (x_bf16)
                    for (int64_t k = 0; k < in_f; k++) dst[k * rg] = bf16_to_f32(((const uint16_t *)x)[row * in_f + k]);
                else
                    for (int64_t k = 0; k < in_f; k++) dst[k * rg] = ((const float *)x)[row * in_f + k];
            }
        }
        const job_t J = {in_f, out_f, panels, scratch, w, bias,
                         y_bf16 ? (void *)((uint16_t *)y + rb * out_f) : (void *)((float *)y + rb * out_f)};
        const int64_t width = block_panels(nr);
        for (int64_t p = 0; p < panels; p += width)
            block(&J, w_bf16, y_bf16, nr, p, panels - p < width ? panels - p : width);
    }
    return 0;
}

int specdec_stream_linear_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

#else /* a build for a CPU without AVX2 + FMA: no kernel (specdec.modeling.native.stream_linear_supported is False) */

int specdec_stream_linear(int x_bf16, int w_bf16, int y_bf16, int64_t rows, int64_t in_f, int64_t out_f,
                          const void *x, const void *w, const void *bias, void *y) {
    return -2;
}

int specdec_stream_linear_supported(void) { return 0; }

#endif
