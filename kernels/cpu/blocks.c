/* The decoder blocks: the glue between the linears in C too, two calls a layer, the same on every path;
 * and a whole forward (embedding lookup, the layers, the final norm, the lm_head) in one call.
 * The attention block: residual += x (or = x on the first layer), h = rmsnorm(residual) * w,
 * qkv = h Wqkv (+ bias), RoPE (rotate-half) on q and k, k and v written into the cache at `slots` (a cache
 * of halves holds them rounded to nearest even), tree attention under `mask`, out = attn Wo. The MLP block:
 * residual += x, h = rmsnorm(residual) * w, out = (silu(h Wg) * (h Wu)) W2. Tensor parallelism all-reduces
 * `out` between the calls. Every step is per row, so the blocks keep the rows independent. */
#include <stdlib.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include "kernels.h"

typedef struct {
    int fmt, N, K;
    const void *w;
    const void *d, *m; /* floats, or halves with SS_HALF_SCALES in fmt */
    const float *bias;
} lin_t;

typedef struct {
    lin_t wqkv, wo, w13, w2;
    const float *attention_norm, *ffn_norm;
    float eps, scale;
    int dim, n_heads, n_kv_heads, head_dim, inter;
} block_t;

/* Built with -DSS_STEP_PROFILE (benchmarks/step_profile.py), the blocks time their parts: where a step's
 * time goes, the linears against the rest. The library the engine runs is built without it. */
enum { PART_WQKV, PART_WO, PART_W13, PART_W2, PART_ATTENTION, PART_LAYERS, PART_LM_HEAD, N_PARTS };
#ifdef SS_STEP_PROFILE
#include <time.h>
static double part_seconds[N_PARTS];
static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#define TIMED(part, expr)                                                                                    \
    do {                                                                                                     \
        const double t0_ = seconds_now();                                                                    \
        expr;                                                                                                \
        part_seconds[part] += seconds_now() - t0_;                                                           \
    } while (0)
#else
#define TIMED(part, expr) do { (void)(part); expr; } while (0)
#endif

/* The seconds each part took since the last call, into out[N_PARTS] (wqkv, wo, w13, w2, attention, the layers
 * whole, ss_forward's lm_head), zeroed; -1 in a library built without SS_STEP_PROFILE. */
int ss_step_profile(double *out) {
#ifdef SS_STEP_PROFILE
    for (int i = 0; i < N_PARTS; i++) out[i] = part_seconds[i], part_seconds[i] = 0.0;
    return 0;
#else
    (void)out;
    return -1;
#endif
}

static int lin(const lin_t *l, int part, int M, const float *x, float *out) {
    int rc;
    TIMED(part, rc = ss_linear(l->fmt, M, l->K, l->N, x, l->w, l->d, l->m, l->bias, out));
    return rc;
}

/* residual = x (first) or residual + x, h = rmsnorm(residual) * w, row by row. The sum of squares in 8
 * lanes, lane l over the elements l, l + 8, ... in order (eight at a time: one vector fma), then R8. */
static void add_rms_norm(int T, int dim, float eps, int first, const float *restrict x, float *restrict residual,
                         const float *restrict w, float *restrict h) {
    for (int t = 0; t < T; t++) {
        float *restrict r = residual + (size_t)t * dim, *restrict ht = h + (size_t)t * dim;
        const float *restrict xt = x + (size_t)t * dim;
        if (first) memcpy(r, xt, sizeof(float) * dim);
        else
            for (int i = 0; i < dim; i++) r[i] += xt[i];
        float acc[8] = {0};
        int i = 0;
        for (; i + 8 <= dim; i += 8)
            for (int l = 0; l < 8; l++) acc[l] = fmaf(r[i + l], r[i + l], acc[l]);
        for (; i < dim; i++) acc[i & 7] = fmaf(r[i], r[i], acc[i & 7]);
        const float inv = 1.0f / sqrtf(ss_r8(acc) / dim + eps);
        for (int e = 0; e < dim; e++) ht[e] = r[e] * inv * w[e];
    }
}

/* add_rms_norm for the final norm of a model run block by block (tensor parallelism): the bits ss_forward's
 * final norm has. residual_out = x (+ residual where given). */
void ss_add_rms_norm(int T, int dim, float eps, const float *x, const float *residual, float *residual_out,
                     const float *w, float *h) {
    if (residual) memcpy(residual_out, residual, sizeof(float) * (size_t)T * dim);
    add_rms_norm(T, dim, eps, residual == NULL, x, residual_out, w, h);
}

