/* The float panels' wider tiles (arch/x86/float_tiles_avx512.c), for matmul_float.c's driver. */
#ifndef NANOSERVE_FLOAT_TILES_H
#define NANOSERVE_FLOAT_TILES_H

#include <stdint.h>

enum { NS_FLOAT_PANEL = 16, NS_FLOAT_PAIR_ROWS = 12 };

/* `rows` (1..NS_FLOAT_PAIR_ROWS) float32 rows of x (`k` apart) against two consecutive full
 * panels starting at `panels` (weight element type `type`: NS_F32_PANELS, NS_F16_PANELS or
 * NS_BF16_PANELS), writing 32 float32 columns of each row of y (`y_stride` apart). Output
 * (i, j) is matmul_float.c's chain: fma over k = 0..K-1 in order, from 0, rounded once. */
typedef void (*ns_float_pair_tile)(int rows, const float *x, int64_t k, const void *panels, float *y,
                                   int64_t y_stride);

/* The AVX-512 pair tile for weights of `type`, or NULL where this build or CPU has none. */
ns_float_pair_tile ns_float_pair_tile_avx512(int type);

#endif
