/* Float matrix multiplies: y[M, N] = x[M, K] @ W[N, K]^T for float32, bfloat16 and float16 weights.
 *
 * Three kinds of call, one set of panels and tiles:
 *   float32 weights, float32 x and y             (a float32 model)
 *   bfloat16 weights, bfloat16 x and y           (a float model held in bfloat16)
 *   F16 or BF16 weights, float32 x and y         (a GGUF file's F16 / BF16 matrices, whose
 *                                                 activations are float32 like every block type's)
 * The weight's element type is named by its GGML type number (F32 0, F16 1, BF16 30), which is
 * also the format the one-call decoder gives such a matrix (stages.h).
 *
 * Weight layout (made once at load by nanoserve/native/matmul.py's `pack`): W's rows (output
 * columns) in panels of 16; a full panel is stored K-major, 16 values per k, so a k step is one
 * contiguous 64-byte (float32) or 32-byte (16-bit) read and the whole panel is one stream.
 * The last N % 16 columns form a narrower tail panel, [K][N % 16]. The packed tensor keeps W's
 * element count, so it keeps W's shape (and a GGUF file's 2-byte values, regrouped: resident
 * bytes are the file's). In a bfloat16 panel the 16 values of a k step are interleaved
 * c0 c8 c1 c9 ... c7 c15: read as 8 32-bit words, `word << 16` is columns 0..7 and
 * `word & 0xffff0000` is columns 8..15 as float32, two integer ops and no shuffles
 * (this CPU has no AVX512-BF16; a bfloat16 is the top half of a float32). A float16 panel keeps
 * the columns in order: each 8 halves widen with one F16C vcvtph2ps (exact, as the shift is).
 *
 * The arithmetic, and why it is batch-invariant: output (i, j) is one fused multiply-add chain,
 * acc = fma(x[i][k], W[j][k], acc) for k = 0, 1, ..., K-1, starting from 0 and rounded once
 * at the end (to bfloat16 for bfloat16 calls; widening a 16-bit weight is exact, not a rounding).
 * Every path below runs exactly that chain, whatever the row block, the number of rows in the
 * call, the thread split or the tile, so a row's bits never depend on its neighbours; and the
 * portable path equals the AVX2 path bit for bit where fmaf is a real fused instruction
 * (FP_FAST_FMAF), which the tests check.
 *
 * Blocking: threads take contiguous ranges of panels (output columns, never K). The rows go in
 * macro-blocks whose activations fit a core's L2 (MACRO_ROW_BYTES); within one, for each panel
 * (two at a time for blocks of up to 3 rows, to keep enough independent FMA chains in flight)
 * the rows go through in blocks of at most 6, all while the panel sits in L1/L2, so a weight
 * byte comes from memory once per call whatever the row count. A 6-row x 16-column tile keeps
 * 12 accumulators, 2 weight vectors and 1 broadcast in the 16 AVX2 registers: per k, 2 weight
 * loads and 6 broadcasts feed 12 FMAs, enough to keep both FMA pipes busy in prefill, and at
 * one row the loop streams the panel at memory speed: two panels, two sequential streams, four
 * independent chains, enough that a core consumes its panels faster than its share of the
 * memory bus delivers them (results/README.md has the rates), so the stream sets the pace.
 * bfloat16 activations are widened to a float32 copy once per call (M x K floats, small beside
 * the weights). Where the CPU runs AVX-512 (and ns_isa_best() allows it), blocks of 4 or more
 * rows of float32 output go through arch/x86/float_tiles_avx512.c's 12-row x 2-panel tile
 * instead, with the same chain per output; a thread's odd panel out and the tail stay here.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gemm/float_tiles.h"
#include "nanoserve.h"
#include "runtime/isa.h"
#include "stages/stages.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NS_FLOAT_AVX2 1
#endif

enum { PANEL = NS_FLOAT_PANEL, ROW_BLOCK = 6 };
/* The weight's element type: its GGML type number (stages.h's NS_*_PANELS) */
enum { F32 = NS_F32_PANELS, F16 = NS_F16_PANELS, BF16 = NS_BF16_PANELS };
/* The kinds of call (header): a weight type, and whether x and y are bfloat16 */
enum { CALL_F32, CALL_BF16, CALL_BF16_WEIGHT, CALL_F16_WEIGHT, CALLS };
/* A thread's share must be worth waking it: below this many multiply-adds per thread a call
 * runs on fewer threads (a test model's 64 x 64 weights run on one; the default model's
 * smallest, 576 x 576 at one row, still on two). Bits do not depend on it. */
