/* y = x @ W^T for the GGUF weight types matmul_quant.c does not run, x float32, W in its file's
 * bytes: Q5_0, Q5_1, IQ4_NL (blocks of 32), Q2_K, Q3_K, IQ4_XS (blocks of 256), and F16 / BF16.
 *
 * The block formats go as matmul_quant.c's do (llama.cpp's way on CPUs): each activation row is
 * quantized once per call to 8-bit blocks of 32 (quant_blocks.h's xblock: codes, d, s = d *
 * sum(codes)), and each weight sub-block of 32 values meets one of them in integer dot products.
 * Sub-block j contributes, with h the halves of 16 values and x the activation codes,
 *     A_j d_x sum_h(scale_h sum(qw x))  +  B_j s_x  +  M_j d_x sum_h(min_h sum(x))
 *     Q5_0:   qw = nib | bit << 4 (0..31),      scale 1,             A = d,             B = -16 d
 *     Q5_1:   the same qw,                      scale 1,             A = d,             B = m
 *     IQ4_NL: qw = grid[nib] (signed),          scale 1,             A = d
 *     IQ4_XS: qw = grid[nib] (signed),          scale 1,             A = d (ls_j - 32)
 *     Q2_K:   qw = 2 bits (0..3),               scale = sc & 15,     A = d,  min = sc >> 4, M = -dmin
 *     Q3_K:   qw = 2 bits - 4 (high bit clear), scale = 6 bits - 32, A = d
 * so the per-16 scales and mins of Q2_K / Q3_K stay integers inside the sum, as ggml's
 * vec_dot_q2_K_q8_K does with its bsums. Layouts: quant_blocks.h's structs and nanoserve/quant.py.
 *
 * F16 / BF16 weights meet the float32 activations as they are: each 8 weights widen to float32
 * (F16C's vcvtph2ps; a bfloat16 is the top half of a float32) and go into one of two 8-lane FMA
 * chains, even and odd groups of 8 along K; the lanes are summed as ns_hsum256 does and the last
 * K % 8 products are fused onto that sum one by one. The portable path runs the same chains with
 * fmaf, so where fmaf is one instruction (FP_FAST_FMAF) the two paths agree bit for bit.
 *
 * Batch invariance (nanoserve.h): a row's output is its sub-blocks (or K groups) in K order, by
 * the same instructions whatever tile of rows it is computed in; threads split output columns.
 * As in matmul_quant.c, a thread takes one weight row at a time against up to ROW_TILE
 * activation rows, so each weight row is read from memory once per call and unpacked once per
 * tile. These kernels keep the file's row-major blocks (no repacking), which is also what the
 * row lookups of a token table read.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nanoserve.h"
#include "quant/quant_blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NS_MORE_AVX2 1
#endif

enum {
    GGML_F16 = 1, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q2_K = 10, GGML_Q3_K = 11, GGML_IQ4_NL = 20,
    GGML_IQ4_XS = 23, GGML_BF16 = 30
};

#define ROW_TILE 4
#define COLUMN_CHUNK 16 /* threads split the output columns in chunks of this many */

/* ---- per-format facts -------------------------------------------------------------------- */

static inline int is_float(int fmt) { return fmt == GGML_F16 || fmt == GGML_BF16; }

static inline int block_values(int fmt) {
    switch (fmt) {
    case GGML_F16: case GGML_BF16: return 1;
    case GGML_Q5_0: case GGML_Q5_1: case GGML_IQ4_NL: return 32;
    case GGML_Q2_K: case GGML_Q3_K: case GGML_IQ4_XS: return 256;
    default: return 0;
    }
}

static inline int block_bytes(int fmt) {
    switch (fmt) {
    case GGML_F16: case GGML_BF16: return 2;
    case GGML_Q5_0: return sizeof(block_q5_0);
    case GGML_Q5_1: return sizeof(block_q5_1);
    case GGML_IQ4_NL: return sizeof(block_iq4_nl);
    case GGML_IQ4_XS: return sizeof(block_iq4_xs);
    case GGML_Q2_K: return sizeof(block_q2_k);
    case GGML_Q3_K: return sizeof(block_q3_k);
    default: return 0;
    }
}

