/* The rest of a step: every float32 op of the forward outside the matrix multiplies, fused.
 *
 * - ns_rms_norm, ns_add_rms_norm: RMSNorm of each row, the second after adding the sublayer's
 *   output into the residual stream in place (one pass over the row instead of three).
 * - ns_rope_write_kv: RoPE on q (in place) and k, and the K/V write into the paged cache at each
 *   row's slot, in one pass over the projection's output.
 * - ns_paged_attention: attention of every row over its own sequence's context, read from the
 *   paged cache IN PLACE through the block table (no gather copy).
 * - ns_silu_mul: SiLU(gate) * up over the stacked gate/up projection.
 *
 * The cache holds float32 rows, or q8_0 rows (int8 codes and one float32 scale per row of
 * head_dim values: model/kv_cache.py says why). A q8_0 row is quantized as the K/V write
 * stores it and dequantized one row at a time inside the attention loop, into a head_dim
 * buffer the dot products read; the whole cache is never expanded. The quantization is the
 * same arithmetic as kv_cache.quantize_q8 (the torch path), so both read the same numbers.
 *
 * Batch invariance by construction: every (row, head) is computed by the same code whatever
 * the other rows are, so a token scored in a prefill chunk and in a decode step agree bit for
 * bit. Attention reads exactly the slots a row can see (never the padding), scores them in slot
 * order, and sums its softmax-weighted values in CONTEXT_CHUNK pieces whose partials are added
 * in chunk order, so the result depends on the row's own context and position only. Threads
 * split (row, head) pairs (attention: (row, K/V head) pairs) or rows, never a row's reduction.
 *
 * Each kernel is exported twice: ns_X runs the widest vector path compiled in, ns_X_portable
 * the plain C one the tests hold it against. Both share one body, parametrized by a table of
 * vector primitives (dot product, sum of squares, a*x+y, exp, q8_0 dequantization).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nanoserve.h"
#include "stages.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NS_OPS_AVX2 1
#endif

/* The batch-invariant attention's chunk (model.py's CONTEXT_CHUNK): slots [c*64, c*64+64). */
#define NS_CONTEXT_CHUNK 64
/* Below this many elements of work a parallel region costs more than it saves. */
#define NS_PARALLEL_MIN_WORK 16384

typedef struct {
    float (*dot)(const float *a, const float *b, int64_t n);
    float (*sum_squares)(const float *x, int64_t n);
    void (*axpy)(float a, const float *x, float *y, int64_t n); /* y += a * x */
    void (*exp_shifted)(const float *x, float shift, float *out, int64_t n); /* exp(x - shift) */
    void (*silu_mul)(const float *gate, const float *up, float *out, int64_t n);
    void (*dequantize_q8)(const int8_t *codes, float scale, float *out, int64_t n); /* code * scale */
} VecOps;

/* ---------------------------------------------------------------- portable primitives */

static float dot_portable(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static float sum_squares_portable(const float *x, int64_t n) { return dot_portable(x, x, n); }

static void axpy_portable(float a, const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static void exp_shifted_portable(const float *x, float shift, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = expf(x[i] - shift);
}

static void silu_mul_portable(const float *gate, const float *up, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

static void dequantize_q8_portable(const int8_t *codes, float scale, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = (float)codes[i] * scale;
}

static const VecOps PORTABLE = {dot_portable, sum_squares_portable, axpy_portable,
                                exp_shifted_portable, silu_mul_portable, dequantize_q8_portable};

/* ---------------------------------------------------------------- AVX2 + FMA primitives */
#ifdef NS_OPS_AVX2

/* Lanes summed in one fixed order, so a reduction's bits depend on its length only. */
/* exp(x) for 8 lanes, Cephes' expf: x = n ln2 + r (ln2 in two parts), a degree-5 polynomial
 * for exp(r), then 2^n through the exponent bits. About 1 ulp; underflows to 0 below -87.3. */
static inline __m256 exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504f);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static float dot_avx2(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float sum = ns_hsum256(acc);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static float sum_squares_avx2(const float *x, int64_t n) { return dot_avx2(x, x, n); }

static void axpy_avx2(float a, const float *x, float *y, int64_t n) {
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

static void exp_shifted_avx2(const float *x, float shift, float *out, int64_t n) {
    __m256 s = _mm256_set1_ps(shift);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
    if (i < n) { /* the tail through the same vector code, so every slot rounds alike */
        float tail[8] = {0};
        memcpy(tail, x + i, (size_t)(n - i) * sizeof(float));
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(tail), s));
        _mm256_storeu_ps(tail, e);
        memcpy(out + i, tail, (size_t)(n - i) * sizeof(float));
    }
}

static void silu_mul_avx2(const float *gate, const float *up, float *out, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 sig = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(sig, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* The same products as the portable loop (an int8 converts to float exactly), 8 at a time. */
static void dequantize_q8_avx2(const int8_t *codes, float scale, float *out, int64_t n) {
    const __m256 s = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), s));
    }
    for (; i < n; i++) out[i] = (float)codes[i] * scale;
}

