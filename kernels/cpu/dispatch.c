/* The one dispatch table of the CPU kernels' paths, the choice of the one in use, and the entry points
 * (ss_linear, ss_attention) that run it. A path whose file the compiler could not build is absent (a weak
 * symbol left null); a path the CPU lacks is present but never run. */
#include <stdlib.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels.h"

extern const ss_path_t ss_path_portable;
extern const ss_path_t ss_path_avx2 __attribute__((weak));
extern const ss_path_t ss_path_avx_vnni __attribute__((weak));
extern const ss_path_t ss_path_avx512 __attribute__((weak));
extern const ss_path_t ss_path_avx512_vnni __attribute__((weak));
extern const ss_path_t ss_path_avx512_bf16 __attribute__((weak));
extern const ss_path_t ss_path_amx __attribute__((weak));

/* Every path, widest first (a bf16_only path just before the one it extends). */
static const ss_path_t *const paths[] = {&ss_path_amx,    &ss_path_avx512_bf16, &ss_path_avx512_vnni,
                                         &ss_path_avx512, &ss_path_avx_vnni,    &ss_path_avx2,
                                         &ss_path_portable};
enum { N_PATHS = sizeof paths / sizeof paths[0] };

/* Whether this process may use the AMX tiles: Linux grants their (8 KiB a thread) state on request. */
static int amx_permitted(void) {
#if defined(__linux__) && defined(__x86_64__)
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

static unsigned cpu_features(void) {
    unsigned f = 0;
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE)) return 0;
    const int fma = c & bit_FMA, avx = c & bit_AVX, f16c = c & bit_F16C;
    unsigned lo, hi;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    const int ymm = (lo & 0x6) == 0x6, zmm = ymm && (lo & 0xE0) == 0xE0, tiles = (lo & 0x60000) == 0x60000;
    if (!avx || !ymm || __get_cpuid_max(0, 0) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    if ((b & bit_AVX2) && fma && f16c) f |= SS_CPU_AVX2;
    if (zmm && (b & bit_AVX512F) && (b & bit_AVX512BW) && (b & bit_AVX512VL)) f |= SS_CPU_AVX512;
    if ((f & SS_CPU_AVX512) && (c & bit_AVX512VNNI)) f |= SS_CPU_AVX512_VNNI;
    if (tiles && (d & (1u << 24)) && (d & (1u << 25)) && amx_permitted()) f |= SS_CPU_AMX; /* AMX-TILE, -INT8 */
    const unsigned leaves = a;
    if (leaves >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        if (a & (1u << 4)) f |= SS_CPU_AVX_VNNI;
        if ((f & SS_CPU_AVX512_VNNI) && (a & (1u << 5))) f |= SS_CPU_AVX512_BF16;
    }
#endif
    return f;
}

/* Whether BF16 weights multiply bf16 activations (kernels.h) rather than fp32 ones: a setting of the whole
 * library, as the integer formats' activation width is. */
static int bf16_activations;

/* 1 when path i was compiled into this library and runs on this CPU (a bf16_only path: with bf16
 * activations). */
int ss_path_runs(int i) {
    static int features = -1;
    if (features < 0) features = (int)cpu_features();
    return i >= 0 && i < N_PATHS && paths[i] && (paths[i]->needs & ~(unsigned)features) == 0 &&
           (!paths[i]->bf16_only || bf16_activations);
}

int ss_path_count(void) { return N_PATHS; }

/* Path i's name, or NULL when it was not compiled. */
const char *ss_path_name(int i) { return i >= 0 && i < N_PATHS && paths[i] ? paths[i]->name : 0; }

/* The fewest rows of the calls path i is chosen for (0 when it was not compiled). */
int ss_path_min_rows(int i) { return i >= 0 && i < N_PATHS && paths[i] ? paths[i]->min_rows : 0; }

/* The paths in use, one a class of calls by their rows: one row (decode steps), several (verifications),
 * many (SS_MANY_ROWS and more: prefills, large trees), each the widest that runs and is meant for such
 * calls (min_rows) until ss_use_path / ss_use_path_for choose. Every path computes the same bits, so a
 * call may take any; which is fastest differs with the rows (a 256-bit path can stream one row faster
 * than a 512-bit one whose tiles win at eight, and the tile unit's fixed cost a block pays only over many
 * rows). */
