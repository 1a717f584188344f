/* One projection's stage, whatever layout or mix of layouts a file's matrix holds.
 *
 * A Q4_K_M file quantizes q, k and v (and the layers' down projections) to different types, so
 * the stacked qkv matrix may be Q5_0 beside Q8_0 and a layer's down Q4_K or Q6_K; a file may
 * also keep a matrix (or part of a stack) in F16 or BF16, which runs in matmul_float.c's panels
 * on the float32 input. Each part runs its own layout's stage over the same input (quantized, or
 * as it is for the float panels), into its own columns of y: a part's bits are the bits of its
 * own separate call (the per-layer loop multiplies part by part and concatenates), so stacking
 * changes no bit.
 */
#include "nanoserve.h"
#include "stages/stages.h"

static void stage_part(int fmt, const float *x, const xblock *xq, const void *w, float *y, int64_t y_stride,
                       int64_t rows, int64_t n, int64_t k, int thread, int threads) {
    if (ns_float_panels(fmt))
        ns_stage_panels(fmt, x, w, y, y_stride, rows, n, k, thread, threads);
    else if (ns_kx8_layout(fmt))
        ns_stage_kx8_strided(fmt, xq, w, y, y_stride, rows, n, k, thread, threads);
    else
        ns_stage_x8_strided(fmt, xq, w, y, y_stride, rows, n, k, thread, threads);
}

void ns_stage_blocks(int fmt, const float *x, const xblock *xq, const void *w, float *y, int64_t rows, int64_t n,
                     int64_t k, int thread, int threads) {
    if (fmt != NS_STACKED) {
        stage_part(fmt, x, xq, w, y, n, rows, n, k, thread, threads);
        return;
    }
    const ns_stacked_blocks *stack = w;
    int64_t column = 0;
    for (int64_t p = 0; p < stack->parts; p++) {
        stage_part(stack->formats[p], x, xq, stack->blocks[p], y + column, n, rows, stack->columns[p], k, thread,
                   threads);
        column += stack->columns[p];
    }
}

/* Whether a matrix of format `fmt` (a stack's: any of its parts) reads its input quantized. */
int ns_stage_reads_quantized(int fmt, const void *w) {
    if (fmt != NS_STACKED) return !ns_float_panels(fmt);
    const ns_stacked_blocks *stack = w;
    for (int64_t p = 0; p < stack->parts; p++)
        if (!ns_float_panels(stack->formats[p])) return 1;
    return 0;
}

/* matmul_float.c's panels of 16 columns, matmul_x8.c's and matmul_kx8.c's groups of 8; a stack's
 * parts are each shared on their own. */
int64_t ns_stage_column_unit(int fmt) {
    if (fmt == NS_STACKED) return 0;
    return ns_float_panels(fmt) ? 16 : 8;
}
