/* Linear layer: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), for every M.
 *
 * x and y are float32, W is float32 or bfloat16 row-major [N, K] as checkpoints store
 * it, the bias float32 or bfloat16; products accumulate in float32. At small M the
 * layer is bound by streaming W from memory, so bf16 weights halve its time.
 *
 * Invariance: y[m, n] is one accumulator vector over K (lane j sums a fixed subset of
 * k in increasing order) and one horizontal sum, whatever M, the tile shape, the
 * thread count or the blocking: a row's output never depends on the other rows of the
 * call (so a token's logits do not depend on what shares its step, nor on how its
 * prompt was chunked). The one source compiles to the same arithmetic on AVX2 and
 * AVX-512 (8-lane vectors, FMA).
 *
 * - Widening (bf16 W): 16 bf16 weights load as eight 32-bit lanes; `lane << 16` is the even
 *   weight in float32 and `lane & 0xffff0000` the odd one (two integer ops per 16
 *   weights). x is packed once per call with each 16-element chunk reordered to
 *   [8 even | 8 odd], so both halves meet their x lanes directly.
 * - Micro-kernel: R rows of x by C rows of W (R x C in {1x12, 2x6, 3x4, 4x3}), one
 *   accumulator vector per (row, weight row) summing K in 8 lanes: at most 12
 *   accumulators plus the widened weights fit the 16 ymm registers.
 * - Prefetch: each tile asks for the lines of the tile after it, so at M = 1 the
 *   weights stream near the memory bandwidth of the core.
 * - Blocking: a thread owns a contiguous run of 12-row weight units (one stream per
 *   thread for the prefetcher); within it, a block of weight rows small enough for L2
 *   is reused by every 4-row block of x, and each x block is reused from L1 by every
 *   tile of the weight block. Rows go in blocks small enough for L2 (X_BLOCK_BYTES),
 *   so W is read from memory once per block of rows (once per call at decode sizes).
 *   Decode-sized calls (2 to 64 rows) instead take one weight unit at a time against
 *   every row, asking for the next unit's lines as they go (run_units_outer).
 *
 * A call may ask for bf16 dot products instead (bf16 W only, `bf16_dot`): x rounded to
 * bf16, AVX512-BF16 instructions (linear_bf16.c), row-invariant the same way. A build
 * or CPU without them answers PD_UNSUPPORTED rather than computing other numbers.
 */
#include "linear.h"

#define UNIT_N 12                /* weight rows per work unit: C divides it for every R */
#define MAX_R 4
#define MAX_C 12
#define X_BLOCK_BYTES (192 << 10) /* packed x bytes per block of rows */
#define MIN_MACS_PER_THREAD (1 << 18)
/* Row blocks of at most this many rows run unit by unit (run_units_outer). */
#define UNITS_OUTER_MAX_ROWS 64

typedef struct {
    const float *xp; /* packed x, row stride K */
    const void *w;
    int w_dt; /* DT_F32 or DT_BF16 */
    int64_t w_rs;
    linear_out out;
    int k;
} linear_args;

ALWAYS_INLINE v8f widen_even(v8u32 raw) { return (v8f)(raw << 16); }
ALWAYS_INLINE v8f widen_odd(v8u32 raw) { return (v8f)(raw & 0xffff0000u); }

