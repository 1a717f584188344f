/* Tiled (flash-style) attention over the paged KV cache, for decode rows and prompt chunks alike.
 *
 * Every query row attends over its own sequence's slots [first, last] (last: its position, or
 * where the caller gives visible_ends the last slot of the bidirectional image it lies in;
 * first: 0, or its position's window's start), read in place through its block table in the cache's own
 * dtype (float32, float16, bfloat16, or q8_0 codes with one float32 scale a row), converted to
 * float32 one K or V row at a time as a tile reads it: the cache is never expanded.
 *
 * The arithmetic of one (row, query head), fixed by the positions alone:
 * - The context is cut into PARTITIONS of NS_ATTN_PARTITION slots at absolute offsets, each
 *   into TILES of NS_ATTN_TILE slots; both clipped to [first, last].
 * - A partition runs an online softmax over its tiles in order: the tile's scores (q scaled,
 *   dotted with each K row: 16 lanes of fused multiply-adds over the head dimension, zero
 *   padded to a multiple of 16, the lanes then summed pairwise l + l+8, l + l+4, l + l+2,
 *   l + l+1), optionally soft-capped, the running max raised, the running sum and the values'
 *   accumulator rescaled by exp(old max - new max), the tile's weights summed in 16 lanes the
 *   same way, and its exp-weighted V rows added slot by slot with fused multiply-adds.
 * - The partitions' (max, sum, accumulator) are merged in partition order.
 * So a row's bits depend on its q, its context and its position only: not on the other rows of
 * the call (decode rows, a prompt chunk's rows, a crowd), nor on the thread count, nor on
 * whether a prefill chunk or a decode step computed it (preemption by recompute keeps tokens).
 *
 * Work: a ROW BLOCK is up to NS_ATTN_QUERIES / group consecutive rows of one sequence (a decode
 * row is a block of its own), whose GQA query heads share each K/V row as it is loaded and
 * converted: the heads of one row (up to NS_ATTN_GROUP at a time) read a tile's rows straight
 * from the cache, each key's chunks converted once into every head's lanes (eight keys at a
 * time on AVX-512, two or four on AVX2, one on the reference) and each V row's chunks once into
 * every head's accumulator; no float32 copy of the tile is kept. A decode row's unit is (K/V
 * head, partition), so a single long row still spreads over every thread; its partitions'
 * results are merged after a barrier, one (row, query head) a unit. A prompt chunk's block is
 * one unit per K/V head that runs its partitions in turn and merges them itself, in the same
 * order with the same function (no results kept across threads). Units are dealt to the
 * threads in turn.
 *
 * Three paths, one arithmetic: the portable C reference, AVX2 (+FMA, F16C) and AVX-512F, each
 * compiled with its target attribute and chosen at run time from cpuid (ns_attention_isas says
 * which this CPU runs). Every vector operation is an exactly rounded IEEE operation on the same
 * operands in the same order as the reference (the 16 lanes of the reference are two 8-lane
 * registers on AVX2 and one on AVX-512; AVX-512 sums eight keys' lanes at once over shuffled
 * registers, each key by the same pairs), so the three agree bit for bit
 * (tests/test_native_attention.py). Contraction is off in this file: the compiler may not fuse
 * a multiply and an add the reference keeps apart. A head dimension that is not a multiple of 16 runs the
 * reference (the same bits, slower).
 */
#pragma GCC optimize("fp-contract=off")

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nanoserve.h"
#include "stages/stages.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define NS_ATTN_X86 1
#endif

#define NS_ATTN_LANES 16
/* Query vectors (rows x the query heads of one K/V head) that share one tile's K/V rows. */
#define NS_ATTN_QUERIES 32

/* ---------------------------------------------------------------- scalar helpers (every path) */

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* exp(x) as the vector paths compute it (Cephes' expf, ops.c's exp256): x clamped to
 * [-87.34, 88.38], x = n ln2 + r with ln2 in two parts, a degree-5 polynomial, 2^n by the
 * exponent bits. Each step one rounded operation, so each lane of a vector equals this. */
#define EXP_HI 88.3762626647949f
#define EXP_LO (-87.3365447504f)
#define EXP_LOG2E 1.44269504088896341f
#define EXP_C1 0.693359375f
#define EXP_C2 (-2.12194440e-4f)
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

