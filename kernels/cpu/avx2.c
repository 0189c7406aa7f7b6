/* The 256-bit paths: AVX2 with FMA and F16C, and, built with -DSS_VNNI, AVX-VNNI (the int16 multiply-adds
 * fused with their accumulation: vpdpwssd). Bit for bit the canonical order of kernels.h. */
#include <immintrin.h>

#include "kernels.h"
#include "vec256.h"

#ifdef SS_VNNI
#define PATH ss_path_avx_vnni
#define NAME "AVX-VNNI"
#define NEEDS (SS_CPU_AVX2 | SS_CPU_AVX_VNNI)
/* acc + a . b pairwise (int16 -> int32) */
/* in asm: GCC copies the intrinsic's accumulator in and out of another register on every iteration */
static inline __attribute__((always_inline)) __m256i dpwssd(__m256i acc, __m256i a, __m256i b) {
    __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(a), "xm"(b));
    return acc;
}
#define DPWSSD(acc, a, b) dpwssd((acc), (a), (b))
#else
#define PATH ss_path_avx2
#define NAME "AVX2"
#define NEEDS SS_CPU_AVX2
#define DPWSSD(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#endif
#define INLINE static inline __attribute__((always_inline))
#define MAX_R 4 /* rows per tile: the integer formats' accumulators take 2 registers a row */

/* R8 of each of 8 vectors, as the 8 lanes of one */
INLINE __m256 r8x8(const __m256 a[8]) {
    __m256 h[4], q[2];
    for (int i = 0; i < 4; i++)
        h[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    q[0] = _mm256_hadd_ps(h[0], h[1]);
    q[1] = _mm256_hadd_ps(h[2], h[3]);
    return _mm256_permutevar8x32_ps(_mm256_hadd_ps(q[0], q[1]), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static void quantise(const float *v, int16_t *q, float *scale, float *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], mx = _mm256_setzero_ps();
    for (int l = 0; l < 4; l++) {
        x[l] = _mm256_loadu_ps(v + 8 * l);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, x[l]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float s = _mm_cvtss_f32(h) / 32767.0f;
    *sum = r8(_mm256_add_ps(_mm256_add_ps(x[0], x[2]), _mm256_add_ps(x[1], x[3])));
    const __m256 inv = _mm256_set1_ps(s > 0.0f ? 1.0f / s : 0.0f);
    __m256i r[4];
    for (int l = 0; l < 4; l++) r[l] = _mm256_cvtps_epi32(_mm256_mul_ps(x[l], inv));
    /* int32 -> int16 in order: packs interleave 128-bit lanes, the permute puts them back */
    for (int l = 0; l < 2; l++)
        _mm256_storeu_si256((__m256i *)(q + 16 * l), _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2 * l], r[2 * l + 1]), 0xD8));
    *scale = s;
}

/* 32 weights as int16, in w[0] and w[1]: Q4's 16 bytes at byte `at` (the low nibbles, then the high ones),
 * or Q8's 16 int8 at `at` and the 16 of the step 8 later, 128 bytes further on. */
INLINE void widen(const job_t *j, const int fmt, size_t at, __m256i w[2]) {
    if (fmt == FMT_Q4) {
        __m128i raw = _mm_loadu_si128((const __m128i *)((const uint8_t *)j->w + at));
        w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0F)));
        w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)));
        return;
    }
    const int8_t *q = (const int8_t *)j->w + at;
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 128)));
}

/* The first `n` of 8 floats at p, the rest 0 */
INLINE __m256 load_first(const float *p, int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
}

/* A tail group of g (4, 2 or 1) blocks at block `first`, its lanes from `off` on: each row's exact block
 * dot products added into lanes off .. off + g - 1 of dots[r]. */
INLINE void tail_group(const job_t *j, const int fmt, const int R, const int g, size_t column, int first, int off,
                       const int16_t *qx, __m256i dots[]) {
    const int nb = j->K / 32;
    __m256i w[8]; /* the group's 32 g values as int16, in its order */
    for (int c = 0; c < g; c++) {
        if (fmt == FMT_Q4) { /* low nibbles: values [0, 16 g), high: [16 g, 32 g) */
            const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint8_t *)j->w + column + first * 16 + 16 * c));
            w[c] = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0F)));
            w[g + c] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)));
        } else {
            const int8_t *q = (const int8_t *)j->w + column + first * 32 + 32 * c;
            w[2 * c] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
            w[2 * c + 1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
        }
    }
    /* lanes off .. off + g - 1 take the group's g sums, the others a zero lane (the first group's are in place) */
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i in = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(off), lanes),
                                           _mm256_cmpgt_epi32(_mm256_set1_epi32(off + g), lanes));
    const __m256i place = off ? _mm256_blendv_epi8(_mm256_set1_epi32(7), _mm256_sub_epi32(lanes, _mm256_set1_epi32(off)), in)
                              : lanes;
    for (int r = 0; r < R; r++) {
        const int16_t *x = qx + ((size_t)r * nb + first) * 32;
        __m256i sum = _mm256_setzero_si256();
        for (int c = 0; c < 2 * g; c++) sum = DPWSSD(sum, w[c], _mm256_loadu_si256((const __m256i *)(x + 16 * c)));
        /* lane l holds a part of block l % g: fold the halves until g lanes are left, the rest zero */
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        if (g <= 2) h = _mm_move_epi64(_mm_add_epi32(h, _mm_unpackhi_epi64(h, h)));
        if (g == 1) h = _mm_cvtsi32_si128(_mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 1))));
        const __m256i wide = _mm256_inserti128_si256(_mm256_setzero_si256(), h, 0); /* lanes 4..7 zero */
        dots[r] = _mm256_add_epi32(dots[r], off ? _mm256_permutevar8x32_epi32(wide, place) : wide);
    }
}

