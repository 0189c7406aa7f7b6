/* The 512-bit paths: AVX-512 F/BW/VL and, built with -DSS_VNNI, AVX-512 VNNI (vpdpwssd: the int16
 * multiply-adds fused with their accumulation, 32 a instruction; with int8 activations, Q4 and Q8 on
 * vpdpbusd's 64 byte multiply-adds, in vec512.h), and, built with -DSS_BF16 as well, AVX-512 BF16: the
 * AVX-512 VNNI path with the BF16 linear on bf16 activations on vdpbf16ps (32 multiply-adds a
 * instruction, which the others do as two fp32 fmas of 16). Bit for bit the canonical order of
 * kernels.h: a lane is one of a panel's 16 columns, and its block dot products are exact integers before
 * the one fp32 accumulation a column. Attention keeps the AVX2 path's 8 lanes a score, and a kv head's
 * query heads share each key and value that it reads. */
#include <immintrin.h>

#include "kernels.h"
#include "vec256.h"
#include "vec512.h"

#if defined(SS_VNNI) && defined(SS_BF16)
#define PATH ss_path_avx512_bf16
#define NAME "AVX-512 BF16"
#define NEEDS (SS_CPU_AVX2 | SS_CPU_AVX512 | SS_CPU_AVX512_VNNI | SS_CPU_AVX512_BF16)
#define BF16_ONLY 1
#elif defined(SS_VNNI)
#define PATH ss_path_avx512_vnni
#define NAME "AVX-512 VNNI"
#define NEEDS (SS_CPU_AVX2 | SS_CPU_AVX512 | SS_CPU_AVX512_VNNI)
#endif
#ifdef SS_VNNI
/* acc + a . b pairwise (int16 -> int32), in asm: GCC copies the intrinsic's accumulator in and out of
 * another register on every iteration, which doubles the loop's instructions */
static inline __attribute__((always_inline)) __m512i dp512(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
    return acc;
}
#define DP512(acc, a, b) dp512((acc), (a), (b))
/* acc + a . (the int16 pair at p, broadcast): the broadcast folded into the multiply-add's load */
static inline __attribute__((always_inline)) __m512i dp512_pair(__m512i acc, __m512i a, const int32_t *p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*p));
    return acc;
}
#define DP512_PAIR(acc, a, p) dp512_pair((acc), (a), (p))
#else
#define PATH ss_path_avx512
#define NAME "AVX-512"
#define NEEDS (SS_CPU_AVX2 | SS_CPU_AVX512)
#define DP512(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#define DP512_PAIR(acc, a, p) DP512((acc), (a), _mm512_set1_epi32(*(p)))
#endif
#ifndef BF16_ONLY
#define BF16_ONLY 0
#endif
#define INLINE static inline __attribute__((always_inline))
#define MAX_R 8 /* rows per tile */
#define PREFETCH_PANELS 2 /* how far on the integer tiles ask for weights */
#define TILE_ROWS_Q4 7 /* Q4's own most: its 8-row tile runs out of registers */
#define MAX_C 2 /* panels per integer tile */

void ss_avx2_attend_group(const attn_t *a, int t, int g, const int *keys, int n, float *buf);

/* The two 8-lane halves added: lane l + lane l + 8 */
INLINE __m256 halves(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

static void quantise(const float *v, float levels, int16_t *q, int8_t *q8, float *scale, float *sum) {
    const __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
    const float s = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1))) / levels;
    *sum = r8(halves(_mm512_add_ps(x0, x1)));
    const __m512 inv = _mm512_set1_ps(s > 0.0f ? 1.0f / s : 0.0f);
    const __m512i r0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), r1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    _mm256_storeu_si256((__m256i *)q, _mm512_cvtsepi32_epi16(r0));
    _mm256_storeu_si256((__m256i *)(q + 16), _mm512_cvtsepi32_epi16(r1));
    if (q8) {
        _mm_storeu_si128((__m128i *)q8, _mm512_cvtsepi32_epi8(r0));
        _mm_storeu_si128((__m128i *)(q8 + 16), _mm512_cvtsepi32_epi8(r1));
    }
    *scale = s;
}

