/* The AMX path: the Q4 and Q8 linears' block dot products on the tile unit (AMX-INT8), whose one
 * instruction does a tile's R x 16 x 32 byte multiply-adds, so that a call's extra rows cost little more
 * than their fp32 scaling. Each block's fixed cost (two tile instructions, its sums' round trip through
 * memory) is paid whatever the rows, so the path is meant for calls of many rows (min_rows: prefills),
 * where it outruns the vector paths. The float formats, the quantiser's arithmetic and attention are the
 * AVX-512 VNNI path's.
 *
 * The tile unit multiplies bytes, the activations are int16 (kernels.h): each is split into a signed high
 * byte and an unsigned low one, x = 256 xh + xl, so a block's dot product is 256 (q . xh) + (q . xl), the
 * first a TDPBSSD, the second a TDPBUSD, both exact in int32 (|q . xh| <= 32 * 128 * 128): the same
 * integer as every other path's, scaled in the canonical order, so the same bits.
 *
 * With int8 activations (kernels.h) each value's low byte, read as signed, is the value itself: one
 * TDPBSSD a block on the low bytes alone, half the tile unit's work and one round trip of sums.
 *
 * Layouts. A tile row of activations is one block's 32 bytes in the order the weights' tile wants: for
 * r = 0 .. 7, elements 2r, 2r + 1, 2r + 16, 2r + 17 (a Q4 panel's pair r holds 2r, 2r + 1 in its low
 * nibbles and 2r + 16, 2r + 17 in its high ones). This path's quantiser writes a block's 64 bytes as its
 * 32 low bytes then its 32 high bytes in that order (only this path's linears read them). The weights'
 * tile (8 rows of 64 bytes: row r, column n, the 4 weights of elements above) is unpacked from the panel,
 * per block, into a buffer the tile loads from.
 *
 * Built with -DSS_AMX_EMULATE, the tile instructions are plain C and the rest is the portable path's: the
 * same layouts and arithmetic, on any CPU, so the tests check this path's logic bit for bit where no AMX
 * runs (the machine with AMX checks the instructions themselves). */
#include "kernels.h"
#include "vec512.h"

#define MAX_R 16 /* rows per tile: the most a tile holds */
#define CHUNK 8 /* panels a pass over the blocks */

/* The tile registers (numerals: the instructions name them in their text): the activations' low and high
 * bytes (R rows x 32 bytes), two panels' weights (8 x 64), the two panels' dot products of the low and
 * the high bytes (R x 64). */
#define A_LO 0
#define A_HI 1
#define B0 2
#define B1 3
#define C0_LO 4
#define C0_HI 5
#define C1_LO 6
#define C1_HI 7

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

#ifdef SS_AMX_EMULATE
#define PATH ss_path_amx
#define NAME "AMX (emulated)"
#define NEEDS 0
#define BASE ss_path_portable

/* The tile instructions as the architecture defines them, one thread's tiles in C. */
static _Thread_local struct {
    int rows, colsb;
    uint8_t data[16][64];
} tiles[8];

static void tile_zero(int t) { memset(tiles[t].data, 0, sizeof tiles[t].data); }
static _Thread_local tile_config_t config; /* palette 0: released */