enum { MIN_MACS_PER_THREAD = 1 << 17 };

#define NS_INLINE static inline __attribute__((always_inline))

typedef struct {
    const float *x;   /* [m, k] float32 (bfloat16 inputs widened first) */
    const void *w;    /* packed weight */
    void *y;          /* [m, y_stride]: float32, or bfloat16 for CALL_BF16 */
    int64_t m, n, k;
    int64_t y_stride; /* n, or a stack's width (a part writes its columns of the stack's rows) */
    int call;         /* CALL_*: the weight's type and the output's */
} Problem;

NS_INLINE int weight_type(int call) {
    return call == CALL_F32 ? F32 : call == CALL_F16_WEIGHT ? F16 : BF16;
}

NS_INLINE float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion does (any NaN -> 0x7fc0). */
NS_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (isnan(f)) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* ---- portable path: one row x one panel at a time, the 16 columns a loop the compiler vectorizes */

/* Element `at` of a packed weight of element type `type`, widened to float32 (exactly). */
NS_INLINE float weight_at(int type, const void *w, int64_t at) {
    if (type == F32) return ((const float *)w)[at];
    if (type == F16) return f16_to_f32((const uint8_t *)((const uint16_t *)w + at));
    return bf16_to_f32(((const uint16_t *)w)[at]);
}

/* Column c of the panel at step kk, widened to float32; 0 past a tail panel's width. */
NS_INLINE void panel_step(const Problem *p, int64_t panel, int64_t kk, int width, float *out) {
    const int64_t base = panel * PANEL * p->k;
    const int type = weight_type(p->call);
    if (width == PANEL && type == BF16) {
        const uint16_t *w = (const uint16_t *)p->w + base + kk * PANEL;
        for (int l = 0; l < PANEL / 2; l++) {
            out[l] = bf16_to_f32(w[2 * l]);
            out[l + PANEL / 2] = bf16_to_f32(w[2 * l + 1]);
        }
        return;
    }
    for (int c = 0; c < PANEL; c++) out[c] = c < width ? weight_at(type, p->w, base + kk * width + c) : 0.0f;
}

static void row_panel_portable(const Problem *p, int64_t row, int64_t panel) {
    const int width = (int)(p->n - panel * PANEL < PANEL ? p->n - panel * PANEL : PANEL);
    const float *x = p->x + row * p->k;
    float acc[PANEL] = {0}, w[PANEL];
    for (int64_t kk = 0; kk < p->k; kk++) {
        panel_step(p, panel, kk, width, w);
        for (int c = 0; c < PANEL; c++) acc[c] = NS_MADD(x[kk], w[c], acc[c]);
    }
    for (int c = 0; c < width; c++) {
        const int64_t at = row * p->y_stride + panel * PANEL + c;
        if (p->call == CALL_BF16)
            ((uint16_t *)p->y)[at] = f32_to_bf16(acc[c]);
        else
            ((float *)p->y)[at] = acc[c];
    }
}

/* ---- AVX2 + FMA path: a tile of R rows x NP panels, R and NP compile-time constants */

#ifdef NS_FLOAT_AVX2
/* Step kk of a full panel as two float32 vectors: columns 0..7 and 8..15. */
NS_INLINE void load_panel_step(const void *panel, int64_t kk, int type, __m256 *lo, __m256 *hi) {
    if (type == F16) {
        const __m128i *halves = (const __m128i *)((const uint16_t *)panel + kk * PANEL);
        *lo = _mm256_cvtph_ps(_mm_loadu_si128(halves));
        *hi = _mm256_cvtph_ps(_mm_loadu_si128(halves + 1));
    } else if (type == BF16) {
        const __m256i words = _mm256_loadu_si256((const __m256i *)((const uint16_t *)panel + kk * PANEL));
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
        *hi = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32((int)0xffff0000u)));
    } else {
        *lo = _mm256_loadu_ps((const float *)panel + kk * PANEL);
        *hi = _mm256_loadu_ps((const float *)panel + kk * PANEL + PANEL / 2);
    }
}