static const VecOps AVX2 = {dot_avx2, sum_squares_avx2, axpy_avx2, exp_shifted_avx2, silu_mul_avx2,
                            dequantize_q8_avx2};
#define BEST (&AVX2)
#else
#define BEST (&PORTABLE)
#endif

/* ---------------------------------------------------------------- one row at a time, rows split */

/* A kernel that is a loop over independent rows: `row(args, r)` for every r, the rows split
 * among the pool's threads in contiguous ranges when the call is worth a wake-up. */
typedef struct {
    void (*row)(const void *args, int64_t r);
    const void *args;
    int64_t rows;
} RowJob;

static void rows_task(void *context, int thread, int threads) {
    const RowJob *job = context;
    int64_t begin, end;
    ns_share(job->rows, thread, threads, &begin, &end);
    for (int64_t r = begin; r < end; r++) job->row(job->args, r);
}

static void for_each_row(void (*row)(const void *, int64_t), const void *args, int64_t rows, int64_t work,
                         int num_threads) {
    RowJob job = {row, args, rows};
    ns_parallel(work >= NS_PARALLEL_MIN_WORK ? num_threads : 1, rows_task, &job);
}

/* ---------------------------------------------------------------- RMSNorm */

static void norm_row(const VecOps *ops, const float *x, const float *weight, float *out, int64_t dim,
                     float eps) {
    /* As torch's rms_norm: the reciprocal root of the mean square, then x * it * weight. */
    float inv_rms = 1.0f / sqrtf(ops->sum_squares(x, dim) / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) out[i] = x[i] * inv_rms * weight[i];
}

typedef struct {
    const VecOps *ops;
    float *residual; /* rms_norm: the input, read only */
    const float *delta, *weight; /* delta NULL: no residual add */
    float *out;
    int64_t dim;
    float eps;
} NormArgs;

/* residual += delta (when there is one), then out = RMSNorm(residual): the add and the norm fused. */
static void norm_one_row(const void *args, int64_t r) {
    const NormArgs *a = args;
    float *x = a->residual + r * a->dim;
    if (a->delta != NULL) {
        const float *d = a->delta + r * a->dim;
        for (int64_t i = 0; i < a->dim; i++) x[i] += d[i];
    }
    norm_row(a->ops, x, a->weight, a->out + r * a->dim, a->dim, a->eps);
}

static void rms_norm(const VecOps *ops, const float *x, const float *weight, float *out, int64_t rows,
                     int64_t dim, float eps, int num_threads) {
    NormArgs args = {ops, (float *)x, NULL, weight, out, dim, eps};
    for_each_row(norm_one_row, &args, rows, rows * dim, num_threads);
}

static void add_rms_norm(const VecOps *ops, float *residual, const float *delta, const float *weight,
                         float *out, int64_t rows, int64_t dim, float eps, int num_threads) {
    NormArgs args = {ops, residual, delta, weight, out, dim, eps};
    for_each_row(norm_one_row, &args, rows, rows * dim, num_threads);
}

/* ---------------------------------------------------------------- SiLU(gate) * up */

typedef struct {
    const VecOps *ops;
    const float *gate_up;
    float *out;
    int64_t width;
} SiluArgs;

static void silu_one_row(const void *args, int64_t r) {
    const SiluArgs *a = args;
    const float *row = a->gate_up + r * 2 * a->width;
    a->ops->silu_mul(row, row + a->width, a->out + r * a->width, a->width);
}

static void silu_mul(const VecOps *ops, const float *gate_up, float *out, int64_t rows, int64_t width,
                     int num_threads) {
    SiluArgs args = {ops, gate_up, out, width};
    for_each_row(silu_one_row, &args, rows, rows * width, num_threads);
}

