/* What the quantized matmuls share: f16 scales, and activations quantized to 8-bit blocks.
 *
 * An activation row of k values becomes k/32 blocks of 32 int8 codes with a scale d =
 * max|x| / 127 and s = d * sum(codes) (ggml's Q8_1 idea: s carries a weight block's offset
 * term), and the integer sums of each half of 16 codes (ggml's Q8_K bsums: the per-16 mins of
 * Q2_K, and Q3_K's -4, meet them; every other layout ignores them). Codes round to nearest even (nearbyintf, as the vector unit rounds), so the AVX2
 * quantizer below writes exactly the bytes the portable one writes.
 */
#ifndef NANOSERVE_QUANT_BLOCKS_H
#define NANOSERVE_QUANT_BLOCKS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* One quantized activation block: 32 codes, their scale, scale * sum(codes), and the sums of
 * codes 0..15 and 16..31 (|sum| <= 16 x 127). */
typedef struct {
    int8_t qs[32];
    float d;
    float s;
    int16_t half_sums[2];
} xblock;

static inline float f16_to_f32(const uint8_t *p) {
#if defined(__F16C__)
    return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8)));
#else
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        int shift = 0;
        while (!(mantissa & 0x400)) { mantissa <<= 1; shift++; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mantissa & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline void quantize_block_portable(const float *v, xblock *out) {
    float amax = 0.0f;
    for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(v[l]));
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int half[2] = {0, 0};
    for (int l = 0; l < 32; l++) {
        int code = (int)nearbyintf(v[l] * id);
        out->qs[l] = (int8_t)code;
        half[l / 16] += code;
    }
    out->d = d;
    out->s = d * (float)(half[0] + half[1]);
    out->half_sums[0] = (int16_t)half[0], out->half_sums[1] = (int16_t)half[1];
}

#if defined(__AVX2__)
/* The same codes, d and s as quantize_block_portable: max and the product are exact lane by
 * lane, and the integer sum does not depend on its order. */
static inline void quantize_block_avx2(const float *v, xblock *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(v + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    float d = _mm_cvtss_f32(m) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i codes[4];
    for (int i = 0; i < 4; i++)
        codes[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x[i], _mm256_set1_ps(id)),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i halves[2] = {_mm256_add_epi32(codes[0], codes[1]), _mm256_add_epi32(codes[2], codes[3])};
    __m128i t = _mm_hadd_epi32(_mm_add_epi32(_mm256_castsi256_si128(halves[0]), _mm256_extracti128_si256(halves[0], 1)),
                               _mm_add_epi32(_mm256_castsi256_si128(halves[1]), _mm256_extracti128_si256(halves[1], 1)));
    t = _mm_hadd_epi32(t, t); /* the two halves' sums, twice */
    /* int32 -> int16 -> int8 packs interleave 128-bit lanes; the permute puts them back in order */
    __m256i packed16 = _mm256_packs_epi32(codes[0], codes[1]), packed16b = _mm256_packs_epi32(codes[2], codes[3]);
    __m256i packed8 = _mm256_packs_epi16(packed16, packed16b);
    packed8 = _mm256_permutevar8x32_epi32(packed8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)out->qs, packed8);
    const int first = _mm_cvtsi128_si32(t), second = _mm_extract_epi32(t, 1);
    out->d = d;
    out->s = d * (float)(first + second);
    out->half_sums[0] = (int16_t)first, out->half_sums[1] = (int16_t)second;
}
#endif

/* Row x [k] -> k/32 blocks, the widest path compiled in (`portable`: the plain C one). */
static inline void quantize_row(const float *x, int64_t k, xblock *out) {
    for (int64_t b = 0; b < k / 32; b++) {
#if defined(__AVX2__)
        quantize_block_avx2(x + 32 * b, out + b);
#else
        quantize_block_portable(x + 32 * b, out + b);
#endif
    }
}

static inline void quantize_row_portable(const float *x, int64_t k, xblock *out) {
    for (int64_t b = 0; b < k / 32; b++) quantize_block_portable(x + 32 * b, out + b);
}

/* The GGUF block layouts csrc/gemm/matmul_more.c reads, as ggml-common.h defines them (nanoserve/
 * quant.py's docstring gives the value of each element). Byte arrays only, so no padding: a
 * row of blocks is an array of these. f16 fields are two bytes, read with f16_to_f32. */
typedef struct { uint8_t d[2], qh[4], qs[16]; } block_q5_0;
typedef struct { uint8_t d[2], m[2], qh[4], qs[16]; } block_q5_1;
typedef struct { uint8_t d[2], qs[16]; } block_iq4_nl;
typedef struct { uint8_t d[2], scales_h[2], scales_l[4], qs[128]; } block_iq4_xs;
typedef struct { uint8_t scales[16], qs[64], d[2], dmin[2]; } block_q2_k;
typedef struct { uint8_t hmask[32], qs[64], scales[12], d[2]; } block_q3_k;
_Static_assert(sizeof(block_q5_0) == 22 && sizeof(block_q5_1) == 24 && sizeof(block_iq4_nl) == 18,
               "32-value block sizes");
_Static_assert(sizeof(block_iq4_xs) == 136 && sizeof(block_q2_k) == 84 && sizeof(block_q3_k) == 110,
               "256-value block sizes");

/* IQ4_NL / IQ4_XS: each 4-bit code indexes these 16 non-uniform levels (ggml's kvalues_iq4nl). */
static const int8_t IQ4_GRID[16] __attribute__((unused)) = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

#if defined(__AVX2__)
/* 32 codes 0..15 -> their grid values, one table lookup per byte (ggml-cpu's way). */
static inline __m256i iq4_grid_values(__m256i codes) {
    const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_GRID));
    return _mm256_shuffle_epi8(grid, codes);
}
#endif

#endif
