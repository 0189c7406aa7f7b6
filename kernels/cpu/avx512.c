/* The 512-bit paths: AVX-512 F/BW/VL and, built with -DSS_VNNI, AVX-512 VNNI (vpdpwssd: the int16
 * multiply-adds fused with their accumulation, 32 a instruction). Bit for bit the canonical order of
 * kernels.h: a full group's 8 blocks take the 16 lanes of one register two steps at a time, whose halves
 * are added (exact integers) before the group's fp32 scaling on 8 lanes. Attention is the AVX2 path's. */
#include <immintrin.h>

#include "kernels.h"
#include "vec256.h"

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
#define DP512(acc, a, b) dp512((acc), (a), (b))
#else
#define PATH ss_path_avx512
#define NAME "AVX-512"
#define NEEDS (SS_CPU_AVX2 | SS_CPU_AVX512)
#define DP512(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#endif
#define INLINE static inline __attribute__((always_inline))
#define MAX_R 4 /* rows per tile */
#define MAX_C 4 /* columns per tile */

void ss_avx2_attend(const attn_t *a, int t, int h, int *keys, float *buf);

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

/* A tail group of g (4, 2 or 1) blocks at block `first`, its lanes from `off` on: each row's exact block
 * dot products added into lanes off .. off + g - 1 of dots[r]. */
INLINE void tail_group(const job_t *j, const int fmt, const int R, const int g, const uint8_t *column, int first,
                       int off, const int16_t *qx, __m256i dots[]) {
    const int nb = j->K / 32;
    __m512i w[4]; /* the group's 32 g values as int16, in its order */
    if (fmt == FMT_Q4) {
        const uint8_t *at = column + first * 16; /* low nibbles: values [0, 16 g), high: [16 g, 32 g) */
        if (g == 4) {
            const __m512i raw = _mm512_loadu_si512(at), lo = _mm512_and_si512(raw, _mm512_set1_epi8(0x0F));
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0F));
            w[0] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo)), w[1] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo, 1));
            w[2] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi)), w[3] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi, 1));
        } else if (g == 2) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)at);
            w[0] = _mm512_cvtepu8_epi16(_mm256_and_si256(raw, _mm256_set1_epi8(0x0F)));
            w[1] = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F)));
        } else {
            const __m128i raw = _mm_loadu_si128((const __m128i *)at);
            const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0F)));
            const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)));
            w[0] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
    } else {
        for (int i = 0; i < g; i++) w[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(column + first * 32 + 32 * i)));
    }
    const __mmask8 lanes = (__mmask8)(((1u << g) - 1) << off);
    for (int r = 0; r < R; r++) {
        const int16_t *x = qx + ((size_t)r * nb + first) * 32;
        __m512i sum = _mm512_setzero_si512();
        for (int i = 0; i < g; i++) sum = DP512(sum, w[i], _mm512_loadu_si512(x + 32 * i));
        /* lane l holds a part of block l % g: fold the halves until g lanes are left */
        const __m256i f = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(f), _mm256_extracti128_si256(f, 1));
        if (g <= 2) h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
        if (g == 1) h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 1));
        dots[r] = _mm256_add_epi32(dots[r], _mm256_maskz_expand_epi32(lanes, _mm256_castsi128_si256(h)));
    }
}

/* The first `n` of 8 floats at p, the rest 0 */
INLINE __m256 load_first(const float *p, int n) { return _mm256_maskz_loadu_ps((__mmask8)((1u << n) - 1), p); }

/* The first n scales of a column's row (d or m) from block b on, the rest 0. */
INLINE __m256 scales_first(const job_t *j, const void *row, int b, int n) {
    const __mmask8 k = (__mmask8)((1u << n) - 1);
    return j->half ? _mm256_cvtph_ps(_mm_maskz_loadu_epi16(k, (const uint16_t *)row + b))
                   : _mm256_maskz_loadu_ps(k, (const float *)row + b);
}

/* Integer formats: rows r0 .. r0 + R - 1 of columns n .. n + C - 1 (R, C and fmt constant where inlined).
 * Each activation vector is loaded once for the C columns: the loads, not the multiply-adds, are what
 * a tile of one column runs out of. Per full group, a (row, column)'s 16 steps are summed exactly in
 * int32 and scaled as kernels.h says; the tail groups' dot products are gathered into one vector, a block
 * a lane, and scaled the same way. */
