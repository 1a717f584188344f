/* y = x @ W^T with W in a GGUF block format (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), x float32.
 *
 * As llama.cpp does on CPUs: each activation row is quantized once per call to 8-bit blocks of
 * 32 (scale d, and s = d * sum of the 32 codes), and every weight sub-block of 32 values meets
 * it in an integer dot product. Each weight sub-block j contributes
 *     A_j * d_x * sum(qw * qx)  +  B_j * s_x
 * where qw is the sub-block's integer codes and A_j, B_j its float scale and offset:
 *     Q8_0: qw = qs (signed),           A = d,          B = 0
 *     Q4_0: qw = nibble (0..15),        A = d,          B = -8 d
 *     Q4_1: qw = nibble,                A = d,          B = m
 *     Q4_K: qw = nibble,                A = d sc_j,     B = -dmin mn_j
 *     Q5_K: qw = nibble | bit << 4,     A = d sc_j,     B = -dmin mn_j
 *     Q6_K: qw = q6 - 32 (signed), two int8 scales per 32 folded into the integer sum, A = d.
 * Block layouts: nanoserve/quant.py's docstring (as ggml-common.h defines them).
 *
 * Batch invariance (nanoserve.h): a row's output is a sum over its sub-blocks in K order, by
 * the same instructions whatever tile of rows it is computed in; threads split output columns.
 * Row blocking: a thread takes one weight row (an output column) at a time and runs it against
 * up to ROW_TILE activation rows per pass, so the weight row is read from memory once per call
 * and stays in L1 for the other passes; each weight sub-block is unpacked once per pass.
 * On AVX2, Q4_0 and Q4_1 (the default model's format) take two blocks per step (see "two
 * sub-blocks at a time" below): about half the instructions per block of the per-block
 * kernel; on a Zen 3, one forward's linears of the default model took 0.70x the per-block
 * kernel's time at 16 rows and 0.86x at 1 row (both builds called in turns in one process).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nanoserve.h"
#include "quant/quant_blocks.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define NS_QUANT_AVX2 1
#endif

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };

#define ROW_TILE 4
#define COLUMN_CHUNK 16 /* threads split the output columns in chunks of this many */

/* ---- per-format facts -------------------------------------------------------------------- */

static inline int block_values(int fmt) { return fmt >= GGML_Q4_K ? 256 : 32; }

static inline int block_bytes(int fmt) {
    switch (fmt) {
    case GGML_Q8_0: return 34;
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    default: return 0;
    }
}

/* The 6-bit scale and min of Q4_K/Q5_K sub-block j (quant.py's docstring). */
static inline void k_scale_min(const uint8_t *scales, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = scales[j] & 63;
        *mn = scales[j + 4] & 63;
    } else {
        *sc = (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4);
        *mn = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
    }
}

/* Sub-block j (of 32 values) of the block at `b`: its integer codes q[32], the int scale of
 * each half (1 except Q6_K), and A, B as in the header comment. The portable form. */
