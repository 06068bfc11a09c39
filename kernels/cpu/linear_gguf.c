/* GGUF block-quantized linear layer: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), for W kept
 * in the GGUF file's own blocks (ggml's Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 here, the K-quants' micro-
 * kernels in linear_kquant.c) and float32 x and y.
 *
 * A weight row is K / 32 blocks of 32 weights, each block its scale beside its values:
 *   Q8_0: f16 d, 32 int8 q             w = d * q          (34 bytes)
 *   Q4_0: f16 d, 16 bytes of nibbles   w = d * (q - 8)    (18 bytes)
 *   Q4_1: f16 d, f16 m, 16 bytes       w = d * q + m      (20 bytes)
 *   Q5_0: f16 d, 4 bytes qh, 16 bytes  w = d * (q - 16)   (22 bytes)
 *   Q5_1: f16 d, f16 m, qh, 16 bytes   w = d * q + m      (24 bytes)
 * with weight j < 16 in the low nibble of byte j and weight 16 + j in its high nibble,
 * and for Q5 weight j's fifth bit bit j of qh (a little-endian 32-bit word).
 * The blocks stay packed in memory (at decode sizes the layer is bound by streaming
 * them) and a block becomes 32 float32 weights in registers, rounded exactly as ggml
 * (and `kernels.gguf_blocks.dequantize_rows`) dequantize them: a multiply (exact: a
 * float16 times at most 5 bits), then for Q4_1 and Q5_1 an add, never fused.
 *
 * Invariance and arithmetic: as linear.c's float32 path, to the bit. y[m, n] is one
 * 8-lane accumulator over K (lane j sums k = j mod 8 in increasing order, one FMA per 8
 * weights) and one horizontal sum, whatever M, the tile, the threads or the blocking;
 * so a packed matrix gives exactly the numbers of its dequantized float32 copy. The
 * AVX-512 build decodes a block 16 weights at a time (512-bit widening and scaling, the
 * same roundings per weight), the AVX2 build 8 at a time; both accumulate in 8 lanes,
 * so the two kinds of machine agree here.
 *
 * - Micro-kernel: R rows of x by C weight rows; each decoded block (4 vectors) serves the
 *   R rows. AVX-512 (32 registers): R x C in {1x12, 2x8, 3x6, 4x4}; AVX2 (16 registers):
 *   {1x8, 2x4, 3x3, 4x2}.
 * - Blocking and threads: linear_run (linear.c), over 24-row weight units.
 *
 * A call may ask for bf16 weights instead (`bf16_dot`, where the CPU has AVX512-BF16):
 * each decoded weight rounded to bf16 (to nearest even), x rounded to bf16, the products
 * in bf16 dot products. The numbers are then those of linear_bf16.c over a bf16 copy of
 * the dequantized matrix, to the bit, whatever M. At 4 rows or more a block of weight
 * rows is decoded once into a per-thread bf16 panel that every row of the x block meets
 * (linear_bf16_dot_decoded): decoding per tile would cost ~3x the products at 32 rows.
 * Below 4 rows each block is decoded in registers and met at once (dot_tile here), in
 * the panel tile's accumulators and order; so do the K-quants' chunks (linear_kquant.c).
 */
#include "linear.h"

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8 };

#define QK 32    /* weights per block */
#define UNIT_N 24 /* weight rows per work unit: every C divides it */
#define X_BLOCK_BYTES (192 << 10)
#if defined(__AVX512F__)
#define COLS(R) ((R) == 1 ? 12 : (R) == 2 ? 8 : (R) == 3 ? 6 : 4)
#else
#define COLS(R) ((R) == 1 ? 8 : (R) == 2 ? 4 : (R) == 3 ? 3 : 2)
#endif

/* Types with a float16 minimum after d, and with 4 bytes of fifth bits after the scales. */
ALWAYS_INLINE int has_min(const int T) { return T == GGML_Q4_1 || T == GGML_Q5_1; }
ALWAYS_INLINE int has_high(const int T) { return T == GGML_Q5_0 || T == GGML_Q5_1; }

/* Where the values (Q8_0's 32 bytes, the others' 16 bytes of nibbles) start. */
ALWAYS_INLINE int values_at(const int T) { return 2 + 2 * has_min(T) + 4 * has_high(T); }