/* ---------------------------------------------------------------- RoPE + K/V cache write */

/* x*cos + rotate_half(x)*sin, with rotate_half's sign folded into the signed sin table (as
 * model.py's apply_rope): rotate_half(x)[i] = x[(i + d/2) % d] * sign, one loop per half. */
static void rope_head(const float *x, const float *cos, const float *signed_sin, float *out, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) out[i] = x[i] * cos[i] + x[i + half] * signed_sin[i];
    for (int64_t i = half; i < dim; i++) out[i] = x[i] * cos[i] + x[i - half] * signed_sin[i];
}

/* q8_0 of one row of n values: scale = amax / 127 and codes round(x * (1 / scale)), rounded half
 * to even (nearbyintf in the default rounding mode, as torch.round). kv_cache.quantize_q8 is
 * the same arithmetic in torch; a scale below FLT_MIN (a zero row) stores zero codes. */
static void quantize_row_q8(const float *x, int64_t n, int8_t *codes, float *scale) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f, inverse = d >= FLT_MIN ? 1.0f / d : 0.0f;
    for (int64_t i = 0; i < n; i++) codes[i] = (int8_t)nearbyintf(x[i] * inverse);
    *scale = d;
}

/* Row `index` (kv_head * cache_slots + slot) of a K or V cache takes the values x [dim]. */
static void store_row(const ns_kv_rows *cache, int64_t index, const float *x, int64_t dim) {
    if (cache->scales == NULL)
        memcpy((float *)cache->rows + index * dim, x, (size_t)dim * sizeof(float));
    else
        quantize_row_q8(x, dim, (int8_t *)cache->rows + index * dim, cache->scales + index);
}

typedef struct {
    float *qkv;
    const int64_t *positions, *slots;
    const float *cos, *signed_sin;
    ns_kv_rows k_cache, v_cache;
    int64_t heads, kv_heads, dim, cache_slots;
} RopeArgs;

static void rope_one_row(const void *args, int64_t r) {
    const RopeArgs *a = args;
    const int64_t dim = a->dim;
    float *row = a->qkv + r * (a->heads + 2 * a->kv_heads) * dim, rotated[dim];
    const float *c = a->cos + a->positions[r] * dim, *s = a->signed_sin + a->positions[r] * dim;
    for (int64_t h = 0; h < a->heads; h++) {
        rope_head(row + h * dim, c, s, rotated, dim);
        memcpy(row + h * dim, rotated, (size_t)dim * sizeof(float));
    }
    for (int64_t h = 0; h < a->kv_heads; h++) {
        int64_t at = h * a->cache_slots + a->slots[r];
        rope_head(row + (a->heads + h) * dim, c, s, rotated, dim);
        store_row(&a->k_cache, at, rotated, dim);
        store_row(&a->v_cache, at, row + (a->heads + a->kv_heads + h) * dim, dim);
    }
}

/* qkv [rows, (heads + 2 kv_heads) * dim]: q rotated in place; k rotated and v stored into the
 * caches [kv_heads, cache_slots, dim] at each row's slot. cos/sin [positions, dim]. */
static void rope_write_kv(float *qkv, const int64_t *positions, const float *cos, const float *signed_sin,
                          const int64_t *slots, ns_kv_rows k_cache, ns_kv_rows v_cache, int64_t rows,
                          int64_t heads, int64_t kv_heads, int64_t dim, int64_t cache_slots, int num_threads) {
    RopeArgs args = {qkv, positions, slots, cos, signed_sin, k_cache, v_cache, heads, kv_heads, dim, cache_slots};
    for_each_row(rope_one_row, &args, rows, rows * (heads + 2 * kv_heads) * dim, num_threads);
}

/* ---------------------------------------------------------------- attention over the paged cache */

typedef struct {
    ns_kv_rows k_cache, v_cache;    /* [kv_heads, num_blocks * block_size, dim] */
    const int64_t *block_tables;    /* [seqs, table_width] */
    int64_t table_width, block_size, cache_slots, dim;
} PagedCache;

/* Walks one sequence's slots in order through its block table, one division at the start. */
typedef struct {
    const int64_t *table;
    int64_t index; /* the current slot's row of the cache: kv_head * cache_slots + its cache slot */
    int64_t offset, block_index, block_size, head_base;
} SlotCursor;