static inline float exp_reference(float x) {
    x = fminf(fmaxf(x, EXP_LO), EXP_HI);
    float n = nearbyintf(x * EXP_LOG2E);
    float r = fmaf(-n, EXP_C1, x);
    r = fmaf(-n, EXP_C2, r);
    float p = EXP_P0;
    p = fmaf(p, r, EXP_P1);
    p = fmaf(p, r, EXP_P2);
    p = fmaf(p, r, EXP_P3);
    p = fmaf(p, r, EXP_P4);
    p = fmaf(p, r, EXP_P5);
    p = fmaf(p, r * r, r + 1.0f);
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* ---------------------------------------------------------------- the cache and one tile */

typedef struct {
    ns_kv_rows k, v;             /* [kv_heads, cache_slots, dim] rows in their dtype */
    const int64_t *block_tables; /* [seqs, table_width] */
    int64_t table_width, block_size, cache_slots, dim;
} AttnCache;

/* A tile's K or V rows where the cache holds them: row j at rows[j], `dim` values in `dtype`,
 * with scales[j] for q8_0. */
typedef struct {
    const void *rows[NS_ATTN_TILE];
    float scales[NS_ATTN_TILE];
    int dtype;
    int64_t dim;
} CacheTile;

/* The most query vectors one call of scores / accumulate takes: three accumulators a key for
 * eight keys fill 24 of AVX-512's 32 vector registers (a default model's K/V head serves three). */
#define NS_ATTN_GROUP 3

/* One instance per (dtype, group size), so each body's switch and loops fold away. */
#define NS_ATTN_EACH_GROUP(body, dtype, group, ...)                                                              \
    switch (dtype * 4 + (int)group) {                                                                          \
    case NS_KV_F32 * 4 + 1: body(NS_KV_F32, 1, __VA_ARGS__); break;                                            \
    case NS_KV_F32 * 4 + 2: body(NS_KV_F32, 2, __VA_ARGS__); break;                                            \
    case NS_KV_F32 * 4 + 3: body(NS_KV_F32, 3, __VA_ARGS__); break;                                            \
    case NS_KV_F16 * 4 + 1: body(NS_KV_F16, 1, __VA_ARGS__); break;                                            \
    case NS_KV_F16 * 4 + 2: body(NS_KV_F16, 2, __VA_ARGS__); break;                                            \
    case NS_KV_F16 * 4 + 3: body(NS_KV_F16, 3, __VA_ARGS__); break;                                            \
    case NS_KV_BF16 * 4 + 1: body(NS_KV_BF16, 1, __VA_ARGS__); break;                                          \
    case NS_KV_BF16 * 4 + 2: body(NS_KV_BF16, 2, __VA_ARGS__); break;                                          \
    case NS_KV_BF16 * 4 + 3: body(NS_KV_BF16, 3, __VA_ARGS__); break;                                          \
    case NS_KV_Q8_0 * 4 + 1: body(NS_KV_Q8_0, 1, __VA_ARGS__); break;                                          \
    case NS_KV_Q8_0 * 4 + 2: body(NS_KV_Q8_0, 2, __VA_ARGS__); break;                                          \
    default: body(NS_KV_Q8_0, 3, __VA_ARGS__); break;                                                          \
    }

/* What differs between the paths. Query vector q / accumulator acc: `padded` floats (the
 * head dimension rounded up to 16 lanes, zeros past dim; a tile's rows read as zeros there too).
 * - scores: for each of `group` (<= NS_ATTN_GROUP) query vectors that share [begin, end),
 *   scores[j] = q . keys[j] for j in [begin, end): each key's values multiplied into 16 lanes
 *   of fused multiply-adds over the head dimension, the lanes then summed pairwise l + l+8,
 *   l + l+4, l + l+2, l + l+1 (slots past `end` inside the last 16 may be written too:
 *   scratch the caller does not read). Vectors `padded` apart, their scores NS_ATTN_TILE apart.
 * - exp_shifted: x = exp(x - shift), in place.
 * - sum: the sum of x[0..n) in 16 lanes (x[i] into lane i % 16, in order), the lanes then
 *   summed pairwise as a dot product's.
 * - max: the largest of x[0..n) (n >= 1; exact in any order).
 * - accumulate: for each of `group` vectors, acc += p[j] * values[j] for j in [begin, end), in
 *   order (weights NS_ATTN_TILE apart, accumulators `padded` apart).
 * Each K or V row is read from the cache (and converted) once for the group. */
typedef struct {
    void (*scores)(const float *q, int64_t group, const CacheTile *keys, int64_t begin, int64_t end, int64_t padded,
                   float *scores);
    void (*exp_shifted)(float *x, float shift, int64_t n);
    float (*sum)(const float *x, int64_t n);
    float (*max)(const float *x, int64_t n);
    void (*accumulate)(const float *p, int64_t group, const CacheTile *values, int64_t begin, int64_t end,
                       int64_t padded, float *acc);
} AttnIsa;

/* ---------------------------------------------------------------- the portable reference */

/* Row j of a tile as float32, zeros from dim to padded. */
static void row_reference(const CacheTile *t, int64_t j, int64_t padded, float *out) {
    for (int64_t i = 0; i < t->dim; i++) {
        switch (t->dtype) {
        case NS_KV_F32:
            out[i] = ((const float *)t->rows[j])[i];
            break;
        case NS_KV_F16:
            out[i] = half_to_float(((const uint16_t *)t->rows[j])[i]);
            break;
        case NS_KV_BF16:
            out[i] = bf16_to_float(((const uint16_t *)t->rows[j])[i]);
            break;
        default: /* q8_0 */
            out[i] = (float)((const int8_t *)t->rows[j])[i] * t->scales[j];
        }
    }
    for (int64_t i = t->dim; i < padded; i++) out[i] = 0.0f;
}

static float lanes_sum_reference(float *lanes) {
    for (int half = NS_ATTN_LANES / 2; half >= 1; half /= 2)
        for (int l = 0; l < half; l++) lanes[l] = lanes[l] + lanes[l + half];
    return lanes[0];
}

static void scores_reference(const float *q, int64_t group, const CacheTile *keys, int64_t begin, int64_t end,
                             int64_t padded, float *scores) {
    float key[padded];
    for (int64_t j = begin; j < end; j++) {
        row_reference(keys, j, padded, key);
        for (int64_t g = 0; g < group; g++) {
            float lanes[NS_ATTN_LANES] = {0};
            for (int64_t c = 0; c < padded; c += NS_ATTN_LANES)
                for (int l = 0; l < NS_ATTN_LANES; l++) lanes[l] = fmaf(q[g * padded + c + l], key[c + l], lanes[l]);
            scores[g * NS_ATTN_TILE + j] = lanes_sum_reference(lanes);
        }
    }
}

static void exp_shifted_reference(float *x, float shift, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = exp_reference(x[i] - shift);
}

static float sum_reference(const float *x, int64_t n) {
    float lanes[NS_ATTN_LANES] = {0};
    for (int64_t i = 0; i < n; i++) lanes[i % NS_ATTN_LANES] = lanes[i % NS_ATTN_LANES] + x[i];
    return lanes_sum_reference(lanes);
}

static float max_reference(const float *x, int64_t n) {
    float largest = x[0];
    for (int64_t i = 1; i < n; i++) largest = x[i] > largest ? x[i] : largest;
    return largest;
}

static void accumulate_reference(const float *p, int64_t group, const CacheTile *values, int64_t begin,
                                 int64_t end, int64_t padded, float *acc) {
    float value[padded];
    for (int64_t j = begin; j < end; j++) {
        row_reference(values, j, padded, value);
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < padded; i++)
                acc[g * padded + i] = fmaf(p[g * NS_ATTN_TILE + j], value[i], acc[g * padded + i]);
    }
}

static const AttnIsa REFERENCE = {scores_reference, exp_shifted_reference, sum_reference, max_reference,
                                  accumulate_reference};

#ifdef NS_ATTN_X86
/* ---------------------------------------------------------------- AVX2 + FMA + F16C */

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

/* The 16 lanes lo (0-7) and hi (8-15) summed as lanes_sum_reference sums them. */
AVX2_TARGET static inline float lanes_sum_avx2(__m256 lo, __m256 hi) {
    __m256 s8 = _mm256_add_ps(lo, hi); /* l + l+8 */
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

AVX2_TARGET static inline __m256 exp8_avx2(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C1), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C2), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

AVX2_TARGET static void exp_shifted_avx2(float *x, float shift, int64_t n) {
    const __m256 s = _mm256_set1_ps(shift);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
    for (; i < n; i++) x[i] = exp_reference(x[i] - shift);
}

