/* y = x @ W^T with Q4_K, Q5_K, Q6_K, Q2_K, Q3_K or IQ4_XS blocks repacked at load: 8 output columns
 * interleaved.
 *
 * matmul_quant.c reads the K-quants in the file's row-major layout: every 32-value sub-block
 * of one output column unpacked alone, reduced with a horizontal sum. Here, as matmul_x8.c does
 * for the 32-value formats (and ggml-cpu's repack for Q4_K, its block_q4_Kx8), the super-blocks
 * of 8 consecutive output columns are interleaved, so one step does a sub-block of 8 columns
 * with every lane busy: each 32-bit lane holds 4 code bytes of one column, the integer dot
 * products sum into one lane per column, and the per-column sub-block scales multiply them
 * as integers in the same madd that widens the sums.
 *
 * Layout of a group of 8 columns, super-block by super-block along K (nanoserve/native/repack.py
 * writes it from the file's blocks; the values are the file's, regrouped), each group-super-block:
 *     Q4_K (1184 bytes = 8 x 144 + 32): d[8] f16, dmin[8] f16, sc[8 sub-blocks][8 columns] u8,
 *          mn[8][8] u8 (the 6-bit scales and mins unpacked to bytes), then 4 pairs p of 256 bytes:
 *          chunk t (32 bytes) of pair p holds column c's bytes 4t..4t+3 at 32t + 4c; byte l's low
 *          nibble is value l of sub-block 2p, its high nibble value l of sub-block 2p+1.
 *     Q5_K (1440 bytes = 8 x 180): Q4_K's 1184 bytes, then the fifth bits: the file's qh chunked
 *          (256 bytes), bit j of byte l set adding 16 to value l of sub-block j.
 *     Q6_K (2192 bytes = 8 x 274): d[8] f16, scales[16 halves of 16][8 columns] i8, then the
 *          codes (0..63) a byte each: per sub-block j 8 chunks t of 32 bytes (256 bytes), column
 *          c's codes 4t..4t+3 at 32t + 4c. A byte a code reads 30% more than the file's 6.5 bits
 *          a value, and spares every chunk the 2 loads, 5 shifts and masks and the or that put the
 *          file's low nibble and top 2 bits together: that unpacking, not the memory, set a
 *          decode step's speed on Q6_K.
 *     Q2_K (672 bytes = 8 x 84): d[8] f16, dmin[8] f16, scales[16 halves of 16][8 columns] u8 (the
 *          file's bytes: scale in the low nibble, min in the high), then the 2-bit codes (0..3): 2
 *          sets s of 256 bytes, chunked as Q4_K's pairs, bits 2i, 2i+1 of byte l holding value l
 *          of sub-block 4s + i (set s is the file's qs[32s .. 32s + 31] regrouped).
 *     Q3_K (912 bytes = 8 x 114): d[8] f16, scales[16 halves][8 columns] i8 (the 6-bit scales,
 *          less 32, unpacked to bytes), then the codes as w = q + 4 (0..7: the file's low 2 bits,
 *          and its hmask bit as bit 2) in 3 planes p of 256 bytes, chunked as Q4_K's pairs: byte
 *          l of plane p holds value l's w of sub-block 2p at bits 0-2 and of 2p + 1 at bits 3-5;
 *          bits 6-7 of planes 0 and 1 hold the low 2 bits of sub-blocks 6 and 7, bits 6 and 7 of
 *          plane 2 their bit 2. The file's bits regrouped so that six of the eight
 *          sub-blocks take their codes with one shift and one mask, as Q2_K's do, where the
 *          file's planes cost two loads, two shifts, two masks and an or a chunk.
 *     IQ4_XS (1104 bytes = 8 x 138): d[8] f16, ls[8 sub-blocks][8 columns] i8 (the 6-bit scales
 *          less 32, unpacked to bytes), then per sub-block j 4 chunks t of 32 bytes (128 bytes):
 *          column c's bytes 4t..4t+3 of the sub-block at 32t + 4c, byte i's low nibble value i,
 *          its high nibble value 16 + i (the file's order); a code stands for IQ4_GRID[code]
 *          (quant_blocks.h: ggml's kvalues_iq4nl, -127..113).
 * N is padded to a multiple of 8 with zero columns.
 *
 * Activations: each row quantized once per call to 8-bit blocks of 32 (quant_blocks.h), so
 * each weight sub-block j meets one activation block (codes xq_j, scale dx_j, sx_j = dx_j *
 * sum xq_j, and the integer sum of each half of 16 codes). The arithmetic of output (row,
 * column), on every path and in every tile:
 *     Q4_K: acc = fma(float(sc_j * isum_j), d * dx_j, acc), off = fma(dmin * float(mn_j), sx_j, off)
 *           over the sub-blocks in K order; y = acc - off; isum_j = sum q * xq (q in 0..15)
 *     Q5_K: Q4_K's, with q in 0..31
 *     Q6_K: acc = fma(float(isum_j), d * dx_j, acc) in K order; y = acc;
 *           isum_j = sc_{2j} * sum_{l<16} (q - 32) xq + sc_{2j+1} * sum_{l>=16} (q - 32) xq
 *     Q2_K: acc = fma(float(isum_j), d * dx_j, acc), off = fma(float(msum_j), dmin * dx_j, off)
 *           in K order; y = acc - off; with h the halves of 16 values, q in 0..3,
 *           isum_j = sum_h sc_h sum q xq, msum_j = sum_h mn_h sum xq (sc, mn the nibbles)
 *     Q3_K: acc = fma(float(isum_j), d * dx_j, acc) in K order; y = acc; q = w - 4 in -4..3,
 *           isum_j = sum_h sc_h sum q xq, computed as sum_h sc_h (sum w xq - 4 sum xq)
 *           (the same integer: w in 0..7 needs no sign trick, and the half sums of xq are
 *           Q2_K's)
 *     IQ4_XS: acc = fma(float(isum_j), d * dx_j, acc) in K order; y = acc;
 *           isum_j = ls_j * sum grid[q] xq
 * Every integer is exact (|sc_j isum_j| <= 63 * 32 * 31 * 127 and |isum_j| <= 2 * 128 * 16 *
 * 32 * 127 < 2^24, so the conversions to float are exact too), so the AVX2 path equals the
 * portable one bit for bit wherever fmaf is one instruction, and a row's bits never depend on
 * its tile, its neighbours or the thread split (threads split groups of columns).
 * Int16 headroom: Q4_K sums 8 chunks of maddubs pairs (2 x 15 x 127) per sub-block: 30480;
 * Q5_K, its codes to 31, sums 4 chunks per half (4 x 2 x 31 x 127 = 31496) and widens each;
 * Q6_K moves the sign of q - 32 onto x (|q - 32| <= 32) and sums 4 chunks per 16-value half:
 * 4 x 2 x 32 x 127 = 32512 < 32767. Q2_K and Q3_K sum 4 chunks per half: 4 x 2 x 3 x 127 =
 * 3048 and 4 x 2 x 7 x 127 = 7112; their integers |isum_j| <= 2 x 15 x 16 x 3 x 127 (Q2_K),
 * 2 x 32 x 16 x 4 x 127 (Q3_K) and |msum_j| <= 2 x 15 x 16 x 127 are below 2^24 too, and the
 * half sums of xq (|S| <= 16 x 127) fit the int16 pairs madd multiplies by the per-half mins
 * or scales. IQ4_XS moves the sign of the grid value onto x, as Q6_K does, but a maddubs pair
 * reaches 2 x 127 x 127 = 32258, so each chunk's pairs widen to int32 at once, in the madd that
 * multiplies them by ls_j (|isum_j| <= 32 x 32 x 127 x 127 < 2^24).
 *
 * Tiles: for each sub-block, each 32-byte chunk of codes is unpacked once and met by every row
 * of a tile of up to kx8_tile_rows(fmt) rows, each layout's own height (a decode step's row alone
 * is a tile of one); a row keeps only its integer sums and accumulator (which the compiler may
 * keep on the stack in a tall tile), and Q4_K's offset chain runs as a second loop
 * (the two chains never mix before the final subtraction, so this changes no bit). Q2_K and
 * Q3_K unroll the 8 sub-blocks of a super-block so that every shift that picks a sub-block's
 * bits is a constant: these layouts read fewer bytes than Q4_K, so their unpacking, not the
 * memory, sets their speed. Blocking and threads: column_groups.h's driver.
 */
