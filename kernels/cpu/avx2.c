/* The 256-bit paths: AVX2 with FMA and F16C, and, built with -DSS_VNNI, AVX-VNNI (the int16 multiply-adds
 * fused with their accumulation: vpdpwssd). Bit for bit the canonical order of kernels.h: a lane is one of
 * the 8 columns of half a panel, and an integer tile covers a whole panel. */
#include <immintrin.h>

#include "kernels.h"
#include "vec256.h"

#if defined(SS_VNNI) && defined(SS_VNNI_EMULATE)
/* The AVX-VNNI path's logic on AVX2 alone, for the tests of machines without AVX-VNNI: each fused
 * multiply-add as AVX2's multiplies and adds, exactly (vpdpbusd's bytes widened to int16 first). */
#define PATH ss_path_avx_vnni
#define NAME "AVX-VNNI (emulated)"
#define NEEDS SS_CPU_AVX2
static inline __attribute__((always_inline)) __m256i dpwssd(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}
static inline __attribute__((always_inline)) __m256i dpbusd(__m256i acc, __m256i a, __m256i b) {
    const __m256i a_even = _mm256_and_si256(a, _mm256_set1_epi16(0xFF)), a_odd = _mm256_srli_epi16(a, 8);
    const __m256i b_even = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), b_odd = _mm256_srai_epi16(b, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(a_even, b_even), _mm256_madd_epi16(a_odd, b_odd)));
}
#elif defined(SS_VNNI)
#define PATH ss_path_avx_vnni
#define NAME "AVX-VNNI"
#define NEEDS (SS_CPU_AVX2 | SS_CPU_AVX_VNNI)
/* acc + a . b pairwise (int16 -> int32) */
/* in asm: GCC copies the intrinsic's accumulator in and out of another register on every iteration */
static inline __attribute__((always_inline)) __m256i dpwssd(__m256i acc, __m256i a, __m256i b) {
    __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(a), "xm"(b));
    return acc;
}
/* acc + a . b by 4 bytes (a unsigned, b signed -> int32) */
static inline __attribute__((always_inline)) __m256i dpbusd(__m256i acc, __m256i a, __m256i b) {
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "xm"(b));
    return acc;
}
#endif
#ifdef SS_VNNI
/* lo += a . x, hi += b . y: two chains, so that each vpdpwssd waits on one of its own latency; 4 of them
 * a row leave registers for 2 rows a tile */
#define DOT_PAIRS(lo, hi, a, x, b, y) ((lo) = dpwssd((lo), (a), (x)), (hi) = dpwssd((hi), (b), (y)))
#define MAX_R 2 /* rows per tile */
#else
#define PATH ss_path_avx2
#define NAME "AVX2"
#define NEEDS SS_CPU_AVX2
/* lo += a . x + b . y (hi stays 0): the integer sums are exact in any order, and one accumulator a row
 * and half leaves registers for 4 rows a tile */
#define DOT_PAIRS(lo, hi, a, x, b, y) \
    ((lo) = _mm256_add_epi32((lo), _mm256_add_epi32(_mm256_madd_epi16((a), (x)), _mm256_madd_epi16((b), (y)))))
#define MAX_R 4 /* rows per tile */
#endif
#define MAX_R8 2 /* rows per int8 tile: AVX2's 2 int16 sums and 2 accumulators a row, AVX-VNNI's 4 chains */
#define INLINE static inline __attribute__((always_inline))
#define PREFETCH_PANELS 2 /* how far on the integer tiles ask for weights */
#define FLOAT_ROWS 3 /* rows per float tile: 4 accumulators a row */