AVX2_TARGET static float sum_avx2(const float *x, int64_t n) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(x + i));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(x + i + 8));
    }
    if (i < n) { /* the tail's lanes add zeros: x + 0 is x */
        float tail[16] = {0};
        memcpy(tail, x + i, (size_t)(n - i) * sizeof(float));
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(tail));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(tail + 8));
    }
    return lanes_sum_avx2(lo, hi);
}

AVX2_TARGET static float max_avx2(const float *x, int64_t n) {
    __m256 largest = _mm256_set1_ps(x[0]);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) largest = _mm256_max_ps(largest, _mm256_loadu_ps(x + i));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    float result = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    for (; i < n; i++) result = x[i] > result ? x[i] : result;
    return result;
}

/* 8 values of a tile's row j from value i on, converted as row_reference converts them. */
AVX2_TARGET static inline __attribute__((always_inline)) __m256 tile8_avx2(const CacheTile *t, int dtype, int64_t j,
                                                                          int64_t i) {
    switch (dtype) {
    case NS_KV_F32:
        return _mm256_loadu_ps((const float *)t->rows[j] + i);
    case NS_KV_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)t->rows[j] + i)));
    case NS_KV_BF16: {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)t->rows[j] + i)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    default: {
        __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)t->rows[j] + i)));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(t->scales[j]));
    }
    }
}

/* scores for `group` vectors of a `dtype` tile: two keys at a time (four for one
 * vector: the 16 registers hold 8 two-register accumulators), each key's chunk converted once
 * and multiplied into every vector's lanes. */
AVX2_TARGET static inline __attribute__((always_inline)) void scores_tile_avx2(
        int dtype, int group, const float *q, const CacheTile *keys, int64_t begin, int64_t end, int64_t padded,
        float *scores) {
    const int step = group == 1 ? 4 : 2;
    for (int64_t j = begin; j < end; j += step) {
        const int64_t count = end - j < step ? end - j : step;
        int64_t key[4];
        for (int t = 0; t < step; t++) key[t] = j + (t < count ? t : 0);
        __m256 lo[NS_ATTN_GROUP][4], hi[NS_ATTN_GROUP][4];
        for (int g = 0; g < group; g++)
            for (int t = 0; t < step; t++) lo[g][t] = hi[g][t] = _mm256_setzero_ps();
        for (int64_t c = 0; c < padded; c += 16)
            for (int t = 0; t < step; t++) {
                const __m256 k_lo = tile8_avx2(keys, dtype, key[t], c), k_hi = tile8_avx2(keys, dtype, key[t], c + 8);
                for (int g = 0; g < group; g++) {
                    lo[g][t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * padded + c), k_lo, lo[g][t]);
                    hi[g][t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * padded + c + 8), k_hi, hi[g][t]);
                }
            }
        for (int g = 0; g < group; g++)
            for (int t = 0; t < count; t++) scores[g * NS_ATTN_TILE + j + t] = lanes_sum_avx2(lo[g][t], hi[g][t]);
    }
}

/* accumulate for `group` vectors of a `dtype` tile: 16 values a pass, each V row's two
 * chunks converted once and added into every vector's accumulator. */
AVX2_TARGET static inline __attribute__((always_inline)) void accumulate_tile_avx2(
        int dtype, int group, const float *p, const CacheTile *values, int64_t begin, int64_t end, int64_t padded,
        float *acc) {
    for (int64_t c = 0; c < padded; c += 16) {
        __m256 lo[NS_ATTN_GROUP], hi[NS_ATTN_GROUP];
        for (int g = 0; g < group; g++) {
            lo[g] = _mm256_loadu_ps(acc + g * padded + c);
            hi[g] = _mm256_loadu_ps(acc + g * padded + c + 8);
        }
        for (int64_t j = begin; j < end; j++) {
            const __m256 v_lo = tile8_avx2(values, dtype, j, c), v_hi = tile8_avx2(values, dtype, j, c + 8);
            for (int g = 0; g < group; g++) {
                const __m256 w = _mm256_set1_ps(p[g * NS_ATTN_TILE + j]);
                lo[g] = _mm256_fmadd_ps(w, v_lo, lo[g]);
                hi[g] = _mm256_fmadd_ps(w, v_hi, hi[g]);
            }
        }
        for (int g = 0; g < group; g++) {
            _mm256_storeu_ps(acc + g * padded + c, lo[g]);
            _mm256_storeu_ps(acc + g * padded + c + 8, hi[g]);
        }
    }
}

AVX2_TARGET static void scores_group_avx2(const float *q, int64_t group, const CacheTile *keys, int64_t begin,
                                          int64_t end, int64_t padded, float *scores) {
    NS_ATTN_EACH_GROUP(scores_tile_avx2, keys->dtype, group, q, keys, begin, end, padded, scores)
}

AVX2_TARGET static void accumulate_group_avx2(const float *p, int64_t group, const CacheTile *values, int64_t begin,
                                              int64_t end, int64_t padded, float *acc) {
    NS_ATTN_EACH_GROUP(accumulate_tile_avx2, values->dtype, group, p, values, begin, end, padded, acc)
}

static const AttnIsa AVX2 = {scores_group_avx2, exp_shifted_avx2, sum_avx2, max_avx2, accumulate_group_avx2};

/* ---------------------------------------------------------------- AVX-512F */

#define AVX512_TARGET __attribute__((target("avx512f,avx2,fma,f16c")))

/* Lanes x[0..8) + x[8..16) of two vectors at once: [x's, y's] (each its l + l+8). */
AVX512_TARGET static inline __m512 fold8_avx512(__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
}

AVX512_TARGET static inline float lanes_sum_avx512(__m512 acc) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

AVX512_TARGET static inline __m512 exp16_avx512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_C1), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_C2), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

AVX512_TARGET static void exp_shifted_avx512(float *x, float shift, int64_t n) {
    const __m512 s = _mm512_set1_ps(shift);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 live = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(x + i, live, exp16_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, x + i), s)));
    }
}

AVX512_TARGET static float sum_avx512(const float *x, int64_t n) {
    __m512 lanes = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) { /* the tail's lanes add zeros: x + 0 is x */
        const __mmask16 live = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        lanes = _mm512_add_ps(lanes, _mm512_maskz_loadu_ps(live, x + i));
    }
    return lanes_sum_avx512(lanes);
}

