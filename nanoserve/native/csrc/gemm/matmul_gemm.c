/* The prefill GEMM: y = x @ W^T for a prompt chunk (many rows) against matmul_x8.c's layouts.
 *
 * matmul_x8.c's tile unpacks a group-block's codes into 8 registers and then walks each row of
 * its tile over them. Here the loops are turned as llamafile's tinyBLAS turns them: for each
 * block, each 32-byte chunk of the group's codes is loaded and unpacked once and met by every
 * row of the tile at once, each row keeping only its integer sum and its float accumulator in
 * registers (GEMM_TILE rows by one group of 8 columns). A row's offset term is a separate chain
 * over the blocks, run after the integer chain: the offsets and the integer sums never mix
 * before the final add, so running them as two loops changes no bit. Whether this beats the
 * x8 tiles is measured per machine: the kernel choice (model/linear.py, `native-quant-gemm`)
 * times both at its 16- and 32-row calls; results/README.md has what we measured.
 *
 * The arithmetic of output (row, column) is matmul_x8.c's, instruction for instruction:
 *     acc = fma(float(isum_b), d_b * dx_b, acc), off = fma(m_b, sx_b, off) for b in K order,
 *     y = acc + off   (Q8_0: off = 0)
 * where isum_b is the block's exact integer dot product (summed in another order here, which
 * an exact integer sum does not see). So a row's bits are the same from this GEMM, from the
 * x8 GEMV of a decode step, alone or in any chunk, and on either path (the portable reference
 * below uses the same fmaf chain). Int16 headroom as in matmul_x8.c.
 *
 * Blocking: threads split groups of columns (never a reduction); a thread runs each panel of
 * GEMM_PANEL rows against its groups one at a time, the group's blocks in L1, the panel's
 * quantized rows in L2 (64 rows x 48 blocks x 40 bytes = 120 KB at the default model's largest K).
 */
#include <stdlib.h>

#include "nanoserve.h"
#include "quant/quant_blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define NS_GEMM_AVX2 1
#endif

enum { GEMM_Q4_1 = 3, GEMM_Q8_0 = 8 }; /* the GGML type numbers of matmul_x8.c's layouts */
enum { GEMM_COLUMNS = 8, GEMM_TILE = 4, GEMM_PANEL = 64 };

static int gemm_block_bytes(int fmt) { return fmt == GEMM_Q4_1 ? 160 : fmt == GEMM_Q8_0 ? 272 : 0; }

/* ---- the scalar reference ---------------------------------------------------------------- */

/* Output (row, column c of the group) by the header's arithmetic, one value at a time. */
static float gemm_output_portable(int fmt, const uint8_t *group, int c, const xblock *x, int64_t blocks) {
    const int bytes = gemm_block_bytes(fmt);
    float acc = 0.0f, off = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + b * bytes;
        int isum = 0;
        if (fmt == GEMM_Q4_1) {
            for (int i = 0; i < 16; i++) {
                int code = block[32 + 32 * (i / 4) + 4 * c + i % 4];
                isum += (code & 0x0F) * x[b].qs[i] + (code >> 4) * x[b].qs[16 + i];
            }
            off = fmaf(f16_to_f32(block + 16 + 2 * c), x[b].s, off);
        } else {
            for (int i = 0; i < 32; i++) isum += (int8_t)block[16 + 32 * (i / 4) + 4 * c + i % 4] * x[b].qs[i];
        }
        acc = fmaf((float)isum, f16_to_f32(block + 2 * c) * x[b].d, acc);
    }
    return acc + off;
}

static void gemm_tile_portable(int fmt, int rows, const uint8_t *group, const xblock *x, int64_t blocks, float *y,
                               int64_t n, int valid) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < valid; c++) y[r * n + c] = gemm_output_portable(fmt, group, c, x + r * blocks, blocks);
}

/* ---- AVX2 -------------------------------------------------------------------------------- */

#ifdef NS_GEMM_AVX2
static inline __m256i gemm_broadcast4(const int8_t *p) { /* 4 code bytes into every 32-bit lane */
    int32_t word;
    memcpy(&word, p, 4);
    return _mm256_set1_epi32(word);
}