static void quantise(const float *v, float levels, int16_t *q, int8_t *q8, float *scale, float *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], mx = _mm256_setzero_ps();
    for (int l = 0; l < 4; l++) {
        x[l] = _mm256_loadu_ps(v + 8 * l);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, x[l]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float s = _mm_cvtss_f32(h) / levels;
    *sum = r8(_mm256_add_ps(_mm256_add_ps(x[0], x[2]), _mm256_add_ps(x[1], x[3])));
    const __m256 inv = _mm256_set1_ps(s > 0.0f ? 1.0f / s : 0.0f);
    __m256i r[4];
    for (int l = 0; l < 4; l++) r[l] = _mm256_cvtps_epi32(_mm256_mul_ps(x[l], inv));
    /* int32 -> int16 in order: packs interleave 128-bit lanes, the permute puts them back */
    __m256i w[2];
    for (int l = 0; l < 2; l++) {
        w[l] = _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2 * l], r[2 * l + 1]), 0xD8);
        _mm256_storeu_si256((__m256i *)(q + 16 * l), w[l]);
    }
    /* int16 -> int8 in order, the same way */
    if (q8) _mm256_storeu_si256((__m256i *)q8, _mm256_permute4x64_epi64(_mm256_packs_epi16(w[0], w[1]), 0xD8));
    *scale = s;
}

/* The first n of 8 lanes, as a mask */
INLINE __m256i first_lanes(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }

/* A tile's outputs, rows r0 .. r0 + R - 1 of panel p (acc[r][h]: its columns 8h .. 8h + 7), below n1. */
INLINE void store_tile(const job_t *j, const int R, int r0, int p, int n1, __m256 acc[][2]) {
    for (int h = 0; h < 2; h++) {
        const int n = p * SS_PANEL + 8 * h, valid = n1 - n < 8 ? n1 - n : 8;
        if (valid <= 0) break;
        const __m256i k = first_lanes(valid);
        for (int r = 0; r < R; r++) {
            __m256 v = acc[r][h];
            if (j->bias) v = _mm256_add_ps(v, _mm256_maskload_ps(j->bias + n, k));
            _mm256_maskstore_ps(j->out + (size_t)(r0 + r) * j->N + n, k, v);
        }
    }
}

/* Integer formats: rows r0 .. r0 + R - 1 of panel p (its 16 columns, two vectors of 8; R and fmt
 * constant where inlined), columns below n1. A lane is a column: per block, each row's 16 pair products
 * are summed exactly in int32, then scaled as kernels.h says into one fp32 accumulator a lane. Each
 * broadcast activation pair serves both halves of the panel, so a tile issues half the broadcasts (loads)
 * a tile of half a panel would. */
INLINE void int_tile(const job_t *j, const int fmt, const int R, int r0, int p, int n1) {
    const int nb = j->K / 32, bytes = fmt == FMT_Q4 ? 256 : 512;
    __m256 acc[MAX_R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const uint8_t *w = ss_panel_weights(j, p);
    const void *dp = ss_panel_scales(j, j->d, p), *mp = fmt == FMT_Q4 ? ss_panel_scales(j, j->m, p) : 0;
    const int32_t *qx = (const int32_t *)(j->qx + (size_t)r0 * nb * 32); /* activation pairs, 16 a block */
    /* the panel PREFETCH_PANELS on, asked of memory while this one computes (by the first tile of rows) */
    const size_t ahead = (size_t)PREFETCH_PANELS * nb * bytes;
    const int fetch = r0 == 0 && p + 1 + PREFETCH_PANELS <= (j->N + SS_PANEL - 1) / SS_PANEL;
    for (int b = 0; b < nb; b++) {
        if (fetch)
            for (int at = 0; at < bytes; at += 64) _mm_prefetch((const char *)w + ahead + (size_t)b * bytes + at, _MM_HINT_T1);
        __m256i lo[MAX_R][2], hi[MAX_R][2];
        for (int r = 0; r < R; r++) lo[r][0] = lo[r][1] = hi[r][0] = hi[r][1] = _mm256_setzero_si256();
        /* Q4: a column's 2 bytes give pairs i (low nibbles) and i + 8 (high); Q8: 2 bytes a pair, i and i + 1 */
        for (int i = 0; i < (fmt == FMT_Q4 ? 8 : 16); i += (fmt == FMT_Q4 ? 1 : 2)) {
            const uint8_t *at = w + (size_t)b * bytes + i * 32;
            __m256i wa[2], wb[2];
            for (int h = 0; h < 2; h++) {
                if (fmt == FMT_Q4) {
                    const __m256i z = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(at + 16 * h)));
                    wa[h] = _mm256_and_si256(z, _mm256_set1_epi16(0x0F)), wb[h] = _mm256_srli_epi16(z, 4);
                } else {
                    wa[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(at + 16 * h)));
                    wb[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(at + 32 + 16 * h)));
                }
            }
            const int second = fmt == FMT_Q4 ? i + 8 : i + 1;
            for (int r = 0; r < R; r++) {
                const int32_t *x = qx + ((size_t)r * nb + b) * 16;
                const __m256i xa = _mm256_set1_epi32(x[i]), xb = _mm256_set1_epi32(x[second]);
                for (int h = 0; h < 2; h++) DOT_PAIRS(lo[r][h], hi[r][h], wa[h], xa, wb[h], xb);
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d8 = scales8(j, dp, b * SS_PANEL + 8 * h);
            for (int r = 0; r < R; r++) {
                const size_t at = (size_t)(r0 + r) * nb + b;
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo[r][h], hi[r][h])), _mm256_mul_ps(d8, _mm256_set1_ps(j->dx[at])), acc[r][h]);
                if (fmt == FMT_Q4) acc[r][h] = _mm256_fmadd_ps(scales8(j, mp, b * SS_PANEL + 8 * h), _mm256_set1_ps(j->xsum[at]), acc[r][h]);
            }
        }
    }
    store_tile(j, R, r0, p, n1, acc);
}

