/* The rest of a step: every float32 op of the forward outside the matrix multiplies and the
 * attention (attention.c), fused.
 *
 * - ns_rms_norm, ns_add_rms_norm: RMSNorm of each row, the second after adding the sublayer's
 *   output into the residual stream in place (one pass over the row instead of three).
 * - ns_rope_write_kv: RoPE on q (in place) and k, and the K/V write into the paged cache at each
 *   row's slot, in one pass over the projection's output.
 * - ns_silu_mul, ns_gelu_tanh_mul: SiLU(gate) * up, or GELU's tanh form (Gemma's), over the stacked
 *   gate/up projection.
 * - ns_head_rms_norm: RMSNorm over each q and each k head of a qkv row, in place (Qwen3, Gemma 3).
 *
 * The cache holds float32, float16 or bfloat16 rows (rounded to nearest even, as torch's .to()
 * rounds), or q8_0 rows (int8 codes and one float32 scale per row of head_dim values:
 * model/kv_cache.py says why), the same arithmetic as kv_cache.write (the torch path), so both
 * paths store the same bits.
 *
 * Batch invariance by construction: every row is computed by the same code whatever the other
 * rows are. Threads split rows, never a row's reduction.
 *
 * Each kernel is exported twice: ns_X runs the widest vector path compiled in, ns_X_portable
 * the plain C one the tests hold it against. Both share one body, parametrized by a table of
 * vector primitives (sum of squares, SiLU*up, GELU*up).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nanoserve.h"
#include "stages/stages.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NS_OPS_AVX2 1
#endif

/* Below this many elements of work a parallel region costs more than it saves. */
#define NS_PARALLEL_MIN_WORK 16384

typedef struct {
    float (*sum_squares)(const float *x, int64_t n);
    void (*silu_mul)(const float *gate, const float *up, float *out, int64_t n);
    void (*gelu_tanh_mul)(const float *gate, const float *up, float *out, int64_t n);
} VecOps;

/* GELU's tanh form, 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3), computed as
 * the identical x * sigmoid(2u): SiLU's one exp and divide, and no tanh to vectorize. */
#define GELU_TWO_ROOT_2_OVER_PI 1.5957691216057308f
#define GELU_CUBIC 0.044715f

/* ---------------------------------------------------------------- portable primitives */