/* Whether a format can run on rows of k values: whole blocks, and whole activation blocks of 32. */
static inline int runs_width(int fmt, int64_t k) {
    int values = block_values(fmt);
    return values != 0 && k % values == 0 && (is_float(fmt) || k % 32 == 0);
}

static inline float bf16_to_f32(const uint8_t *p) {
    uint32_t bits = (uint32_t)(p[0] | (p[1] << 8)) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The 6-bit scale of Q3_K's 16-value sub-block s (0..15): its low nibble from scales[s % 8]
 * (high nibble when s >= 8), its top two bits from scales[8 + s % 4] at bit 2 (s / 4). */
static inline int q3_k_scale(const uint8_t *scales, int s) {
    int low = s < 8 ? scales[s] & 0x0F : scales[s - 8] >> 4;
    return (low | ((scales[8 + s % 4] >> (2 * (s / 4))) & 3) << 4) - 32;
}

/* The 6-bit scale of IQ4_XS sub-block j, less 32. */
static inline int iq4_xs_scale(const block_iq4_xs *b, int j) {
    int high = b->scales_h[0] | (b->scales_h[1] << 8);
    return (((b->scales_l[j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4)) - 32;
}

/* ---- one sub-block of 32 values, the portable form ---------------------------------------- */

typedef struct {
    int8_t q[32];   /* the integer codes qw */
    int scale[2];   /* of values 0-15 and 16-31 */
    int min[2];     /* Q2_K's mins (else 0), weighted by the sums of the activation codes */
    float A, B, M;  /* as in the header */
} sub_block;

static inline int nib(const uint8_t *qs, int l) { return l < 16 ? qs[l] & 0x0F : qs[l - 16] >> 4; }

/* Sub-block j of the block at `p`. */
static void unpack_sub_block(int fmt, const uint8_t *p, int j, sub_block *s) {
    s->scale[0] = s->scale[1] = 1;
    s->min[0] = s->min[1] = 0;
    s->B = s->M = 0.0f;
    switch (fmt) {
    case GGML_Q5_0:
    case GGML_Q5_1: {
        const uint8_t *qh = fmt == GGML_Q5_0 ? ((const block_q5_0 *)p)->qh : ((const block_q5_1 *)p)->qh;
        const uint8_t *qs = fmt == GGML_Q5_0 ? ((const block_q5_0 *)p)->qs : ((const block_q5_1 *)p)->qs;
        uint32_t high = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
        for (int l = 0; l < 32; l++) s->q[l] = (int8_t)(nib(qs, l) | ((high >> l) & 1) << 4);
        s->A = f16_to_f32(p);
        s->B = fmt == GGML_Q5_0 ? -16.0f * s->A : f16_to_f32(((const block_q5_1 *)p)->m);
        return;
    }
    case GGML_IQ4_NL: {
        const block_iq4_nl *b = (const block_iq4_nl *)p;
        for (int l = 0; l < 32; l++) s->q[l] = IQ4_GRID[nib(b->qs, l)];
        s->A = f16_to_f32(b->d);
        return;
    }
    case GGML_IQ4_XS: {
        const block_iq4_xs *b = (const block_iq4_xs *)p;
        for (int l = 0; l < 32; l++) s->q[l] = IQ4_GRID[nib(b->qs + 16 * j, l)];
        s->A = f16_to_f32(b->d) * (float)iq4_xs_scale(b, j);
        return;
    }
    case GGML_Q2_K:
    case GGML_Q3_K: {
        /* Sub-block j is half h = j / 4 at shift s = j % 4: bits 2s of the 32 bytes qs[32h ..],
         * its two halves the 16-value sub-blocks 2j and 2j + 1. */
        int h = j / 4, shift = 2 * (j % 4);
        const uint8_t *qs = (fmt == GGML_Q2_K ? ((const block_q2_k *)p)->qs : ((const block_q3_k *)p)->qs) + 32 * h;
        for (int l = 0; l < 32; l++) s->q[l] = (int8_t)((qs[l] >> shift) & 3);
        if (fmt == GGML_Q2_K) {
            const block_q2_k *b = (const block_q2_k *)p;
            for (int t = 0; t < 2; t++) {
                s->scale[t] = b->scales[2 * j + t] & 0x0F;
                s->min[t] = b->scales[2 * j + t] >> 4;
            }
            s->A = f16_to_f32(b->d);
            s->M = -f16_to_f32(b->dmin);
        } else { /* the third bit, bit j of hmask[l]: set means no -4 */
            const block_q3_k *b = (const block_q3_k *)p;
            for (int l = 0; l < 32; l++) s->q[l] = (int8_t)(s->q[l] - (((b->hmask[l] >> j) & 1) ? 0 : 4));
            for (int t = 0; t < 2; t++) s->scale[t] = q3_k_scale(b->scales, 2 * j + t);
            s->A = f16_to_f32(b->d);
        }
        return;
    }
    }
}

/* ---- portable dot products --------------------------------------------------------------- */

/* out[r * n] = dot(weight row w, activation row r) for r < rows (a tile of at most ROW_TILE). */
static void dot_blocks_portable(int fmt, const uint8_t *w, const void *xq, int64_t k, int rows, float *out,
                                int64_t n) {
    const xblock *x = xq;
    const int64_t xblocks = k / 32;
    const int per_block = block_values(fmt) / 32, bytes = block_bytes(fmt);
    float acc[ROW_TILE] = {0}, offsets[ROW_TILE] = {0};
    for (int64_t sub = 0; sub < xblocks; sub++) {
        sub_block s;
        unpack_sub_block(fmt, w + (sub / per_block) * bytes, (int)(sub % per_block), &s);
        for (int r = 0; r < rows; r++) {
            const xblock *xb = x + r * xblocks + sub;
            int dot[2] = {0, 0}, sum[2] = {0, 0};
            for (int l = 0; l < 32; l++) {
                dot[l / 16] += s.q[l] * xb->qs[l];
                sum[l / 16] += xb->qs[l];
            }
            acc[r] += (float)(dot[0] * s.scale[0] + dot[1] * s.scale[1]) * (s.A * xb->d);
            acc[r] += (float)(sum[0] * s.min[0] + sum[1] * s.min[1]) * (s.M * xb->d);
            offsets[r] += s.B * xb->s;
        }
    }
    for (int r = 0; r < rows; r++) out[r * n] = acc[r] + offsets[r];
}

static inline float weight_value(int fmt, const uint8_t *w, int64_t i) {
    return fmt == GGML_F16 ? f16_to_f32(w + 2 * i) : bf16_to_f32(w + 2 * i);
}

/* The header's F16 / BF16 chains: lanes c of two accumulators, even and odd groups of 8. */
static void dot_floats_portable(int fmt, const uint8_t *w, const void *xq, int64_t k, int rows, float *out,
                                int64_t n) {
    for (int r = 0; r < rows; r++) {
        const float *x = (const float *)xq + r * k;
        float acc[2][8] = {{0}};
        int64_t kk = 0;
        for (; kk + 16 <= k; kk += 16)
            for (int g = 0; g < 2; g++)
                for (int c = 0; c < 8; c++)
                    acc[g][c] = fmaf(x[kk + 8 * g + c], weight_value(fmt, w, kk + 8 * g + c), acc[g][c]);
        if (kk + 8 <= k) {
            for (int c = 0; c < 8; c++) acc[0][c] = fmaf(x[kk + c], weight_value(fmt, w, kk + c), acc[0][c]);
            kk += 8;
        }
        float v[8], s4[4];
        for (int c = 0; c < 8; c++) v[c] = acc[0][c] + acc[1][c];
        for (int c = 0; c < 4; c++) s4[c] = v[c] + v[c + 4];
        float total = (s4[0] + s4[2]) + (s4[1] + s4[3]);
        for (; kk < k; kk++) total = fmaf(x[kk], weight_value(fmt, w, kk), total);
        out[r * n] = total;
    }
}

/* ---- AVX2 dot products ------------------------------------------------------------------- */

#ifdef NS_MORE_AVX2
static inline __m256i nibbles16(const uint8_t *qs) { /* 16 bytes -> 32 codes, low nibbles first */
    __m128i packed = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), _mm_and_si128(packed, mask));
}

/* The 32 bits of qh[0..3] as 32 bytes, 0x10 where the bit is set (ggml's bytes_from_bits_32). */
static inline __m256i high_bits16(const uint8_t *qh) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

/* Sub-block j's codes as 32 bytes (signed for IQ4_NL, IQ4_XS and Q3_K), the int16 scale and min
 * of each half (lanes 0-7: values 0-15; lanes 8-15: values 16-31), A, B and M. */
static inline __attribute__((always_inline)) __m256i unpack_avx2(const int fmt, const uint8_t *p, int j,
                                                                 __m256i *scale16, __m256i *min16, float *A,
                                                                 float *B, float *M) {
    *scale16 = _mm256_set1_epi16(1);
    *min16 = _mm256_setzero_si256();
    *B = *M = 0.0f;
    switch (fmt) {
    case GGML_Q5_0: {
        const block_q5_0 *b = (const block_q5_0 *)p;
        *A = f16_to_f32(b->d);
        *B = -16.0f * *A;
        return _mm256_or_si256(nibbles16(b->qs), high_bits16(b->qh));
    }
    case GGML_Q5_1: {
        const block_q5_1 *b = (const block_q5_1 *)p;
        *A = f16_to_f32(b->d);
        *B = f16_to_f32(b->m);
        return _mm256_or_si256(nibbles16(b->qs), high_bits16(b->qh));
    }
    case GGML_IQ4_NL: {
        const block_iq4_nl *b = (const block_iq4_nl *)p;
        *A = f16_to_f32(b->d);
        return iq4_grid_values(nibbles16(b->qs));
    }
    case GGML_IQ4_XS: {
        const block_iq4_xs *b = (const block_iq4_xs *)p;
        *A = f16_to_f32(b->d) * (float)iq4_xs_scale(b, j);
        return iq4_grid_values(nibbles16(b->qs + 16 * j));
    }
    case GGML_Q2_K: {
        const block_q2_k *b = (const block_q2_k *)p;
        const uint8_t s0 = b->scales[2 * j], s1 = b->scales[2 * j + 1];
        *scale16 = _mm256_set_m128i(_mm_set1_epi16(s1 & 0x0F), _mm_set1_epi16(s0 & 0x0F));
        *min16 = _mm256_set_m128i(_mm_set1_epi16(s1 >> 4), _mm_set1_epi16(s0 >> 4));
        *A = f16_to_f32(b->d);
        *M = -f16_to_f32(b->dmin);
        __m256i qs = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * (j / 4)));
        return _mm256_and_si256(_mm256_srli_epi16(qs, 2 * (j % 4)), _mm256_set1_epi8(3));
    }
    case GGML_Q3_K: {
        const block_q3_k *b = (const block_q3_k *)p;
        *scale16 = _mm256_set_m128i(_mm_set1_epi16((short)q3_k_scale(b->scales, 2 * j + 1)),
                                    _mm_set1_epi16((short)q3_k_scale(b->scales, 2 * j)));
        *A = f16_to_f32(b->d);
        __m256i qs = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * (j / 4)));
        __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * (j % 4)), _mm256_set1_epi8(3));
        __m256i hmask = _mm256_loadu_si256((const __m256i *)b->hmask);
        __m256i high = _mm256_and_si256(_mm256_srli_epi16(hmask, j), _mm256_set1_epi8(1));
        /* high bit clear: -4, so q = low + 4 * high - 4 */
        return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 2)), _mm256_set1_epi8(4));
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
    const int is_signed = fmt == GGML_IQ4_NL || fmt == GGML_IQ4_XS || fmt == GGML_Q3_K;
    __m256i scale16, min16;
    float A, B, M;
    __m256i q = unpack_avx2(fmt, w + (sub / per_block) * bytes, (int)(sub % per_block), &scale16, &min16, &A, &B, &M);
    /* maddubs multiplies unsigned by signed bytes: a signed q moves its sign onto x. Each int16
     * lane then sums two products of at most 127 * 127, which fits. */
    __m256i q_unsigned = is_signed ? _mm256_sign_epi8(q, q) : q;
    for (int r = 0; r < rows; r++) {
        const xblock *xb = x + r * xblocks + sub;
        __m256i xv = _mm256_loadu_si256((const __m256i *)xb->qs);
        __m256i xs = is_signed ? _mm256_sign_epi8(xv, q) : xv;
        __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(q_unsigned, xs), scale16);
        acc[r][lane] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(A * xb->d), acc[r][lane]);
        if (fmt == GGML_Q2_K) { /* the mins, against the sum of each half's activation codes */
            __m256i mins = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), xv), min16);
            acc[r][lane] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(M * xb->d), acc[r][lane]);
        }
        if (fmt == GGML_Q5_0 || fmt == GGML_Q5_1) /* the formats with an offset B */
            offsets[r][lane] = _mm_fmadd_ss(_mm_set_ss(B), _mm_set_ss(xb->s), offsets[r][lane]);
    }
}

