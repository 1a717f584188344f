/* One thread's share of an op, with no barrier of its own: what the exported kernels run
 * inside ns_parallel, and what decoder.c chains inside one parallel region per step.
 * A stage computes exactly what its exported kernel computes (the same function per row,
 * block or unit), so the fused decoder's bits are the separate calls' bits. */
#ifndef NANOSERVE_STAGES_H
#define NANOSERVE_STAGES_H

#include <stdint.h>

#include "quant/quant_blocks.h"

/* One layer's K or V cache, [kv_heads, cache_slots, head_dim] rows of `dtype` (nanoserve.h's
 * NS_KV_*): float32, float16, bfloat16, or q8_0: int8 codes and one float32 scale per row,
 * `scales` [kv_heads, cache_slots] (ops.c says how; NULL for the others). */
typedef struct {
    void *rows;
    float *scales;
    int dtype;
} ns_kv_rows;

/* ops.c, on the vector path. Rows [begin, end). delta NULL: a plain RMSNorm of residual. */
void ns_stage_norm_rows(float *residual, const float *delta, const float *weight, float *out, int64_t dim,
                        float eps, int64_t begin, int64_t end);
/* The gate's activation: SiLU (Llama's), or GELU's tanh form (Gemma's gelu_pytorch_tanh). */
enum { NS_ACT_SILU = 0, NS_ACT_GELU_TANH = 1 };
void ns_stage_gated_rows(int activation, const float *gate_up, float *out, int64_t width, int64_t begin,
                         int64_t end);
/* RMSNorm over each of a qkv row's heads q heads (q_weight) and kv_heads k heads (k_weight) of dim
 * values, in place; rows `stride` floats apart. */
void ns_stage_head_norm_rows(float *qkv, int64_t stride, const float *q_weight, const float *k_weight,
                             int64_t heads, int64_t kv_heads, int64_t dim, float eps, int64_t begin, int64_t end);
void ns_stage_rope_rows(float *qkv, const int64_t *positions, const float *cos, const float *signed_sin,
                        const int64_t *slots, ns_kv_rows k_cache, ns_kv_rows v_cache, int64_t heads,
                        int64_t kv_heads, int64_t dim, int64_t cache_slots, int64_t begin, int64_t end);
/* attention.c: tiled attention over the paged cache (ns_tiled_attention's arithmetic), in two
 * parts: a plan of the step's rows, made once per call by one thread (0, or -2 when out of
 * memory; freed by ns_attention_plan_free either way), and the stage every thread of the region
 * runs, its units then (past a barrier inside) its merges; no barrier after them. The stage
 * returns 0, or -2 when the thread's scratch could not be allocated. */
typedef struct {
    int64_t rows, window, blocks, units;
    int64_t max_parts;    /* the most partitions a prompt chunk's row block spans (0: none) */
    int64_t *block_start; /* [blocks + 1]: each row block's first row */
    int64_t *unit_end;    /* [blocks]: the units of blocks 0..b together */
    int64_t *partial_at;  /* [rows + 1]: where each decode row's partitions' partials start */
    float *partials;      /* NULL when no decode row has more than one partition */
    const int64_t *visible_ends; /* [rows]: the last slot each row sees (a bidirectional image's
                                  * rows see the whole image), or NULL: each row's position */
} ns_attention_plan;
int ns_attention_plan_init(ns_attention_plan *plan, const int64_t *row_seq, const int64_t *positions,
                           const int64_t *visible_ends, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                           int64_t window);
void ns_attention_plan_free(ns_attention_plan *plan);
int ns_stage_tiled_attention(const ns_attention_plan *plan, const float *q, int64_t q_row_stride, ns_kv_rows k_cache,
                             ns_kv_rows v_cache, const int64_t *block_tables, int64_t table_width,
                             const int64_t *row_seq, const int64_t *positions, float *out, int64_t heads,
                             int64_t kv_heads, int64_t dim, int64_t block_size, int64_t num_blocks, float scale,
                             float softcap, int thread, int threads);