static void unpack_sub_block(int fmt, const uint8_t *b, int j, int8_t q[32], int half_scale[2],
                             float *A, float *B) {
    half_scale[0] = half_scale[1] = 1;
    *B = 0.0f;
    switch (fmt) {
    case GGML_Q8_0:
        memcpy(q, b + 2, 32);
        *A = f16_to_f32(b);
        return;
    case GGML_Q4_0:
    case GGML_Q4_1: {
        const uint8_t *qs = b + (fmt == GGML_Q4_0 ? 2 : 4);
        for (int l = 0; l < 16; l++) {
            q[l] = (int8_t)(qs[l] & 0x0F);
            q[l + 16] = (int8_t)(qs[l] >> 4);
        }
        *A = f16_to_f32(b);
        *B = fmt == GGML_Q4_0 ? -8.0f * *A : f16_to_f32(b + 2);
        return;
    }
    case GGML_Q4_K:
    case GGML_Q5_K: {
        int sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        const uint8_t *qs = b + (fmt == GGML_Q4_K ? 16 : 48) + 32 * (j / 2);
        for (int l = 0; l < 32; l++) {
            int v = (j & 1) ? qs[l] >> 4 : qs[l] & 0x0F;
            if (fmt == GGML_Q5_K) v |= ((b[16 + l] >> j) & 1) << 4;
            q[l] = (int8_t)v;
        }
        *A = f16_to_f32(b) * (float)sc;
        *B = -f16_to_f32(b + 2) * (float)mn;
        return;
    }
    case GGML_Q6_K: {
        int h = j / 4, t = j % 4;
        const uint8_t *ql = b + 64 * h + 32 * (t & 1), *qh = b + 128 + 32 * h;
        const int8_t *scales = (const int8_t *)(b + 192) + 8 * h + 2 * t;
        for (int l = 0; l < 32; l++) {
            int low = t < 2 ? ql[l] & 0x0F : ql[l] >> 4;
            q[l] = (int8_t)((low | (((qh[l] >> (2 * t)) & 3) << 4)) - 32);
        }
        half_scale[0] = scales[0];
        half_scale[1] = scales[1];
        *A = f16_to_f32(b + 208);
        return;
    }
    }
}

/* ---- portable dot products --------------------------------------------------------------- */

/* out[r * n] = dot(weight row w, activation row r) for r < rows (a tile of at most ROW_TILE). */
static void dot_rows_portable(int fmt, const uint8_t *w, const xblock *x, int64_t xblocks, int rows,
                              float *out, int64_t n) {
    float acc[ROW_TILE] = {0}, offsets[ROW_TILE] = {0};
    int per_block = block_values(fmt) / 32, bytes = block_bytes(fmt);
    for (int64_t sub = 0; sub < xblocks; sub++) {
        int8_t q[32];
        int half_scale[2];
        float A, B;
        unpack_sub_block(fmt, w + (sub / per_block) * bytes, (int)(sub % per_block), q, half_scale, &A, &B);
        for (int r = 0; r < rows; r++) {
            const xblock *xb = x + r * xblocks + sub;
            int low = 0, high = 0;
            for (int l = 0; l < 16; l++) low += q[l] * xb->qs[l];
            for (int l = 16; l < 32; l++) high += q[l] * xb->qs[l];
            acc[r] += (float)(low * half_scale[0] + high * half_scale[1]) * (A * xb->d);
            offsets[r] += B * xb->s;
        }
    }
    for (int r = 0; r < rows; r++) out[r * n] = acc[r] + offsets[r];
}

/* ---- AVX2 dot products ------------------------------------------------------------------- */

#ifdef NS_QUANT_AVX2
static inline __m256i nibbles16(const uint8_t *qs) { /* 16 bytes -> 32 codes, low nibbles first */
    __m128i packed = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), _mm_and_si128(packed, mask));
}

/* Sub-block j's codes as 32 bytes, whether they are signed, the int16 scale of each half
 * (lanes 0-7: values 0-15; lanes 8-15: values 16-31), A and B. */
static inline __m256i unpack_avx2(int fmt, const uint8_t *b, int j, int *is_signed, __m256i *scale16,
                                  float *A, float *B) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    *scale16 = _mm256_set1_epi16(1);
    *is_signed = 0;
    *B = 0.0f;
    switch (fmt) {
    case GGML_Q8_0:
        *is_signed = 1;
        *A = f16_to_f32(b);
        return _mm256_loadu_si256((const __m256i *)(b + 2));
    case GGML_Q4_0:
        *A = f16_to_f32(b);
        *B = -8.0f * *A;
        return nibbles16(b + 2);
    case GGML_Q4_1:
        *A = f16_to_f32(b);
        *B = f16_to_f32(b + 2);
        return nibbles16(b + 4);
    case GGML_Q4_K:
    case GGML_Q5_K: {
        int sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        *A = f16_to_f32(b) * (float)sc;
        *B = -f16_to_f32(b + 2) * (float)mn;
        __m256i qs = _mm256_loadu_si256((const __m256i *)(b + (fmt == GGML_Q4_K ? 16 : 48) + 32 * (j / 2)));
        __m256i q = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(qs, 4) : qs, low4);
        if (fmt == GGML_Q5_K) {
            __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
            __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
            q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
        }
        return q;
    }
    case GGML_Q6_K: {
        int h = j / 4, t = j % 4;
        const int8_t *scales = (const int8_t *)(b + 192) + 8 * h + 2 * t;
        *is_signed = 1;
        *A = f16_to_f32(b + 208);
        *scale16 = _mm256_set_m128i(_mm_set1_epi16(scales[1]), _mm_set1_epi16(scales[0]));
        __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (t & 1)));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        __m256i low = _mm256_and_si256(t < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
        __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), _mm256_set1_epi8(3));
        return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(top, 4)), _mm256_set1_epi8(32));
    }
    }
    return _mm256_setzero_si256();
}

