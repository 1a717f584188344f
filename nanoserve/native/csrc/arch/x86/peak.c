/* The peak probe: how many int8 multiply-adds and float32 fused multiply-adds this machine's
 * cores retire a second on an ISA (isa.h), for `nanoserve profile` to read each step against.
 *
 * Each thread runs independent chains of the ISA's widest instruction (vpdpbusd, or maddubs +
 * madd + add without VNNI, which is what the tiles run there; vfmadd231ps), enough chains to
 * cover the instruction's latency, over registers that never touch memory. The count of
 * operations (a multiply and an add each) comes back; Python times the call. */
#include <stdint.h>

#include "runtime/isa.h"
#include "nanoserve.h"

enum { PEAK_CHAINS = 12 };

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* The compiler must not see the chains' inputs as constants it could fold or merge. */
#define PEAK_OPAQUE(v) __asm__ volatile("" : "+v"(v))

/* Twelve named chains (an array of them cost register copies every round) */
#define PEAK_BODY(VEC, ZERO, SET1, STEP, LANES, ELEMENT_OPS)                                 \
    VEC a = SET1(1), b = SET1(2);                                                             \
    PEAK_OPAQUE(a);                                                                           \
    PEAK_OPAQUE(b);                                                                           \
    VEC c0 = ZERO(), c1 = ZERO(), c2 = ZERO(), c3 = ZERO(), c4 = ZERO(), c5 = ZERO();         \
    VEC c6 = ZERO(), c7 = ZERO(), c8 = ZERO(), c9 = ZERO(), c10 = ZERO(), c11 = ZERO();       \
    PEAK_OPAQUE(c0); PEAK_OPAQUE(c1); PEAK_OPAQUE(c2); PEAK_OPAQUE(c3); PEAK_OPAQUE(c4);      \
    PEAK_OPAQUE(c5); PEAK_OPAQUE(c6); PEAK_OPAQUE(c7); PEAK_OPAQUE(c8); PEAK_OPAQUE(c9);      \
    PEAK_OPAQUE(c10); PEAK_OPAQUE(c11); /* twelve chains the compiler cannot merge */         \
    for (int64_t i = 0; i < iterations; i++) {                                                \
        c0 = STEP(c0, a, b), c1 = STEP(c1, a, b), c2 = STEP(c2, a, b), c3 = STEP(c3, a, b);   \
        c4 = STEP(c4, a, b), c5 = STEP(c5, a, b), c6 = STEP(c6, a, b), c7 = STEP(c7, a, b);   \
        c8 = STEP(c8, a, b), c9 = STEP(c9, a, b), c10 = STEP(c10, a, b), c11 = STEP(c11, a, b); \
    }                                                                                         \
    PEAK_OPAQUE(c0); PEAK_OPAQUE(c1); PEAK_OPAQUE(c2); PEAK_OPAQUE(c3); PEAK_OPAQUE(c4);      \
    PEAK_OPAQUE(c5); PEAK_OPAQUE(c6); PEAK_OPAQUE(c7); PEAK_OPAQUE(c8); PEAK_OPAQUE(c9);      \
    PEAK_OPAQUE(c10); PEAK_OPAQUE(c11);                                                       \
    return iterations * PEAK_CHAINS * (LANES) * (ELEMENT_OPS);

#define DPBUSD512(acc, a, b) _mm512_dpbusd_epi32(acc, a, b)
/* Without VNNI a step's product depends on a and b alone: `a` is marked changed before each
 * step, or the compiler computes the product once for every chain (or once for the loop). */
#define MADDUBS512(acc, a, b) \
    ({ PEAK_OPAQUE(a); _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1))); })
#define DPBUSD256(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#define MADDUBS256(acc, a, b) \
    ({ PEAK_OPAQUE(a); _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))); })
#define SET1_BYTES512(v) _mm512_set1_epi8((char)(v))
#define SET1_BYTES256(v) _mm256_set1_epi8((char)(v))

/* int8 operations (multiply + add = 2 per byte pair) in `iterations` rounds */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static int64_t int8_avx512vnni(int64_t iterations) {
    PEAK_BODY(__m512i, _mm512_setzero_si512, SET1_BYTES512, DPBUSD512, 64, 2)
}
__attribute__((target("avx512f,avx512bw"))) static int64_t int8_avx512(int64_t iterations) {
    PEAK_BODY(__m512i, _mm512_setzero_si512, SET1_BYTES512, MADDUBS512, 64, 2)
}
__attribute__((target("avx2,avxvnni"))) static int64_t int8_avxvnni(int64_t iterations) {
    PEAK_BODY(__m256i, _mm256_setzero_si256, SET1_BYTES256, DPBUSD256, 32, 2)
}
__attribute__((target("avx2"))) static int64_t int8_avx2(int64_t iterations) {
    PEAK_BODY(__m256i, _mm256_setzero_si256, SET1_BYTES256, MADDUBS256, 32, 2)
}
#define FMA512(acc, a, b) _mm512_fmadd_ps(a, b, acc)
#define FMA256(acc, a, b) _mm256_fmadd_ps(a, b, acc)
__attribute__((target("avx512f"))) static int64_t f32_avx512(int64_t iterations) {
    PEAK_BODY(__m512, _mm512_setzero_ps, _mm512_set1_ps, FMA512, 16, 2)
}
__attribute__((target("avx2,fma"))) static int64_t f32_avx2(int64_t iterations) {
    PEAK_BODY(__m256, _mm256_setzero_ps, _mm256_set1_ps, FMA256, 8, 2)
}

static int64_t peak_ops(int isa, int float32, int64_t iterations) {
    switch (isa) {
    case NS_ISA_AVX512VNNI: return float32 ? f32_avx512(iterations) : int8_avx512vnni(iterations);
    case NS_ISA_AVX512: return float32 ? f32_avx512(iterations) : int8_avx512(iterations);
    case NS_ISA_AVXVNNI: return float32 ? f32_avx2(iterations) : int8_avxvnni(iterations);
    case NS_ISA_AVX2: return float32 ? f32_avx2(iterations) : int8_avx2(iterations);
    default: return 0;
    }
}
#else
static int64_t peak_ops(int isa, int float32, int64_t iterations) {
    (void)isa, (void)float32, (void)iterations;
    return 0;
}
#endif

typedef struct {
    int isa, float32;
    int64_t iterations;
    int64_t ops[256];
} PeakJob;

static void peak_task(void *context, int thread, int threads) {
    PeakJob *job = context;
    (void)threads;
    job->ops[thread] = peak_ops(job->isa, job->float32, job->iterations);
}

/* Operations retired by `num_threads` threads (at most 256), each running `iterations` rounds
 * of ISA `isa`'s int8 dot product (float32: its float32 FMA); 0 where the ISA does not run here
 * or has no vector path. Python divides by the call's time. */
NS_EXPORT int64_t ns_peak_ops(int isa, int float32, int64_t iterations, int num_threads) {
    if (isa == NS_ISA_PORTABLE || !ns_isa_runs(isa)) return 0;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > 256) num_threads = 256;
    PeakJob job = {isa, float32, iterations, {0}};
    ns_parallel(num_threads, peak_task, &job);
    int64_t total = 0;
    for (int t = 0; t < num_threads; t++) total += job.ops[t];
    return total;
}
