/* LoRA's low-rank updates, every adapter of a step in one pass per target matrix:
 *     y[r] += (x[r] @ A^T) @ B^T     for each row r that runs with an adapter,
 * A and B that row's adapter's (vLLM's punica "shrink" then "expand", on the CPU). The base
 * projection ran once for all rows before; rows without an adapter, or whose adapter does not
 * target this matrix, are left alone.
 *
 * Layout (nanoserve/native/lora.py builds it once per adapter at load): per layer and target,
 * A stacked over the target's modules [rank, k] (q, k and v share the qkv target), and each
 * module's B as a "piece": the output columns it writes and the ranks of A it reads, transposed
 * to [rank, width] so an expand step reads 8 consecutive columns; the adapter's scaling is
 * folded into B. A fused B would hold zeros wherever a module's columns meet another module's
 * ranks; the pieces skip them.
 *
 * The arithmetic, and why a row's bits never depend on its neighbours:
 * - shrink: u[r][j] = dot(x[r], A[j]) as 8 lanes of fused multiply-add chains over k (lane l
 *   takes k = l, l + 8, ...), summed as ns_hsum256 sums, then any k % 8 tail chained on;
 * - expand: y[r][c] += (u[r][0] * Bt[0][c] + ... chained as fused multiply-adds from 0 in
 *   order of rank), one add into y at the end.
 * Rows are grouped only to reuse a loaded A row or Bt row (up to ROWS consecutive rows of the
 * same adapter); threads take units of (row block, rank) in the shrink and ranges of output
 * columns in the expand, never a part of a reduction. So a row's result is the same alone, in a
 * crowd of other adapters or of none, at any thread count; and the portable path below runs
 * the same chains (equal bits where fmaf is fused, as matmul_float.c's).
 */
#include <math.h>

#include "nanoserve.h"
#include "stages/stages.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NS_LORA_AVX2 1
#endif

enum { ROWS = 4, LANES = 8 };

#define NS_LORA_INLINE static inline __attribute__((always_inline))

/* The update of row `row` at target `at`, or NULL: no adapter, or its adapter skips `at`. */
static const ns_lora_update *row_update(const ns_lora_step *l, int64_t at, int64_t row) {
    const int32_t slot = l->row_slot[row];
    if (slot < 0) return NULL;
    const ns_lora_update *u = &l->updates[slot][at];
    return u->a != NULL ? u : NULL;
}

/* The next block of rows at or after `row` with an update at `at`: [*start, *stop), at most
 * ROWS consecutive rows of one adapter. Returns its update, or NULL past the last row. */
static const ns_lora_update *next_block(const ns_lora_step *l, int64_t at, int64_t rows, int64_t row,
                                        int64_t *start, int64_t *stop) {
    while (row < rows && row_update(l, at, row) == NULL) row++;
    if (row == rows) return NULL;
    const ns_lora_update *u = row_update(l, at, row);
    int64_t end = row + 1;
    while (end < rows && end - row < ROWS && l->row_slot[end] == l->row_slot[row]) end++;
    *start = row;
    *stop = end;
    return u;
}

/* Lane sums in ns_hsum256's order: (l0 + l4) + (l2 + l6), then + ((l1 + l5) + (l3 + l7)). */
static float portable_hsum(const float lanes[LANES]) {
    const float s0 = lanes[0] + lanes[4], s1 = lanes[1] + lanes[5], s2 = lanes[2] + lanes[6],
                s3 = lanes[3] + lanes[7];
    return (s0 + s2) + (s1 + s3);
}

/* u[r][j] = dot(x[r], a) for the `count` rows from x (row stride k) into u (row stride `ustride`). */
NS_LORA_INLINE void shrink_rows(const float *x, const float *a, float *u, int64_t count, int64_t k,
                                int64_t ustride, int portable) {
    const int64_t body = k - k % LANES;
    float sums[ROWS];
#if NS_LORA_AVX2
    if (!portable) {
        __m256 acc[ROWS];
        for (int64_t r = 0; r < count; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < body; i += LANES) {
            const __m256 w = _mm256_loadu_ps(a + i);
            for (int64_t r = 0; r < count; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i), w, acc[r]);
        }
        for (int64_t r = 0; r < count; r++) sums[r] = ns_hsum256(acc[r]);
    } else