/* The tile kernel, inlined into one function per (format, tile height); matmul_quant.c's
 * dot_tile_avx2 explains the two accumulator pairs. */
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

/* 8 weights from w[i], widened to float32. */
static inline __attribute__((always_inline)) __m256 load8(const int fmt, const uint8_t *w, int64_t i) {
    __m128i halves = _mm_loadu_si128((const __m128i *)(w + 2 * i));
    if (fmt == GGML_F16) return _mm256_cvtph_ps(halves);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

/* The header's F16 / BF16 chains for a tile of rows: each weight group is widened once. */
static inline __attribute__((always_inline)) void dot_float_tile_avx2(const int fmt, const int rows, const uint8_t *w,
                                                                      const float *x, int64_t k, float *out,
                                                                      int64_t n) {
    __m256 acc[ROW_TILE][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t kk = 0;
    for (; kk + 16 <= k; kk += 16) {
        __m256 w0 = load8(fmt, w, kk), w1 = load8(fmt, w, kk + 8);
        for (int r = 0; r < rows; r++) {
            acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + kk), w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + kk + 8), w1, acc[r][1]);
        }
    }
    const int64_t groups_end = kk + 8 <= k ? kk + 8 : kk;
    if (groups_end > kk) {
        __m256 w0 = load8(fmt, w, kk);
        for (int r = 0; r < rows; r++) acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + kk), w0, acc[r][0]);
    }
    for (int r = 0; r < rows; r++) {
        float total = ns_hsum256(_mm256_add_ps(acc[r][0], acc[r][1]));
        for (int64_t i = groups_end; i < k; i++) total = fmaf(x[r * k + i], weight_value(fmt, w, i), total);
        out[r * n] = total;
    }
}

