/* The wide tiles, written once and compiled once per ISA: each of tiles_avx512vnni.c,
 * tiles_avx512.c and tiles_avxvnni.c sets the vector width and the dot-product instruction,
 * selects its ISA with GCC's target pragma, and includes this file.
 *
 * A tile multiplies `rows` activation rows by one unit of WT_GROUPS adjacent groups of 8 columns
 * (matmul_x8.c's and matmul_kx8.c's layouts, unchanged): 16 columns a zmm register on AVX-512,
 * the two groups' 32-byte chunks side by side in one register, or one group a ymm register on
 * AVX-VNNI. A unit's second group is `stride` bytes after its first (0: the unit has one group,
 * the register's upper half repeats it and the store keeps the first `valid` columns).
 *
 * For each block, each chunk of the unit's codes is loaded and unpacked once and met by every
 * row of the tile (its 4 activation bytes broadcast from the panel's interleaved codes, every
 * row at a constant offset from one address); each row keeps its int32 sum and float
 * accumulator in registers, one sub-block at a time (Q4_K's two nibbles of a chunk are two
 * passes: holding both sub-blocks' sums spilled registers). The chunk loops are unrolled so
 * the compiler names each sum's register instead of copying it every step. The arithmetic of each output is its layout's, operation
 * for operation (matmul_x8.c, matmul_kx8.c), with the block's integer dot product summed by
 * vpdpbusd (or maddubs + madd without VNNI), which an exact integer sum does not see:
 *   x8 Q4_1: acc = fma(float(isum_b), d_b * dx_b, acc), off = fma(m_b, sx_b, off); y = acc + off
 *   x8 Q8_0: as Q4_1 with off = 0. vpdpbusd multiplies unsigned by signed bytes: the weight
 *            w + 128 (w xor 0x80) meets x, and the sum starts at -128 sum(x) (the block's half
 *            sums); without VNNI |w| meets x negated where w < 0 (|pair| <= 2 x 127 x 127).
 *   kx8 Q4_K: acc = fma(float(isum_j) * float(sc_j), d * dx_j, acc) (the product is
 *            float(sc_j * isum_j) exactly: |sc_j isum_j| < 2^24), off = fma(dmin * float(mn_j),
 *            sx_j, off); y = acc - off
 *   kx8 Q6_K: each half h of 16 values sums q * x from -32 * (the half's sum of x), so
 *            s_h = sum (q - 32) x, and isum_j = fma(float(s_0), sc_0, float(s_1) * sc_1) is the
 *            reference's integer exactly (every product and sum < 2^24);
 *            acc = fma(isum_j, d * dx_j, acc); y = acc
 * The offset chains run as a second loop over the blocks, as matmul_kx8.c's do: the two chains
 * never mix before the final add. So each ISA's tile equals the portable reference bit for bit,
 * and a row's bits never depend on its tile, its unit, or the thread split.
 * Without VNNI, maddubs' int16 pairs stay exact: Q4 codes 2 x 15 x 127, Q6_K 2 x 63 x 127.
 */
#include <string.h>

#include "gemm/column_groups.h"
#include "quant/quant_blocks.h"
#include "arch/x86/wide_tiles_api.h"

#ifndef WT_NAME
#error "define WT_NAME, WT_COLUMNS and WT_VNNI before including wide_tiles.h"
#endif

#define WT_CAT2(a, b) a##_##b
#define WT_CAT(a, b) WT_CAT2(a, b)
#define WT(name) WT_CAT(name, WT_NAME)