/* The weight at (row, k): its lanes' partner in the tail loop. */
ALWAYS_INLINE float weight_at(const void *w, int64_t i, const int WDT) {
    return WDT == DT_BF16 ? bf16_to_float(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* R rows of packed x from row m0 times C weight rows from row n: y[r][c] for the tile.
 * WDT: the weight dtype, a compile-time constant. */
ALWAYS_INLINE void tile(const linear_args *A, int64_t m0, int64_t n, const int R, const int C,
                        const int WDT) {
    const int K = A->k, K16 = K & ~15;
    const int64_t ws = (int64_t)dtype_size(WDT); /* weight bytes */
    const float *xp = A->xp + m0 * A->k;
    const char *wb = (const char *)A->w + n * A->w_rs * ws;
    const void *w = wb;
    float *y = linear_y(&A->out, m0, n);
    v8f acc[MAX_R][MAX_C];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 12
        for (int c = 0; c < C; c++) acc[r][c] = v8_splat(0.0f);
    for (int k = 0; k < K16; k += 16) {
#pragma GCC unroll 12
        for (int c = 0; c < C; c++) {
            const char *row = wb + (c * A->w_rs + k) * ws;
            /* The next tile's rows, one 64-byte line at a time: C + c rows ahead stream
             * in beside these (the prefetcher alone keeps too few lines in flight). */
            if (WDT == DT_F32 || !(k & 31)) __builtin_prefetch(row + C * A->w_rs * ws, 0, 0);
            v8f w0, w1;
            if (WDT == DT_BF16) {
                v8u32 raw;
                memcpy(&raw, row, sizeof raw);
                w0 = widen_even(raw);
                w1 = widen_odd(raw);
            } else {
                w0 = v8_load((const float *)row);
                w1 = v8_load((const float *)row + 8);
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                acc[r][c] = v8_fma(v8_load(xp + r * K + k), w0, acc[r][c]);
                acc[r][c] = v8_fma(v8_load(xp + r * K + k + 8), w1, acc[r][c]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 12
        for (int c = 0; c < C; c++) {
            float s = v8_hsum(acc[r][c]);
            for (int k = K16; k < K; k++) s += xp[r * K + k] * weight_at(w, c * A->w_rs + k, WDT);
            linear_put(&A->out, y, r, c, n, s);
        }
}

#define COLS(R) ((R) == 1 ? 12 : (R) == 2 ? 6 : (R) == 3 ? 4 : 3)
LINEAR_ROWS_FN(rows_bf16, linear_args, tile, COLS, DT_BF16)
LINEAR_ROWS_FN(rows_f32, linear_args, tile, COLS, DT_F32)

/* x rows into the packed layout. bf16 W: per 16-chunk [x0 x2 .. x14 | x1 x3 .. x15],
 * so each half meets its widened weights; f32 W: as is. The tail stays as is. */
static void pack_x(const float *x, int64_t x_rs, int64_t m, int k, int w_dt, float *dst) {
    const int K16 = k & ~15;
    for (int64_t r = 0; r < m; r++) {
        const float *src = x + r * x_rs;
        float *out = dst + r * k;
        if (w_dt == DT_F32) {
            memcpy(out, src, sizeof(float) * k);
            continue;
        }
        for (int c = 0; c < K16; c += 16)
            for (int j = 0; j < 8; j++) {
                out[c + j] = src[c + 2 * j];
                out[c + 8 + j] = src[c + 2 * j + 1];
            }
        for (int c = K16; c < k; c++) out[c] = src[c];
    }
}

/* The packed copy of x lives in a per-thread buffer that only grows: no allocation
 * (and no page faults) per call. */
static __thread void *scratch_buffer;
static __thread size_t scratch_capacity;

void *linear_scratch(size_t bytes) {
    if (bytes > scratch_capacity) {
        free(scratch_buffer);
        bytes = (bytes + 63) & ~(size_t)63;
        scratch_buffer = aligned_alloc(64, bytes);
        scratch_capacity = scratch_buffer ? bytes : 0;
    }
    return scratch_buffer;
}

/* Asks for the next `slice` bytes of `total` at `next` (into L2), from *asked on. */
static inline void ask_slice(const char *next, int64_t *asked, int64_t slice, int64_t total) {
    for (int64_t end = *asked + slice; *asked < end && *asked < total; *asked += 64)
        __builtin_prefetch(next + *asked, 0, 2);
}

/* Rows [m0, m1) against weight units [u0, u1), one unit at a time (decode-sized calls):
 * each unit's weights serve every row while in cache, and the next unit's lines are
 * asked for a slice after each tile, so memory streams them while the tiles compute
 * (run block by block, the first 4 rows wait on memory and the rest never do). */
static void run_units_outer(const linear_plan *P, int64_t m0, int64_t m1, int64_t u0,
                            int64_t u1) {
    const int64_t full = (m1 - m0) / 4, parts = P->unit_n / P->tile_n;
    const int64_t slices = full * parts + (m1 - m0 > full * 4);
    for (int64_t u = u0; u < u1; u++) {
        const int64_t n0 = u * P->unit_n, n1 = n0 + P->unit_n < P->n ? n0 + P->unit_n : P->n;
        const char *next = P->w_bytes + n1 * P->w_row_bytes;
        const int64_t next_bytes = u + 1 < u1 ? P->unit_n * P->w_row_bytes : 0;
        const int64_t slice = (next_bytes / slices + 63) & ~(int64_t)63;
        int64_t asked = 0;
        for (int64_t m = m0; m < m1; m += 4) {
            const int R = m + 4 <= m1 ? 4 : (int)(m1 - m);
            const int64_t step = R == 4 ? P->tile_n : P->unit_n; /* tails: whole-unit tiles */
            for (int64_t n = n0; n < n1; n += step) {
                P->rows(P->args, m, n, n + step < n1 ? n + step : n1, R);
                ask_slice(next, &asked, slice, next_bytes);
            }
        }
    }
}

/* Rows [m0, m1) against weight units [u0, u1): blocks of weight rows. A path that loads
 * its blocks (decoding them into a panel) and names their source asks for the next
 * block's source lines a slice after each 4 rows, so its load does not wait on memory. */
static void run_blocks(const linear_plan *P, int64_t m0, int64_t m1, int64_t u0, int64_t u1) {
    if (P->w_bytes && !P->load && m1 - m0 > 1 && m1 - m0 <= UNITS_OUTER_MAX_ROWS) {
        run_units_outer(P, m0, m1, u0, u1);
        return;
    }
    const int64_t passes = (m1 - m0 + 3) / 4;
    for (int64_t b0 = u0; b0 < u1; b0 += P->w_units) {
        const int64_t b1 = b0 + P->w_units < u1 ? b0 + P->w_units : u1;
        const int64_t n0 = b0 * P->unit_n, n1 = b1 * P->unit_n < P->n ? b1 * P->unit_n : P->n;
        if (P->load) P->load(P->args, n0, n1);
        const int64_t next_rows = P->load && P->w_bytes && b1 < u1
                                      ? (b1 + P->w_units < u1 ? P->w_units : u1 - b1) * P->unit_n
                                      : 0;
        const int64_t next_bytes = next_rows * P->w_row_bytes;
        const int64_t slice = (next_bytes / passes + 63) & ~(int64_t)63;
        const char *next = next_bytes ? P->w_bytes + n1 * P->w_row_bytes : NULL;
        int64_t asked = 0;
        for (int64_t m = m0; m < m1; m += 4) {
            P->rows(P->args, m, n0, n1, m + 4 <= m1 ? 4 : (int)(m1 - m));
            ask_slice(next, &asked, slice, next_bytes);
        }
    }
}

/* Every row against weight units [u0, u1), a block of rows at a time. */
static void run_units(const linear_plan *P, int64_t u0, int64_t u1) {
    for (int64_t m0 = 0; m0 < P->m; m0 += P->x_rows)
        run_blocks(P, m0, m0 + P->x_rows < P->m ? m0 + P->x_rows : P->m, u0, u1);
}

void linear_parallel(int threads, linear_share_fn share, const void *args) {
    if (threads <= 1) {
        share(args, 0, 1);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int t = 0, T = 1;
#endif
        share(args, t, T);
    }
}

/* Thread t of T's run of weight units. */
static void run_share(const void *args, int t, int T) {
    const linear_plan *P = args;
    const int64_t units = (P->n + P->unit_n - 1) / P->unit_n;
    run_units(P, units * t / T, units * (t + 1) / T);
}

void linear_run(const linear_plan *P, int64_t macs, int num_threads) {
    const int64_t units = (P->n + P->unit_n - 1) / P->unit_n;
    int threads = threads_for(num_threads, macs, MIN_MACS_PER_THREAD);
    if (threads > units) threads = (int)units;
    linear_parallel(threads, run_share, P);
}

static int linear(const float *x, int64_t x_rs, const void *w, int w_dt, int64_t w_rs,
                  const void *bias, int bias_dt, float *y, int64_t y_rs, int64_t m, int64_t n,
                  int64_t k, int num_threads) {
    if (m == 0 || n == 0) return PD_OK;
    float *xp = linear_scratch((size_t)(m * k) * sizeof(float));
    if (!xp) return PD_NO_MEMORY;
    pack_x(x, x_rs, m, (int)k, w_dt, xp);
    linear_args A = {.xp = xp, .w = w, .w_dt = w_dt, .w_rs = w_rs, .out = {bias, bias_dt, y, y_rs},
                     .k = (int)k};
    linear_plan P = {.rows = w_dt == DT_BF16 ? rows_bf16 : rows_f32, .args = &A, .m = m, .n = n,
                     .unit_n = UNIT_N, .x_rows = linear_block_rows(X_BLOCK_BYTES, k * 4),
                     .w_units = linear_block_units(UNIT_N * k * (int64_t)dtype_size(w_dt)),
                     .w_bytes = w, .w_row_bytes = w_rs * (int64_t)dtype_size(w_dt),
                     .tile_n = COLS(4)};
    linear_run(&P, m * n * k, num_threads);
    return PD_OK;
}

/* The call's arguments as one struct of 8-byte fields (kernels/cpu_ops.py packs it). */
typedef struct {
    int64_t x, x_rs, w, w_dt, w_rs, bias, bias_dt, y, y_rs;
    int64_t m, n, k, bf16_dot, num_threads, bad;
} pd_linear_call;

int64_t pd_linear_call_size(void) { return sizeof(pd_linear_call); }

/* 1 where calls may ask for bf16 dot products (this build and this CPU have them). */
int pd_linear_bf16_dot_available(void) { return linear_bf16_dot_available(); }

int pd_linear(pd_linear_call *c) {
    if (c->bf16_dot) {
        if (c->w_dt != DT_BF16 || !linear_bf16_dot_available()) return PD_UNSUPPORTED;
        return linear_bf16_dot(PTR(c->x), c->x_rs, PTR(c->w), c->w_rs, PTR(c->bias),
                               (int)c->bias_dt, PTR(c->y), c->y_rs, c->m, c->n, c->k,
                               (int)c->num_threads);
    }
    return linear(PTR(c->x), c->x_rs, PTR(c->w), (int)c->w_dt, c->w_rs, PTR(c->bias),
                  (int)c->bias_dt, PTR(c->y), c->y_rs, c->m, c->n, c->k, (int)c->num_threads);
}
