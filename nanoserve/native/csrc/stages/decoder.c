/* Every decoder layer of a step in one native call, inside one parallel region.
 *
 * A Llama layer on the native path is nine kernel calls (norm, qkv, RoPE + K/V write,
 * attention, o, residual add + norm, gate_up, SiLU*up, down), each a trip through Python,
 * ctypes and a wake of the pool; a Gemma 3 layer thirteen. Here the whole stack of layers runs as
 * one task on the pool's threads, the stages separated by barriers:
 *     norm (+ residual add) and quantize | qkv | RoPE + K/V write | attention | quantize |
 *     o | residual add + norm and quantize | gate_up | SiLU*up and quantize | down
 * with the families' switches where a model has them: RMSNorm over each q and k head before RoPE
 * (Qwen3, Gemma 3), Gemma's norms of the attention's and the MLP's outputs before their residual
 * adds, GELU's tanh form for SiLU, each layer's own RoPE table and sliding window (Gemma 3's
 * local layers), soft-capped scores (Gemma 2), another attention scale.
 * Each stage is the exported kernel's own code (stages.h), split the same way (rows, attention.c's
 * (row block, K/V head, partition) units, groups of 8 columns: never a reduction), so the bits
 * are the separate calls' bits, and batch-invariant for the same reasons. A stage too small to be worth
 * splitting (NS_STAGE_MIN_WORK) runs on thread 0 while the others wait at the barrier.
 * The matrices are in repacked block layouts (stage_blocks.c; their inputs quantized once, in the
 * stage that writes them), in matmul_float.c's panels (float32, or a GGUF file's F16 / BF16
 * values: stages.h's NS_*_PANELS, read from the float input), or stacks mixing them. The
 * last layer's down projection is left in `delta`, not yet added to `hidden`, as the Python
 * loop leaves it. A step with LoRA rows adds their adapters' updates after each projection
 * (lora.c's two stages, the same code the loop's call runs). A sparse layer (a mixture of
 * experts) runs moe.c's stage in place of gate_up | SiLU*up | down: its router, grouping,
 * experts and sums, the bits of its own call.
 */
#include <stdlib.h>
#include <time.h>

#include "nanoserve.h"
#include "stages/stages.h"

/* Elements of work below which a stage runs on one thread (ops.c's NS_PARALLEL_MIN_WORK). */
#define NS_STAGE_MIN_WORK 16384

enum { QKV, O, GATE_UP, DOWN, MATRICES };

/* The model: fixed after load. Per-layer arrays hold `layers` entries (matrices: 4 per layer). */
typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *const *input_norm, *const *post_norm;
    const void *const *matrices;    /* [layer * 4 + QKV/O/GATE_UP/DOWN] */
    const int32_t *formats;         /* the same order: stages.h's ns_stage_blocks formats */
    void *const *k_cache, *const *v_cache; /* [layer]: [kv_heads, num_blocks * block_size, head_dim] */
    int64_t block_size, num_blocks;
    const float *const *cos, *const *signed_sin; /* [layer]: its RoPE table [positions, head_dim] */
    /* NULL, or [layer]: a q8_0 cache's scales [kv_heads, num_blocks * block_size] */
    float *const *k_scales, *const *v_scales;
    int64_t kv_dtype; /* nanoserve.h's NS_KV_* */
    const ns_moe_layer *const *moe; /* NULL: every layer dense; else [layer]: its experts, or NULL */
    /* The families' switches (NULL or 0 where off): */
    const int64_t *windows;          /* [layer]: the last positions a row attends to; 0: all */
    const float *const *q_norm, *const *k_norm; /* NULL, or [layer]: each q / k head's norm weight */
    const float *const *attn_out_norm, *const *mlp_out_norm; /* NULL, or [layer]: Gemma's output norms */
    float softcap;                   /* scores -> softcap * tanh(scores / softcap); 0: none */
    int64_t activation;              /* stages.h's NS_ACT_* */
} DecoderModel;

/* The most distinct sliding windows a model's layers may have (one attention plan each). */
#define NS_DECODER_WINDOWS 4

