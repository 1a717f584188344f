/* y = x @ W^T with W's blocks repacked at load: eight output columns interleaved per block.
 *
 * The row-major GGUF layout (matmul_quant.c) gives each output column its own stream of
 * blocks, so a one-row product reduces every 32-value block to one number with a horizontal
 * sum and two scalar scale conversions. Here the blocks of 8 consecutive output columns are
 * interleaved, as ggml-cpu's repack does for Q4_0 (its block_q4_0x8), so one block step does
 * the 8 columns at once with every lane busy: the 8 scales convert in one instruction, and each
 * 32-bit lane of a register holds 4 code bytes of one column, so the integer dot products sum
 * into one int32 lane per column without any horizontal step.
 *
 * Layout of a group of 8 columns (nanoserve/native/quant.py's `repack` writes it), block by
 * block along K, each group-block:
 *     Q4_1 (160 bytes = 8 x 20): d[8] f16, m[8] f16, then 4 chunks t of 32 bytes: column c's
 *          code bytes 4t..4t+3 at 32t + 4c. A code byte i holds value i (low nibble) and value
 *          16 + i (high nibble), as in the file.
 *     Q8_0 (272 bytes = 8 x 34): d[8] f16, then 8 chunks t of 32 bytes: column c's codes
 *          4t..4t+3 at 32t + 4c.
 *     Q5_1 (192 bytes = 8 x 24): d[8] f16, m[8] f16, then the fifth bits h[32]: byte 4c + i holds
 *          at bit t the fifth bit of column c's value 4t + i and at bit 4 + t that of value
 *          16 + 4t + i (so chunk t's fifth bits are one shift and one mask of h away), then the
 *          low 4 bits as Q4_1's 4 chunks.
 *     IQ4_NL (144 bytes = 8 x 18): d[8] f16, then Q4_1's 4 chunks of code bytes; a code (0..15)
 *          stands for the value IQ4_GRID[code] (quant_blocks.h: ggml's kvalues_iq4nl, -127..113).
 * The file's bytes, reordered; N is padded to a multiple of 8 with zero columns. Q4_0 is
 * repacked into the Q4_1 layout with m = -8 d (exact in f16), 20 bytes a block instead of 18;
 * Q5_0 into the Q5_1 layout with m = -16 d, 24 bytes instead of 22.
 *
 * Activations: each row quantized once per call to 8-bit blocks (quant_blocks.h).
 *
 * The arithmetic of output (row, column), the same on every path and in every tile:
 *     acc = fma(float(isum_b), d_b * dx_b, acc), off = fma(m_b, sx_b, off) for b in K order,
 *     y = acc + off   (Q8_0 and IQ4_NL: off = 0)
 * where isum_b is the block's exact integer dot product (IQ4_NL: of the grid values). So the AVX2 path equals the
 * portable one bit for bit wherever fmaf is one instruction, and a row's bits never depend
 * on its tile, its neighbours or the thread split (threads split groups of columns).
 * Int16 headroom (Q4_1): a maddubs lane sums 2 products of at most 15 x 127; eight of them
 * (4 chunks, 2 halves) sum to at most 30480 < 32767. Q5_1's codes reach 31, so each half's
 * 4 chunks (31496) widen to int32 before the halves add. Q8_0 and IQ4_NL weights are signed:
 * maddubs takes their magnitude and their sign moves onto x, a lane's pair reaching 2 x 127 x
 * 127 = 32258, so each chunk's pairs widen to int32 before the next chunk adds.
 *
 * Blocking and threads: column_groups.h's driver, in tiles of up to ROW_TILE rows.
 */
#include "gemm/column_groups.h"
#include "runtime/isa.h"
#include "nanoserve.h"
#include "quant/quant_blocks.h"
#include "stages/stages.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define NS_X8_AVX2 1
#endif

enum { X8_Q4_1 = 3, X8_Q5_1 = 7, X8_Q8_0 = 8, X8_IQ4_NL = 20 }; /* the GGML type numbers of the layouts' formats */
enum { COLUMNS = NS_GROUP_COLUMNS, ROW_TILE = 8 };

static int group_block_bytes(int fmt) {
    return fmt == X8_Q4_1 ? 160 : fmt == X8_Q5_1 ? 192 : fmt == X8_Q8_0 ? 272 : fmt == X8_IQ4_NL ? 144 : 0;
}

