/* wide_tiles.h's tiles for AVX-512 F/BW/VL without VNNI: maddubs + madd on zmm. */
#include "arch/x86/wide_tiles_api.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <string.h>

#include "gemm/column_groups.h"
#include "quant/quant_blocks.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
#endif
#define WT_NAME avx512
#define WT_COLUMNS 16
#define WT_VNNI 0
#include "arch/x86/wide_tiles.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
ns_wide_tile ns_wide_tile_for_avx512(int fmt) {
    (void)fmt;
    return 0;
}
#endif