static void tile_config(const tile_config_t *c) {
    config = *c;
    for (int t = 0; t < 8; t++) tiles[t].rows = c->rows[t], tiles[t].colsb = c->colsb[t], tile_zero(t);
}
static void tile_load(int t, const void *base, long stride) {
    memset(tiles[t].data, 0, sizeof tiles[t].data);
    for (int r = 0; r < tiles[t].rows; r++) memcpy(tiles[t].data[r], (const char *)base + r * stride, tiles[t].colsb);
}
static void tile_store(int t, void *base, long stride) {
    for (int r = 0; r < tiles[t].rows; r++) memcpy((char *)base + r * stride, tiles[t].data[r], tiles[t].colsb);
}
/* c += a . b, a's bytes signed or not, b's signed: c[m][n] += sum over k of a[m][k] b[k / 4][4 n + k % 4] */
static void tile_dot(int c, int a, int b, int a_signed) {
    for (int m = 0; m < tiles[c].rows; m++)
        for (int n = 0; n < tiles[c].colsb / 4; n++) {
            int32_t s;
            memcpy(&s, tiles[c].data[m] + 4 * n, 4);
            for (int k = 0; k < tiles[a].colsb; k++) {
                const int x = a_signed ? (int8_t)tiles[a].data[m][k] : tiles[a].data[m][k];
                s += x * (int8_t)tiles[b].data[k / 4][4 * n + k % 4];
            }
            memcpy(tiles[c].data[m] + 4 * n, &s, 4);
        }
}
#define TILE_CONFIG(cfg) tile_config(cfg)
#define TILE_SAVE_CONFIG(cfg) (*(cfg) = config)
#define TILE_RELEASE() memset(&config, 0, sizeof config)
#define TILE_LOAD(t, base, stride) tile_load((t), (base), (stride))
#define TILE_STORE(t, base, stride) tile_store((t), (base), (stride))
#define TILE_ZERO(t) tile_zero(t)
#define TILE_DPBUSD(c, a, b) tile_dot((c), (a), (b), 0)
#define TILE_DPBSSD(c, a, b) tile_dot((c), (a), (b), 1)
#else
#include <immintrin.h>

#define PATH ss_path_amx
#define NAME "AMX"
#define NEEDS (SS_CPU_AVX2 | SS_CPU_AVX512 | SS_CPU_AVX512_VNNI | SS_CPU_AMX)
#define BASE ss_path_avx512_vnni
/* the configuration instructions' asm names 8 of its 64 bytes: the barriers say all of them are read,
 * or written, so that none of the fields written before is dropped as unread */
#define TILE_CONFIG(cfg)                                  \
    do {                                                  \
        __asm__ volatile("" : : "r"(cfg) : "memory");     \
        _tile_loadconfig(cfg);                            \
    } while (0)
#define TILE_SAVE_CONFIG(cfg)                             \
    do {                                                  \
        _tile_storeconfig(cfg);                           \
        __asm__ volatile("" : : "r"(cfg) : "memory");     \
    } while (0)
#define TILE_RELEASE() _tile_release()
/* the compiler's barrier first: the instruction's asm does not say it reads memory, and the weights'
 * tile written just before must be stored, not dropped as unread */
#define TILE_LOAD(t, base, stride)                    \
    do {                                              \
        __asm__ volatile("" ::: "memory");            \
        _tile_loadd(t, (base), (stride));             \
    } while (0)
#define TILE_STORE(t, base, stride) _tile_stored(t, (base), (stride))
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)
#define TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#endif

extern const ss_path_t BASE;

/* The base path's quantisation, written as this path's tiles read it: 32 low bytes, then 32 high ones,
 * each in the order of the header's comment. */
static void quantise(const float *v, float levels, int16_t *q, int8_t *q8, float *scale, float *sum) {
    v32s x;
    BASE.quantise(v, levels, (int16_t *)&x, q8, scale, sum);
    const v32s order = {0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23,
                        8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31};
    const v32s y = __builtin_shuffle(x, order);
    const v32b lo = __builtin_convertvector(y, v32b), hi = __builtin_convertvector(y >> 8, v32b);
    memcpy(q, &lo, 32);
    memcpy((char *)q + 32, &hi, 32);
}

/* The weights' tile of one panel's block (256 bytes of Q4, 512 of Q8) into out[8][64]. */
INLINE void weight_tile(const int fmt, const uint8_t *block, uint8_t *out) {
    for (int r = 0; r < 8; r++) {
        v16u row;
        if (fmt == FMT_Q4) { /* a column's 2 bytes: the low nibbles are 2r, 2r + 1, the high 2r + 16, 2r + 17 */
            const v16u z = zext16(block + r * 32);
            row = (z & 0x0F0F) | ((z << 12) & 0x0F0F0000);
        } else { /* pair r holds 2r, 2r + 1, pair r + 8 holds 2r + 16, 2r + 17 */
            row = zext16(block + r * 32) | zext16(block + (r + 8) * 32) << 16;
        }
        memcpy(out + r * 64, &row, 64);
    }
}

