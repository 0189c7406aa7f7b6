/* The 512-bit paths: AVX-512 F/BW/VL and, built with -DSS_VNNI, AVX-512 VNNI (vpdpwssd: the int16
 * multiply-adds fused with their accumulation, 32 a instruction). Bit for bit the canonical order of
 * kernels.h: a full group's 8 blocks take the 16 lanes of one register two steps at a time, whose halves
 * are added (exact integers) before the group's fp32 scaling on 8 lanes. Attention is the AVX2 path's. */
#include <immintrin.h>

#include "kernels.h"

#ifdef SS_VNNI
#define PATH ss_path_avx512_vnni
#define NAME "AVX-512 VNNI"
#define NEEDS (SS_CPU_AVX2 | SS_CPU_AVX512 | SS_CPU_AVX512_VNNI)
/* acc + a . b pairwise (int16 -> int32), in asm: GCC copies the intrinsic's accumulator in and out of
 * another register on every iteration, which doubles the loop's instructions */
static inline __attribute__((always_inline)) __m512i dp512(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
    return acc;
}
static inline __attribute__((always_inline)) __m256i dp256(__m256i acc, __m256i a, __m256i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
    return acc;
}
#define DP512(acc, a, b) dp512((acc), (a), (b))
#define DP256(acc, a, b) dp256((acc), (a), (b))
#else
#define PATH ss_path_avx512
#define NAME "AVX-512"
#define NEEDS (SS_CPU_AVX2 | SS_CPU_AVX512)
#define DP512(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#define DP256(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#endif
#define INLINE static inline __attribute__((always_inline))
#define MAX_R 8 /* rows per tile */

void ss_avx2_attend(const attn_t *a, int t, int h, int *keys, float *buf);

/* R8 of kernels.h */
INLINE float r8(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* The exact int32 sums of each of 8 vectors, as the 8 lanes of one */
INLINE __m256i isum8(const __m256i v[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* The two 8-lane halves added: lane l + lane l + 8 */
INLINE __m256 halves(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

static void quantise(const float *v, int16_t *q, float *scale, float *sum) {
    const __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
    const float s = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1))) / 32767.0f;
    *sum = r8(halves(_mm512_add_ps(x0, x1)));
    const __m512 inv = _mm512_set1_ps(s > 0.0f ? 1.0f / s : 0.0f);
    _mm256_storeu_si256((__m256i *)q, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x0, inv))));
    _mm256_storeu_si256((__m256i *)(q + 16), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x1, inv))));
    *scale = s;
}

/* One tail block's 32 weights as int16: values 0..15 in w[0], 16..31 in w[1]. */
INLINE void tail_block(const int fmt, const uint8_t *at, __m256i w[2]) {
    if (fmt == FMT_Q4) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)at);
        w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0F)));
        w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)));
        return;
    }
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)at));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(at + 16)));
}

/* The first `n` of 8 floats at p, the rest 0 */
INLINE __m256 load_first(const float *p, int n) { return _mm256_maskz_loadu_ps((__mmask8)((1u << n) - 1), p); }

/* Integer formats: rows r0 .. r0 + R - 1 of column n (R and fmt constant where inlined). */
INLINE void int_tile(const job_t *j, const int fmt, const int R, int r0, int n) {
    const int nb = j->K / 32, groups = nb / 8, tail = nb - 8 * groups;
    __m256 acc[MAX_R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const float *dn = j->d + (size_t)n * nb, *mn = fmt == FMT_Q4 ? j->m + (size_t)n * nb : 0;
    const int16_t *qx = j->qx + (size_t)r0 * nb * 32;
    const float *dx = j->dx + (size_t)r0 * nb, *xs = j->xsum + (size_t)r0 * nb;
    const uint8_t *column = (const uint8_t *)j->w + (fmt == FMT_Q4 ? (size_t)n * nb * 16 : (size_t)n * nb * 32);
    for (int g = 0; g < groups; g++) {
        __m512i isum[MAX_R];
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
        if (fmt == FMT_Q4) {
            for (int s = 0; s < 8; s += 2) { /* 32 bytes: steps s, s + 1 low, s + 8, s + 9 high */
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(column + g * 128 + s * 16));
                const __m512i lo = _mm512_cvtepu8_epi16(_mm256_and_si256(raw, _mm256_set1_epi8(0x0F)));
                const __m512i hi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F)));
                for (int r = 0; r < R; r++) {
                    const int16_t *x = qx + ((size_t)r * nb + 8 * g) * 32;
                    isum[r] = DP512(isum[r], lo, _mm512_loadu_si512(x + 16 * s));
                    isum[r] = DP512(isum[r], hi, _mm512_loadu_si512(x + 16 * (s + 8)));
                }
            }
        } else {
            for (int s = 0; s < 16; s += 2) { /* 32 int8: steps s, s + 1 */
                const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(column + g * 256 + s * 16)));
                for (int r = 0; r < R; r++)
                    isum[r] = DP512(isum[r], w, _mm512_loadu_si512(qx + ((size_t)r * nb + 8 * g) * 32 + 16 * s));
            }
        }
        const __m256 d8 = _mm256_loadu_ps(dn + 8 * g);
        for (int r = 0; r < R; r++) {
            const size_t at = (size_t)r * nb + 8 * g;
            const __m256i dot = _mm256_add_epi32(_mm512_castsi512_si256(isum[r]), _mm512_extracti64x4_epi64(isum[r], 1));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d8, _mm256_loadu_ps(dx + at)), acc[r]);
            if (fmt == FMT_Q4) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(mn + 8 * g), _mm256_loadu_ps(xs + at), acc[r]);
        }
    }
    if (tail) {
        const int b0 = 8 * groups;
        __m256i dots[MAX_R][8];
        for (int r = 0; r < R; r++)
            for (int t = tail; t < 8; t++) dots[r][t] = _mm256_setzero_si256();
        for (int t = 0; t < tail; t++) {
            __m256i w[2];
            tail_block(fmt, column + (fmt == FMT_Q4 ? (b0 + t) * 16 : (b0 + t) * 32), w);
            for (int r = 0; r < R; r++) {
                const int16_t *x = qx + ((size_t)r * nb + b0 + t) * 32;
                const __m256i lo = DP256(_mm256_setzero_si256(), w[0], _mm256_loadu_si256((const __m256i *)x));
                dots[r][t] = DP256(lo, w[1], _mm256_loadu_si256((const __m256i *)(x + 16)));
            }
        }
        const __m256 dt = load_first(dn + b0, tail);
        for (int r = 0; r < R; r++) {
            const size_t at = (size_t)r * nb + b0;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum8(dots[r])), _mm256_mul_ps(dt, load_first(dx + at, tail)), acc[r]);
            if (fmt == FMT_Q4) acc[r] = _mm256_fmadd_ps(load_first(mn + b0, tail), load_first(xs + at, tail), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s = r8(acc[r]);
        if (j->bias) s += j->bias[n];
        j->out[(size_t)(r0 + r) * j->N + n] = s;
    }
}