/* A panel's 16 scales (d or m) of block b as the int8 tiles' lanes hold its columns: columns 0-3 and 8-11,
 * then 4-7 and 12-15 (what vpunpck*wd's 128-bit lanes give). */
INLINE void scales16_split(const job_t *j, const void *panel, int b, __m256 s[2]) {
    const __m256 a = scales8(j, panel, b * SS_PANEL), c = scales8(j, panel, b * SS_PANEL + 8);
    s[0] = _mm256_permute2f128_ps(a, c, 0x20), s[1] = _mm256_permute2f128_ps(a, c, 0x31);
}

/* The integer formats with int8 activations: rows r0 .. r0 + R - 1 of panel p, columns below n1. Each
 * block's exact integer dot products come from byte multiply-adds of the weights with the int8
 * activations; their lanes hold the columns in scales16_split's order, scaled as kernels.h says, and put
 * back in order when stored. AVX2 runs Q4 alone (Q8's signed bytes would cost vpmaddubsw a sign a row). */
INLINE void int8_tile(const job_t *j, const int fmt, const int R, int r0, int p, int n1) {
    const int nb = j->K / 32, bytes = fmt == FMT_Q4 ? 256 : 512;
    __m256 acc[MAX_R8][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const uint8_t *w = ss_panel_weights(j, p);
    const void *dp = ss_panel_scales(j, j->d, p), *mp = fmt == FMT_Q4 ? ss_panel_scales(j, j->m, p) : 0;
    const size_t ahead = (size_t)PREFETCH_PANELS * nb * bytes;
    const int fetch = r0 == 0 && p + 1 + PREFETCH_PANELS <= (j->N + SS_PANEL - 1) / SS_PANEL;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * bytes;
        if (fetch)
            for (int at = 0; at < bytes; at += 64) _mm_prefetch((const char *)wb + ahead + at, _MM_HINT_T1);
        __m256i sum[MAX_R8][2];
#ifdef SS_VNNI
        /* a lane is a column's 4 bytes of pairs i and i + 1, interleaved: Q4's elements 2i .. 2i + 3 in the
         * low nibbles and 2i + 16 .. 2i + 19 in the high ones; Q8's 2i .. 2i + 3, each plus 128 to make it
         * unsigned, 128 times the block's sum taken back below. Two chains a (row, half). */
        const int8_t *qx = j->qx8 + (size_t)r0 * nb * 32;
        __m256i more[MAX_R8][2];
        for (int r = 0; r < R; r++) sum[r][0] = sum[r][1] = more[r][0] = more[r][1] = _mm256_setzero_si256();
        for (int i = 0; i < (fmt == FMT_Q4 ? 8 : 16); i += (fmt == FMT_Q4 ? 2 : 4)) {
            __m256i a[2], c[2]; /* the chains' weights, against the activations at 2i and at 2i + off */
            const int off = fmt == FMT_Q4 ? 16 : 4;
            for (int half = 0; half < (fmt == FMT_Q4 ? 1 : 2); half++) {
                const __m256i z0 = _mm256_loadu_si256((const __m256i *)(wb + (i + 2 * half) * 32));
                const __m256i z1 = _mm256_loadu_si256((const __m256i *)(wb + (i + 2 * half + 1) * 32));
                const __m256i u[2] = {_mm256_unpacklo_epi16(z0, z1), _mm256_unpackhi_epi16(z0, z1)};
                for (int h = 0; h < 2; h++) {
                    if (fmt == FMT_Q4) {
                        a[h] = _mm256_and_si256(u[h], nibble), c[h] = _mm256_and_si256(_mm256_srli_epi16(u[h], 4), nibble);
                    } else if (half == 0) {
                        a[h] = _mm256_xor_si256(u[h], _mm256_set1_epi8(-128));
                    } else {
                        c[h] = _mm256_xor_si256(u[h], _mm256_set1_epi8(-128));
                    }
                }
            }
            for (int r = 0; r < R; r++) {
                const int8_t *x = qx + ((size_t)r * nb + b) * 32;
                int32_t xa, xc;
                memcpy(&xa, x + 2 * i, 4), memcpy(&xc, x + 2 * i + off, 4);
                const __m256i va = _mm256_set1_epi32(xa), vc = _mm256_set1_epi32(xc);
                for (int h = 0; h < 2; h++) sum[r][h] = dpbusd(sum[r][h], a[h], va), more[r][h] = dpbusd(more[r][h], c[h], vc);
            }
        }
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++) {
                sum[r][h] = _mm256_add_epi32(sum[r][h], more[r][h]);
                if (fmt == FMT_Q8)
                    sum[r][h] = _mm256_sub_epi32(sum[r][h], _mm256_set1_epi32(128 * j->sum8[(size_t)(r0 + r) * nb + b]));
            }
#else
        /* a 16-bit lane is a column's pair: vpmaddubsw's sums of two products, at most 2 * 15 * 127, added in
         * int16 over pairs 0-3 and 8-11, then 4-7 and 12-15 (at most 30480 each), then widened */
        const int32_t *qx16 = (const int32_t *)(j->qx + (size_t)r0 * nb * 32);
        const __m256i low_bytes = _mm256_set1_epi32(0x02000200);
        __m256i s16[MAX_R8][2];
        for (int r = 0; r < R; r++) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
        for (int i = 0; i < 8; i++) {
            const __m256i z = _mm256_loadu_si256((const __m256i *)(wb + i * 32));
            const __m256i lo = _mm256_and_si256(z, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(z, 4), nibble);
            for (int r = 0; r < R; r++) {
                const int32_t *x = qx16 + ((size_t)r * nb + b) * 16;
                const __m256i xa = _mm256_shuffle_epi8(_mm256_set1_epi32(x[i]), low_bytes);
                const __m256i xc = _mm256_shuffle_epi8(_mm256_set1_epi32(x[i + 8]), low_bytes);
                const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xc));
                s16[r][i >> 2] = _mm256_add_epi16(s16[r][i >> 2], t);
            }
        }
        const __m256i ones = _mm256_set1_epi16(1);
        for (int r = 0; r < R; r++) {
            sum[r][0] = _mm256_madd_epi16(_mm256_unpacklo_epi16(s16[r][0], s16[r][1]), ones);
            sum[r][1] = _mm256_madd_epi16(_mm256_unpackhi_epi16(s16[r][0], s16[r][1]), ones);
        }