/* The integer chain of `rows` rows against one group: acc[r] for each row. */
static inline __attribute__((always_inline)) void q4_1_products(const int rows, const uint8_t *group,
                                                                const xblock *x, int64_t blocks, __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + b * 160;
        __m256i sums[GEMM_TILE];
        for (int r = 0; r < rows; r++) sums[r] = _mm256_setzero_si256();
        for (int t = 0; t < 4; t++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(block + 32 + 32 * t));
            const __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
            for (int r = 0; r < rows; r++) {
                const int8_t *xq = x[r * blocks + b].qs;
                __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, gemm_broadcast4(xq + 4 * t)),
                                                _mm256_maddubs_epi16(hi, gemm_broadcast4(xq + 16 + 4 * t)));
                sums[r] = _mm256_add_epi16(sums[r], pair);
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
        for (int r = 0; r < rows; r++) {
            __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r], ones));
            acc[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(d, _mm256_set1_ps(x[r * blocks + b].d)), acc[r]);
        }
    }
}

static inline __attribute__((always_inline)) void q8_0_products(const int rows, const uint8_t *group,
                                                                const xblock *x, int64_t blocks, __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + b * 272;
        __m256i sums[GEMM_TILE];
        for (int r = 0; r < rows; r++) sums[r] = _mm256_setzero_si256();
        for (int t = 0; t < 8; t++) {
            /* maddubs multiplies unsigned by signed bytes: the weight's sign moves onto x */
            const __m256i w = _mm256_loadu_si256((const __m256i *)(block + 16 + 32 * t));
            const __m256i magnitude = _mm256_sign_epi8(w, w);
            for (int r = 0; r < rows; r++) {
                __m256i xs = _mm256_sign_epi8(gemm_broadcast4(x[r * blocks + b].qs + 4 * t), w);
                sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xs), ones));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, _mm256_set1_ps(x[r * blocks + b].d)),
                                     acc[r]);
    }
}

static inline void gemm_store(float *y, __m256 v, int valid) {
    if (valid == GEMM_COLUMNS) {
        _mm256_storeu_ps(y, v);
        return;
    }
    float lanes[GEMM_COLUMNS];
    _mm256_storeu_ps(lanes, v);
    memcpy(y, lanes, (size_t)valid * sizeof(float));
}

/* A tile of `rows` rows against one group: the integer chain, then (Q4_1) the offset chain. */
static inline __attribute__((always_inline)) void gemm_tile_avx2(const int fmt, const int rows, const uint8_t *group,
                                                                 const xblock *x, int64_t blocks, float *y,
                                                                 int64_t n, int valid) {
    __m256 acc[GEMM_TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    if (fmt == GEMM_Q4_1) {
        q4_1_products(rows, group, x, blocks, acc);
        __m256 off[GEMM_TILE];
        for (int r = 0; r < rows; r++) off[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(group + b * 160 + 16)));
            for (int r = 0; r < rows; r++) off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[r * blocks + b].s), off[r]);
        }
        for (int r = 0; r < rows; r++) acc[r] = _mm256_add_ps(acc[r], off[r]);
    } else {
        q8_0_products(rows, group, x, blocks, acc);
    }
    for (int r = 0; r < rows; r++) gemm_store(y + r * n, acc[r], valid);
}

/* One function per (format, tile height), both constants, so the tile's registers are named. */
#define DEFINE_GEMM_TILE(NAME, FMT)                                                                      \
    static void NAME(int fmt, int rows, const uint8_t *group, const xblock *x, int64_t blocks, float *y, \
                     int64_t n, int valid) {                                                             \
        (void)fmt;                                                                                       \
        switch (rows) {                                                                                  \
        case 4: gemm_tile_avx2(FMT, 4, group, x, blocks, y, n, valid); return;                           \
        case 3: gemm_tile_avx2(FMT, 3, group, x, blocks, y, n, valid); return;                           \
        case 2: gemm_tile_avx2(FMT, 2, group, x, blocks, y, n, valid); return;                           \
        default: gemm_tile_avx2(FMT, 1, group, x, blocks, y, n, valid); return;                          \
        }                                                                                                \
    }
DEFINE_GEMM_TILE(gemm_tile_avx2_q4_1, GEMM_Q4_1)
DEFINE_GEMM_TILE(gemm_tile_avx2_q8_0, GEMM_Q8_0)
#endif

/* ---- the entry points -------------------------------------------------------------------- */

typedef void (*gemm_tile_fn)(int fmt, int rows, const uint8_t *group, const xblock *x, int64_t blocks, float *y,
                             int64_t n, int valid);