#include "gemm/column_groups.h"
#include "runtime/isa.h"
#include "nanoserve.h"
#include "quant/quant_blocks.h"
#include "stages/stages.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define NS_KX8_AVX2 1
#endif

enum { KX8_Q4_K = 12, KX8_Q5_K = 13, KX8_Q6_K = 14 }; /* the GGML type numbers */
/* KX8_MAX_TILE: the tallest case of the tile functions (DEFINE_KX8_TILE) */
enum { KX8_COLUMNS = NS_GROUP_COLUMNS, KX8_MAX_TILE = 8 };
enum { Q4_K_CODES = 160, Q5_K_HIGH = 1184, Q6_K_SCALES = 16, Q6_K_CODES = 144 }; /* byte offsets */
enum { KX8_Q2_K = 10, KX8_Q3_K = 11 }; /* the GGML type numbers of the 2- and 3-bit layouts */
enum { Q2_K_DMIN = 16, Q2_K_SCALES = 32, Q2_K_CODES = 160, Q3_K_SCALES = 16, Q3_K_CODES = 144 };
enum { KX8_IQ4_XS = 23, IQ4_XS_SCALES = 16, IQ4_XS_CODES = 80 }; /* its GGML type number, byte offsets */

static int kx8_bytes(int fmt) {
    switch (fmt) {
    case KX8_Q4_K: return 1184;
    case KX8_Q5_K: return 1440;
    case KX8_Q6_K: return 2192;
    case KX8_Q2_K: return 672;
    case KX8_Q3_K: return 912;
    case KX8_IQ4_XS: return 1104;
    default: return 0;
    }
}

