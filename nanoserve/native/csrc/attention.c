/* Tiled (flash-style) attention over the paged KV cache, for decode rows and prompt chunks alike.
 *
 * Every query row attends over its own sequence's slots [first, last] (last: its position;
 * first: 0, or the window's start), read in place through its block table in the cache's own
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
 *   accumulator rescaled by exp(old max - new max), and the tile's exp-weighted V rows added
 *   slot by slot with fused multiply-adds.
 * - The partitions' (max, sum, accumulator) are merged in partition order.
 * So a row's bits depend on its q, its context and its position only: not on the other rows of
 * the call (decode rows, a prompt chunk's rows, a crowd), nor on the thread count, nor on
 * whether a prefill chunk or a decode step computed it (preemption by recompute keeps tokens).
 *
 * Work: a ROW BLOCK is up to NS_ATTN_QUERIES / group consecutive rows of one sequence (a decode
 * row is a block of its own); the unit a thread takes is (row block, K/V head, partition), so
 * the GQA query heads of every row of the block share each K/V row as it is loaded and
 * converted, and a single long decode row still spreads over every thread. Units are dealt to
 * the threads in turn; the partitions' results of rows with more than one are merged after a
 * barrier, one (row, K/V head) per unit.
 *
 * Three paths, one arithmetic: the portable C reference, AVX2 (+FMA, F16C) and AVX-512F, each
 * compiled with its target attribute and chosen at run time from cpuid (ns_attention_isas says
 * which this CPU runs). Every vector operation is an exactly rounded IEEE operation on the same
 * operands in the same order as the reference (the 16 lanes of the reference are two 8-lane
 * registers on AVX2 and one on AVX-512), so the three agree bit for bit (tests/test_native_
 * attention.py). Contraction is off in this file: the compiler may not fuse a multiply and an
 * add the reference keeps apart. A head dimension that is not a multiple of 16 runs the
 * reference (the same bits, slower).
 */
#pragma GCC optimize("fp-contract=off")

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nanoserve.h"
#include "stages.h"

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

/* One tile's K or V rows: their row indices in the cache (kv_head * cache_slots + slot). */
typedef struct {
    const ns_kv_rows *cache;
    const int64_t *index;
    int64_t count, dim, padded;
} AttnTile;

/* Query vector v's slots inside the tile: [begin[v], end[v]) relative to the tile's first slot. */
typedef struct {
    const int32_t *begin, *end;
} AttnRanges;

/* What differs between the paths: the tile's scores, exp over a run of scores, and the values'
 * accumulation. q and acc hold `queries` vectors of `padded` floats; scores `queries` rows of
 * NS_ATTN_TILE. */
typedef struct {
    void (*scores)(const float *q, int64_t queries, const AttnTile *tile, const AttnRanges *ranges,
                   float *scores);
    void (*exp_shifted)(float *x, float shift, int64_t n); /* x = exp(x - shift) in place */
    void (*accumulate)(const float *probs, int64_t queries, const AttnTile *tile, const AttnRanges *ranges,
                       float *acc);
} AttnIsa;

/* Row `index` of a cache as float32 values into out [padded] (zeros past dim). */
static inline void row_reference(const ns_kv_rows *cache, int64_t index, int64_t dim, int64_t padded,
                                 float *out) {
    const int64_t at = index * dim;
    switch (cache->dtype) {
    case NS_KV_F32:
        memcpy(out, (const float *)cache->rows + at, (size_t)dim * sizeof(float));
        break;
    case NS_KV_F16:
        for (int64_t i = 0; i < dim; i++) out[i] = half_to_float(((const uint16_t *)cache->rows)[at + i]);
        break;
    case NS_KV_BF16:
        for (int64_t i = 0; i < dim; i++) out[i] = bf16_to_float(((const uint16_t *)cache->rows)[at + i]);
        break;
    default: { /* q8_0 */
        const int8_t *codes = (const int8_t *)cache->rows + at;
        const float scale = cache->scales[index];
        for (int64_t i = 0; i < dim; i++) out[i] = (float)codes[i] * scale;
    }
    }
    for (int64_t i = dim; i < padded; i++) out[i] = 0.0f;
}

/* ---------------------------------------------------------------- the portable reference */