/* Q5_1's code of value 4t + i (`high`: value 16 + 4t + i) of column c in a group-block, 0..31. */
static inline int q5_code(const uint8_t *block, int c, int t, int i, int high) {
    const int code = block[64 + 32 * t + 4 * c + i], fifth = block[32 + 4 * c + i] >> (t + 4 * high);
    return (high ? code >> 4 : code & 0x0F) | (fifth & 1) << 4;
}

/* ---- portable ---------------------------------------------------------------------------- */

/* One group of 8 columns against one activation row: out[c] for c < valid. */
static void dot_group_portable(const int fmt, const uint8_t *group, const xblock *x, int64_t blocks,
                               float *out, int valid) {
    const int bytes = group_block_bytes(fmt);
    float acc[COLUMNS] = {0}, off[COLUMNS] = {0};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + b * bytes;
        const int8_t *xq = x[b].qs;
        for (int c = 0; c < COLUMNS; c++) {
            int isum = 0;
            if (fmt == X8_Q4_1) {
                for (int t = 0; t < 4; t++)
                    for (int i = 0; i < 4; i++) {
                        int code = block[32 + 32 * t + 4 * c + i];
                        isum += (code & 0x0F) * xq[4 * t + i] + (code >> 4) * xq[16 + 4 * t + i];
                    }
                off[c] = fmaf(f16_to_f32(block + 16 + 2 * c), x[b].s, off[c]);
            } else if (fmt == X8_Q5_1) {
                for (int t = 0; t < 4; t++)
                    for (int i = 0; i < 4; i++)
                        isum += q5_code(block, c, t, i, 0) * xq[4 * t + i] + q5_code(block, c, t, i, 1) * xq[16 + 4 * t + i];
                off[c] = fmaf(f16_to_f32(block + 16 + 2 * c), x[b].s, off[c]);
            } else if (fmt == X8_IQ4_NL) {
                for (int t = 0; t < 4; t++)
                    for (int i = 0; i < 4; i++) {
                        int code = block[16 + 32 * t + 4 * c + i];
                        isum += IQ4_GRID[code & 0x0F] * xq[4 * t + i] + IQ4_GRID[code >> 4] * xq[16 + 4 * t + i];
                    }
            } else {
                for (int t = 0; t < 8; t++)
                    for (int i = 0; i < 4; i++) isum += (int8_t)block[16 + 32 * t + 4 * c + i] * xq[4 * t + i];
            }
            acc[c] = fmaf((float)isum, f16_to_f32(block + 2 * c) * x[b].d, acc[c]);
        }
    }
    for (int c = 0; c < valid; c++) out[c] = acc[c] + off[c];
}

/* A tile of `rows` activation rows (`blocks` blocks apart) against one group. */
static void dot_tile_portable(int fmt, int rows, const uint8_t *group, const xblock *x, int64_t blocks, float *y,
                              int64_t n, int valid) {
    for (int r = 0; r < rows; r++) dot_group_portable(fmt, group, x + r * blocks, blocks, y + r * n, valid);
}

/* ---- AVX2 -------------------------------------------------------------------------------- */

#ifdef NS_X8_AVX2
/* How far ahead of the block it multiplies a tile asks for its weights. A thread's groups lie
 * end to end, so this runs along its one stream of the matrix; the hardware prefetcher alone
 * restarts at every matrix (a decode step's thread share of one is 80-400 KB) and fell behind
 * on a contended memory bus (results/x8_prefetch_ab.csv). Prefetch never faults, so asking
 * past a matrix's end is harmless; the bits do not change. */
#define PREFETCH_BYTES 4096

static inline __m256i broadcast4(const int8_t *p) { /* 4 code bytes into every 32-bit lane */
    int32_t word;
    memcpy(&word, p, 4);
    return _mm256_set1_epi32(word);
}

static inline void store_columns(float *y, __m256 v, int valid) {
    if (valid == COLUMNS) {
        _mm256_storeu_ps(y, v);
        return;
    }
    float lanes[COLUMNS];
    _mm256_storeu_ps(lanes, v);
    memcpy(y, lanes, (size_t)valid * sizeof(float));
}

/* The tile kernel, inlined into one function per (format, tile height) so both are constants.
 * A row's instructions are the same whatever the tile height; the tile only shares the
 * group-block's loads and nibble unpacking among its rows. */