/* The 32 weights of block b of column n as 2 vectors of 16 floats. */
INLINE void float_block(const job_t *j, const int fmt, int n, int b, __m512 v[2]) {
    const size_t at = (size_t)n * j->K + b * 32;
    for (int i = 0; i < 2; i++) {
        if (fmt == FMT_F16) {
            v[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)j->w + at + 16 * i)));
        } else if (fmt == FMT_BF16) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)j->w + at + 16 * i));
            v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        } else {
            v[i] = _mm512_loadu_ps((const float *)j->w + at + 16 * i);
        }
    }
}

INLINE void float_tile(const job_t *j, const int fmt, const int R, int r0, int n) {
    const int nb = j->K / 32, K = j->K;
    __m512 acc[MAX_R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float *x0 = j->x + (size_t)r0 * K;
    for (int b = 0; b < nb; b++) {
        __m512 v[2];
        float_block(j, fmt, n, b, v);
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 2; i++)
                acc[r][i] = _mm512_fmadd_ps(v[i], _mm512_loadu_ps(x0 + (size_t)r * K + b * 32 + 16 * i), acc[r][i]);
    }
    for (int r = 0; r < R; r++) {
        float s = r8(halves(_mm512_add_ps(acc[r][0], acc[r][1])));
        if (j->bias) s += j->bias[n];
        j->out[(size_t)(r0 + r) * j->N + n] = s;
    }
}

#define TILE_ROWS(fmt) ((fmt) == FMT_Q4 || (fmt) == FMT_Q8 ? 8 : 4)

INLINE void tile(const job_t *j, const int fmt, const int R, int r0, int n) {
    if (fmt == FMT_Q4 || fmt == FMT_Q8) int_tile(j, fmt, R, r0, n);
    else float_tile(j, fmt, R, r0, n);
}

/* The last M % R rows of column n, R - 1 at most. */
INLINE void rest_tile(const job_t *j, const int fmt, int rest, int r0, int n) {
    switch (rest) {
    case 7: tile(j, fmt, 7, r0, n); break;
    case 6: tile(j, fmt, 6, r0, n); break;
    case 5: tile(j, fmt, 5, r0, n); break;
    case 4: tile(j, fmt, 4, r0, n); break;
    case 3: tile(j, fmt, 3, r0, n); break;
    case 2: tile(j, fmt, 2, r0, n); break;
    case 1: tile(j, fmt, 1, r0, n); break;
    default: break;
    }
}

/* Columns in chunks whose weights stay in cache while every tile of rows passes over them. */
INLINE void columns_fmt(const job_t *j, const int fmt, int n0, int n1) {
    const int R = TILE_ROWS(fmt), rest = j->M % R, full = j->M - rest;
    for (int c0 = n0; c0 < n1; c0 += 16) {
        const int c1 = c0 + 16 < n1 ? c0 + 16 : n1;
        for (int r0 = 0; r0 < full; r0 += R)
            for (int n = c0; n < c1; n++) tile(j, fmt, R, r0, n);
        if (rest)
            for (int n = c0; n < c1; n++) rest_tile(j, fmt, rest, full, n);
    }
}

static void columns(const job_t *j, int n0, int n1) {
    switch (j->fmt) {
    case FMT_Q4: columns_fmt(j, FMT_Q4, n0, n1); break;
    case FMT_Q8: columns_fmt(j, FMT_Q8, n0, n1); break;
    case FMT_F16: columns_fmt(j, FMT_F16, n0, n1); break;
    case FMT_BF16: columns_fmt(j, FMT_BF16, n0, n1); break;
    default: columns_fmt(j, FMT_F32, n0, n1);
    }
}

const ss_path_t PATH = {NAME, NEEDS, quantise, columns, ss_avx2_attend};