#endif
        __m256 d[2], m[2];
        scales16_split(j, dp, b, d);
        if (fmt == FMT_Q4) scales16_split(j, mp, b, m);
        for (int r = 0; r < R; r++) {
            const size_t at = (size_t)(r0 + r) * nb + b;
            const __m256 dx = _mm256_set1_ps(j->dx[at]);
            for (int h = 0; h < 2; h++) {
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h]), _mm256_mul_ps(d[h], dx), acc[r][h]);
                if (fmt == FMT_Q4) acc[r][h] = _mm256_fmadd_ps(m[h], _mm256_set1_ps(j->xsum[at]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const __m256 a = acc[r][0], c = acc[r][1];
        acc[r][0] = _mm256_permute2f128_ps(a, c, 0x20), acc[r][1] = _mm256_permute2f128_ps(a, c, 0x31);
    }
    store_tile(j, R, r0, p, n1, acc);
}

/* Columns n0 (a panel's first) .. n1 - 1, in chunks of 4 panels whose weights stay in cache while every
 * tile of rows passes over them; with int8 activations in their own tiles where this path has them. */
INLINE void int_columns(const job_t *j, const int fmt, int n0, int n1) {
    const int last = (n1 + SS_PANEL - 1) / SS_PANEL;
#ifdef SS_VNNI
    const int bytes8 = 1; /* Q4 and Q8 */
#else
    const int bytes8 = fmt == FMT_Q4;
#endif
    if (j->qx8 && bytes8) {
        const int rest = j->M % MAX_R8, full = j->M - rest;
        for (int p0 = n0 / SS_PANEL; p0 < last; p0 += 4) {
            const int p1 = p0 + 4 < last ? p0 + 4 : last;
            for (int p = p0; p < p1; p++) {
                for (int r0 = 0; r0 < full; r0 += MAX_R8) int8_tile(j, fmt, MAX_R8, r0, p, n1);
                if (rest == 1) int8_tile(j, fmt, 1, full, p, n1);
            }
        }
        return;
    }
    const int rest = j->M % MAX_R, full = j->M - rest;
    for (int p0 = n0 / SS_PANEL; p0 < last; p0 += 4) {
        const int p1 = p0 + 4 < last ? p0 + 4 : last;
        for (int p = p0; p < p1; p++) {
            for (int r0 = 0; r0 < full; r0 += MAX_R) int_tile(j, fmt, MAX_R, r0, p, n1);
            if (MAX_R > 3 && rest == 3) int_tile(j, fmt, 3, full, p, n1);
            else if (MAX_R > 2 && rest == 2) int_tile(j, fmt, 2, full, p, n1);
            else if (rest == 1) int_tile(j, fmt, 1, full, p, n1);
        }
    }
}

