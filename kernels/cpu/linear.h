/* What the linear layer's arithmetic paths share: float32 FMAs on every CPU (linear.c),
 * bf16 dot products where the CPU has AVX512-BF16 (linear_bf16.c), int8 weights
 * (linear_int8.c) and GGUF blocks (linear_gguf.c, linear_kquant.c) each bring their
 * micro-kernels; the blocking and threading around them
 * are one (linear_run). */
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

/* R rows of x (1 to 4) from row m against weight rows [n0, n1): a path's micro-kernels. */
typedef void (*linear_rows_fn)(const void *args, int64_t m, int64_t n0, int64_t n1, int R);

/* Weight rows [n0, n1) made ready, on the thread about to run every row block of x
 * against them: a path that decodes its weights into a panel first. */
typedef void (*linear_load_fn)(const void *args, int64_t n0, int64_t n1);

/* Decodes weight rows [n0, n1) of `src` into bf16 rows of `kp` elements at dst. */
typedef void (*linear_bf16_decode_fn)(const void *src, int64_t n0, int64_t n1, uint16_t *dst,
                                      int kp);

/* y = bf16(x) @ bf16(W)^T (+ bias) for a W that `decode` turns into bf16 rows, a block of
 * rows at a time into a per-thread panel; the same numbers as linear_bf16_dot over the
 * decoded matrix. PD_UNSUPPORTED where bf16 dot products are not available. `w_bytes`
 * and `w_row_bytes`: where the encoded rows lie, to prefetch them. */
__attribute__((visibility("hidden"))) int linear_bf16_dot_decoded(
    const float *x, int64_t x_rs, linear_bf16_decode_fn decode, const void *src,
    const void *w_bytes, int64_t w_row_bytes, const void *bias, int bias_dt, float *y,
    int64_t y_rs, int64_t m, int64_t n, int64_t k, int num_threads);

/* One call of a path as the shared blocking and threading see it (linear.c's header). */
typedef struct {
    linear_rows_fn rows;
    const void *args; /* what `rows` reads */
    int64_t m, n;     /* rows of x, rows of W */
    int64_t unit_n;   /* weight rows per work unit */
    int64_t x_rows;   /* x rows per block (a multiple of 4): linear_block_rows */
    int64_t w_units;  /* weight units per block: linear_block_units */
    linear_load_fn load; /* NULL: the rows read the weights where they lie */
    /* Where the weights lie, to prefetch them (NULL: no prefetching): their bytes from
     * one row to the next, and the weight rows of a 4-row tile (it divides unit_n).
     * Without `load`, decode-sized calls then run unit by unit (run_units_outer). */
    const char *w_bytes;
    int64_t w_row_bytes, tile_n;
} linear_plan;

/* Rows of x per block: as many rows of `row_bytes` (packed) as fit `budget` bytes, in
 * whole groups of 4, at least one group. */
static inline int64_t linear_block_rows(int64_t budget, int64_t row_bytes) {
    int64_t rows = budget / row_bytes & ~(int64_t)3;
    return rows < 4 ? 4 : rows;
}

/* Weight bytes per L2-resident block, every path. */
#define LINEAR_W_BLOCK_BYTES (96 << 10)

/* Weight units per block: as many units of `unit_bytes` as fit LINEAR_W_BLOCK_BYTES, at
 * least one. */
static inline int64_t linear_block_units(int64_t unit_bytes) {
    int64_t units = LINEAR_W_BLOCK_BYTES / unit_bytes;
    return units < 1 ? 1 : units;
}

/* A thread's part of a call: thread t of T. */
typedef void (*linear_share_fn)(const void *args, int t, int T);

/* share(args, t, T) for every t of T threads (at most `threads`; on the caller when one). */
__attribute__((visibility("hidden"))) void linear_parallel(int threads, linear_share_fn share,
                                                            const void *args);

