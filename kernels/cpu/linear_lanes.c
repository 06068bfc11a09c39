/* Linear layer on bf16 weights stored with the outputs in the lanes: y[M, N] = bf16(x)[M, K]
 * @ W[N, K]^T (+ bias) on AVX512-BF16, W packed once at load (engine/models/lanes.py).
 *
 * Layout: [ceil(N / 64)][K2][4][16][2] bf16 with K2 = ceil(K / 2): for each group of 64
 * outputs and each pair of k, four vectors of 16 outputs' (k, k + 1) weights, one cache
 * line each, so a group's weights lie in one contiguous run; rows past N and the k past K
 * are zero.
 *
 * Invariance: y[m, n] is lane n % 16 of one float32 accumulator that takes the pairs of
 * k in increasing order, one `vdpbf16ps` each, from zero; no horizontal sum, so nothing
 * depends on M, the tile, the thread count or the blocking, and no per-output epilogue
 * is paid (the row-major kernel of linear_bf16.c sums 16 lanes per output).
 *
 * - Micro-kernel: R rows of x (1 to 6) by one group: 24 accumulators, four weight vectors
 *   per pair and each row's pair broadcast from memory.
 * - Blocking: a thread owns a contiguous run of groups (one stream for the prefetcher);
 *   rows go in blocks whose packed x fits L2 beside a group, and a group, once read,
 *   serves every tile of the block from L2. Calls of a few rows ask for the lines a
 *   few pairs ahead, since at decode sizes the weights stream from memory.
 */
#include "linear.h"

#define GROUP 64   /* outputs per group: four vectors of 16 */
#define MAX_R 6    /* rows per tile: 6 x 4 accumulators of the 32 zmm registers */
#define X_BLOCK_BYTES (256 << 10) /* packed x bytes per block of rows */
#define AHEAD_BYTES 8192          /* how far ahead in a group a group's first tile asks */
#define MIN_MACS_PER_THREAD (1 << 18)
#define ROW_SPLIT_MIN_ROWS 64 /* rows per thread from which threads split rows */

#if defined(__AVX512F__) && defined(__AVX512BF16__)

typedef struct {
    const uint16_t *xp; /* packed bf16 x, rows of kp (K rounded up to even) */
    const uint16_t *w;  /* packed weights */
    int64_t m, n;
    int k, kp, pairs;
    linear_out out;
    const float *x; /* x as given, rounded by each thread into xp when threads split rows */
    int64_t x_rs;
    int64_t groups, x_rows; /* groups of 64 outputs; rows of x per block */
    int row_split;          /* threads split the rows (1) or the groups (0) */
} lanes_args;

/* Rows m0 .. m0 + R of y for group g: the tile's 24 (or fewer) accumulators over every
 * pair, then the bias and masked stores for a group past N. PF 1: ask for this group's
 * lines ahead (a group's first tile); PF 2: ask for `per` lines of the next group from
 * `next` on each pair (the other tiles: memory streams it while they compute). */
