/* Weight-only int8 linear layer: y[M, N] = x[M, K] @ (Q[N, K] * S)^T (+ bias), for int8
 * weights Q quantized in groups of G inputs along K, one float32 scale per group
 * (W[n, k] ~ Q[n, k] * S[n, k / G], S of [N, K / G]), and float32 x and y. G = K is one
 * scale per output row.
 *
 * The weights stay int8 in memory (a quarter of float32's bytes, half of bf16's: at
 * decode sizes the layer is bound by streaming them) and widen to float32 in registers,
 * sixteen (AVX-512) or eight (AVX2) at a time: a sign extension and a conversion, both
 * exact. Each widened vector is multiplied by its group's scale (G is a multiple of the
 * vector width when a row has several groups, so a vector lies in one group): the
 * product is float32's rounding of Q * S, the very weight the plain-torch reference
 * dequantizes, and one multiply per weight vector serves all R rows of x, where a
 * per-group partial sum would cost an extra accumulator and FMA per (row, column).
 * Products accumulate in float32 with FMAs, then the bias is added.
 *
 * Invariance, as in linear.c: y[m, n] is one accumulator vector over K (lane j sums a
 * fixed subset of k in increasing order; the last partial vector reads x zero-padded and
 * the weights past K as zero) and one horizontal sum, whatever M, the tile shape, the
 * thread count or the blocking. The AVX-512 and AVX2 builds sum in 16 and 8 lanes, so
 * the two kinds of machine differ in the last bits.
 *
 * - Micro-kernel: R rows of x by C rows of Q, one accumulator per pair; each widened
 *   weight vector serves the R rows. AVX-512 (32 registers): R x C in {1x24, 2x12, 3x8,
 *   4x6}; AVX2 (16 registers): {1x12, 2x6, 3x4, 4x3}.
 * - Prefetch and blocking: as linear.c (a thread owns a run of weight units; a weight
 *   block small enough for L2 is reused by every block of x rows).
 */
