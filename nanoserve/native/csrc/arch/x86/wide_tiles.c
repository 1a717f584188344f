/* wide_tiles_api.h: which ISA's tile runs a layout. */
#include "arch/x86/wide_tiles_api.h"

#include "runtime/isa.h"

ns_wide_tile ns_wide_tile_on(int isa, int fmt) {
    if (!ns_isa_runs(isa)) return 0;
    switch (isa) {
    case NS_ISA_AVX512VNNI: return ns_wide_tile_for_avx512vnni(fmt);
    case NS_ISA_AVX512: return ns_wide_tile_for_avx512(fmt);
    case NS_ISA_AVXVNNI: return ns_wide_tile_for_avxvnni(fmt);
    default: return 0;
    }
}

int ns_wide_groups(int isa) { return isa == NS_ISA_AVXVNNI ? 1 : 2; }

int ns_wide_height(int fmt) { return fmt == NS_WIDE_Q6_K ? 6 : 8; }