AVX512_TARGET static float max_avx512(const float *x, int64_t n) {
    __m512 largest = _mm512_set1_ps(x[0]);
    for (int64_t i = 0; i < n; i += 16) { /* the tail's lanes hold x[0] again */
        const __mmask16 live = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        largest = _mm512_max_ps(largest, _mm512_mask_loadu_ps(_mm512_set1_ps(x[0]), live, x + i));
    }
    return _mm512_reduce_max_ps(largest);
}

/* 16 values of a tile's row j from value i on, converted as row_reference converts them. */
AVX512_TARGET static inline __attribute__((always_inline)) __m512 tile16_avx512(const CacheTile *t, int dtype,
                                                                                int64_t j, int64_t i) {
    switch (dtype) {
    case NS_KV_F32:
        return _mm512_loadu_ps((const float *)t->rows[j] + i);
    case NS_KV_F16:
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)t->rows[j] + i)));
    case NS_KV_BF16: {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)t->rows[j] + i)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
    default: {
        __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)t->rows[j] + i)));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(wide), _mm512_set1_ps(t->scales[j]));
    }
    }
}

/* 8 keys' 16-lane sums at once, each key by lanes_sum_reference's pairs (l + l+8, l + l+4,
 * l + l+2, l + l+1), the additions shared out over shuffled registers: the 8 scores in key
 * order in lanes 0-7. */
AVX512_TARGET static inline __m512 lanes_sum8_avx512(const __m512 *a) {
    __m512 b[4], c[2];
    for (int i = 0; i < 4; i++) b[i] = fold8_avx512(a[2 * i], a[2 * i + 1]); /* quarters: key 2i: 0,1; 2i+1: 2,3 */
    for (int i = 0; i < 2; i++) /* quarter t: key 4i + t, its l + l+4 */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    /* quarter t: keys t (lanes 0, 1) and 4 + t (lanes 2, 3) */
    const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* quarter t: keys t (lane 0) and 4 + t (lane 1) */
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d, d, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(d, d, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(order, e);
}

/* scores for `group` vectors of a `dtype` tile: eight keys at a time, each key's 16-value
 * chunk converted once and multiplied into every vector's lanes (a short last group repeats its
 * first key: lanes nobody reads). */
AVX512_TARGET static inline __attribute__((always_inline)) void scores_tile_avx512(
        int dtype, int group, const float *q, const CacheTile *keys, int64_t begin, int64_t end, int64_t padded,
        float *scores) {
    for (int64_t j = begin; j < end; j += 8) {
        const int64_t count = end - j < 8 ? end - j : 8;
        int64_t key[8];
        for (int t = 0; t < 8; t++) key[t] = j + (t < count ? t : 0);
        __m512 a[NS_ATTN_GROUP][8];
        for (int g = 0; g < group; g++)
            for (int t = 0; t < 8; t++) a[g][t] = _mm512_setzero_ps();
        for (int64_t c = 0; c < padded; c += 16)
            for (int t = 0; t < 8; t++) {
                const __m512 k = tile16_avx512(keys, dtype, key[t], c);
                for (int g = 0; g < group; g++)
                    a[g][t] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * padded + c), k, a[g][t]);
            }
        for (int g = 0; g < group; g++)
            _mm512_mask_storeu_ps(scores + g * NS_ATTN_TILE + j, (__mmask16)((1u << count) - 1),
                                  lanes_sum8_avx512(a[g]));
    }
}

/* accumulate for `group` vectors of a `dtype` tile: 64 values a pass, each V row's chunks
 * converted once and added into every vector's accumulator. */
AVX512_TARGET static inline __attribute__((always_inline)) void accumulate_tile_avx512(
        int dtype, int group, const float *p, const CacheTile *values, int64_t begin, int64_t end, int64_t padded,
        float *acc) {
    for (int64_t c = 0; c < padded; c += 64) {
        const int chunks = padded - c >= 64 ? 4 : (int)((padded - c) / 16);
        __m512 a[NS_ATTN_GROUP][4];
        for (int g = 0; g < group; g++)
            for (int u = 0; u < 4; u++)
                a[g][u] = u < chunks ? _mm512_loadu_ps(acc + g * padded + c + 16 * u) : _mm512_setzero_ps();
        for (int64_t j = begin; j < end; j++) {
            __m512 v[4];
            for (int u = 0; u < 4; u++) v[u] = u < chunks ? tile16_avx512(values, dtype, j, c + 16 * u) : v[0];
            for (int g = 0; g < group; g++) {
                const __m512 w = _mm512_set1_ps(p[g * NS_ATTN_TILE + j]);
                for (int u = 0; u < 4; u++)
                    if (u < chunks) a[g][u] = _mm512_fmadd_ps(w, v[u], a[g][u]);
            }
        }
        for (int g = 0; g < group; g++)
            for (int u = 0; u < chunks; u++) _mm512_storeu_ps(acc + g * padded + c + 16 * u, a[g][u]);
    }
}

AVX512_TARGET static void scores_group_avx512(const float *q, int64_t group, const CacheTile *keys, int64_t begin,
                                              int64_t end, int64_t padded, float *scores) {
    NS_ATTN_EACH_GROUP(scores_tile_avx512, keys->dtype, group, q, keys, begin, end, padded, scores)
}

AVX512_TARGET static void accumulate_group_avx512(const float *p, int64_t group, const CacheTile *values,
                                                  int64_t begin, int64_t end, int64_t padded, float *acc) {
    NS_ATTN_EACH_GROUP(accumulate_tile_avx512, values->dtype, group, p, values, begin, end, padded, acc)
}

static const AttnIsa AVX512 = {scores_group_avx512, exp_shifted_avx512, sum_avx512, max_avx512,
                               accumulate_group_avx512};
#endif

/* The paths this CPU runs: NS_ATTN_PORTABLE always, with AVX2 and AVX-512 where cpuid says so. */
NS_EXPORT int ns_attention_isas(void) {
    int isas = NS_ATTN_PORTABLE;
#ifdef NS_ATTN_X86
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (avx2) isas |= NS_ATTN_AVX2;
    if (avx2 && __builtin_cpu_supports("avx512f")) isas |= NS_ATTN_AVX512;
#endif
    return isas;
}

/* The path `isa` names (0: the widest this CPU runs), or NULL where the CPU lacks it. A head
 * dimension that is not whole 16-lane chunks takes the reference: the same bits. */