static inline __attribute__((always_inline)) void dot_tile_avx2(const int fmt, const int rows,
                                                                const uint8_t *group, const xblock *x,
                                                                int64_t blocks, float *y, int64_t n, int valid) {
    const int bytes = group_block_bytes(fmt);
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_TILE], off[ROW_TILE];
    for (int r = 0; r < rows; r++) acc[r] = off[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + b * bytes;
        for (int line = 0; line < bytes; line += 64)
            _mm_prefetch((const char *)block + PREFETCH_BYTES + line, _MM_HINT_T0);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
        if (fmt == X8_Q4_1) {
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16)));
            __m256i lo[4], hi[4];
            for (int t = 0; t < 4; t++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(block + 32 + 32 * t));
                lo[t] = _mm256_and_si256(w, low4);
                hi[t] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
            }
            for (int r = 0; r < rows; r++) {
                const xblock *xb = x + r * blocks + b;
                __m256i sums = _mm256_setzero_si256();
                for (int t = 0; t < 4; t++) {
                    sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(lo[t], broadcast4(xb->qs + 4 * t)));
                    sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(hi[t], broadcast4(xb->qs + 16 + 4 * t)));
                }
                __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, ones));
                acc[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(d, _mm256_set1_ps(xb->d)), acc[r]);
                off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xb->s), off[r]);
            }
        } else if (fmt == X8_Q5_1) {
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16)));
            const __m256i fifth = _mm256_loadu_si256((const __m256i *)(block + 32)), bit4 = _mm256_set1_epi8(0x10);
            __m256i lo[4], hi[4];
            for (int t = 0; t < 4; t++) {
                /* 16-bit shifts: the mask keeps bit 4 of each byte, which no bit of the other byte reaches */
                __m256i w = _mm256_loadu_si256((const __m256i *)(block + 64 + 32 * t));
                lo[t] = _mm256_or_si256(_mm256_and_si256(w, low4), _mm256_and_si256(_mm256_slli_epi16(fifth, 4 - t), bit4));
                hi[t] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), low4),
                                        _mm256_and_si256(_mm256_srli_epi16(fifth, t), bit4));
            }
            for (int r = 0; r < rows; r++) {
                const xblock *xb = x + r * blocks + b;
                __m256i low_sums = _mm256_setzero_si256(), high_sums = _mm256_setzero_si256();
                for (int t = 0; t < 4; t++) {
                    low_sums = _mm256_add_epi16(low_sums, _mm256_maddubs_epi16(lo[t], broadcast4(xb->qs + 4 * t)));
                    high_sums = _mm256_add_epi16(high_sums, _mm256_maddubs_epi16(hi[t], broadcast4(xb->qs + 16 + 4 * t)));
                }
                __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(low_sums, ones), _mm256_madd_epi16(high_sums, ones));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(xb->d)), acc[r]);
                off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xb->s), off[r]);
            }
        } else if (fmt == X8_IQ4_NL) {
            /* As Q8_0's chunks below, each byte of codes giving two: its low nibbles meet x's
             * values 4t.., its high nibbles x's values 16 + 4t.. Unrolled whole, the loop had
             * all 8 looked-up chunks and their magnitudes computed first and spilled; two
             * chunks at a time keep a 4-row tile in registers. */
            __m256i sums[ROW_TILE];
            for (int r = 0; r < rows; r++) sums[r] = _mm256_setzero_si256();
            #pragma GCC unroll 2
            for (int t = 0; t < 4; t++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(block + 16 + 32 * t));
                for (int half = 0; half < 2; half++) {
                    const __m256i q = iq4_grid_values(_mm256_and_si256(half ? _mm256_srli_epi16(w, 4) : w, low4));
                    const __m256i magnitude = _mm256_sign_epi8(q, q);
                    for (int r = 0; r < rows; r++) {
                        const int8_t *xq = x[r * blocks + b].qs + 16 * half + 4 * t;
                        __m256i products = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(broadcast4(xq), q));
                        sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(products, ones));
                    }
                }
            }
            for (int r = 0; r < rows; r++) {
                const xblock *xb = x + r * blocks + b;
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, _mm256_set1_ps(xb->d)), acc[r]);
            }
        } else {
            /* Chunk by chunk, each chunk's weights loaded once for all the tile's rows (their
             * magnitudes too): at 4 rows the rows' sums and accumulators and one chunk fit the
             * 16 ymm registers. The integer sums do not depend on the order. */
            __m256i sums[ROW_TILE];
            for (int r = 0; r < rows; r++) sums[r] = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                /* maddubs multiplies unsigned by signed bytes: the weight's sign moves onto x */
                const __m256i w = _mm256_loadu_si256((const __m256i *)(block + 16 + 32 * t));
                const __m256i magnitude = _mm256_sign_epi8(w, w);
                for (int r = 0; r < rows; r++) {
                    const int8_t *xq = x[r * blocks + b].qs;
                    __m256i products = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(broadcast4(xq + 4 * t), w));
                    sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(products, ones));
                }
            }
            for (int r = 0; r < rows; r++) {
                const xblock *xb = x + r * blocks + b;
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, _mm256_set1_ps(xb->d)), acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) store_columns(y + r * n, _mm256_add_ps(acc[r], off[r]), valid);
}