/* Sub-block `sub` against each row of the tile, into that row's accumulators of parity `lane`. */
static inline __attribute__((always_inline)) void sub_block_step_avx2(const int fmt, const int rows, const uint8_t *w,
                                                                      const xblock *x, int64_t xblocks, int64_t sub,
                                                                      __m256 acc[][2], __m128 offsets[][2],
                                                                      const int lane) {
    const int per_block = block_values(fmt) / 32, bytes = block_bytes(fmt);
    int is_signed;
    __m256i scale16;
    float A, B;
    __m256i q = unpack_avx2(fmt, w + (sub / per_block) * bytes, (int)(sub % per_block), &is_signed, &scale16, &A, &B);
    /* maddubs multiplies unsigned by signed bytes: a signed q moves its sign onto x. */
    __m256i q_unsigned = is_signed ? _mm256_sign_epi8(q, q) : q;
    for (int r = 0; r < rows; r++) {
        const xblock *xb = x + r * xblocks + sub;
        __m256i xv = _mm256_loadu_si256((const __m256i *)xb->qs);
        if (is_signed) xv = _mm256_sign_epi8(xv, q);
        __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(q_unsigned, xv), scale16);
        acc[r][lane] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(A * xb->d), acc[r][lane]);
        if (fmt != GGML_Q8_0 && fmt != GGML_Q6_K) /* the formats with an offset B */
            offsets[r][lane] = _mm_fmadd_ss(_mm_set_ss(B), _mm_set_ss(xb->s), offsets[r][lane]);
    }
}

/* The tile kernel, inlined into one function per (format, tile height) so both are constants.
 * Each row keeps two accumulator pairs, for even and odd sub-blocks, so a lone row has
 * independent FMA chains; the loop is unrolled by two so the pair index is a constant and the
 * accumulators stay in registers (indexed by `sub & 1` they lived in memory, and every FMA
 * waited on a store). A row's sums are the same instructions whatever the tile height. */
static inline __attribute__((always_inline)) void dot_tile_avx2(const int fmt, const int rows, const uint8_t *w,
                                                                const xblock *x, int64_t xblocks, float *out,
                                                                int64_t n) {
    __m256 acc[ROW_TILE][2];
    __m128 offsets[ROW_TILE][2];
    for (int r = 0; r < rows; r++) {
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        offsets[r][0] = offsets[r][1] = _mm_setzero_ps();
    }
    int64_t sub = 0;
    for (; sub + 1 < xblocks; sub += 2) {
        sub_block_step_avx2(fmt, rows, w, x, xblocks, sub, acc, offsets, 0);
        sub_block_step_avx2(fmt, rows, w, x, xblocks, sub + 1, acc, offsets, 1);
    }
    if (sub < xblocks) sub_block_step_avx2(fmt, rows, w, x, xblocks, sub, acc, offsets, 0);
    for (int r = 0; r < rows; r++)
        out[r * n] = ns_hsum256(_mm256_add_ps(acc[r][0], acc[r][1])) +
                     _mm_cvtss_f32(_mm_add_ss(offsets[r][0], offsets[r][1]));
}