INLINE void int_tile(const job_t *j, const int fmt, const int R, const int C, int r0, int n) {
    const int nb = j->K / 32, groups = nb / 8, tail = nb - 8 * groups, bytes = fmt == FMT_Q4 ? nb * 16 : nb * 32;
    __m256 acc[MAX_R][MAX_C];
    const uint8_t *column[MAX_C];
    const void *dn[MAX_C], *mn[MAX_C];
    for (int c = 0; c < C; c++) {
        for (int r = 0; r < R; r++) acc[r][c] = _mm256_setzero_ps();
        column[c] = (const uint8_t *)j->w + (size_t)(n + c) * bytes;
        dn[c] = ss_scale_row(j, j->d, n + c), mn[c] = fmt == FMT_Q4 ? ss_scale_row(j, j->m, n + c) : 0;
        ss_prefetch_column(j, n + c);
    }
    const int16_t *qx = j->qx + (size_t)r0 * nb * 32;
    const float *dx = j->dx + (size_t)r0 * nb, *xs = j->xsum + (size_t)r0 * nb;
    for (int g = 0; g < groups; g++) {
        __m512i isum[MAX_R][MAX_C];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) isum[r][c] = _mm512_setzero_si512();
        if (fmt == FMT_Q4) {
            for (int s = 0; s < 8; s += 2) { /* 32 bytes: steps s, s + 1 low, s + 8, s + 9 high */
                __m512i lo[MAX_C], hi[MAX_C];
                for (int c = 0; c < C; c++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(column[c] + g * 128 + s * 16));
                    lo[c] = _mm512_cvtepu8_epi16(_mm256_and_si256(raw, _mm256_set1_epi8(0x0F)));
                    hi[c] = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F)));
                }
                for (int r = 0; r < R; r++) {
                    const int16_t *x = qx + ((size_t)r * nb + 8 * g) * 32;
                    const __m512i xl = _mm512_loadu_si512(x + 16 * s), xh = _mm512_loadu_si512(x + 16 * (s + 8));
                    for (int c = 0; c < C; c++) {
                        isum[r][c] = DP512(isum[r][c], lo[c], xl);
                        isum[r][c] = DP512(isum[r][c], hi[c], xh);
                    }
                }
            }
        } else {
            for (int s = 0; s < 16; s += 2) { /* 32 int8: steps s, s + 1 */
                __m512i w[MAX_C];
                for (int c = 0; c < C; c++)
                    w[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(column[c] + g * 256 + s * 16)));
                for (int r = 0; r < R; r++) {
                    const __m512i xv = _mm512_loadu_si512(qx + ((size_t)r * nb + 8 * g) * 32 + 16 * s);
                    for (int c = 0; c < C; c++) isum[r][c] = DP512(isum[r][c], w[c], xv);
                }
            }
        }
        for (int c = 0; c < C; c++) {
            const __m256 d8 = scales8(j, dn[c], 8 * g);
            for (int r = 0; r < R; r++) {
                const size_t at = (size_t)r * nb + 8 * g;
                const __m512i sum = isum[r][c];
                const __m256i dot = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d8, _mm256_loadu_ps(dx + at)), acc[r][c]);
                if (fmt == FMT_Q4) acc[r][c] = _mm256_fmadd_ps(scales8(j, mn[c], 8 * g), _mm256_loadu_ps(xs + at), acc[r][c]);
            }
        }
    }
    if (tail) {
        const int b0 = 8 * groups;
        for (int c = 0; c < C; c++) {
            __m256i dots[MAX_R];
            for (int r = 0; r < R; r++) dots[r] = _mm256_setzero_si256();
            int first = b0;
            if (tail & 4) tail_group(j, fmt, R, 4, column[c], first, first - b0, qx, dots), first += 4;
            if (tail & 2) tail_group(j, fmt, R, 2, column[c], first, first - b0, qx, dots), first += 2;
            if (tail & 1) tail_group(j, fmt, R, 1, column[c], first, first - b0, qx, dots);
            const __m256 dt = scales_first(j, dn[c], b0, tail);
            for (int r = 0; r < R; r++) {
                const size_t at = (size_t)r * nb + b0;
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_mul_ps(dt, load_first(dx + at, tail)), acc[r][c]);
                if (fmt == FMT_Q4) acc[r][c] = _mm256_fmadd_ps(scales_first(j, mn[c], b0, tail), load_first(xs + at, tail), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = r8(acc[r][c]);
            if (j->bias) s += j->bias[n + c];
            j->out[(size_t)(r0 + r) * j->N + n + c] = s;
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

/* An integer tile's columns for R rows: as many as the registers hold (R x C accumulators). */
#define INT_COLUMNS(R) ((R) <= 2 ? 4 : 2)

/* Rows r0 .. r0 + R - 1 of columns c0 .. c1 - 1 in tiles of INT_COLUMNS(R) columns, the rest one by one. */
INLINE void int_rows(const job_t *j, const int fmt, const int R, int r0, int c0, int c1) {
    const int C = INT_COLUMNS(R);
    int n = c0;
    for (; n + C <= c1; n += C) int_tile(j, fmt, R, C, r0, n);
    for (; n < c1; n++) int_tile(j, fmt, R, 1, r0, n);
}

/* Float formats: 4 rows a tile, one column. */
INLINE void float_rows(const job_t *j, const int fmt, const int R, int r0, int c0, int c1) {
    for (int n = c0; n < c1; n++) float_tile(j, fmt, R, r0, n);
}

INLINE void rows(const job_t *j, const int fmt, const int R, int r0, int c0, int c1) {
    if (fmt == FMT_Q4 || fmt == FMT_Q8) int_rows(j, fmt, R, r0, c0, c1);
    else float_rows(j, fmt, R, r0, c0, c1);
}

/* Columns in chunks whose weights stay in cache while every tile of 4 rows passes over them. */
INLINE void columns_fmt(const job_t *j, const int fmt, int n0, int n1) {
    const int rest = j->M % 4, full = j->M - rest;
    for (int c0 = n0; c0 < n1; c0 += 16) {
        const int c1 = c0 + 16 < n1 ? c0 + 16 : n1;
        for (int r0 = 0; r0 < full; r0 += 4) rows(j, fmt, 4, r0, c0, c1);
        if (rest == 3) rows(j, fmt, 3, full, c0, c1);
        else if (rest == 2) rows(j, fmt, 2, full, c0, c1);
        else if (rest == 1) rows(j, fmt, 1, full, c0, c1);
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