NS_INLINE __m256i bf16_round(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
}

NS_INLINE void store_panel_row(const Problem *p, int64_t row, int64_t panel, int bf16, __m256 lo, __m256 hi) {
    const int64_t at = row * p->y_stride + panel * PANEL;
    if (bf16) {
        /* packus works per 128-bit lane: lo0-3 hi0-3 lo4-7 hi4-7; the permute restores the order */
        const __m256i packed = _mm256_packus_epi32(bf16_round(lo), bf16_round(hi));
        _mm256_storeu_si256((__m256i *)((uint16_t *)p->y + at), _mm256_permute4x64_epi64(packed, 0xd8));
    } else {
        _mm256_storeu_ps((float *)p->y + at, lo);
        _mm256_storeu_ps((float *)p->y + at + PANEL / 2, hi);
    }
}

/* One tile: R rows (1..6) x one panel, or R rows (1..3) x two panels (then the second panel's
 * accumulators are the "row + 3" ones). R, NP and call are compile-time constants in every
 * instance, so the `if`s fold away; the accumulators are named variables, not an array,
 * because GCC 12 otherwise stores an array of them to the stack at every k step. */
NS_INLINE void tile_avx2(const Problem *p, int64_t row0, int64_t panel, const int R, const int NP,
                         const int call) {
    const int64_t k = p->k;
    const float *x = p->x + row0 * k;
    const int type = weight_type(call), bf16 = call == CALL_BF16;
    const size_t element = type == F32 ? sizeof(float) : sizeof(uint16_t);
    const char *w0 = (const char *)p->w + (size_t)(panel * k * PANEL) * element;
    const char *w1 = w0 + (size_t)(k * PANEL) * element;
    const float *x0 = x, *x1 = x + k, *x2 = x + 2 * k;
    const float *x3 = NP == 2 ? x0 : x + 3 * k, *x4 = NP == 2 ? x1 : x + 4 * k, *x5 = NP == 2 ? x2 : x + 5 * k;
    const int rows_hi = NP == 2 ? R : R - 3; /* accumulator pairs 3..5 in use */
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0;
    __m256 a3 = a0, b3 = a0, a4 = a0, b4 = a0, a5 = a0, b5 = a0;
    for (int64_t kk = 0; kk < k; kk++) {
        __m256 lo, hi, lo2 = _mm256_setzero_ps(), hi2 = lo2;
        load_panel_step(w0, kk, type, &lo, &hi);
        if (NP == 2) load_panel_step(w1, kk, type, &lo2, &hi2);
        const __m256 v3 = NP == 2 ? lo2 : lo, u3 = NP == 2 ? hi2 : hi;
#define NS_ROW(i, xi, vl, vh) \
        if ((i < 3 ? R : rows_hi + 3) > i) { \
            const __m256 xb = _mm256_broadcast_ss(xi + kk); \
            a##i = _mm256_fmadd_ps(xb, vl, a##i); \
            b##i = _mm256_fmadd_ps(xb, vh, b##i); \
        }
        NS_ROW(0, x0, lo, hi) NS_ROW(1, x1, lo, hi) NS_ROW(2, x2, lo, hi)
        NS_ROW(3, x3, v3, u3) NS_ROW(4, x4, v3, u3) NS_ROW(5, x5, v3, u3)
#undef NS_ROW
    }
    /* accumulator pair i < 3 is row i of the first panel; pair i >= 3 is row i - 3 of the
     * second panel (NP == 2) or row i of the first (NP == 1) */
    const int64_t row3 = NP == 2 ? row0 : row0 + 3, panel3 = NP == 2 ? panel + 1 : panel;
    if (R > 0) store_panel_row(p, row0, panel, bf16, a0, b0);
    if (R > 1) store_panel_row(p, row0 + 1, panel, bf16, a1, b1);
    if (R > 2) store_panel_row(p, row0 + 2, panel, bf16, a2, b2);
    if (rows_hi > 0) store_panel_row(p, row3, panel3, bf16, a3, b3);
    if (rows_hi > 1) store_panel_row(p, row3 + 1, panel3, bf16, a4, b4);
    if (rows_hi > 2) store_panel_row(p, row3 + 2, panel3, bf16, a5, b5);
}

