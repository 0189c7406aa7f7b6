/* Row-invariant CPU linears over packed weights: out[r, n] = x[r, :] . w[n, :] (+ bias[n]).
 *
 * Every output element is computed by the same sequence of operations whatever the number of rows in
 * the call, the row's place among them and the number of threads: per (row, column), accumulators
 * filled block by block of 32 weights in order and combined in a fixed order; each row's own
 * preparation (below) depends on that row alone. A verification of n tree nodes therefore computes,
 * bit for bit, what n one-row decode steps compute, and greedy speculation is exact by construction.
 * Rows are processed in tiles that share each unpacked weight block, so extra rows cost arithmetic,
 * not weight reads.
 *
 * Weight formats (K a multiple of 32; nb = K / 32 blocks per output row):
 *   Q4  qs [N][nb * 16] uint8, d and m [N][nb] fp32: w = d * q + m  (Q4_1 as stored; Q4_0 is m = -8 d)
 *   Q8  qs [N][nb * 32] int8, d [N][nb] fp32: w = d * q  (Q8_0)
 *   F16 w [N][K] IEEE half;  BF16 w [N][K] bfloat16;  F32 w [N][K] float
 * The integer formats' values are in "kernel order" (engine/cpu_backends.py packs them): each row's
 * blocks go in groups of 8, and a group holds 16 steps, step s being values 2s and 2s + 1 of each of its
 * 8 blocks in turn (16 values), so that one multiply-add of a step with the activations' step leaves one
 * block's partial dot product per lane and a group's 8 blocks are scaled with one vector operation. Q8
 * stores the 16 steps as 16 int8 each; Q4 stores steps s and s + 8 in one 16 bytes (low, high nibbles).
 * The last nb % 8 blocks are stored as GGUF stores a block: 32 int8 (Q8), or 16 bytes whose byte j holds
 * value j in its low nibble and j + 16 in its high one (Q4).
 * Q4 and Q8 multiply integers: each row's blocks of 32 are quantised to int16 with one fp32 scale
 * (absmax / 32767, round to nearest), the block's integer dot product (exact in int32, and in the fp32
 * it is converted to) is scaled by both scales, and Q4's offset term is m . (the exact fp32 sums of the
 * row's blocks). int16 rather than llama.cpp's int8: a block with one large activation (small models
 * have such channels) would leave the others a few levels of int8, and the error compounds over the
 * layers (5-6 % of the logits' range on SmolLM2 with int8, ~0.1 % with int16), at ~20 % more work per
 * row. The 16- and 32-bit formats multiply in fp32.
 *
 * Tree attention (ss_attention) follows the same rule: each (row, head) is one fixed pass over the
 * row's allowed keys (scores, a max, exponentials and the weighted sum of values, in key order).
 *
 * Threads: a small pool of its own splits the columns; each column is computed by one thread in the
 * same order, so results do not depend on the thread count either. Built by kernels/cpu_linear.py
 * with the host compiler for the machine at hand (-march=native); the AVX2 path and the portable one
 * each keep the invariants above (they need not agree with each other).
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SS_AVX2 1
#endif

enum { FMT_Q4 = 0, FMT_Q8 = 1, FMT_F16 = 2, FMT_BF16 = 3, FMT_F32 = 4 };
#define MAX_R 4 /* rows per tile, at most */
#ifndef INT_TILE_ROWS
#define INT_TILE_ROWS 4
#endif
/* rows per tile: the integer formats' accumulators take 2 registers a row, the float formats' 4 */
#define TILE_ROWS(fmt) ((fmt) == FMT_Q4 || (fmt) == FMT_Q8 ? INT_TILE_ROWS : 3)

typedef struct {
    int fmt, M, K, N;
    const float *x;      /* [M][K] fp32: the float formats */
    const int16_t *qx;   /* [M][nb][32]: Q4 and Q8 */
    const float *dx;     /* [M][nb] scales of qx */
    const float *xsum;   /* [M][nb] fp32 block sums of x: Q4 */
    const void *w;
    const float *d, *m, *bias;
    float *out;
} job_t;

