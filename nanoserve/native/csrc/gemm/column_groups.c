/* column_groups.h's driver: the loops every interleaved-column layout runs its tile in. */
#include <stdlib.h>

#include "gemm/column_groups.h"
#include "runtime/isa.h"
#include "nanoserve.h"

/* A call of at most this many rows has every thread quantize all of them into its own copy
 * (a few hundred nanoseconds a row) rather than split them and wait at a barrier: on a busy
 * machine a barrier can wait a whole time slice for a descheduled thread. The codes are the
 * same either way. */
#define PRIVATE_ROWS 8

/* The panel's rows in the fewest tiles of at most `height` rows, as even as they go. */
static int tile_count(int panel_rows, int height) { return (panel_rows + height - 1) / height; }
static int tile_rows(int panel_rows, int tiles, int i) { return panel_rows / tiles + (i < panel_rows % tiles); }

/* Columns of group g that exist (the last group of N may be short). */
static int valid_columns(int64_t n, int64_t g) {
    return n - g * NS_GROUP_COLUMNS < NS_GROUP_COLUMNS ? (int)(n - g * NS_GROUP_COLUMNS) : NS_GROUP_COLUMNS;
}

/* A thread's interleaved codes of one panel (ns_wide_interleave), kept between calls: the
 * pool's threads live as long as the process, and a panel's codes are the size of its rows. */
static __thread int32_t *panel_codes;
static __thread int64_t panel_codes_words;

static int32_t *panel_codes_for(int64_t words) {
    if (words > panel_codes_words) {
        int32_t *grown = realloc(panel_codes, (size_t)words * sizeof(int32_t));
        if (grown == NULL) return NULL;
        panel_codes = grown, panel_codes_words = words;
    }
    return panel_codes;
}

/* Groups [begin, end) in units of layout->wide_groups through the wide tile; a unit short of
 * groups (the last of N) passes stride 0 and stores only its own columns. Each tile's codes are
 * interleaved once for the panel, before its first unit. */
static void wide_units(const ns_group_layout *layout, const xblock *xq, const int32_t *codes_all, const uint8_t *w,
                       float *y, int64_t y_stride, int64_t panel, int panel_rows, int64_t n, int64_t blocks,
                       int64_t begin, int64_t end) {
    const int tiles = tile_count(panel_rows, layout->wide_height);
    for (int64_t g = begin; g < end; g += layout->wide_groups) {
        const int64_t last = g + layout->wide_groups <= end ? g + layout->wide_groups - 1 : end - 1;
        const int valid = (int)(last - g) * NS_GROUP_COLUMNS + valid_columns(n, last);
        const int64_t stride = last > g ? layout->group_bytes : 0;
        for (int i = 0, r = 0; i < tiles; i++) {
            const int rows = tile_rows(panel_rows, tiles, i);
            layout->wide(rows, w + g * layout->group_bytes, stride, xq + (panel + r) * blocks,
                         codes_all + r * blocks * 8, blocks, y + (panel + r) * y_stride + g * NS_GROUP_COLUMNS,
                         y_stride, valid, i == 0);
            r += rows;
        }
    }
}

/* The panel's codes, tile by tile, in the order wide_units reads them. */
static void interleave_panel(const ns_group_layout *layout, const xblock *xq, int64_t panel, int panel_rows,
                             int64_t blocks, int32_t *codes) {
    const int tiles = tile_count(panel_rows, layout->wide_height);
    for (int i = 0, r = 0; i < tiles; i++) {
        const int rows = tile_rows(panel_rows, tiles, i);
        ns_wide_interleave(xq + (panel + r) * blocks, rows, blocks, codes + r * blocks * 8);
        r += rows;
    }
}

/* One row runs the layout's own tile: the wide tiles pay off across rows, and a lone row (a
   1-slot decode step) ran slower through them (results/isa_compare_1.7b_q4_k_m_1slot.csv).
   Every tile gives the same bits, so the choice changes no output. */
static int runs_wide(const ns_group_layout *layout, int64_t rows) {
    return layout->wide != NULL && rows > 1;
}

void ns_column_groups(const ns_group_layout *layout, const xblock *xq, const uint8_t *w, float *y, int64_t y_stride,
                      int64_t rows, int64_t n, int64_t k, int thread, int threads) {
    const int64_t blocks = k / 32, groups = (n + NS_GROUP_COLUMNS - 1) / NS_GROUP_COLUMNS;
    const int64_t panel_words = (rows < NS_GROUP_PANEL ? rows : NS_GROUP_PANEL) * blocks * 8;
    /* without memory for the codes the layout's own tile runs: the same bits */
    int32_t *codes = runs_wide(layout, rows) ? panel_codes_for(panel_words) : NULL;
    const int wide = codes != NULL;
    /* threads split whole units, so only the matrix's last unit may be short (the same split
       whichever tile a thread then runs) */
    const int64_t unit = runs_wide(layout, rows) ? layout->wide_groups : 1;
    int64_t begin, end;
    ns_share((groups + unit - 1) / unit, thread, threads, &begin, &end);
    begin *= unit;
    end = end * unit < groups ? end * unit : groups;
    for (int64_t panel = 0; panel < rows; panel += NS_GROUP_PANEL) {
        const int panel_rows = rows - panel < NS_GROUP_PANEL ? (int)(rows - panel) : NS_GROUP_PANEL;
        if (wide) {
            interleave_panel(layout, xq, panel, panel_rows, blocks, codes);
            wide_units(layout, xq, codes, w, y, y_stride, panel, panel_rows, n, blocks, begin, end);
            continue;
        }
        const int tiles = tile_count(panel_rows, layout->tile_height);
        for (int64_t g = begin; g < end; g++) {
            for (int i = 0, r = 0; i < tiles; i++) {
                const int tile_rows_here = tile_rows(panel_rows, tiles, i);
                layout->tile(layout->fmt, tile_rows_here, w + g * layout->group_bytes, xq + (panel + r) * blocks,
                             blocks, y + (panel + r) * y_stride + g * NS_GROUP_COLUMNS, y_stride,
                             valid_columns(n, g));
                r += tile_rows_here;
            }
        }
    }
}

ns_group_layout ns_group_layout_on(ns_group_layout layout, int isa) {
    layout.wide = ns_wide_tile_on(isa, layout.fmt);
    layout.wide_groups = ns_wide_groups(isa);
    layout.wide_height = ns_wide_height(layout.fmt);
    return layout;
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
    const int64_t unit = runs_wide(layout, rows) ? layout->wide_groups : 1;
    const int64_t units = ((n + NS_GROUP_COLUMNS - 1) / NS_GROUP_COLUMNS + unit - 1) / unit;
    if (num_threads > units) num_threads = (int)units;
    if (num_threads < 1) num_threads = 1;
    const int64_t copies = rows <= PRIVATE_ROWS ? num_threads : 1;
    xblock *xq = malloc(sizeof(xblock) * (size_t)(copies * rows * (k / 32)));
    if (xq == NULL) return -2;
    GroupsJob job = {layout, quantize, x, w, xq, y, rows, n, k};
    ns_parallel(num_threads, groups_task, &job);
    free(xq);
    return 0;
}