static inline SlotCursor cursor_at(const PagedCache *c, const int64_t *table, int64_t kv_head, int64_t slot) {
    SlotCursor at = {table, 0, slot % c->block_size, slot / c->block_size, c->block_size,
                     kv_head * c->cache_slots};
    at.index = at.head_base + table[at.block_index] * c->block_size + at.offset;
    return at;
}

static inline void cursor_next(SlotCursor *at) {
    if (++at->offset == at->block_size) {
        at->offset = 0;
        at->index = at->head_base + at->table[++at->block_index] * at->block_size;
    } else {
        at->index++;
    }
}

/* The float32 values of cache row `index`: the row itself, or a q8_0 row dequantized into
 * `buffer` [dim] (one row at a time: the tile the dot products read, never the whole cache). */
static inline const float *cache_row(const VecOps *ops, const ns_kv_rows *cache, int64_t index, int64_t dim,
                                     float *buffer) {
    if (cache->scales == NULL) return (const float *)cache->rows + index * dim;
    ops->dequantize_q8((const int8_t *)cache->rows + index * dim, cache->scales[index], buffer, dim);
    return buffer;
}

/* Floats of one thread's attention scratch: per query head of the group, its scores over the
 * longest context, its scaled q, its chunk's output and three running sums; and one
 * dequantized cache row. */
static inline int64_t attention_scratch_floats(int64_t group, int64_t longest, int64_t dim) {
    return group * (longest + 2 * dim + 3) + dim;
}

/* The `group` query heads of one row that share K/V head `kv_head` (grouped-query attention),
 * over context slots [first, last], in one pass over its K rows and one over its V rows: each
 * K/V row is read once for the group instead of once per head, which is what bounds attention
 * over a long context. Each head's arithmetic is exactly what it would be alone: its scores in
 * slot order, the softmax's max over the visible slots, each chunk's exp-weighted values summed
 * in slot order into its chunk_out, and the chunks' partials (values and weights) added in
 * chunk order. q and out hold the group's heads back to back (dim floats each); scratch holds
 * attention_scratch_floats(group, scores_len, dim) floats. */
static void attend_group(const VecOps *ops, const PagedCache *c, const int64_t *table, int64_t kv_head,
                         const float *q, int64_t group, float scale, int64_t first, int64_t last,
                         int64_t scores_len, float *scratch, float *out) {
    int64_t dim = c->dim, count = last - first + 1;
    float *scores = scratch, *scaled_q = scores + group * scores_len, *chunk_out = scaled_q + group * dim;
    float *max_score = chunk_out + group * dim, *total = max_score + group, *chunk_total = total + group;
    float *dequantized = chunk_total + group;
    for (int64_t g = 0; g < group; g++) {
        for (int64_t i = 0; i < dim; i++) scaled_q[g * dim + i] = q[g * dim + i] * scale;
        max_score[g] = -INFINITY;
    }
    SlotCursor k = cursor_at(c, table, kv_head, first);
    for (int64_t j = first; j <= last; j++) {
        const float *k_row = cache_row(ops, &c->k_cache, k.index, dim, dequantized);
        for (int64_t g = 0; g < group; g++) {
            float score = ops->dot(scaled_q + g * dim, k_row, dim);
            scores[g * scores_len + j] = score;
            max_score[g] = score > max_score[g] ? score : max_score[g];
        }
        if (j < last) cursor_next(&k);
    }
    for (int64_t g = 0; g < group; g++) {
        float *row_scores = scores + g * scores_len + first;
        ops->exp_shifted(row_scores, max_score[g], row_scores, count);
        total[g] = 0.0f;
    }
    memset(out, 0, (size_t)(group * dim) * sizeof(float));
    SlotCursor v = cursor_at(c, table, kv_head, first);
    for (int64_t start = first; start <= last;) {
        int64_t stop = (start / NS_CONTEXT_CHUNK + 1) * NS_CONTEXT_CHUNK; /* the chunk's end */
        stop = stop > last + 1 ? last + 1 : stop;
        memset(chunk_out, 0, (size_t)(group * dim) * sizeof(float));
        for (int64_t g = 0; g < group; g++) chunk_total[g] = 0.0f;
        for (int64_t j = start; j < stop; j++) {
            const float *v_row = cache_row(ops, &c->v_cache, v.index, dim, dequantized);
            for (int64_t g = 0; g < group; g++) {
                float weight = scores[g * scores_len + j];
                chunk_total[g] += weight;
                ops->axpy(weight, v_row, chunk_out + g * dim, dim);
            }
            if (j < last) cursor_next(&v);
        }
        for (int64_t g = 0; g < group; g++) {
            total[g] += chunk_total[g];
            for (int64_t i = 0; i < dim; i++) out[g * dim + i] += chunk_out[g * dim + i];
        }
        start = stop;
    }
    for (int64_t g = 0; g < group; g++) {
        float inv_total = 1.0f / total[g];
        for (int64_t i = 0; i < dim; i++) out[g * dim + i] *= inv_total;
    }
}

