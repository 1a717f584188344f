/* The library's one thread pool: workers that stay awake between calls.
 *
 * A decode step makes a few hundred short native calls. An OpenMP region forked per call pays
 * its start and its join every time, and each of them waits for a thread the OS may have put
 * to sleep; here the workers live as long as the process and, after a task, spin on the job
 * word for NS_POOL_SPIN_US before they sleep on a futex, so the next call of the same step
 * finds them awake, and an idle engine costs no CPU.
 *
 * ns_parallel(threads, task, context) runs task(context, t, threads) for t = 0..threads-1,
 * t = 0 on the calling thread, and returns when all have returned. Inside a task,
 * ns_barrier(threads) waits for the task's other threads. The split a task makes of its work
 * is its own business; the kernels split output columns or rows, never a reduction, so no
 * bit depends on the thread count (nanoserve.h).
 *
 * One caller at a time owns the workers: a second thread calling in while they are busy (a
 * server thread beside the engine loop) or a task calling ns_parallel runs its task on one
 * thread, inline, with the same bits. A forked child starts with no workers and spawns its own.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include "nanoserve.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

/* Long enough to bridge the Python between two calls of one step, short enough that a worker
 * spinning after the step does not take a core from torch's own threads for long. */
#define NS_POOL_SPIN_US 200
#define NS_POOL_MAX_THREADS 256

typedef struct {
    /* The job word: generation << 16 | threads, so a worker reads both in one load. */
    _Atomic uint64_t job;
    ns_task task;
    void *context;
    _Atomic int done;       /* workers finished with the current job */
    _Atomic uint32_t wake;  /* the futex word: bumped when a job is posted to sleepers */
    _Atomic int sleepers;
    _Atomic int arrived;    /* ns_barrier: threads at the barrier in this phase */
    _Atomic uint32_t phase;
    int workers;            /* started so far (threads 1..workers) */
    pthread_mutex_t owner;  /* held by the caller whose job the workers run */
} Pool;

static Pool pool = {.owner = PTHREAD_MUTEX_INITIALIZER};
/* Every ns_parallel call, for the profile: each exported kernel enters it once per call. */
static _Atomic uint64_t parallel_calls;
/* The job word when each worker was started: its first job is the next one (a worker that
 * read the word itself could start after the job it was made for, and miss it). */
static uint64_t first_seen[NS_POOL_MAX_THREADS];

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

#if defined(__linux__)
static void futex_wait(_Atomic uint32_t *word, uint32_t expected) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}
#else /* no futex: a sleeping worker polls every 100 us */
static void futex_wait(_Atomic uint32_t *word, uint32_t expected) {
    struct timespec nap = {0, 100000};
    if (atomic_load(word) == expected) nanosleep(&nap, NULL);
}

static void futex_wake_all(_Atomic uint32_t *word) { (void)word; }
#endif

/* The next job word after `seen`: spin a while, then sleep until a caller posts one. */
static uint64_t next_job(uint64_t seen) {
    int64_t deadline = 0;
    for (unsigned spins = 0;; spins++) {
        uint64_t job = atomic_load_explicit(&pool.job, memory_order_acquire);
        if (job != seen) return job;
        CPU_RELAX();
        if ((spins & 255) != 255) continue;
        int64_t t = now_us();
        if (deadline == 0) deadline = t + NS_POOL_SPIN_US;
        if (t >= deadline) break;
    }
    /* Dekker with ns_parallel: we count ourselves asleep, then look at the job once more; it
     * posts the job, then looks at the count. One of the two sees the other. */
    uint32_t wake = atomic_load(&pool.wake);
    atomic_fetch_add(&pool.sleepers, 1);
    uint64_t job;
    while ((job = atomic_load(&pool.job)) == seen) {
        futex_wait(&pool.wake, wake);
        wake = atomic_load(&pool.wake);
    }
    atomic_fetch_sub(&pool.sleepers, 1);
    return job;
}

static void *worker_main(void *arg) {
    const int id = (int)(intptr_t)arg;
    uint64_t seen = first_seen[id];
    for (;;) {
        seen = next_job(seen);
        int threads = (int)(seen & 0xFFFF);
        if (id >= threads) continue; /* a smaller job: the caller does not wait for us */
        pool.task(pool.context, id, threads);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
    }
    return NULL;
}

/* Workers 1..wanted-1 exist (as many as could be started); returns the team size to use. */
static int ensure_workers(int wanted) {
    while (pool.workers + 1 < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        first_seen[pool.workers + 1] = atomic_load(&pool.job);
        int failed = pthread_create(&thread, &attr, worker_main, (void *)(intptr_t)(pool.workers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.workers++;
    }
    return pool.workers + 1 < wanted ? pool.workers + 1 : wanted;
}

static void forget_workers_in_child(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pool.owner = fresh;
    pool.workers = 0;
    atomic_store(&pool.sleepers, 0);
}

static pthread_once_t fork_handler_once = PTHREAD_ONCE_INIT;
static void install_fork_handler(void) { pthread_atfork(NULL, NULL, forget_workers_in_child); }

void ns_parallel(int threads, ns_task task, void *context) {
    atomic_fetch_add_explicit(&parallel_calls, 1, memory_order_relaxed);
    if (threads > NS_POOL_MAX_THREADS) threads = NS_POOL_MAX_THREADS;
    if (threads <= 1 || pthread_mutex_trylock(&pool.owner) != 0) {
        task(context, 0, 1);
        return;
    }
    pthread_once(&fork_handler_once, install_fork_handler);
    threads = ensure_workers(threads);
    if (threads <= 1) {
        pthread_mutex_unlock(&pool.owner);
        task(context, 0, 1);
        return;
    }
    pool.task = task;
    pool.context = context;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.arrived, 0);
    uint64_t generation = (atomic_load(&pool.job) >> 16) + 1;
    atomic_store(&pool.job, generation << 16 | (uint64_t)threads);
    if (atomic_load(&pool.sleepers) > 0) {
        atomic_fetch_add(&pool.wake, 1);
        futex_wake_all(&pool.wake);
    }
    task(context, 0, threads);
    for (unsigned spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < threads - 1; spins++) {
        CPU_RELAX();
        if ((spins & 1023) == 1023) sched_yield(); /* a descheduled worker needs our core */
    }
    pthread_mutex_unlock(&pool.owner);
}

void ns_barrier(int threads) {
    if (threads <= 1) return;
    uint32_t phase = atomic_load(&pool.phase);
    if (atomic_fetch_add(&pool.arrived, 1) == threads - 1) {
        atomic_store(&pool.arrived, 0);
        atomic_store(&pool.phase, phase + 1);
        return;
    }
    for (unsigned spins = 0; atomic_load(&pool.phase) == phase; spins++) {
        CPU_RELAX();
        if ((spins & 1023) == 1023) sched_yield();
    }
}

/* The workers started so far (for the tests: a call must reuse them, not start new ones). */
NS_EXPORT int ns_pool_workers(void) { return pool.workers; }

/* Native kernel calls so far in this process (the profile's calls per step). */
NS_EXPORT uint64_t ns_native_calls(void) { return atomic_load_explicit(&parallel_calls, memory_order_relaxed); }
