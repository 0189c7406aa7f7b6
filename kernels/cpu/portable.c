/* The portable path: plain C that any compiler builds for any CPU, and the definition of the canonical
 * order (kernels.h) that every other path reproduces bit for bit. */
#include "kernels.h"

static void quantise(const float *v, float levels, int16_t *q, int8_t *q8, float *scale, float *sum) {
    float amax = 0.0f, t[8];
    for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(v[k]));
    for (int l = 0; l < 8; l++) t[l] = (v[l] + v[16 + l]) + (v[8 + l] + v[24 + l]);
    const float s = amax / levels, inv = s > 0.0f ? 1.0f / s : 0.0f;
    for (int k = 0; k < 32; k++) {
        const float r = nearbyintf(v[k] * inv);
        q[k] = (int16_t)(r > levels ? levels : r < -levels ? -levels : r);
        if (q8) q8[k] = (int8_t)q[k];
    }
    *scale = s;
    *sum = ss_r8(t);
}

/* Value k of block b of column n, from its panel (kernels.h). */
static inline int int_weight(const job_t *j, int n, int b, int k) {
    const int c = n % SS_PANEL;
    const uint8_t *block = ss_panel_weights(j, n / SS_PANEL) + (size_t)b * (j->fmt == FMT_Q8 ? 512 : 256);
    if (j->fmt == FMT_Q8) return ((const int8_t *)block)[(k / 2) * 2 * SS_PANEL + 2 * c + k % 2];
    const int v = k % 16; /* Q4: values k and k + 16 share a byte */
    const uint8_t byte = block[(v / 2) * 2 * SS_PANEL + 2 * c + v % 2];
    return (k < 16 ? byte : byte >> 4) & 0x0F;
}

static inline float float_weight(const job_t *j, int n, int k) {
    const size_t at = (size_t)n * j->K + k;
    if (j->fmt == FMT_F16) return ss_half_to_float(((const uint16_t *)j->w)[at]);
    if (j->fmt == FMT_BF16) return ss_bf16_to_float(((const uint16_t *)j->w)[at]);
    return ((const float *)j->w)[at];
}

/* Scale b of column n (d or m), from its panel. */
static inline float scale(const job_t *j, const void *scales, int n, int b) {
    const size_t at = (size_t)b * SS_PANEL + n % SS_PANEL;
    const void *panel = ss_panel_scales(j, scales, n / SS_PANEL);
    return j->half ? ss_half_to_float(((const uint16_t *)panel)[at]) : ((const float *)panel)[at];
}

static float int_dot(const job_t *j, int r, int n) {
    const int nb = j->K / 32;
    const int16_t *x = j->qx + (size_t)r * nb * 32;
    float a = 0.0f;
    for (int b = 0; b < nb; b++) {
        const size_t at = (size_t)r * nb + b;
        int32_t dot = 0;
        for (int k = 0; k < 32; k++) dot += int_weight(j, n, b, k) * x[b * 32 + k];
        a = fmaf((float)dot, scale(j, j->d, n, b) * j->dx[at], a);
        if (j->fmt == FMT_Q4) a = fmaf(scale(j, j->m, n, b), j->xsum[at], a);
    }
    return a;
}

static float float_dot(const job_t *j, int r, int n) {
    const float *x = j->x + (size_t)r * j->K;
    float c[32] = {0}, t[8];
    for (int k = 0; k < j->K; k += 32)
        for (int i = 0; i < 32; i++) c[i] = fmaf(float_weight(j, n, k + i), x[k + i], c[i]);
    for (int l = 0; l < 8; l++) t[l] = (c[l] + c[16 + l]) + (c[8 + l] + c[24 + l]);
    return ss_r8(t);
}

static float bf16_dot(const job_t *j, int r, int n) {
    const uint16_t *x = j->xb + (size_t)r * j->K, *w = (const uint16_t *)j->w + (size_t)n * j->K;
    float c[32] = {0}, t[8];
    for (int k = 0; k < j->K; k += 32)
        for (int l = 0; l < 16; l++) {
            float *lane = c + l + 16 * ((k / 32) % 2);
            for (int i = 2 * l + 1; i >= 2 * l; i--) /* the odd value first */
                *lane = ss_bf16_fma(ss_bf16_to_float(w[k + i]), ss_bf16_to_float(x[k + i]), *lane);
        }
    for (int l = 0; l < 8; l++) t[l] = (c[l] + c[16 + l]) + (c[8 + l] + c[24 + l]);
    return ss_r8(t);
}

static void columns(const job_t *j, int n0, int n1) {
    const int integer = j->fmt == FMT_Q4 || j->fmt == FMT_Q8;
    for (int r = 0; r < j->M; r++)
        for (int n = n0; n < n1; n++) {
            float s = integer ? int_dot(j, r, n) : j->xb ? bf16_dot(j, r, n) : float_dot(j, r, n);
            if (j->bias) s += j->bias[n];
            j->out[(size_t)r * j->N + n] = s;
        }
}

void ss_portable_attend_head(const attn_t *a, int t, int h, const int *keys, int n, float *buf) {
    const int D = a->D, kvh = h / (a->H / a->Hkv);
    const float *q = a->q + ((size_t)t * a->H + h) * D;
    const size_t kvb = (size_t)kvh * a->s_max * D; /* this kv head's first element */
    float mx = -INFINITY;
    for (int i = 0; i < n; i++) {
        const size_t k = kvb + (size_t)keys[i] * D;
        float acc[8] = {0};
        for (int e = 0; e < D; e++) acc[e % 8] = fmaf(q[e], ss_kv(a, a->k, k + e), acc[e % 8]);
        buf[i] = ss_r8(acc) * a->scale;
        mx = buf[i] > mx ? buf[i] : mx;
    }
    float sum[8] = {0};
    for (int i = 0; i < n; i++) {
        buf[i] = ss_exp(buf[i] - mx);
        sum[i % 8] += buf[i];
    }
    const float inv = 1.0f / ss_r8(sum);
    float *o = a->out + ((size_t)t * a->H + h) * D;
    for (int e = 0; e < D; e++) {
        float acc = 0.0f;
        for (int i = 0; i < n; i++) acc = fmaf(buf[i], ss_kv(a, a->v, kvb + (size_t)keys[i] * D + e), acc);
        o[e] = acc * inv;
    }
}

static void attend(const attn_t *a, int t, int g, int *keys, float *buf) {
    const int n = ss_keys(a, t, keys), G = a->H / a->Hkv;
    for (int h = g * G; h < (g + 1) * G; h++) ss_portable_attend_head(a, t, h, keys, n, buf);
}

const ss_path_t ss_path_portable = {"portable C", 0, 1, quantise, columns, attend, 0};
