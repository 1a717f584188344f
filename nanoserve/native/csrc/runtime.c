/* What Python asks the library before using it: its ABI version and the ISA it was built for. */
#include "nanoserve.h"

NS_EXPORT int ns_abi_version(void) { return NS_ABI_VERSION; }

/* The widest vector path compiled in, for the start-up line. */
NS_EXPORT const char *ns_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#elif defined(__ARM_NEON)
    return "neon";
#else
    return "portable";
#endif
}