#ifdef SS_AVX2
static inline float hsum(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

#endif

/* Each row's int16 blocks, their scales and (Q4) exact block sums, into one buffer per thread. Rounding
 * is to nearest even (the FPU's default mode, on either path). On the AVX2 path the blocks of each full
 * group of 8 are stored in kernel order (see the top), as the weights are. */
static int prepare_rows(job_t *j) {
    static _Thread_local void *buf;
    static _Thread_local size_t cap;
    const int nb = j->K / 32;
    const size_t blocks = (size_t)j->M * nb, need = blocks * (32 * sizeof(int16_t) + 2 * sizeof(float));
    if (need > cap) {
        free(buf);
        buf = malloc(need);
        cap = buf ? need : 0;
        if (!buf) return -1;
    }
    float *dx = buf, *xsum = dx + blocks;
    int16_t *qx = (int16_t *)(xsum + blocks);
    for (size_t i = 0; i < blocks; i++) {
        const float *v = j->x + i * 32;
#ifdef SS_AVX2
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 x[4], mx = _mm256_setzero_ps();
        for (int l = 0; l < 4; l++) {
            x[l] = _mm256_loadu_ps(v + 8 * l);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, x[l]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        xsum[i] = hsum(_mm256_add_ps(_mm256_add_ps(x[0], x[1]), _mm256_add_ps(x[2], x[3])));
        const float scale = amax / 32767.0f;
        const __m256 inv = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
        __m256i q[4];
        for (int l = 0; l < 4; l++) q[l] = _mm256_cvtps_epi32(_mm256_mul_ps(x[l], inv));
        /* int32 -> int16 in order: packs interleave 128-bit lanes, the permute puts them back */
        int16_t block[32];
        for (int l = 0; l < 2; l++) {
            __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * l], q[2 * l + 1]), 0xD8);
            _mm256_storeu_si256((__m256i *)(block + 16 * l), p);
        }
        const int b = (int)(i % nb), g = b / 8;
        if (g < nb / 8) { /* kernel order: pair s of block b goes to lanes 2 (b % 8), +1 of step s */
            int16_t *group = qx + (i - b + 8 * g) * 32;
            for (int s2 = 0; s2 < 16; s2++) memcpy(group + s2 * 16 + 2 * (b % 8), block + 2 * s2, 2 * sizeof(int16_t));
        } else {
            memcpy(qx + i * 32, block, sizeof block);
        }
        dx[i] = scale;
#else
        float amax = 0.0f, s[4] = {0};
        for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(v[k]));
        for (int k = 0; k < 32; k += 4)
            for (int l = 0; l < 4; l++) s[l] += v[k + l];
        const float scale = amax / 32767.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int k = 0; k < 32; k++) qx[i * 32 + k] = (int16_t)nearbyintf(v[k] * inv);
        dx[i] = scale;
        xsum[i] = (s[0] + s[1]) + (s[2] + s[3]);
#endif
    }
    j->qx = qx, j->dx = dx, j->xsum = xsum;
    return 0;
}

static inline void store(const job_t *j, int r, int n, float s) {
    if (j->bias) s += j->bias[n];
    j->out[(size_t)r * j->N + n] = s;
}

#ifdef SS_AVX2
/* 32 weights as int16, in w[0] and w[1]: Q4's 16 bytes at byte `at` (the low nibbles, then the high ones),
 * or Q8's 16 int8 at `at` and 16 more `apart` bytes further on. */
static inline __attribute__((always_inline)) void widen(const job_t *j, const int fmt, size_t at, int apart,
                                                        __m256i w[2]) {
    if (fmt == FMT_Q4) {
        __m128i raw = _mm_loadu_si128((const __m128i *)((const uint8_t *)j->w + at));
        w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0F)));
        w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)));
        return;
    }
    const int8_t *q = (const int8_t *)j->w + at;
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + apart)));
}