/* SS_PANEL scales (d or m) of a panel's block b, floats or halves. */
INLINE __m512 scales16(const job_t *j, const void *panel, int b) {
    return j->half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)panel + (size_t)b * SS_PANEL)))
                   : _mm512_loadu_ps((const float *)panel + (size_t)b * SS_PANEL);
}

/* Integer formats: rows r0 .. r0 + R - 1 of panels p .. p + C - 1 (R, C and fmt constant where inlined),
 * columns below n1. A lane is a column: per block, each (row, panel)'s 16 pair products are summed exactly
 * in int32, in two accumulators below 5 rows (two chains of multiply-adds in flight) and in one from 5 (the
 * rows are chains enough, and the second set spilled registers: Q8's 8-row tile ran 11 % faster on the
 * Zen 4), then scaled as kernels.h says in one fp32 accumulator a lane. Each weight vector is unpacked once
 * for the R rows. The first tile of rows asks memory for the panels PREFETCH_PANELS on while it computes. */
INLINE void int_tile(const job_t *j, const int fmt, const int R, const int C, int r0, int p, int n1) {
    const int nb = j->K / 32, bytes = fmt == FMT_Q4 ? 256 : 512;
    __m512 acc[MAX_R][MAX_C];
    const uint8_t *w[MAX_C];
    const void *dp[MAX_C], *mp[MAX_C];
    for (int c = 0; c < C; c++) {
        for (int r = 0; r < R; r++) acc[r][c] = _mm512_setzero_ps();
        w[c] = ss_panel_weights(j, p + c);
        dp[c] = ss_panel_scales(j, j->d, p + c), mp[c] = fmt == FMT_Q4 ? ss_panel_scales(j, j->m, p + c) : 0;
    }
    const int32_t *qx = (const int32_t *)(j->qx + (size_t)r0 * nb * 32); /* activation pairs, 16 a block */
    const size_t ahead = (size_t)PREFETCH_PANELS * nb * bytes;
    const int fetch = r0 == 0 && p + C + PREFETCH_PANELS <= (j->N + SS_PANEL - 1) / SS_PANEL;
    for (int b = 0; b < nb; b++) {
        if (fetch)
            for (int c = 0; c < C; c++)
                for (int at = 0; at < bytes; at += 64) _mm_prefetch((const char *)w[c] + ahead + (size_t)b * bytes + at, _MM_HINT_T1);
        __m512i lo[MAX_R][MAX_C], hi[MAX_R][MAX_C];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) lo[r][c] = hi[r][c] = _mm512_setzero_si512();
        /* Q4: 32 bytes give pairs i (low nibbles) and i + 8 (high); Q8: 32 bytes a pair, i and i + 1 */
        for (int i = 0; i < (fmt == FMT_Q4 ? 8 : 16); i += (fmt == FMT_Q4 ? 1 : 2)) {
            __m512i wa[MAX_C], wb[MAX_C];
            for (int c = 0; c < C; c++) {
                const uint8_t *at = w[c] + (size_t)b * bytes + i * 32;
                if (fmt == FMT_Q4) {
                    const __m512i z = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)at));
                    wa[c] = _mm512_and_si512(z, _mm512_set1_epi16(0x0F)), wb[c] = _mm512_srli_epi16(z, 4);
                } else {
                    wa[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)at));
                    wb[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(at + 32)));
                }
            }
            const int second = fmt == FMT_Q4 ? i + 8 : i + 1;
            for (int r = 0; r < R; r++) {
                const int32_t *x = qx + ((size_t)r * nb + b) * 16;
                for (int c = 0; c < C; c++) {
                    lo[r][c] = DP512_PAIR(lo[r][c], wa[c], x + i);
                    if (R >= 5) lo[r][c] = DP512_PAIR(lo[r][c], wb[c], x + second);
                    else hi[r][c] = DP512_PAIR(hi[r][c], wb[c], x + second);
                }
            }
        }
        for (int c = 0; c < C; c++) {
            const __m512 d16 = scales16(j, dp[c], b);
            for (int r = 0; r < R; r++) {
                const size_t at = (size_t)(r0 + r) * nb + b;
                const __m512 dot = _mm512_cvtepi32_ps(R >= 5 ? lo[r][c] : _mm512_add_epi32(lo[r][c], hi[r][c]));
                acc[r][c] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d16, _mm512_set1_ps(j->dx[at])), acc[r][c]);
                if (fmt == FMT_Q4) acc[r][c] = _mm512_fmadd_ps(scales16(j, mp[c], b), _mm512_set1_ps(j->xsum[at]), acc[r][c]);
            }
        }
    }
    for (int c = 0; c < C; c++) {
        const int n = (p + c) * SS_PANEL, valid = n1 - n < SS_PANEL ? n1 - n : SS_PANEL;
        const __mmask16 k = (__mmask16)((1u << valid) - 1);
        for (int r = 0; r < R; r++) {
            __m512 v = acc[r][c];
            if (j->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, j->bias + n));
            _mm512_mask_storeu_ps(j->out + (size_t)(r0 + r) * j->N + n, k, v);
        }
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

