/* One thread's share of an op, with no barrier of its own: what the exported kernels run
 * inside ns_parallel. A stage computes exactly what its exported kernel computes (the same
 * function per row, block or unit), so a caller chaining stages gets the separate calls' bits. */
#ifndef NANOSERVE_STAGES_H
#define NANOSERVE_STAGES_H

#include <stdint.h>

#include "quant_blocks.h"

/* matmul_x8.c, on the vector path: rows [begin, end) of x [., k] quantized into xq; then thread
 * `thread`'s groups of 8 columns of y [rows, n] = xq @ W^T. */
void ns_stage_quantize_rows(const float *x, int64_t k, xblock *xq, int64_t begin, int64_t end);
void ns_stage_x8(int fmt, const xblock *xq, const uint8_t *w, float *y, int64_t rows, int64_t n, int64_t k,
                 int thread, int threads);

#endif