/* Rows per tile of each layout (at most KX8_MAX_TILE), measured per layout at 16 rows
 * (results/README.md): a tile shares each chunk's unpacking among its rows, so a taller one pays
 * until its rows' sums no longer fit the 16 registers. Q6_K, Q2_K and Q3_K hold more a row (two
 * sums each, or eight unrolled sub-blocks) and slow down past 3 rows, Q5_K past 4. */
static int kx8_tile_rows(int fmt) {
    switch (fmt) {
    case KX8_Q4_K: return 8;
    case KX8_Q5_K: return 4;
    case KX8_IQ4_XS: return 8;
    default: return 3; /* Q6_K, Q2_K, Q3_K */
    }
}

/* Q2_K and Q3_K: codes of 2 or 3 bits, their own tiles (the kx8_low_bits_* functions). */
static int kx8_low_bit_format(int fmt) { return fmt == KX8_Q2_K || fmt == KX8_Q3_K; }

/* ---- the scalar reference ---------------------------------------------------------------- */

/* Code l of sub-block j (0..7) of column c in a group-super-block: 0..15 (Q4_K), 0..31 (Q5_K),
 * 0..63 (Q6_K). */
static int kx8_code(int fmt, const uint8_t *block, int j, int c, int l) {
    if (fmt == KX8_Q6_K) return block[Q6_K_CODES + 256 * j + 32 * (l / 4) + 4 * c + l % 4];
    const int at = Q4_K_CODES + 256 * (j / 2) + 32 * (l / 4) + 4 * c + l % 4;
    int code = (j & 1) ? block[at] >> 4 : block[at] & 0x0F;
    if (fmt == KX8_Q5_K) code |= ((block[Q5_K_HIGH + 32 * (l / 4) + 4 * c + l % 4] >> j) & 1) << 4;
    return code;
}

static float kx8_output_portable(int fmt, const uint8_t *group, int c, const xblock *x, int64_t blocks) {
    const int bytes = kx8_bytes(fmt);
    float acc = 0.0f, off = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + (b / 8) * bytes;
        const int j = (int)(b % 8);
        const float d = f16_to_f32(block + 2 * c);
        if (fmt == KX8_Q4_K || fmt == KX8_Q5_K) {
            int isum = 0;
            for (int l = 0; l < 32; l++) isum += kx8_code(fmt, block, j, c, l) * x[b].qs[l];
            acc = fmaf((float)(block[32 + 8 * j + c] * isum), d * x[b].d, acc);
            off = fmaf(f16_to_f32(block + 16 + 2 * c) * (float)block[96 + 8 * j + c], x[b].s, off);
        } else {
            int half[2] = {0, 0};
            for (int l = 0; l < 32; l++) half[l / 16] += (kx8_code(fmt, block, j, c, l) - 32) * x[b].qs[l];
            const int8_t *scales = (const int8_t *)block + Q6_K_SCALES;
            int isum = scales[8 * (2 * j) + c] * half[0] + scales[8 * (2 * j + 1) + c] * half[1];
            acc = fmaf((float)isum, d * x[b].d, acc);
        }
    }
    return acc - off;
}

/* Value l's code in sub-block j (0..7) of column c of a group-super-block: Q2_K's q (0..3),
 * Q3_K's w = q + 4 (0..7). */
static int kx8_low_bits_code(int fmt, const uint8_t *block, int j, int c, int l) {
    const int at = 32 * (l / 4) + 4 * c + l % 4;
    if (fmt == KX8_Q2_K) return (block[Q2_K_CODES + 256 * (j / 4) + at] >> (2 * (j % 4))) & 3;
    const uint8_t *planes = block + Q3_K_CODES + at;
    if (j < 6) return (planes[256 * (j / 2)] >> (3 * (j % 2))) & 7;
    return planes[256 * (j - 6)] >> 6 | ((planes[512] >> j) & 1) << 2;
}

/* Q2_K and Q3_K's output (row, column c) by the header's arithmetic, one value at a time. */
static float kx8_low_bits_output_portable(int fmt, const uint8_t *group, int c, const xblock *x,
                                          int64_t blocks) {
    const int bytes = kx8_bytes(fmt);
    float acc = 0.0f, off = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + (b / 8) * bytes;
        const int j = (int)(b % 8);
        int dot[2] = {0, 0}, xsum[2] = {0, 0}; /* per half of 16: sum q xq (Q3_K: w xq), sum xq */
        for (int l = 0; l < 32; l++) {
            dot[l / 16] += kx8_low_bits_code(fmt, block, j, c, l) * x[b].qs[l];
            xsum[l / 16] += x[b].qs[l];
        }
        const float d = f16_to_f32(block + 2 * c);
        if (fmt == KX8_Q2_K) {
            const uint8_t *scales = block + Q2_K_SCALES + 16 * j + c; /* halves 2j and 2j + 1 */
            int isum = (scales[0] & 15) * dot[0] + (scales[8] & 15) * dot[1];
            int msum = (scales[0] >> 4) * xsum[0] + (scales[8] >> 4) * xsum[1];
            acc = fmaf((float)isum, d * x[b].d, acc);
            off = fmaf((float)msum, f16_to_f32(block + Q2_K_DMIN + 2 * c) * x[b].d, off);
        } else {
            const int8_t *scales = (const int8_t *)block + Q3_K_SCALES + 16 * j + c;
            int isum = scales[0] * (dot[0] - 4 * xsum[0]) + scales[8] * (dot[1] - 4 * xsum[1]);
            acc = fmaf((float)isum, d * x[b].d, acc);
        }
    }
    return acc - off;
}

