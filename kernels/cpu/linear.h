/* The linear layer's entry points shared by its two arithmetic paths: float32 FMAs on
 * every CPU (linear.c) and bf16 dot products where the CPU has AVX512-BF16
 * (linear_bf16.c). */
#ifndef PDSERVE_CPU_LINEAR_H
#define PDSERVE_CPU_LINEAR_H

#include "common.h"

/* 1 when this build targets AVX512-BF16 and the CPU running it has it. */
__attribute__((visibility("hidden"))) int linear_bf16_dot_available(void);

/* y = bf16(x) @ W^T (+ bias) for a bf16 W; PD_UNSUPPORTED where not available. */
__attribute__((visibility("hidden"))) int linear_bf16_dot(
    const float *x, int64_t x_rs, const uint16_t *w, int64_t w_rs, const void *bias, int bias_dt,
    float *y, int64_t y_rs, int64_t m, int64_t n, int64_t k, int num_threads);

/* A per-thread, 64-byte aligned buffer of at least `bytes` that only grows (no allocation
 * and no page faults per call): each path packs x into it, one call at a time. */
__attribute__((visibility("hidden"))) void *linear_scratch(size_t bytes);

/* Runs `run(args, u0, u1)` over weight units [0, units), split into contiguous runs
 * among at most `num_threads` threads (fewer when `macs` is too little work for them). */
typedef void (*linear_units_fn)(const void *args, int64_t u0, int64_t u1);
__attribute__((visibility("hidden"))) void linear_split(linear_units_fn run, const void *args,
                                                         int64_t units, int64_t macs,
                                                         int num_threads);

#endif