/* One tail block's 32 weights: values 0..15 in w[0], 16..31 in w[1]. */
static inline __attribute__((always_inline)) void int_block(const job_t *j, const int fmt, int n, int b, __m256i w[2]) {
    const size_t block = (size_t)n * (j->K / 32) + b;
    widen(j, fmt, fmt == FMT_Q4 ? block * 16 : block * 32, 16, w);
}

/* Steps s and s + 8 of group g of column n (kernel order, see the top). */
static inline __attribute__((always_inline)) void int_steps(const job_t *j, const int fmt, int n, int g, int s,
                                                            __m256i w[2]) {
    const size_t column = (size_t)n * (j->K / 32);
    widen(j, fmt, fmt == FMT_Q4 ? column * 16 + g * 128 + s * 16 : column * 32 + g * 256 + s * 16, 128, w);
}

/* Integer formats: rows r0 .. r0 + R - 1 of column n (R and fmt constant where inlined). Per full group,
 * each row's 16 steps are summed exactly in int32 (a lane: one block's 32 products, at most
 * 32 * 128 * 32768 < 2^31), converted to fp32 once and scaled by the 8 blocks' d * dx with one FMA, Q4's
 * offset m . xsum with another; the tail blocks are scaled one by one. */
static inline __attribute__((always_inline)) void int_tile(const job_t *j, const int fmt, const int R, int r0, int n) {
    const int nb = j->K / 32, groups = nb / 8;
    __m256 acc[MAX_R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const float *dn = j->d + (size_t)n * nb, *mn = fmt == FMT_Q4 ? j->m + (size_t)n * nb : 0;
    const int16_t *qx = j->qx + (size_t)r0 * nb * 32;
    const float *dx = j->dx + (size_t)r0 * nb, *xs = j->xsum + (size_t)r0 * nb;
    for (int g = 0; g < groups; g++) {
        __m256i isum[MAX_R];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            __m256i w[2];
            int_steps(j, fmt, n, g, s, w);
            for (int r = 0; r < R; r++) {
                const int16_t *x = qx + ((size_t)r * nb + 8 * g) * 32;
                const __m256i lo = _mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)(x + 16 * s)));
                const __m256i hi = _mm256_madd_epi16(w[1], _mm256_loadu_si256((const __m256i *)(x + 16 * (s + 8))));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(lo, hi));
            }
        }
        const __m256 d8 = _mm256_loadu_ps(dn + 8 * g);
        for (int r = 0; r < R; r++) {
            const size_t at = (size_t)r * nb + 8 * g;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d8, _mm256_loadu_ps(dx + at)), acc[r]);
            if (fmt == FMT_Q4) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(mn + 8 * g), _mm256_loadu_ps(xs + at), acc[r]);
        }
    }
    for (int b = 8 * groups; b < nb; b++) {
        __m256i w[2];
        int_block(j, fmt, n, b, w);
        for (int r = 0; r < R; r++) {
            const size_t at = (size_t)r * nb + b;
            const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)(qx + at * 32))),
                                                 _mm256_madd_epi16(w[1], _mm256_loadu_si256((const __m256i *)(qx + at * 32 + 16))));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dn[b] * dx[at]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s = hsum(acc[r]);
        if (fmt == FMT_Q4)
            for (int b = 8 * groups; b < nb; b++) s = fmaf(mn[b], xs[(size_t)r * nb + b], s);
        store(j, r0 + r, n, s);
    }
}

/* The 32 weights of block b of column n as 4 vectors of 8 floats. */
static inline __attribute__((always_inline)) void float_block(const job_t *j, const int fmt, int n, int b, __m256 v[4]) {
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

static inline __attribute__((always_inline)) void float_tile(const job_t *j, const int fmt, const int R, int r0, int n) {
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
    for (int r = 0; r < R; r++)
        store(j, r0 + r, n, hsum(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3]))));
}