/* matmul_x8.c, on the vector path: rows [begin, end) of x [., k] quantized into xq. */
void ns_stage_quantize_rows(const float *x, int64_t k, xblock *xq, int64_t begin, int64_t end);

/* Thread `thread`'s groups of 8 columns of y [rows, n] = xq @ W^T over one of the layouts of
 * matmul_x8.c or of matmul_kx8.c (the K-quants and IQ4_XS: `ns_kx8_layout` says which), writing
 * y's rows `y_stride` apart (a part of a stacked matrix writes its columns of the stack's rows). */
int ns_kx8_layout(int fmt);
void ns_stage_x8_strided(int fmt, const xblock *xq, const uint8_t *w, float *y, int64_t y_stride, int64_t rows,
                         int64_t n, int64_t k, int thread, int threads);
void ns_stage_kx8_strided(int fmt, const xblock *xq, const uint8_t *w, float *y, int64_t y_stride, int64_t rows,
                          int64_t n, int64_t k, int thread, int threads);

/* stage_blocks.c: a projection in any of those layouts or in matmul_float.c's panels (below),
 * or stacked from parts in different ones along the output columns (fmt NS_STACKED, w an
 * ns_stacked_blocks): a Q4_K_M file's q, k and v. A block layout reads xq, the panels read x
 * (both the same rows). Each part's groups are split among the threads on their own; no
 * reduction is ever split. ns_stage_reads_quantized: whether the stage reads xq (the stage
 * before it must quantize). */
enum { NS_STACKED = -1 };
typedef struct {
    int64_t parts;
    const int32_t *formats;          /* [parts]: an x8 or kx8 layout, or float panels, each */
    const int64_t *columns;          /* [parts]: each part's output columns, in stack order */
    const uint8_t *const *blocks;    /* [parts] */
} ns_stacked_blocks;
void ns_stage_blocks(int fmt, const float *x, const xblock *xq, const void *w, float *y, int64_t rows, int64_t n,
                     int64_t k, int thread, int threads);
int ns_stage_reads_quantized(int fmt, const void *w);
/* The width of the groups of output columns ns_stage_blocks shares among the threads, in order
 * (thread t writes the t-th ns_share of them), or 0 where there is no one such split (a stack):
 * what a caller needs that reads back, with no barrier, the columns its thread wrote. */
int64_t ns_stage_column_unit(int fmt);

/* matmul_float.c, on the vector path: thread `thread`'s panels of 16 columns of y [m, n] =
 * x @ W^T, x and y float32, W in matmul.py's packed panels of GGML type `fmt` (the format the
 * decoder gives such a matrix): float32, or a GGUF file's F16 / BF16 values. y's rows are
 * `y_stride` apart (a part of a stack writes its columns of the stack's rows); ns_stage_float is
 * the float32 call with y_stride n. */
enum { NS_F32_PANELS = 0, NS_F16_PANELS = 1, NS_BF16_PANELS = 30 };
static inline int ns_float_panels(int fmt) {
    return fmt == NS_F32_PANELS || fmt == NS_F16_PANELS || fmt == NS_BF16_PANELS;
}
void ns_stage_panels(int fmt, const float *x, const void *w, float *y, int64_t y_stride, int64_t m, int64_t n,
                     int64_t k, int thread, int threads);
void ns_stage_float(const float *x, const float *w, float *y, int64_t m, int64_t n, int64_t k, int thread,
                    int threads);

/* lora.c: LoRA's low-rank updates of a step's rows, every adapter at once (lora.c and
 * nanoserve/native/lora.py describe the layout). One adapter's update of one target matrix:
 * A stacked over its modules [rank, k], and per module a piece of B, transposed and scaled. */