static const AttnIsa *attention_isa(int isa, int64_t dim) {
    const int available = ns_attention_isas();
    if (isa != 0 && !(available & isa)) return NULL;
    if (isa == 0) isa = available & NS_ATTN_AVX512 ? NS_ATTN_AVX512 : available & NS_ATTN_AVX2 ? NS_ATTN_AVX2
                                                                                           : NS_ATTN_PORTABLE;
    if (dim % NS_ATTN_LANES) return &REFERENCE;
#ifdef NS_ATTN_X86
    if (isa == NS_ATTN_AVX512) return &AVX512;
    if (isa == NS_ATTN_AVX2) return &AVX2;
#endif
    return &REFERENCE;
}

/* ---------------------------------------------------------------- the plan: blocks, units, partials */

static inline int64_t first_slot(int64_t last, int64_t window) {
    return window > 0 && last + 1 > window ? last + 1 - window : 0;
}

/* The last slot row r sees: its position, or past it inside a bidirectional image. */
static inline int64_t last_slot(const ns_attention_plan *plan, const int64_t *positions, int64_t r) {
    return plan->visible_ends != NULL ? plan->visible_ends[r] : positions[r];
}

static inline int64_t padded_dim(int64_t dim) { return (dim + NS_ATTN_LANES - 1) / NS_ATTN_LANES * NS_ATTN_LANES; }

/* Row blocks, the units' prefix counts and where each multi-partition row keeps its partials. */
int ns_attention_plan_init(ns_attention_plan *plan, const int64_t *row_seq, const int64_t *positions,
                           const int64_t *visible_ends, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                           int64_t window) {
    memset(plan, 0, sizeof *plan);
    plan->visible_ends = visible_ends;
    const int64_t group = heads / kv_heads;
    const int64_t block_rows = group >= NS_ATTN_QUERIES ? 1 : NS_ATTN_QUERIES / group;
    plan->rows = rows;
    plan->window = window;
    plan->block_start = malloc(sizeof(int64_t) * (size_t)(rows + 1));
    plan->unit_end = malloc(sizeof(int64_t) * (size_t)(rows + 1));
    plan->partial_at = malloc(sizeof(int64_t) * (size_t)(rows + 1));
    if (plan->block_start == NULL || plan->unit_end == NULL || plan->partial_at == NULL) return -2;
    int64_t blocks = 0, units = 0, partials = 0;
    for (int64_t r = 0; r < rows;) {
        int64_t end = r + 1;
        while (end < rows && end - r < block_rows && row_seq[end] == row_seq[r]) end++;
        int64_t low = INT64_MAX, high = 0;
        for (int64_t i = r; i < end; i++) {
            int64_t first = first_slot(positions[i], window), last = last_slot(plan, positions, i);
            low = first < low ? first : low;
            high = last > high ? last : high;
        }
        const int64_t parts = high / NS_ATTN_PARTITION - low / NS_ATTN_PARTITION + 1;
        if (end - r > 1) { /* a prompt chunk's rows: one unit a K/V head runs all their partitions */
            units += kv_heads;
            plan->max_parts = parts > plan->max_parts ? parts : plan->max_parts;
            for (int64_t i = r; i < end; i++) plan->partial_at[i] = partials; /* none kept */
        } else { /* a decode row: one unit a (K/V head, partition), merged past the barrier */
            units += parts * kv_heads;
            for (int64_t i = r; i < end; i++) {
                plan->partial_at[i] = partials;
                if (parts > 1) partials += parts * heads * (padded_dim(dim) + 2);
            }
        }
        plan->block_start[blocks] = r;
        plan->unit_end[blocks++] = units;
        r = end;
    }
    plan->block_start[blocks] = rows;
    plan->blocks = blocks;
    plan->units = units;
    plan->partial_at[rows] = partials;
    if (partials > 0) {
        plan->partials = malloc(sizeof(float) * (size_t)partials);
        if (plan->partials == NULL) return -2;
    }
    return 0;
}

void ns_attention_plan_free(ns_attention_plan *plan) {
    free(plan->block_start);
    free(plan->unit_end);
    free(plan->partial_at);
    free(plan->partials);
    memset(plan, 0, sizeof *plan);
}

/* ---------------------------------------------------------------- one unit: a block's rows, a K/V head, a partition */

typedef struct {
    const AttnIsa *isa;
    const AttnCache *c;
    const ns_attention_plan *plan;
    const float *q;
    int64_t q_row_stride;
    const int64_t *row_seq, *positions;
    float *out;
    int64_t heads, kv_heads;
    float scale, softcap;
} AttnJob;

/* One thread's buffers for up to NS_ATTN_QUERIES query vectors and one tile. */
typedef struct {
    float *q, *acc, *scores, *max, *sum;
    float *kept; /* a prompt chunk's partitions' (max, sum, accumulator) per query vector, or NULL */
    int64_t *index; /* the tile's cache rows */
    CacheTile tile; /* the tile's K, then V, rows */
    int32_t *begin, *end, *low, *high;
} AttnScratch;

static int scratch_alloc(AttnScratch *s, int64_t padded, int64_t max_parts) {
    const int64_t n = NS_ATTN_QUERIES, tile = NS_ATTN_TILE;
    s->q = aligned_alloc(64, sizeof(float) * (size_t)(2 * n * padded + n * tile + 2 * n + 16));
    s->index = malloc(sizeof(int64_t) * (size_t)tile + sizeof(int32_t) * 4 * (size_t)n);
    s->kept = max_parts > 0 ? malloc(sizeof(float) * (size_t)(n * max_parts * (padded + 2))) : NULL;
    if (s->q == NULL || s->index == NULL || (max_parts > 0 && s->kept == NULL)) {
        free(s->q);
        free(s->index);
        free(s->kept);
        return -2;
    }
    s->acc = s->q + n * padded;
    s->scores = s->acc + n * padded;
    s->max = s->scores + n * tile;
    s->sum = s->max + n;
    s->begin = (int32_t *)(s->index + tile);
    s->end = s->begin + n;
    s->low = s->end + n;
    s->high = s->low + n;
    return 0;
}

static void scratch_free(AttnScratch *s) {
    free(s->q);
    free(s->index);
    free(s->kept);
}

/* Merge `parts` partitions' (max, sum, accumulator [padded]) in order into out [dim]: the
 * accumulators weighted by exp(max - the largest max) and divided by the weighted sums. */