ALWAYS_INLINE int block_bytes(const int T) { return values_at(T) + (T == GGML_Q8_0 ? 32 : 16); }

/* The offset subtracted from q: Q4_0's 8, Q5_0's 16, none with a minimum. */
ALWAYS_INLINE int q_offset(const int T) { return T == GGML_Q4_0 ? 8 : T == GGML_Q5_0 ? 16 : 0; }

ALWAYS_INLINE uint32_t high_bits(const uint8_t *b, const int T) {
    uint32_t qh;
    memcpy(&qh, b + 2 + 2 * has_min(T), 4);
    return qh;
}

#if defined(__AVX512F__)
/* The block's 32 weights as two vectors of 16, in order. */
ALWAYS_INLINE void decode_block16(const uint8_t *b, __m512 *lo, __m512 *hi, const int T) {
    const __m512 d = _mm512_set1_ps(gguf_half(b));
    __m512 v0, v1;
    if (T == GGML_Q8_0) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(b + 18));
        v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
        v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + values_at(T)));
        const __m128i nib = _mm_set1_epi8(0x0f);
        __m512i i0 = _mm512_cvtepu8_epi32(_mm_and_si128(raw, nib));
        __m512i i1 = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), nib));
        if (has_high(T)) { /* 16 where the weight's bit of qh is set: one mask a half */
            const uint32_t qh = high_bits(b, T);
            const __m512i sixteen = _mm512_set1_epi32(16);
            i0 = _mm512_mask_or_epi32(i0, (__mmask16)(qh & 0xffff), i0, sixteen);
            i1 = _mm512_mask_or_epi32(i1, (__mmask16)(qh >> 16), i1, sixteen);
        }
        if (q_offset(T)) {
            i0 = _mm512_sub_epi32(i0, _mm512_set1_epi32(q_offset(T)));
            i1 = _mm512_sub_epi32(i1, _mm512_set1_epi32(q_offset(T)));
        }
        v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(i0), d);
        v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(i1), d);
        if (has_min(T)) {
            const __m512 m = _mm512_set1_ps(gguf_half(b + 2));
            v0 = _mm512_add_ps(v0, m);
            v1 = _mm512_add_ps(v1, m);
        }
    }
    *lo = v0, *hi = v1;
}

/* The block's 32 weights as 4 vectors of 8, in order. */
ALWAYS_INLINE void decode_block(const uint8_t *b, v8f *w, const int T) {
    __m512 v0, v1;
    decode_block16(b, &v0, &v1, T);
    gguf_split16(v0, &w[0], &w[1]);
    gguf_split16(v1, &w[2], &w[3]);
}
#elif defined(__AVX2__)
ALWAYS_INLINE void decode_block(const uint8_t *b, v8f *w, const int T) {
    const __m256 d = _mm256_set1_ps(gguf_half(b));
    __m256i i[4];
    if (T == GGML_Q8_0) {
        for (int j = 0; j < 4; j++)
            i[j] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j)));
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + values_at(T)));
        const __m128i nib = _mm_set1_epi8(0x0f);
        const __m128i lo = _mm_and_si128(raw, nib);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
        i[0] = _mm256_cvtepu8_epi32(lo);
        i[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
        i[2] = _mm256_cvtepu8_epi32(hi);
        i[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
        if (has_high(T)) { /* lane l of vector j: bit 8j + l of qh, moved to bit 4 */
            const __m256i qh = _mm256_set1_epi32((int)high_bits(b, T));
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            for (int j = 0; j < 4; j++) {
                const __m256i shift = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * j));
                const __m256i bit =
                    _mm256_and_si256(_mm256_srlv_epi32(qh, shift), _mm256_set1_epi32(1));
                i[j] = _mm256_or_si256(i[j], _mm256_slli_epi32(bit, 4));
            }
        }
    }
    const __m256 m = has_min(T) ? _mm256_set1_ps(gguf_half(b + 2)) : _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        if (q_offset(T)) i[j] = _mm256_sub_epi32(i[j], _mm256_set1_epi32(q_offset(T)));
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(i[j]), d);
        if (has_min(T)) v = _mm256_add_ps(v, m);
        w[j] = (v8f)v;
    }
}
#else /* any other CPU: the same roundings, one weight at a time */
ALWAYS_INLINE void decode_block(const uint8_t *b, v8f *w, const int T) {
    const float d = gguf_half(b), m = has_min(T) ? gguf_half(b + 2) : 0.0f;
    const uint32_t qh = has_high(T) ? high_bits(b, T) : 0;
    const uint8_t *q = b + values_at(T);
    for (int j = 0; j < QK; j++) {
        float v;
        if (T == GGML_Q8_0) v = (float)(int8_t)q[j] * d;
        else {
            const int nibble = (j < 16 ? q[j] & 15 : q[j - 16] >> 4) | (int)(qh >> j & 1) << 4;
            v = has_min(T) ? (float)nibble * d + m : (float)(nibble - q_offset(T)) * d;
        }
        w[j / 8][j % 8] = v;
    }
}
#endif