/* Panel p's block b of rows r0 .. r0 + R - 1 scaled into acc[R] (kernels.h): each column's exact
 * D_b = 256 hi + lo from the tile unit's dot products (lo alone with int8 activations: narrow), then one
 * fma a row (two for Q4). */
INLINE void scale(const job_t *j, const int fmt, const int narrow, const int R, int r0, int p, int b,
                  const int32_t (*dot)[MAX_R][16], v16f *acc) {
    const int nb = j->K / 32;
    const v16f d16 = scales_v16(j, ss_panel_scales(j, j->d, p), b);
    const v16f m16 = fmt == FMT_Q4 ? scales_v16(j, ss_panel_scales(j, j->m, p), b) : (v16f){0};
    for (int r = 0; r < R; r++) {
        const size_t at = (size_t)(r0 + r) * nb + b;
        v16u hi;
        v16i lo;
        memcpy(&lo, dot[0][r], 64);
        v16i D = lo;
        if (!narrow) {
            memcpy(&hi, dot[1][r], 64);
            D += (v16i)(hi << 8);
        }
        acc[r] = fma16(__builtin_convertvector(D, v16f), d16 * splat(j->dx[at]), acc[r]);
        if (fmt == FMT_Q4) acc[r] = fma16(m16, splat(j->xsum[at]), acc[r]);
    }
}

/* One panel's block on tile set s (its weights' tile, its two dot products) into dot. With int8
 * activations (narrow) the low bytes are the int8 values themselves, signed: one dot product. */
#define PANEL_DOTS(narrow, B, C_LO, C_HI, w, dot) \
    do {                                          \
        TILE_LOAD(B, (w), 64);                    \
        TILE_ZERO(C_LO);                          \
        if (narrow) {                             \
            TILE_DPBSSD(C_LO, A_LO, B);           \
        } else {                                  \
            TILE_ZERO(C_HI);                      \
            TILE_DPBUSD(C_LO, A_LO, B);           \
            TILE_DPBSSD(C_HI, A_HI, B);           \
            TILE_STORE(C_HI, (dot)[1], 64);       \
        }                                         \
        TILE_STORE(C_LO, (dot)[0], 64);           \
    } while (0)

/* Rows r0 .. r0 + R - 1 (the tiles configured for R) of panels q0 .. q1 - 1 (at most CHUNK), columns below
 * n1. Block by block, the activations' tiles loaded once for every panel; panel by panel, in a pipeline
 * over two sets of tiles and buffers, so that no step waits on the one before: panel i + 1's weights are
 * unpacked while panel i's tile is loaded, and panel i - 1 is scaled after panel i's dot products are
 * issued (the tile unit's stores and loads go through memory, which forwards nothing to them). */