/* The 32 weights of block b of column n as 4 vectors of 8 floats. */
INLINE void float_block(const job_t *j, const int fmt, int n, int b, __m256 v[4]) {
    const size_t at = (size_t)n * j->K + b * 32;
    for (int i = 0; i < 4; i++) {
        if (fmt == FMT_F16) {
            v[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)j->w + at + 8 * i)));
        } else if (fmt == FMT_BF16) {
            __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)j->w + at + 8 * i));
            v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        } else {
            v[i] = _mm256_loadu_ps((const float *)j->w + at + 8 * i);
        }
    }
}

/* Rows r0 .. r0 + R - 1 of column n; with `fetch`, memory is asked for column n + 16 while it computes. */
INLINE void float_tile(const job_t *j, const int fmt, const int R, int r0, int n, int fetch) {
    const int nb = j->K / 32, K = j->K, line = fmt == FMT_F32 ? 128 : 64;
    const char *ahead = fetch ? (const char *)j->w + (size_t)(n + 16) * nb * line : 0;
    __m256 acc[FLOAT_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_ps();
    const float *x0 = j->x + (size_t)r0 * K;
    for (int b = 0; b < nb; b++) {
        if (fetch)
            for (int at = 0; at < line; at += 64) _mm_prefetch(ahead + (size_t)b * line + at, _MM_HINT_T1);
        __m256 v[4];
        float_block(j, fmt, n, b, v);
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 4; i++)
                acc[r][i] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(x0 + (size_t)r * K + b * 32 + 8 * i), acc[r][i]);
    }
    for (int r = 0; r < R; r++) {
        float s = r8(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][2]), _mm256_add_ps(acc[r][1], acc[r][3])));
        if (j->bias) s += j->bias[n];
        j->out[(size_t)(r0 + r) * j->N + n] = s;
    }
}

