/* The 512-bit paths' code in GCC's generic vectors, which the compiler lowers to AVX-512 where the file is
 * built for it and to narrower instructions (or scalars) where it is not: what the AMX path shares with the
 * AVX-512 VNNI path, and the int8 tiles of the latter, which the tests therefore run, bit for bit, on
 * machines without AVX-512 (vnni512_emulated.c). A lane is one of a panel's 16 columns. */
#ifndef SS_VEC512_H
#define SS_VEC512_H

#include "kernels.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

typedef int8_t v32b __attribute__((vector_size(32)));
typedef int16_t v32s __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef float v16f __attribute__((vector_size(64)));

INLINE v16f splat(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

INLINE v16f fma16(v16f a, v16f b, v16f c) {
#ifdef __AVX512F__
    return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    for (int l = 0; l < 16; l++) c[l] = fmaf(a[l], b[l], c[l]);
    return c;
#endif
}

/* SS_PANEL scales (d or m) of a panel's block b, floats or halves. */
INLINE v16f scales_v16(const job_t *j, const void *panel, int b) {
    v16f s;
    if (!j->half) {
        memcpy(&s, (const float *)panel + (size_t)b * SS_PANEL, sizeof s);
        return s;
    }
    const uint16_t *h = (const uint16_t *)panel + (size_t)b * SS_PANEL;
#ifdef __AVX512F__
    s = (v16f)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#else
    for (int l = 0; l < 16; l++) s[l] = ss_half_to_float(h[l]);
#endif
    return s;
}

/* 16 uint16 at p, zero-extended (GCC splits the generic conversion in two halves) */
INLINE v16u zext16(const uint8_t *p) {
#ifdef __AVX512F__
    return (v16u)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
#else
    v16h h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, v16u);
#endif
}

/* Rows r0 .. r0 + R - 1 of panel p's outputs (acc[r]), the columns below n1, with the bias. */
INLINE void store_panel(const job_t *j, const int R, int r0, int p, int n1, const v16f *acc) {
    const int n = p * SS_PANEL, valid = n1 - n < SS_PANEL ? n1 - n : SS_PANEL;
    v16f bias = {0};
    if (j->bias) memcpy(&bias, j->bias + n, sizeof(float) * valid);
    for (int r = 0; r < R; r++) {
        const v16f v = j->bias ? acc[r] + bias : acc[r];
        memcpy(j->out + (size_t)(r0 + r) * j->N + n, &v, sizeof(float) * valid);
    }
}

/* acc + in each lane the dot product of its 4 bytes of a (unsigned) with the 4 bytes at x (signed). */
INLINE v16i dpbusd16(v16i acc, v16u a, const int8_t *x) {
#ifdef __AVX512VNNI__
    /* in asm, the 4 bytes broadcast from memory: GCC copies the intrinsic's accumulator on every use */
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*(const int32_t *)x));
#else
    for (int l = 0; l < 16; l++)
        for (int k = 0; k < 4; k++) acc[l] += (int)((a[l] >> (8 * k)) & 0xFF) * x[k];
#endif
    return acc;
}

#define MAX_R8 8 /* rows per int8 tile: 3 registers a row */

/* The integer formats with int8 activations (kernels.h): rows r0 .. r0 + R - 1 of panel p, columns below
 * n1. A lane is a column's 4 bytes of two pairs, one vpermw from the panel's two 32-byte runs. Q4: pairs i
 * and i + 1 of the nibbles (elements 2i .. 2i + 3 low, 2i + 16 .. 2i + 19 high). Q8: pairs i and i + 1
 * (elements 2i .. 2i + 3), each plus 128 to make it unsigned, 128 times the block's sum taken back. Each
 * row's two chains of byte multiply-adds give its exact block dot products, scaled as kernels.h says. */
