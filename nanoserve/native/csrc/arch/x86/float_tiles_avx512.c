/* matmul_float.c's float panels on AVX-512 F: a tile of up to 12 rows x two 16-column panels.
 *
 * A panel step (16 columns at one k) is one zmm, so a row's two panels take two accumulators;
 * 12 rows keep 24 of the 32 registers, with the two panel steps and a broadcast beside them.
 * Per k: two weight loads and 12 broadcasts feed 24 FMAs, half the instructions of the AVX2
 * tile's 6 x 16 for the same arithmetic, which is what lets a prompt-sized call approach the
 * FMA units' rate instead of the front end's. Each output is the same fma chain as every
 * other path's (float_tiles.h), so the bits equal the portable reference's. */
#include "gemm/float_tiles.h"

#include "stages/stages.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,fma,f16c")
#endif

#define FT_INLINE static inline __attribute__((always_inline))

/* Step kk of a full panel as 16 float32 columns, in order (widening is exact). */
FT_INLINE __m512 panel_step(const void *panel, int64_t kk, int type) {
    if (type == NS_F16_PANELS)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)panel + kk * NS_FLOAT_PANEL)));
    if (type == NS_BF16_PANELS) {
        /* the panel interleaves c0 c8 c1 c9 ... (matmul_float.c): the low halves are columns 0..7 */
        const __m256i words = _mm256_loadu_si256((const __m256i *)((const uint16_t *)panel + kk * NS_FLOAT_PANEL));
        const __m256i lo = _mm256_slli_epi32(words, 16);
        const __m256i hi = _mm256_and_si256(words, _mm256_set1_epi32((int)0xffff0000u));
        return _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
    }
    return _mm512_loadu_ps((const float *)panel + kk * NS_FLOAT_PANEL);
}

/* R and type are compile-time constants in every instance; the accumulators are named
 * variables (an array of them is spilled to the stack at every k step by GCC 12). */
FT_INLINE void pair_tile(const float *x, int64_t k, const void *panels, float *y, int64_t y_stride, const int R,
                         const int type) {
    const size_t element = type == NS_F32_PANELS ? sizeof(float) : sizeof(uint16_t);
    const char *w0 = panels, *w1 = w0 + (size_t)(k * NS_FLOAT_PANEL) * element;
    __m512 a0 = _mm512_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    __m512 a4 = a0, b4 = a0, a5 = a0, b5 = a0, a6 = a0, b6 = a0, a7 = a0, b7 = a0;
    __m512 a8 = a0, b8 = a0, a9 = a0, b9 = a0, a10 = a0, b10 = a0, a11 = a0, b11 = a0;
    for (int64_t kk = 0; kk < k; kk++) {
        const __m512 lo = panel_step(w0, kk, type), hi = panel_step(w1, kk, type);
#define FT_ROW(i) \
        if (R > i) { \
            const __m512 xb = _mm512_set1_ps(x[i * k + kk]); \
            a##i = _mm512_fmadd_ps(xb, lo, a##i); \
            b##i = _mm512_fmadd_ps(xb, hi, b##i); \
        }
        FT_ROW(0) FT_ROW(1) FT_ROW(2) FT_ROW(3) FT_ROW(4) FT_ROW(5)
        FT_ROW(6) FT_ROW(7) FT_ROW(8) FT_ROW(9) FT_ROW(10) FT_ROW(11)
#undef FT_ROW
    }
#define FT_STORE(i) \
    if (R > i) { \
        _mm512_storeu_ps(y + i * y_stride, a##i); \
        _mm512_storeu_ps(y + i * y_stride + NS_FLOAT_PANEL, b##i); \
    }
    FT_STORE(0) FT_STORE(1) FT_STORE(2) FT_STORE(3) FT_STORE(4) FT_STORE(5)
    FT_STORE(6) FT_STORE(7) FT_STORE(8) FT_STORE(9) FT_STORE(10) FT_STORE(11)
#undef FT_STORE
}

#define FT_TILE(R, T) \
    static void pair_##R##_##T(const float *x, int64_t k, const void *panels, float *y, int64_t y_stride) { \
        pair_tile(x, k, panels, y, y_stride, R, T); \
    }
#define FT_TILES(T) FT_TILE(1, T) FT_TILE(2, T) FT_TILE(3, T) FT_TILE(4, T) FT_TILE(5, T) FT_TILE(6, T) \
                    FT_TILE(7, T) FT_TILE(8, T) FT_TILE(9, T) FT_TILE(10, T) FT_TILE(11, T) FT_TILE(12, T)
FT_TILES(NS_F32_PANELS)
FT_TILES(NS_F16_PANELS)
FT_TILES(NS_BF16_PANELS)
#define FT_BY_ROWS(T) {pair_1_##T, pair_2_##T, pair_3_##T, pair_4_##T, pair_5_##T, pair_6_##T, \
                       pair_7_##T, pair_8_##T, pair_9_##T, pair_10_##T, pair_11_##T, pair_12_##T}

typedef void (*pair_fn)(const float *, int64_t, const void *, float *, int64_t);
static const pair_fn F32_TILES[NS_FLOAT_PAIR_ROWS] = FT_BY_ROWS(NS_F32_PANELS);
static const pair_fn F16_TILES[NS_FLOAT_PAIR_ROWS] = FT_BY_ROWS(NS_F16_PANELS);
static const pair_fn BF16_TILES[NS_FLOAT_PAIR_ROWS] = FT_BY_ROWS(NS_BF16_PANELS);

static void pair_f32(int rows, const float *x, int64_t k, const void *panels, float *y, int64_t y_stride) {
    F32_TILES[rows - 1](x, k, panels, y, y_stride);
}
static void pair_f16(int rows, const float *x, int64_t k, const void *panels, float *y, int64_t y_stride) {
    F16_TILES[rows - 1](x, k, panels, y, y_stride);
}
static void pair_bf16(int rows, const float *x, int64_t k, const void *panels, float *y, int64_t y_stride) {
    BF16_TILES[rows - 1](x, k, panels, y, y_stride);
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

ns_float_pair_tile ns_float_pair_tile_avx512(int type) {
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
        return 0;
    return type == NS_F32_PANELS ? pair_f32 : type == NS_F16_PANELS ? pair_f16 : type == NS_BF16_PANELS ? pair_bf16 : 0;
}
#else
ns_float_pair_tile ns_float_pair_tile_avx512(int type) {
    (void)type;
    return 0;
}
#endif
