/* The driver every layout of 8 interleaved output columns shares (matmul_x8.c, matmul_kx8.c):
 * the activation rows quantized once per call, then threads split the groups of 8 columns
 * (never a reduction), and each thread runs every panel of NS_GROUP_PANEL rows against its
 * groups one at a time, the panel's rows in the fewest tiles of at most the layout's height, as
 * even as they go (17 rows of height 8 are tiles of 6, 6 and 5, not 8, 8 and 1: a short tile
 * pays a whole tile's unpacking for few rows). A group's blocks stay in L1 while the panel's
 * rows meet them; the panel's quantized rows are read again for every group, so a panel is
 * small (32 rows x 18 blocks x 44 bytes at K = 576), and the weights are read once per panel:
 * a decode step of up to 32 rows streams them once. A row's bits never depend on its tile, its
 * panel or the thread split. */
#ifndef NANOSERVE_COLUMN_GROUPS_H
#define NANOSERVE_COLUMN_GROUPS_H

#include <stdint.h>

#include "arch/x86/wide_tiles_api.h"
#include "quant/quant_blocks.h"

enum { NS_GROUP_COLUMNS = 8, NS_GROUP_PANEL = 32 };

/* `rows` activation rows (`blocks` blocks each, one after another) against one group: their
 * outputs in y's rows, `y_stride` apart, its first `valid` columns. */
typedef void (*ns_group_tile)(int fmt, int rows, const uint8_t *group, const xblock *x, int64_t blocks, float *y,
                              int64_t y_stride, int valid);

/* How one layout runs: its tile, its format number, the most rows a tile takes, and one group's
 * bytes over the whole of K; and where an ISA has one, its wide tile (arch/x86/wide_tiles.h),
 * which then runs every group in units of `wide_groups` groups (NULL: `tile` runs them). */
typedef struct {
    ns_group_tile tile;
    int fmt;
    int tile_height;
    int64_t group_bytes;
    ns_wide_tile wide;
    int wide_groups, wide_height;
} ns_group_layout;

/* `layout` with ISA `isa`'s wide tile, where that ISA has one for the layout and runs here. */
ns_group_layout ns_group_layout_on(ns_group_layout layout, int isa);

/* Thread `thread`'s groups of columns of y [rows, n] = xq @ W^T, y's rows `y_stride` apart. */
void ns_column_groups(const ns_group_layout *layout, const xblock *xq, const uint8_t *w, float *y, int64_t y_stride,
                      int64_t rows, int64_t n, int64_t k, int thread, int threads);

/* y [rows, n] = x [rows, k] @ W^T in one parallel region: each row quantized by `quantize`,
 * then ns_column_groups. Returns 0, or -2 when out of memory. */
int ns_matmul_column_groups(const ns_group_layout *layout, void (*quantize)(const float *, int64_t, xblock *),
                            const float *x, const uint8_t *w, float *y, int64_t rows, int64_t n, int64_t k,
                            int num_threads);

#endif
