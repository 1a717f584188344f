/* The wide tiles' interface (wide_tiles.h has the tiles and their arithmetic): one tile per
 * (ISA, layout), chosen at run time by wide_tiles.c. */
#ifndef NANOSERVE_WIDE_TILES_API_H
#define NANOSERVE_WIDE_TILES_API_H

#include <stdint.h>
#include <string.h>

#include "quant/quant_blocks.h"

/* The layouts with wide tiles: their GGML type numbers (matmul_x8.c's X8_*, matmul_kx8.c's KX8_*) */
enum { NS_WIDE_Q4_1 = 3, NS_WIDE_Q8_0 = 8, NS_WIDE_Q4_K = 12, NS_WIDE_Q6_K = 14 };
enum { NS_WIDE_MAX_ROWS = 8 };

/* `rows` (1..NS_WIDE_MAX_ROWS) activation rows (`blocks` apart) against one unit of groups: the
 * first at `group`, a second `stride` bytes on (stride 0: one group). The rows' codes come
 * interleaved in `codes` (ns_wide_interleave): so a tile reads every row's 4 bytes of a chunk
 * at constant offsets from one address. Their scales and sums stay in x. Writes y's rows,
 * `y_stride` apart, their first `valid` columns; `prefetch`: ask for the unit's next blocks
 * ahead (the first tile to meet the unit). */
typedef void (*ns_wide_tile)(int rows, const uint8_t *group, int64_t stride, const xblock *x, const int32_t *codes,
                             int64_t blocks, float *y, int64_t y_stride, int valid, int prefetch);

/* The codes of `rows` rows of x (`blocks` blocks each) as a tile reads them: word t (codes
 * 4t..4t+3) of block b of row r at codes[(8 b + t) rows + r]. */
static inline void ns_wide_interleave(const xblock *x, int rows, int64_t blocks, int32_t *codes) {
    for (int64_t b = 0; b < blocks; b++)
        for (int t = 0; t < 8; t++)
            for (int r = 0; r < rows; r++) memcpy(codes + (8 * b + t) * rows + r, x[r * blocks + b].qs + 4 * t, 4);
}

ns_wide_tile ns_wide_tile_for_avx512vnni(int fmt);
ns_wide_tile ns_wide_tile_for_avx512(int fmt);
ns_wide_tile ns_wide_tile_for_avxvnni(int fmt);

/* The tile of ISA `isa` (isa.h) for layout `fmt`, or NULL: none, or the ISA does not run here. */
ns_wide_tile ns_wide_tile_on(int isa, int fmt);
/* Groups of 8 columns in one of ISA `isa`'s units: 2 on AVX-512, 1 on AVX-VNNI. */
int ns_wide_groups(int isa);
/* Rows per tile of layout `fmt`: as many as each row's sums and accumulators leave registers for. */
int ns_wide_height(int fmt);

#endif
