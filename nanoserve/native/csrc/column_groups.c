/* column_groups.h's driver: the loops every interleaved-column layout runs its tile in. */
#include <stdlib.h>

#include "column_groups.h"
#include "nanoserve.h"

/* A call of at most this many rows has every thread quantize all of them into its own copy
 * (a few hundred nanoseconds a row) rather than split them and wait at a barrier: on a busy
 * machine a barrier can wait a whole time slice for a descheduled thread. The codes are the
 * same either way. */
#define PRIVATE_ROWS 8

void ns_column_groups(const ns_group_layout *layout, const xblock *xq, const uint8_t *w, float *y, int64_t y_stride,
                      int64_t rows, int64_t n, int64_t k, int thread, int threads) {
    const int64_t blocks = k / 32, groups = (n + NS_GROUP_COLUMNS - 1) / NS_GROUP_COLUMNS;
    int64_t begin, end;
    ns_share(groups, thread, threads, &begin, &end);
    for (int64_t panel = 0; panel < rows; panel += NS_GROUP_PANEL) {
        const int panel_rows = rows - panel < NS_GROUP_PANEL ? (int)(rows - panel) : NS_GROUP_PANEL;
        const int tiles = (panel_rows + layout->tile_height - 1) / layout->tile_height;
        for (int64_t g = begin; g < end; g++) {
            const int valid = n - g * NS_GROUP_COLUMNS < NS_GROUP_COLUMNS ? (int)(n - g * NS_GROUP_COLUMNS)
                                                                          : NS_GROUP_COLUMNS;
            for (int i = 0, r = 0; i < tiles; i++) {
                const int tile_rows = panel_rows / tiles + (i < panel_rows % tiles);
                layout->tile(layout->fmt, tile_rows, w + g * layout->group_bytes, xq + (panel + r) * blocks, blocks,
                             y + (panel + r) * y_stride + g * NS_GROUP_COLUMNS, y_stride, valid);
                r += tile_rows;
            }
        }
    }
}

typedef struct {
    const ns_group_layout *layout;
    void (*quantize)(const float *x, int64_t k, xblock *out);
    const float *x;
    const uint8_t *w;
    xblock *xq;
    float *y;
    int64_t rows, n, k;
} GroupsJob;

static void groups_task(void *context, int thread, int threads) {
    const GroupsJob *job = context;
    const int64_t blocks = job->k / 32;
    xblock *xq = job->xq;
    int64_t begin, end;
    if (job->rows <= PRIVATE_ROWS) {
        xq += thread * job->rows * blocks;
        begin = 0, end = job->rows;
    } else {
        ns_share(job->rows, thread, threads, &begin, &end);
    }
    for (int64_t r = begin; r < end; r++) job->quantize(job->x + r * job->k, job->k, xq + r * blocks);
    if (job->rows > PRIVATE_ROWS) ns_barrier(threads);
    ns_column_groups(job->layout, xq, job->w, job->y, job->n, job->rows, job->n, job->k, thread, threads);
}

int ns_matmul_column_groups(const ns_group_layout *layout, void (*quantize)(const float *, int64_t, xblock *),
                            const float *x, const uint8_t *w, float *y, int64_t rows, int64_t n, int64_t k,
                            int num_threads) {
    const int64_t groups = (n + NS_GROUP_COLUMNS - 1) / NS_GROUP_COLUMNS;
    if (num_threads > groups) num_threads = (int)groups;
    if (num_threads < 1) num_threads = 1;
    const int64_t copies = rows <= PRIVATE_ROWS ? num_threads : 1;
    xblock *xq = malloc(sizeof(xblock) * (size_t)(copies * rows * (k / 32)));
    if (xq == NULL) return -2;
    GroupsJob job = {layout, quantize, x, w, xq, y, rows, n, k};
    ns_parallel(num_threads, groups_task, &job);
    free(xq);
    return 0;
}