/* R rows of x from row m0 times C weight rows from row n: y[r][c] for the tile. */
ALWAYS_INLINE void tile(const gguf_args *A, int64_t m0, int64_t n, const int R, const int C,
                        const int T) {
    const float *x = A->x + m0 * A->x_rs;
    const uint8_t *w = A->w + n * A->w_rs;
    float *y = linear_y(&A->out, m0, n);
    const int blocks = A->k / QK, BB = block_bytes(T);
    const int64_t rs = A->w_rs, xs = A->x_rs;
    v8f acc[GGUF_MAX_R][GGUF_MAX_C];
    gguf_tile_zero(acc, R, C);
    for (int kb = 0; kb < blocks; kb++) {
        const int k = kb * QK;
#pragma GCC unroll 12
        for (int c = 0; c < C; c++) {
            const uint8_t *block = w + c * rs + (int64_t)kb * BB;
            /* The next tile's rows, about a 64-byte line at a time (as linear.c). */
            if (!(kb & 1)) __builtin_prefetch(block + C * rs, 0, 0);
            v8f wv[4];
            decode_block(block, wv, T);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const float *xr = x + r * xs + k;
                /* lane j: k = j, j + 8, ...: linear.c's order for float32 weights */
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) acc[r][c] = v8_fma(v8_load(xr + 8 * j), wv[j], acc[r][c]);
            }
        }
    }
    gguf_tile_put(A, y, n, acc, R, C);
}

LINEAR_ROWS_FN(rows_q8_0, gguf_args, tile, COLS, GGML_Q8_0)
LINEAR_ROWS_FN(rows_q4_0, gguf_args, tile, COLS, GGML_Q4_0)
LINEAR_ROWS_FN(rows_q4_1, gguf_args, tile, COLS, GGML_Q4_1)
LINEAR_ROWS_FN(rows_q5_0, gguf_args, tile, COLS, GGML_Q5_0)
LINEAR_ROWS_FN(rows_q5_1, gguf_args, tile, COLS, GGML_Q5_1)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* The block's 32 weights rounded to bf16 (to nearest even), in order: decode_block16's
 * values, then the rounding. A 4- or 5-bit type looks them up in a table of the 16 (32)
 * values its quants give, built per block by the same multiply (and add: the product is
 * exact, so one FMA rounds as the two operations do); Q8_0 converts. ~Half the vector
 * work per weight of converting each one. */
ALWAYS_INLINE __m512i decode_block_bf16(const uint8_t *b, const int T) {
    if (T == GGML_Q8_0) {
        __m512 lo, hi;
        decode_block16(b, &lo, &hi, T);
        return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    }
    const float off = (float)q_offset(T);
    const __m512 d = _mm512_set1_ps(gguf_half(b));
    const __m512 q0 = _mm512_sub_ps(
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps(off));
    __m512 t0, t1 = _mm512_setzero_ps();
    if (has_min(T)) { /* the product is exact, so the FMA rounds once, as the add does */
        const __m512 m = _mm512_set1_ps(gguf_half(b + 2));
        t0 = _mm512_fmadd_ps(q0, d, m);
        if (has_high(T)) t1 = _mm512_fmadd_ps(_mm512_add_ps(q0, _mm512_set1_ps(16.0f)), d, m);
    } else {
        t0 = _mm512_mul_ps(q0, d);
        if (has_high(T)) t1 = _mm512_mul_ps(_mm512_add_ps(q0, _mm512_set1_ps(16.0f)), d);
    }
    const __m512i table =
        has_high(T) ? (__m512i)_mm512_cvtne2ps_pbh(t1, t0)
                    : _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(t0));
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + values_at(T)));
    const __m256i nib =
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
    __m512i idx = _mm512_cvtepu8_epi16(nib);
    if (has_high(T)) /* 16 where the weight's bit of qh is set */
        idx = _mm512_mask_add_epi16(idx, (__mmask32)high_bits(b, T), idx, _mm512_set1_epi16(16));
    return _mm512_permutexvar_epi16(idx, table);
}