#define DEFINE_DOT_AVX2(FMT)                                                                                \
    static void dot_avx2_##FMT(int fmt, const uint8_t *w, const void *xq, int64_t k, int rows, float *out,  \
                               int64_t n) {                                                               \
        (void)fmt;                                                                                        \
        if (rows == ROW_TILE) {                                                                           \
            dot_tile_avx2(FMT, ROW_TILE, w, xq, k / 32, out, n);                                          \
            return;                                                                                       \
        }                                                                                                 \
        for (int r = 0; r < rows; r++) dot_tile_avx2(FMT, 1, w, (const xblock *)xq + r * (k / 32), k / 32, \
                                                     out + r * n, n);                                     \
    }
DEFINE_DOT_AVX2(GGML_Q5_0)
DEFINE_DOT_AVX2(GGML_Q5_1)
DEFINE_DOT_AVX2(GGML_IQ4_NL)
DEFINE_DOT_AVX2(GGML_IQ4_XS)
DEFINE_DOT_AVX2(GGML_Q2_K)
DEFINE_DOT_AVX2(GGML_Q3_K)

#define DEFINE_DOT_FLOAT_AVX2(FMT)                                                                          \
    static void dot_avx2_##FMT(int fmt, const uint8_t *w, const void *xq, int64_t k, int rows, float *out,  \
                               int64_t n) {                                                               \
        (void)fmt;                                                                                        \
        if (rows == ROW_TILE) {                                                                           \
            dot_float_tile_avx2(FMT, ROW_TILE, w, xq, k, out, n);                                         \
            return;                                                                                       \
        }                                                                                                 \
        for (int r = 0; r < rows; r++) dot_float_tile_avx2(FMT, 1, w, (const float *)xq + r * k, k, out + r * n, n); \
    }