/* IQ4_XS: value l of sub-block j of column c in a group-super-block, through the grid. */
static int iq4_xs_value(const uint8_t *block, int j, int c, int l) {
    const int code = block[IQ4_XS_CODES + 128 * j + 32 * (l % 16 / 4) + 4 * c + l % 4];
    return IQ4_GRID[l < 16 ? code & 0x0F : code >> 4];
}

static float iq4_xs_output_portable(int fmt, const uint8_t *group, int c, const xblock *x, int64_t blocks) {
    (void)fmt;
    float acc = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + (b / 8) * kx8_bytes(KX8_IQ4_XS);
        const int j = (int)(b % 8);
        int isum = 0;
        for (int l = 0; l < 32; l++) isum += iq4_xs_value(block, j, c, l) * x[b].qs[l];
        const int ls = ((const int8_t *)block)[IQ4_XS_SCALES + 8 * j + c];
        acc = fmaf((float)(ls * isum), f16_to_f32(block + 2 * c) * x[b].d, acc);
    }
    return acc;
}

static void kx8_tile_portable(int fmt, int rows, const uint8_t *group, const xblock *x, int64_t blocks, float *y,
                              int64_t n, int valid) {
    float (*output)(int, const uint8_t *, int, const xblock *, int64_t) =
        kx8_low_bit_format(fmt) ? kx8_low_bits_output_portable
        : fmt == KX8_IQ4_XS     ? iq4_xs_output_portable
                                : kx8_output_portable;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < valid; c++) y[r * n + c] = output(fmt, group, c, x + r * blocks, blocks);
}

/* ---- AVX2 -------------------------------------------------------------------------------- */

#ifdef NS_KX8_AVX2
static inline __m256i kx8_broadcast4(const int8_t *p) { /* 4 code bytes into every 32-bit lane */
    int32_t word;
    memcpy(&word, p, 4);
    return _mm256_set1_epi32(word);
}

/* 8 bytes (one per column) -> int16 pairs (v, v) per 32-bit lane: madd's per-column multiplier. */
static inline __m256i kx8_pairs(const uint8_t *bytes, int is_signed) {
    __m128i eight = _mm_loadl_epi64((const __m128i *)bytes);
    __m256i v = is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}

/* Sub-block j's 32-byte chunk t of codes, as unsigned bytes: 0..15 (Q4_K), 0..31 (Q5_K),
 * 0..63 (Q6_K). */
static inline __m256i kx8_chunk(const int fmt, const uint8_t *block, int j, int t) {
    if (fmt == KX8_Q6_K) return _mm256_loadu_si256((const __m256i *)(block + Q6_K_CODES + 256 * j + 32 * t));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i w = _mm256_loadu_si256((const __m256i *)(block + Q4_K_CODES + 256 * (j / 2) + 32 * t));
    __m256i q = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(w, 4) : w, low4);
    if (fmt == KX8_Q5_K) { /* bit j of the fifth bits, as 16 where it is set */
        const __m256i bit = _mm256_set1_epi8((char)(1 << j));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(block + Q5_K_HIGH + 32 * t));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    return q;
}

/* The integer chain of `rows` rows (`blocks` blocks apart) against one group: acc[r]. */
static inline __attribute__((always_inline)) void kx8_products(const int fmt, const int rows, const uint8_t *group,
                                                               const xblock *x, int64_t blocks, __m256 *acc) {
    const int bytes = kx8_bytes(fmt);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + (b / 8) * bytes;
        const int j = (int)(b % 8);
        __m256i isum[KX8_MAX_TILE];
        if (fmt == KX8_Q4_K || fmt == KX8_Q5_K) {
            __m256i sums[KX8_MAX_TILE][2]; /* Q5_K: one per half of 4 chunks (the header's headroom) */
            for (int r = 0; r < rows; r++) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                const __m256i q = kx8_chunk(fmt, block, j, t);
                const int half = fmt == KX8_Q5_K ? t / 4 : 0;
                for (int r = 0; r < rows; r++) {
                    const __m256i xq = kx8_broadcast4(x[r * blocks + b].qs + 4 * t);
                    sums[r][half] = _mm256_add_epi16(sums[r][half], _mm256_maddubs_epi16(q, xq));
                }
            }
            const __m256i sc = kx8_pairs(block + 32 + 8 * j, 0);
            for (int r = 0; r < rows; r++) {
                isum[r] = _mm256_madd_epi16(sums[r][0], sc);
                if (fmt == KX8_Q5_K) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(sums[r][1], sc));
            }
        } else {
            __m256i sums[KX8_MAX_TILE][2];
            for (int r = 0; r < rows; r++) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                /* maddubs multiplies unsigned by signed bytes: the sign of q - 32 moves onto x */
                const __m256i w = _mm256_sub_epi8(kx8_chunk(fmt, block, j, t), _mm256_set1_epi8(32));
                const __m256i magnitude = _mm256_sign_epi8(w, w);
                for (int r = 0; r < rows; r++) {
                    __m256i xs = _mm256_sign_epi8(kx8_broadcast4(x[r * blocks + b].qs + 4 * t), w);
                    sums[r][t / 4] = _mm256_add_epi16(sums[r][t / 4], _mm256_maddubs_epi16(magnitude, xs));
                }
            }
            const __m256i sc0 = kx8_pairs(block + Q6_K_SCALES + 8 * (2 * j), 1);
            const __m256i sc1 = kx8_pairs(block + Q6_K_SCALES + 8 * (2 * j + 1), 1);
            for (int r = 0; r < rows; r++)
                isum[r] = _mm256_add_epi32(_mm256_madd_epi16(sums[r][0], sc0), _mm256_madd_epi16(sums[r][1], sc1));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(x[r * blocks + b].d)),
                                     acc[r]);
    }
}