/* The first n scales of a column's row (d or m) from block b on, the rest 0. */
INLINE __m256 scales_first(const job_t *j, const void *row, int b, int n) {
    if (!j->half) return load_first((const float *)row + b, n);
    uint16_t h[8] = {0};
    memcpy(h, (const uint16_t *)row + b, sizeof(uint16_t) * n);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* Integer formats: rows r0 .. r0 + R - 1 of column n (R and fmt constant where inlined). Per full group,
 * each row's 16 steps are summed exactly in int32 (a lane: one block's 32 products, at most
 * 32 * 128 * 32768 < 2^31) and scaled as kernels.h says; the tail blocks' dot products are gathered
 * into one vector and scaled the same way, a block a lane. */
INLINE void int_tile(const job_t *j, const int fmt, const int R, int r0, int n) {
    const int nb = j->K / 32, groups = nb / 8, tail = nb - 8 * groups;
    __m256 acc[MAX_R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const void *dn = ss_scale_row(j, j->d, n), *mn = fmt == FMT_Q4 ? ss_scale_row(j, j->m, n) : 0;
    const int16_t *qx = j->qx + (size_t)r0 * nb * 32;
    const float *dx = j->dx + (size_t)r0 * nb, *xs = j->xsum + (size_t)r0 * nb;
    const size_t column = fmt == FMT_Q4 ? (size_t)n * nb * 16 : (size_t)n * nb * 32;
    ss_prefetch_column(j, n);
    for (int g = 0; g < groups; g++) {
        __m256i isum[MAX_R];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            __m256i w[2];
            widen(j, fmt, fmt == FMT_Q4 ? column + g * 128 + s * 16 : column + g * 256 + s * 16, w);
            for (int r = 0; r < R; r++) {
                const int16_t *x = qx + ((size_t)r * nb + 8 * g) * 32;
                isum[r] = DPWSSD(isum[r], w[0], _mm256_loadu_si256((const __m256i *)(x + 16 * s)));
                isum[r] = DPWSSD(isum[r], w[1], _mm256_loadu_si256((const __m256i *)(x + 16 * (s + 8))));
            }
        }
        const __m256 d8 = scales8(j, dn, 8 * g);
        for (int r = 0; r < R; r++) {
            const size_t at = (size_t)r * nb + 8 * g;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d8, _mm256_loadu_ps(dx + at)), acc[r]);
            if (fmt == FMT_Q4) acc[r] = _mm256_fmadd_ps(scales8(j, mn, 8 * g), _mm256_loadu_ps(xs + at), acc[r]);
        }
    }
    if (tail) {
        const int b0 = 8 * groups;
        __m256i dots[MAX_R];
        for (int r = 0; r < R; r++) dots[r] = _mm256_setzero_si256();
        int first = b0;
        if (tail & 4) tail_group(j, fmt, R, 4, column, first, first - b0, qx, dots), first += 4;
        if (tail & 2) tail_group(j, fmt, R, 2, column, first, first - b0, qx, dots), first += 2;
        if (tail & 1) tail_group(j, fmt, R, 1, column, first, first - b0, qx, dots);
        const __m256 dt = scales_first(j, dn, b0, tail);
        for (int r = 0; r < R; r++) {
            const size_t at = (size_t)r * nb + b0;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_mul_ps(dt, load_first(dx + at, tail)), acc[r]);
            if (fmt == FMT_Q4) acc[r] = _mm256_fmadd_ps(scales_first(j, mn, b0, tail), load_first(xs + at, tail), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s = r8(acc[r]);
        if (j->bias) s += j->bias[n];
        j->out[(size_t)(r0 + r) * j->N + n] = s;
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

INLINE void float_tile(const job_t *j, const int fmt, const int R, int r0, int n) {
    const int nb = j->K / 32, K = j->K;
    __m256 acc[MAX_R][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_ps();
    const float *x0 = j->x + (size_t)r0 * K;
    for (int b = 0; b < nb; b++) {
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

/* rows per tile: the integer formats' accumulators take 2 registers a row, the float formats' 4 */
#define TILE_ROWS(fmt) ((fmt) == FMT_Q4 || (fmt) == FMT_Q8 ? 4 : 3)

INLINE void tile(const job_t *j, const int fmt, const int R, int r0, int n) {
    if (fmt == FMT_Q4 || fmt == FMT_Q8) int_tile(j, fmt, R, r0, n);
    else float_tile(j, fmt, R, r0, n);
}

/* Columns in chunks whose weights stay in cache while every tile of rows passes over them. */
INLINE void columns_fmt(const job_t *j, const int fmt, int n0, int n1) {
    const int R = TILE_ROWS(fmt), rest = j->M % R, full = j->M - rest;
    for (int c0 = n0; c0 < n1; c0 += 16) {
        const int c1 = c0 + 16 < n1 ? c0 + 16 : n1;
        for (int r0 = 0; r0 < full; r0 += R)
            for (int n = c0; n < c1; n++) tile(j, fmt, R, r0, n);
        for (int n = c0; n < c1; n++) {
            if (rest == 3) tile(j, fmt, 3, full, n);
            else if (rest == 2) tile(j, fmt, 2, full, n);
            else if (rest == 1) tile(j, fmt, 1, full, n);
        }
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

/* exp8 of kernels.h, 8 lanes */
INLINE __m256 exp_ps(__m256 x) {
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

/* The 8 lanes of one score (kernels.h) before their R8, for a head size D that is a multiple of 8. */
INLINE __m256 score_lanes(const int D, const float *q, const float *k) {
    __m256 acc = _mm256_setzero_ps();
    for (int e = 0; e < D; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), _mm256_loadu_ps(k + e), acc);
    return acc;
}

/* out[e] = inv * sum_i p[i] v[keys[i]][e], 64 dimensions at a time (the accumulators stay in registers). */
INLINE void weighted_values(const int D, const float *p, const int *keys, int n, const float *vb, float inv, float *out) {
    for (int e0 = 0; e0 < D; e0 += 64) {
        const int width = D - e0 < 64 ? D - e0 : 64;
        __m256 acc[8];
        for (int e = 0; e < width / 8; e++) acc[e] = _mm256_setzero_ps();
        for (int i = 0; i < n; i++) {
            const __m256 pi = _mm256_set1_ps(p[i]);
            const float *v = vb + (size_t)keys[i] * D + e0;
            for (int e = 0; e < width / 8; e++) acc[e] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v + 8 * e), acc[e]);
        }
        for (int e = 0; e < width / 8; e++) _mm256_storeu_ps(out + e0 + 8 * e, _mm256_mul_ps(acc[e], _mm256_set1_ps(inv)));
    }
}

INLINE void attend_d(const int D, const attn_t *a, int t, int h, int *keys, float *buf) {
    const int kvh = h / (a->H / a->Hkv);
    const float *q = a->q + ((size_t)t * a->H + h) * D;
    const float *kb = a->k + (size_t)kvh * a->s_max * D, *vb = a->v + (size_t)kvh * a->s_max * D;
    const int n = ss_keys(a, t, keys);
    const __m256 scale = _mm256_set1_ps(a->scale);
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 lanes[8];
        for (int l = 0; l < 8; l++) lanes[l] = score_lanes(D, q, kb + (size_t)keys[i + l] * D);
        const __m256 sc = _mm256_mul_ps(r8x8(lanes), scale);
        _mm256_storeu_ps(buf + i, sc);
        vmx = _mm256_max_ps(vmx, sc);
    }
    float mx = -INFINITY, lanes[8];
    _mm256_storeu_ps(lanes, vmx);
    for (int l = 0; l < 8; l++) mx = lanes[l] > mx ? lanes[l] : mx;
    for (; i < n; i++) {
        buf[i] = r8(score_lanes(D, q, kb + (size_t)keys[i] * D)) * a->scale;
        mx = buf[i] > mx ? buf[i] : mx;
    }
    const __m256 vm = _mm256_set1_ps(mx);
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(buf + i, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(buf + i), vm)));
    if (i < n) {
        float tail[8] = {0};
        for (int l = 0; l < n - i; l++) tail[l] = buf[i + l] - mx;
        _mm256_storeu_ps(tail, exp_ps(_mm256_loadu_ps(tail)));
        for (int l = 0; l < n - i; l++) buf[i + l] = tail[l];
    }
    float sum = 0.0f;
    for (i = 0; i < n; i++) sum += buf[i];
    weighted_values(D, buf, keys, n, vb, 1.0f / sum, a->out + ((size_t)t * a->H + h) * D);
}

/* One (row, head); the head sizes of real models get their own constant-D copy. */
static void attend(const attn_t *a, int t, int h, int *keys, float *buf) {
    if (a->D == 64) attend_d(64, a, t, h, keys, buf);
    else if (a->D == 128) attend_d(128, a, t, h, keys, buf);
    else if (a->D % 8 == 0) attend_d(a->D, a, t, h, keys, buf);
    else ss_portable_attend(a, t, h, keys, buf);
}

#ifndef SS_VNNI
/* The AVX-512 paths attend through this one: attention is a small share of a step. */
void ss_avx2_attend(const attn_t *a, int t, int h, int *keys, float *buf) { attend(a, t, h, keys, buf); }
#endif

const ss_path_t PATH = {NAME, NEEDS, quantise, columns, attend};