static float dot_reference(const float *q, const float *k, int64_t padded) {
    float lanes[NS_ATTN_LANES] = {0};
    for (int64_t c = 0; c < padded; c += NS_ATTN_LANES)
        for (int l = 0; l < NS_ATTN_LANES; l++) lanes[l] = fmaf(q[c + l], k[c + l], lanes[l]);
    for (int half = NS_ATTN_LANES / 2; half >= 1; half /= 2)
        for (int l = 0; l < half; l++) lanes[l] = lanes[l] + lanes[l + half];
    return lanes[0];
}

static void scores_reference(const float *q, int64_t queries, const AttnTile *tile, const AttnRanges *ranges,
                             float *scores) {
    float row[tile->padded];
    for (int64_t j = 0; j < tile->count; j++) {
        row_reference(tile->cache, tile->index[j], tile->dim, tile->padded, row);
        for (int64_t v = 0; v < queries; v++)
            if (j >= ranges->begin[v] && j < ranges->end[v])
                scores[v * NS_ATTN_TILE + j] = dot_reference(q + v * tile->padded, row, tile->padded);
    }
}

static void exp_shifted_reference(float *x, float shift, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = exp_reference(x[i] - shift);
}

static void accumulate_reference(const float *probs, int64_t queries, const AttnTile *tile,
                                 const AttnRanges *ranges, float *acc) {
    float row[tile->padded];
    for (int64_t j = 0; j < tile->count; j++) {
        row_reference(tile->cache, tile->index[j], tile->dim, tile->padded, row);
        for (int64_t v = 0; v < queries; v++) {
            if (j < ranges->begin[v] || j >= ranges->end[v]) continue;
            const float p = probs[v * NS_ATTN_TILE + j];
            float *a = acc + v * tile->padded;
            for (int64_t i = 0; i < tile->padded; i++) a[i] = fmaf(p, row[i], a[i]);
        }
    }
}

static const AttnIsa REFERENCE = {scores_reference, exp_shifted_reference, accumulate_reference};

#ifdef NS_ATTN_X86
/* ---------------------------------------------------------------- AVX2 + FMA + F16C */

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

/* 8 values of row `index` from float `i` on (i a multiple of 8, inside dim). */
AVX2_TARGET static inline __m256 load8_avx2(const ns_kv_rows *cache, int64_t index, int64_t dim, int64_t i) {
    const int64_t at = index * dim + i;
    switch (cache->dtype) {
    case NS_KV_F32:
        return _mm256_loadu_ps((const float *)cache->rows + at);
    case NS_KV_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache->rows + at)));
    case NS_KV_BF16: {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache->rows + at)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    default: {
        __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)cache->rows + at)));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(cache->scales[index]));
    }
    }
}

AVX2_TARGET static void row_avx2(const AttnTile *tile, int64_t j, float *out) {
    for (int64_t i = 0; i < tile->dim; i += 8)
        _mm256_storeu_ps(out + i, load8_avx2(tile->cache, tile->index[j], tile->dim, i));
}

AVX2_TARGET static inline float dot_avx2(const float *q, const float *k, int64_t padded) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t c = 0; c < padded; c += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8), _mm256_loadu_ps(k + c + 8), hi);
    }
    __m256 s8 = _mm256_add_ps(lo, hi); /* l + l+8 */
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

AVX2_TARGET static void scores_avx2(const float *q, int64_t queries, const AttnTile *tile,
                                    const AttnRanges *ranges, float *scores) {
    float row[tile->padded];
    for (int64_t j = 0; j < tile->count; j++) {
        row_avx2(tile, j, row);
        for (int64_t v = 0; v < queries; v++)
            if (j >= ranges->begin[v] && j < ranges->end[v])
                scores[v * NS_ATTN_TILE + j] = dot_avx2(q + v * tile->padded, row, tile->padded);
    }
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

AVX2_TARGET static void accumulate_avx2(const float *probs, int64_t queries, const AttnTile *tile,
                                        const AttnRanges *ranges, float *acc) {
    float row[tile->padded];
    for (int64_t j = 0; j < tile->count; j++) {
        row_avx2(tile, j, row);
        for (int64_t v = 0; v < queries; v++) {
            if (j < ranges->begin[v] || j >= ranges->end[v]) continue;
            const __m256 p = _mm256_set1_ps(probs[v * NS_ATTN_TILE + j]);
            float *a = acc + v * tile->padded;
            for (int64_t i = 0; i < tile->padded; i += 8)
                _mm256_storeu_ps(a + i, _mm256_fmadd_ps(p, _mm256_loadu_ps(row + i), _mm256_loadu_ps(a + i)));
        }
    }
}

static const AttnIsa AVX2 = {scores_avx2, exp_shifted_avx2, accumulate_avx2};

/* ---------------------------------------------------------------- AVX-512F */

#define AVX512_TARGET __attribute__((target("avx512f,avx2,fma,f16c")))

AVX512_TARGET static inline __m512 load16_avx512(const ns_kv_rows *cache, int64_t index, int64_t dim, int64_t i) {
    const int64_t at = index * dim + i;
    switch (cache->dtype) {
    case NS_KV_F32:
        return _mm512_loadu_ps((const float *)cache->rows + at);
    case NS_KV_F16:
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)cache->rows + at)));
    case NS_KV_BF16: {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)cache->rows + at)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
    default: {
        __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)cache->rows + at)));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(wide), _mm512_set1_ps(cache->scales[index]));
    }
    }
}