/* Weight rows [n0, n1) as bf16 rows of kp (= K) weights at dst: each weight decoded as
 * above, then rounded to bf16 (to nearest even), the value a bf16 copy of the dequantized
 * matrix holds. */
ALWAYS_INLINE void decode_rows_bf16(const gguf_args *A, int64_t n0, int64_t n1, uint16_t *dst,
                                    int kp, const int T) {
    const int blocks = A->k / QK, BB = block_bytes(T);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = A->w + n * A->w_rs;
        uint16_t *out = dst + (n - n0) * kp;
        for (int kb = 0; kb < blocks; kb++)
            _mm512_store_si512(out + kb * QK, decode_block_bf16(row + (int64_t)kb * BB, T));
    }
}

static void decode_bf16(const void *src, int64_t n0, int64_t n1, uint16_t *dst, int kp) {
    const gguf_args *A = src;
    switch (A->type) {
    case GGML_Q8_0: decode_rows_bf16(A, n0, n1, dst, kp, GGML_Q8_0); break;
    case GGML_Q4_0: decode_rows_bf16(A, n0, n1, dst, kp, GGML_Q4_0); break;
    case GGML_Q4_1: decode_rows_bf16(A, n0, n1, dst, kp, GGML_Q4_1); break;
    case GGML_Q5_0: decode_rows_bf16(A, n0, n1, dst, kp, GGML_Q5_0); break;
    default: decode_rows_bf16(A, n0, n1, dst, kp, GGML_Q5_1); break;
    }
}
/* The panel path's tile (linear_bf16.c) with each block decoded in registers instead of
 * from a panel: the same products in the same accumulators, so the same numbers, for
 * calls of fewer than 4 rows, where a panel would be decoded for one use. */
ALWAYS_INLINE void dot_tile(const gguf_dot_args *A, int64_t m0, int64_t n, const int R,
                            const int C, const int T) {
    const uint16_t *xp = A->xp + m0 * A->kp;
    const uint8_t *w = A->g.w + n * A->g.w_rs;
    float *y = linear_y(&A->g.out, m0, n);
    const int blocks = A->g.k / QK, BB = block_bytes(T);
    const int64_t rs = A->g.w_rs;
    __m512 acc[32]; /* R * C used; the rest stay zero for the sums */
#pragma GCC unroll 32
    for (int i = 0; i < 32; i++) acc[i] = _mm512_setzero_ps();
    for (int kb = 0; kb < blocks; kb++) {
        __m512i xv[GGUF_MAX_R];
#pragma GCC unroll 3
        for (int r = 0; r < R; r++) xv[r] = _mm512_load_si512(xp + r * A->kp + kb * QK);
#pragma GCC unroll 12
        for (int c = 0; c < C; c++) {
            const uint8_t *block = w + c * rs + (int64_t)kb * BB;
            if (!(kb & 1)) __builtin_prefetch(block + C * rs, 0, 0);
            const __m512bh wv = (__m512bh)decode_block_bf16(block, T);
#pragma GCC unroll 3
            for (int r = 0; r < R; r++)
                acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], (__m512bh)xv[r], wv);
        }
    }
    linear_put_sums(&A->g.out, y, n, acc, R, C);
}