static inline __attribute__((always_inline)) void tile(const job_t *j, const int fmt, const int R, int r0, int n) {
    if (fmt == FMT_Q4 || fmt == FMT_Q8) int_tile(j, fmt, R, r0, n);
    else float_tile(j, fmt, R, r0, n);
}

/* Columns in chunks whose weights stay in cache while every tile of rows passes over them. */
static inline __attribute__((always_inline)) void columns_fmt(const job_t *j, const int fmt, int n0, int n1) {
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
#else
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Value k of block b of column n, from the kernel order (see the top). */
static inline int int_weight(const job_t *j, int n, int b, int k) {
    const int nb = j->K / 32, g = b / 8;
    if (j->fmt == FMT_Q8) {
        const int8_t *q = (const int8_t *)j->w + (size_t)n * nb * 32;
        return g < nb / 8 ? q[g * 256 + (k / 2) * 16 + 2 * (b % 8) + k % 2] : q[b * 32 + k];
    }
    const uint8_t *q = (const uint8_t *)j->w + (size_t)n * nb * 16;
    if (g < nb / 8) {
        const int s = k / 2;
        return (q[g * 128 + (s % 8) * 16 + 2 * (b % 8) + k % 2] >> (s < 8 ? 0 : 4)) & 0x0F;
    }
    return (q[b * 16 + (k & 15)] >> (k < 16 ? 0 : 4)) & 0x0F;
}

static inline float float_weight(const job_t *j, int n, int k) {
    const size_t at = (size_t)n * j->K + k;
    if (j->fmt == FMT_F16) return half_to_float(((const uint16_t *)j->w)[at]);
    if (j->fmt == FMT_BF16) {
        uint32_t bits = (uint32_t)((const uint16_t *)j->w)[at] << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    return ((const float *)j->w)[at];
}

static void columns(const job_t *j, int n0, int n1) {
    const int nb = j->K / 32, K = j->K;
    for (int r = 0; r < j->M; r++) {
        for (int n = n0; n < n1; n++) {
            float s = 0.0f;
            if (j->fmt == FMT_Q4 || j->fmt == FMT_Q8) {
                for (int b = 0; b < nb; b++) {
                    const size_t blk = (size_t)n * nb + b, at = (size_t)r * nb + b;
                    const int16_t *xq = j->qx + at * 32;
                    int32_t dot = 0;
                    for (int k = 0; k < 32; k++) dot += int_weight(j, n, b, k) * xq[k];
                    s = fmaf((float)dot, j->d[blk] * j->dx[at], s);
                    if (j->fmt == FMT_Q4) s = fmaf(j->m[blk], j->xsum[at], s);
                }
            } else {
                const float *xr = j->x + (size_t)r * K;
                float acc[8] = {0};
                for (int k = 0; k < K; k += 8)
                    for (int l = 0; l < 8; l++) acc[l] = fmaf(float_weight(j, n, k + l), xr[k + l], acc[l]);
                s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
            }
            store(j, r, n, s);
        }
    }
}
#endif

/* ---- the thread pool: workers spin briefly on a generation counter, then sleep ----
 * A job is a number of units (a run of columns, an attention row and head) that the threads claim one at
 * a time from a shared counter, so a thread the OS preempts (another process wants the core) holds back
 * only the unit it is in, not a fixed share. The counter carries the job's generation: a worker that
 * claims a unit is sure of the job it read, and a late worker finds the units gone and goes back to
 * sleep without being waited for. */
#define MAX_THREADS 64
#define CLOSED 0xFFFFFFFFu
typedef void (*task_fn)(const void *job, int unit, int part);
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static atomic_int generation, done_units, n_threads = 1, n_started = 1;
static _Atomic uint64_t claim; /* generation << 32 | the next unclaimed unit (CLOSED while a job is set) */
static _Atomic(task_fn) current_fn;
static _Atomic(const void *) current_job;
static atomic_int current_units;

static void drain(int part) {
    for (;;) {
        uint64_t c = atomic_load_explicit(&claim, memory_order_acquire);
        const task_fn fn = atomic_load_explicit(&current_fn, memory_order_relaxed);
        const void *job = atomic_load_explicit(&current_job, memory_order_relaxed);
        const uint32_t unit = (uint32_t)c;
        if (unit == CLOSED || unit >= (uint32_t)atomic_load_explicit(&current_units, memory_order_relaxed)) return;
        if (!atomic_compare_exchange_weak_explicit(&claim, &c, c + 1, memory_order_acq_rel, memory_order_relaxed))
            continue; /* claimed by another thread, or a new job: read again */
        fn(job, (int)unit, part);
        atomic_fetch_add_explicit(&done_units, 1, memory_order_release);
    }
}

static void *worker(void *arg) {
    const int part = (int)(intptr_t)arg;
    int seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&generation, memory_order_acquire) == seen) {
            if (++spins < 20000) {
#ifdef SS_AVX2
                _mm_pause();
#endif
                continue;
            }
            pthread_mutex_lock(&mu);
            while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &mu);
            pthread_mutex_unlock(&mu);
        }
        seen = atomic_load(&generation);
        if (part < atomic_load(&n_threads)) drain(part);
    }
    return 0;
}

