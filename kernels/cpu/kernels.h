/* What the CPU kernels' files share: the job descriptions, the canonical arithmetic and the dispatch
 * table's entry type.
 *
 * The files, ggml-cpu's way: one per ISA family (portable.c, avx2.c, avx512.c, amx.c), each compiled
 * with its own target flags (kernels/cpu_linear.py holds the recipe; avx2.c is built with and without
 * VNNI, avx512.c without, with, and with VNNI and BF16), and dispatch.c, which holds the one table of
 * paths, picks the one in use and owns the entry points; pool.c is the thread pool, blocks.c the
 * decoder-block glue; vec256.h holds the helpers that the AVX2 and AVX-512 paths share, vec512.h the
 * generic-vector code of the AMX and AVX-512 VNNI paths (vnni512_emulated.c builds the latter's int8 tiles
 * anywhere, for the tests).
 *
 * Every output element is computed by the same sequence of operations whatever the number of rows in the
 * call, the row's place among them and the number of threads, and each row's own preparation (its int16
 * quantisation) depends on that row alone: a verification of n tree nodes computes, bit for bit, what n
 * one-row decode steps compute, and greedy speculation is exact by construction. Rows are processed in
 * tiles that share each unpacked weight vector, so extra rows cost arithmetic, not weight reads.
 *
 * Q4 and Q8 multiply integers: each row's blocks of 32 are quantised with one fp32 scale, and each
 * block's integer dot product is scaled by both scales. By default to int16 (L = 32767 levels a side):
 * with llama.cpp's int8 (L = 127), a block with one large activation (small models have such channels)
 * leaves the others a few levels, and the error compounds over the layers (5-6 % of the logits' range on
 * SmolLM2, ~0.1 % with int16). No one linear tolerates it alone either: int8 on any one of q/k/v, the
 * attention output, gate/up, down or the lm_head (int16 elsewhere) moved SmolLM2's greedy answers off fp32's
 * on 12-16 of 16 questions, against 1 for int16 throughout, so the width stays one setting of the library.
 * Nothing narrower than int16 keeps them (benchmarks/activation_width.py, the reference model with its
 * linears' inputs quantised as here, 16 questions): 12 bits kept 10 answers, 10 bits 9, int8 1, and int8
 * with each block's two largest values kept exact (an outlier split) 5, against 16 for int16. Any width
 * between 8 and 16 bits needs two byte products a value, as many instructions as one int16 multiply-add.
 * int8 is the opt-in (ss_set_activation_bits): its byte products halve a row's multiply-adds (vpmaddubsw,
 * vpdpbusd), which is what makes verified rows cheap. The values of an
 * int8 block are int16 values too, so a path without int8 kernels computes the same bits from its int16
 * copy. The 16- and 32-bit formats multiply in fp32, BF16 weights on bf16 activations where asked
 * (ss_set_bf16_activations): torch's own precision at bfloat16, which vdpbf16ps multiplies 32 at a time.
 *
 * Every path computes every output bit for bit as portable.c does: the block dot products are exact
 * integers, and each path performs the same fp32 operations in the same order (below), so the same
 * weights give the same tokens on every x86 machine and under every path. Everything is compiled with
 * -ffp-contract=off, so no compiler fuses a multiply and an add that the order below keeps apart.
 *
 * The canonical order:
 *   R8(t)      = ((t0 + t4) + (t1 + t5)) + ((t2 + t6) + (t3 + t7)), the one horizontal sum of 8 lanes.
 *   Quantising a block v[0..31] (Q4, Q8) to L levels: amax = max |v|, scale = amax / L, inv = 1 / scale
 *              (0 when scale is 0), q = round-to-nearest-even(v * inv) (|q| <= L: v * inv is at most
 *              L (1 + 2^-23)), and its sum (Q4's offset term) R8(t) with
 *              t_l = (v[l] + v[16 + l]) + (v[8 + l] + v[24 + l]).
 *   Q4 / Q8 linear, one (row, column): one accumulator a = +0; for the blocks b in increasing order
 *              a = fma(D_b, d_b * dx_b, a), then for Q4 a = fma(m_b, xsum_b, a); out = a (+ bias).
 *              D_b, the block's integer dot product, is exact in int32 (at most 32 * 128 * 32768 < 2^31)
 *              and converted to float once, rounding to nearest even.
 *   Float linear: 32 lanes c, each +0; c_i = fma(w[32 b + i], x[32 b + i], c_i) for the blocks in order;
 *              out = R8(t) with t_l = (c_l + c_{16 + l}) + (c_{8 + l} + c_{24 + l}) (+ bias).
 *   BF16 linear on bf16 activations (ss_set_bf16_activations): each row rounded to bfloat16 once
 *              (ss_float_to_bf16); 32 lanes c, each +0; for the blocks in order, lane i = l + 16 (b mod 2)
 *              takes block b's pair l, the odd value first: c_i = B(w[32 b + 2 l + 1], x[..], c_i), then
 *              c_i = B(w[32 b + 2 l], x[..], c_i); out = R8(t) with t_l = (c_l + c_{16 + l}) +
 *              (c_{8 + l} + c_{24 + l}) (+ bias): two chains of vdpbf16ps a column, not one.
 *              B (ss_bf16_fma) is what AVX512-BF16's vdpbf16ps does with one product: a weight below 2^-126
 *              read as zero, the product added with one rounding to nearest even, and a sum that is tiny
 *              after it (below 2^-126 when rounded to 24 bits with an unbounded exponent) flushed to zero;
 *              the paths without the instruction run two fp32 fmas with the MXCSR's DAZ and FTZ set, which
 *              do the same (benchmarks/bf16_dot.py checks a CPU's instruction against this definition).
 *   Attention, one (row, head) over its allowed keys in order (k and v at their exact fp32 values: a
 *              cache of halves is widened exactly): a score is R8 of 8 lanes, lane l summing
 *              fma(q[e], k[e], .) over e = l, l + 8, ... from +0, times the scale; p_i = exp8(score_i -
 *              max); sum = R8(s), lane l summing p_l, p_{l + 8}, ... in order from +0 (eight chains of
 *              adds, not one: attention ran 5-9 % faster); out[e] = (fma over the keys in order of
 *              p_i v_i[e], from +0) * (1 / sum).
 *   exp8(x):   Cephes' expf polynomial (below), each step one fp32 operation or one fma.
 */