#define DEFINE_DOT_AVX2(FMT)                                                                              \
    static void dot_rows_avx2_##FMT(int fmt, const uint8_t *w, const xblock *x, int64_t xblocks, int rows, \
                                    float *out, int64_t n) {                                            \
        (void)fmt;                                                                                      \
        if (rows == ROW_TILE) {                                                                         \
            dot_tile_avx2(FMT, ROW_TILE, w, x, xblocks, out, n);                                        \
            return;                                                                                     \
        }                                                                                               \
        for (int r = 0; r < rows; r++) dot_tile_avx2(FMT, 1, w, x + r * xblocks, xblocks, out + r * n, n); \
    }
DEFINE_DOT_AVX2(GGML_Q8_0)
DEFINE_DOT_AVX2(GGML_Q4_0)
DEFINE_DOT_AVX2(GGML_Q4_1)
DEFINE_DOT_AVX2(GGML_Q4_K)
DEFINE_DOT_AVX2(GGML_Q5_K)
DEFINE_DOT_AVX2(GGML_Q6_K)

static void dot_rows_avx2(int fmt, const uint8_t *w, const xblock *x, int64_t xblocks, int rows, float *out,
                          int64_t n) {
    switch (fmt) {
    case GGML_Q8_0: dot_rows_avx2_GGML_Q8_0(fmt, w, x, xblocks, rows, out, n); return;
    case GGML_Q4_0: dot_rows_avx2_GGML_Q4_0(fmt, w, x, xblocks, rows, out, n); return;
    case GGML_Q4_1: dot_rows_avx2_GGML_Q4_1(fmt, w, x, xblocks, rows, out, n); return;
    case GGML_Q4_K: dot_rows_avx2_GGML_Q4_K(fmt, w, x, xblocks, rows, out, n); return;
    case GGML_Q5_K: dot_rows_avx2_GGML_Q5_K(fmt, w, x, xblocks, rows, out, n); return;
    case GGML_Q6_K: dot_rows_avx2_GGML_Q6_K(fmt, w, x, xblocks, rows, out, n); return;
    }
}

/* ---- Q4_0 / Q4_1 two sub-blocks at a time ------------------------------------------------- */

/* The 4-bit formats spend most of the per-block kernel above on scalar work (two f16
 * conversions, a broadcast, a scalar offset FMA per block and row). Here two consecutive
 * blocks go together: their 32 code bytes fill one register (low nibbles: values 0-15 of
 * each block, high nibbles: values 16-31), their four f16 scale/offset halves convert in one
 * instruction, and one FMA per row takes both blocks. The activation row is laid out to match
 * (xpair), so a row's work per pair is two maddubs, one add, one madd, one convert and one
 * FMA, plus the scales. A K with an odd number of blocks ends with a half pair whose second
 * block is all zeros. */
typedef struct {
    int8_t lo[32]; /* values 0-15 of block 2p, then of block 2p+1 */
    int8_t hi[32]; /* values 16-31 of each */
    float ds[4];   /* d and s of block 2p, then of 2p+1 (0 for a missing last block) */
} xpair;

static void quantize_row_pairs(const float *x, int64_t k, xpair *out) {
    int64_t blocks = k / 32;
    for (int64_t p = 0; p < (blocks + 1) / 2; p++) {
        xblock b[2];
        memset(b, 0, sizeof b);
        quantize_row(x + 64 * p, 32 * (2 * p + 1 < blocks ? 2 : 1), b);
        for (int h = 0; h < 2; h++) {
            memcpy(out[p].lo + 16 * h, b[h].qs, 16);
            memcpy(out[p].hi + 16 * h, b[h].qs + 16, 16);
            out[p].ds[2 * h] = b[h].d;
            out[p].ds[2 * h + 1] = b[h].s;
        }
    }
}

/* Block pair p of a Q4_0/Q4_1 weight row: the 32 code bytes (block 2p in the low lane) and
 * [A, B, A', B'] (the header's A and B of each block; zeros for a missing second block). */