static void merge_partitions(const float *max, const float *sum, const float *const *acc, int64_t parts,
                             int64_t dim, float *out) {
    float largest = max[0];
    for (int64_t p = 1; p < parts; p++) largest = max[p] > largest ? max[p] : largest;
    float total = 0.0f;
    for (int64_t i = 0; i < dim; i++) out[i] = 0.0f;
    for (int64_t p = 0; p < parts; p++) {
        const float weight = exp_reference(max[p] - largest);
        total = fmaf(sum[p], weight, total);
        for (int64_t i = 0; i < dim; i++) out[i] = fmaf(acc[p][i], weight, out[i]);
    }
    const float inverse = 1.0f / total;
    for (int64_t i = 0; i < dim; i++) out[i] = out[i] * inverse;
}

/* The online softmax of query vector v over one tile, its scores already in place: the
 * running max raised, the sum and accumulator rescaled, the scores turned into weights. */
static void softmax_tile(const AttnJob *job, AttnScratch *s, int64_t v, int64_t padded) {
    float *scores = s->scores + v * NS_ATTN_TILE + s->begin[v];
    const int64_t count = s->end[v] - s->begin[v];
    if (job->softcap > 0.0f)
        for (int64_t j = 0; j < count; j++) scores[j] = job->softcap * tanhf(scores[j] / job->softcap);
    const float tile_max = job->isa->max(scores, count);
    const float old_max = s->max[v], new_max = tile_max > old_max ? tile_max : old_max;
    job->isa->exp_shifted(scores, new_max, count);
    const float tile_sum = job->isa->sum(scores, count);
    if (old_max == -INFINITY) {
        s->sum[v] = tile_sum;
    } else if (old_max != new_max) {
        const float correction = exp_reference(old_max - new_max);
        s->sum[v] = s->sum[v] * correction + tile_sum;
        float *acc = s->acc + v * padded;
        for (int64_t i = 0; i < padded; i++) acc[i] = acc[i] * correction;
    } else { /* a correction of exp(0) = 1 would leave every bit as it is */
        s->sum[v] = s->sum[v] + tile_sum;
    }
    s->max[v] = new_max;
}

/* Query vectors [v0, v0 + n) of the block (row-major: row, then the group's heads): their
 * scaled q, each one's slots of partition `part` ([low, high]), and their running state
 * reset. Returns the union of their slots, [*lo, *hi] (empty: *hi < *lo). */
static void start_queries(const AttnJob *job, AttnScratch *s, int64_t first_row, int64_t v0, int64_t n,
                          int64_t kv_head, int64_t part, int64_t *lo, int64_t *hi) {
    const int64_t dim = job->c->dim, padded = padded_dim(dim), group = job->heads / job->kv_heads;
    const int64_t part_lo = part * NS_ATTN_PARTITION, part_hi = part_lo + NS_ATTN_PARTITION - 1;
    *lo = INT64_MAX;
    *hi = -1;
    for (int64_t v = 0; v < n; v++) {
        const int64_t r = first_row + (v0 + v) / group, h = kv_head * group + (v0 + v) % group;
        const int64_t last = last_slot(job->plan, job->positions, r);
        const int64_t first = first_slot(job->positions[r], job->plan->window);
        s->low[v] = (int32_t)(first > part_lo ? first : part_lo);
        s->high[v] = (int32_t)(last < part_hi ? last : part_hi);
        s->max[v] = -INFINITY;
        s->sum[v] = 0.0f;
        memset(s->acc + v * padded, 0, sizeof(float) * (size_t)padded);
        if (s->low[v] > s->high[v]) continue; /* this row sees nothing of the partition */
        *lo = s->low[v] < *lo ? s->low[v] : *lo;
        *hi = s->high[v] > *hi ? s->high[v] : *hi;
        const float *q = job->q + r * job->q_row_stride + h * dim;
        for (int64_t i = 0; i < dim; i++) s->q[v * padded + i] = q[i] * job->scale;
        for (int64_t i = dim; i < padded; i++) s->q[v * padded + i] = 0.0f;
    }
}

/* The cache rows of slots [from, from + count) of the K/V head whose rows start at `head_base`,
 * through the sequence's block table: walked block by block (no division a slot), reading no
 * table entry past the last slot's. */
static void tile_index(const AttnCache *c, const int64_t *table, int64_t head_base, int64_t from, int64_t count,
                       int64_t *index) {
    int64_t block = from / c->block_size, offset = from % c->block_size;
    int64_t row = head_base + table[block] * c->block_size;
    for (int64_t j = 0; j < count; j++) {
        index[j] = row + offset;
        if (++offset == c->block_size && j + 1 < count) {
            offset = 0;
            row = head_base + table[++block] * c->block_size;
        }
    }
}

/* A tile's rows `index[0..count)` of `cache` where it holds them. */
static void cache_tile(const ns_kv_rows *cache, const int64_t *index, int64_t count, int64_t dim, CacheTile *tile) {
    const int64_t bytes = dim * (cache->dtype == NS_KV_F32 ? 4 : cache->dtype == NS_KV_Q8_0 ? 1 : 2);
    tile->dtype = cache->dtype;
    tile->dim = dim;
    for (int64_t j = 0; j < count; j++) tile->rows[j] = (const char *)cache->rows + index[j] * bytes;
    if (cache->dtype == NS_KV_Q8_0)
        for (int64_t j = 0; j < count; j++) tile->scales[j] = cache->scales[index[j]];
}

/* How many query vectors from v on (at most NS_ATTN_GROUP) share v's slots of the tile. */
static int64_t sharing_run(const AttnScratch *s, int64_t v, int64_t n) {
    int64_t run = 1;
    while (v + run < n && run < NS_ATTN_GROUP && s->begin[v + run] == s->begin[v] && s->end[v + run] == s->end[v])
        run++;
    return run;
}

/* One tile of the query vectors' slots (their begin / end set): the vectors cut into runs that share their slots of
 * the tile (a row's GQA heads), at most NS_ATTN_GROUP a run; each run's scores and softmax,
 * then each run's values. */
static void run_tile(const AttnJob *job, AttnScratch *s, int64_t n, const int64_t *index, int64_t count) {
    const AttnIsa *isa = job->isa;
    const int64_t dim = job->c->dim, padded = padded_dim(dim);
    cache_tile(&job->c->k, index, count, dim, &s->tile);
    for (int64_t v = 0, run; v < n; v += run) {
        run = sharing_run(s, v, n);
        if (s->end[v] <= s->begin[v]) continue;
        isa->scores(s->q + v * padded, run, &s->tile, s->begin[v], s->end[v], padded, s->scores + v * NS_ATTN_TILE);
        for (int64_t u = v; u < v + run; u++) softmax_tile(job, s, u, padded);
    }
    cache_tile(&job->c->v, index, count, dim, &s->tile);
    for (int64_t v = 0, run; v < n; v += run) {
        run = sharing_run(s, v, n);
        if (s->end[v] > s->begin[v])
            isa->accumulate(s->scores + v * NS_ATTN_TILE, run, &s->tile, s->begin[v], s->end[v], padded,
                            s->acc + v * padded);
    }
}