/* IQ4_XS's chain of `rows` rows against one group: acc[r]. Each chunk's codes go through the
 * grid once for the tile's rows, low nibbles and then high ones, so few registers stay live. */
static inline __attribute__((always_inline)) void iq4_xs_products(const int rows, const uint8_t *group,
                                                                  const xblock *x, int64_t blocks, __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + (b / 8) * kx8_bytes(KX8_IQ4_XS);
        const int j = (int)(b % 8);
        const __m256i ls = kx8_pairs(block + IQ4_XS_SCALES + 8 * j, 1);
        __m256i isum[KX8_MAX_TILE];
        for (int r = 0; r < rows; r++) isum[r] = _mm256_setzero_si256();
        for (int t = 0; t < 4; t++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(block + IQ4_XS_CODES + 128 * j + 32 * t));
            for (int half = 0; half < 2; half++) {
                /* maddubs multiplies unsigned by signed bytes: the grid value's sign moves onto x */
                const __m256i q = iq4_grid_values(_mm256_and_si256(half ? _mm256_srli_epi16(w, 4) : w, low4));
                const __m256i magnitude = _mm256_sign_epi8(q, q);
                for (int r = 0; r < rows; r++) {
                    const int8_t *xq = x[r * blocks + b].qs + 16 * half + 4 * t;
                    __m256i products = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(kx8_broadcast4(xq), q));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(products, ls));
                }
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(x[r * blocks + b].d)),
                                     acc[r]);
    }
}

static inline void kx8_store(float *y, __m256 v, int valid) {
    if (valid == KX8_COLUMNS) {
        _mm256_storeu_ps(y, v);
        return;
    }
    float lanes[KX8_COLUMNS];
    _mm256_storeu_ps(lanes, v);
    memcpy(y, lanes, (size_t)valid * sizeof(float));
}

static inline __attribute__((always_inline)) void kx8_tile_avx2(const int fmt, const int rows, const uint8_t *group,
                                                                const xblock *x, int64_t blocks, float *y, int64_t n,
                                                                int valid) {
    __m256 acc[KX8_MAX_TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    if (fmt == KX8_IQ4_XS)
        iq4_xs_products(rows, group, x, blocks, acc);
    else
        kx8_products(fmt, rows, group, x, blocks, acc);
    if (fmt == KX8_Q4_K || fmt == KX8_Q5_K) {
        __m256 off[KX8_MAX_TILE];
        for (int r = 0; r < rows; r++) off[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *block = group + (b / 8) * kx8_bytes(fmt);
            const int j = (int)(b % 8);
            const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 96 + 8 * j))));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16)));
            const __m256 m = _mm256_mul_ps(dmin, mn);
            for (int r = 0; r < rows; r++) off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[r * blocks + b].s), off[r]);
        }
        for (int r = 0; r < rows; r++) acc[r] = _mm256_sub_ps(acc[r], off[r]);
    }
    for (int r = 0; r < rows; r++) kx8_store(y + r * n, acc[r], valid);
}

/* ---- Q2_K and Q3_K, AVX2 ------------------------------------------------------------------- */

/* Shuffles of the 16 scale bytes of halves 2j (bytes 0..7, one per column) and 2j + 1 (8..15),
 * broadcast to both 128-bit lanes, into an int16 pair per column's 32-bit lane: bytes (A + c,
 * B + c) at the bottom of their int16 (LOW: zero-extended) or at the top (HIGH: an arithmetic
 * shift right by 8 then sign-extends them). */
#define KX8_LOW(a, b) a, -1, b, -1
#define KX8_HIGH(a, b) -1, a, -1, b
#define KX8_SCALE_SHUFFLE(PAIR, A, B)                                                                   \
    _mm256_setr_epi8(PAIR(A, B), PAIR(A + 1, B + 1), PAIR(A + 2, B + 2), PAIR(A + 3, B + 3),            \
                     PAIR(A + 4, B + 4), PAIR(A + 5, B + 5), PAIR(A + 6, B + 6), PAIR(A + 7, B + 7))