static float dot_portable(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static float sum_squares_portable(const float *x, int64_t n) { return dot_portable(x, x, n); }

static void silu_mul_portable(const float *gate, const float *up, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

static void gelu_tanh_mul_portable(const float *gate, const float *up, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float x = gate[i], two_u = GELU_TWO_ROOT_2_OVER_PI * (x + GELU_CUBIC * x * x * x);
        out[i] = x / (1.0f + expf(-two_u)) * up[i];
    }
}

static const VecOps PORTABLE = {sum_squares_portable, silu_mul_portable, gelu_tanh_mul_portable};

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

static void gelu_tanh_mul_avx2(const float *gate, const float *up, float *out, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), cubic = _mm256_set1_ps(GELU_CUBIC);
    const __m256 minus_two_c = _mm256_set1_ps(-GELU_TWO_ROOT_2_OVER_PI);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(gate + i);
        __m256 inner = _mm256_add_ps(x, _mm256_mul_ps(_mm256_mul_ps(cubic, x), _mm256_mul_ps(x, x)));
        __m256 gelu = _mm256_div_ps(x, _mm256_add_ps(one, exp256(_mm256_mul_ps(minus_two_c, inner))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
    }
    gelu_tanh_mul_portable(gate + i, up + i, out + i, n - i);
}

static const VecOps AVX2 = {sum_squares_avx2, silu_mul_avx2, gelu_tanh_mul_avx2};
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

/* ---------------------------------------------------------------- activation(gate) * up */

typedef struct {
    void (*mul)(const float *gate, const float *up, float *out, int64_t n);
    const float *gate_up;
    float *out;
    int64_t width;
} GatedArgs;

static void gated_one_row(const void *args, int64_t r) {
    const GatedArgs *a = args;
    const float *row = a->gate_up + r * 2 * a->width;
    a->mul(row, row + a->width, a->out + r * a->width, a->width);
}

static GatedArgs gated_args(const VecOps *ops, int activation, const float *gate_up, float *out, int64_t width) {
    GatedArgs args = {activation == NS_ACT_GELU_TANH ? ops->gelu_tanh_mul : ops->silu_mul, gate_up, out, width};
    return args;
}

static void silu_mul(const VecOps *ops, const float *gate_up, float *out, int64_t rows, int64_t width,
                     int num_threads) {
    GatedArgs args = gated_args(ops, NS_ACT_SILU, gate_up, out, width);
    for_each_row(gated_one_row, &args, rows, rows * width, num_threads);
}

static void gelu_tanh_mul(const VecOps *ops, const float *gate_up, float *out, int64_t rows, int64_t width,
                          int num_threads) {
    GatedArgs args = gated_args(ops, NS_ACT_GELU_TANH, gate_up, out, width);
    for_each_row(gated_one_row, &args, rows, rows * width, num_threads);
}

/* ---------------------------------------------------------------- q and k head norms */

typedef struct {
    const VecOps *ops;
    float *qkv;
    const float *q_weight, *k_weight;
    int64_t stride, heads, kv_heads, dim;
    float eps;
} HeadNormArgs;

/* RMSNorm over each q head (by q_weight) and each k head (by k_weight) of row r, in place. */
static void head_norm_one_row(const void *args, int64_t r) {
    const HeadNormArgs *a = args;
    float *row = a->qkv + r * a->stride;
    for (int64_t h = 0; h < a->heads + a->kv_heads; h++) {
        float *head = row + h * a->dim;
        norm_row(a->ops, head, h < a->heads ? a->q_weight : a->k_weight, head, a->dim, a->eps);
    }
}

static void head_rms_norm(const VecOps *ops, float *qkv, const float *q_weight, const float *k_weight,
                          int64_t rows, int64_t stride, int64_t heads, int64_t kv_heads, int64_t dim, float eps,
                          int num_threads) {
    HeadNormArgs args = {ops, qkv, q_weight, k_weight, stride, heads, kv_heads, dim, eps};
    for_each_row(head_norm_one_row, &args, rows, rows * (heads + kv_heads) * dim, num_threads);
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

/* float32 to float16 / bfloat16, rounded to nearest even as torch's .to() rounds, so the native
 * write and kv_cache.write store the same bits (float16: overflow to infinity, subnormals kept). */
static inline uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000, magnitude = x & 0x7fffffff;
    if (magnitude > 0x7f800000) return (uint16_t)(sign | 0x7e00 | ((magnitude >> 13) & 0x3ff)); /* NaN */
    if (magnitude >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* rounds past 65504: infinity */
    if (magnitude < 0x38800000) { /* below float16's smallest normal: a subnormal or zero */
        if (magnitude < 0x33000000) return (uint16_t)sign;
        const uint32_t exponent = magnitude >> 23, mantissa = (magnitude & 0x7fffff) | 0x800000;
        const uint32_t shift = 126 - exponent; /* 14..24 */
        uint32_t half = mantissa >> shift;
        const uint32_t rest = mantissa & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    const uint32_t rounded = magnitude + 0xfff + ((magnitude >> 13) & 1) - 0x38000000; /* rebias 127 -> 15 */
    return (uint16_t)(sign | (rounded >> 13));
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

/* Row `index` (kv_head * cache_slots + slot) of a K or V cache takes the values x [dim]. */
static void store_row(const ns_kv_rows *cache, int64_t index, const float *x, int64_t dim) {
    switch (cache->dtype) {
    case NS_KV_F32:
        memcpy((float *)cache->rows + index * dim, x, (size_t)dim * sizeof(float));
        break;
    case NS_KV_F16:
        for (int64_t i = 0; i < dim; i++) ((uint16_t *)cache->rows)[index * dim + i] = float_to_half(x[i]);
        break;
    case NS_KV_BF16:
        for (int64_t i = 0; i < dim; i++) ((uint16_t *)cache->rows)[index * dim + i] = float_to_bf16(x[i]);
        break;
    default:
        quantize_row_q8(x, dim, (int8_t *)cache->rows + index * dim, cache->scales + index);
    }
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

/* ---------------------------------------------------------------- stages (stages.h) */

void ns_stage_norm_rows(float *residual, const float *delta, const float *weight, float *out, int64_t dim,
                        float eps, int64_t begin, int64_t end) {
    NormArgs args = {BEST, residual, delta, weight, out, dim, eps};
    for (int64_t r = begin; r < end; r++) norm_one_row(&args, r);
}

void ns_stage_gated_rows(int activation, const float *gate_up, float *out, int64_t width, int64_t begin,
                         int64_t end) {
    GatedArgs args = gated_args(BEST, activation, gate_up, out, width);
    for (int64_t r = begin; r < end; r++) gated_one_row(&args, r);
}

void ns_stage_head_norm_rows(float *qkv, int64_t stride, const float *q_weight, const float *k_weight,
                             int64_t heads, int64_t kv_heads, int64_t dim, float eps, int64_t begin, int64_t end) {
    HeadNormArgs args = {BEST, qkv, q_weight, k_weight, stride, heads, kv_heads, dim, eps};
    for (int64_t r = begin; r < end; r++) head_norm_one_row(&args, r);
}

void ns_stage_rope_rows(float *qkv, const int64_t *positions, const float *cos, const float *signed_sin,
                        const int64_t *slots, ns_kv_rows k_cache, ns_kv_rows v_cache, int64_t heads,
                        int64_t kv_heads, int64_t dim, int64_t cache_slots, int64_t begin, int64_t end) {
    RopeArgs args = {qkv, positions, slots, cos, signed_sin, k_cache, v_cache, heads, kv_heads, dim, cache_slots};
    for (int64_t r = begin; r < end; r++) rope_one_row(&args, r);
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

NS_EXPORT_BOTH(gelu_tanh_mul,
               (const float *gate_up, float *out, int64_t rows, int64_t width, int num_threads),
               ARGS(gate_up, out, rows, width, num_threads))

/* qkv [rows, stride]: its first heads + kv_heads heads of dim values each normed in place. */
NS_EXPORT_BOTH(head_rms_norm,
               (float *qkv, const float *q_weight, const float *k_weight, int64_t rows, int64_t stride,
                int64_t heads, int64_t kv_heads, int64_t dim, float eps, int num_threads),
               ARGS(qkv, q_weight, k_weight, rows, stride, heads, kv_heads, dim, eps, num_threads))

/* RoPE has no vector primitive: one export, the compiler vectorizes it. */
/* Caches of kv_dtype (nanoserve.h's NS_KV_*); k_scales/v_scales: a q8_0 cache's, else NULL. */
NS_EXPORT void ns_rope_write_kv(float *qkv, const int64_t *positions, const float *cos,
                                const float *signed_sin, const int64_t *slots, int kv_dtype, void *k_cache,
                                float *k_scales, void *v_cache, float *v_scales, int64_t rows, int64_t heads,
                                int64_t kv_heads, int64_t dim, int64_t cache_slots, int num_threads) {
    ns_kv_rows k = {k_cache, k_scales, kv_dtype}, v = {v_cache, v_scales, kv_dtype};
    rope_write_kv(qkv, positions, cos, signed_sin, slots, k, v, rows, heads, kv_heads, dim, cache_slots,
                  num_threads);
}