enum { ONE_ROW = 0, SEVERAL_ROWS = 1, MANY_ROWS = 2, N_CLASSES = 3 };
static const int class_rows[N_CLASSES] = {1, 2, SS_MANY_ROWS}; /* the fewest rows of a call of each class */
static const ss_path_t *active[N_CLASSES];

static void choose_widest(void) {
    if (active[ONE_ROW]) return;
    for (int c = 0; c < N_CLASSES; c++)
        for (int i = 0; i < N_PATHS && !active[c]; i++)
            if (ss_path_runs(i) && paths[i]->min_rows <= class_rows[c]) active[c] = paths[i];
}

/* The class of a call of ``rows`` rows. */
static int class_of(int rows) { return rows == 1 ? ONE_ROW : rows < SS_MANY_ROWS ? SEVERAL_ROWS : MANY_ROWS; }

/* The path for a call of ``rows`` rows. */
static const ss_path_t *path(int rows) {
    choose_widest();
    return active[class_of(rows)];
}

static int index_of(const ss_path_t *p) {
    for (int i = 0; i < N_PATHS; i++)
        if (paths[i] == p) return i;
    return -1;
}

/* The index of the path in use for calls of ``rows`` rows. */
int ss_path_for(int rows) { return index_of(path(rows)); }

/* The fewest rows of a call in the class of many. */
int ss_many_rows(void) { return SS_MANY_ROWS; }

/* Runs path i from now on, for every call; -1 (and no change) when it cannot run here. */
int ss_use_path(int i) {
    if (!ss_path_runs(i)) return -1;
    for (int c = 0; c < N_CLASSES; c++) active[c] = paths[i];
    return 0;
}

/* Runs path i from now on for the calls of the class of ``rows`` rows; -1 (and no change) when it cannot
 * run here. */
int ss_use_path_for(int rows, int i) {
    if (!ss_path_runs(i)) return -1;
    choose_widest();
    active[class_of(rows)] = paths[i];
    return 0;
}

/* The activations' integer width, 16 or 8 bits (kernels.h): a setting of the whole library, as the model
 * it serves has one. */
static int activation_bits = 16;

/* Quantises the integer formats' activations to `bits` (16 or 8) from now on; -1 (and no change) for
 * another width. */
int ss_set_activation_bits(int bits) {
    if (bits != 16 && bits != 8) return -1;
    activation_bits = bits;
    return 0;
}

int ss_activation_bits(void) { return activation_bits; }

/* BF16 weights multiply bf16 activations from now on (on != 0), or fp32 ones; the paths in use are the
 * widest again, since the paths that run change. */
void ss_set_bf16_activations(int on) {
    bf16_activations = on != 0;
    for (int c = 0; c < N_CLASSES; c++) active[c] = 0;
}

int ss_bf16_activations(void) { return bf16_activations; }

/* The rows in bfloat16 (ss_float_to_bf16), into one buffer per thread: what every path's BF16 linear on
 * bf16 activations multiplies. */
static int prepare_bf16_rows(job_t *j) {
    static _Thread_local uint16_t *buf;
    static _Thread_local size_t cap;
    const size_t n = (size_t)j->M * j->K;
    if (n > cap) {
        free(buf);
        buf = malloc(n * sizeof *buf);
        cap = buf ? n : 0;
        if (!buf) return -1;
    }
    for (size_t i = 0; i < n; i++) buf[i] = ss_float_to_bf16(j->x[i]);
    j->xb = buf;
    return 0;
}

/* Each row's integer blocks (int16, and int8 with int8 activations), their scales and (Q4) exact block
 * sums, into one buffer per thread. */
static int prepare_rows(job_t *j) {
    static _Thread_local void *buf;
    static _Thread_local size_t cap;
    const int nb = j->K / 32, narrow = activation_bits == 8;
    const size_t blocks = (size_t)j->M * nb;
    const size_t need = blocks * (32 * sizeof(int16_t) + (narrow ? 32 + sizeof(int32_t) : 0) + 2 * sizeof(float));
    if (need > cap) {
        free(buf);
        buf = malloc(need);
        cap = buf ? need : 0;
        if (!buf) return -1;
    }
    float *dx = buf, *xsum = dx + blocks;
    int16_t *qx = (int16_t *)(xsum + blocks);
    int32_t *sum8 = narrow ? (int32_t *)(qx + blocks * 32) : 0;
    int8_t *qx8 = narrow ? (int8_t *)(sum8 + blocks) : 0;
    const float levels = narrow ? 127.0f : 32767.0f;
    void (*quantise)(const float *, float, int16_t *, int8_t *, float *, float *) = path(j->M)->quantise;
    for (size_t i = 0; i < blocks; i++) {
        quantise(j->x + i * 32, levels, qx + i * 32, narrow ? qx8 + i * 32 : 0, dx + i, xsum + i);
        if (narrow) {
            int32_t s = 0;
            for (int k = 0; k < 32; k++) s += qx8[i * 32 + k];
            sum8[i] = s;
        }
    }
    j->qx = qx, j->qx8 = qx8, j->sum8 = sum8, j->dx = dx, j->xsum = xsum;
    return 0;
}