typedef void (*TileFn)(const Problem *, int64_t, int64_t);
#define TILE(R, NP, C) \
    static void tile_##R##_##NP##_##C(const Problem *p, int64_t row0, int64_t panel) { \
        tile_avx2(p, row0, panel, R, NP, C); \
    }
#define TILES_FOR(C) TILE(1, 1, C) TILE(2, 1, C) TILE(3, 1, C) TILE(4, 1, C) TILE(5, 1, C) TILE(6, 1, C) \
                     TILE(1, 2, C) TILE(2, 2, C) TILE(3, 2, C)
TILES_FOR(CALL_F32)
TILES_FOR(CALL_BF16)
TILES_FOR(CALL_BF16_WEIGHT)
TILES_FOR(CALL_F16_WEIGHT)
#define ONE_PANEL(C) {tile_1_1_##C, tile_2_1_##C, tile_3_1_##C, tile_4_1_##C, tile_5_1_##C, tile_6_1_##C}
#define TWO_PANELS(C) {tile_1_2_##C, tile_2_2_##C, tile_3_2_##C}
/* [call][rows - 1]: one panel; two panels for blocks of up to 3 rows */
static const TileFn TILES_1[CALLS][ROW_BLOCK] = {ONE_PANEL(CALL_F32), ONE_PANEL(CALL_BF16),
                                                 ONE_PANEL(CALL_BF16_WEIGHT), ONE_PANEL(CALL_F16_WEIGHT)};
static const TileFn TILES_2[CALLS][3] = {TWO_PANELS(CALL_F32), TWO_PANELS(CALL_BF16),
                                         TWO_PANELS(CALL_BF16_WEIGHT), TWO_PANELS(CALL_F16_WEIGHT)};
#endif

/* ---- the loop over a thread's panels and the call's row blocks */

/* Rows of activations a thread keeps in its L2 while its panels pass over them. A panel stays in
 * L1/L2 across a block of rows, but a prompt-sized call (an image's tiles: thousands of rows)
 * has far more activation bytes than the caches hold, and walking every row under each panel
 * would read them all from memory once per panel; macro-blocks of rows bound that to once per
 * call, at the price of reading the thread's panels once per macro-block (from L3, a fraction
 * of the arithmetic's time even at K = 3072). A multiple of both tiles' heights. */
enum { MACRO_ROW_BYTES = 384 * 1024, MACRO_ROW_MULTIPLE = 12 };
/* The AVX-512 pair tile runs row blocks of at least this many rows: below it its two chains a
 * row leave the FMA units waiting on latency, where the AVX2 tiles keep four. */
enum { WIDE_MIN_ROWS = 4 };

/* Block b of `blocks` over rows [start, start + m), as even as possible (16 rows in 3 blocks:
 * 6 5 5), so no block is a slow sliver: its first row, and its row count in *rows. */
static inline int64_t row_block(int64_t start, int64_t m, int64_t blocks, int64_t b, int64_t *rows) {
    const int64_t row0 = start + b * m / blocks;
    *rows = start + (b + 1) * m / blocks - row0;
    return row0;
}

static int64_t macro_rows(int64_t k) {
    const int64_t rows = MACRO_ROW_BYTES / (k * (int64_t)sizeof(float)) / MACRO_ROW_MULTIPLE * MACRO_ROW_MULTIPLE;
    return rows > MACRO_ROW_MULTIPLE ? rows : MACRO_ROW_MULTIPLE;
}

/* Panels [first, last) against rows [start, start + m): the AVX2 tiles (`vector`), else the
 * portable rows. */
static void narrow_panels(const Problem *p, int64_t start, int64_t m, int64_t first, int64_t last, int vector) {
    const int64_t full = p->n / PANEL;
    const int64_t blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK;
    for (int64_t panel = first; panel < last;) {
        const int pair = panel + 1 < last && panel + 1 < full;
        const int np = pair ? 2 : 1;
        for (int64_t b = 0; b < blocks; b++) {
            int64_t rows;
            const int64_t row0 = row_block(start, m, blocks, b, &rows);
#ifdef NS_FLOAT_AVX2
            if (vector && panel < full) {
                if (pair && rows <= 3) {
                    TILES_2[p->call][rows - 1](p, row0, panel);
                } else {
                    for (int q = 0; q < np; q++) TILES_1[p->call][rows - 1](p, row0, panel + q);
                }
                continue;
            }
#endif
            (void)vector;
            for (int q = 0; q < np; q++)
                for (int64_t r = row0; r < row0 + rows; r++) row_panel_portable(p, r, panel + q);
        }
        panel += np;
    }
}

