/* A sparse layer's routed experts in one native call: route, group, gather, every expert's gated
 * MLP, and each row's weighted sum, inside one parallel region.
 *
 * The Python loop (model/moe.py) makes, per expert that has rows, a gather, two matmuls, the
 * SiLU*up, a scale and an index_add: a dozen trips through Python and ctypes per expert, and a
 * host read of the counts per layer. Here the pool's threads run the stages, separated by
 * barriers:
 *     the router's logits (when the call routes) | each row's softmax and top_k, and the
 *     grouping by expert (thread 0: a counting sort over rows * top_k pairs, stable, so each
 *     expert's rows stay ascending) | gather the pairs' rows (and quantize) | every expert's
 *     gate_up over its rows | SiLU*up (and quantize) | every expert's down, then each row's sum
 * A barrier costs most where there is least work (one row, on a busy machine a descheduled
 * thread's time slice), so the small parts run on thread 0 without one between them (a router of
 * one panel of 16 experts, the routing, the grouping, a gather of few rows), and each thread sums
 * the output columns it computed in every expert's down, with no barrier between the two.
 * A matmul stage runs the experts one after another, each split by output columns across the
 * threads by the stage every projection runs (stage_blocks.c: so an expert may be in any layout
 * a dense matrix may, float or half panels, the x8 and K layouts, a stack of those; the exported
 * kernels' own code), so an expert's rows get the bits the separate call over the same rows
 * gets, which is a row's bits alone (the kernels are batch-invariant). A row's sum starts from
 * zero and adds weight * output for its experts in ascending expert index, the product rounded
 * before the add, as the loop's `routed * scale` then `index_add_` does; so this call and the
 * loop through the same kernels agree bit for bit.
 * The parts run as one stage (ns_stage_moe, stages.h): ns_moe_experts runs it alone, and the
 * one-call decoder (decoder.c) runs it as a sparse layer's MLP, in its own parallel region.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nanoserve.h"
#include "stages/stages.h"

/* Elements of work below which a row-wise stage runs on thread 0 (decoder.c's threshold). */
#define MOE_STAGE_MIN_WORK 16384

typedef struct {
    const ns_moe_layer *m;
    const ns_moe_step *s;
    int64_t pairs;
    int64_t *starts;         /* [experts + 1]: expert e's pairs are [starts[e], starts[e + 1]) */
    int64_t *pair_row;       /* [pairs]: the row of each grouped pair */
    int64_t *slot;           /* [rows * top_k]: where pair (row, j) sits in the grouped order */
    float *logits;           /* [rows, experts]: the router's, when the call routes */
    int64_t *next;           /* [experts]: the grouping's scratch */
    float *gathered, *gate_up, *activated, *expert_out;
    xblock *xq;              /* the quantized input of the matmul stage that needs it */
    int quantized_gate_up, quantized_down;
} MoEJob;

/* Whether a row-wise stage of `work` elements runs on thread 0 alone (stage_rows). */
static int on_thread_0(int64_t work) {
    return work < MOE_STAGE_MIN_WORK;
}