/* One step: its rows, where their context lives, and the buffers the stages write. */
typedef struct {
    int64_t rows, table_width;
    const int64_t *positions, *slot_mapping, *block_tables, *row_seq;
    float *hidden, *delta, *normed, *qkv, *attended, *gate_up, *activated;
    double *linear_seconds; /* NULL, or where thread 0 adds the projections' wall time (profile) */
    double *attention_seconds; /* NULL, or where thread 0 adds RoPE + K/V write + attention's (profile) */
    const ns_lora_step *lora; /* NULL, or the LoRA rows' adapters (lora.c), added after each projection */
    int64_t *expert_rows;   /* NULL, or [experts]: each expert's routed rows are added here (profile) */
    double *expert_seconds; /* NULL, or [experts]: each expert's matmul wall time is added here */
} DecoderStep;

typedef struct {
    const DecoderModel *m;
    const DecoderStep *s;
    xblock *xq; /* one quantized input at a time: every reuse is past a barrier */
    ns_moe_scratch moe; /* the sparse layers' buffers, and their rows' routing */
    ns_attention_plan attention[NS_DECODER_WINDOWS]; /* the step's rows' plans, one per distinct window */
    int64_t plans;
    _Atomic int failed;
} DecoderJob;

/* Thread `thread`'s rows of a row-wise stage of `work` elements. */
static void stage_rows(int64_t rows, int64_t work, int thread, int threads, int64_t *begin, int64_t *end) {
    if (work < NS_STAGE_MIN_WORK) {
        *begin = 0;
        *end = thread == 0 ? rows : 0;
        return;
    }
    ns_share(rows, thread, threads, begin, end);
}

/* Whether matrix `which` of `layer` reads its input quantized (then the stage before it quantizes). */
static int quantized(const DecoderModel *m, int64_t layer, int which) {
    const int64_t at = layer * MATRICES + which;
    return ns_stage_reads_quantized(m->formats[at], m->matrices[at]);
}

/* hidden += delta (its rows normed in place first by `delta_norm`, Gemma's output norms, where
 * not NULL), then the norm of hidden by `weight` into normed, quantized where the next matrix
 * reads it so. `delta` NULL: the norm alone. */
static void norm_and_quantize(const DecoderJob *job, float *delta, const float *delta_norm, const float *weight,
                              int quantize, int thread, int threads) {
    const DecoderModel *m = job->m;
    const DecoderStep *s = job->s;
    int64_t begin, end;
    stage_rows(s->rows, s->rows * m->hidden, thread, threads, &begin, &end);
    if (delta != NULL && delta_norm != NULL)
        ns_stage_norm_rows(delta, NULL, delta_norm, delta, m->hidden, m->eps, begin, end);
    ns_stage_norm_rows(s->hidden, delta, weight, s->normed, m->hidden, m->eps, begin, end);
    if (quantize) ns_stage_quantize_rows(s->normed, m->hidden, job->xq, begin, end);
}

/* y = input @ W^T for matrix `which` of `layer`: from the float input, or from its quantized
 * copy in job->xq (a stack's parts each from the one its layout reads). */
static void project(const DecoderJob *job, int64_t layer, int which, const float *input, float *y, int64_t n,
                    int64_t k, int thread, int threads) {
    const DecoderModel *m = job->m;
    const int64_t at = layer * MATRICES + which;
    ns_stage_blocks(m->formats[at], input, job->xq, m->matrices[at], y, job->s->rows, n, k, thread, threads);
}

static double now_s(void);

/* The plan of the layers whose window is `window` (ns_decoder_layers made one per distinct window). */
static const ns_attention_plan *plan_of(const DecoderJob *job, int64_t window) {
    for (int64_t p = 0; p < job->plans; p++)
        if (job->attention[p].window == window) return &job->attention[p];
    return NULL; /* unreachable: every layer's window has its plan */
}