INLINE void int8_tile16(const job_t *j, const int fmt, const int R, int r0, int p, int n1) {
    const int nb = j->K / 32, bytes = fmt == FMT_Q4 ? 256 : 512;
    const v32s pairs = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    v16f acc[MAX_R8];
    for (int r = 0; r < R; r++) acc[r] = (v16f){0};
    const uint8_t *w = ss_panel_weights(j, p);
    const void *dp = ss_panel_scales(j, j->d, p), *mp = fmt == FMT_Q4 ? ss_panel_scales(j, j->m, p) : 0;
    const int8_t *qx = j->qx8 + (size_t)r0 * nb * 32;
    /* the panel 2 on, asked of memory while this one computes (by the first tile of rows) */
    const int fetch = r0 == 0 && p + 3 <= (j->N + SS_PANEL - 1) / SS_PANEL;
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * bytes;
        if (fetch)
            for (int at = 0; at < bytes; at += 64) __builtin_prefetch(wb + (size_t)2 * nb * bytes + at, 0, 2);
        v16i sum[MAX_R8], more[MAX_R8];
        for (int r = 0; r < R; r++) sum[r] = more[r] = (v16i){0};
        for (int i = 0; i < (fmt == FMT_Q4 ? 8 : 16); i += (fmt == FMT_Q4 ? 2 : 4)) {
            v32s z;
            memcpy(&z, wb + i * 32, sizeof z);
            const v16u u = (v16u)__builtin_shuffle(z, pairs);
            v16u a, c; /* the chains' weights, against the activations at 2i and at 2i + off */
            int off;
            if (fmt == FMT_Q4) {
                a = u & 0x0F0F0F0F, c = (u >> 4) & 0x0F0F0F0F, off = 16;
            } else {
                memcpy(&z, wb + (i + 2) * 32, sizeof z);
                a = u ^ 0x80808080, c = (v16u)__builtin_shuffle(z, pairs) ^ 0x80808080, off = 4;
            }
            for (int r = 0; r < R; r++) {
                const int8_t *x = qx + ((size_t)r * nb + b) * 32;
                sum[r] = dpbusd16(sum[r], a, x + 2 * i), more[r] = dpbusd16(more[r], c, x + 2 * i + off);
            }
        }
        const v16f d16 = scales_v16(j, dp, b), m16 = fmt == FMT_Q4 ? scales_v16(j, mp, b) : (v16f){0};
        for (int r = 0; r < R; r++) {
            const size_t at = (size_t)(r0 + r) * nb + b;
            v16i D = sum[r] + more[r];
            if (fmt == FMT_Q8) D -= 128 * j->sum8[at];
            acc[r] = fma16(__builtin_convertvector(D, v16f), d16 * splat(j->dx[at]), acc[r]);
            if (fmt == FMT_Q4) acc[r] = fma16(m16, splat(j->xsum[at]), acc[r]);
        }
    }
    store_panel(j, R, r0, p, n1, acc);
}

/* The integer formats with int8 activations, columns n0 (a panel's first) .. n1 - 1: in chunks of 4 panels
 * whose weights stay in cache while every tile of rows (as even as they go) passes over them. */
INLINE void int8_columns16(const job_t *j, const int fmt, int n0, int n1) {
    const int last = (n1 + SS_PANEL - 1) / SS_PANEL;
    for (int p0 = n0 / SS_PANEL; p0 < last; p0 += 4) {
        const int p1 = p0 + 4 < last ? p0 + 4 : last;
        int r0 = 0;
        for (int tiles = (j->M + MAX_R8 - 1) / MAX_R8; tiles > 0; tiles--) {
            const int R = (j->M - r0 + tiles - 1) / tiles;
            for (int p = p0; p < p1; p++) {
                switch (R) {
                case 8: int8_tile16(j, fmt, 8, r0, p, n1); break;
                case 7: int8_tile16(j, fmt, 7, r0, p, n1); break;
                case 6: int8_tile16(j, fmt, 6, r0, p, n1); break;
                case 5: int8_tile16(j, fmt, 5, r0, p, n1); break;
                case 4: int8_tile16(j, fmt, 4, r0, p, n1); break;
                case 3: int8_tile16(j, fmt, 3, r0, p, n1); break;
                case 2: int8_tile16(j, fmt, 2, r0, p, n1); break;
                default: int8_tile16(j, fmt, 1, r0, p, n1);
                }
            }
            r0 += R;
        }
    }
}

/* The integer formats' columns with int8 activations: 1 when done here, 0 for the caller's own tiles. */
INLINE int int8_columns(const job_t *j, int n0, int n1) {
    if (!j->qx8) return 0;
    if (j->fmt == FMT_Q4) int8_columns16(j, FMT_Q4, n0, n1);
    else if (j->fmt == FMT_Q8) int8_columns16(j, FMT_Q8, n0, n1);
    else return 0;
    return 1;
}

#endif