DEFINE_DOT_FLOAT_AVX2(GGML_F16)
DEFINE_DOT_FLOAT_AVX2(GGML_BF16)
#endif

/* ---- the entry points -------------------------------------------------------------------- */

/* How a kernel wants its activation rows (matmul_quant.c's pattern): a quantizer (NULL: the
 * float32 rows as they are), the bytes one row takes, and the tile function over them. */
typedef void (*dot_fn)(int fmt, const uint8_t *w, const void *xq, int64_t k, int rows, float *out, int64_t n);
typedef struct {
    void (*quantize)(const float *x, int64_t k, void *out);
    dot_fn dot;
} kernel;

static void quantize_blocks_portable(const float *x, int64_t k, void *out) { quantize_row_portable(x, k, out); }

static kernel portable_kernel(int fmt) {
    if (is_float(fmt)) return (kernel){NULL, dot_floats_portable};
    return (kernel){quantize_blocks_portable, dot_blocks_portable};
}

#ifdef NS_MORE_AVX2
static void quantize_blocks(const float *x, int64_t k, void *out) { quantize_row(x, k, out); }

static kernel widest_kernel(int fmt) {
    switch (fmt) {
    case GGML_Q5_0: return (kernel){quantize_blocks, dot_avx2_GGML_Q5_0};
    case GGML_Q5_1: return (kernel){quantize_blocks, dot_avx2_GGML_Q5_1};
    case GGML_IQ4_NL: return (kernel){quantize_blocks, dot_avx2_GGML_IQ4_NL};
    case GGML_IQ4_XS: return (kernel){quantize_blocks, dot_avx2_GGML_IQ4_XS};
    case GGML_Q2_K: return (kernel){quantize_blocks, dot_avx2_GGML_Q2_K};
    case GGML_Q3_K: return (kernel){quantize_blocks, dot_avx2_GGML_Q3_K};
    case GGML_F16: return (kernel){NULL, dot_avx2_GGML_F16};
    default: return (kernel){NULL, dot_avx2_GGML_BF16};
    }
}
#else
static kernel widest_kernel(int fmt) { return portable_kernel(fmt); }
#endif

