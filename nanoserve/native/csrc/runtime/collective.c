/* One exchange of the shared-memory collectives between tensor-parallel ranks on one machine
 * (distributed/shared_memory.py owns the buffer, its layout and the waits that may sleep).
 *
 * In Python an exchange is a handful of torch and numpy calls and a polling loop, tens of
 * microseconds a rank; a decode step makes two a layer. Here the write of this rank's slot,
 * the publication of its counter (a release store, after the data), the spin on the other
 * ranks' counters (acquire loads) and the sum in rank order are one call. The spin is bounded:
 * past `spin_us` the call returns 1 and Python's wait takes over (it sleeps, and asks whether a
 * rank died), then calls ns_shm_sum itself.
 *
 * The sum adds the slots in rank order 0..N-1, one element at a time (no reassociation, no
 * FMA), so its bits are those of torch's `slots[0] + slots[1] + ...` whatever rank arrived first.
 */
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "nanoserve.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Whether every rank's counter (one int64 every `stride` words) has reached `exchange`. */
static int all_arrived(const int64_t *counters, int64_t stride, int world, int64_t exchange) {
    for (int r = 0; r < world; r++)
        if (atomic_load_explicit((_Atomic int64_t *)&counters[r * stride], memory_order_acquire) < exchange)
            return 0;
    return 1;
}

/* Copies `nbytes` of `x` into this rank's slot (`slots` + rank * slot_bytes), publishes
 * `exchange` in its counter, and spins up to `spin_us` for the other ranks: 0 when all have
 * published, 1 when the spin ran out (the caller waits on). */
NS_EXPORT int ns_shm_publish(int64_t *counters, int64_t stride, int rank, int world, int64_t exchange,
                             uint8_t *slots, int64_t slot_bytes, const void *x, int64_t nbytes,
                             int64_t spin_us) {
    memcpy(slots + rank * slot_bytes, x, (size_t)nbytes);
    atomic_store_explicit((_Atomic int64_t *)&counters[rank * stride], exchange, memory_order_release);
    int64_t deadline = 0;
    for (unsigned polls = 0; !all_arrived(counters, stride, world, exchange); polls++) {
        CPU_RELAX();
        if ((polls & 63) != 63) continue;
        int64_t t = now_us();
        if (deadline == 0) deadline = t + spin_us;
        if (t >= deadline) return 1;
    }
    return 0;
}

/* out[i] = slot 0[i] + slot 1[i] + ... + slot world-1[i] (float32, `n` elements, slots
 * `slot_floats` apart), after every rank has published. */
NS_EXPORT void ns_shm_sum(const float *slots, int64_t slot_floats, int world, int64_t n, float *out) {
    memcpy(out, slots, sizeof(float) * (size_t)n);
    for (int r = 1; r < world; r++) {
        const float *slot = slots + r * slot_floats;
        for (int64_t i = 0; i < n; i++) out[i] += slot[i];
    }
}

/* ns_shm_publish of float32 `x` [n], then, when every rank arrived within the spin, ns_shm_sum
 * into `out`: one call for a whole all-reduce. 1: the spin ran out, `out` untouched (the caller
 * waits, then calls ns_shm_sum). */
NS_EXPORT int ns_shm_all_reduce(int64_t *counters, int64_t stride, int rank, int world, int64_t exchange,
                                uint8_t *slots, int64_t slot_bytes, const float *x, int64_t n, float *out,
                                int64_t spin_us) {
    if (ns_shm_publish(counters, stride, rank, world, exchange, slots, slot_bytes, x,
                       n * (int64_t)sizeof(float), spin_us) != 0)
        return 1;
    ns_shm_sum((const float *)slots, slot_bytes / (int64_t)sizeof(float), world, n, out);
    return 0;
}