int ss_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    for (int i = atomic_load(&n_started); i < n; i++) {
        pthread_t t;
        if (pthread_create(&t, 0, worker, (void *)(intptr_t)i) != 0) return atomic_load(&n_threads);
        pthread_detach(t);
        atomic_store(&n_started, i + 1);
    }
    atomic_store(&n_threads, n);
    return n;
}

/* Runs fn over units 0 .. units - 1 on the pool's threads (the caller is part 0), or alone when small.
 * Not reentrant: one caller at a time (a rank's one compute thread). */
static void run(task_fn fn, const void *job, int units, int small) {
    if (atomic_load(&n_threads) == 1 || small || units <= 1) {
        for (int u = 0; u < units; u++) fn(job, u, 0);
        return;
    }
    const uint64_t g = (atomic_load(&claim) >> 32) + 1;
    atomic_store(&claim, g << 32 | CLOSED);
    atomic_store_explicit(&current_fn, fn, memory_order_relaxed);
    atomic_store_explicit(&current_job, job, memory_order_relaxed);
    atomic_store_explicit(&current_units, units, memory_order_relaxed);
    atomic_store_explicit(&done_units, 0, memory_order_relaxed);
    atomic_store_explicit(&claim, g << 32, memory_order_release);
    pthread_mutex_lock(&mu);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&mu);
    drain(0);
    while (atomic_load_explicit(&done_units, memory_order_acquire) < units) {
#ifdef SS_AVX2
        _mm_pause();
#endif
    }
}

/* Columns per unit of a linear: runs of 16, more for wide outputs (~128 units a call at most). */
static int column_grain(int N) {
    const int runs = (N + 16 * 128 - 1) / (16 * 128);
    return 16 * (runs > 1 ? runs : 1);
}

static void linear_unit(const void *job, int unit, int part) {
    const job_t *j = job;
    const int grain = column_grain(j->N), n0 = unit * grain, n1 = n0 + grain < j->N ? n0 + grain : j->N;
    (void)part;
    columns(j, n0, n1);
}

int ss_avx2(void) {
#ifdef SS_AVX2
    return 1;
#else
    return 0;
#endif
}

/* ---- tree attention ---- */
typedef struct {
    int T, H, Hkv, D, S, s_max;
    float scale;
    const float *q, *k, *v;
    const uint8_t *mask;
    float *out;
    char *scratch; /* per part: S floats (scores) and S ints (the allowed keys) */
} attn_t;

