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

/* 8 scales (d or m) of a panel's [nb][SS_PANEL], from index i on, floats or halves. */
static inline __attribute__((always_inline)) __m256 scales8(const job_t *j, const void *panel, int i) {
    return j->half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)panel + i)))
                   : _mm256_loadu_ps((const float *)panel + i);
}

/* Attention asks for the cache lines of the key or value PREFETCH_KEYS keys ahead (`n` elements from element
 * i of a KV cache of floats or halves): the hardware's prefetchers alone left a long context's keys and
 * values streaming from L3 at 80-90 % of the speed (2000 keys, 30 layers). */
#define PREFETCH_KEYS 32
static inline __attribute__((always_inline)) void prefetch_kv(const int half, const void *cache, size_t i, int n) {
    const char *p = (const char *)cache + i * (half ? 2 : 4);
    for (int b = 0; b < n * (half ? 2 : 4); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

/* 8 elements from element i of a KV cache of floats or halves, as floats (exactly). */
static inline __attribute__((always_inline)) __m256 kv8(const int half, const void *cache, size_t i) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + i)))
                : _mm256_loadu_ps((const float *)cache + i);
}

/* R8 of each of 8 vectors, as the 8 lanes of one, in two steps: r8x4 takes 4 of them to a vector of partial
 * sums, and r8_pairs two such vectors (vectors 0-3, then 4-7) to the 8 sums. */
static inline __attribute__((always_inline)) __m256 r8x4(const __m256 a[4]) {
    __m256 h[2];
    for (int i = 0; i < 2; i++)
        h[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    return _mm256_hadd_ps(h[0], h[1]);
}
static inline __attribute__((always_inline)) __m256 r8_pairs(__m256 first, __m256 second) {
    return _mm256_permutevar8x32_ps(_mm256_hadd_ps(first, second), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
static inline __attribute__((always_inline)) __m256 r8x8(const __m256 a[8]) { return r8_pairs(r8x4(a), r8x4(a + 4)); }

/* Kv head g of row t over its n allowed keys: its query heads in runs of up to `most` attended together by
 * run(C, a, t, h, ...), none alone where that can be helped (4 of at most 3 as 2 + 2, 5 of at most 4 as
 * 3 + 2). */
typedef void (*heads_fn)(int C, const attn_t *a, int t, int h, const int *keys, int n, float *buf);
static inline __attribute__((always_inline)) void attend_in_runs(heads_fn run, int most, const attn_t *a, int t, int g,
                                                                 const int *keys, int n, float *buf) {
    const int G = a->H / a->Hkv;
    for (int h = g * G, left = G, C; left > 0; h += C, left -= C) {
        C = left <= most ? left : left == most + 1 ? most - 1 : most;
        run(C, a, t, h, keys, n, buf);
    }
}

/* fn(C, D, half, a, ...) with the head size D and the cache's `half` as constants for the head sizes of real
 * models (64, 128), so that the compiler unrolls them. */
#define WITH_CONSTANT_HEAD_SIZE(fn, C, a, ...)                                                                   \
    ((a)->D == 64    ? ((a)->half ? fn(C, 64, 1, a, __VA_ARGS__) : fn(C, 64, 0, a, __VA_ARGS__))               \
     : (a)->D == 128 ? ((a)->half ? fn(C, 128, 1, a, __VA_ARGS__) : fn(C, 128, 0, a, __VA_ARGS__))             \
     : (a)->half     ? fn(C, (a)->D, 1, a, __VA_ARGS__)                                                         \
                     : fn(C, (a)->D, 0, a, __VA_ARGS__))

/* The scores of keys i .. n - 1 of C heads, one key at a time after a vector loop's 8 at a time: head c's
 * query at q + c * D, its scores into s + c * S (kernels.h: R8 of 8 lanes, then the scale), and mx[c] the
 * largest of them and of vmx[c]'s lanes (the vector loop's maxima). D is a multiple of 8. */
static inline __attribute__((always_inline)) void score_rest(const int C, const int D, const int half, const attn_t *a,
                                                             const float *q, size_t kb, const int *keys, int i, int n,
                                                             const __m256 *vmx, float *s, float *mx) {
    for (int c = 0; c < C; c++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, vmx[c]);
        mx[c] = -INFINITY;
        for (int l = 0; l < 8; l++) mx[c] = lanes[l] > mx[c] ? lanes[l] : mx[c];
    }
    for (; i < n; i++)
        for (int c = 0; c < C; c++) {
            __m256 acc = _mm256_setzero_ps();
            for (int e = 0; e < D; e += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c * D + e), kv8(half, a->k, kb + (size_t)keys[i] * D + e), acc);
            const float y = r8(acc) * a->scale;
            s[(size_t)c * a->S + i] = y;
            mx[c] = y > mx[c] ? y : mx[c];
        }
}

/* exp8 of kernels.h, 8 lanes */
static inline __attribute__((always_inline)) __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(SS_EXP_LO)), _mm256_set1_ps(SS_EXP_HI));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(SS_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(SS_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(SS_LN2_LO), r);
    __m256 p = _mm256_set1_ps(SS_EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SS_EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SS_EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SS_EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SS_EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SS_EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* p = exp8(score - max) in place over n scores (kernels.h); returns their sum in its 8 lanes. */
static inline __attribute__((always_inline)) float softmax_weights(float *p, int n, float mx) {
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 w = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(p + i), vm));
        _mm256_storeu_ps(p + i, w);
        sum = _mm256_add_ps(sum, w);
    }
    if (i < n) {
        float tail[8];
        for (int l = 0; l < 8; l++) tail[l] = l < n - i ? p[i + l] - mx : 0.0f;
        const __m256 w = exp_ps(_mm256_loadu_ps(tail));
        _mm256_storeu_ps(tail, w);
        for (int l = 0; l < n - i; l++) p[i + l] = tail[l];
        /* the lanes past the end add +0, which leaves their sums as they are */
        sum = _mm256_add_ps(sum, _mm256_blendv_ps(_mm256_setzero_ps(), w, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                  _mm256_set1_epi32(n - i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))));
    }
    return r8(sum);
}

#endif