/* One function per (format, tile height up to ROW_TILE), both constants. */
#define TILE_CASE(FMT, ROWS)                                                               \
    if (rows == ROWS) {                                                                    \
        dot_tile_avx2(FMT, ROWS, group, x, blocks, y, n, valid);                           \
        return;                                                                            \
    }
#define DEFINE_TILE_AVX2(NAME, FMT)                                                                      \
    static void NAME(int fmt, int rows, const uint8_t *group, const xblock *x, int64_t blocks, float *y, \
                     int64_t n, int valid) {                                                             \
        (void)fmt;                                                                                       \
        TILE_CASE(FMT, 8)                                                                                \
        TILE_CASE(FMT, 7)                                                                                \
        TILE_CASE(FMT, 6)                                                                                \
        TILE_CASE(FMT, 5)                                                                                \
        TILE_CASE(FMT, 4)                                                                                \
        TILE_CASE(FMT, 3)                                                                                \
        TILE_CASE(FMT, 2)                                                                                \
        for (int r = 0; r < rows; r++)                                                                   \
            dot_tile_avx2(FMT, 1, group, x + r * blocks, blocks, y + r * n, n, valid);                   \
    }
DEFINE_TILE_AVX2(dot_tile_avx2_q4_1, X8_Q4_1)
DEFINE_TILE_AVX2(dot_tile_avx2_q5_1, X8_Q5_1)
DEFINE_TILE_AVX2(dot_tile_avx2_q8_0, X8_Q8_0)
DEFINE_TILE_AVX2(dot_tile_avx2_iq4_nl, X8_IQ4_NL)
#endif

/* ---- the entry points -------------------------------------------------------------------- */

#ifdef NS_X8_AVX2
#define BEST_TILE(fmt)                                                                                     \
    ((fmt) == X8_Q4_1 ? dot_tile_avx2_q4_1 : (fmt) == X8_Q5_1 ? dot_tile_avx2_q5_1                        \
     : (fmt) == X8_IQ4_NL ? dot_tile_avx2_iq4_nl : dot_tile_avx2_q8_0)
#else
#define BEST_TILE(fmt) dot_tile_portable
#endif

void ns_stage_quantize_rows(const float *x, int64_t k, xblock *xq, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) quantize_row(x + r * k, k, xq + r * (k / 32));
}

/* The driver's description of this layout with `tile`, for a K of k values, with ISA `isa`'s
 * wide tile where it has one (isa.h). */
static ns_group_layout x8_layout(ns_group_tile tile, int fmt, int64_t k, int isa) {
    return ns_group_layout_on((ns_group_layout){tile, fmt, ROW_TILE, k / 32 * group_block_bytes(fmt)}, isa);
}

void ns_stage_x8_strided(int fmt, const xblock *xq, const uint8_t *w, float *y, int64_t y_stride, int64_t rows,
                         int64_t n, int64_t k, int thread, int threads) {
    const ns_group_layout layout = x8_layout(BEST_TILE(fmt), fmt, k, ns_isa_best());
    ns_column_groups(&layout, xq, w, y, y_stride, rows, n, k, thread, threads);
}

/* The group tile of ISA `isa` below its wide tiles: AVX2's where it is compiled in, else portable. */
static ns_group_tile x8_group_tile(int isa, int fmt) {
    return isa == NS_ISA_PORTABLE ? dot_tile_portable : BEST_TILE(fmt);
}