/* The 16 scale bytes of sub-block j's halves, in both 128-bit lanes. */
static inline __m256i kx8_half_scales(const uint8_t *block, int offset, int j) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(block + offset + 16 * j)));
}

/* An activation block's (sum of codes 0..15, of 16..31) as an int16 pair in every 32-bit lane. */
static inline __m256i kx8_half_sums(const xblock *xb) {
    int32_t pair;
    memcpy(&pair, xb->half_sums, 4);
    return _mm256_set1_epi32(pair);
}

/* Sub-block j's 32-byte chunk t of codes as unsigned bytes: Q2_K's q in 0..3, Q3_K's w in 0..7. */
static inline __attribute__((always_inline)) __m256i kx8_low_bits_chunk(const int fmt, const uint8_t *block,
                                                                         const int j, int t) {
#define KX8_CHUNK(offset) _mm256_loadu_si256((const __m256i *)(block + (offset) + 32 * t))
    if (fmt == KX8_Q2_K)
        return _mm256_and_si256(_mm256_srli_epi16(KX8_CHUNK(Q2_K_CODES + 256 * (j / 4)), 2 * (j % 4)),
                                _mm256_set1_epi8(3));
    if (j < 6)
        return _mm256_and_si256(_mm256_srli_epi16(KX8_CHUNK(Q3_K_CODES + 256 * (j / 2)), 3 * (j % 2)),
                                _mm256_set1_epi8(7));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(KX8_CHUNK(Q3_K_CODES + 256 * (j - 6)), 6),
                                         _mm256_set1_epi8(3));
    return _mm256_or_si256(low, _mm256_and_si256(_mm256_srli_epi16(KX8_CHUNK(Q3_K_CODES + 512), j - 2),
                                                 _mm256_set1_epi8(4)));
#undef KX8_CHUNK
}

/* Sub-block j (activation block b) against `rows` rows: the header's acc chain. isum runs half
 * by half, so a row holds one int16 sum and one int32 sum. */
static inline __attribute__((always_inline)) void kx8_low_bits_sub_block(const int fmt, const int rows,
                                                                          const uint8_t *block, const int j,
                                                                          const xblock *x, int64_t blocks,
                                                                          int64_t b, __m256 *acc) {
    const __m256i scale_bytes = kx8_half_scales(block, fmt == KX8_Q2_K ? Q2_K_SCALES : Q3_K_SCALES, j);
    __m256i isum[KX8_MAX_TILE];
    for (int r = 0; r < rows; r++) isum[r] = _mm256_setzero_si256();
    for (int half = 0; half < 2; half++) {
        __m256i sums[KX8_MAX_TILE];
        for (int r = 0; r < rows; r++) sums[r] = _mm256_setzero_si256();
        for (int t = 4 * half; t < 4 * half + 4; t++) {
            const __m256i q = kx8_low_bits_chunk(fmt, block, j, t);
            for (int r = 0; r < rows; r++) {
                const __m256i xq = kx8_broadcast4(x[r * blocks + b].qs + 4 * t);
                sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(q, xq));
            }
        }
        const __m256i sc = fmt == KX8_Q2_K
            ? _mm256_and_si256(_mm256_shuffle_epi8(scale_bytes, half ? KX8_SCALE_SHUFFLE(KX8_LOW, 8, 8)
                                                                     : KX8_SCALE_SHUFFLE(KX8_LOW, 0, 0)),
                               _mm256_set1_epi16(0x0F))
            : _mm256_srai_epi16(_mm256_shuffle_epi8(scale_bytes, half ? KX8_SCALE_SHUFFLE(KX8_HIGH, 8, 8)
                                                                      : KX8_SCALE_SHUFFLE(KX8_HIGH, 0, 0)), 8);
        for (int r = 0; r < rows; r++)
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(sums[r], sc));
    }
    if (fmt == KX8_Q3_K) { /* less 4 sum_h sc_h sum xq */
        const __m256i scales =
            _mm256_srai_epi16(_mm256_shuffle_epi8(scale_bytes, KX8_SCALE_SHUFFLE(KX8_HIGH, 0, 8)), 8);
        for (int r = 0; r < rows; r++) {
            const __m256i weighted = _mm256_madd_epi16(scales, kx8_half_sums(x + r * blocks + b));
            isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(weighted, 2));
        }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
    for (int r = 0; r < rows; r++) {
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x[r * blocks + b].d));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
    }
}

/* Q2_K's offset chain, its own loop as Q4_K's: off = fma(float(msum_j), dmin * dx_j, off). */
static inline __attribute__((always_inline)) void kx8_q2_k_offsets(const int rows, const uint8_t *group,
                                                                   const xblock *x, int64_t blocks, __m256 *off) {
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + (b / 8) * kx8_bytes(KX8_Q2_K);
        const __m256i scale_bytes = kx8_half_scales(block, Q2_K_SCALES, (int)(b % 8));
        const __m256i mins = _mm256_srli_epi16(_mm256_shuffle_epi8(scale_bytes, KX8_SCALE_SHUFFLE(KX8_LOW, 0, 8)), 4);
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + Q2_K_DMIN)));
        for (int r = 0; r < rows; r++) {
            const xblock *xb = x + r * blocks + b;
            const __m256i msum = _mm256_madd_epi16(mins, kx8_half_sums(xb));
            off[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, _mm256_set1_ps(xb->d)), off[r]);
        }
    }
}