/* Columns per unit of a linear: whole panels (SS_PANEL = 16 columns), about UNITS_A_THREAD units a thread. Few units keep the
 * threads from contending for the claim counter (each claim moves its cache line between the cores) and
 * give each a longer run of panels to stream, enough of them let the others take over the share of a
 * thread the OS preempts. A forward of the embedded model on a 2-core Xeon, 1-8 rows, 300 tokens of
 * context: 3 a thread ran 3-8 % faster than 6, 2 as fast at one row and 5 % slower at eight. */
#define UNITS_A_THREAD 3
static int column_grain(int N) {
    const int runs = N / (16 * UNITS_A_THREAD * ss_threads());
    return 16 * (runs > 1 ? runs : 1);
}

static void linear_unit(const void *job, int unit, int part) {
    const job_t *j = job;
    const int grain = column_grain(j->N), n0 = unit * grain, n1 = n0 + grain < j->N ? n0 + grain : j->N;
    (void)part;
    path(j->M)->columns(j, n0, n1);
}

/* x [M][K] fp32 (contiguous), out [M][N] fp32; fmt may carry SS_HALF_SCALES. Returns 0, or -1 when out of
 * memory. */
int ss_linear(int fmt, int M, int K, int N, const float *x, const void *w, const void *d, const void *m,
              const float *bias, float *out) {
    job_t j = {fmt & ~SS_HALF_SCALES, M, K, N, (fmt & SS_HALF_SCALES) != 0, x, 0, 0, 0, 0, 0, w, d, m, bias, out, 0};
    fmt = j.fmt;
    path(M); /* chosen here, before the pool's threads read it */
    if ((fmt == FMT_Q4 || fmt == FMT_Q8) && prepare_rows(&j) != 0) return -1;
    if (fmt == FMT_BF16 && bf16_activations && prepare_bf16_rows(&j) != 0) return -1;
    ss_run(linear_unit, &j, (N + column_grain(N) - 1) / column_grain(N), (size_t)N * K < 65536);
    return 0;
}

/* Unit u is row u % T of kv head u / T: the rows of a tree, which share their keys, one after another, so
 * that a long context's keys and values come from a thread's cache for every row after the first (taken
 * row by row, the other kv heads evicted them in between: 2000 keys, 4 rows, 1.5x the time on one thread). */
static void attention_unit(const void *job, int unit, int part) {
    const attn_t *a = job;
    const int G = a->H / a->Hkv;
    float *buf = (float *)(a->scratch + (size_t)part * a->S * (G * sizeof(float) + sizeof(int)));
    path(a->T)->attend(a, unit % a->T, unit / a->T, (int *)(buf + (size_t)G * a->S), buf);
}

/* q [T][H][D] fp32, k and v [Hkv][s_max][D] fp32 or IEEE halves (half), mask [T][S] bytes (nonzero =
 * attend: every row needs one), out [T][H][D]. Returns 0, or -1 when out of memory. */
int ss_attention(int T, int H, int Hkv, int D, int S, int s_max, int half, float scale, const float *q,
                 const void *k, const void *v, const uint8_t *mask, float *out) {
    const int parts = ss_threads();
    path(T);
    char *scratch = malloc((size_t)parts * S * ((H / Hkv) * sizeof(float) + sizeof(int)) + 1);
    if (!scratch) return -1;
    attn_t a = {T, H, Hkv, D, S, s_max, half != 0, scale, q, k, v, mask, out, scratch};
    ss_run(attention_unit, &a, T * Hkv, (size_t)T * H * S * D < 32768); /* a few microseconds: alone */
    free(scratch);
    return 0;
}