/* y [rows, n] = x [rows, k] @ W^T for W [n, k] repacked (fmt 3: the Q4_1 layout, 7: Q5_1, 8: Q8_0,
 * 20: IQ4_NL) on ISA `isa` (isa.h; the portable one quantizes x in plain C too). Returns 0, -1
 * for an unknown layout, k not whole blocks or an ISA that does not run here, -2 when out of
 * memory. */
NS_EXPORT int ns_matmul_x8_isa(int isa, int fmt, const float *x, const uint8_t *w, float *y, int64_t rows, int64_t n,
                               int64_t k, int num_threads) {
    if (group_block_bytes(fmt) == 0 || k % 32 != 0 || !ns_isa_runs(isa)) return -1;
    const ns_group_layout layout = x8_layout(x8_group_tile(isa, fmt), fmt, k, isa);
    return ns_matmul_column_groups(&layout, isa == NS_ISA_PORTABLE ? quantize_row_portable : quantize_row, x, w, y,
                                   rows, n, k, num_threads);
}

/* ns_matmul_x8_isa on the widest ISA that runs here. */
NS_EXPORT int ns_matmul_x8(int fmt, const float *x, const uint8_t *w, float *y, int64_t rows, int64_t n,
                           int64_t k, int num_threads) {
    return ns_matmul_x8_isa(ns_isa_best(), fmt, x, w, y, rows, n, k, num_threads);
}

/* The same through plain C, for the tests to hold the vector paths against (bit for bit). */
NS_EXPORT int ns_matmul_x8_portable(int fmt, const float *x, const uint8_t *w, float *y, int64_t rows,
                                    int64_t n, int64_t k, int num_threads) {
    return ns_matmul_x8_isa(NS_ISA_PORTABLE, fmt, x, w, y, rows, n, k, num_threads);
}

/* Row `id` of the repacked W, dequantized into row [k]. */
static void lookup_row(int fmt, const uint8_t *w, int64_t id, int64_t k, float *row) {
    const int bytes = group_block_bytes(fmt);
    const int64_t blocks = k / 32, g = id / COLUMNS;
    const int c = (int)(id % COLUMNS);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = w + (g * blocks + b) * bytes;
        const float d = f16_to_f32(block + 2 * c);
        if (fmt == X8_Q4_1) {
            const float m = f16_to_f32(block + 16 + 2 * c);
            for (int t = 0; t < 4; t++)
                for (int j = 0; j < 4; j++) {
                    int code = block[32 + 32 * t + 4 * c + j];
                    row[32 * b + 4 * t + j] = d * (float)(code & 0x0F) + m;
                    row[32 * b + 16 + 4 * t + j] = d * (float)(code >> 4) + m;
                }
        } else if (fmt == X8_Q5_1) {
            const float m = f16_to_f32(block + 16 + 2 * c);
            for (int t = 0; t < 4; t++)
                for (int j = 0; j < 4; j++) {
                    row[32 * b + 4 * t + j] = d * (float)q5_code(block, c, t, j, 0) + m;
                    row[32 * b + 16 + 4 * t + j] = d * (float)q5_code(block, c, t, j, 1) + m;
                }
        } else if (fmt == X8_IQ4_NL) {
            for (int t = 0; t < 4; t++)
                for (int j = 0; j < 4; j++) {
                    int code = block[16 + 32 * t + 4 * c + j];
                    row[32 * b + 4 * t + j] = d * (float)IQ4_GRID[code & 0x0F];
                    row[32 * b + 16 + 4 * t + j] = d * (float)IQ4_GRID[code >> 4];
                }
        } else {
            for (int t = 0; t < 8; t++)
                for (int j = 0; j < 4; j++) row[32 * b + 4 * t + j] = d * (float)(int8_t)block[16 + 32 * t + 4 * c + j];
        }
    }
}

/* out [count, k] = rows ids[i] of the repacked W [n, k], dequantized (a tied head's table
 * serving the embedding lookups). Returns 0, -1 as ns_matmul_x8, or -3 for an id outside [0, n). */
NS_EXPORT int ns_dequantize_rows_x8(int fmt, const uint8_t *w, const int64_t *ids, int64_t count, int64_t n,
                                    int64_t k, float *out, int num_threads) {
    if (group_block_bytes(fmt) == 0 || k % 32 != 0) return -1;
    return ns_lookup_rows(lookup_row, fmt, w, ids, count, n, k, out, num_threads);
}