/* Float formats: FLOAT_ROWS rows a tile, in chunks of 16 columns whose weights stay in cache while every
 * tile passes over them. The first tile of a multi-row call asks memory for the next chunk while it
 * computes (a row alone streams at memory speed without). */
INLINE void float_columns(const job_t *j, const int fmt, int n0, int n1) {
    const int rest = j->M % FLOAT_ROWS, full = j->M - rest;
    for (int c0 = n0; c0 < n1; c0 += 16) {
        const int c1 = c0 + 16 < n1 ? c0 + 16 : n1, fetch = j->M > 1 && c1 + 16 <= j->N;
        for (int r0 = 0; r0 < full; r0 += FLOAT_ROWS)
            for (int n = c0; n < c1; n++) float_tile(j, fmt, FLOAT_ROWS, r0, n, fetch && r0 == 0);
        for (int n = c0; n < c1; n++) {
            if (rest == 2) float_tile(j, fmt, 2, full, n, fetch && full == 0);
            else if (rest == 1) float_tile(j, fmt, 1, full, n, 0);
        }
    }
}

/* 16 bfloat16 as the 8 fp32 of their odd elements and the 8 of their even ones, exactly. */
INLINE __m256 odd_bf16(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000))); }
INLINE __m256 even_bf16(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }

/* BF16 weights on bf16 activations (kernels.h): the block at k of rows r0 .. r0 + R - 1 of column n into acc (the
 * lanes of the even blocks or of the odd, each as two vectors), each vdpbf16ps as two fmas under
 * bf16_tile's DAZ and FTZ; with `fetch`, memory is asked for column n + 16. A tile passes over the blocks
 * two at a time, so that each accumulator stays in its register. */
INLINE void bf16_block(const int R, const uint16_t *w, const uint16_t *x, int K, int k, int fetch,
                       __m256 acc[FLOAT_ROWS][2]) {
    if (fetch) _mm_prefetch((const char *)(w + (size_t)16 * K + k), _MM_HINT_T1);
    __m256 wo[2], we[2];
    for (int i = 0; i < 2; i++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + k + 16 * i));
        wo[i] = odd_bf16(v), we[i] = even_bf16(v);
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 2; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(x + (size_t)r * K + k + 16 * i));
            acc[r][i] = _mm256_fmadd_ps(we[i], even_bf16(v), _mm256_fmadd_ps(wo[i], odd_bf16(v), acc[r][i]));
        }
}

INLINE void bf16_tile(const job_t *j, const int R, int r0, int n, int fetch) {
    const int K = j->K;
    const uint16_t *w = (const uint16_t *)j->w + (size_t)n * K, *x = j->xb + (size_t)r0 * K;
    __m256 even[FLOAT_ROWS][2], odd[FLOAT_ROWS][2]; /* lanes 0-7 and 8-15 of the even blocks, and of the odd */
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 2; i++) even[r][i] = odd[r][i] = _mm256_setzero_ps();
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* DAZ and FTZ for the fmas alone: R8 and the bias add as usual */
    int k = 0;
    for (; k + 64 <= K; k += 64) {
        bf16_block(R, w, x, K, k, fetch, even);
        bf16_block(R, w, x, K, k + 32, fetch, odd);
    }
    if (k < K) bf16_block(R, w, x, K, k, fetch, even);
    _mm_setcsr(csr);
    for (int r = 0; r < R; r++) {
        float s = r8(_mm256_add_ps(_mm256_add_ps(even[r][0], odd[r][0]), _mm256_add_ps(even[r][1], odd[r][1])));
        if (j->bias) s += j->bias[n];
        j->out[(size_t)(r0 + r) * j->N + n] = s;
    }
}

