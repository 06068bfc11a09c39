/* Linear layer on bf16 dot-product instructions: y[M, N] = bf16(x)[M, K] @ W[N, K]^T
 * (+ bias), for a bfloat16 W, on CPUs with AVX512-BF16 (`vdpbf16ps`).
 *
 * x is float32 and rounded to bf16 once per call (to nearest even; the instruction
 * treats bf16 subnormals as zero); each product of two bf16 values is exact in float32
 * and accumulates in float32. W is read in place: `vdpbf16ps` multiplies bf16 pairs
 * (k, k + 1), which is how a row-major [N, K] bf16 matrix already lies in memory.
 *
 * Invariance, as in linear.c: y[m, n] is one 16-lane accumulator over K (lane j sums
 * the pairs 2j, 2j + 1 of every 32-wide step of k, in increasing k; a tail step masks
 * the weights past K to zero) and one horizontal sum with a fixed tree (halves of 8,
 * 4, 2, 1 lanes), whatever M, the tile shape, the thread count or the blocking.
 *
 * - Micro-kernel: R rows of x by C rows of W (R x C in {1x24, 2x12, 3x8, 4x6}: 24
 *   accumulators, the x rows and a weight vector fit the 32 zmm registers). A tile's
 *   outputs are summed sixteen at a time by a transposing tree that adds each output's
 *   lanes in the same order as one vector's fold (linear_sum16), so every tile shape, the
 *   tail tiles of one weight row included, gives an output the same sum.
 * - Prefetch and blocking: as linear.c (a thread owns a run of 24-row weight units; a
 *   weight block small enough for L2 is reused by every block of x rows; decode-sized
 *   calls go unit by unit). Tiles ask for the next tile's lines only up to
 *   STREAM_MAX_ROWS rows.
 */
#include "linear.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)

#define UNIT_N 24 /* weight rows per work unit: C divides it for every R */
#define MAX_R 4
/* Calls of at most this many rows stream their weights faster than they compute on them,
 * so each tile asks for the next tile's lines besides what the blocking prefetches; in
 * larger calls those requests only take load slots from the products. */
#define STREAM_MAX_ROWS 8
#define X_BLOCK_BYTES (96 << 10) /* packed (bf16) x bytes per block of rows */
/* The same for a decoded matrix, where each block of rows decodes the weights again: most
 * of a 1 MiB L2 beside the panel (at 2048 rows the decoding then costs ~1.5 % against
 * 12 % with the bf16 matrix's blocks). */
#define PANEL_X_BLOCK_BYTES (768 << 10)

typedef struct {
    const uint16_t *xp; /* packed bf16 x, row stride kp (K rounded up to 32) */
    const uint16_t *w;
    int64_t w_rs;
    linear_out out;
    int k, kp;
} dot_args;

/* R rows of packed x from row m0 times C weight rows from row n, which lie at w (row
 * stride rs): y[r][c] for the tile. PF: ask for the next tile's lines (STREAM_MAX_ROWS). */
ALWAYS_INLINE void dot_tile_at(const dot_args *A, int64_t m0, int64_t n, const uint16_t *w,
                               const int64_t rs, const int R, const int C, const int PF) {
    const uint16_t *xp = A->xp + m0 * A->kp;
    float *y = linear_y(&A->out, m0, n);
    const int K = A->k, K32 = K & ~31, KP = A->kp;
    __m512 acc[32]; /* R * C used; the rest stay zero for the sums */
#pragma GCC unroll 32
    for (int i = 0; i < 32; i++) acc[i] = _mm512_setzero_ps();
    for (int k = 0; k < K32; k += 32) {
        __m512i xv[MAX_R];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) xv[r] = _mm512_load_si512(xp + r * KP + k);
#pragma GCC unroll 24
        for (int c = 0; c < C; c++) {
            const uint16_t *row = w + c * rs + k;
            /* The next tile's rows, a line ahead of each of these (as linear.c). */
            if (PF) __builtin_prefetch(row + C * rs, 0, 0);
            __m512bh wv = (__m512bh)_mm512_loadu_si512(row);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], (__m512bh)xv[r], wv);
        }
    }
    if (K32 < K) { /* the tail: weights past K read as zero (x is zero-padded) */
        const __mmask32 keep = (__mmask32)((1ull << (K - K32)) - 1);
#pragma GCC unroll 24
        for (int c = 0; c < C; c++) {
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(keep, w + c * rs + K32);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m512i xv = _mm512_load_si512(xp + r * KP + K32);
                acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], (__m512bh)xv, wv);
            }
        }
    }
    linear_put_sums(&A->out, y, n, acc, R, C);
}

/* The tile of a bf16 matrix read in place. */
ALWAYS_INLINE void dot_tile(const dot_args *A, int64_t m0, int64_t n, const int R, const int C,
                            const int PF) {
    dot_tile_at(A, m0, n, A->w + n * A->w_rs, A->w_rs, R, C, PF);
}

/* The weight rows [n0, n1) a thread last decoded (linear_bf16_dot_decoded), as bf16 rows
 * of kp elements: its own buffer, grown and never shrunk, beside its packed x. */
static __thread uint16_t *panel;
static __thread size_t panel_capacity;
static __thread int64_t panel_n0;

/* The tile of a decoded matrix, from this thread's panel. */
ALWAYS_INLINE void panel_tile(const dot_args *A, int64_t m0, int64_t n, const int R, const int C) {
    dot_tile_at(A, m0, n, panel + (n - panel_n0) * A->kp, A->kp, R, C, 0); /* in L2 */
}