/* Query vectors [v0, v0 + n) of the block over partition `part` of K/V head `kv_head`, tile by
 * tile: each tile's K rows read (and converted) once for all of them, then its V rows. */
static void run_queries(const AttnJob *job, AttnScratch *s, int64_t first_row, int64_t v0, int64_t n,
                        int64_t kv_head, int64_t part) {
    const AttnCache *c = job->c;
    int64_t lo, hi;
    start_queries(job, s, first_row, v0, n, kv_head, part, &lo, &hi);
    const int64_t *table = c->block_tables + job->row_seq[first_row] * c->table_width;
    const int64_t head_base = kv_head * c->cache_slots;
    for (int64_t tile_lo = lo / NS_ATTN_TILE * NS_ATTN_TILE; tile_lo <= hi; tile_lo += NS_ATTN_TILE) {
        const int64_t from = tile_lo > lo ? tile_lo : lo;
        const int64_t to = tile_lo + NS_ATTN_TILE - 1 < hi ? tile_lo + NS_ATTN_TILE - 1 : hi, count = to - from + 1;
        int any = 0;
        for (int64_t v = 0; v < n; v++) { /* each one's slots of the tile, from `from` */
            int64_t b = s->low[v] > from ? s->low[v] : from, e = s->high[v] < to ? s->high[v] : to;
            s->begin[v] = (int32_t)(b - from);
            s->end[v] = (int32_t)(e >= b ? e - from + 1 : b - from);
            any |= e >= b;
        }
        if (!any) continue;
        tile_index(c, table, head_base, from, count, s->index);
        run_tile(job, s, n, s->index, count);
    }
}

/* Where query vector v's partition result goes: straight into out when its row has one
 * partition (a merge of one, computed the same way), else into the row's partials. */
static void store_queries(const AttnJob *job, AttnScratch *s, int64_t first_row, int64_t v0, int64_t n,
                          int64_t kv_head, int64_t part) {
    const int64_t dim = job->c->dim, padded = padded_dim(dim), group = job->heads / job->kv_heads;
    for (int64_t v = 0; v < n; v++) {
        if (s->low[v] > s->high[v]) continue;
        const int64_t r = first_row + (v0 + v) / group, h = kv_head * group + (v0 + v) % group;
        const int64_t last = last_slot(job->plan, job->positions, r);
        const int64_t first_part = first_slot(job->positions[r], job->plan->window) / NS_ATTN_PARTITION;
        const float *acc = s->acc + v * padded;
        if (last / NS_ATTN_PARTITION == first_part) {
            merge_partitions(s->max + v, s->sum + v, &acc, 1, dim, job->out + (r * job->heads + h) * dim);
            continue;
        }
        float *partial = job->plan->partials + job->plan->partial_at[r] +
                         ((part - first_part) * job->heads + h) * (padded + 2);
        partial[0] = s->max[v];
        partial[1] = s->sum[v];
        memcpy(partial + 2, acc, sizeof(float) * (size_t)padded);
    }
}

/* A prompt chunk's query vectors [v0, v0 + n) after partition `p` of the block's `parts`: each
 * one's (max, sum, accumulator) kept for its merge. */
static void keep_queries(AttnScratch *s, int64_t n, int64_t p, int64_t parts, int64_t padded) {
    for (int64_t v = 0; v < n; v++) {
        if (s->low[v] > s->high[v]) continue; /* a partition the row does not reach */
        float *kept = s->kept + (v * parts + p) * (padded + 2);
        kept[0] = s->max[v];
        kept[1] = s->sum[v];
        memcpy(kept + 2, s->acc + v * padded, sizeof(float) * (size_t)padded);
    }
}

/* Each of the query vectors' own partitions, kept in order from the block's first, merged
 * into out: the arithmetic of merge_row_head over a decode row's partials. */
static void merge_kept(const AttnJob *job, AttnScratch *s, int64_t first_row, int64_t v0, int64_t n, int64_t kv_head,
                       int64_t block_first_part, int64_t parts) {
    const int64_t dim = job->c->dim, padded = padded_dim(dim), group = job->heads / job->kv_heads;
    for (int64_t v = 0; v < n; v++) {
        const int64_t r = first_row + (v0 + v) / group, h = kv_head * group + (v0 + v) % group;
        const int64_t last = last_slot(job->plan, job->positions, r);
        const int64_t first_part = first_slot(job->positions[r], job->plan->window) / NS_ATTN_PARTITION;
        const int64_t count = last / NS_ATTN_PARTITION - first_part + 1;
        float max[count], sum[count];
        const float *acc[count];
        for (int64_t p = 0; p < count; p++) {
            const float *kept = s->kept + (v * parts + first_part - block_first_part + p) * (padded + 2);
            max[p] = kept[0];
            sum[p] = kept[1];
            acc[p] = kept + 2;
        }
        merge_partitions(max, sum, acc, count, dim, job->out + (r * job->heads + h) * dim);
    }
}

/* Unit `unit`: a decode row's (K/V head, partition), its result stored for the merge; or a
 * prompt chunk's K/V head over all its partitions, merged here (the same merge, in the same
 * order, so a row's bits are the same either way). */
