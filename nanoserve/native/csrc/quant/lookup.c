/* Row lookups of a weight matrix (a quantized token table's embedding rows, or a tied head's
 * table serving them): every layout's exported ns_dequantize_rows* checks its own format and
 * width, then hands this driver the one thing that differs, how one row is written. */
#include "nanoserve.h"

typedef struct {
    ns_lookup_row row;
    int fmt;
    const uint8_t *w;
    const int64_t *ids;
    int64_t count, k;
    float *out;
} LookupJob;

static void lookup_task(void *context, int thread, int threads) {
    const LookupJob *job = context;
    int64_t begin, end;
    ns_share(job->count, thread, threads, &begin, &end);
    for (int64_t i = begin; i < end; i++) job->row(job->fmt, job->w, job->ids[i], job->k, job->out + i * job->k);
}

int ns_lookup_rows(ns_lookup_row row, int fmt, const uint8_t *w, const int64_t *ids, int64_t count, int64_t n,
                   int64_t k, float *out, int num_threads) {
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return -3;
    LookupJob job = {row, fmt, w, ids, count, k, out};
    ns_parallel(count > 1 ? num_threads : 1, lookup_task, &job);
    return 0;
}