AVX512_TARGET static void row_avx512(const AttnTile *tile, int64_t j, float *out) {
    for (int64_t i = 0; i < tile->dim; i += 16)
        _mm512_storeu_ps(out + i, load16_avx512(tile->cache, tile->index[j], tile->dim, i));
}

AVX512_TARGET static inline float reduce16_avx512(__m512 acc) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

AVX512_TARGET static void scores_avx512(const float *q, int64_t queries, const AttnTile *tile,
                                        const AttnRanges *ranges, float *scores) {
    const int64_t padded = tile->padded;
    float row[padded];
    for (int64_t j = 0; j < tile->count; j++) {
        row_avx512(tile, j, row);
        for (int64_t v = 0; v < queries; v++) {
            if (j < ranges->begin[v] || j >= ranges->end[v]) continue;
            const float *qv = q + v * padded;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t c = 0; c < padded; c += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(qv + c), _mm512_loadu_ps(row + c), acc);
            scores[v * NS_ATTN_TILE + j] = reduce16_avx512(acc);
        }
    }
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
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp16_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i), s)));
    if (i < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1);
        __m512 e = exp16_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + i), s));
        _mm512_mask_storeu_ps(x + i, tail, e);
    }
}

AVX512_TARGET static void accumulate_avx512(const float *probs, int64_t queries, const AttnTile *tile,
                                            const AttnRanges *ranges, float *acc) {
    const int64_t padded = tile->padded;
    float row[padded];
    for (int64_t j = 0; j < tile->count; j++) {
        row_avx512(tile, j, row);
        for (int64_t v = 0; v < queries; v++) {
            if (j < ranges->begin[v] || j >= ranges->end[v]) continue;
            const __m512 p = _mm512_set1_ps(probs[v * NS_ATTN_TILE + j]);
            float *a = acc + v * padded;
            for (int64_t i = 0; i < padded; i += 16)
                _mm512_storeu_ps(a + i, _mm512_fmadd_ps(p, _mm512_loadu_ps(row + i), _mm512_loadu_ps(a + i)));
        }
    }
}

static const AttnIsa AVX512 = {scores_avx512, exp_shifted_avx512, accumulate_avx512};
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

static inline int64_t padded_dim(int64_t dim) { return (dim + NS_ATTN_LANES - 1) / NS_ATTN_LANES * NS_ATTN_LANES; }

/* Row blocks, the units' prefix counts and where each multi-partition row keeps its partials. */
int ns_attention_plan_init(ns_attention_plan *plan, const int64_t *row_seq, const int64_t *positions, int64_t rows,
                           int64_t heads, int64_t kv_heads, int64_t dim, int64_t window) {
    memset(plan, 0, sizeof *plan);
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
            int64_t first = first_slot(positions[i], window);
            low = first < low ? first : low;
            high = positions[i] > high ? positions[i] : high;
        }
        units += (high / NS_ATTN_PARTITION - low / NS_ATTN_PARTITION + 1) * kv_heads;
        plan->block_start[blocks] = r;
        plan->unit_end[blocks++] = units;
        r = end;
    }
    plan->block_start[blocks] = rows;
    plan->blocks = blocks;
    plan->units = units;
    for (int64_t r = 0; r < rows; r++) {
        plan->partial_at[r] = partials;
        int64_t parts = positions[r] / NS_ATTN_PARTITION - first_slot(positions[r], window) / NS_ATTN_PARTITION + 1;
        if (parts > 1) partials += parts * heads * (padded_dim(dim) + 2);
    }
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