static inline __attribute__((always_inline)) void kx8_low_bits_tile_avx2(const int fmt, const int rows,
                                                                         const uint8_t *group, const xblock *x,
                                                                         int64_t blocks, float *y, int64_t n,
                                                                         int valid) {
    __m256 acc[KX8_MAX_TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 8) {
        const uint8_t *block = group + (b / 8) * kx8_bytes(fmt);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) kx8_low_bits_sub_block(fmt, rows, block, j, x, blocks, b + j, acc);
    }
    if (fmt == KX8_Q2_K) {
        __m256 off[KX8_MAX_TILE];
        for (int r = 0; r < rows; r++) off[r] = _mm256_setzero_ps();
        kx8_q2_k_offsets(rows, group, x, blocks, off);
        for (int r = 0; r < rows; r++) acc[r] = _mm256_sub_ps(acc[r], off[r]);
    }
    for (int r = 0; r < rows; r++) kx8_store(y + r * n, acc[r], valid);
}

/* One function per (format, tile height), both constants, so the tile's registers are named; the
 * heights past the layout's own are never called and fold away. */
#define KX8_TILE_CASE(BODY, FMT, ROWS)                                  \
    if (ROWS <= kx8_tile_rows(FMT) && rows == ROWS) {                   \
        BODY(FMT, ROWS, group, x, blocks, y, n, valid);                 \
        return;                                                         \
    }
#define DEFINE_KX8_TILE(NAME, BODY, FMT)                                                                \
    static void NAME(int fmt, int rows, const uint8_t *group, const xblock *x, int64_t blocks, float *y, \
                     int64_t n, int valid) {                                                            \
        (void)fmt;                                                                                      \
        KX8_TILE_CASE(BODY, FMT, 8)                                                                     \
        KX8_TILE_CASE(BODY, FMT, 7)                                                                     \
        KX8_TILE_CASE(BODY, FMT, 6)                                                                     \
        KX8_TILE_CASE(BODY, FMT, 5)                                                                     \
        KX8_TILE_CASE(BODY, FMT, 4)                                                                     \
        KX8_TILE_CASE(BODY, FMT, 3)                                                                     \
        KX8_TILE_CASE(BODY, FMT, 2)                                                                     \
        for (int r = 0; r < rows; r++) BODY(FMT, 1, group, x + r * blocks, blocks, y + r * n, n, valid); \
    }
DEFINE_KX8_TILE(kx8_tile_avx2_q4_k, kx8_tile_avx2, KX8_Q4_K)
DEFINE_KX8_TILE(kx8_tile_avx2_q5_k, kx8_tile_avx2, KX8_Q5_K)
DEFINE_KX8_TILE(kx8_tile_avx2_q6_k, kx8_tile_avx2, KX8_Q6_K)
DEFINE_KX8_TILE(kx8_tile_avx2_q2_k, kx8_low_bits_tile_avx2, KX8_Q2_K)
DEFINE_KX8_TILE(kx8_tile_avx2_q3_k, kx8_low_bits_tile_avx2, KX8_Q3_K)
DEFINE_KX8_TILE(kx8_tile_avx2_iq4_xs, kx8_tile_avx2, KX8_IQ4_XS)
#endif

/* ---- the entry points -------------------------------------------------------------------- */

/* The widest tile compiled in for a layout. */
static ns_group_tile kx8_best_tile(int fmt) {
#ifdef NS_KX8_AVX2
    switch (fmt) {
    case KX8_Q4_K: return kx8_tile_avx2_q4_k;
    case KX8_Q5_K: return kx8_tile_avx2_q5_k;
    case KX8_Q6_K: return kx8_tile_avx2_q6_k;
    case KX8_Q2_K: return kx8_tile_avx2_q2_k;
    case KX8_Q3_K: return kx8_tile_avx2_q3_k;
    case KX8_IQ4_XS: return kx8_tile_avx2_iq4_xs;
    }
#endif
    (void)fmt;
    return kx8_tile_portable;
}

int ns_kx8_layout(int fmt) { return kx8_bytes(fmt) != 0; }

/* The driver's description of this layout with `tile`, for a K of k values, with ISA `isa`'s
 * wide tile where it has one (isa.h). */
static ns_group_layout kx8_layout(ns_group_tile tile, int fmt, int64_t k, int isa) {
    return ns_group_layout_on((ns_group_layout){tile, fmt, kx8_tile_rows(fmt), k / 256 * kx8_bytes(fmt)}, isa);
}

void ns_stage_kx8_strided(int fmt, const xblock *xq, const uint8_t *w, float *y, int64_t y_stride, int64_t rows,
                          int64_t n, int64_t k, int thread, int threads) {
    const ns_group_layout layout = kx8_layout(kx8_best_tile(fmt), fmt, k, ns_isa_best());
    ns_column_groups(&layout, xq, w, y, y_stride, rows, n, k, thread, threads);
}