static void rope(float *x, const float *cos, const float *sin, int hd) {
    const int half = hd / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* n floats x into a KV cache of floats or halves from element i on. */
static void kv_write(int half, void *cache, size_t i, const float *x, int n) {
    if (!half) {
        memcpy((float *)cache + i, x, sizeof(float) * n);
        return;
    }
    uint16_t *h = (uint16_t *)cache + i;
    int e = 0;
#ifdef __F16C__
    for (; e + 8 <= n; e += 8)
        _mm_storeu_si128((__m128i *)(h + e), _mm256_cvtps_ph(_mm256_loadu_ps(x + e), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; e < n; e++) h[e] = ss_float_to_half(x[e]);
}

/* x, residual [T][dim]; cos, sin [T][head_dim]; k, v caches [n_kv_heads][s_max][head_dim] of this layer,
 * floats or halves (half); out [T][dim]. Returns 0, or -1 when out of memory. */
int ss_attention_block(const block_t *b, int T, const float *x, float *residual, int first, const float *cos,
                       const float *sin, const int64_t *slots, const uint8_t *mask, int S, int half, void *k_cache,
                       void *v_cache, int s_max, float *out) {
    const int hd = b->head_dim, nh = b->n_heads, nkv = b->n_kv_heads, width = (nh + 2 * nkv) * hd;
    float *h = malloc(sizeof(float) * (size_t)T * (b->dim + width + nh * hd));
    if (!h) return -1;
    float *qkv = h + (size_t)T * b->dim, *att = qkv + (size_t)T * width;
    add_rms_norm(T, b->dim, b->eps, first, x, residual, b->attention_norm, h);
    int rc = lin(&b->wqkv, PART_WQKV, T, h, qkv);
    if (rc == 0) {
        float *q = malloc(sizeof(float) * (size_t)T * nh * hd);
        if (!q) rc = -1;
        for (int t = 0; rc == 0 && t < T; t++) {
            float *row = qkv + (size_t)t * width;
            for (int j = 0; j < nh + nkv; j++) rope(row + j * hd, cos + (size_t)t * hd, sin + (size_t)t * hd, hd);
            memcpy(q + (size_t)t * nh * hd, row, sizeof(float) * nh * hd);
            for (int j = 0; j < nkv; j++) {
                kv_write(half, k_cache, ((size_t)j * s_max + slots[t]) * hd, row + (nh + j) * hd, hd);
                kv_write(half, v_cache, ((size_t)j * s_max + slots[t]) * hd, row + (nh + nkv + j) * hd, hd);
            }
        }
        if (rc == 0)
            TIMED(PART_ATTENTION,
                  rc = ss_attention(T, nh, nkv, hd, S, s_max, half, b->scale, q, k_cache, v_cache, mask, att));
        free(q);
    }
    if (rc == 0) rc = lin(&b->wo, PART_WO, T, att, out);
    free(h);
    return rc;
}

int ss_mlp_block(const block_t *b, int T, const float *x, float *residual, float *out) {
    const int inter = b->inter;
    float *h = malloc(sizeof(float) * (size_t)T * (b->dim + 3 * inter));
    if (!h) return -1;
    float *gu = h + (size_t)T * b->dim, *act = gu + (size_t)T * 2 * inter;
    add_rms_norm(T, b->dim, b->eps, 0, x, residual, b->ffn_norm, h);
    int rc = lin(&b->w13, PART_W13, T, h, gu);
    if (rc == 0) {
        for (int t = 0; t < T; t++)
            for (int i = 0; i < inter; i++) {
                const float g = gu[(size_t)t * 2 * inter + i], u = gu[(size_t)t * 2 * inter + inter + i];
                act[(size_t)t * inter + i] = g / (1.0f + ss_exp(-g)) * u;
            }
        rc = lin(&b->w2, PART_W2, T, act, out);
    }
    free(h);
    return rc;
}

/* Every layer of a model without tensor parallelism, in turn, in one call: x [T][dim] holds the
 * embeddings on entry and the last layer's output on return, residual the stream it adds to (the final
 * norm is the caller's); layer l's caches start l * layer_stride elements on, floats or halves (half);
 * tmp [T][dim]. */
int ss_layers(const block_t *blocks, int n, int T, float *x, float *residual, const float *cos, const float *sin,
              const int64_t *slots, const uint8_t *mask, int S, int half, void *k_cache, void *v_cache,
              int64_t layer_stride, int s_max, float *tmp) {
    const size_t stride = (size_t)layer_stride * (half ? 2 : 4);
    int rc = 0;
    TIMED(PART_LAYERS, for (int l = 0; rc == 0 && l < n; l++) {
        rc = ss_attention_block(blocks + l, T, x, residual, l == 0, cos, sin, slots, mask, S, half,
                                (char *)k_cache + l * stride, (char *)v_cache + l * stride, s_max, tmp);
        if (rc == 0) rc = ss_mlp_block(blocks + l, T, tmp, residual, x);
    });
    return rc;
}

/* A model without tensor parallelism, as ss_forward runs it. The embedding is a table of `vocab` rows of
 * `dim`: Q4 or Q8 blocks in the kernels' panels (kernels.h) with float scales, or F32 rows [vocab][dim].
 * cos and sin [rope_positions][head_dim]: RoPE's at each position. */
typedef struct {
    const block_t *blocks;
    int n_layers, vocab, rope_positions;
    lin_t embedding, output;
    const float *norm, *cos, *sin;
    float eps;
} model_t;

/* Row `token` of the embedding into x[dim], as the blocks stand for it: q d (+ m), one rounding each. */
static void embed(const lin_t *e, int dim, int64_t token, float *x) {
    const int nb = dim / 32;
    if (e->fmt == FMT_F32) {
        memcpy(x, (const float *)e->w + (size_t)token * dim, sizeof(float) * dim);
        return;
    }
    const int p = (int)(token / SS_PANEL), lane = (int)(token % SS_PANEL), q4 = e->fmt == FMT_Q4;
    const uint8_t *panel = (const uint8_t *)e->w + (size_t)p * nb * (q4 ? 256 : 512);
    for (int b = 0; b < nb; b++) {
        const size_t at = ((size_t)p * nb + b) * SS_PANEL + lane;
        const float d = ((const float *)e->d)[at];
        float *out = x + b * 32;
        if (q4) { /* pair j: values 2j, 2j + 1 in its bytes' low nibbles, 2j + 16, 2j + 17 in their high ones */
            const float m = ((const float *)e->m)[at];
            for (int j = 0; j < 8; j++) {
                const uint8_t *pair = panel + (size_t)b * 256 + (j * SS_PANEL + lane) * 2;
                out[2 * j] = (float)(pair[0] & 15) * d + m, out[2 * j + 16] = (float)(pair[0] >> 4) * d + m;
                out[2 * j + 1] = (float)(pair[1] & 15) * d + m, out[2 * j + 17] = (float)(pair[1] >> 4) * d + m;
            }
        } else { /* pair j: values 2j, 2j + 1 */
            for (int j = 0; j < 16; j++) {
                const int8_t *pair = (const int8_t *)panel + (size_t)b * 512 + (j * SS_PANEL + lane) * 2;
                out[2 * j] = (float)pair[0] * d, out[2 * j + 1] = (float)pair[1] * d;
            }
        }
    }
}

/* A forward of T rows: tokens, positions and slots [T]; mask [T][S] and the caches as ss_layers takes them;
 * hidden [T][dim] gets the final norm's output, logits [R][vocab] the lm_head's of the rows `rows` (all T
 * in order where rows is NULL; R = T then). Returns 0; -1 when out of memory, -2 when a position has no
 * RoPE row (the caller extends the tables and calls again), -3 when a token is outside the vocabulary. */
int ss_forward(const model_t *m, int T, const int64_t *tokens, const int64_t *positions, const int64_t *slots,
               const uint8_t *mask, int S, int half, void *k_cache, void *v_cache, int64_t layer_stride, int s_max,
               int R, const int64_t *rows, float *hidden, float *logits) {
    const block_t *b = m->blocks;
    const int dim = b->dim, hd = b->head_dim;
    for (int t = 0; t < T; t++) {
        if (positions[t] < 0 || positions[t] >= m->rope_positions) return -2;
        if (tokens[t] < 0 || tokens[t] >= m->vocab) return -3;
    }
    float *x = malloc(sizeof(float) * ((size_t)T * (3 * dim + 2 * hd) + (size_t)R * dim));
    if (!x) return -1;
    float *residual = x + (size_t)T * dim, *tmp = residual + (size_t)T * dim, *cos = tmp + (size_t)T * dim,
          *sin = cos + (size_t)T * hd, *picked = sin + (size_t)T * hd;
    for (int t = 0; t < T; t++) {
        embed(&m->embedding, dim, tokens[t], x + (size_t)t * dim);
        memcpy(cos + (size_t)t * hd, m->cos + (size_t)positions[t] * hd, sizeof(float) * hd);
        memcpy(sin + (size_t)t * hd, m->sin + (size_t)positions[t] * hd, sizeof(float) * hd);
    }
    int rc = ss_layers(b, m->n_layers, T, x, residual, cos, sin, slots, mask, S, half, k_cache, v_cache, layer_stride,
                       s_max, tmp);
    if (rc == 0) {
        add_rms_norm(T, dim, m->eps, 0, x, residual, m->norm, hidden);
        const float *in = hidden;
        if (rows) {
            for (int r = 0; r < R; r++) memcpy(picked + (size_t)r * dim, hidden + (size_t)rows[r] * dim, sizeof(float) * dim);
            in = picked;
        }
        const lin_t *o = &m->output;
        if (R > 0) rc = lin(o, PART_LM_HEAD, R, in, logits);
    }
    free(x);
    return rc;
}