static void stage_rows(int64_t rows, int64_t work, int thread, int threads, int64_t *begin, int64_t *end) {
    if (on_thread_0(work)) {
        *begin = 0;
        *end = thread == 0 ? rows : 0;
        return;
    }
    ns_share(rows, thread, threads, begin, end);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* y = input @ W^T over expert e's pairs, for every expert in turn: W is gate_up (which 0) or
 * down (which 1). With the profile's timing on, a barrier ends each expert and thread 0 adds
 * its wall time. */
static void experts_project(const MoEJob *job, int which, const float *input, float *y, int64_t n, int64_t k,
                            int thread, int threads) {
    const ns_moe_layer *m = job->m;
    double *seconds = job->s->expert_seconds;
    for (int64_t e = 0; e < m->experts; e++) {
        const int64_t start = job->starts[e], count = job->starts[e + 1] - start;
        if (count == 0) continue;
        const double begun = seconds != NULL && thread == 0 ? now_s() : 0.0;
        const void *w = which == 0 ? m->gate_up[e] : m->down[e];
        ns_stage_blocks(m->formats[2 * e + which], input + start * k, job->xq + start * (k / 32), w, y + start * n,
                        count, n, k, thread, threads);
        if (seconds != NULL) {
            ns_barrier(threads);
            if (thread == 0) seconds[e] += now_s() - begun;
        }
    }
}

/* Row-wise, split as stage_rows splits pairs * hidden (ns_stage_moe's barrier before it knows). */
static void gather(const MoEJob *job, int thread, int threads) {
    const int64_t hidden = job->m->hidden;
    int64_t begin, end;
    stage_rows(job->pairs, job->pairs * hidden, thread, threads, &begin, &end);
    for (int64_t p = begin; p < end; p++)
        memcpy(job->gathered + p * hidden, job->s->x + job->pair_row[p] * hidden, sizeof(float) * (size_t)hidden);
    if (job->quantized_gate_up) ns_stage_quantize_rows(job->gathered, hidden, job->xq, begin, end);
}

static void activate(const MoEJob *job, int thread, int threads) {
    const int64_t width = job->m->width;
    int64_t begin, end;
    stage_rows(job->pairs, job->pairs * width, thread, threads, &begin, &end);
    ns_stage_gated_rows(NS_ACT_SILU, job->gate_up, job->activated, width, begin, end);
    if (job->quantized_down) ns_stage_quantize_rows(job->activated, width, job->xq, begin, end);
}

/* out[row] = 0, then += (weight * expert output), rounded in that order, experts ascending:
 * the loop's `routed * scale` and `index_add_`. A fused multiply-add would round once, and
 * GCC fuses across statements unless told not to. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static void add_weighted(float *out, float weight, const float *y, int64_t n) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    for (int64_t i = 0; i < n; i++) {
        const float scaled = weight * y[i];
        out[i] += scaled;
    }
}

/* Columns [begin, end) of rows [first, last) of the sums, each element's experts ascending. */
static void combine_block(const MoEJob *job, int64_t first, int64_t last, int64_t begin, int64_t end) {
    const ns_moe_step *s = job->s;
    const int64_t k = job->m->top_k, hidden = job->m->hidden;
    for (int64_t r = first; r < last; r++) {
        float *out = s->out + r * hidden + begin;
        memset(out, 0, sizeof(float) * (size_t)(end - begin));
        int64_t done = -1; /* the last expert added: each pass adds the next larger one */
        for (int64_t added = 0; added < k; added++) {
            int64_t next = -1;
            for (int64_t j = 0; j < k; j++) {
                const int64_t e = s->choices[r * k + j];
                if (e > done && (next < 0 || e < s->choices[r * k + next])) next = j;
            }
            done = s->choices[r * k + next];
            add_weighted(out, s->weights[r * k + next], job->expert_out + job->slot[r * k + next] * hidden + begin,
                         end - begin);
        }
    }
}

/* The output columns thread `thread` wrote in every expert's down (each stage shares its groups
 * of ns_stage_column_unit columns in order), or 0 when the downs' groups differ (float panels
 * beside a block layout, or a stack), so no one thread owns a column in all of them. The same
 * answer on every thread, which decides whether they meet at a barrier. */
static int down_columns(const MoEJob *job, int thread, int threads, int64_t *begin, int64_t *end) {
    const ns_moe_layer *m = job->m;
    const int64_t unit = ns_stage_column_unit(m->formats[1]);
    for (int64_t e = 1; e < m->experts; e++)
        if (ns_stage_column_unit(m->formats[2 * e + 1]) != unit) return 0;
    if (unit == 0) return 0;
    ns_share((m->hidden + unit - 1) / unit, thread, threads, begin, end);
    *begin *= unit;
    *end = *end * unit < m->hidden ? *end * unit : m->hidden;
    return 1;
}

/* Each row's sum, right after the downs: each thread sums the columns it wrote itself, with no
 * barrier between (where the downs' formats allow; else past one, split by rows). */
static void combine(const MoEJob *job, int thread, int threads) {
    const ns_moe_step *s = job->s;
    int64_t begin, end;
    if (down_columns(job, thread, threads, &begin, &end)) {
        if (begin < end) combine_block(job, 0, s->rows, begin, end);
        return;
    }
    ns_barrier(threads);
    stage_rows(s->rows, s->rows * job->m->top_k * job->m->hidden, thread, threads, &begin, &end);
    combine_block(job, begin, end, 0, job->m->hidden);
}

/* Groups the step's (row, expert) pairs by expert: starts, each pair's row, each choice's place
 * (`next`: scratch of `experts` entries). Rows go in ascending, so each expert's rows stay
 * ascending. */
static void group(const MoEJob *job, int64_t *next) {
    const ns_moe_layer *m = job->m;
    const ns_moe_step *s = job->s;
    int64_t *starts = job->starts;
    memset(starts, 0, sizeof(int64_t) * (size_t)(m->experts + 1));
    for (int64_t i = 0; i < job->pairs; i++) starts[s->choices[i] + 1]++;
    for (int64_t e = 0; e < m->experts; e++) starts[e + 1] += starts[e];
    memcpy(next, starts, sizeof(int64_t) * (size_t)m->experts);
    for (int64_t i = 0; i < job->pairs; i++) {
        const int64_t at = next[s->choices[i]]++;
        job->pair_row[at] = i / m->top_k;
        job->slot[i] = at;
    }
    if (s->expert_rows != NULL)
        for (int64_t e = 0; e < m->experts; e++) s->expert_rows[e] += starts[e + 1] - starts[e];
}

/* One row's routing, as model/moe.py's `route`: the softmax over every expert's logit (in
 * place), the top_k (ties to the lower index), renormalised when the family says. */
static void route_row(float *probs, int64_t experts, int64_t top_k, int renormalize, int64_t *choices,
                      float *weights) {
    float max = probs[0], sum = 0.0f;
    for (int64_t e = 1; e < experts; e++) max = probs[e] > max ? probs[e] : max;
    for (int64_t e = 0; e < experts; e++) {
        probs[e] = expf(probs[e] - max);
        sum += probs[e];
    }
    for (int64_t e = 0; e < experts; e++) probs[e] /= sum;
    float chosen = 0.0f;
    for (int64_t j = 0; j < top_k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < experts; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= choices[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        choices[j] = best;
        weights[j] = probs[best];
        chosen += probs[best];
    }
    if (renormalize)
        for (int64_t j = 0; j < top_k; j++) weights[j] /= chosen;
}

/* The router's logits (over the threads where there is more than one panel of 16 experts and
 * enough work, else on thread 0 with no barrier: the same columns, the same bits), then
 * (thread 0) each row's routing and the grouping. No barrier after. */
static void route_and_group(const MoEJob *job, int64_t *next, int thread, int threads) {
    const ns_moe_layer *m = job->m;
    const ns_moe_step *s = job->s;
    if (s->route) {
        if (m->experts <= 16 || on_thread_0(s->rows * m->experts * m->hidden)) {
            if (thread == 0) ns_stage_float(s->x, m->router, job->logits, s->rows, m->experts, m->hidden, 0, 1);
        } else {
            ns_stage_float(s->x, m->router, job->logits, s->rows, m->experts, m->hidden, thread, threads);
            ns_barrier(threads);
        }
        if (thread == 0)
            for (int64_t r = 0; r < s->rows; r++)
                route_row(job->logits + r * m->experts, m->experts, m->top_k, (int)m->renormalize,
                          s->choices + r * m->top_k, s->weights + r * m->top_k);
    }
    if (thread == 0) group(job, next);
}

/* The buffers' sizes for `rows` rows of layer m: index entries, floats, quantized blocks. */
static void scratch_sizes(const ns_moe_layer *m, int64_t rows, int64_t *indices, int64_t *floats, int64_t *blocks) {
    const int64_t pairs = rows * m->top_k, widest = m->hidden > m->width ? m->hidden : m->width;
    *indices = 2 * m->experts + 1 + 2 * pairs;
    *floats = pairs * (m->hidden + 2 * m->width + m->width + m->hidden) + rows * m->experts;
    *blocks = pairs * (widest / 32) + 1;
}

int ns_moe_scratch_init(ns_moe_scratch *scratch, const ns_moe_layer *const *layers, int64_t count, int64_t rows,
                        int routing) {
    int64_t indices = 0, floats = 0, blocks = 0, pairs = 0;
    for (int64_t i = 0; i < count; i++) {
        if (layers[i] == NULL) continue;
        int64_t layer_indices, layer_floats, layer_blocks;
        scratch_sizes(layers[i], rows, &layer_indices, &layer_floats, &layer_blocks);
        indices = layer_indices > indices ? layer_indices : indices;
        floats = layer_floats > floats ? layer_floats : floats;
        blocks = layer_blocks > blocks ? layer_blocks : blocks;
        pairs = rows * layers[i]->top_k > pairs ? rows * layers[i]->top_k : pairs;
    }
    const int64_t routed = routing ? pairs : 0;
    scratch->indices = malloc(sizeof(int64_t) * (size_t)(indices + routed + 1));
    scratch->buffers = malloc(sizeof(float) * (size_t)(floats + routed + 1));
    scratch->xq = malloc(sizeof(xblock) * (size_t)blocks);
    scratch->choices = routing && scratch->indices != NULL ? scratch->indices + indices : NULL;
    scratch->weights = routing && scratch->buffers != NULL ? scratch->buffers + floats : NULL;
    return scratch->indices == NULL || scratch->buffers == NULL || scratch->xq == NULL ? -2 : 0;
}

void ns_moe_scratch_free(ns_moe_scratch *scratch) {
    free(scratch->indices);
    free(scratch->buffers);
    free(scratch->xq);
}

/* This call's view of the scratch: the same on every thread, so each builds its own. */
static MoEJob job_in(const ns_moe_layer *m, const ns_moe_step *s, const ns_moe_scratch *scratch) {
    const int64_t pairs = s->rows * m->top_k;
    int quantized_gate_up = 0, quantized_down = 0;
    for (int64_t e = 0; e < m->experts; e++) {
        quantized_gate_up |= ns_stage_reads_quantized(m->formats[2 * e], m->gate_up[e]);
        quantized_down |= ns_stage_reads_quantized(m->formats[2 * e + 1], m->down[e]);
    }
    int64_t *indices = scratch->indices;
    float *gathered = scratch->buffers + s->rows * m->experts;
    return (MoEJob){m, s, pairs, indices, indices + m->experts + 1, indices + m->experts + 1 + pairs,
                    scratch->buffers, indices + m->experts + 1 + 2 * pairs, gathered, gathered + pairs * m->hidden,
                    gathered + pairs * (m->hidden + 2 * m->width), gathered + pairs * (m->hidden + 3 * m->width),
                    scratch->xq, quantized_gate_up, quantized_down};
}

void ns_stage_moe(const ns_moe_layer *m, const ns_moe_step *s, const ns_moe_scratch *scratch, int thread,
                  int threads) {
    const MoEJob job = job_in(m, s, scratch);
    route_and_group(&job, job.next, thread, threads);
    if (s->out == NULL) return;
    if (!on_thread_0(job.pairs * m->hidden)) ns_barrier(threads); /* else thread 0 grouped, and gathers */
    gather(&job, thread, threads);
    ns_barrier(threads);
    experts_project(&job, 0, job.gathered, job.gate_up, 2 * m->width, m->hidden, thread, threads);
    ns_barrier(threads);
    activate(&job, thread, threads);
    ns_barrier(threads);
    experts_project(&job, 1, job.activated, job.expert_out, m->hidden, m->width, thread, threads);
    combine(&job, thread, threads);
}

typedef struct {
    const ns_moe_layer *m;
    const ns_moe_step *s;
    const ns_moe_scratch *scratch;
} MoECall;

static void moe_task(void *context, int thread, int threads) {
    const MoECall *call = context;
    ns_stage_moe(call->m, call->s, call->scratch, thread, threads);
}

/* out [rows, hidden] = each row's sum over its top_k experts of weight * expert(x row), experts
 * in ascending index; with s->route, the rows are routed here first (choices and weights
 * written), else choices and weights are the caller's. Returns 0, -1 when a quantized matrix's
 * input is not whole blocks of 32, -2 when out of memory, -3 for a given expert index outside
 * [0, experts). */
NS_EXPORT int ns_moe_experts(const ns_moe_layer *m, const ns_moe_step *s, int num_threads) {
    for (int64_t e = 0; e < m->experts; e++)
        if ((ns_stage_reads_quantized(m->formats[2 * e], m->gate_up[e]) && m->hidden % 32) ||
            (ns_stage_reads_quantized(m->formats[2 * e + 1], m->down[e]) && m->width % 32))
            return -1;
    if (!s->route)
        for (int64_t i = 0; i < s->rows * m->top_k; i++)
            if (s->choices[i] < 0 || s->choices[i] >= m->experts) return -3;
    if (s->rows == 0) return 0;
    ns_moe_scratch scratch;
    int status = ns_moe_scratch_init(&scratch, &m, 1, s->rows, 0);
    if (status == 0) {
        MoECall call = {m, s, &scratch};
        ns_parallel(num_threads, moe_task, &call);
    }
    ns_moe_scratch_free(&scratch);
    return status;
}