/* Every row of x against every weight row: the weight units split into contiguous runs
 * among at most `num_threads` threads (fewer when `macs` is too little work for them);
 * within a run, blocks of x rows, and in each a block of weight rows reused by every 4
 * rows of it. */
__attribute__((visibility("hidden"))) void linear_run(const linear_plan *P, int64_t macs,
                                                       int num_threads);

/* Where a path's outputs go: y (row stride y_rs), with the bias added (bias_dt -1: none). */
typedef struct {
    const void *bias;
    int bias_dt;
    float *y;
    int64_t y_rs;
} linear_out;

/* The output rows from x row m0, as a tile from weight row n writes them (column n). */
ALWAYS_INLINE float *linear_y(const linear_out *O, int64_t m0, int64_t n) {
    return O->y + m0 * O->y_rs + n;
}

/* Output (r, c) of a tile whose first weight row is n (y from linear_y): s plus the bias. */
ALWAYS_INLINE void linear_put(const linear_out *O, float *y, int r, int c, int64_t n, float s) {
    if (O->bias_dt >= 0) s += load_scalar(O->bias, O->bias_dt, n + c);
    y[r * O->y_rs + c] = s;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* The sums of 16 vectors in one vector: out[4q + t] = sum(v[4t + q]). Output i is the
 * tree (((l0+l8) + (l4+l12)) + ((l2+l10) + (l6+l14))) + (((l1+l9) + ...)) of v[i]'s
 * lanes, for every i and whatever the other vectors hold. */
ALWAYS_INLINE __m512 linear_sum16(const __m512 *v) {
    __m512 s[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* lanes i + 8 onto i, two vectors per result */
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* lanes i + 4 onto i within each half */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) { /* lanes i + 2 onto i within each 128-bit lane */
        __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
        w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* x rows rounded to bf16 (to nearest even), each row zero-padded to kp elements. */
static inline void linear_pack_x_bf16(const float *x, int64_t x_rs, int64_t m, int k, int kp, uint16_t *dst) {
    for (int64_t r = 0; r < m; r++) {
        const float *src = x + r * x_rs;
        uint16_t *out = dst + r * kp;
        for (int c = 0; c < kp; c += 32) {
            int left = k - c;
            __mmask16 lo = left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            __mmask16 hi = left >= 32 ? 0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            __m512 a = _mm512_maskz_loadu_ps(lo, src + c);
            __m512 b = _mm512_maskz_loadu_ps(hi, src + c + 16);
            _mm512_store_si512(out + c, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    }
}

/* The outputs of an R x C tile of 16-lane accumulators (acc[r * C + c], those past R * C
 * zero up to 16 or 32), each the sum of its lanes by linear_sum16's tree, plus the bias. */
ALWAYS_INLINE void linear_put_sums(const linear_out *O, float *y, int64_t n, const __m512 *acc,
                                   const int R, const int C) {
    float sums[32];
    _mm512_storeu_ps(sums, linear_sum16(acc));
    if (R * C > 16) _mm512_storeu_ps(sums + 16, linear_sum16(acc + 16));
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 24
        for (int c = 0; c < C; c++) {
            const int i = r * C + c; /* where linear_sum16 put output i */
            linear_put(O, y, r, c, n, sums[(i & ~15) + 4 * (i & 3) + ((i & 15) >> 2)]);
        }
}
#endif

/* A GGUF linear call as its micro-kernels read it: 32-weight blocks (linear_gguf.c) or
 * 256-weight K-quant super-blocks (linear_kquant.c), w_rs bytes per weight row. */
typedef struct {
    const float *x;
    int64_t x_rs;
    const uint8_t *w;
    int64_t w_rs;
    linear_out out;
    int k;
    int64_t type; /* the ggml block type */
} gguf_args;

/* The GGUF tiles' largest shape: rows of x by weight rows. */
#define GGUF_MAX_R 4
#define GGUF_MAX_C 12

/* A block's float16 scale (or minimum) at p, as float. */
ALWAYS_INLINE float gguf_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_float(h);
}

#if defined(__AVX512F__)
/* 16 decoded weights as two vectors of 8, in order. */
ALWAYS_INLINE void gguf_split16(__m512 v, v8f *lo, v8f *hi) {
    *lo = (v8f)_mm512_castps512_ps256(v);
    *hi = (v8f)_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
#endif

/* A tile's R x C accumulators, zeroed. */
ALWAYS_INLINE void gguf_tile_zero(v8f acc[][GGUF_MAX_C], const int R, const int C) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 12
        for (int c = 0; c < C; c++) acc[r][c] = v8_splat(0.0f);
}

/* The tile's outputs (y from linear_y, first weight row n): each accumulator's sum. */
ALWAYS_INLINE void gguf_tile_put(const gguf_args *A, float *y, int64_t n,
                                 v8f acc[][GGUF_MAX_C], const int R, const int C) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 12
        for (int c = 0; c < C; c++) linear_put(&A->out, y, r, c, n, v8_hsum(acc[r][c]));
}

/* The K-quant micro-kernels over gguf_args for ggml type `type` (Q4_K, Q5_K, Q6_K); NULL
 * for another type. */
__attribute__((visibility("hidden"))) linear_rows_fn linear_kquant_rows(int64_t type);

/* The K-quants' decoders into bf16 rows (linear_bf16_dot_decoded); NULL for another type
 * or a build without AVX512-BF16. */
__attribute__((visibility("hidden"))) linear_bf16_decode_fn linear_kquant_decode_bf16(
    int64_t type);

/* gguf_args with x packed to bf16 rows of kp elements (the bf16 path's layout): what the
 * tiles that decode in registers and take bf16 dot products read. */
typedef struct {
    gguf_args g;
    const uint16_t *xp;
    int kp;
} gguf_dot_args;

/* The K-quants' register-decoding bf16 micro-kernels over gguf_dot_args (calls of fewer
 * than 4 rows); NULL for another type or a build without AVX512-BF16. */
__attribute__((visibility("hidden"))) linear_rows_fn linear_kquant_dot_rows(int64_t type);
/* One weight row of K-quant super-blocks (`k` weights) as float32 at out, each weight the
 * value the tiles decode (linear_kquant.c). */
__attribute__((visibility("hidden"))) void linear_kquant_row_f32(const uint8_t *row, int k,
                                                                 int64_t type, float *out);

/* Defines `name`, a linear_rows_fn over `args_t`: R rows of x from row m against weight rows
 * [n0, n1) in tiles of cols(R) weight rows, then those left one a tile, each the
 * always-inline `tile(A, m, n, R, C, ...)` with R and C constants: one specialisation of
 * the micro-kernels per row count. */
#define LINEAR_ROWS_FN(name, args_t, tile, cols, ...)                                          \
    ALWAYS_INLINE void name##_block(const args_t *A, int64_t m, int64_t n0, int64_t n1,        \
                                    const int R) {                                             \
        const int C = cols(R);                                                                 \
        int64_t n = n0;                                                                        \
        for (; n + C <= n1; n += C) tile(A, m, n, R, C, ##__VA_ARGS__);                        \
        for (; n < n1; n++) tile(A, m, n, R, 1, ##__VA_ARGS__);                                \
    }                                                                                          \
    static __attribute__((noinline)) void name(const void *args, int64_t m, int64_t n0,        \
                                               int64_t n1, int R) {                            \
        const args_t *A = args;                                                                \
        switch (R) {                                                                           \
        case 4: name##_block(A, m, n0, n1, 4); break;                                          \
        case 3: name##_block(A, m, n0, n1, 3); break;                                          \
        case 2: name##_block(A, m, n0, n1, 2); break;                                          \
        default: name##_block(A, m, n0, n1, 1); break;                                         \
        }                                                                                      \
    }

#endif