static inline __attribute__((always_inline)) __m256i pair_codes_avx2(const int fmt, const uint8_t *row, int64_t p,
                                                                     int second, __m128 *scales) {
    const int bytes = block_bytes(fmt), code_offset = fmt == GGML_Q4_0 ? 2 : 4;
    const uint8_t *b0 = row + 2 * p * bytes, *b1 = b0 + bytes;
    __m128i first = _mm_loadu_si128((const __m128i *)(b0 + code_offset));
    __m128i next = second ? _mm_loadu_si128((const __m128i *)(b1 + code_offset)) : _mm_setzero_si128();
    if (fmt == GGML_Q4_1) { /* d, m of each block: four halves in one conversion */
        int32_t h0, h1 = 0;
        memcpy(&h0, b0, 4);
        if (second) memcpy(&h1, b1, 4);
        *scales = _mm_cvtph_ps(_mm_set_epi32(0, 0, h1, h0));
    } else { /* Q4_0: d of each block, and B = -8 d */
        uint16_t d0, d1 = 0;
        memcpy(&d0, b0, 2);
        if (second) memcpy(&d1, b1, 2);
        __m128 d = _mm_cvtph_ps(_mm_set_epi16(0, 0, 0, 0, (short)d1, (short)d1, (short)d0, (short)d0));
        *scales = _mm_mul_ps(d, _mm_set_ps(-8.0f, 1.0f, -8.0f, 1.0f));
    }
    return _mm256_set_m128i(next, first);
}

/* Pair p of one weight row against each row of the tile. `second`: whether block 2p+1 exists
 * (a constant at each call, so the full pairs' loop has no branch). */
static inline __attribute__((always_inline)) void pair_step_avx2(const int fmt, const int rows, const uint8_t *w,
                                                                 const xpair *x, int64_t pairs, int64_t p,
                                                                 const int second, __m256 *acc, __m128 *offsets) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i spread = _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0); /* lanes 0-3: block 2p, 4-7: 2p+1 */
    __m128 scales;
    __m256i q = pair_codes_avx2(fmt, w, p, second, &scales);
    __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
    for (int r = 0; r < rows; r++) {
        const xpair *xp = x + r * pairs + p;
        /* [A d, B s, A' d', B' s']: lanes 0 and 2 scale the integer sums, 1 and 3 are the offsets */
        __m128 t = _mm_mul_ps(scales, _mm_loadu_ps(xp->ds));
        offsets[r] = _mm_add_ps(offsets[r], t);
        /* each int16 lane sums four code products (at most 4 * 15 * 127): no saturation */
        __m256i sums = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xp->lo)),
                                        _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)xp->hi)));
        __m256 scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(t), spread);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sums, ones)), scale, acc[r]);
    }
}

/* A tile of `rows` activation rows against one weight row; a row's sums are the same
 * instructions whatever the tile height (one vector accumulator and one offset accumulator). */
static inline __attribute__((always_inline)) void dot_pair_tile_avx2(const int fmt, const int rows, const uint8_t *w,
                                                                     const xpair *x, int64_t blocks, float *out,
                                                                     int64_t n) {
    const int64_t pairs = (blocks + 1) / 2;
    __m256 acc[ROW_TILE];
    __m128 offsets[ROW_TILE];
    for (int r = 0; r < rows; r++) {
        acc[r] = _mm256_setzero_ps();
        offsets[r] = _mm_setzero_ps();
    }
    for (int64_t p = 0; p < blocks / 2; p++) pair_step_avx2(fmt, rows, w, x, pairs, p, 1, acc, offsets);
    if (blocks & 1) pair_step_avx2(fmt, rows, w, x, pairs, blocks / 2, 0, acc, offsets);
    for (int r = 0; r < rows; r++) {
        __m128 o = offsets[r];
        out[r * n] = ns_hsum256(acc[r]) + (_mm_cvtss_f32(_mm_shuffle_ps(o, o, 1)) + _mm_cvtss_f32(_mm_shuffle_ps(o, o, 3)));
    }
}

