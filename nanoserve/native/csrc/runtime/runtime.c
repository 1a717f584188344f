/* What Python asks the library before using it: its ABI version and the ISA it was built for. */
#include "nanoserve.h"

NS_EXPORT int ns_abi_version(void) { return NS_ABI_VERSION; }

/* The vector path compiled in, for the start-up line: AVX2 with FMA, or portable C. */
NS_EXPORT const char *ns_isa(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "portable";
#endif
}