#ifndef SS_KERNELS_H
#define SS_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { FMT_Q4 = 0, FMT_Q8 = 1, FMT_F16 = 2, FMT_BF16 = 3, FMT_F32 = 4 };

/* One linear: out [M][N] = x [M][K] . w [N][K] (+ bias). Weight formats (K a multiple of 32, nb = K / 32):
 *   Q4  4-bit values q with d and m, fp32 or fp16, a block: w = d * q + m  (Q4_1 as stored; Q4_0 is m = -8 d)
 *   Q8  int8 values q with d, fp32 or fp16, a block: w = d * q  (Q8_0)
 *   F16 w [N][K] IEEE half;  BF16 w [N][K] bfloat16;  F32 w [N][K] float
 * The integer formats come in "panels" of SS_PANEL columns (engine/model/cpu_blocks.py packs them; the last
 * panel is padded with zero columns): panel p holds, for each block b in turn, the block's value pairs in
 * turn, each pair as SS_PANEL columns x 2 values. Q8 stores a pair as 2 int8 a column (16 pairs, 512 bytes
 * a block); Q4 stores pairs j and j + 8 in one 2 bytes a column, low and high nibbles, as a GGUF block's
 * bytes 2j and 2j + 1 hold them (8 of them, 256 bytes a block). The scales d and m are [panel][nb][SS_PANEL].
 * So one int16 multiply-add of a pair's weight vector with a row's activation pair, broadcast, gives that
 * pair's products for SS_PANEL columns at once: no horizontal sums, no tail blocks, and each column's
 * block scaling is one lane of a vector. The activations' int16 blocks (qx) are in their natural order. */
#define SS_PANEL 16

/* The fewest rows of a call in the class of many (dispatch.c): prefills, large trees. */
#define SS_MANY_ROWS 16

/* A flag of ss_linear's format: the integer formats' d and m are IEEE halves, not floats (a GGUF's own
 * scales are, exactly; they are 2 bytes of a block's 18 or 20, not 4 of 24). */
#define SS_HALF_SCALES 8

typedef struct {
    int fmt, M, K, N;
    int half;            /* d and m are halves (SS_HALF_SCALES) */
    const float *x;      /* [M][K] fp32: the float formats */
    const int16_t *qx;   /* [M][nb][32] int16 blocks: Q4 and Q8 */
    const int8_t *qx8;   /* the same values as int8 blocks, in their natural order, with int8 activations */
    const int32_t *sum8; /* [M][nb] the sums of the int8 blocks: what Q8 on vpdpbusd takes back (w + 128) */
    const float *dx;     /* [M][nb] scales of qx */
    const float *xsum;   /* [M][nb] fp32 block sums of x: Q4 */
    const void *w;
    const void *d, *m;   /* [panels][nb][SS_PANEL] floats, or halves */
    const float *bias;
    float *out;
    const uint16_t *xb;  /* [M][K] the rows in bfloat16: BF16 weights on bf16 activations */
} job_t;