/* BF16 weights on bf16 activations: FLOAT_ROWS rows a tile, in chunks of 16 columns, as the float formats. */
static void bf16_columns(const job_t *j, int n0, int n1) {
    const int rest = j->M % FLOAT_ROWS, full = j->M - rest;
    for (int c0 = n0; c0 < n1; c0 += 16) {
        const int c1 = c0 + 16 < n1 ? c0 + 16 : n1, fetch = j->M > 1 && c1 + 16 <= j->N;
        for (int r0 = 0; r0 < full; r0 += FLOAT_ROWS)
            for (int n = c0; n < c1; n++) bf16_tile(j, FLOAT_ROWS, r0, n, fetch && r0 == 0);
        for (int n = c0; n < c1; n++) {
            if (rest == 2) bf16_tile(j, 2, full, n, fetch && full == 0);
            else if (rest == 1) bf16_tile(j, 1, full, n, 0);
        }
    }
}

static void columns(const job_t *j, int n0, int n1) {
    if (j->xb) {
        bf16_columns(j, n0, n1);
        return;
    }
    switch (j->fmt) {
    case FMT_Q4: int_columns(j, FMT_Q4, n0, n1); break;
    case FMT_Q8: int_columns(j, FMT_Q8, n0, n1); break;
    case FMT_F16: float_columns(j, FMT_F16, n0, n1); break;
    case FMT_BF16: float_columns(j, FMT_BF16, n0, n1); break;
    default: float_columns(j, FMT_F32, n0, n1);
    }
}

#define MAX_HEADS 3 /* query heads attended together, sharing each key and value read: 16 registers */

/* Scores (kernels.h) of heads h .. h + C - 1 of row t against its n keys, head c's into s + c * S, and their
 * maxima; each key vector is loaded and converted once for the C heads, 4 keys at a time. */
INLINE void head_scores(const int C, const int D, const int half, const attn_t *a, int t, int h, const int *keys,
                        int n, float *s, float *mx) {
    const float *q = a->q + ((size_t)t * a->H + h) * D;
    const size_t kb = (size_t)(h / (a->H / a->Hkv)) * a->s_max * D; /* the kv head's first element */
    const __m256 scale = _mm256_set1_ps(a->scale);
    __m256 vmx[MAX_HEADS];
    for (int c = 0; c < C; c++) vmx[c] = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        if (i + 8 + PREFETCH_KEYS <= n)
            for (int l = 0; l < 8; l++) prefetch_kv(half, a->k, kb + (size_t)keys[i + PREFETCH_KEYS + l] * D, D);
        __m256 quad[MAX_HEADS][2];
        for (int half_of_8 = 0; half_of_8 < 2; half_of_8++) {
            __m256 acc[MAX_HEADS][4];
            for (int c = 0; c < C; c++)
                for (int l = 0; l < 4; l++) acc[c][l] = _mm256_setzero_ps();
            for (int e = 0; e < D; e += 8)
                for (int l = 0; l < 4; l++) {
                    const __m256 k = kv8(half, a->k, kb + (size_t)keys[i + 4 * half_of_8 + l] * D + e);
                    for (int c = 0; c < C; c++) acc[c][l] = _mm256_fmadd_ps(_mm256_loadu_ps(q + c * D + e), k, acc[c][l]);
                }
            for (int c = 0; c < C; c++) quad[c][half_of_8] = r8x4(acc[c]);
        }
        for (int c = 0; c < C; c++) {
            const __m256 y = _mm256_mul_ps(r8_pairs(quad[c][0], quad[c][1]), scale);
            _mm256_storeu_ps(s + (size_t)c * a->S + i, y);
            vmx[c] = _mm256_max_ps(vmx[c], y);
        }
    }
    score_rest(C, D, half, a, q, kb, keys, i, n, vmx, s, mx);
}