/* One thread's buffers for up to NS_ATTN_QUERIES query vectors. */
typedef struct {
    float *q, *acc, *scores, *max, *sum;
    int64_t *index;
    int32_t *begin, *end, *low, *high;
} AttnScratch;

static void *scratch_alloc(AttnScratch *s, int64_t padded) {
    const int64_t n = NS_ATTN_QUERIES;
    float *floats = aligned_alloc(64, sizeof(float) * (size_t)(2 * n * padded + n * NS_ATTN_TILE + 2 * n + 16));
    if (floats == NULL) return NULL;
    s->q = floats;
    s->acc = s->q + n * padded;
    s->scores = s->acc + n * padded;
    s->max = s->scores + n * NS_ATTN_TILE;
    s->sum = s->max + n;
    s->index = malloc(sizeof(int64_t) * NS_ATTN_TILE + sizeof(int32_t) * 4 * NS_ATTN_QUERIES);
    if (s->index == NULL) {
        free(floats);
        return NULL;
    }
    s->begin = (int32_t *)(s->index + NS_ATTN_TILE);
    s->end = s->begin + n;
    s->low = s->end + n;
    s->high = s->low + n;
    return floats;
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
    float tile_max = scores[0];
    for (int64_t j = 1; j < count; j++) tile_max = scores[j] > tile_max ? scores[j] : tile_max;
    const float old_max = s->max[v], new_max = tile_max > old_max ? tile_max : old_max;
    job->isa->exp_shifted(scores, new_max, count);
    float tile_sum = 0.0f;
    for (int64_t j = 0; j < count; j++) tile_sum = tile_sum + scores[j];
    if (old_max == -INFINITY) {
        s->sum[v] = tile_sum;
    } else {
        const float correction = exp_reference(old_max - new_max);
        s->sum[v] = s->sum[v] * correction + tile_sum;
        float *acc = s->acc + v * padded;
        for (int64_t i = 0; i < padded; i++) acc[i] = acc[i] * correction;
    }
    s->max[v] = new_max;
}

/* Query vectors [v0, v0 + n) of the block (row-major: row, then the group's heads) over
 * partition `part` of K/V head `kv_head`; rows of one sequence, `first_row` the block's first. */