/* Tree attention: q [T][H][D] fp32, k and v [Hkv][s_max][D] fp32 or IEEE halves (half), mask [T][S] bytes
 * (nonzero = attend). */
typedef struct {
    int T, H, Hkv, D, S, s_max, half;
    float scale;
    const float *q;
    const void *k, *v;
    const uint8_t *mask;
    float *out;
    char *scratch; /* per part: (H / Hkv) x S floats (a group's scores) and S ints (the allowed keys) */
} attn_t;

/* CPU features, as dispatch.c reads them (cpuid, and the OS's saving of the vector registers). */
enum {
    SS_CPU_AVX2 = 1 << 0, /* with FMA and F16C */
    SS_CPU_AVX_VNNI = 1 << 1,
    SS_CPU_AVX512 = 1 << 2, /* F, BW and VL */
    SS_CPU_AVX512_VNNI = 1 << 3,
    SS_CPU_AMX = 1 << 4, /* AMX-TILE and AMX-INT8, the OS saving the tiles and letting this process use them */
    SS_CPU_AVX512_BF16 = 1 << 5,
};

/* A path: one ISA family's kernels. */
typedef struct {
    const char *name;    /* what the precision label shows: "AVX-512 VNNI" */
    unsigned needs;      /* the CPU features it runs on (SS_CPU_*) */
    int min_rows;        /* the fewest rows of the calls it is chosen for: below, its fixed cost a call outweighs
                            what it saves (it computes the same bits for any rows, and runs any when told) */
    /* block v[32] -> q[32] int16 (in the path's order) to `levels` levels, its scale and its sum, as the
     * canonical order says; q8, when given, the same values as int8 in their natural order */
    void (*quantise)(const float *v, float levels, int16_t *q, int8_t *q8, float *scale, float *sum);
    /* columns n0 .. n1 - 1 of every row of the job */
    void (*columns)(const job_t *j, int n0, int n1);
    /* one (row, kv head) of an attention: its H / Hkv query heads, which read each key once; keys holds S
     * ints, buf (H / Hkv) x S floats */
    void (*attend)(const attn_t *a, int t, int g, int *keys, float *buf);
    int bf16_only;       /* 1: it is the path after it in the table but for the BF16 linear on bf16 activations,
                            which it runs on vdpbf16ps; so it runs only with them */
} ss_path_t;

/* The thread pool (pool.c): fn over units 0 .. units - 1 on the pool's threads (the caller is part 0),
 * or alone when `small`; one caller at a time. */
typedef void (*ss_task_fn)(const void *job, int unit, int part);
void ss_run(ss_task_fn fn, const void *job, int units, int small);
int ss_threads(void);
int ss_set_threads(int n);

/* The entry points (dispatch.c) that the decoder blocks (blocks.c) call too; 0, or -1 when out of memory. */
int ss_linear(int fmt, int M, int K, int N, const float *x, const void *w, const void *d, const void *m,
              const float *bias, float *out);
int ss_attention(int T, int H, int Hkv, int D, int S, int s_max, int half, float scale, const float *q,
                 const void *k, const void *v, const uint8_t *mask, float *out);

/* One head h of row t over its n allowed keys, buf S floats: the portable path's, the vector paths' fallback
 * for head sizes that are not multiples of 8. */
void ss_portable_attend_head(const attn_t *a, int t, int h, const int *keys, int n, float *buf);

/* The weights of panel p: nb blocks of 256 (Q4) or 512 (Q8) bytes. */
static inline const uint8_t *ss_panel_weights(const job_t *j, int p) {
    return (const uint8_t *)j->w + (size_t)p * (j->K / 32) * (j->fmt == FMT_Q4 ? 256 : 512);
}

/* The scales (d or m) of panel p: [nb][SS_PANEL] floats or halves. */
static inline const void *ss_panel_scales(const job_t *j, const void *scales, int p) {
    return (const char *)scales + (size_t)p * (j->K / 32) * SS_PANEL * (j->half ? 2 : 4);
}

/* The allowed keys of row t, in order; returns their number. */
static inline int ss_keys(const attn_t *a, int t, int *keys) {
    const uint8_t *mrow = a->mask + (size_t)t * a->S;
    int n = 0;
    for (int s = 0; s < a->S; s++)
        if (mrow[s]) keys[n++] = s;
    return n;
}

