/* isa.h: which vector paths run on this CPU, asked once. */
#include <stdlib.h>
#include <string.h>

#include "runtime/isa.h"
#include "nanoserve.h"

static const char *const LABELS[NS_ISA_COUNT] = {"portable", "avx2", "avxvnni", "avx512", "avx512vnni"};

const char *ns_isa_label(int isa) { return isa >= 0 && isa < NS_ISA_COUNT ? LABELS[isa] : "unknown"; }

int ns_isa_runs(int isa) {
    switch (isa) {
    case NS_ISA_PORTABLE: return 1;
#if defined(__x86_64__) && defined(__GNUC__)
    /* AVX2's tiles are compiled only where the build targets AVX2 (-march=native, build.py) */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    case NS_ISA_AVX2: return 1;
#endif
    case NS_ISA_AVXVNNI:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("avxvnni");
    case NS_ISA_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
    case NS_ISA_AVX512VNNI: return ns_isa_runs(NS_ISA_AVX512) && __builtin_cpu_supports("avx512vnni");
#endif
    default: return 0;
    }
}

static ns_isa_level choose(void) {
    /* NANOSERVE_ISA=avx2 (say) holds the kernels to a narrower path, to compare them */
    const char *forced = getenv("NANOSERVE_ISA");
    if (forced != NULL && *forced)
        for (int isa = 0; isa < NS_ISA_COUNT; isa++)
            if (strcmp(forced, LABELS[isa]) == 0 && ns_isa_runs(isa)) return (ns_isa_level)isa;
    for (int isa = NS_ISA_COUNT - 1; isa > 0; isa--)
        if (isa != NS_ISA_AVX512 && ns_isa_runs(isa)) return (ns_isa_level)isa;
    return NS_ISA_PORTABLE;
}

static int best = -1; /* a race writes the same value */

ns_isa_level ns_isa_best(void) {
    if (best < 0) best = choose();
    return (ns_isa_level)best;
}

/* For a benchmark comparing ISAs in one process, between calls (no kernel may be running): the
 * ISA every later call runs, if it runs here. Returns 0, or -1 leaving the choice as it was. */
NS_EXPORT int ns_isa_choose(int isa) {
    if (!ns_isa_runs(isa)) return -1;
    best = isa;
    return 0;
}

/* For Python: the label of ISA `isa` (0 .. NS_ISA_COUNT - 1) and whether it runs here. */
NS_EXPORT const char *ns_isa_name(int isa) { return ns_isa_label(isa); }
NS_EXPORT int ns_isa_available(int isa) { return ns_isa_runs(isa); }
NS_EXPORT int ns_isa_chosen(void) { return ns_isa_best(); }
