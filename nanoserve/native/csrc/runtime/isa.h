/* The vector units a kernel may run on, chosen at run time from what the CPU says it has.
 *
 * The library is one build: the wide tiles (arch/x86/) are compiled per ISA with GCC's target
 * pragmas whatever the build machine, and `ns_isa_best()` picks the widest one this CPU runs
 * (cpuid, once per process). Every path computes a row's integer dot products exactly and
 * accumulates them in matmul_x8.c's / matmul_kx8.c's fixed float order, so each one equals the
 * portable reference bit for bit; the tests call each by name (`ns_matmul_x8_isa`). */
#ifndef NANOSERVE_ISA_H
#define NANOSERVE_ISA_H

typedef enum {
    NS_ISA_PORTABLE = 0,   /* plain C */
    NS_ISA_AVX2 = 1,       /* AVX2 + FMA + F16C, 8 columns a register (matmul_x8.c's own tiles) */
    NS_ISA_AVXVNNI = 2,    /* AVX2 with VEX vpdpbusd (Alder Lake, Zen 5 client), 8 columns */
    NS_ISA_AVX512 = 3,     /* AVX-512 F/BW/VL, 16 columns a register, maddubs + madd */
    NS_ISA_AVX512VNNI = 4, /* AVX-512 with vpdpbusd, 16 columns a register */
    NS_ISA_COUNT = 5
} ns_isa_level;

/* Whether this library has `isa` compiled in and this CPU runs it. */
int ns_isa_runs(int isa);
/* The widest ISA that runs here, unless NANOSERVE_ISA names another that does. AVX-512 without
 * VNNI is taken only when named: on the one machine it was measured on (results of
 * bench.block_kernels, bench.isa_compare) its maddubs tiles lost to AVX2's on Q4_0 and Q4_K. */
ns_isa_level ns_isa_best(void);
const char *ns_isa_label(int isa);

#endif