/* Float formats: rows r0 .. r0 + R - 1 (R <= 4) of column n; with `fetch`, memory is asked for column
 * n + 16 while it computes. */
INLINE void float_tile(const job_t *j, const int fmt, const int R, int r0, int n, int fetch) {
    const int nb = j->K / 32, K = j->K, line = fmt == FMT_F32 ? 128 : 64;
    const char *ahead = fetch ? (const char *)j->w + (size_t)(n + 16) * nb * line : 0;
    __m512 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float *x0 = j->x + (size_t)r0 * K;
    for (int b = 0; b < nb; b++) {
        if (fetch)
            for (int at = 0; at < line; at += 64) _mm_prefetch(ahead + (size_t)b * line + at, _MM_HINT_T1);
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

/* Panels per integer tile of R rows: 2 where the registers hold them (3 R accumulators a panel); one row
 * streams its panels one at a time, which keeps a decode step at memory speed (4 at once ran 1.4x
 * slower on the Zen 5). */
#define TILE_PANELS(R) ((R) == 1 ? 1 : (R) <= 4 ? 2 : 1)

/* Rows r0 .. r0 + R - 1 of panels p0 .. p1 - 1 in tiles of TILE_PANELS(R) panels, the rest one by one. */
INLINE void int_rows(const job_t *j, const int fmt, const int R, int r0, int p0, int p1, int n1) {
    const int C = TILE_PANELS(R);
    int p = p0;
    for (; p + C <= p1; p += C) int_tile(j, fmt, R, C, r0, p, n1);
    for (; p < p1; p++) int_tile(j, fmt, R, 1, r0, p, n1);
}

/* Columns n0 (a panel's first) .. n1 - 1, in chunks of panels whose weights stay in cache while every tile
 * of rows passes over them. */
INLINE void int_columns(const job_t *j, const int fmt, int n0, int n1) {
    const int last = (n1 + SS_PANEL - 1) / SS_PANEL, most = fmt == FMT_Q4 ? TILE_ROWS_Q4 : MAX_R;
    for (int p0 = n0 / SS_PANEL; p0 < last; p0 += 4) {
        const int p1 = p0 + 4 < last ? p0 + 4 : last;
        int r0 = 0;
        for (int tiles = (j->M + most - 1) / most; tiles > 0; tiles--) {
            const int R = (j->M - r0 + tiles - 1) / tiles; /* tiles as even as they go: 9 rows are 5 + 4 */
            switch (R) {
            case 8: int_rows(j, fmt, 8, r0, p0, p1, n1); break;
            case 7: int_rows(j, fmt, 7, r0, p0, p1, n1); break;
            case 6: int_rows(j, fmt, 6, r0, p0, p1, n1); break;
            case 5: int_rows(j, fmt, 5, r0, p0, p1, n1); break;
            case 4: int_rows(j, fmt, 4, r0, p0, p1, n1); break;
            case 3: int_rows(j, fmt, 3, r0, p0, p1, n1); break;
            case 2: int_rows(j, fmt, 2, r0, p0, p1, n1); break;
            default: int_rows(j, fmt, 1, r0, p0, p1, n1);
            }
            r0 += R;
        }
    }
}

/* Float formats: 4 rows a tile, in chunks of 16 columns whose weights stay in cache while every tile passes
 * over them. The first tile of a multi-row call asks memory for the next chunk while it computes (a row
 * alone streams at memory speed without): a bf16 target's 4-row verification ran 1.4-1.5x faster (Zen 4). */
INLINE void float_columns(const job_t *j, const int fmt, int n0, int n1) {
    const int rest = j->M % 4, full = j->M - rest;
    for (int c0 = n0; c0 < n1; c0 += 16) {
        const int c1 = c0 + 16 < n1 ? c0 + 16 : n1, fetch = j->M > 1 && c1 + 16 <= j->N;
        for (int r0 = 0; r0 < full; r0 += 4)
            for (int n = c0; n < c1; n++) float_tile(j, fmt, 4, r0, n, fetch && r0 == 0);
        for (int n = c0; n < c1; n++) {
            if (rest == 3) float_tile(j, fmt, 3, full, n, fetch && full == 0);
            else if (rest == 2) float_tile(j, fmt, 2, full, n, fetch && full == 0);
            else if (rest == 1) float_tile(j, fmt, 1, full, n, 0);
        }
    }
}

#ifdef SS_BF16
/* acc + the products of w's and x's 16 bfloat16 pairs, the odd first (kernels.h's B, twice a lane); x in a
 * register, loaded once for the tile's columns (as a memory operand, once a column: 4 rows ran 1.3x slower) */
INLINE __m512 dot_bf16(__m512 acc, __m512i w, __m512i x) {
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
}
#else
/* A vector of 32 bfloat16 as the 16 fp32 of its odd elements and the 16 of its even ones, exactly. */
INLINE __m512 odd_bf16(__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000))); }
INLINE __m512 even_bf16(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
#endif

/* BF16 weights on bf16 activations (kernels.h): the block at k of rows r0 .. r0 + R - 1 and columns n .. n + C
 * - 1 (R <= 4, C <= 2) into acc, the lanes of the even blocks or of the odd; with `fetch`, memory is asked for
 * columns n + 16 .. n + C + 15. Without AVX512-BF16 each vdpbf16ps is two fmas, under bf16_tile's DAZ and
 * FTZ. A tile passes over the blocks two at a time, so that each accumulator stays in its register. */
INLINE void bf16_block(const int R, const int C, const uint16_t *w, const uint16_t *x, int K, int k, int fetch,
                       __m512 acc[4][2]) {
    if (fetch)
        for (int c = 0; c < C; c++) _mm_prefetch((const char *)(w + (size_t)(16 + c) * K + k), _MM_HINT_T1);
#ifdef SS_BF16
    __m512i wv[2];
    for (int c = 0; c < C; c++) wv[c] = _mm512_loadu_si512(w + (size_t)c * K + k);
    for (int r = 0; r < R; r++) {
        const __m512i xv = _mm512_loadu_si512(x + (size_t)r * K + k);
        for (int c = 0; c < C; c++) acc[r][c] = dot_bf16(acc[r][c], wv[c], xv);
    }
#else
    __m512 wo[2], we[2];
    for (int c = 0; c < C; c++) {
        const __m512i v = _mm512_loadu_si512(w + (size_t)c * K + k);
        wo[c] = odd_bf16(v), we[c] = even_bf16(v);
    }
    for (int r = 0; r < R; r++) {
        const __m512i xv = _mm512_loadu_si512(x + (size_t)r * K + k);
        const __m512 xo = odd_bf16(xv), xe = even_bf16(xv);
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(we[c], xe, _mm512_fmadd_ps(wo[c], xo, acc[r][c]));
    }
#endif
}

INLINE void bf16_tile(const job_t *j, const int R, const int C, int r0, int n, int fetch) {
    const int K = j->K;
    const uint16_t *w = (const uint16_t *)j->w + (size_t)n * K, *x = j->xb + (size_t)r0 * K;
    __m512 even[4][2], odd[4][2]; /* the lanes of the even blocks, and of the odd */
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) even[r][c] = odd[r][c] = _mm512_setzero_ps();
#ifndef SS_BF16
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* DAZ and FTZ for the fmas alone: R8 and the bias add as usual */
#endif
    int k = 0;
    for (; k + 64 <= K; k += 64) {
        bf16_block(R, C, w, x, K, k, fetch, even);
        bf16_block(R, C, w, x, K, k + 32, fetch, odd);
    }
    if (k < K) bf16_block(R, C, w, x, K, k, fetch, even);
#ifndef SS_BF16
    _mm_setcsr(csr);
#endif
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = r8(halves(_mm512_add_ps(even[r][c], odd[r][c])));
            if (j->bias) s += j->bias[n + c];
            j->out[(size_t)(r0 + r) * j->N + n + c] = s;
        }
}