ALWAYS_INLINE void lanes_tile(const lanes_args *A, int64_t m0, int64_t g, const int R,
                              const int PF, const char *next, int per) {
    const int pairs = A->pairs;
    const uint16_t *w = A->w + g * (int64_t)pairs * GROUP * 2;
    const uint32_t *x = (const uint32_t *)(const void *)(A->xp + m0 * A->kp);
    const int xs = A->kp / 2; /* pairs per x row */
    __m512 acc[MAX_R][4];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int j = 0; j < pairs; j++) {
        const uint16_t *wj = w + (int64_t)j * GROUP * 2;
        if (PF == 1)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) __builtin_prefetch((const char *)wj + AHEAD_BYTES + 64 * c, 0, 0);
        if (PF == 2) /* past the matrix's end a prefetch is only a wasted request */
            for (int q = 0; q < per; q++) __builtin_prefetch(next + ((int64_t)j * per + q) * 64, 0, 2);
        __m512bh wv[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) wv[c] = (__m512bh)_mm512_loadu_si512(wj + 32 * c);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * xs + j]);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    const linear_out *O = &A->out;
    const int64_t n0 = g * GROUP;
    for (int c = 0; c < 4; c++) {
        const int64_t col = n0 + 16 * c;
        if (col >= A->n) break;
        const int left = A->n - col >= 16 ? 16 : (int)(A->n - col);
        const __mmask16 keep = (__mmask16)((1u << left) - 1);
        __m512 bias = _mm512_setzero_ps();
        if (O->bias_dt == DT_F32)
            bias = _mm512_maskz_loadu_ps(keep, (const float *)O->bias + col);
        else if (O->bias_dt == DT_BF16)
            bias = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, (const uint16_t *)O->bias + col)),
                16));
        else if (O->bias_dt == DT_F16)
            bias = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, (const uint16_t *)O->bias + col));
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            /* The bias joins after the sum, as in every other path. */
            __m512 v = O->bias_dt >= 0 ? _mm512_add_ps(acc[r][c], bias) : acc[r][c];
            _mm512_mask_storeu_ps(O->y + (m0 + r) * O->y_rs + col, keep, v);
        }
    }
}

/* One tile of R rows (1 to 6) in prefetch mode pf, R and pf made constants. */
static void lanes_tile_any(const lanes_args *A, int64_t m, int64_t g, int R, int pf,
                           const char *next, int per) {
#define LANES_TILE_R(RR)                                                                       \
    case RR:                                                                                   \
        if (pf == 1) lanes_tile(A, m, g, RR, 1, next, per);                                    \
        else if (pf == 2) lanes_tile(A, m, g, RR, 2, next, per);                               \
        else lanes_tile(A, m, g, RR, 0, next, per);                                            \
        break;
    switch (R) {
        LANES_TILE_R(6)
        LANES_TILE_R(5)
        LANES_TILE_R(4)
        LANES_TILE_R(3)
        LANES_TILE_R(2)
        LANES_TILE_R(1)
    default: break;
    }
#undef LANES_TILE_R
}

/* Rows [m0, m1) against group g, six rows a tile (the last tile fewer). The first tile
 * asks for the group's lines ahead of itself; the others each ask for a slice of the
 * next group's (`next`, NULL: none), so the next first tile finds it in L2. */
static void lanes_rows(const lanes_args *A, int64_t m0, int64_t m1, int64_t g, const char *next) {
    const int64_t tiles = (m1 - m0 + MAX_R - 1) / MAX_R;
    const int64_t lines = (int64_t)A->pairs * 4; /* a group's cache lines */
    const int per = tiles > 1 ? (int)((4 + tiles - 2) / (tiles - 1)) : 0; /* lines a pair */
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t m = m0 + t * MAX_R;
        const int R = m + MAX_R <= m1 ? MAX_R : (int)(m1 - m);
        if (t == 0) {
            lanes_tile_any(A, m, g, R, 1, NULL, 0);
        } else if (next && tiles > 2) { /* one later tile: asking for a whole group measured slower */
            const int64_t from = (t - 1) * lines / (tiles - 1);
            lanes_tile_any(A, m, g, R, 2, next + from * 64, per);
        } else {
            lanes_tile_any(A, m, g, R, 0, NULL, 0);
        }
    }
}

/* Rows [m0, m1) against groups [g0, g1): blocks of rows, each against every group in turn. */
static void lanes_groups(const lanes_args *A, int64_t m0, int64_t m1, int64_t g0, int64_t g1,
                         int64_t x_rows) {
    for (int64_t b0 = m0; b0 < m1; b0 += x_rows) {
        const int64_t b1 = b0 + x_rows < m1 ? b0 + x_rows : m1;
        for (int64_t g = g0; g < g1; g++) {
            const char *next = g + 1 < g1 ? (const char *)(A->w + (g + 1) * A->pairs * GROUP * 2)
                                          : NULL;
            lanes_rows(A, b0, b1, g, next);
        }
    }
}

/* Thread t of T's share: a run of groups at decode sizes (each thread streams its own
 * weights), a run of rows (every group) from ROW_SPLIT_MIN_ROWS rows per thread, where
 * a few groups would split unevenly and the weights come from cache anyway. */