INLINE void int_chunk(const job_t *j, const int fmt, const int narrow, const int R, int r0, int q0, int q1, int n1) {
    const int nb = j->K / 32, bytes = fmt == FMT_Q4 ? 256 : 512, P = q1 - q0;
    _Alignas(64) uint8_t w[2][8 * 64];
    _Alignas(64) int32_t dot[2][2][MAX_R][16]; /* [set][low, high][row][column] */
    v16f acc[CHUNK][MAX_R];
    for (int i = 0; i < P; i++)
        for (int r = 0; r < R; r++) acc[i][r] = (v16f){0};
    const uint8_t *x = (const uint8_t *)(j->qx + (size_t)r0 * nb * 32); /* a row's blocks: 64 bytes each */
    const long stride = (long)nb * 64;
    for (int b = 0; b < nb; b++) {
        TILE_LOAD(A_LO, x + (size_t)b * 64, stride);
        if (!narrow) TILE_LOAD(A_HI, x + (size_t)b * 64 + 32, stride);
        weight_tile(fmt, ss_panel_weights(j, q0) + (size_t)b * bytes, w[0]);
        for (int i = 0; i < P; i++) {
            if (i + 1 < P) weight_tile(fmt, ss_panel_weights(j, q0 + i + 1) + (size_t)b * bytes, w[(i + 1) & 1]);
            if (i & 1) PANEL_DOTS(narrow, B1, C1_LO, C1_HI, w[1], dot[1]);
            else PANEL_DOTS(narrow, B0, C0_LO, C0_HI, w[0], dot[0]);
            if (i > 0) scale(j, fmt, narrow, R, r0, q0 + i - 1, b, dot[(i - 1) & 1], acc[i - 1]);
        }
        scale(j, fmt, narrow, R, r0, q1 - 1, b, dot[(P - 1) & 1], acc[P - 1]);
    }
    for (int i = 0; i < P; i++) store_panel(j, R, r0, q0 + i, n1, acc[i]);
}

/* Panels p0 .. p1 - 1 of rows r0 .. r0 + R - 1, CHUNK at a time: their accumulators stay in the first
 * level of cache. */
INLINE void int_rows(const job_t *j, const int fmt, const int R, int r0, int p0, int p1, int n1) {
    for (int q0 = p0; q0 < p1; q0 += CHUNK) {
        const int q1 = q0 + CHUNK < p1 ? q0 + CHUNK : p1;
        if (j->qx8) int_chunk(j, fmt, 1, R, r0, q0, q1, n1);
        else int_chunk(j, fmt, 0, R, r0, q0, q1, n1);
    }
}

/* The tiles for R rows, configured on every call: the thread's tiles are its own state, which other code
 * on the same thread (a library's matrix multiply) may have configured otherwise since. */
static void configure(int R) {
    tile_config_t cfg = {.palette = 1};
    cfg.rows[A_LO] = cfg.rows[A_HI] = (uint8_t)R, cfg.colsb[A_LO] = cfg.colsb[A_HI] = 32;
    cfg.rows[B0] = cfg.rows[B1] = 8, cfg.colsb[B0] = cfg.colsb[B1] = 64;
    for (int t = C0_LO; t <= C1_HI; t++) cfg.rows[t] = (uint8_t)R, cfg.colsb[t] = 64;
    TILE_CONFIG(&cfg);
}

/* Columns n0 (a panel's first) .. n1 - 1 of the integer formats: the rows in tiles of at most MAX_R, as
 * even as they go (17 rows are 9 + 8), each over every panel. The thread's tile configuration is put back
 * as it was found (released, or another library's, which may count on it staying). */
static void int_columns(const job_t *j, const int fmt, int n0, int n1) {
    const int p0 = n0 / SS_PANEL, p1 = (n1 + SS_PANEL - 1) / SS_PANEL;
    _Alignas(64) tile_config_t found;
    TILE_SAVE_CONFIG(&found);
    int r0 = 0;
    for (int tiles = (j->M + MAX_R - 1) / MAX_R; tiles > 0; tiles--) {
        const int R = (j->M - r0 + tiles - 1) / tiles;
        configure(R);
        int_rows(j, fmt, R, r0, p0, p1, n1);
        r0 += R;
    }
    if (found.palette) TILE_CONFIG(&found);
    else TILE_RELEASE();
}

static void columns(const job_t *j, int n0, int n1) {
    if (j->fmt == FMT_Q4) int_columns(j, FMT_Q4, n0, n1);
    else if (j->fmt == FMT_Q8) int_columns(j, FMT_Q8, n0, n1);
    else BASE.columns(j, n0, n1);
}

static void attend(const attn_t *a, int t, int g, int *keys, float *buf) { BASE.attend(a, t, g, keys, buf); }

const ss_path_t PATH = {NAME, NEEDS, SS_MANY_ROWS, quantise, columns, attend, 0};
