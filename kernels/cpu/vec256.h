/* The 256-bit helpers that the AVX2 and AVX-512 paths share (both are built with AVX2, FMA and F16C). */
#ifndef SS_VEC256_H
#define SS_VEC256_H

#include <immintrin.h>

#include "kernels.h"

/* R8 of kernels.h */
static inline __attribute__((always_inline)) float r8(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* 8 scales of a column's row (d or m) from block b on, floats or halves. */
static inline __attribute__((always_inline)) __m256 scales8(const job_t *j, const void *row, int b) {
    return j->half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + b)))
                   : _mm256_loadu_ps((const float *)row + b);
}

#endif
