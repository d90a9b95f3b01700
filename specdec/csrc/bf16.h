/* bf16 <-> fp32 for the native kernels (specdec/csrc/*.c): integer ops only, the same under any floating-point
 * flags a source is built with. */
#ifndef SPECDEC_BF16_H
#define SPECDEC_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_rounded(float f) { return bf16_to_f32(f32_to_bf16(f)); } /* f as bf16 holds it */

#endif
