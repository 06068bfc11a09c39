/* What this build of the CPU kernels is: compiler flags and the vector ISA the
 * compiler targeted, for status lines and benchmarks. */
#include "common.h"

#ifndef PD_BUILD_FLAGS
#define PD_BUILD_FLAGS "unknown flags"
#endif

#if defined(__AVX512F__)
#define PD_ISA "AVX-512"
#elif defined(__AVX2__) && defined(__FMA__)
#define PD_ISA "AVX2+FMA"
#elif defined(__AVX__)
#define PD_ISA "AVX"
#elif defined(__SSE2__)
#define PD_ISA "SSE2"
#else
#define PD_ISA "generic"
#endif

#ifdef _OPENMP
#define PD_THREADS "OpenMP"
#else
#define PD_THREADS "single-threaded (no OpenMP)"
#endif

const char *pd_build_info(void) { return PD_ISA ", " PD_THREADS ", " PD_BUILD_FLAGS; }