#ifdef SS_AVX2
/* exp(x) for x <= 0 (the scores minus their max): Cephes' polynomial on 2^n * e^r, ~1 ulp. */
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#ifdef SS_AVX2
/* Scores of 8 keys at once for a constant head size D: 8 dot products reduced together. */
static inline __attribute__((always_inline)) __m256 scores8(const int D, const float *q, const float *kb, const int *keys) {
    __m256 a[8];
    for (int l = 0; l < 8; l++) {
        const float *k = kb + (size_t)keys[l] * D;
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
        for (int e = 8; e < D; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), _mm256_loadu_ps(k + e), acc);
        a[l] = acc;
    }
    __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    /* h0 = [k0..k3 low lanes | k0..k3 high lanes], likewise h1 for k4..k7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

/* out = inv * sum_i p[i] v[keys[i]] for a constant head size D (the accumulators stay in registers). */
static inline __attribute__((always_inline)) void weighted_values(const int D, const float *p, const int *keys, int n,
                                                                  const float *vb, float inv, float *out) {
    __m256 acc[16];
    for (int e = 0; e < D / 8; e++) acc[e] = _mm256_setzero_ps();
    for (int i = 0; i < n; i++) {
        const __m256 pi = _mm256_set1_ps(p[i]);
        const float *v = vb + (size_t)keys[i] * D;
        for (int e = 0; e < D / 8; e++) acc[e] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v + 8 * e), acc[e]);
    }
    for (int e = 0; e < D / 8; e++) _mm256_storeu_ps(out + 8 * e, _mm256_mul_ps(acc[e], _mm256_set1_ps(inv)));
}
#endif

/* One (row, query head): scores over the allowed keys, softmax, weighted values; `buf` holds S floats. */
static void attend_one(const attn_t *a, int t, int h, int *keys, float *buf) {
    const int D = a->D, G = a->H / a->Hkv, kvh = h / G;
    const float *q = a->q + ((size_t)t * a->H + h) * D;
    const float *kb = a->k + (size_t)kvh * a->s_max * D, *vb = a->v + (size_t)kvh * a->s_max * D;
    const uint8_t *mrow = a->mask + (size_t)t * a->S;
    int n = 0;
    for (int s = 0; s < a->S; s++)
        if (mrow[s]) keys[n++] = s;
    float mx = -INFINITY;
    int first = 0;
#ifdef SS_AVX2
    if (D == 64 || D == 128) {
        __m256 scale = _mm256_set1_ps(a->scale), vmx = _mm256_set1_ps(-INFINITY);
        for (; first + 8 <= n; first += 8) {
            __m256 sc = _mm256_mul_ps(D == 64 ? scores8(64, q, kb, keys + first) : scores8(128, q, kb, keys + first), scale);
            _mm256_storeu_ps(buf + first, sc);
            vmx = _mm256_max_ps(vmx, sc);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, vmx);
        for (int l = 0; l < 8; l++) mx = lanes[l] > mx ? lanes[l] : mx;
    }
#endif
    for (int i = first; i < n; i++) {
        const float *k = kb + (size_t)keys[i] * D;
        float dot;
#ifdef SS_AVX2
        if (D % 16 == 0) {
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            for (int e = 0; e < D; e += 16) {
                acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), _mm256_loadu_ps(k + e), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e + 8), _mm256_loadu_ps(k + e + 8), acc1);
            }
            dot = hsum(_mm256_add_ps(acc0, acc1));
        } else
#endif
        {
            float acc[4] = {0};
            int e = 0;
            for (; e + 4 <= D; e += 4)
                for (int l = 0; l < 4; l++) acc[l] = fmaf(q[e + l], k[e + l], acc[l]);
            for (; e < D; e++) acc[0] = fmaf(q[e], k[e], acc[0]);
            dot = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        }
        buf[i] = dot * a->scale;
        mx = buf[i] > mx ? buf[i] : mx;
    }
    int i = 0;