/* A tile of R rows (at most 4) and C columns (1 or 2). */
static void bf16_rows(const job_t *j, int R, int C, int r0, int n, int fetch) {
    switch ((R - 1) * 2 + C - 1) {
    case 7: bf16_tile(j, 4, 2, r0, n, fetch); break;
    case 6: bf16_tile(j, 4, 1, r0, n, fetch); break;
    case 5: bf16_tile(j, 3, 2, r0, n, fetch); break;
    case 4: bf16_tile(j, 3, 1, r0, n, fetch); break;
    case 3: bf16_tile(j, 2, 2, r0, n, fetch); break;
    case 2: bf16_tile(j, 2, 1, r0, n, fetch); break;
    case 1: bf16_tile(j, 1, 2, r0, n, fetch); break;
    default: bf16_tile(j, 1, 1, r0, n, fetch);
    }
}

/* BF16 weights on bf16 activations: tiles of 4 rows and 2 columns (four chains of vdpbf16ps, whose latency is 6
 * cycles on the Zen 4), in chunks of 16 columns whose weights stay in cache while every tile of rows passes
 * over them; the first tile asks memory for the next chunk while it computes (without, 2 columns at a time
 * streamed from memory at half the speed there). One row streams a column at a time without asking, as
 * the float formats' does: two chains, as many as fp32's fmas have, and on the Zen 4 the embedded model's
 * one-row linears ran 5-10 % slower 2 columns at a time and 5 % slower asking ahead. */