#include "linear.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LANES 16
#define UNIT_N 24
#define MM(op) _mm512_##op /* the intrinsics of this vector width */
typedef __m512 vec;
ALWAYS_INLINE vec vec_w(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
ALWAYS_INLINE float vec_sum(vec v) { return _mm512_reduce_add_ps(v); }
#define COLS(R) ((R) == 1 ? 24 : (R) == 2 ? 12 : (R) == 3 ? 8 : 6)
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#define UNIT_N 12
#define MM(op) _mm256_##op
typedef __m256 vec;
ALWAYS_INLINE vec vec_w(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
ALWAYS_INLINE float vec_sum(vec v) { /* halves of 4, 2, 1 lanes */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define COLS(R) ((R) == 1 ? 12 : (R) == 2 ? 6 : (R) == 3 ? 4 : 3)
#else /* any other CPU: the same arithmetic one lane wide */
#define LANES 1
#define UNIT_N 12
typedef float vec;
ALWAYS_INLINE vec vec_zero(void) { return 0.0f; }
ALWAYS_INLINE vec vec_x(const float *p) { return *p; }
ALWAYS_INLINE vec vec_w(const int8_t *p) { return (float)*p; }
ALWAYS_INLINE vec vec_scale(vec w, const float *s) { return w * *s; }
ALWAYS_INLINE vec vec_fma(vec a, vec b, vec c) { return fmaf(a, b, c); }
ALWAYS_INLINE float vec_sum(vec v) { return v; }
#define COLS(R) ((R) == 1 ? 12 : (R) == 2 ? 6 : (R) == 3 ? 4 : 3)
#endif
#ifdef MM /* AVX-512 and AVX2: the same operations, 16 or 8 lanes wide */
ALWAYS_INLINE vec vec_zero(void) { return MM(setzero_ps)(); }
ALWAYS_INLINE vec vec_x(const float *p) { return MM(load_ps)(p); }
ALWAYS_INLINE vec vec_scale(vec w, const float *s) { return MM(mul_ps)(w, MM(set1_ps)(*s)); }
ALWAYS_INLINE vec vec_fma(vec a, vec b, vec c) { return MM(fmadd_ps)(a, b, c); }
#endif

#define MAX_R 4
#define MAX_ACC (4 * COLS(4)) /* R * C is the same for every R */
#define X_BLOCK_BYTES (192 << 10)

typedef struct {
    const float *xp; /* packed x: rows of kp floats (K rounded up to LANES), zero-padded */
    const int8_t *w;
    int64_t w_rs;
    const float *scales; /* [N, groups], rows contiguous */
    int64_t groups;      /* scales per weight row */
    linear_out out;
    int k, kp, group; /* group: inputs per scale (K / groups) */
} int8_args;

/* R rows of packed x from row m0 times C weight rows from row n: y[r][c] for the tile. */
ALWAYS_INLINE void tile(const int8_args *A, int64_t m0, int64_t n, const int R, const int C) {
    const float *xp = A->xp + m0 * A->kp;
    const int8_t *w = A->w + n * A->w_rs;
    float *y = linear_y(&A->out, m0, n);
    const int K = A->k, KV = K & ~(LANES - 1), KP = A->kp, G = A->group;
    const int64_t rs = A->w_rs, gs = A->groups;
    const float *s = A->scales + n * gs; /* row n's scales; row n + c's at + c * gs */
    vec acc[MAX_ACC];
#pragma GCC unroll 24
    for (int i = 0; i < R * C; i++) acc[i] = vec_zero();
    /* Group by group (G >= K: one group, cut at KV); a group's vectors share its scale. */
    for (int g0 = 0, g = 0; g0 < KV; g0 += G, g++) {
        const int g1 = g0 + G < KV ? g0 + G : KV;
        for (int k = g0; k < g1; k += LANES) {
            vec xv[MAX_R];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) xv[r] = vec_x(xp + r * KP + k);
#pragma GCC unroll 24
            for (int c = 0; c < C; c++) {
                const int8_t *row = w + c * rs + k;
                /* The next tile's rows, a 64-byte line at a time (as linear.c). */
                if (!(k & 63)) __builtin_prefetch(row + C * rs, 0, 0);
                const vec wv = vec_scale(vec_w(row), s + c * gs + g);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) acc[r * C + c] = vec_fma(xv[r], wv, acc[r * C + c]);
            }
        }
    }
    if (KV < K) { /* the last partial vector (only in a one-group row): weights past K zero */
#pragma GCC unroll 24
        for (int c = 0; c < C; c++) {
            int8_t tail[16] = {0};
            memcpy(tail, w + c * rs + KV, (size_t)(K - KV));
            const vec wv = vec_scale(vec_w(tail), s + c * gs + KV / G);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                acc[r * C + c] = vec_fma(vec_x(xp + r * KP + KV), wv, acc[r * C + c]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 24
        for (int c = 0; c < C; c++) linear_put(&A->out, y, r, c, n, vec_sum(acc[r * C + c]));
}

LINEAR_ROWS_FN(rows_r, int8_args, tile, COLS)

/* x rows copied to rows of kp floats, the padding zero. */
static void pack_x(const float *x, int64_t x_rs, int64_t m, int k, int kp, float *dst) {
    for (int64_t r = 0; r < m; r++) {
        memcpy(dst + r * kp, x + r * x_rs, sizeof(float) * k);
        memset(dst + r * kp + k, 0, sizeof(float) * (kp - k));
    }
}

/* The call's arguments as one struct of 8-byte fields (kernels/cpu_ops.py packs it). */
typedef struct {
    int64_t x, x_rs, w, w_rs, scales, groups, bias, bias_dt, y, y_rs;
    int64_t m, n, k, num_threads, bad;
} pd_linear_int8_call;

int64_t pd_linear_int8_call_size(void) { return sizeof(pd_linear_int8_call); }

int pd_linear_int8(pd_linear_int8_call *c) {
    const int64_t m = c->m, n = c->n, k = c->k, groups = c->groups;
    if (m == 0 || n == 0) return PD_OK;
    /* Checked in Python (kernels/cpu_quantized.py); refused here too rather than read past S. */
    if (groups < 1 || k % groups || (groups > 1 && (k / groups) % LANES)) return PD_BAD_INT8_GROUPS;
    const int kp = (int)((k + LANES - 1) & ~(int64_t)(LANES - 1));
    float *xp = linear_scratch((size_t)(m * kp) * sizeof(float));
    if (!xp) return PD_NO_MEMORY;
    pack_x(PTR(c->x), c->x_rs, m, (int)k, kp, xp);
    int8_args A = {.xp = xp, .w = PTR(c->w), .w_rs = c->w_rs, .scales = PTR(c->scales),
                   .groups = groups, .out = {PTR(c->bias), (int)c->bias_dt, PTR(c->y), c->y_rs},
                   .k = (int)k, .kp = kp,
                   .group = (int)(k / groups)};
    linear_plan P = {.rows = rows_r, .args = &A, .m = m, .n = n, .unit_n = UNIT_N,
                     .x_rows = linear_block_rows(X_BLOCK_BYTES, kp * 4),
                     .w_units = linear_block_units(UNIT_N * k), .w_bytes = (const char *)A.w,
                     .w_row_bytes = c->w_rs, .tile_n = COLS(4)};
    linear_run(&P, m * n * k, (int)c->num_threads);
    return PD_OK;
}
