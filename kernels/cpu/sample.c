/* The sampler's pass over the vocabulary (engine/spec/sampling.py): each node's penalties, then its greedy
 * choice or its draw from softmax(logits / temperature) with min-p at a given uniform, for every node of a
 * tree in one call. In C because a row is the whole vocabulary (49k logits for the embedded model) and
 * torch's elementwise ops cost ~0.2 ms a row on a small CPU, and because right after a forward, whose
 * weights have just streamed through the caches, every Python and torch op runs several times slower than
 * it does warm: the penalties' counts, the penalties and the choice in torch and numpy took 0.4 ms of a
 * 4 ms decode step on the Zen 4. Built for the machine at hand like the decoder blocks; not part of any
 * model's arithmetic, so no canonical order to keep, only the distribution (and the penalties' bits, which
 * are Sampler.penalise's). */
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

/* Row x's penalties for the window w[0 .. len - 1] (the last tokens of its context), in place: each token
 * seen c > 0 times, y = x > 0 ? x / repeat : x * repeat (where repeat != 1), then (y - frequency c) -
 * presence: the fp32 operations of Sampler.penalise, in its order, so the same bits. w is sorted here. */
static int by_value(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}
static void penalise_row(float *x, int V, int64_t *w, int len, float repeat, float frequency, float presence) {
    qsort(w, (size_t)len, sizeof *w, by_value);
    for (int i = 0; i < len;) {
        int j = i;
        while (j < len && w[j] == w[i]) j++;
        if (w[i] >= 0 && w[i] < V) {
            float y = x[w[i]];
            if (repeat != 1.0f) y = y > 0.0f ? y / repeat : y * repeat;
            x[w[i]] = (y - frequency * (float)(j - i)) - presence;
        }
        i = j;
    }
}

/* The first of the largest of x[0 .. V - 1], NaN aside (a row of -inf: 0): the largest 8 lanes at a time,
 * then the first that equals it (a scalar loop's compare-and-branch ran at 3 cycles a logit). */
static int64_t argmax_row(const float *x, int V) {
    const float mx = max_scaled(x, V, 1.0f);
    int i = 0;
    for (; i + 8 <= V; i += 8) {
        v8f y;
        memcpy(&y, x + i, sizeof y);
        const v8i hit = y == mx;
        int any = 0;
        for (int l = 0; l < 8; l++) any |= hit[l];
        if (any) break;
    }
    for (; i < V; i++)
        if (x[i] == mx) return i;
    return 0;
}

/* The draw of row x: y = x / temperature (times its inverse), p_i proportional to exp(y_i - max y), 0 where
 * y_i is -inf (a grammar's mask) or p_i < min_p p_max (min-p; 0: off); then the first token whose cumulative
 * mass (in double, block by block) exceeds u times the total. e: V floats; sums: the blocks' doubles. */
static int64_t draw_row(const float *x, int V, float temperature, float min_p, double u, float *e, double *sums) {
    const int blocks = (V + BLOCK - 1) / BLOCK;
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
    const double target = u * total;
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
    return at;
}

/* The target's token at each of the n nodes of a tree, from logits [n][V] (changed in place by the
 * penalties): with `history` (its last h tokens before the root) given, node r's logits are first penalised
 * by the last last_n tokens of the history followed by its path (tokens of the root .. r, parents[0] = -1,
 * parents[r] < r), as Sampler.logits does; then the first of the largest logits when temperature is 0, else
 * the draw at u[r] in [0, 1). Returns 0, or -1 when out of memory. */
int ss_choose(int n, int V, float *logits, const int64_t *tokens, const int64_t *parents, const int64_t *history,
              int h, int last_n, float repeat, float frequency, float presence, float temperature, float min_p,
              const double *u, int64_t *out) {
    static _Thread_local float *e; /* a row's masses, then the blocks' sums (doubles): kept, a row is large */
    static _Thread_local size_t cap;
    const int blocks = (V + BLOCK - 1) / BLOCK;
    const size_t need = sizeof(float) * (size_t)V + sizeof(double) * (size_t)blocks + sizeof(double);
    if (temperature > 0.0f && need > cap) {
        free(e);
        e = malloc(need);
        cap = e ? need : 0;
        if (!e) return -1;
    }
    double *sums = e ? (double *)(((uintptr_t)(e + V) + sizeof(double) - 1) & ~(uintptr_t)(sizeof(double) - 1)) : 0;
    int64_t *w = history ? malloc(sizeof(int64_t) * ((size_t)h + (size_t)n)) : 0;
    if (history && !w) return -1;
    for (int r = 0; r < n; r++) {
        float *x = logits + (size_t)r * V;
        if (history) {
            int depth = 0; /* node r's path behind the history's h tokens: collected from r up, then reversed */
            for (int i = r; i >= 0; i = (int)parents[i]) w[h + depth++] = tokens[i];
            for (int a = 0, b = depth - 1; a < b; a++, b--) {
                const int64_t t = w[h + a];
                w[h + a] = w[h + b], w[h + b] = t;
            }
            memcpy(w, history, sizeof(int64_t) * (size_t)h);
            const int len = h + depth < last_n ? h + depth : last_n;
            penalise_row(x, V, w + h + depth - len, len, repeat, frequency, presence);
        }
        out[r] = temperature > 0.0f ? draw_row(x, V, temperature, min_p, u[r], e, sums) : argmax_row(x, V);
    }
    free(w);
    return 0;
}