/* q [rows, q_row_stride] (heads * dim used); out [rows, heads * dim]. Row r attends over the
 * context of sequence row_seq[r] (its block table) up to its position; with window > 0, only
 * the last `window` slots of it. Threads split (row, K/V head) pairs: query head h reads K/V
 * head h / (heads / kv_heads), so a pair's query heads are consecutive. */
typedef struct {
    const VecOps *ops;
    const float *q;
    int64_t q_row_stride;
    const PagedCache *c;
    const int64_t *row_seq, *positions;
    float *out;
    int64_t heads, kv_heads, window, longest, units;
    float scale;
    _Atomic int failed; /* a thread could not allocate its scratch */
} AttentionJob;

static void attention_task(void *context, int thread, int threads) {
    AttentionJob *a = context;
    const int64_t dim = a->c->dim, group = a->heads / a->kv_heads;
    if (thread >= a->units) return;
    float *scratch = malloc((size_t)attention_scratch_floats(group, a->longest, dim) * sizeof(float));
    if (scratch == NULL) {
        a->failed = 1;
        return;
    }
    /* Units dealt in turn, not in contiguous ranges: a prompt chunk's rows attend over contexts
     * growing row by row (causal), so a contiguous split left the last thread most of the work.
     * A unit's arithmetic does not depend on which thread runs it. */
    for (int64_t unit = thread; unit < a->units; unit += threads) {
        int64_t r = unit / a->kv_heads, kv_head = unit % a->kv_heads, last = a->positions[r];
        int64_t first = a->window > 0 && last + 1 > a->window ? last + 1 - a->window : 0;
        int64_t h = kv_head * group; /* the group's first query head */
        attend_group(a->ops, a->c, a->c->block_tables + a->row_seq[r] * a->c->table_width, kv_head,
                     a->q + r * a->q_row_stride + h * dim, group, a->scale, first, last, a->longest, scratch,
                     a->out + (r * a->heads + h) * dim);
    }
    free(scratch);
}

/* q [rows, q_row_stride] (heads * dim used); out [rows, heads * dim]. Row r attends over the
 * context of sequence row_seq[r] (its block table) up to its position; with window > 0, only
 * the last `window` slots of it. Threads split (row, K/V head) pairs: query head h reads K/V
 * head h / (heads / kv_heads), so a pair's query heads are consecutive. Returns 0, or -2 when
 * a thread's scratch could not be allocated. */
static int paged_attention(const VecOps *ops, const float *q, int64_t q_row_stride, const PagedCache *c,
                           const int64_t *row_seq, const int64_t *positions, float *out, int64_t rows,
                           int64_t heads, int64_t kv_heads, float scale, int64_t window, int num_threads) {
    int64_t group = heads / kv_heads, longest = 0;
    for (int64_t r = 0; r < rows; r++) longest = positions[r] + 1 > longest ? positions[r] + 1 : longest;
    AttentionJob job = {ops, q, q_row_stride, c, row_seq, positions, out, heads, kv_heads, window, longest,
                        rows * kv_heads, scale, 0};
    int worth = job.units > 1 && job.units * group * longest * c->dim >= NS_PARALLEL_MIN_WORK;
    ns_parallel(worth ? num_threads : 1, attention_task, &job);
    return job.failed ? -2 : 0;
}

/* ---------------------------------------------------------------- stages (stages.h) */

void ns_stage_norm_rows(float *residual, const float *delta, const float *weight, float *out, int64_t dim,
                        float eps, int64_t begin, int64_t end) {
    NormArgs args = {BEST, residual, delta, weight, out, dim, eps};
    for (int64_t r = begin; r < end; r++) norm_one_row(&args, r);
}

void ns_stage_silu_rows(const float *gate_up, float *out, int64_t width, int64_t begin, int64_t end) {
    SiluArgs args = {BEST, gate_up, out, width};
    for (int64_t r = begin; r < end; r++) silu_one_row(&args, r);
}