static void bf16_columns(const job_t *j, int n0, int n1) {
    const int C = j->M == 1 ? 1 : 2;
    for (int c0 = n0; c0 < n1; c0 += 16) {
        const int c1 = c0 + 16 < n1 ? c0 + 16 : n1, fetch = j->M > 1 && c1 + 16 <= j->N;
        for (int r0 = 0; r0 < j->M; r0 += 4)
            for (int n = c0; n < c1; n += C)
                bf16_rows(j, j->M - r0 < 4 ? j->M - r0 : 4, c1 - n < C ? c1 - n : C, r0, n, fetch && r0 == 0);
    }
}

static void columns(const job_t *j, int n0, int n1) {
    if (j->xb) {
        bf16_columns(j, n0, n1);
        return;
    }
#ifdef SS_VNNI
    if (int8_columns(j, n0, n1)) return; /* with int8 activations, vpdpbusd's byte multiply-adds (vec512.h) */
#endif
    switch (j->fmt) {
    case FMT_Q4: int_columns(j, FMT_Q4, n0, n1); break;
    case FMT_Q8: int_columns(j, FMT_Q8, n0, n1); break;
    case FMT_F16: float_columns(j, FMT_F16, n0, n1); break;
    case FMT_BF16: float_columns(j, FMT_BF16, n0, n1); break;
    default: float_columns(j, FMT_F32, n0, n1);
    }
}