#ifdef SS_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(buf + i, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(buf + i), _mm256_set1_ps(mx))));
    if (i < n) {
        float tail[8] = {0};
        for (int l = 0; l < n - i; l++) tail[l] = buf[i + l] - mx;
        _mm256_storeu_ps(tail, exp_ps(_mm256_loadu_ps(tail)));
        for (int l = 0; l < n - i; l++) buf[i + l] = tail[l];
    }
#else
    for (; i < n; i++) buf[i] = expf(buf[i] - mx);
#endif
    float sum = 0.0f;
    for (i = 0; i < n; i++) sum += buf[i];
    float *o = a->out + ((size_t)t * a->H + h) * D;
    const float inv = 1.0f / sum;
#ifdef SS_AVX2
    if (D == 64) { weighted_values(64, buf, keys, n, vb, inv, o); return; }
    if (D == 128) { weighted_values(128, buf, keys, n, vb, inv, o); return; }
#endif
    for (int e = 0; e < D; e++) {
        float acc = 0.0f;
        for (i = 0; i < n; i++) acc = fmaf(buf[i], vb[(size_t)keys[i] * D + e], acc);
        o[e] = acc * inv;
    }
}

static void attention_unit(const void *job, int unit, int part) {
    const attn_t *a = job;
    float *buf = (float *)(a->scratch + (size_t)part * a->S * (sizeof(float) + sizeof(int)));
    attend_one(a, unit / a->H, unit % a->H, (int *)(buf + a->S), buf);
}

/* q [T][H][D], k and v [Hkv][s_max][D] fp32, mask [T][S] bytes (nonzero = attend: every row needs one),
 * out [T][H][D]. Returns 0, or -1 when out of memory. */
int ss_attention(int T, int H, int Hkv, int D, int S, int s_max, float scale, const float *q, const float *k,
                 const float *v, const uint8_t *mask, float *out) {
    const int parts = atomic_load(&n_threads);
    char *scratch = malloc((size_t)parts * S * (sizeof(float) + sizeof(int)) + 1);
    if (!scratch) return -1;
    attn_t a = {T, H, Hkv, D, S, s_max, scale, q, k, v, mask, out, scratch};
    run(attention_unit, &a, T * H, (size_t)T * H * S < 4096);
    free(scratch);
    return 0;
}

/* x [M][K] fp32 (contiguous), out [M][N] fp32. Returns 0, or -1 when out of memory. */
int ss_linear(int fmt, int M, int K, int N, const float *x, const void *w, const float *d,
              const float *m, const float *bias, float *out) {
    job_t j = {fmt, M, K, N, x, 0, 0, 0, w, d, m, bias, out};
    if ((fmt == FMT_Q4 || fmt == FMT_Q8) && prepare_rows(&j) != 0) return -1;
    run(linear_unit, &j, (N + column_grain(N) - 1) / column_grain(N), (size_t)N * K < 65536);
    return 0;
}

/* ---- decoder blocks: the glue between the linears in C too, two calls a layer ----
 * The attention block: residual += x (or = x on the first layer), h = rmsnorm(residual) * w,
 * qkv = h Wqkv (+ bias), RoPE (rotate-half) on q and k, k and v written into the cache at `slots`, tree
 * attention under `mask`, out = attn Wo. The MLP block: residual += x, h = rmsnorm(residual) * w,
 * out = (silu(h Wg) * (h Wu)) W2. Tensor parallelism all-reduces `out` between the calls. Every step
 * is per row, so the blocks keep the rows independent. */
typedef struct {
    int fmt, N, K;
    const void *w;
    const float *d, *m, *bias;
} lin_t;

typedef struct {
    lin_t wqkv, wo, w13, w2;
    const float *attention_norm, *ffn_norm;
    float eps, scale;
    int dim, n_heads, n_kv_heads, head_dim, inter;
} block_t;

static int lin(const lin_t *l, int M, const float *x, float *out) {
    return ss_linear(l->fmt, M, l->K, l->N, x, l->w, l->d, l->m, l->bias, out);
}