/* Thread `thread`'s groups of columns of y = xq @ W^T, every panel of rows. */
static void gemm_groups(gemm_tile_fn tile, int fmt, const xblock *xq, const uint8_t *w, float *y, int64_t rows,
                        int64_t n, int64_t k, int thread, int threads) {
    const int64_t blocks = k / 32, groups = (n + GEMM_COLUMNS - 1) / GEMM_COLUMNS;
    const int64_t group_bytes = blocks * gemm_block_bytes(fmt);
    int64_t begin, end;
    ns_share(groups, thread, threads, &begin, &end);
    for (int64_t panel = 0; panel < rows; panel += GEMM_PANEL) {
        int64_t panel_end = panel + GEMM_PANEL < rows ? panel + GEMM_PANEL : rows;
        for (int64_t g = begin; g < end; g++) {
            int valid = n - g * GEMM_COLUMNS < GEMM_COLUMNS ? (int)(n - g * GEMM_COLUMNS) : GEMM_COLUMNS;
            for (int64_t r = panel; r < panel_end; r += GEMM_TILE) {
                int tile_rows = panel_end - r < GEMM_TILE ? (int)(panel_end - r) : GEMM_TILE;
                tile(fmt, tile_rows, w + g * group_bytes, xq + r * blocks, blocks, y + r * n + g * GEMM_COLUMNS, n,
                     valid);
            }
        }
    }
}

#ifdef NS_GEMM_AVX2
#define GEMM_BEST_TILE(fmt) ((fmt) == GEMM_Q4_1 ? gemm_tile_avx2_q4_1 : gemm_tile_avx2_q8_0)
#else
#define GEMM_BEST_TILE(fmt) gemm_tile_portable
#endif

typedef struct {
    gemm_tile_fn tile;
    void (*quantize)(const float *x, int64_t k, xblock *out);
    int fmt;
    const float *x;
    const uint8_t *w;
    xblock *xq;
    float *y;
    int64_t rows, n, k;
} GemmJob;

/* The chunk's rows quantized once, split among the threads; one barrier; then the products. */
static void gemm_task(void *context, int thread, int threads) {
    const GemmJob *job = context;
    const int64_t blocks = job->k / 32;
    int64_t begin, end;
    ns_share(job->rows, thread, threads, &begin, &end);
    for (int64_t r = begin; r < end; r++) job->quantize(job->x + r * job->k, job->k, job->xq + r * blocks);
    ns_barrier(threads);
    gemm_groups(job->tile, job->fmt, job->xq, job->w, job->y, job->rows, job->n, job->k, thread, threads);
}

static int gemm_x8(gemm_tile_fn tile, void (*quantize)(const float *, int64_t, xblock *), int fmt, const float *x,
                   const uint8_t *w, float *y, int64_t rows, int64_t n, int64_t k, int num_threads) {
    if (gemm_block_bytes(fmt) == 0 || k % 32 != 0) return -1;
    int64_t groups = (n + GEMM_COLUMNS - 1) / GEMM_COLUMNS;
    if (num_threads > groups) num_threads = (int)groups;
    if (num_threads < 1) num_threads = 1;
    xblock *xq = malloc(sizeof(xblock) * (size_t)(rows * (k / 32)));
    if (xq == NULL) return -2;
    GemmJob job = {tile, quantize, fmt, x, w, xq, y, rows, n, k};
    ns_parallel(num_threads, gemm_task, &job);
    free(xq);
    return 0;
}

/* y [rows, n] = x [rows, k] @ W^T for W [n, k] in matmul_x8.c's layout (fmt 3: Q4_1, 8: Q8_0),
 * with ns_matmul_x8's bits, on the widest path compiled in. Returns 0, -1 for an unknown layout
 * or k not whole blocks, -2 when out of memory. */
NS_EXPORT int ns_gemm_x8(int fmt, const float *x, const uint8_t *w, float *y, int64_t rows, int64_t n, int64_t k,
                         int num_threads) {
    return gemm_x8(GEMM_BEST_TILE(fmt), quantize_row, fmt, x, w, y, rows, n, k, num_threads);
}

/* The scalar reference, for the tests to hold the vector path against (bit for bit). */
NS_EXPORT int ns_gemm_x8_portable(int fmt, const float *x, const uint8_t *w, float *y, int64_t rows, int64_t n,
                                  int64_t k, int num_threads) {
    return gemm_x8(gemm_tile_portable, quantize_row_portable, fmt, x, w, y, rows, n, k, num_threads);
}
