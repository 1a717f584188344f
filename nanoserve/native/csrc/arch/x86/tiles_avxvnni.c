/* wide_tiles.h's tiles for AVX2 with AVX-VNNI: VEX vpdpbusd on ymm. */
#include "arch/x86/wide_tiles_api.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <string.h>

#include "gemm/column_groups.h"
#include "quant/quant_blocks.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,avxvnni,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,avxvnni,fma,f16c")
#endif
#define WT_NAME avxvnni
#define WT_COLUMNS 8
#define WT_VNNI 1
#include "arch/x86/wide_tiles.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
ns_wide_tile ns_wide_tile_for_avxvnni(int fmt) {
    (void)fmt;
    return 0;
}
#endif