/* The pairs of full panels from `first` against rows [start, start + m) on the AVX-512 tile;
 * returns the first panel it left (an odd one out, or the tail) for the narrow tiles. */
static int64_t wide_panels(const Problem *p, ns_float_pair_tile tile, int64_t start, int64_t m, int64_t first,
                           int64_t last) {
    const int64_t full = p->n / PANEL;
    const int64_t blocks = (m + NS_FLOAT_PAIR_ROWS - 1) / NS_FLOAT_PAIR_ROWS;
    const size_t element = weight_type(p->call) == F32 ? sizeof(float) : sizeof(uint16_t);
    int64_t panel = first;
    for (; panel + 1 < last && panel + 1 < full; panel += 2) {
        const char *panels = (const char *)p->w + (size_t)(panel * PANEL * p->k) * element;
        for (int64_t b = 0; b < blocks; b++) {
            int64_t rows;
            const int64_t row0 = row_block(start, m, blocks, b, &rows);
            tile((int)rows, p->x + row0 * p->k, p->k, panels, (float *)p->y + row0 * p->y_stride + panel * PANEL,
                 p->y_stride);
        }
    }
    return panel;
}

/* The AVX-512 pair tile a call of kind `call` runs on ISA `isa` (isa.h), or NULL: an ISA below
 * AVX-512, a bfloat16-output call (its rounding lives in the AVX2 tiles), or no AVX-512 here. */
static ns_float_pair_tile wide_tile(int isa, int call) {
    return isa >= NS_ISA_AVX512 && call != CALL_BF16 ? ns_float_pair_tile_avx512(weight_type(call)) : NULL;
}

/* A thread's panels [first, last) on ISA `isa` (isa.h; NS_ISA_PORTABLE: the plain C rows). */
static void run_panels(const Problem *p, int64_t first, int64_t last, int isa) {
    const int64_t macro = macro_rows(p->k);
    const ns_float_pair_tile wide = wide_tile(isa, p->call);
    for (int64_t start = 0; start < p->m; start += macro) {
        const int64_t m = p->m - start < macro ? p->m - start : macro;
        const int64_t rest = wide && m >= WIDE_MIN_ROWS ? wide_panels(p, wide, start, m, first, last) : first;
        narrow_panels(p, start, m, rest, last, isa != NS_ISA_PORTABLE);
    }
}

typedef struct {
    const Problem *p;
    int64_t panels;
    int isa;
} PanelJob;

static void panels_task(void *context, int thread, int threads) {
    const PanelJob *job = context;
    int64_t begin, end;
    ns_share(job->panels, thread, threads, &begin, &end);
    run_panels(job->p, begin, end, job->isa);
}

static void run(const Problem *p, int num_threads, int isa) {
    const int64_t panels = (p->n + PANEL - 1) / PANEL;
    const int64_t worth = p->m * p->n * p->k / MIN_MACS_PER_THREAD;
    if (num_threads > panels) num_threads = (int)panels;
    if (num_threads > worth) num_threads = worth > 1 ? (int)worth : 1;
    PanelJob job = {p, panels, isa};
    ns_parallel(num_threads, panels_task, &job);
}

/* The call that multiplies float32 activations by weights of GGML type `fmt`: -1 for a type
 * with no panels. */
static int float32_call(int fmt) {
    return fmt == F32 ? CALL_F32 : fmt == F16 ? CALL_F16_WEIGHT : fmt == BF16 ? CALL_BF16_WEIGHT : -1;
}

void ns_stage_panels(int fmt, const float *x, const void *w, float *y, int64_t y_stride, int64_t m, int64_t n,
                     int64_t k, int thread, int threads) {
    const Problem p = {x, w, y, m, n, k, y_stride, float32_call(fmt)};
    int64_t begin, end;
    ns_share((n + PANEL - 1) / PANEL, thread, threads, &begin, &end);
    run_panels(&p, begin, end, ns_isa_best());
}

void ns_stage_float(const float *x, const float *w, float *y, int64_t m, int64_t n, int64_t k, int thread,
                    int threads) {
    ns_stage_panels(F32, x, w, y, n, m, n, k, thread, threads);
}