static void attention(DecoderJob *job, int64_t layer, int thread, int threads) {
    const DecoderModel *m = job->m;
    const DecoderStep *s = job->s;
    const double start = s->attention_seconds != NULL && thread == 0 ? now_s() : 0.0;
    const int64_t qkv_width = (m->heads + 2 * m->kv_heads) * m->head_dim;
    const ns_kv_rows k_cache = {m->k_cache[layer], m->k_scales != NULL ? m->k_scales[layer] : NULL, (int)m->kv_dtype};
    const ns_kv_rows v_cache = {m->v_cache[layer], m->v_scales != NULL ? m->v_scales[layer] : NULL, (int)m->kv_dtype};
    int64_t begin, end;
    stage_rows(s->rows, s->rows * qkv_width, thread, threads, &begin, &end);
    if (m->q_norm != NULL)
        ns_stage_head_norm_rows(s->qkv, qkv_width, m->q_norm[layer], m->k_norm[layer], m->heads, m->kv_heads,
                                m->head_dim, m->eps, begin, end);
    ns_stage_rope_rows(s->qkv, s->positions, m->cos[layer], m->signed_sin[layer], s->slot_mapping, k_cache, v_cache,
                       m->heads, m->kv_heads, m->head_dim, m->num_blocks * m->block_size, begin, end);
    ns_barrier(threads);
    if (ns_stage_tiled_attention(plan_of(job, m->windows[layer]), s->qkv, qkv_width, k_cache, v_cache,
                                 s->block_tables, s->table_width, s->row_seq, s->positions, s->attended, m->heads,
                                 m->kv_heads, m->head_dim, m->block_size, m->num_blocks, m->scale, m->softcap,
                                 thread, threads) != 0)
        job->failed = 1;
    ns_barrier(threads);
    if (start != 0.0) *s->attention_seconds += now_s() - start;
    if (!quantized(m, layer, O)) return;
    const int64_t q_size = m->heads * m->head_dim;
    stage_rows(s->rows, s->rows * q_size, thread, threads, &begin, &end);
    ns_stage_quantize_rows(s->attended, q_size, job->xq, begin, end);
}

static void mlp_activation(const DecoderJob *job, int quantize, int thread, int threads) {
    const DecoderStep *s = job->s;
    const int64_t width = job->m->intermediate;
    int64_t begin, end;
    stage_rows(s->rows, s->rows * width, thread, threads, &begin, &end);
    ns_stage_gated_rows((int)job->m->activation, s->gate_up, s->activated, width, begin, end);
    if (quantize) ns_stage_quantize_rows(s->activated, width, job->xq, begin, end);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A projection and the barrier that ends it, timed on thread 0 when the profile asks; with
 * LoRA rows, their adapters' updates of it (the shrink beside the projection, the expand into
 * its output past the barrier), timed with it. */
static void timed_project(const DecoderJob *job, int64_t layer, int which, const float *input, float *y,
                          int64_t n, int64_t k, int thread, int threads) {
    const DecoderStep *s = job->s;
    double start = s->linear_seconds != NULL && thread == 0 ? now_s() : 0.0;
    const int lora = s->lora != NULL && ns_lora_touches(s->lora, layer * MATRICES + which, s->rows);
    project(job, layer, which, input, y, n, k, thread, threads);
    if (lora) ns_stage_lora_shrink(s->lora, layer * MATRICES + which, input, s->rows, k, thread, threads);
    ns_barrier(threads);
    if (lora) {
        ns_stage_lora_expand(s->lora, layer * MATRICES + which, y, s->rows, n, thread, threads);
        ns_barrier(threads);
    }
    if (start != 0.0) *s->linear_seconds += now_s() - start;
}

/* A sparse layer's MLP: its experts over the normed rows, each row's sum left in delta. */
static void routed_experts(const DecoderJob *job, int64_t layer, int thread, int threads) {
    const DecoderStep *s = job->s;
    const ns_moe_step step = {s->rows, s->normed, 1, job->moe.choices, job->moe.weights, s->delta,
                              s->expert_rows, s->expert_seconds};
    ns_stage_moe(job->m->moe[layer], &step, &job->moe, thread, threads);
    ns_barrier(threads);
}