#endif
    {
        for (int64_t r = 0; r < count; r++) {
            float lanes[LANES] = {0};
            for (int64_t i = 0; i < body; i += LANES)
                for (int lane = 0; lane < LANES; lane++)
                    lanes[lane] = NS_MADD(x[r * k + i + lane], a[i + lane], lanes[lane]);
            sums[r] = portable_hsum(lanes);
        }
    }
    (void)portable;
    for (int64_t r = 0; r < count; r++) {
        float sum = sums[r];
        for (int64_t i = body; i < k; i++) sum = NS_MADD(x[r * k + i], a[i], sum);
        u[r * ustride] = sum;
    }
}

/* y[r][c] += sum over j of u[r][j] * bt[j][c], for columns [begin, end) of a piece (y, bt and the
 * columns all counted from the piece's first column). */
NS_LORA_INLINE void expand_rows(const float *u, int64_t ustride, const float *bt, int64_t width, int64_t rank,
                                float *y, int64_t ystride, int64_t count, int64_t begin, int64_t end, int portable) {
    int64_t c = begin;
#if NS_LORA_AVX2
    if (!portable) {
        for (; c + LANES <= end; c += LANES) {
            __m256 acc[ROWS];
            for (int64_t r = 0; r < count; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t j = 0; j < rank; j++) {
                const __m256 w = _mm256_loadu_ps(bt + j * width + c);
                for (int64_t r = 0; r < count; r++)
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(u[r * ustride + j]), w, acc[r]);
            }
            for (int64_t r = 0; r < count; r++) {
                float *out = y + r * ystride + c;
                _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), acc[r]));
            }
        }
    }
#endif
    (void)portable;
    for (; c < end; c++)
        for (int64_t r = 0; r < count; r++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < rank; j++) acc = NS_MADD(u[r * ustride + j], bt[j * width + c], acc);
            y[r * ystride + c] += acc;
        }
}

/* The row-block functions with the block's row count a constant, so its accumulators stay in
 * registers. */
static void shrink_block(const float *x, const float *a, float *u, int64_t count, int64_t k, int64_t ustride,
                         int portable) {
    switch (count) {
    case 1: shrink_rows(x, a, u, 1, k, ustride, portable); break;
    case 2: shrink_rows(x, a, u, 2, k, ustride, portable); break;
    case 3: shrink_rows(x, a, u, 3, k, ustride, portable); break;
    default: shrink_rows(x, a, u, ROWS, k, ustride, portable); break;
    }
}

static void expand_block(const float *u, int64_t ustride, const float *bt, int64_t width, int64_t rank, float *y,
                         int64_t ystride, int64_t count, int64_t begin, int64_t end, int portable) {
    switch (count) {
    case 1: expand_rows(u, ustride, bt, width, rank, y, ystride, 1, begin, end, portable); break;
    case 2: expand_rows(u, ustride, bt, width, rank, y, ystride, 2, begin, end, portable); break;
    case 3: expand_rows(u, ustride, bt, width, rank, y, ystride, 3, begin, end, portable); break;
    default: expand_rows(u, ustride, bt, width, rank, y, ystride, ROWS, begin, end, portable); break;
    }
}

int ns_lora_touches(const ns_lora_step *l, int64_t at, int64_t rows) {
    for (int64_t row = 0; row < rows; row++)
        if (row_update(l, at, row) != NULL) return 1;
    return 0;
}