#define DOT_COLS(R) ((R) == 1 ? 24 : (R) == 2 ? 12 : (R) == 3 ? 8 : 6)
LINEAR_ROWS_FN(dot_rows_streamed, dot_args, dot_tile, DOT_COLS, 1)
LINEAR_ROWS_FN(dot_rows, dot_args, dot_tile, DOT_COLS, 0)
LINEAR_ROWS_FN(panel_rows, dot_args, panel_tile, DOT_COLS)

int linear_bf16_dot_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
}

/* dot_args with the decoder of a matrix that is decoded into panels. */
typedef struct {
    dot_args dot;
    linear_bf16_decode_fn decode;
    const void *src;
    int *failed; /* set when a thread could not grow its panel */
} decoded_args;

static void load_panel(const void *args, int64_t n0, int64_t n1) {
    const decoded_args *D = args;
    const size_t bytes = (size_t)((n1 - n0) * D->dot.kp) * sizeof(uint16_t);
    if (bytes > panel_capacity) {
        free(panel);
        panel = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        panel_capacity = panel ? bytes : 0;
    }
    if (!panel) {
        __atomic_store_n(D->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    D->decode(D->src, n0, n1, panel, D->dot.kp);
    panel_n0 = n0;
}

/* panel_rows where this thread has a panel; without one the call fails as a whole. */
static void panel_rows_if_loaded(const void *args, int64_t m, int64_t n0, int64_t n1, int R) {
    if (panel) panel_rows(args, m, n0, n1, R);
}

int linear_bf16_dot_decoded(const float *x, int64_t x_rs, linear_bf16_decode_fn decode,
                            const void *src, const void *w_bytes, int64_t w_row_bytes,
                            const void *bias, int bias_dt, float *y, int64_t y_rs, int64_t m,
                            int64_t n, int64_t k, int num_threads) {
    if (m == 0 || n == 0) return PD_OK;
    const int kp = (int)((k + 31) & ~(int64_t)31);
    uint16_t *xp = linear_scratch((size_t)(m * kp) * sizeof(uint16_t));
    if (!xp) return PD_NO_MEMORY;
    linear_pack_x_bf16(x, x_rs, m, (int)k, kp, xp);
    int failed = 0;
    decoded_args D = {.dot = {.xp = xp, .out = {bias, bias_dt, y, y_rs}, .k = (int)k, .kp = kp},
                      .decode = decode, .src = src, .failed = &failed};
    linear_plan P = {.rows = panel_rows_if_loaded, .args = &D, .m = m, .n = n, .unit_n = UNIT_N,
                     .x_rows = linear_block_rows(PANEL_X_BLOCK_BYTES, kp * 2),
                     .w_units = linear_block_units(UNIT_N * kp * 2), .load = load_panel,
                     .w_bytes = w_bytes, .w_row_bytes = w_row_bytes};
    linear_run(&P, m * n * k, num_threads);
    return failed ? PD_NO_MEMORY : PD_OK;
}

int linear_bf16_dot(const float *x, int64_t x_rs, const uint16_t *w, int64_t w_rs,
                    const void *bias, int bias_dt, float *y, int64_t y_rs, int64_t m, int64_t n,
                    int64_t k, int num_threads) {
    if (m == 0 || n == 0) return PD_OK;
    const int kp = (int)((k + 31) & ~(int64_t)31);
    uint16_t *xp = linear_scratch((size_t)(m * kp) * sizeof(uint16_t));
    if (!xp) return PD_NO_MEMORY;
    linear_pack_x_bf16(x, x_rs, m, (int)k, kp, xp);
    dot_args A = {.xp = xp, .w = w, .w_rs = w_rs, .out = {bias, bias_dt, y, y_rs}, .k = (int)k,
                  .kp = kp};
    linear_plan P = {.rows = m <= STREAM_MAX_ROWS ? dot_rows_streamed : dot_rows, .args = &A,
                     .m = m, .n = n, .unit_n = UNIT_N,
                     .x_rows = linear_block_rows(X_BLOCK_BYTES, kp * 2),
                     .w_units = linear_block_units(UNIT_N * k * 2),
                     .w_bytes = (const char *)w, .w_row_bytes = w_rs * 2,
                     .tile_n = DOT_COLS(4)};
    linear_run(&P, m * n * k, num_threads);
    return PD_OK;
}

#else /* the compiler does not target AVX512-BF16: the float32 path serves every call */

int linear_bf16_dot_decoded(const float *x, int64_t x_rs, linear_bf16_decode_fn decode,
                            const void *src, const void *w_bytes, int64_t w_row_bytes,
                            const void *bias, int bias_dt, float *y, int64_t y_rs, int64_t m,
                            int64_t n, int64_t k, int num_threads) {
    (void)w_bytes, (void)w_row_bytes;
    (void)x, (void)x_rs, (void)decode, (void)src, (void)bias, (void)bias_dt, (void)y, (void)y_rs;
    (void)m, (void)n, (void)k, (void)num_threads;
    return PD_UNSUPPORTED;
}

int linear_bf16_dot_available(void) { return 0; }

int linear_bf16_dot(const float *x, int64_t x_rs, const uint16_t *w, int64_t w_rs,
                    const void *bias, int bias_dt, float *y, int64_t y_rs, int64_t m, int64_t n,
                    int64_t k, int num_threads) {
    (void)x, (void)x_rs, (void)w, (void)w_rs, (void)bias, (void)bias_dt, (void)y, (void)y_rs;
    (void)m, (void)n, (void)k, (void)num_threads;
    return PD_UNSUPPORTED;
}

#endif