static void run_queries(const AttnJob *job, AttnScratch *s, int64_t first_row, int64_t v0, int64_t n,
                        int64_t kv_head, int64_t part) {
    const AttnCache *c = job->c;
    const int64_t dim = c->dim, padded = padded_dim(dim), group = job->heads / job->kv_heads;
    const int64_t part_lo = part * NS_ATTN_PARTITION, part_hi = part_lo + NS_ATTN_PARTITION - 1;
    int64_t lo = INT64_MAX, hi = -1;
    for (int64_t v = 0; v < n; v++) {
        const int64_t r = first_row + (v0 + v) / group, h = kv_head * group + (v0 + v) % group;
        const int64_t last = job->positions[r], first = first_slot(last, job->plan->window);
        s->low[v] = (int32_t)(first > part_lo ? first : part_lo);
        s->high[v] = (int32_t)(last < part_hi ? last : part_hi);
        s->max[v] = -INFINITY;
        s->sum[v] = 0.0f;
        memset(s->acc + v * padded, 0, sizeof(float) * (size_t)padded);
        if (s->low[v] > s->high[v]) continue; /* this row sees nothing of the partition */
        lo = s->low[v] < lo ? s->low[v] : lo;
        hi = s->high[v] > hi ? s->high[v] : hi;
        const float *q = job->q + r * job->q_row_stride + h * dim;
        for (int64_t i = 0; i < dim; i++) s->q[v * padded + i] = q[i] * job->scale;
        for (int64_t i = dim; i < padded; i++) s->q[v * padded + i] = 0.0f;
    }
    if (hi < lo) return;
    const int64_t *table = c->block_tables + job->row_seq[first_row] * c->table_width;
    const int64_t head_base = kv_head * c->cache_slots;
    for (int64_t tile_lo = lo / NS_ATTN_TILE * NS_ATTN_TILE; tile_lo <= hi; tile_lo += NS_ATTN_TILE) {
        const int64_t from = tile_lo > lo ? tile_lo : lo, to = tile_lo + NS_ATTN_TILE - 1 < hi ? tile_lo + NS_ATTN_TILE - 1 : hi;
        for (int64_t slot = from; slot <= to; slot++)
            s->index[slot - from] = head_base + table[slot / c->block_size] * c->block_size + slot % c->block_size;
        int any = 0;
        for (int64_t v = 0; v < n; v++) {
            int64_t b = s->low[v] > from ? s->low[v] : from, e = s->high[v] < to ? s->high[v] : to;
            s->begin[v] = (int32_t)(b - from);
            s->end[v] = (int32_t)(e >= b ? e - from + 1 : b - from);
            any |= e >= b;
        }
        if (!any) continue;
        /* Scores and weights are kept at the tile's own offsets (begin[v] from `from`). */
        AttnTile k_tile = {&c->k, s->index, to - from + 1, dim, padded};
        AttnRanges ranges = {s->begin, s->end};
        job->isa->scores(s->q, n, &k_tile, &ranges, s->scores);
        for (int64_t v = 0; v < n; v++)
            if (s->end[v] > s->begin[v]) softmax_tile(job, s, v, padded);
        AttnTile v_tile = {&c->v, s->index, to - from + 1, dim, padded};
        job->isa->accumulate(s->scores, n, &v_tile, &ranges, s->acc);
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
        const int64_t last = job->positions[r], first_part = first_slot(last, job->plan->window) / NS_ATTN_PARTITION;
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

static void run_unit(const AttnJob *job, AttnScratch *s, int64_t unit) {
    const ns_attention_plan *plan = job->plan;
    int64_t block = 0, low = 0, hi, b_lo = INT64_MAX;
    /* The block holding `unit`: a binary search over the units' prefix counts. */
    hi = plan->blocks - 1;
    while (low < hi) {
        int64_t mid = (low + hi) / 2;
        if (plan->unit_end[mid] <= unit) low = mid + 1;
        else hi = mid;
    }
    block = low;
    const int64_t first_row = plan->block_start[block], end_row = plan->block_start[block + 1];
    for (int64_t r = first_row; r < end_row; r++) {
        int64_t first = first_slot(job->positions[r], plan->window);
        b_lo = first < b_lo ? first : b_lo;
    }
    const int64_t in_block = unit - (block ? plan->unit_end[block - 1] : 0);
    const int64_t parts = (plan->unit_end[block] - (block ? plan->unit_end[block - 1] : 0)) / job->kv_heads;
    const int64_t kv_head = in_block / parts, part = b_lo / NS_ATTN_PARTITION + in_block % parts;
    const int64_t queries = (end_row - first_row) * (job->heads / job->kv_heads);
    for (int64_t v0 = 0; v0 < queries; v0 += NS_ATTN_QUERIES) {
        const int64_t n = queries - v0 < NS_ATTN_QUERIES ? queries - v0 : NS_ATTN_QUERIES;
        run_queries(job, s, first_row, v0, n, kv_head, part);
        store_queries(job, s, first_row, v0, n, kv_head, part);
    }
}

/* The partials of row r's query head h merged into out. */
static void merge_row_head(const AttnJob *job, int64_t r, int64_t h) {
    const ns_attention_plan *plan = job->plan;
    const int64_t dim = job->c->dim, padded = padded_dim(dim), last = job->positions[r];
    const int64_t parts = last / NS_ATTN_PARTITION - first_slot(last, plan->window) / NS_ATTN_PARTITION + 1;
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
    void *held = job->plan->units > thread ? scratch_alloc(&s, padded) : NULL;
    int status = job->plan->units > thread && held == NULL ? -2 : 0;
    if (held != NULL)
        for (int64_t unit = thread; unit < job->plan->units; unit += threads) run_unit(job, &s, unit);
    if (held != NULL) {
        free(s.index);
        free(held);
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
 * position (window > 0: its last `window` slots); softcap > 0: scores soft-capped. Returns 0,
 * -2 when out of memory, -4 when the CPU lacks `isa`. */
NS_EXPORT int ns_tiled_attention(int isa, const float *q, int64_t q_row_stride, int kv_dtype, void *k_cache,
                                 float *k_scales, void *v_cache, float *v_scales, const int64_t *block_tables,
                                 int64_t table_width, const int64_t *row_seq, const int64_t *positions, float *out,
                                 int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                                 int64_t num_blocks, float scale, int64_t window, float softcap, int num_threads) {
    const AttnIsa *path = attention_isa(isa, dim);
    if (path == NULL) return -4;
    ns_attention_plan plan;
    int status = ns_attention_plan_init(&plan, row_seq, positions, rows, heads, kv_heads, dim, window);
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