#define DOT_COLS(R) ((R) == 1 ? 12 : (R) == 2 ? 8 : 6)
LINEAR_ROWS_FN(dot_q8_0, gguf_dot_args, dot_tile, DOT_COLS, GGML_Q8_0)
LINEAR_ROWS_FN(dot_q4_0, gguf_dot_args, dot_tile, DOT_COLS, GGML_Q4_0)
LINEAR_ROWS_FN(dot_q4_1, gguf_dot_args, dot_tile, DOT_COLS, GGML_Q4_1)
LINEAR_ROWS_FN(dot_q5_0, gguf_dot_args, dot_tile, DOT_COLS, GGML_Q5_0)
LINEAR_ROWS_FN(dot_q5_1, gguf_dot_args, dot_tile, DOT_COLS, GGML_Q5_1)

/* y from bf16 dot products for m < 4 rows: blocks (or K-quant chunks) decoded in
 * registers. */
static int dot_few_rows(const gguf_args *G, int64_t m, int64_t n, int num_threads) {
    const int kp = G->k; /* whole 32-weight blocks: no padding */
    uint16_t *xp = linear_scratch((size_t)(m * kp) * sizeof(uint16_t));
    if (!xp) return PD_NO_MEMORY;
    linear_pack_x_bf16(G->x, G->x_rs, m, G->k, kp, xp);
    gguf_dot_args A = {.g = *G, .xp = xp, .kp = kp};
    const int64_t T = G->type;
    linear_plan P = {.rows = T == GGML_Q8_0   ? dot_q8_0
                             : T == GGML_Q4_0 ? dot_q4_0
                             : T == GGML_Q4_1 ? dot_q4_1
                             : T == GGML_Q5_0 ? dot_q5_0
                             : T == GGML_Q5_1 ? dot_q5_1
                                              : linear_kquant_dot_rows(T),
                     .args = &A, .m = m, .n = n, .unit_n = UNIT_N, .x_rows = 4,
                     .w_units = linear_block_units(UNIT_N * G->w_rs)};
    linear_run(&P, m * n * G->k, num_threads);
    return PD_OK;
}

#define HAS_DECODE_BF16 1
#else
#define HAS_DECODE_BF16 0
#endif

/* The call's arguments as one struct of 8-byte fields (kernels/cpu_quantized.py packs it). */
typedef struct {
    int64_t x, x_rs, w, w_rs, type, bias, bias_dt, y, y_rs;
    int64_t m, n, k, bf16_dot, num_threads, bad;
} pd_linear_gguf_call;

int64_t pd_linear_gguf_call_size(void) { return sizeof(pd_linear_gguf_call); }

/* Weights and bytes of one block of ggml type `type`; 0 weights for a type not served. */
static void block_shape(int64_t type, int *weights, int *bytes) {
    static const struct { int64_t type; int weights, bytes; } shapes[] = {
        {GGML_Q8_0, QK, 34}, {GGML_Q4_0, QK, 18}, {GGML_Q4_1, QK, 20},
        {GGML_Q5_0, QK, 22}, {GGML_Q5_1, QK, 24},
        {12, 256, 144}, {13, 256, 176}, {14, 256, 210}, /* Q4_K, Q5_K, Q6_K */
    };
    *weights = *bytes = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        if (shapes[i].type == type) *weights = shapes[i].weights, *bytes = shapes[i].bytes;
}