#define NS_LORA_PIECES 3 /* modules per target at most: q, k and v share qkv */
typedef struct {
    int64_t column, width;    /* the output columns the piece writes */
    int64_t rank_start, rank; /* the ranks of A it reads */
    const float *bt;          /* [rank, width] */
} ns_lora_piece;
typedef struct {
    const float *a; /* [rank, k]; NULL: the adapter leaves this target alone */
    int64_t rank, pieces;
    ns_lora_piece piece[NS_LORA_PIECES];
} ns_lora_update;
/* One step's rows: each row's adapter slot (-1: none), each slot's tables [layer * 4 + target],
 * and the scratch the shrink writes, [rows, max_rank]. */
typedef struct {
    const ns_lora_update *const *updates;
    const int32_t *row_slot;
    float *shrunk;
    int64_t max_rank;
} ns_lora_step;
/* Whether any of the `rows` rows has an update at target `at` (the same answer on every thread). */
int ns_lora_touches(const ns_lora_step *l, int64_t at, int64_t rows);
/* Thread `thread`'s (row block, rank) units of shrunk = x @ A^T, x [rows, k]; then, past a
 * barrier, its columns of y [rows, n] += shrunk @ B^T. */
void ns_stage_lora_shrink(const ns_lora_step *l, int64_t at, const float *x, int64_t rows, int64_t k, int thread,
                          int threads);
void ns_stage_lora_expand(const ns_lora_step *l, int64_t at, float *y, int64_t rows, int64_t n, int thread,
                          int threads);

/* moe.c: a sparse layer's routed experts. The layer, fixed after load (nanoserve/native/moe.py
 * builds it): */
typedef struct {
    int64_t experts, top_k, hidden, width;
    const float *router;        /* [experts, hidden] in matmul_float.c's panels */
    int64_t renormalize;        /* the top-k weights divided by their sum */
    const void *const *gate_up; /* [experts]: [2 * width, hidden] each (a stack: its ns_stacked_blocks) */
    const void *const *down;    /* [experts]: [hidden, width] each */
    const int32_t *formats;     /* [experts * 2]: ns_stage_blocks formats; expert e's gate_up at 2e,
                                 * its down at 2e + 1 */
} ns_moe_layer;

/* One call over rows: each row's top_k experts and weights, where the sum goes. */
typedef struct {
    int64_t rows;
    const float *x;          /* [rows, hidden] */
    int64_t route;           /* 1: the stage routes the rows into choices and weights; 0: given */
    int64_t *choices;        /* [rows, top_k]: expert indices, distinct within a row */
    float *weights;          /* [rows, top_k] */
    float *out;              /* [rows, hidden], or NULL: the call only routes the rows */
    int64_t *expert_rows;    /* NULL, or [experts]: each expert's rows are added here (profile) */
    double *expert_seconds;  /* NULL, or [experts]: each expert's matmul wall time is added here */
} ns_moe_step;

/* The stage's buffers for up to `rows` rows of any of `layers` (NULL entries skipped), and with
 * `routing`, room for the rows' choices and weights (the stage's caller points its step there).
 * ns_moe_scratch_init returns 0, or -2 when out of memory (ns_moe_scratch_free frees either way). */
typedef struct {
    int64_t *indices;
    float *buffers;
    xblock *xq;
    int64_t *choices;
    float *weights;
} ns_moe_scratch;
int ns_moe_scratch_init(ns_moe_scratch *scratch, const ns_moe_layer *const *layers, int64_t count, int64_t rows,
                        int routing);
void ns_moe_scratch_free(ns_moe_scratch *scratch);

/* The whole sparse MLP over s's rows, by every thread of the region together (its parts
 * separated by barriers inside; the last part, each row's sum, is not followed by one): route
 * (s->route), group, gather, every expert's gate_up, SiLU*up, every expert's down, the sums. */
void ns_stage_moe(const ns_moe_layer *m, const ns_moe_step *s, const ns_moe_scratch *scratch, int thread,
                  int threads);

#endif
