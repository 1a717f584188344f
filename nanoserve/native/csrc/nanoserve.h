/* nanoserve native kernels: the conventions every file in csrc/ follows.
 *
 * Layout by role, as ggml-cpu keeps arch/ beside its generic kernels (every include is written
 * from csrc/, which build.py puts on the include path):
 * - runtime/: the thread pool, the ISA this CPU runs (isa.h), the ABI query, the shared-memory
 *   collective.
 * - quant/: activations quantized to 8-bit blocks and the GGUF block structs (quant_blocks.h),
 *   the repacking of the file's blocks at load, row lookups of a quantized table.
 * - gemm/: the matrix products, one file a layout (the file's blocks, the 8-column groups of
 *   matmul_x8.c and matmul_kx8.c with their shared driver column_groups, float panels, the Q4
 *   GEMM), each with its portable C and AVX2 paths.
 * - arch/x86/: the wider ISAs' tiles (AVX-512, AVX-512 VNNI, AVX-VNNI) and the peak probe.
 * - stages/: a step's fused stages (stages.h): attention over the paged cache, norms, RoPE and
 *   activations, each projection's stage, MoE, LoRA, and the one-call decoder that runs them.
 *
 * - Plain C11, compiled once per machine with -O3 -march=native (build.py). Each AVX2 path
 *   sits beside a portable C version of the same function, under #if on the compiler's own
 *   macros (__AVX2__, __FMA__, __F16C__), so any machine with a C compiler gets a working
 *   library (portable C where it has no AVX2), and a test can hold the fast path against the
 *   portable one. The block tiles' wider paths (AVX-512, AVX-512 VNNI, AVX-VNNI: arch/x86/)
 *   select their ISA per file with GCC's target pragma and are chosen at run time by cpuid
 *   (runtime/isa.h), each held against the same portable reference.
 * - Batch invariance by construction: a kernel never splits a row's reduction (the K axis)
 *   across threads or in a way that depends on how many rows share the call or where the row
 *   sits. Threads split output columns; row blocking only reuses a weight block across rows.
 * - Threads come from the library's own pool (runtime/threadpool.c), sized by an explicit
 *   argument (num_threads) that Python passes from the start-up policy (worker/startup.py), so
 *   --threads holds on whatever thread the engine's loop runs.
 * - Tensors are passed as raw pointers to contiguous memory; sizes are int64_t.
 */
#ifndef NANOSERVE_H
#define NANOSERVE_H

#include <math.h>
#include <stdint.h>

/* Bumped when a function's signature changes, so Python refuses a stale library. */
#define NS_ABI_VERSION 4

#if defined(_MSC_VER)
#define NS_EXPORT __declspec(dllexport)
#else
#define NS_EXPORT __attribute__((visibility("default")))
#endif

/* The KV cache's dtypes (stages.h's ns_kv_rows, nanoserve/native/attention.py's codes). */
enum { NS_KV_F32 = 0, NS_KV_F16 = 1, NS_KV_BF16 = 2, NS_KV_Q8_0 = 3 };

/* attention.c's fixed cuts of a row's context, in slots from position 0: the partitions the
 * threads share out and merge in order, and the tiles of one online-softmax step. A row's bits
 * depend on them; change them and every cached bit of every test moves. */
#define NS_ATTN_PARTITION 256
#define NS_ATTN_TILE 64
/* attention.c's paths, as bits: ns_tiled_attention takes one (0: the widest this CPU runs),
 * ns_attention_isas returns those this CPU runs. */
enum { NS_ATTN_PORTABLE = 1, NS_ATTN_AVX2 = 2, NS_ATTN_AVX512 = 4 };

/* threadpool.c: run task(context, t, threads) for t = 0..threads-1 (t = 0 on the caller) and
 * return when every one has; ns_barrier(threads) inside a task waits for its other threads.
 * A task may be given fewer threads than asked for (one, when another caller holds the pool). */
typedef void (*ns_task)(void *context, int thread, int threads);
void ns_parallel(int threads, ns_task task, void *context);
void ns_barrier(int threads);

/* lookup.c: out [count, k] = rows ids[i] of a matrix W [n, k], `row(fmt, w, id, k, out_row)`
 * writing each, the rows split among the threads. Returns 0, or -3 for an id outside [0, n). */
typedef void (*ns_lookup_row)(int fmt, const uint8_t *w, int64_t id, int64_t k, float *out);
int ns_lookup_rows(ns_lookup_row row, int fmt, const uint8_t *w, const int64_t *ids, int64_t count, int64_t n,
                   int64_t k, float *out, int num_threads);

/* [begin, end) of `count` items for thread t of `threads`: contiguous, in order. */
static inline void ns_share(int64_t count, int thread, int threads, int64_t *begin, int64_t *end) {
    *begin = count * thread / threads;
    *end = count * (thread + 1) / threads;
}

/* The float kernels' portable multiply-add: fmaf where the machine has a fused multiply-add
 * (then it is one instruction and the portable chain equals the AVX2 one), a plain
 * multiply-add elsewhere, still one fixed order. NS_PORTABLE_FUSED says which (the tests ask). */
#ifdef FP_FAST_FMAF
#define NS_MADD(a, b, c) fmaf((a), (b), (c))
#define NS_PORTABLE_FUSED 1
#else
#define NS_MADD(a, b, c) ((a) * (b) + (c))
#define NS_PORTABLE_FUSED 0
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