static void add_rms_norm(int T, int dim, float eps, int first, const float *x, float *residual,
                         const float *w, float *h) {
    for (int t = 0; t < T; t++) {
        float *r = residual + (size_t)t * dim;
        const float *xt = x + (size_t)t * dim;
        float acc[8] = {0};
        for (int i = 0; i < dim; i++) {
            r[i] = first ? xt[i] : r[i] + xt[i];
            acc[i & 7] = fmaf(r[i], r[i], acc[i & 7]);
        }
        const float ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        const float inv = 1.0f / sqrtf(ss / dim + eps);
        for (int i = 0; i < dim; i++) h[(size_t)t * dim + i] = r[i] * inv * w[i];
    }
}

static void rope(float *x, const float *cos, const float *sin, int hd) {
    const int half = hd / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* x, residual [T][dim]; cos, sin [T][head_dim]; k, v caches [n_kv_heads][s_max][head_dim] of this layer;
 * out [T][dim]. Returns 0, or -1 when out of memory. */
int ss_attention_block(const block_t *b, int T, const float *x, float *residual, int first, const float *cos,
                       const float *sin, const int64_t *slots, const uint8_t *mask, int S, float *k_cache,
                       float *v_cache, int s_max, float *out) {
    const int hd = b->head_dim, nh = b->n_heads, nkv = b->n_kv_heads, width = (nh + 2 * nkv) * hd;
    float *h = malloc(sizeof(float) * (size_t)T * (b->dim + width + nh * hd));
    if (!h) return -1;
    float *qkv = h + (size_t)T * b->dim, *att = qkv + (size_t)T * width;
    add_rms_norm(T, b->dim, b->eps, first, x, residual, b->attention_norm, h);
    int rc = lin(&b->wqkv, T, h, qkv);
    if (rc == 0) {
        float *q = malloc(sizeof(float) * (size_t)T * nh * hd);
        if (!q) rc = -1;
        for (int t = 0; rc == 0 && t < T; t++) {
            float *row = qkv + (size_t)t * width;
            for (int j = 0; j < nh + nkv; j++) rope(row + j * hd, cos + (size_t)t * hd, sin + (size_t)t * hd, hd);
            memcpy(q + (size_t)t * nh * hd, row, sizeof(float) * nh * hd);
            for (int j = 0; j < nkv; j++) {
                memcpy(k_cache + ((size_t)j * s_max + slots[t]) * hd, row + (nh + j) * hd, sizeof(float) * hd);
                memcpy(v_cache + ((size_t)j * s_max + slots[t]) * hd, row + (nh + nkv + j) * hd, sizeof(float) * hd);
            }
        }
        if (rc == 0) rc = ss_attention(T, nh, nkv, hd, S, s_max, b->scale, q, k_cache, v_cache, mask, att);
        free(q);
    }
    if (rc == 0) rc = lin(&b->wo, T, att, out);
    free(h);
    return rc;
}

int ss_mlp_block(const block_t *b, int T, const float *x, float *residual, float *out) {
    const int inter = b->inter;
    float *h = malloc(sizeof(float) * (size_t)T * (b->dim + 3 * inter));
    if (!h) return -1;
    float *gu = h + (size_t)T * b->dim, *act = gu + (size_t)T * 2 * inter;
    add_rms_norm(T, b->dim, b->eps, 0, x, residual, b->ffn_norm, h);
    int rc = lin(&b->w13, T, h, gu);
    if (rc == 0) {
        for (int t = 0; t < T; t++)
            for (int i = 0; i < inter; i++) {
                const float g = gu[(size_t)t * 2 * inter + i], u = gu[(size_t)t * 2 * inter + inter + i];
                act[(size_t)t * inter + i] = g / (1.0f + expf(-g)) * u;
            }
        rc = lin(&b->w2, T, act, out);
    }
    free(h);
    return rc;
}
