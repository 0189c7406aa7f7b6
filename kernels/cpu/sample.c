/* The sampler's pass over the vocabulary (engine/spec/sampling.py): one token per row from softmax(logits /
 * temperature) with min-p, drawn at a given uniform. In C because a row is the whole vocabulary (49k logits
 * for the embedded model) and torch's elementwise ops cost ~0.2 ms a row on a small CPU, a twentieth of a
 * decode step, paid again for every row a verification samples. Built for the machine at hand like the
 * decoder blocks; not part of any model's arithmetic, so no canonical order to keep, only the distribution. */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* The largest of y_i = x_i k, 8 lanes at a time. */
static float max_scaled(const float *x, int V, float k) {
    v8f lane = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int i = 0;
    for (; i + 8 <= V; i += 8) {
        v8f y;
        memcpy(&y, x + i, sizeof y);
        y *= k;
        const v8i up = y > lane;
        lane = (v8f)(((v8i)y & up) | ((v8i)lane & ~up));
    }
    float mx = -INFINITY;
    for (int l = 0; l < 8; l++) mx = lane[l] > mx ? lane[l] : mx;
    for (; i < V; i++) mx = x[i] * k > mx ? x[i] * k : mx;
    return mx;
}

#define BLOCK 256 /* tokens a block of the search: their sums are kept, so the search reads one block */

/* Row r of logits [n][V]: y = logits / temperature (times its inverse), p_i proportional to exp(y_i - max y),
 * 0 where y_i is -inf (a grammar's mask) or p_i < min_p p_max (min-p; 0: off); then the first token whose
 * cumulative mass (in double, block by block) exceeds u[r] times the total, u[r] in [0, 1). Returns 0, or -1
 * when out of memory. */
int ss_sample(int n, int V, const float *logits, float temperature, float min_p, const double *u, int64_t *out) {
    static _Thread_local float *e; /* a row's masses, then the blocks' sums (doubles) */
    static _Thread_local size_t cap;
    const int blocks = (V + BLOCK - 1) / BLOCK;
    const size_t need = sizeof(float) * (size_t)V + sizeof(double) * (size_t)blocks + sizeof(double);
    if (need > cap) {
        free(e);
        e = malloc(need);
        cap = e ? need : 0;
        if (!e) return -1;
    }
    double *sums = (double *)(((uintptr_t)(e + V) + sizeof(double) - 1) & ~(uintptr_t)(sizeof(double) - 1));
    for (int r = 0; r < n; r++) {
        const float *x = logits + (size_t)r * V;
        const float k = 1.0f / temperature, mx = max_scaled(x, V, k);
        for (int i = 0; i < V; i++) { /* the largest gives exp(0) = 1, so min-p is p < min_p */
            const float y = x[i] * k, p = ss_exp(y - mx);
            e[i] = y == -INFINITY || p < min_p ? 0.0f : p;
        }
        double total = 0.0;
        for (int b = 0; b < blocks; b++) {
            const int end = (b + 1) * BLOCK < V ? (b + 1) * BLOCK : V;
            double part[8] = {0};
            int i = b * BLOCK;
            for (; i + 8 <= end; i += 8)
                for (int l = 0; l < 8; l++) part[l] += e[i + l];
            sums[b] = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
            for (; i < end; i++) sums[b] += e[i];
            total += sums[b];
        }
        const double target = u[r] * total;
        double c = 0.0;
        int b = 0;
        while (b < blocks - 1 && c + sums[b] <= target) c += sums[b++];
        int64_t at = -1;
        for (; b < blocks && at < 0; b++) /* the block the target falls in, the next ones where rounding moved it */
            for (int i = b * BLOCK, end = (b + 1) * BLOCK < V ? (b + 1) * BLOCK : V; i < end && at < 0; i++)
                if (e[i] > 0.0f && (c += e[i]) > target) at = i;
        if (at < 0) /* the target at or above the rounded total: the last token of mass */
            for (int i = V - 1; i >= 0 && at < 0; i--)
                if (e[i] > 0.0f) at = i;
        out[r] = at;
    }
    return 0;
}