static void run_unit(const AttnJob *job, AttnScratch *s, int64_t unit) {
    const ns_attention_plan *plan = job->plan;
    int64_t low = 0, hi = plan->blocks - 1, b_lo = INT64_MAX, b_hi = 0;
    while (low < hi) { /* the block holding `unit`: a binary search over the units' prefix counts */
        int64_t mid = (low + hi) / 2;
        if (plan->unit_end[mid] <= unit) low = mid + 1;
        else hi = mid;
    }
    const int64_t block = low, first_row = plan->block_start[block], end_row = plan->block_start[block + 1];
    for (int64_t r = first_row; r < end_row; r++) {
        int64_t first = first_slot(job->positions[r], plan->window), last = last_slot(plan, job->positions, r);
        b_lo = first < b_lo ? first : b_lo;
        b_hi = last > b_hi ? last : b_hi;
    }
    const int64_t first_part = b_lo / NS_ATTN_PARTITION, parts = b_hi / NS_ATTN_PARTITION - first_part + 1;
    const int64_t in_block = unit - (block ? plan->unit_end[block - 1] : 0);
    const int64_t queries = (end_row - first_row) * (job->heads / job->kv_heads);
    const int chunk = end_row - first_row > 1;
    const int64_t kv_head = chunk ? in_block : in_block / parts;
    for (int64_t v0 = 0; v0 < queries; v0 += NS_ATTN_QUERIES) {
        const int64_t n = queries - v0 < NS_ATTN_QUERIES ? queries - v0 : NS_ATTN_QUERIES;
        if (!chunk) {
            const int64_t part = first_part + in_block % parts;
            run_queries(job, s, first_row, v0, n, kv_head, part);
            store_queries(job, s, first_row, v0, n, kv_head, part);
            continue;
        }
        for (int64_t p = 0; p < parts; p++) {
            run_queries(job, s, first_row, v0, n, kv_head, first_part + p);
            keep_queries(s, n, p, parts, padded_dim(job->c->dim));
        }
        merge_kept(job, s, first_row, v0, n, kv_head, first_part, parts);
    }
}

/* The partials of row r's query head h merged into out. */
static void merge_row_head(const AttnJob *job, int64_t r, int64_t h) {
    const ns_attention_plan *plan = job->plan;
    const int64_t dim = job->c->dim, padded = padded_dim(dim), last = last_slot(plan, job->positions, r);
    const int64_t first_part = first_slot(job->positions[r], plan->window) / NS_ATTN_PARTITION;
    const int64_t parts = last / NS_ATTN_PARTITION - first_part + 1;
    float max[parts], sum[parts];
    const float *acc[parts];
    for (int64_t p = 0; p < parts; p++) {
        const float *partial = plan->partials + plan->partial_at[r] + (p * job->heads + h) * (padded + 2);
        max[p] = partial[0];
        sum[p] = partial[1];
        acc[p] = partial + 2;
    }
    merge_partitions(max, sum, acc, parts, dim, job->out + (r * job->heads + h) * dim);
}

/* Thread `thread`'s units, dealt in turn (a unit's arithmetic does not depend on which thread
 * runs it); then, past a barrier, its share of the multi-partition rows' merges. Returns 0, or
 * -2 when its scratch could not be allocated (the other threads still reach the barrier). */
static int attention_task(const AttnJob *job, int thread, int threads) {
    const int64_t padded = padded_dim(job->c->dim);
    AttnScratch s;
    int status = 0;
    if (job->plan->units > thread) {
        status = scratch_alloc(&s, padded, job->plan->max_parts);
        if (status == 0) {
            for (int64_t unit = thread; unit < job->plan->units; unit += threads) run_unit(job, &s, unit);
            scratch_free(&s);
        }
    }
    if (job->plan->partials == NULL) return status;
    if (threads > 1) ns_barrier(threads);
    const int64_t merges = job->plan->rows * job->heads;
    for (int64_t m = thread; m < merges; m += threads) {
        const int64_t r = m / job->heads;
        if (job->plan->partial_at[r + 1] > job->plan->partial_at[r]) merge_row_head(job, r, m % job->heads);
    }
    return status;
}

/* ---------------------------------------------------------------- entries */

int ns_stage_tiled_attention(const ns_attention_plan *plan, const float *q, int64_t q_row_stride, ns_kv_rows k_cache,
                             ns_kv_rows v_cache, const int64_t *block_tables, int64_t table_width,
                             const int64_t *row_seq, const int64_t *positions, float *out, int64_t heads,
                             int64_t kv_heads, int64_t dim, int64_t block_size, int64_t num_blocks, float scale,
                             float softcap, int thread, int threads) {
    AttnCache cache = {k_cache, v_cache, block_tables, table_width, block_size, num_blocks * block_size, dim};
    AttnJob job = {attention_isa(0, dim), &cache, plan, q, q_row_stride, row_seq, positions, out, heads, kv_heads,
                   scale, softcap};
    return attention_task(&job, thread, threads);
}

typedef struct {
    const AttnJob *job;
    _Atomic int failed;
} AttnCall;

static void call_task(void *context, int thread, int threads) {
    AttnCall *call = context;
    if (attention_task(call->job, thread, threads) != 0) call->failed = 1;
}

/* Attention of `rows` query rows over the paged cache, on path `isa` (0: the widest this CPU
 * runs; else one NS_ATTN_* bit). q [rows, q_row_stride] (heads * dim used, unit stride);
 * caches [kv_heads, num_blocks * block_size, dim] of `kv_dtype` (q8_0: with their scales);
 * out [rows, heads * dim]. Row r attends over sequence row_seq[r]'s block table up to its
 * position, or up to visible_ends[r] where visible_ends is not NULL (a bidirectional image's
 * rows see the whole image; window > 0: from its position's last `window` slots on);
 * softcap > 0: scores soft-capped. Returns 0,
 * -2 when out of memory, -4 when the CPU lacks `isa`. */
NS_EXPORT int ns_tiled_attention(int isa, const float *q, int64_t q_row_stride, int kv_dtype, void *k_cache,
                                 float *k_scales, void *v_cache, float *v_scales, const int64_t *block_tables,
                                 int64_t table_width, const int64_t *row_seq, const int64_t *positions,
                                 const int64_t *visible_ends, float *out,
                                 int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                                 int64_t num_blocks, float scale, int64_t window, float softcap, int num_threads) {
    const AttnIsa *path = attention_isa(isa, dim);
    if (path == NULL) return -4;
    ns_attention_plan plan;
    int status = ns_attention_plan_init(&plan, row_seq, positions, visible_ends, rows, heads, kv_heads, dim, window);
    if (status == 0 && rows > 0) {
        AttnCache cache = {{k_cache, k_scales, kv_dtype}, {v_cache, v_scales, kv_dtype}, block_tables, table_width,
                           block_size, num_blocks * block_size, dim};
        AttnJob job = {path, &cache, &plan, q, q_row_stride, row_seq, positions, out, heads, kv_heads, scale,
                       softcap};
        AttnCall call = {&job, 0};
        int threads = plan.units > 1 ? num_threads : 1;
        ns_parallel(threads, call_task, &call);
        status = call.failed ? -2 : 0;
    }
    ns_attention_plan_free(&plan);
    return status;
}