#define DEFINE_DOT_PAIRS_AVX2(FMT)                                                                           \
    static void dot_pairs_avx2_##FMT(const uint8_t *w, const void *xq, int64_t blocks, int rows, float *out, \
                                     int64_t n) {                                                          \
        const xpair *x = xq;                                                                               \
        if (rows == ROW_TILE) {                                                                            \
            dot_pair_tile_avx2(FMT, ROW_TILE, w, x, blocks, out, n);                                       \
            return;                                                                                        \
        }                                                                                                  \
        for (int r = 0; r < rows; r++)                                                                     \
            dot_pair_tile_avx2(FMT, 1, w, x + r * ((blocks + 1) / 2), blocks, out + r * n, n);             \
    }
DEFINE_DOT_PAIRS_AVX2(GGML_Q4_0)
DEFINE_DOT_PAIRS_AVX2(GGML_Q4_1)
#endif

/* ---- the entry points -------------------------------------------------------------------- */

/* How a kernel wants its activation rows: a quantizer, the bytes one row takes, and the tile
 * function over them (fmt-generic ones receive the format through `fmt`). */
typedef struct {
    void (*quantize)(const float *x, int64_t k, void *out);
    size_t (*row_bytes)(int64_t k);
    void (*dot)(int fmt, const uint8_t *w, const void *xq, int64_t xblocks, int rows, float *out, int64_t n);
} kernel;

static void quantize_blocks_portable(const float *x, int64_t k, void *out) { quantize_row_portable(x, k, out); }
static size_t block_row_bytes(int64_t k) { return sizeof(xblock) * (size_t)(k / 32); }

static void dot_portable(int fmt, const uint8_t *w, const void *xq, int64_t xblocks, int rows, float *out,
                         int64_t n) {
    dot_rows_portable(fmt, w, xq, xblocks, rows, out, n);
}
static const kernel PORTABLE = {quantize_blocks_portable, block_row_bytes, dot_portable};

#ifdef NS_QUANT_AVX2
static void quantize_blocks(const float *x, int64_t k, void *out) { quantize_row(x, k, out); }
static void quantize_pairs(const float *x, int64_t k, void *out) { quantize_row_pairs(x, k, out); }
static size_t pair_row_bytes(int64_t k) { return sizeof(xpair) * (size_t)((k / 32 + 1) / 2); }
static void dot_avx2(int fmt, const uint8_t *w, const void *xq, int64_t xblocks, int rows, float *out, int64_t n) {
    dot_rows_avx2(fmt, w, xq, xblocks, rows, out, n);
}
static void dot_q4_0_pairs(int fmt, const uint8_t *w, const void *xq, int64_t xblocks, int rows, float *out,
                           int64_t n) {
    (void)fmt;
    dot_pairs_avx2_GGML_Q4_0(w, xq, xblocks, rows, out, n);
}
static void dot_q4_1_pairs(int fmt, const uint8_t *w, const void *xq, int64_t xblocks, int rows, float *out,
                           int64_t n) {
    (void)fmt;
    dot_pairs_avx2_GGML_Q4_1(w, xq, xblocks, rows, out, n);
}
static const kernel AVX2 = {quantize_blocks, block_row_bytes, dot_avx2};
static const kernel AVX2_Q4_0 = {quantize_pairs, pair_row_bytes, dot_q4_0_pairs};
static const kernel AVX2_Q4_1 = {quantize_pairs, pair_row_bytes, dot_q4_1_pairs};
#endif

typedef struct {
    const kernel *kern;
    int fmt;
    const float *x;
    const uint8_t *w;
    float *y;
    int64_t rows, n, k;
    _Atomic int failed;
} MatmulJob;

/* No barrier inside: each thread quantizes every activation row itself (rows x k work, small
 * beside the rows x n x k of the products) and then takes its share of the output columns. */