typedef struct {
    kernel kern;
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
    const int64_t n = job->n, k = job->k, rows = job->rows;
    const int64_t row_bytes = k / block_values(job->fmt) * block_bytes(job->fmt);
    int64_t begin, end;
    ns_share((n + COLUMN_CHUNK - 1) / COLUMN_CHUNK, thread, threads, &begin, &end);
    const void *xq = job->x;
    size_t x_row_bytes = sizeof(float) * (size_t)k;
    void *quantized = NULL;
    if (job->kern.quantize) {
        x_row_bytes = sizeof(xblock) * (size_t)(k / 32);
        quantized = malloc(x_row_bytes * (size_t)rows);
        if (!quantized) {
            job->failed = 1;
            return;
        }
        for (int64_t r = 0; r < rows; r++) job->kern.quantize(job->x + r * k, k, (uint8_t *)quantized + r * x_row_bytes);
        xq = quantized;
    }
    for (int64_t col = begin * COLUMN_CHUNK; col < n && col < end * COLUMN_CHUNK; col++) {
        for (int64_t r = 0; r < rows; r += ROW_TILE) {
            int tile = rows - r < ROW_TILE ? (int)(rows - r) : ROW_TILE;
            job->kern.dot(job->fmt, job->w + col * row_bytes, (const uint8_t *)xq + r * x_row_bytes, k, tile,
                          job->y + r * n + col, n);
        }
    }
    free(quantized);
}