INLINE __m512 join(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
INLINE __m256 low(__m512 v) { return _mm512_castps512_ps256(v); }
INLINE __m256 high(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
/* Elements e .. e + 7 of the keys at elements i and j of a KV cache of floats or halves, as floats: key i's
 * in the low half, key j's in the high one. */
INLINE __m512 two_keys(const int half, const void *cache, size_t i, size_t j) {
    if (!half) return join(_mm256_loadu_ps((const float *)cache + i), _mm256_loadu_ps((const float *)cache + j));
    const uint16_t *c = cache;
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(c + i))),
                                                   _mm_loadu_si128((const __m128i *)(c + j)), 1));
}
/* 16 elements from element i of a KV cache of floats or halves, as floats; only the first 8 when width < 16
 * (the rest zero, and not read). */
INLINE __m512 kv16(const int half, const void *cache, size_t i, int width) {
    if (width >= 16)
        return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + i)))
                    : _mm512_loadu_ps((const float *)cache + i);
    return half ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(0xFF, (const uint16_t *)cache + i))
                : _mm512_maskz_loadu_ps(0xFF, (const float *)cache + i);
}

#define MAX_HEADS 4 /* query heads attended together, sharing each key and value read */

/* Scores (kernels.h) of heads h .. h + C - 1 of row t against its n keys, head c's into s + c * S, and their
 * maxima: two keys in a register (8 lanes each), so that each key vector is loaded and converted once for
 * the C heads. */
INLINE void head_scores(const int C, const int D, const int half, const attn_t *a, int t, int h, const int *keys,
                        int n, float *s, float *mx) {
    const float *q0 = a->q + ((size_t)t * a->H + h) * D;
    const size_t kb = (size_t)(h / (a->H / a->Hkv)) * a->s_max * D; /* the kv head's first element */
    __m512 q[MAX_HEADS][16];                                         /* D <= 128; elements e .. e + 7 twice */
    for (int c = 0; c < C; c++)
        for (int e = 0; e < D; e += 8) q[c][e / 8] = join(_mm256_loadu_ps(q0 + c * D + e), _mm256_loadu_ps(q0 + c * D + e));
    const __m256 scale = _mm256_set1_ps(a->scale);
    __m256 vmx[MAX_HEADS];
    for (int c = 0; c < C; c++) vmx[c] = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m512 acc[MAX_HEADS][4];
        for (int c = 0; c < C; c++)
            for (int l = 0; l < 4; l++) acc[c][l] = _mm512_setzero_ps();
        if (i + 8 + PREFETCH_KEYS <= n)
            for (int l = 0; l < 8; l++) prefetch_kv(half, a->k, kb + (size_t)keys[i + PREFETCH_KEYS + l] * D, D);
        for (int e = 0; e < D; e += 8)
            for (int l = 0; l < 4; l++) {
                const __m512 k = two_keys(half, a->k, kb + (size_t)keys[i + 2 * l] * D + e,
                                          kb + (size_t)keys[i + 2 * l + 1] * D + e);
                for (int c = 0; c < C; c++) acc[c][l] = _mm512_fmadd_ps(q[c][e / 8], k, acc[c][l]);
            }
        for (int c = 0; c < C; c++) {
            __m256 lanes[8];
            for (int l = 0; l < 4; l++) lanes[2 * l] = low(acc[c][l]), lanes[2 * l + 1] = high(acc[c][l]);
            const __m256 y = _mm256_mul_ps(r8x8(lanes), scale);
            _mm256_storeu_ps(s + (size_t)c * a->S + i, y);
            vmx[c] = _mm256_max_ps(vmx[c], y);
        }
    }
    score_rest(C, D, half, a, q0, kb, keys, i, n, vmx, s, mx);
}