/* PD_UNSUPPORTED for a block type not served or a K that is not whole blocks. */
int pd_linear_gguf(pd_linear_gguf_call *c) {
    const int64_t m = c->m, n = c->n, k = c->k;
    int block, bytes;
    block_shape(c->type, &block, &bytes);
    linear_rows_fn rows = c->type == GGML_Q8_0   ? rows_q8_0
                          : c->type == GGML_Q4_0 ? rows_q4_0
                          : c->type == GGML_Q4_1 ? rows_q4_1
                          : c->type == GGML_Q5_0 ? rows_q5_0
                          : c->type == GGML_Q5_1 ? rows_q5_1
                                                 : linear_kquant_rows(c->type);
    if (!rows || !block || k % block || k <= 0 || c->w_rs < k / block * bytes)
        return PD_UNSUPPORTED;
#if HAS_DECODE_BF16
    const linear_bf16_decode_fn decode = block == QK ? decode_bf16 : linear_kquant_decode_bf16(c->type);
#else
    const linear_bf16_decode_fn decode = NULL;
#endif
    if (c->bf16_dot && (!decode || !linear_bf16_dot_available())) return PD_UNSUPPORTED;
    if (m == 0 || n == 0) return PD_OK;
    gguf_args A = {.x = PTR(c->x), .x_rs = c->x_rs, .w = PTR(c->w), .w_rs = c->w_rs,
                   .out = {PTR(c->bias), (int)c->bias_dt, PTR(c->y), c->y_rs}, .k = (int)k,
                   .type = c->type};
#if HAS_DECODE_BF16
    if (c->bf16_dot && m < 4) return dot_few_rows(&A, m, n, (int)c->num_threads);
#endif
    if (c->bf16_dot)
        return linear_bf16_dot_decoded(A.x, A.x_rs, decode, &A, A.w, A.w_rs, A.out.bias,
                                       A.out.bias_dt, A.out.y, A.out.y_rs, m, n, k,
                                       (int)c->num_threads);
    linear_plan P = {.rows = rows, .args = &A, .m = m, .n = n, .unit_n = UNIT_N,
                     .x_rows = linear_block_rows(X_BLOCK_BYTES, k * 4),
                     .w_units = linear_block_units(UNIT_N * c->w_rs)};
    linear_run(&P, m * n * k, (int)c->num_threads);
    return PD_OK;
}

/* ---- rows of a packed matrix: an embedding table kept in its blocks ---- */

/* The matrix, the ids of the rows wanted, and float32 rows out; `bf16`: each weight
 * rounded to bf16 (to nearest even), the values of a bf16 copy. */
typedef struct {
    int64_t w, w_rs, type, k, num_rows;
    int64_t ids, ids_ix, ids_s, n;
    int64_t out, out_rs, bf16, bad;
} pd_gguf_rows_call;

int64_t pd_gguf_rows_call_size(void) { return sizeof(pd_gguf_rows_call); }

/* Row `row` of blocks of type T as k float32 weights, as the tiles decode them. */
ALWAYS_INLINE void block_row_f32(const uint8_t *row, int k, float *out, const int T) {
    for (int kb = 0; kb < k / QK; kb++) {
        v8f w[4];
        decode_block(row + (int64_t)kb * block_bytes(T), w, T);
        for (int j = 0; j < 4; j++) v8_store(out + kb * QK + 8 * j, w[j]);
    }
}

static void row_f32(const uint8_t *row, int k, int64_t type, float *out) {
    switch (type) {
    case GGML_Q8_0: block_row_f32(row, k, out, GGML_Q8_0); break;
    case GGML_Q4_0: block_row_f32(row, k, out, GGML_Q4_0); break;
    case GGML_Q4_1: block_row_f32(row, k, out, GGML_Q4_1); break;
    case GGML_Q5_0: block_row_f32(row, k, out, GGML_Q5_0); break;
    case GGML_Q5_1: block_row_f32(row, k, out, GGML_Q5_1); break;
    default: linear_kquant_row_f32(row, k, type, out); break;
    }
}

/* On the calling thread: a step looks up one row per token. PD_BAD_ROW_ID (nothing
 * written) for an id outside the matrix; PD_UNSUPPORTED as pd_linear_gguf. */
int pd_gguf_rows(pd_gguf_rows_call *c) {
    const int64_t k = c->k;
    int block, bytes;
    block_shape(c->type, &block, &bytes);
    if (!block || k % block || k <= 0 || c->w_rs < k / block * bytes) return PD_UNSUPPORTED;
    for (int64_t i = 0; i < c->n; i++) {
        const int64_t id = load_index(PTR(c->ids), (int)c->ids_ix, i * c->ids_s);
        if (id < 0 || id >= c->num_rows) return fail_at(&c->bad, i, PD_BAD_ROW_ID);
    }
    const uint8_t *w = PTR(c->w);
    for (int64_t i = 0; i < c->n; i++) {
        const int64_t id = load_index(PTR(c->ids), (int)c->ids_ix, i * c->ids_s);
        float *out = (float *)PTR(c->out) + i * c->out_rs;
        row_f32(w + id * c->w_rs, (int)k, c->type, out);
        if (c->bf16)
            for (int64_t j = 0; j < k; j++) out[j] = bf16_to_float(float_to_bf16(out[j]));
    }
    return PD_OK;
}