static void shrink(const ns_lora_step *l, int64_t at, const float *x, int64_t rows, int64_t k, int thread,
                   int threads, int portable) {
    int64_t units = 0, start, stop;
    const ns_lora_update *u;
    for (int64_t row = 0; (u = next_block(l, at, rows, row, &start, &stop)) != NULL; row = stop) units += u->rank;
    int64_t begin, end, unit = 0;
    ns_share(units, thread, threads, &begin, &end);
    for (int64_t row = 0; unit < end && (u = next_block(l, at, rows, row, &start, &stop)) != NULL; row = stop) {
        for (int64_t j = 0; j < u->rank; j++, unit++)
            if (unit >= begin && unit < end)
                shrink_block(x + start * k, u->a + j * k, l->shrunk + start * l->max_rank + j, stop - start, k,
                            l->max_rank, portable);
    }
}

static void expand(const ns_lora_step *l, int64_t at, float *y, int64_t rows, int64_t n, int thread,
                   int threads, int portable) {
    int64_t groups_begin, groups_end, start, stop;
    ns_share((n + LANES - 1) / LANES, thread, threads, &groups_begin, &groups_end);
    const int64_t first = groups_begin * LANES, last = groups_end * LANES < n ? groups_end * LANES : n;
    if (first >= last) return;
    const ns_lora_update *u;
    for (int64_t row = 0; (u = next_block(l, at, rows, row, &start, &stop)) != NULL; row = stop)
        for (int64_t p = 0; p < u->pieces; p++) {
            const ns_lora_piece *piece = &u->piece[p];
            const int64_t begin = first > piece->column ? first : piece->column;
            const int64_t end = last < piece->column + piece->width ? last : piece->column + piece->width;
            if (begin >= end) continue;
            expand_block(l->shrunk + start * l->max_rank + piece->rank_start, l->max_rank, piece->bt, piece->width,
                         piece->rank, y + start * n + piece->column, n, stop - start, begin - piece->column,
                         end - piece->column, portable);
        }
}

void ns_stage_lora_shrink(const ns_lora_step *l, int64_t at, const float *x, int64_t rows, int64_t k, int thread,
                          int threads) {
    shrink(l, at, x, rows, k, thread, threads, 0);
}

void ns_stage_lora_expand(const ns_lora_step *l, int64_t at, float *y, int64_t rows, int64_t n, int thread,
                          int threads) {
    expand(l, at, y, rows, n, thread, threads, 0);
}

typedef struct {
    const ns_lora_step *l;
    int64_t at, rows, n, k;
    const float *x;
    float *y;
    int portable;
} LoraJob;

static void lora_task(void *context, int thread, int threads) {
    const LoraJob *job = context;
    shrink(job->l, job->at, job->x, job->rows, job->k, thread, threads, job->portable);
    ns_barrier(threads);
    expand(job->l, job->at, job->y, job->rows, job->n, thread, threads, job->portable);
}

/* y [rows, n] += each row's update at target `at` of its adapter's tables, x [rows, k] its
 * input: the per-layer loop's call (the one-call decoder runs the two stages itself). */
static int lora_apply(const ns_lora_step *l, int64_t at, const float *x, float *y, int64_t rows, int64_t n,
                      int64_t k, int num_threads, int portable) {
    if (!ns_lora_touches(l, at, rows)) return 0;
    LoraJob job = {l, at, rows, n, k, x, y, portable};
    ns_parallel(num_threads, lora_task, &job);
    return 0;
}

NS_EXPORT int ns_lora_apply(const ns_lora_step *l, int64_t at, const float *x, float *y, int64_t rows, int64_t n,
                            int64_t k, int num_threads) {
    return lora_apply(l, at, x, y, rows, n, k, num_threads, 0);
}

NS_EXPORT int ns_lora_apply_portable(const ns_lora_step *l, int64_t at, const float *x, float *y, int64_t rows,
                                     int64_t n, int64_t k, int num_threads) {
    return lora_apply(l, at, x, y, rows, n, k, num_threads, 1);
}

NS_EXPORT int ns_lora_portable_fused(void) { return NS_PORTABLE_FUSED; }

NS_EXPORT int ns_lora_pieces(void) { return NS_LORA_PIECES; }