/* Heads h .. h + C - 1 of row t: scores, softmax weights, and the weighted values, 16 of a value's elements
 * in a register, each loaded and converted once for the C heads. */
INLINE void attend_heads(const int C, const int D, const int half, const attn_t *a, int t, int h, const int *keys,
                         int n, float *s) {
    float mx[MAX_HEADS], inv[MAX_HEADS];
    head_scores(C, D, half, a, t, h, keys, n, s, mx);
    for (int c = 0; c < C; c++) inv[c] = 1.0f / softmax_weights(s + (size_t)c * a->S, n, mx[c]);
    const size_t vb = (size_t)(h / (a->H / a->Hkv)) * a->s_max * D;
    float *out = a->out + ((size_t)t * a->H + h) * D;
    for (int e0 = 0; e0 < D; e0 += 64) {
        const int width = D - e0 < 64 ? D - e0 : 64, V = (width + 15) / 16;
        __m512 acc[MAX_HEADS][4];
        for (int c = 0; c < C; c++)
            for (int e = 0; e < V; e++) acc[c][e] = _mm512_setzero_ps();
        for (int i = 0; i < n; i++) {
            const size_t v = vb + (size_t)keys[i] * D + e0;
            if (i + PREFETCH_KEYS < n) prefetch_kv(half, a->v, vb + (size_t)keys[i + PREFETCH_KEYS] * D + e0, width);
            __m512 x[4];
            for (int e = 0; e < V; e++) x[e] = kv16(half, a->v, v + 16 * e, width - 16 * e);
            for (int c = 0; c < C; c++) {
                const __m512 p = _mm512_set1_ps(s[(size_t)c * a->S + i]);
                for (int e = 0; e < V; e++) acc[c][e] = _mm512_fmadd_ps(p, x[e], acc[c][e]);
            }
        }
        for (int c = 0; c < C; c++)
            for (int e = 0; e < V; e++) {
                const __m512 y = _mm512_mul_ps(acc[c][e], _mm512_set1_ps(inv[c]));
                float *o = out + (size_t)c * D + e0 + 16 * e;
                if (width - 16 * e >= 16) _mm512_storeu_ps(o, y);
                else _mm256_storeu_ps(o, low(y));
            }
    }
}

static void heads(int C, const attn_t *a, int t, int h, const int *keys, int n, float *buf) {
    switch (C) {
    case 1: WITH_CONSTANT_HEAD_SIZE(attend_heads, 1, a, t, h, keys, n, buf); break;
    case 2: WITH_CONSTANT_HEAD_SIZE(attend_heads, 2, a, t, h, keys, n, buf); break;
    case 3: WITH_CONSTANT_HEAD_SIZE(attend_heads, 3, a, t, h, keys, n, buf); break;
    default: WITH_CONSTANT_HEAD_SIZE(attend_heads, 4, a, t, h, keys, n, buf);
    }
}

/* One (row, kv head): its query heads up to MAX_HEADS at a time; head sizes that are not multiples of 8, or
 * above 128, on the AVX2 path's code. */
static void attend(const attn_t *a, int t, int g, int *keys, float *buf) {
    const int n = ss_keys(a, t, keys);
    if (a->D % 8 || a->D > 128) ss_avx2_attend_group(a, t, g, keys, n, buf);
    else attend_in_runs(heads, MAX_HEADS, a, t, g, keys, n, buf);
}

const ss_path_t PATH = {NAME, NEEDS, 1, quantise, columns, attend, BF16_ONLY};