static void decoder_task(void *context, int thread, int threads) {
    DecoderJob *job = context;
    const DecoderModel *m = job->m;
    const DecoderStep *s = job->s;
    const int64_t qkv_width = (m->heads + 2 * m->kv_heads) * m->head_dim, q_size = m->heads * m->head_dim;
    for (int64_t layer = 0; layer < m->layers; layer++) {
        const float *mlp_out_norm = layer > 0 && m->mlp_out_norm != NULL ? m->mlp_out_norm[layer - 1] : NULL;
        norm_and_quantize(job, layer == 0 ? NULL : s->delta, mlp_out_norm, m->input_norm[layer],
                          quantized(m, layer, QKV), thread, threads);
        ns_barrier(threads);
        timed_project(job, layer, QKV, s->normed, s->qkv, qkv_width, m->hidden, thread, threads);
        attention(job, layer, thread, threads);
        ns_barrier(threads);
        timed_project(job, layer, O, s->attended, s->delta, m->hidden, q_size, thread, threads);
        norm_and_quantize(job, s->delta, m->attn_out_norm != NULL ? m->attn_out_norm[layer] : NULL,
                          m->post_norm[layer], quantized(m, layer, GATE_UP), thread, threads);
        ns_barrier(threads);
        if (m->moe != NULL && m->moe[layer] != NULL) {
            routed_experts(job, layer, thread, threads);
            continue;
        }
        timed_project(job, layer, GATE_UP, s->normed, s->gate_up, 2 * m->intermediate, m->hidden, thread, threads);
        mlp_activation(job, quantized(m, layer, DOWN), thread, threads);
        ns_barrier(threads);
        timed_project(job, layer, DOWN, s->activated, s->delta, m->hidden, m->intermediate, thread, threads);
    }
    if (m->mlp_out_norm != NULL) { /* the last MLP's output, normed as the loop leaves it */
        int64_t begin, end;
        stage_rows(s->rows, s->rows * m->hidden, thread, threads, &begin, &end);
        ns_stage_norm_rows(s->delta, NULL, m->mlp_out_norm[m->layers - 1], s->delta, m->hidden, m->eps, begin, end);
    }
}

/* Runs every layer of `m` over the step `s`: `hidden` [rows, hidden] is the residual stream
 * (updated in place up to the last layer's MLP), `delta` [rows, hidden] ends as the last
 * layer's MLP output. Returns 0, -2 when a scratch buffer could not be allocated, or -3 when the
 * layers have more than NS_DECODER_WINDOWS distinct windows (decoder.py refuses such a model). */
NS_EXPORT int ns_decoder_layers(const DecoderModel *m, const DecoderStep *s, int num_threads) {
    int64_t widest = m->hidden > m->intermediate ? m->hidden : m->intermediate;
    widest = widest > m->heads * m->head_dim ? widest : m->heads * m->head_dim;
    DecoderJob job = {m, s, malloc(sizeof(xblock) * (size_t)(s->rows * (widest / 32))), {0}, {{0}}, 0, 0};
    int status = job.xq == NULL ? -2 : 0;
    if (status == 0 && m->moe != NULL) status = ns_moe_scratch_init(&job.moe, m->moe, m->layers, s->rows, 1);
    for (int64_t layer = 0; status == 0 && layer < m->layers; layer++) {
        if (plan_of(&job, m->windows[layer]) != NULL) continue;
        if (job.plans == NS_DECODER_WINDOWS) {
            status = -3;
            break;
        }
        status = ns_attention_plan_init(&job.attention[job.plans++], s->row_seq, s->positions, NULL, s->rows,
                                        m->heads, m->kv_heads, m->head_dim, m->windows[layer]);
    }
    if (status == 0) ns_parallel(num_threads, decoder_task, &job);
    free(job.xq);
    ns_moe_scratch_free(&job.moe);
    for (int64_t p = 0; p < job.plans; p++) ns_attention_plan_free(&job.attention[p]);
    return status == 0 && job.failed ? -2 : status;
}