/* y [rows, n] = x [rows, k] @ W^T for W [n, k] repacked (fmt 12: Q4_K, 13: Q5_K, 14: Q6_K,
 * 10: Q2_K, 11: Q3_K, 23: IQ4_XS) on ISA `isa` (isa.h; the portable one quantizes x in plain C
 * too). Returns 0, -1 for an unknown layout, k not whole super-blocks of 256 or an ISA that does
 * not run here, -2 when out of memory. */
NS_EXPORT int ns_matmul_kx8_isa(int isa, int fmt, const float *x, const uint8_t *w, float *y, int64_t rows, int64_t n,
                                int64_t k, int num_threads) {
    if (kx8_bytes(fmt) == 0 || k % 256 != 0 || !ns_isa_runs(isa)) return -1;
    const int portable = isa == NS_ISA_PORTABLE;
    const ns_group_layout layout = kx8_layout(portable ? kx8_tile_portable : kx8_best_tile(fmt), fmt, k, isa);
    return ns_matmul_column_groups(&layout, portable ? quantize_row_portable : quantize_row, x, w, y, rows, n, k,
                                   num_threads);
}

/* ns_matmul_kx8_isa on the widest ISA that runs here. */
NS_EXPORT int ns_matmul_kx8(int fmt, const float *x, const uint8_t *w, float *y, int64_t rows, int64_t n, int64_t k,
                            int num_threads) {
    return ns_matmul_kx8_isa(ns_isa_best(), fmt, x, w, y, rows, n, k, num_threads);
}

/* ---- row lookups: a tied head's table serving the embedding -------------------------------- */

/* Value l of 32-value sub-block j of column c, rounded as nanoserve/quant.py's dequantizer rounds
 * it (scale = d * sc first, then scale * q less the offset: no fused multiply-add). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static float kx8_value(int fmt, const uint8_t *block, int j, int c, int l) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    const float d = f16_to_f32(block + 2 * c);
    switch (fmt) {
    case KX8_Q4_K:
    case KX8_Q5_K: {
        const float scale = d * (float)block[32 + 8 * j + c], offset = f16_to_f32(block + 16 + 2 * c) * (float)block[96 + 8 * j + c];
        return scale * (float)kx8_code(fmt, block, j, c, l) - offset;
    }
    case KX8_Q6_K:
        return d * (float)((const int8_t *)block)[Q6_K_SCALES + 8 * (2 * j + l / 16) + c] *
               (float)(kx8_code(fmt, block, j, c, l) - 32);
    case KX8_Q2_K: {
        const uint8_t sc = block[Q2_K_SCALES + 8 * (2 * j + l / 16) + c];
        const float scale = d * (float)(sc & 15), offset = f16_to_f32(block + Q2_K_DMIN + 2 * c) * (float)(sc >> 4);
        return scale * (float)kx8_low_bits_code(fmt, block, j, c, l) - offset;
    }
    case KX8_Q3_K:
        return d * (float)((const int8_t *)block)[Q3_K_SCALES + 8 * (2 * j + l / 16) + c] *
               (float)(kx8_low_bits_code(fmt, block, j, c, l) - 4);
    default: /* IQ4_XS */
        return d * (float)((const int8_t *)block)[IQ4_XS_SCALES + 8 * j + c] * (float)iq4_xs_value(block, j, c, l);
    }
}

/* Row `id` of the repacked W, dequantized into row [k]. */
static void kx8_lookup_row(int fmt, const uint8_t *w, int64_t id, int64_t k, float *row) {
    const int64_t blocks = k / 32;
    const uint8_t *group = w + id / KX8_COLUMNS * (k / 256 * kx8_bytes(fmt));
    const int c = (int)(id % KX8_COLUMNS);
    for (int64_t b = 0; b < blocks; b++)
        for (int l = 0; l < 32; l++) row[32 * b + l] = kx8_value(fmt, group + b / 8 * kx8_bytes(fmt), (int)(b % 8), c, l);
}

/* out [count, k] = rows ids[i] of the repacked W [n, k], dequantized (a tied head's table
 * serving the embedding lookups, so the table is resident once). Returns 0, -1 as
 * ns_matmul_kx8, or -3 for an id outside [0, n). */
NS_EXPORT int ns_dequantize_rows_kx8(int fmt, const uint8_t *w, const int64_t *ids, int64_t count, int64_t n,
                                     int64_t k, float *out, int num_threads) {
    if (kx8_bytes(fmt) == 0 || k % 256 != 0) return -1;
    return ns_lookup_rows(kx8_lookup_row, fmt, w, ids, count, n, k, out, num_threads);
}

/* The scalar reference, for the tests to hold the vector paths against (bit for bit). */
NS_EXPORT int ns_matmul_kx8_portable(int fmt, const float *x, const uint8_t *w, float *y, int64_t rows, int64_t n,
                                     int64_t k, int num_threads) {
    return ns_matmul_kx8_isa(NS_ISA_PORTABLE, fmt, x, w, y, rows, n, k, num_threads);
}
