/* The AVX-512 VNNI path's int8 tiles (vec512.h) in plain C, with the portable path for the rest, for the
 * tests of machines without AVX-512: its layout and arithmetic, bit for bit, anywhere (the machine with
 * AVX-512 VNNI checks the instructions themselves). Built in place of avx512.c's VNNI object. */
#include "kernels.h"
#include "vec512.h"

extern const ss_path_t ss_path_portable;

static void quantise(const float *v, float levels, int16_t *q, int8_t *q8, float *scale, float *sum) {
    ss_path_portable.quantise(v, levels, q, q8, scale, sum);
}

static void columns(const job_t *j, int n0, int n1) {
    if (!int8_columns(j, n0, n1)) ss_path_portable.columns(j, n0, n1);
}

static void attend(const attn_t *a, int t, int g, int *keys, float *buf) { ss_path_portable.attend(a, t, g, keys, buf); }

const ss_path_t ss_path_avx512_vnni = {"AVX-512 VNNI (emulated)", 0, 1, quantise, columns, attend, 0};
