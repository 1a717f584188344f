/* nanoserve native kernels: the conventions every file in csrc/ follows.
 *
 * - Plain C11 with OpenMP, compiled once per machine with -O3 -march=native (build.py). Each
 *   ISA-specific path (AVX2, AVX-512, NEON) sits beside a portable version of the same
 *   function, under #if on the compiler's own macros (__AVX2__, __AVX512F__, ...), so any
 *   machine with a C compiler gets a working library, and a test can hold a fast path against
 *   the portable one.
 * - Batch invariance by construction: a kernel never splits a row's reduction (the K axis)
 *   across threads or in a way that depends on how many rows share the call or where the row
 *   sits. Threads split output columns; row blocking only reuses a weight block across rows.
 * - Threads are an explicit argument (num_threads), never OpenMP's per-thread default: the
 *   engine's loop may run on a thread OpenMP has never seen, and --threads must hold there.
 * - Tensors are passed as raw pointers to contiguous memory; sizes are int64_t.
 */
#ifndef NANOSERVE_H
#define NANOSERVE_H

#include <stdint.h>

/* Bumped when a function's signature changes, so Python refuses a stale library. */
#define NS_ABI_VERSION 1

#if defined(_MSC_VER)
#define NS_EXPORT __declspec(dllexport)
#else
#define NS_EXPORT __attribute__((visibility("default")))
#endif

#if defined(__AVX__)
#include <immintrin.h>
/* The sum of a vector's eight lanes, in one fixed order (low half + high half, then pairs):
 * every kernel that ends a row's reduction this way ends it the same way. */
static inline float ns_hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif
