/* GGUF blocks repacked at load into the interleaved layouts, in C: Q4_0, Q4_1 and Q8_0 into
 * matmul_x8.c's groups, Q4_K and Q6_K into matmul_kx8.c's (those files document the layouts;
 * nanoserve/native/repack.py writes the same bytes in torch for every format and is what the
 * tests hold this against). One pass over the file's bytes, the groups split among the threads:
 * the load of a model's weights, not its repacking, is what a user waits for. */
#include <string.h>

#include "nanoserve.h"
#include "quant/quant_blocks.h"

enum { RP_Q4_0 = 2, RP_Q4_1 = 3, RP_Q8_0 = 8, RP_Q4_K = 12, RP_Q6_K = 14 }; /* GGML type numbers */
enum { RP_COLUMNS = 8 };

/* The file's block bytes (per 32 values, or per 256 for the K-quants) and the layout's group-block
 * bytes; 0 for a format this file does not repack. */
static int source_bytes(int fmt) {
    switch (fmt) {
    case RP_Q4_0: return 18;
    case RP_Q4_1: return 20;
    case RP_Q8_0: return 34;
    case RP_Q4_K: return 144;
    case RP_Q6_K: return 210;
    default: return 0;
    }
}
static int layout_bytes(int fmt) {
    switch (fmt) {
    case RP_Q4_0: case RP_Q4_1: return 160;
    case RP_Q8_0: return 272;
    case RP_Q4_K: return 1184;
    case RP_Q6_K: return 2192;
    default: return 0;
    }
}
static int values_per_block(int fmt) { return fmt == RP_Q4_K || fmt == RP_Q6_K ? 256 : 32; }

/* -8 d for an f16 d, in f16: exact (a power of two) unless it overflows (then -1). */
static int shifted_offset(const uint8_t *d, uint8_t *m) {
    const uint16_t bits = (uint16_t)(d[0] | d[1] << 8);
    const uint16_t sign = (uint16_t)((bits & 0x8000) ^ 0x8000), exponent = (bits >> 10) & 0x1F;
    uint16_t out;
    if (exponent == 0x1F) return -1; /* inf or nan: no finite offset */
    if (exponent == 0) {             /* zero or subnormal: 8x its mantissa, perhaps now normal */
        const float magnitude = fabsf(f16_to_f32(d)) * 8.0f; /* exact */
        if (magnitude < 6.103515625e-05f) {
            out = (uint16_t)(magnitude * 16777216.0f); /* m x 2^-24, m < 1024: exact */
        } else {
            uint32_t f;
            memcpy(&f, &magnitude, 4);
            out = (uint16_t)((((f >> 23) & 0xFF) - 112) << 10 | (f & 0x7FFFFF) >> 13);
        }
    } else {
        if (exponent + 3 >= 0x1F) return -1;
        out = (uint16_t)(bits & 0x7FFF) + (3 << 10);
    }
    out |= sign;
    m[0] = (uint8_t)out, m[1] = (uint8_t)(out >> 8);
    return 0;
}

/* Column c's 32 bytes `src` into a 256-byte set of 8 chunks: its bytes 4t..4t+3 at 32t + 4c. */
static void chunk_column(uint8_t *set, int c, const uint8_t *src, int bytes) {
    for (int t = 0; t < bytes / 4; t++) memcpy(set + 32 * t + 4 * c, src + 4 * t, 4);
}

/* Q4_K's 6-bit scale and min of sub-block j from its 12 packed bytes (ggml's get_scale_min_k4). */
static void q4_k_scale_min(const uint8_t *q, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63, *mn = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *mn = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Column c's file block `src` into group-block `dst`; -1 where Q4_0's offset overflows f16. */
static int repack_column(int fmt, const uint8_t *src, uint8_t *dst, int c) {
    switch (fmt) {
    case RP_Q4_0:
        memcpy(dst + 2 * c, src, 2);
        if (shifted_offset(src, dst + 16 + 2 * c)) return -1;
        for (int t = 0; t < 4; t++) memcpy(dst + 32 + 32 * t + 4 * c, src + 2 + 4 * t, 4);
        return 0;
    case RP_Q4_1:
        memcpy(dst + 2 * c, src, 2);
        memcpy(dst + 16 + 2 * c, src + 2, 2);
        for (int t = 0; t < 4; t++) memcpy(dst + 32 + 32 * t + 4 * c, src + 4 + 4 * t, 4);
        return 0;
    case RP_Q8_0:
        memcpy(dst + 2 * c, src, 2);
        chunk_column(dst + 16, c, src + 2, 32);
        return 0;
    case RP_Q4_K:
        memcpy(dst + 2 * c, src, 2);
        memcpy(dst + 16 + 2 * c, src + 2, 2);
        for (int j = 0; j < 8; j++) q4_k_scale_min(src + 4, j, dst + 32 + 8 * j + c, dst + 96 + 8 * j + c);
        /* the file's qs are already the layout's nibble pairs: byte l of 32p.. holds sub-blocks 2p, 2p + 1 */
        for (int p = 0; p < 4; p++) chunk_column(dst + 160 + 256 * p, c, src + 16 + 32 * p, 32);
        return 0;
    default: { /* Q6_K: ql[128], qh[64], scales[16], d; the codes a byte each */
        const uint8_t *ql = src, *qh = src + 128;
        memcpy(dst + 2 * c, src + 208, 2);
        for (int h = 0; h < 16; h++) dst[16 + 8 * h + c] = src[192 + h];
        for (int half = 0; half < 2; half++) {
            for (int i = 0; i < 4; i++) { /* sub-block 4 half + i, as ggml's dequantize_row_q6_K reads it */
                uint8_t codes[32];
                for (int l = 0; l < 32; l++) {
                    const uint8_t low = ql[64 * half + 32 * (i & 1) + l];
                    codes[l] = (uint8_t)(((i & 2) ? low >> 4 : low & 0x0F) | ((qh[32 * half + l] >> (2 * i)) & 3) << 4);
                }
                chunk_column(dst + 144 + 256 * (4 * half + i), c, codes, 32);
            }
        }
        return 0;
    }
    }
}

typedef struct {
    int fmt;
    const uint8_t *src;
    uint8_t *dst;
    int64_t rows, blocks;
    _Atomic int failed;
} RepackJob;

static void repack_task(void *context, int thread, int threads) {
    RepackJob *job = context;
    const int64_t groups = (job->rows + RP_COLUMNS - 1) / RP_COLUMNS;
    const int in_bytes = source_bytes(job->fmt), out_bytes = layout_bytes(job->fmt);
    int64_t begin, end;
    ns_share(groups, thread, threads, &begin, &end);
    for (int64_t g = begin; g < end; g++) {
        uint8_t *group = job->dst + g * job->blocks * out_bytes;
        memset(group, 0, (size_t)(job->blocks * out_bytes)); /* the padding columns stay zero */
        for (int c = 0; c < RP_COLUMNS && g * RP_COLUMNS + c < job->rows; c++) {
            const uint8_t *row = job->src + (g * RP_COLUMNS + c) * job->blocks * in_bytes;
            for (int64_t b = 0; b < job->blocks; b++)
                if (repack_column(job->fmt, row + b * in_bytes, group + b * out_bytes, c)) job->failed = 1;
        }
    }
}

/* W [rows, k] in the file's blocks of `fmt` (2: Q4_0, 3: Q4_1, 8: Q8_0, 12: Q4_K, 14: Q6_K) into
 * its layout at dst (groups of 8 rows, the last padded with zero rows: ceil(rows / 8) x k /
 * values a block x the layout's group-block bytes). Returns 0, -1 for a format or k this file does
 * not take, or -4 where a Q4_0 scale's offset -8 d overflows f16 (the caller keeps the file's
 * layout then). */
NS_EXPORT int ns_repack_blocks(int fmt, const uint8_t *src, uint8_t *dst, int64_t rows, int64_t k,
                               int num_threads) {
    if (source_bytes(fmt) == 0 || k % values_per_block(fmt) != 0) return -1;
    RepackJob job = {fmt, src, dst, rows, k / values_per_block(fmt), 0};
    ns_parallel(num_threads < 1 ? 1 : num_threads, repack_task, &job);
    return job.failed ? -4 : 0;
}

/* The layout's bytes a group of 8 rows takes per block of the file (0: not repacked here). */
NS_EXPORT int ns_repack_group_block_bytes(int fmt) { return layout_bytes(fmt); }