static int matmul(kernel kern, int fmt, const float *x, const uint8_t *w, float *y, int64_t rows, int64_t n,
                  int64_t k, int num_threads) {
    if (!runs_width(fmt, k)) return -1;
    int64_t chunks = (n + COLUMN_CHUNK - 1) / COLUMN_CHUNK;
    if (num_threads > chunks) num_threads = (int)chunks;
    MatmulJob job = {kern, fmt, x, w, y, rows, n, k, 0};
    ns_parallel(num_threads, matmul_task, &job);
    return job.failed ? -2 : 0;
}

/* y [rows, n] = x [rows, k] @ W^T, W [n, k] in GGML type `fmt` (one of this file's), the widest
 * path compiled in. Returns 0, or -1 for another type or k not whole blocks (for the block
 * formats, whole blocks of 32 too), -2 when out of memory. */
NS_EXPORT int ns_matmul_more(int fmt, const float *x, const uint8_t *w, float *y, int64_t rows, int64_t n,
                             int64_t k, int num_threads) {
    return matmul(widest_kernel(fmt), fmt, x, w, y, rows, n, k, num_threads);
}

/* The same through the portable C dot products, for tests to hold the vector path against. */
NS_EXPORT int ns_matmul_more_portable(int fmt, const float *x, const uint8_t *w, float *y, int64_t rows,
                                      int64_t n, int64_t k, int num_threads) {
    return matmul(portable_kernel(fmt), fmt, x, w, y, rows, n, k, num_threads);
}

/* Row `id` of W as float32 into out [k]. */
static void lookup_row(int fmt, const uint8_t *w, int64_t id, int64_t k, float *out) {
    const uint8_t *row = w + id * (k / block_values(fmt) * block_bytes(fmt));
    if (is_float(fmt)) {
        for (int64_t i = 0; i < k; i++) out[i] = weight_value(fmt, row, i);
        return;
    }
    const int per_block = block_values(fmt) / 32, bytes = block_bytes(fmt);
    for (int64_t sub = 0; sub < k / 32; sub++) {
        sub_block s;
        unpack_sub_block(fmt, row + (sub / per_block) * bytes, (int)(sub % per_block), &s);
        for (int l = 0; l < 32; l++)
            out[32 * sub + l] = s.A * (float)(s.q[l] * s.scale[l / 16]) + s.M * (float)s.min[l / 16] + s.B;
    }
}


/* out [count, k] = rows ids[i] of W [n, k] as float32 (a token table's lookups).
 * Returns 0, -1 as ns_matmul_more, or -3 when an id is outside [0, n). */
NS_EXPORT int ns_dequantize_rows_more(int fmt, const uint8_t *w, const int64_t *ids, int64_t count, int64_t n,
                                      int64_t k, float *out, int num_threads) {
    if (!runs_width(fmt, k)) return -1;
    return ns_lookup_rows(lookup_row, fmt, w, ids, count, n, k, out, num_threads);
}