static int matmul_float32(int fmt, const float *x, const void *w, float *y, int64_t m, int64_t n, int64_t k,
                          int num_threads, int isa) {
    const Problem p = {x, w, y, m, n, k, n, float32_call(fmt)};
    if (p.call < 0) return -1;
    run(&p, num_threads, isa);
    return 0;
}

static int matmul_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t m, int64_t n,
                       int64_t k, int num_threads, int isa) {
    float *wide = malloc((size_t)(m * k) * sizeof *wide);
    if (wide == NULL) return 1;
    for (int64_t i = 0; i < m * k; i++) wide[i] = bf16_to_f32(x[i]);
    const Problem p = {wide, w, y, m, n, k, n, CALL_BF16};
    run(&p, num_threads, isa);
    free(wide);
    return 0;
}

/* The entry points: 0 on success, 1 when the widened activations could not be allocated.
 * `*_portable` skip the ISA path (for the tests that hold one against the other). */
NS_EXPORT int ns_matmul_f32(const float *x, const float *w, float *y, int64_t m, int64_t n, int64_t k,
                            int num_threads) {
    return matmul_float32(F32, x, w, y, m, n, k, num_threads, ns_isa_best());
}

NS_EXPORT int ns_matmul_f32_portable(const float *x, const float *w, float *y, int64_t m, int64_t n,
                                     int64_t k, int num_threads) {
    return matmul_float32(F32, x, w, y, m, n, k, num_threads, NS_ISA_PORTABLE);
}

NS_EXPORT int ns_matmul_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t m, int64_t n,
                             int64_t k, int num_threads) {
    return matmul_bf16(x, w, y, m, n, k, num_threads, ns_isa_best());
}

NS_EXPORT int ns_matmul_bf16_portable(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t m,
                                      int64_t n, int64_t k, int num_threads) {
    return matmul_bf16(x, w, y, m, n, k, num_threads, NS_ISA_PORTABLE);
}

/* A GGUF file's F16 or BF16 matrix (`fmt`: its GGML type) in panels, float32 x and y; -1 for
 * another type. */
NS_EXPORT int ns_matmul_half_panels(int fmt, const float *x, const uint16_t *w, float *y, int64_t m, int64_t n,
                                    int64_t k, int num_threads) {
    return fmt == F32 ? -1 : matmul_float32(fmt, x, w, y, m, n, k, num_threads, ns_isa_best());
}

NS_EXPORT int ns_matmul_half_panels_portable(int fmt, const float *x, const uint16_t *w, float *y, int64_t m,
                                             int64_t n, int64_t k, int num_threads) {
    return fmt == F32 ? -1 : matmul_float32(fmt, x, w, y, m, n, k, num_threads, NS_ISA_PORTABLE);
}

/* Float32 activations against float32 (`fmt` 0) or a GGUF file's F16 / BF16 panels on ISA `isa`
 * (isa.h), for the tests that hold every ISA this CPU runs against the portable path: -1 where
 * `isa` does not run here or `fmt` has no panels. */
NS_EXPORT int ns_matmul_float_isa(int isa, int fmt, const float *x, const void *w, float *y, int64_t m, int64_t n,
                                  int64_t k, int num_threads) {
    return ns_isa_runs(isa) ? matmul_float32(fmt, x, w, y, m, n, k, num_threads, isa) : -1;
}

/* The ISA the float panels run on here (isa.h's level): AVX-512's pair tiles where
 * ns_isa_best() allows them (prompt-sized calls; fewer than WIDE_MIN_ROWS rows run AVX2's). */
NS_EXPORT int ns_matmul_float_isa_chosen(void) {
    if (wide_tile(ns_isa_best(), CALL_F32)) return NS_ISA_AVX512;
#ifdef NS_FLOAT_AVX2
    return NS_ISA_AVX2;
#else
    return NS_ISA_PORTABLE;
#endif
}

/* The panel width `pack` must use, and whether the portable chain is fused (then it equals the
 * ISA path bit for bit). */
NS_EXPORT int ns_matmul_float_panel(void) { return PANEL; }
NS_EXPORT int ns_matmul_float_portable_fused(void) { return NS_PORTABLE_FUSED; }