/* Heads h .. h + C - 1 of row t: scores, softmax weights, and the weighted values, W of a value's elements
 * at a time (the accumulators stay in registers), each 8 loaded and converted once for the C heads. */
INLINE void attend_heads(const int C, const int D, const int half, const attn_t *a, int t, int h, const int *keys,
                         int n, float *s) {
    const int W = C == 1 ? 64 : 32;
    float mx[MAX_HEADS], inv[MAX_HEADS];
    head_scores(C, D, half, a, t, h, keys, n, s, mx);
    for (int c = 0; c < C; c++) inv[c] = 1.0f / softmax_weights(s + (size_t)c * a->S, n, mx[c]);
    const size_t vb = (size_t)(h / (a->H / a->Hkv)) * a->s_max * D;
    float *out = a->out + ((size_t)t * a->H + h) * D;
    for (int e0 = 0; e0 < D; e0 += W) {
        const int width = D - e0 < W ? D - e0 : W;
        __m256 acc[MAX_HEADS][8];
        for (int c = 0; c < C; c++)
            for (int e = 0; e < width / 8; e++) acc[c][e] = _mm256_setzero_ps();
        for (int i = 0; i < n; i++) {
            const size_t v = vb + (size_t)keys[i] * D + e0;
            if (i + PREFETCH_KEYS < n) prefetch_kv(half, a->v, vb + (size_t)keys[i + PREFETCH_KEYS] * D + e0, width);
            __m256 p[MAX_HEADS];
            for (int c = 0; c < C; c++) p[c] = _mm256_set1_ps(s[(size_t)c * a->S + i]);
            for (int e = 0; e < width / 8; e++) {
                const __m256 x = kv8(half, a->v, v + 8 * e);
                for (int c = 0; c < C; c++) acc[c][e] = _mm256_fmadd_ps(p[c], x, acc[c][e]);
            }
        }
        for (int c = 0; c < C; c++)
            for (int e = 0; e < width / 8; e++)
                _mm256_storeu_ps(out + (size_t)c * D + e0 + 8 * e, _mm256_mul_ps(acc[c][e], _mm256_set1_ps(inv[c])));
    }
}

static void heads(int C, const attn_t *a, int t, int h, const int *keys, int n, float *buf) {
    switch (C) {
    case 1: WITH_CONSTANT_HEAD_SIZE(attend_heads, 1, a, t, h, keys, n, buf); break;
    case 2: WITH_CONSTANT_HEAD_SIZE(attend_heads, 2, a, t, h, keys, n, buf); break;
    default: WITH_CONSTANT_HEAD_SIZE(attend_heads, 3, a, t, h, keys, n, buf);
    }
}

/* Kv head g of row t, its n allowed keys given: its query heads up to MAX_HEADS at a time, or one by one on
 * the portable code for head sizes that are not multiples of 8. */
static void attend_group(const attn_t *a, int t, int g, const int *keys, int n, float *buf) {
    const int G = a->H / a->Hkv;
    if (a->D % 8 == 0) attend_in_runs(heads, MAX_HEADS, a, t, g, keys, n, buf);
    else
        for (int h = g * G; h < (g + 1) * G; h++) ss_portable_attend_head(a, t, h, keys, n, buf);
}

static void attend(const attn_t *a, int t, int g, int *keys, float *buf) { attend_group(a, t, g, keys, ss_keys(a, t, keys), buf); }

#ifndef SS_VNNI
/* The AVX-512 paths attend the head sizes they have no registers for through this one. */
void ss_avx2_attend_group(const attn_t *a, int t, int g, const int *keys, int n, float *buf) {
    attend_group(a, t, g, keys, n, buf);
}
#endif

const ss_path_t PATH = {NAME, NEEDS, 1, quantise, columns, attend, 0};