void ns_stage_rope_rows(float *qkv, const int64_t *positions, const float *cos, const float *signed_sin,
                        const int64_t *slots, ns_kv_rows k_cache, ns_kv_rows v_cache, int64_t heads,
                        int64_t kv_heads, int64_t dim, int64_t cache_slots, int64_t begin, int64_t end) {
    RopeArgs args = {qkv, positions, slots, cos, signed_sin, k_cache, v_cache, heads, kv_heads, dim, cache_slots};
    for (int64_t r = begin; r < end; r++) rope_one_row(&args, r);
}

int ns_stage_attention(const float *q, int64_t q_row_stride, ns_kv_rows k_cache, ns_kv_rows v_cache,
                       const int64_t *block_tables, int64_t table_width, const int64_t *row_seq,
                       const int64_t *positions, float *out, int64_t rows, int64_t heads, int64_t kv_heads,
                       int64_t dim, int64_t block_size, int64_t num_blocks, float scale, int thread, int threads) {
    PagedCache cache = {k_cache, v_cache, block_tables, table_width, block_size, num_blocks * block_size, dim};
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) longest = positions[r] + 1 > longest ? positions[r] + 1 : longest;
    AttentionJob job = {BEST, q, q_row_stride, &cache, row_seq, positions, out, heads, kv_heads, 0, longest,
                        rows * kv_heads, scale, 0};
    attention_task(&job, thread, threads);
    return job.failed ? -2 : 0;
}

/* ---------------------------------------------------------------- exports */

#define NS_EXPORT_BOTH(name, params, args)                                \
    NS_EXPORT void ns_##name params { name(BEST, args); }                 \
    NS_EXPORT void ns_##name##_portable params { name(&PORTABLE, args); }

#define ARGS(...) __VA_ARGS__

NS_EXPORT_BOTH(rms_norm,
               (const float *x, const float *weight, float *out, int64_t rows, int64_t dim, float eps,
                int num_threads),
               ARGS(x, weight, out, rows, dim, eps, num_threads))

NS_EXPORT_BOTH(add_rms_norm,
               (float *residual, const float *delta, const float *weight, float *out, int64_t rows,
                int64_t dim, float eps, int num_threads),
               ARGS(residual, delta, weight, out, rows, dim, eps, num_threads))

NS_EXPORT_BOTH(silu_mul,
               (const float *gate_up, float *out, int64_t rows, int64_t width, int num_threads),
               ARGS(gate_up, out, rows, width, num_threads))

/* RoPE has no vector primitive: one export, the compiler vectorizes it. */
/* k_scales/v_scales NULL: float32 caches; else int8 q8_0 codes with one scale per row. */
NS_EXPORT void ns_rope_write_kv(float *qkv, const int64_t *positions, const float *cos,
                                const float *signed_sin, const int64_t *slots, void *k_cache, float *k_scales,
                                void *v_cache, float *v_scales, int64_t rows, int64_t heads, int64_t kv_heads,
                                int64_t dim, int64_t cache_slots, int num_threads) {
    ns_kv_rows k = {k_cache, k_scales}, v = {v_cache, v_scales};
    rope_write_kv(qkv, positions, cos, signed_sin, slots, k, v, rows, heads, kv_heads, dim, cache_slots,
                  num_threads);
}

#define PAGED_PARAMS                                                                                   \
    (const float *q, int64_t q_row_stride, void *k_cache, float *k_scales, void *v_cache,              \
     float *v_scales, const int64_t *block_tables, int64_t table_width, const int64_t *row_seq, const int64_t *positions, \
     float *out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,        \
     int64_t num_blocks, float scale, int64_t window, int num_threads)
#define PAGED_BODY(ops)                                                                                 \
    {                                                                                                   \
        PagedCache cache = {{k_cache, k_scales}, {v_cache, v_scales}, block_tables, table_width,         \
                            block_size, num_blocks * block_size, dim};                                  \
        return paged_attention(ops, q, q_row_stride, &cache, row_seq, positions, out, rows, heads,      \
                               kv_heads, scale, window, num_threads);                                   \
    }

NS_EXPORT int ns_paged_attention PAGED_PARAMS PAGED_BODY(BEST)
NS_EXPORT int ns_paged_attention_portable PAGED_PARAMS PAGED_BODY(&PORTABLE)