static void lanes_share(const void *args, int t, int T) {
    const lanes_args *A = args;
    if (A->row_split) {
        const int64_t tiles = (A->m + MAX_R - 1) / MAX_R;
        const int64_t m0 = tiles * t / T * MAX_R;
        const int64_t m1 = tiles * (t + 1) / T * MAX_R < A->m ? tiles * (t + 1) / T * MAX_R : A->m;
        /* Each thread rounds its own rows: no wait for one thread to pack them all. */
        linear_pack_x_bf16(A->x + m0 * A->x_rs, A->x_rs, m1 - m0, A->k, A->kp,
                           (uint16_t *)A->xp + m0 * A->kp);
        lanes_groups(A, m0, m1, 0, A->groups, A->x_rows);
    } else { /* the caller packed x */
        lanes_groups(A, 0, A->m, A->groups * t / T, A->groups * (t + 1) / T, A->x_rows);
    }
}

int linear_lanes_available(void) { return linear_bf16_dot_available(); }

static int linear_lanes(const float *x, int64_t x_rs, const uint16_t *w, const void *bias,
                        int bias_dt, float *y, int64_t y_rs, int64_t m, int64_t n, int64_t k,
                        int num_threads) {
    if (m == 0 || n == 0) return PD_OK;
    const int kp = (int)((k + 31) & ~(int64_t)31); /* the bf16 packing's rows */
    uint16_t *xp = linear_scratch((size_t)(m * kp) * sizeof(uint16_t));
    if (!xp) return PD_NO_MEMORY;
    const int64_t x_rows = X_BLOCK_BYTES / (kp * 2) / MAX_R * MAX_R;
    const int64_t groups = (n + GROUP - 1) / GROUP;
    int threads = threads_for(num_threads, m * n * k, MIN_MACS_PER_THREAD);
    const int row_split = m >= (int64_t)threads * ROW_SPLIT_MIN_ROWS;
    const lanes_args A = {.xp = xp, .w = w, .m = m, .n = n, .k = (int)k, .kp = kp,
                          .pairs = (int)((k + 1) / 2), .out = {bias, bias_dt, y, y_rs},
                          .x = x, .x_rs = x_rs, .groups = groups,
                          .x_rows = x_rows < MAX_R ? MAX_R : x_rows, .row_split = row_split};
    if (!row_split) {
        if (threads > groups) threads = (int)groups;
        linear_pack_x_bf16(x, x_rs, m, (int)k, kp, xp);
    }
    linear_parallel(threads, lanes_share, &A);
    return PD_OK;
}

#else /* the compiler does not target AVX512-BF16 */

int linear_lanes_available(void) { return 0; }

static int linear_lanes(const float *x, int64_t x_rs, const uint16_t *w, const void *bias,
                        int bias_dt, float *y, int64_t y_rs, int64_t m, int64_t n, int64_t k,
                        int num_threads) {
    (void)x, (void)x_rs, (void)w, (void)bias, (void)bias_dt, (void)y, (void)y_rs;
    (void)m, (void)n, (void)k, (void)num_threads;
    return PD_UNSUPPORTED;
}

#endif

/* The call's arguments as one struct of 8-byte fields (kernels/cpu_ops.py packs it). */
typedef struct {
    int64_t x, x_rs, w, bias, bias_dt, y, y_rs, m, n, k, num_threads, bad;
} pd_linear_lanes_call;

int64_t pd_linear_lanes_call_size(void) { return sizeof(pd_linear_lanes_call); }

/* 1 where this build and this CPU run the packed layout (AVX512-BF16). */
int pd_linear_lanes_available(void) { return linear_lanes_available(); }

int pd_linear_lanes(pd_linear_lanes_call *c) {
    return linear_lanes(PTR(c->x), c->x_rs, PTR(c->w), PTR(c->bias), (int)c->bias_dt, PTR(c->y),
                        c->y_rs, c->m, c->n, c->k, (int)c->num_threads);
}