/* An IEEE half as a float, exactly (what F16C's conversion gives). */
static inline float ss_half_to_float(uint16_t h) {
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

/* A float as an IEEE half, rounded to nearest even (what F16C's conversion and torch's give): what a KV
 * cache of halves holds. */
static inline uint16_t ss_float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, a = x & 0x7FFFFFFF;
    if (a >= 0x7F800000) return (uint16_t)(sign | 0x7C00 | (a > 0x7F800000 ? 0x200 : 0)); /* inf, NaN */
    if (a >= 0x477FF000) return (uint16_t)(sign | 0x7C00); /* rounds past 65504 */
    if (a < 0x38800000) { /* below 2^-14: a subnormal half, in units of 2^-24 */
        if (a < 0x33000000) return (uint16_t)sign; /* at most half of the least subnormal: to zero */
        const uint32_t shift = 126 - (a >> 23), man = (a & 0x7FFFFF) | 0x800000; /* shift 14 .. 24 */
        uint32_t h = man >> shift;
        const uint32_t rest = man & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((a >> 13) - ((127 - 15) << 10));
    const uint32_t rest = a & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

/* Element i of a KV cache of floats or halves. */
static inline float ss_kv(const attn_t *a, const void *base, size_t i) {
    return a->half ? ss_half_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* A bfloat16 as a float, exactly. */
static inline float ss_bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* A float as a bfloat16, rounded to nearest even, a result below 2^-126 in magnitude as a zero of its sign
 * (vdpbf16ps would read it as zero), a NaN as a quiet NaN: a row of bf16 activations. */
static inline uint16_t ss_float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t a = x & 0x7FFFFFFF;
    if (a > 0x7F800000) return (uint16_t)((x >> 16) | 0x40);
    const uint32_t h = (x + 0x7FFF + ((x >> 16) & 1)) >> 16;
    return (h & 0x7F80) ? (uint16_t)h : (uint16_t)(h & 0x8000);
}

/* c + w x as vdpbf16ps adds one product (kernels.h's B): w below 2^-126 read as zero (x and c never are:
 * ss_float_to_bf16 and this flush them), one rounding to nearest even, a tiny sum flushed to a zero of its
 * sign. The x86 detects tininess after rounding to 24 bits with an unbounded exponent, so a sum that
 * fmaf rounds up to 2^-126 from the band just below it is tiny there too: that one case is decided on the
 * exact sum, which a double holds (a product of two bfloat16 has 16 bits, and a sum this small of it and
 * an fp32 spans fewer than 53). */
static inline float ss_bf16_fma(float w, float x, float c) {
    if (fabsf(w) < 0x1p-126f) w = copysignf(0.0f, w);
    const float r = fmaf(w, x, c);
    if (fabsf(r) > 0x1p-126f) return r;
    if (fabsf(r) == 0x1p-126f && fabs((double)w * x + c) >= 0x1p-126 - 0x1p-151) return r;
    return copysignf(0.0f, r);
}

static inline float ss_r8(const float *t) {
    return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}

/* Cephes' expf on 2^n e^r, the arguments clamped to [-87.3, 88.3] (results normal and finite): ~1 ulp. */
#define SS_EXP_LO (-87.3f)
#define SS_EXP_HI 88.3f
#define SS_LOG2E 1.44269504088896341f
#define SS_LN2_HI 0.693359375f
#define SS_LN2_LO (-2.12194440e-4f)
#define SS_EXP_P0 1.9875691500e-4f
#define SS_EXP_P1 1.3981999507e-3f
#define SS_EXP_P2 8.3334519073e-3f
#define SS_EXP_P3 4.1665795894e-2f
#define SS_EXP_P4 1.6666665459e-1f
#define SS_EXP_P5 5.0000001201e-1f

static inline float ss_exp(float x) {
    x = x < SS_EXP_LO ? SS_EXP_LO : x > SS_EXP_HI ? SS_EXP_HI : x;
    const float n = nearbyintf(x * SS_LOG2E);
    float r = fmaf(-n, SS_LN2_HI, x);
    r = fmaf(-n, SS_LN2_LO, r);
    float p = SS_EXP_P0;
    p = fmaf(p, r, SS_EXP_P1);
    p = fmaf(p, r, SS_EXP_P2);
    p = fmaf(p, r, SS_EXP_P3);
    p = fmaf(p, r, SS_EXP_P4);
    p = fmaf(p, r, SS_EXP_P5);
    p = fmaf(p, r * r, r + 1.0f);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float e;
    memcpy(&e, &bits, sizeof e);
    return p * e;
}

#endif