static void matmul_task(void *context, int thread, int threads) {
    MatmulJob *job = context;
    const kernel *kern = job->kern;
    const int64_t n = job->n, k = job->k, rows = job->rows, xblocks = k / 32;
    const int64_t row_bytes = k / block_values(job->fmt) * block_bytes(job->fmt);
    const size_t x_row_bytes = kern->row_bytes(k);
    int64_t begin, end;
    ns_share((n + COLUMN_CHUNK - 1) / COLUMN_CHUNK, thread, threads, &begin, &end);
    uint8_t *xq = malloc(x_row_bytes * (size_t)rows);
    if (!xq) {
        job->failed = 1;
        return;
    }
    for (int64_t r = 0; r < rows; r++) kern->quantize(job->x + r * k, k, xq + r * x_row_bytes);
    for (int64_t col = begin * COLUMN_CHUNK; col < n && col < end * COLUMN_CHUNK; col++) {
        for (int64_t r = 0; r < rows; r += ROW_TILE) {
            int tile = rows - r < ROW_TILE ? (int)(rows - r) : ROW_TILE;
            kern->dot(job->fmt, job->w + col * row_bytes, xq + r * x_row_bytes, xblocks, tile, job->y + r * n + col, n);
        }
    }
    free(xq);
}

static int matmul(const kernel *kern, int fmt, const float *x, const uint8_t *w, float *y, int64_t rows,
                  int64_t n, int64_t k, int num_threads) {
    if (block_bytes(fmt) == 0 || k % block_values(fmt) != 0) return -1;
    int64_t chunks = (n + COLUMN_CHUNK - 1) / COLUMN_CHUNK;
    if (num_threads > chunks) num_threads = (int)chunks;
    MatmulJob job = {kern, fmt, x, w, y, rows, n, k, 0};
    ns_parallel(num_threads, matmul_task, &job);
    return job.failed ? -2 : 0;
}

/* y [rows, n] = x [rows, k] @ W^T, W [n, k] in GGUF format `fmt` (a GGML type number), the
 * widest path compiled in. Returns 0, or -1 for an unknown format / k not whole blocks,
 * -2 when out of memory. */
NS_EXPORT int ns_matmul_quant(int fmt, const float *x, const uint8_t *w, float *y, int64_t rows, int64_t n,
                              int64_t k, int num_threads) {
#ifdef NS_QUANT_AVX2
    const kernel *kern = fmt == GGML_Q4_0 ? &AVX2_Q4_0 : fmt == GGML_Q4_1 ? &AVX2_Q4_1 : &AVX2;
    return matmul(kern, fmt, x, w, y, rows, n, k, num_threads);
#else
    return matmul(&PORTABLE, fmt, x, w, y, rows, n, k, num_threads);
#endif
}

/* The same through the portable C dot products, for tests to hold the vector path against. */
NS_EXPORT int ns_matmul_quant_portable(int fmt, const float *x, const uint8_t *w, float *y, int64_t rows,
                                       int64_t n, int64_t k, int num_threads) {
    return matmul(&PORTABLE, fmt, x, w, y, rows, n, k, num_threads);
}

/* Row `id` of W, dequantized into out [k]. */
static void lookup_row(int fmt, const uint8_t *w, int64_t id, int64_t k, float *out) {
    const int per_block = block_values(fmt) / 32, bytes = block_bytes(fmt);
    const uint8_t *row = w + id * (k / block_values(fmt) * bytes);
    for (int64_t sub = 0; sub < k / 32; sub++) {
        int8_t q[32];
        int half_scale[2];
        float A, B;
        unpack_sub_block(fmt, row + (sub / per_block) * bytes, (int)(sub % per_block), q, half_scale, &A, &B);
        for (int l = 0; l < 32; l++) out[32 * sub + l] = A * (float)(q[l] * half_scale[l / 16]) + B;
    }
}

/* out [count, k] = rows ids[i] of W [n, k] dequantized (a quantized token table's lookups).
 * Returns 0, -1 as ns_matmul_quant, or -3 when an id is outside [0, n). */
NS_EXPORT int ns_dequantize_rows(int fmt, const uint8_t *w, const int64_t *ids, int64_t count, int64_t n,
                                 int64_t k, float *out, int num_threads) {
    if (block_bytes(fmt) == 0 || k % block_values(fmt) != 0) return -1;
    return ns_lookup_rows(lookup_row, fmt, w, ids, count, n, k, out, num_threads);
}