#if WT_COLUMNS == 16
typedef __m512i wt_vi;
typedef __m512 wt_vf;
/* 32 bytes of each group at p and p + stride, side by side */
static inline wt_vi WT(load_unit)(const uint8_t *p, int64_t stride) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                              _mm256_loadu_si256((const __m256i *)(p + stride)), 1);
}
static inline wt_vf WT(f16_unit)(const uint8_t *p, int64_t stride) { /* 8 f16 each -> 16 floats */
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                                   _mm_loadu_si128((const __m128i *)(p + stride)), 1));
}
static inline __m128i WT(bytes_unit)(const uint8_t *p, int64_t stride) { /* 8 bytes each */
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)p), _mm_loadl_epi64((const __m128i *)(p + stride)));
}
static inline wt_vf WT(u8_unit)(const uint8_t *p, int64_t stride) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(WT(bytes_unit)(p, stride)));
}
static inline wt_vf WT(i8_unit)(const uint8_t *p, int64_t stride) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(WT(bytes_unit)(p, stride)));
}
#define WT_AND _mm512_and_si512
#define WT_ADD_I _mm512_add_epi32
#define WT_OR _mm512_or_si512
#define WT_XOR _mm512_xor_si512
#define WT_SRLI16 _mm512_srli_epi16
#define WT_SLLI16 _mm512_slli_epi16
#define WT_SET1_8 _mm512_set1_epi8
#define WT_SET1_32 _mm512_set1_epi32
#define WT_ZERO_I _mm512_setzero_si512
#define WT_CVT _mm512_cvtepi32_ps
#define WT_FMA _mm512_fmadd_ps
#define WT_MUL _mm512_mul_ps
#define WT_ADD _mm512_add_ps
#define WT_SUB _mm512_sub_ps
#define WT_SET1_F _mm512_set1_ps
#define WT_ZERO_F _mm512_setzero_ps
#if WT_VNNI
#define WT_DOT(acc, u, s) _mm512_dpbusd_epi32((acc), (u), (s))
#else
#define WT_DOT(acc, u, s) _mm512_add_epi32((acc), _mm512_madd_epi16(_mm512_maddubs_epi16((u), (s)), _mm512_set1_epi16(1)))
/* x negated where w is negative (codes are never -128, so the negation is exact) */
#define WT_SIGN_ONTO(x, w) _mm512_mask_sub_epi8((x), _mm512_movepi8_mask(w), _mm512_setzero_si512(), (x))
#define WT_ABS8 _mm512_abs_epi8
#endif
static inline void WT(store)(float *y, wt_vf v, int valid) {
    _mm512_mask_storeu_ps(y, (__mmask16)((1u << valid) - 1u), v);
}
#elif WT_COLUMNS == 8
typedef __m256i wt_vi;
typedef __m256 wt_vf;
static inline wt_vi WT(load_unit)(const uint8_t *p, int64_t stride) {
    (void)stride;
    return _mm256_loadu_si256((const __m256i *)p);
}
static inline wt_vf WT(f16_unit)(const uint8_t *p, int64_t stride) {
    (void)stride;
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline wt_vf WT(u8_unit)(const uint8_t *p, int64_t stride) {
    (void)stride;
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline wt_vf WT(i8_unit)(const uint8_t *p, int64_t stride) {
    (void)stride;
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#define WT_AND _mm256_and_si256
#define WT_ADD_I _mm256_add_epi32
#define WT_OR _mm256_or_si256
#define WT_XOR _mm256_xor_si256
#define WT_SRLI16 _mm256_srli_epi16
#define WT_SLLI16 _mm256_slli_epi16
#define WT_SET1_8 _mm256_set1_epi8
#define WT_SET1_32 _mm256_set1_epi32
#define WT_ZERO_I _mm256_setzero_si256
#define WT_CVT _mm256_cvtepi32_ps
#define WT_FMA _mm256_fmadd_ps
#define WT_MUL _mm256_mul_ps
#define WT_ADD _mm256_add_ps
#define WT_SUB _mm256_sub_ps
#define WT_SET1_F _mm256_set1_ps
#define WT_ZERO_F _mm256_setzero_ps
#if !WT_VNNI
#error "the 8-column wide tile is AVX-VNNI's (AVX2 without VNNI has matmul_x8.c's tiles)"
#endif
#define WT_DOT(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
static inline void WT(store)(float *y, wt_vf v, int valid) {
    if (valid == 8) {
        _mm256_storeu_ps(y, v);
        return;
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    memcpy(y, lanes, (size_t)valid * sizeof(float));
}
#else
#error "WT_COLUMNS is 16 or 8"
#endif

enum { WT_MAX_ROWS = NS_WIDE_MAX_ROWS, WT_MAX_CHAINS = 4 };

/* Independent integer sums a row keeps per block: one dot product waits for the one before it
 * in its chain (vpdpbusd's latency is several cycles), so a short tile, whose rows alone give
 * too few chains to fill the pipes, splits each row's sum and adds the parts at the end (an
 * exact integer sum, in any order). */
#define WT_CHAINS(rows) ((rows) >= 4 ? 1 : (rows) >= 2 ? 2 : 4)

static inline __attribute__((always_inline)) wt_vi WT(sum_chains)(const wt_vi *parts, const int chains) {
    wt_vi sum = parts[0];
    for (int c = 1; c < chains; c++) sum = WT_ADD_I(sum, parts[c]);
    return sum;
}

/* Word t of block b of the tile's row r (ns_wide_interleave's order) in every 32-bit lane: with
 * `rows` a constant, one address and constant offsets for every row of a chunk. */
static inline __attribute__((always_inline)) wt_vi WT(word)(const int32_t *codes, const int rows, int64_t b, int t,
                                                          int r) {
    return WT_SET1_32(codes[(8 * b + t) * rows + r]);
}

/* How far ahead of the block it multiplies a tile asks for each group's weights (matmul_x8.c's
 * reason: the hardware prefetcher restarts at every matrix). Only a unit's first tile asks: the
 * panel's other tiles find the unit in cache, and a request a line costs a tile of few rows
 * more than it saves. */
#define WT_PREFETCH_BYTES 4096

static inline __attribute__((always_inline)) void WT(prefetch)(const uint8_t *block, int64_t stride, int bytes) {
    for (int line = 0; line < bytes; line += 64) {
        _mm_prefetch((const char *)block + WT_PREFETCH_BYTES + line, _MM_HINT_T0);
        _mm_prefetch((const char *)block + stride + WT_PREFETCH_BYTES + line, _MM_HINT_T0);
    }
}

/* ---- x8: Q4_1 (Q4_0 repacked) and Q8_0 ----------------------------------------------------------- */

static inline __attribute__((always_inline)) void WT(x8_body)(const int fmt, const int rows, const uint8_t *group,
                                                            int64_t stride, const xblock *x, const int32_t *codes, int64_t blocks,
                                                            float *y, int64_t y_stride, int valid, int prefetch) {
    const int bytes = fmt == NS_WIDE_Q4_1 ? 160 : 272;
    const wt_vi low4 = WT_SET1_8(0x0F);
    wt_vf acc[WT_MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = WT_ZERO_F();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + b * bytes;
        if (prefetch) WT(prefetch)(block, stride, bytes);
        const int chains = WT_CHAINS(rows);
        wt_vi part[WT_MAX_ROWS][WT_MAX_CHAINS], isum[WT_MAX_ROWS];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < chains; c++) part[r][c] = WT_ZERO_I();
        if (fmt == NS_WIDE_Q4_1) {
            #pragma GCC unroll 8
            for (int t = 0; t < 4; t++) {
                const wt_vi w = WT(load_unit)(block + 32 + 32 * t, stride);
                const wt_vi lo = WT_AND(w, low4), hi = WT_AND(WT_SRLI16(w, 4), low4);
                for (int r = 0; r < rows; r++) {
                    wt_vi *even = &part[r][(2 * t) % chains], *odd = &part[r][(2 * t + 1) % chains];
                    *even = WT_DOT(*even, lo, WT(word)(codes, rows, b, t, r));
                    *odd = WT_DOT(*odd, hi, WT(word)(codes, rows, b, 4 + t, r));
                }
            }
        } else {
#if WT_VNNI
            for (int r = 0; r < rows; r++) {
                const xblock *xb = x + r * blocks + b;
                part[r][0] = WT_SET1_32(-128 * (xb->half_sums[0] + xb->half_sums[1]));
            }
            #pragma GCC unroll 8
            for (int t = 0; t < 8; t++) {
                const wt_vi biased = WT_XOR(WT(load_unit)(block + 16 + 32 * t, stride), WT_SET1_8((char)0x80));
                for (int r = 0; r < rows; r++) {
                    wt_vi *chain = &part[r][t % chains];
                    *chain = WT_DOT(*chain, biased, WT(word)(codes, rows, b, t, r));
                }
            }
#else
            #pragma GCC unroll 8
            for (int t = 0; t < 8; t++) {
                const wt_vi w = WT(load_unit)(block + 16 + 32 * t, stride), magnitude = WT_ABS8(w);
                for (int r = 0; r < rows; r++) {
                    wt_vi *chain = &part[r][t % chains];
                    *chain = WT_DOT(*chain, magnitude, WT_SIGN_ONTO(WT(word)(codes, rows, b, t, r), w));
                }
            }
#endif
        }
        for (int r = 0; r < rows; r++) isum[r] = WT(sum_chains)(part[r], chains);
        const wt_vf d = WT(f16_unit)(block, stride);
        for (int r = 0; r < rows; r++)
            acc[r] = WT_FMA(WT_CVT(isum[r]), WT_MUL(d, WT_SET1_F(x[r * blocks + b].d)), acc[r]);
    }
    wt_vf off[WT_MAX_ROWS];
    for (int r = 0; r < rows; r++) off[r] = WT_ZERO_F();
    if (fmt == NS_WIDE_Q4_1)
        for (int64_t b = 0; b < blocks; b++) {
            const wt_vf m = WT(f16_unit)(group + b * bytes + 16, stride);
            for (int r = 0; r < rows; r++) off[r] = WT_FMA(m, WT_SET1_F(x[r * blocks + b].s), off[r]);
        }
    for (int r = 0; r < rows; r++) WT(store)(y + r * y_stride, WT_ADD(acc[r], off[r]), valid);
}

/* ---- kx8: Q4_K and Q6_K ---------------------------------------------------------------------------- */

enum { WT_Q4_K_BYTES = 1184, WT_Q4_K_CODES = 160, WT_Q6_K_BYTES = 2192, WT_Q6_K_SCALES = 16, WT_Q6_K_CODES = 144 };

/* Sub-block j = 4s + i's chunk t of Q6_K codes, 0..63, a byte each. */
static inline __attribute__((always_inline)) wt_vi WT(q6_k_chunk)(const uint8_t *block, int64_t stride, int s,
                                                                const int i, int t) {
    return WT(load_unit)(block + WT_Q6_K_CODES + 256 * (4 * s + i) + 32 * t, stride);
}

/* Each row's s_h = sum (q - 32) x over half `half` of sub-block 4s + i (activation block b). */
static inline __attribute__((always_inline)) void WT(q6_k_half)(const int rows, const uint8_t *block, int64_t stride,
                                                              int s, const int i, const int half, const xblock *x,
                                                              const int32_t *codes, int64_t blocks, int64_t b,
                                                              wt_vi *sums) {
    const int chains = (WT_CHAINS(rows) + 1) / 2; /* four dot products a half: two chains at most */
    wt_vi parts[WT_MAX_ROWS][2];
    for (int r = 0; r < rows; r++) {
        parts[r][0] = WT_SET1_32(-32 * x[r * blocks + b].half_sums[half]);
        if (chains > 1) parts[r][1] = WT_ZERO_I();
    }
    #pragma GCC unroll 8
    for (int t = 4 * half; t < 4 * half + 4; t++) {
        const wt_vi q = WT(q6_k_chunk)(block, stride, s, i, t);
        for (int r = 0; r < rows; r++) {
            wt_vi *chain = &parts[r][t % chains];
            *chain = WT_DOT(*chain, q, WT(word)(codes, rows, b, t, r));
        }
    }
    for (int r = 0; r < rows; r++) sums[r] = WT(sum_chains)(parts[r], chains);
}

/* Q4_K's sub-block 2p + nibble (activation block b) against the tile's rows: the low or high
 * nibbles of pair p's chunks, one sub-block at a time, so that a row keeps one sum and its
 * accumulator in registers (two sub-blocks at once spilled them). */
static inline __attribute__((always_inline)) void WT(q4_k_sub_block)(const int rows, const uint8_t *block,
                                                                   int64_t stride, int p, const int nibble,
                                                                   const xblock *x, const int32_t *codes,
                                                                   int64_t blocks, int64_t b, wt_vf *acc) {
    const int chains = WT_CHAINS(rows);
    wt_vi parts[WT_MAX_ROWS][WT_MAX_CHAINS], sums[WT_MAX_ROWS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chains; c++) parts[r][c] = WT_ZERO_I();
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) {
        const wt_vi w = WT(load_unit)(block + WT_Q4_K_CODES + 256 * p + 32 * t, stride);
        const wt_vi q = WT_AND(nibble ? WT_SRLI16(w, 4) : w, WT_SET1_8(0x0F));
        for (int r = 0; r < rows; r++) parts[r][t % chains] = WT_DOT(parts[r][t % chains], q, WT(word)(codes, rows, b, t, r));
    }
    for (int r = 0; r < rows; r++) sums[r] = WT(sum_chains)(parts[r], chains);
    const wt_vf d = WT(f16_unit)(block, stride);
    const wt_vf scale = WT(u8_unit)(block + 32 + 8 * (2 * p + nibble), stride);
    for (int r = 0; r < rows; r++)
        acc[r] = WT_FMA(WT_MUL(WT_CVT(sums[r]), scale), WT_MUL(d, WT_SET1_F(x[r * blocks + b].d)), acc[r]);
}

/* Q6_K's sub-block j = 4s + i (activation block b) against the tile's rows: the acc chain. */
static inline __attribute__((always_inline)) void WT(q6_k_sub_block)(const int rows, const uint8_t *block,
                                                                   int64_t stride, int s, const int i,
                                                                   const xblock *x, const int32_t *codes, int64_t blocks, int64_t b,
                                                                   wt_vf *acc) {
    const int j = 4 * s + i;
    wt_vf isum[WT_MAX_ROWS];
    const wt_vf sc0 = WT(i8_unit)(block + WT_Q6_K_SCALES + 8 * (2 * j), stride);
    const wt_vf sc1 = WT(i8_unit)(block + WT_Q6_K_SCALES + 8 * (2 * j + 1), stride);
    wt_vi sums[WT_MAX_ROWS];
    WT(q6_k_half)(rows, block, stride, s, i, 0, x, codes, blocks, b, sums);
    for (int r = 0; r < rows; r++) isum[r] = WT_MUL(WT_CVT(sums[r]), sc0);
    WT(q6_k_half)(rows, block, stride, s, i, 1, x, codes, blocks, b, sums);
    for (int r = 0; r < rows; r++) isum[r] = WT_FMA(WT_CVT(sums[r]), sc1, isum[r]);
    const wt_vf d = WT(f16_unit)(block, stride);
    for (int r = 0; r < rows; r++) acc[r] = WT_FMA(isum[r], WT_MUL(d, WT_SET1_F(x[r * blocks + b].d)), acc[r]);
}

static inline __attribute__((always_inline)) void WT(kx8_body)(const int fmt, const int rows, const uint8_t *group,
                                                             int64_t stride, const xblock *x, const int32_t *codes, int64_t blocks,
                                                             float *y, int64_t y_stride, int valid, int prefetch) {
    const int bytes = fmt == NS_WIDE_Q4_K ? WT_Q4_K_BYTES : WT_Q6_K_BYTES;
    wt_vf acc[WT_MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = WT_ZERO_F();
    for (int64_t super = 0; super < blocks / 8; super++) {
        const uint8_t *block = group + super * bytes;
        const int64_t b = 8 * super;
        if (prefetch) WT(prefetch)(block, stride, bytes);
        if (fmt == NS_WIDE_Q4_K) {
            for (int p = 0; p < 4; p++) {
                WT(q4_k_sub_block)(rows, block, stride, p, 0, x, codes, blocks, b + 2 * p, acc);
                WT(q4_k_sub_block)(rows, block, stride, p, 1, x, codes, blocks, b + 2 * p + 1, acc);
            }
            continue;
        }
        /* Q6_K: the inner 4 unrolled, so each sub-block's nibble and top-bit shift are constants */
        for (int s = 0; s < 2; s++) {
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) WT(q6_k_sub_block)(rows, block, stride, s, i, x, codes, blocks, b + 4 * s + i, acc);
        }
    }
    if (fmt == NS_WIDE_Q4_K) {
        wt_vf off[WT_MAX_ROWS];
        for (int r = 0; r < rows; r++) off[r] = WT_ZERO_F();
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *block = group + (b / 8) * bytes;
            const wt_vf m = WT_MUL(WT(f16_unit)(block + 16, stride), WT(u8_unit)(block + 96 + 8 * (b % 8), stride));
            for (int r = 0; r < rows; r++) off[r] = WT_FMA(m, WT_SET1_F(x[r * blocks + b].s), off[r]);
        }
        for (int r = 0; r < rows; r++) acc[r] = WT_SUB(acc[r], off[r]);
    }
    for (int r = 0; r < rows; r++) WT(store)(y + r * y_stride, acc[r], valid);
}

/* One function per (layout, tile height), both constants, so each row's registers are named. */
#define WT_HEIGHT_CASE(BODY, FMT, ROWS)                                          \
    if (rows == ROWS) {                                                          \
        BODY(FMT, ROWS, group, stride, x, codes, blocks, y, y_stride, valid, prefetch); \
        return;                                                                  \
    }
#define WT_DEFINE_TILE(NAME, BODY, FMT)                                                                         \
    static void NAME(int rows, const uint8_t *group, int64_t stride, const xblock *x, const int32_t *codes, int64_t blocks, float *y, \
                     int64_t y_stride, int valid, int prefetch) {                                               \
        WT_HEIGHT_CASE(BODY, FMT, 8)                                                                            \
        WT_HEIGHT_CASE(BODY, FMT, 7)                                                                            \
        WT_HEIGHT_CASE(BODY, FMT, 6)                                                                            \
        WT_HEIGHT_CASE(BODY, FMT, 5)                                                                            \
        WT_HEIGHT_CASE(BODY, FMT, 4)                                                                            \
        WT_HEIGHT_CASE(BODY, FMT, 3)                                                                            \
        WT_HEIGHT_CASE(BODY, FMT, 2)                                                                            \
        BODY(FMT, 1, group, stride, x, codes, blocks, y, y_stride, valid, prefetch);                           \
    }
WT_DEFINE_TILE(WT(x8_q4_1), WT(x8_body), NS_WIDE_Q4_1)
WT_DEFINE_TILE(WT(x8_q8_0), WT(x8_body), NS_WIDE_Q8_0)
WT_DEFINE_TILE(WT(kx8_q4_k), WT(kx8_body), NS_WIDE_Q4_K)
WT_DEFINE_TILE(WT(kx8_q6_k), WT(kx8_body), NS_WIDE_Q6_K)

ns_wide_tile WT(ns_wide_tile_for)(int fmt) {
    switch (fmt) {
    case NS_WIDE_Q4_1: return WT(x8_q4_1);
    case NS_WIDE_Q8_0: return WT(x8_q8_0);
    case NS_WIDE_Q4_K: return WT(kx8_q4_k);
    case NS_WIDE_Q6_K: return WT(kx8_q6_k);
    default: return NULL;
    }
}
