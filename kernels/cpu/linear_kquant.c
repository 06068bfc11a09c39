/* The GGUF linear layer's micro-kernels for ggml's K-quants (Q4_K, Q5_K, Q6_K): W kept in
 * the file's 256-weight super-blocks, float32 x and y; linear_gguf.c's entry point calls
 * them.
 *
 * A super-block is 8 sub-blocks of 32 weights (Q6_K: 16 of 16) with their scales:
 *   Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs, 128 bytes
 *        of nibbles; w = d * sc[s] * q - dmin * mn[s], q in 0..15
 *   Q5_K (176 bytes): Q4_K's header, 32 bytes of high bits (bit s of byte l: weight l of
 *        sub-block s), 128 bytes of nibbles; q in 0..31
 *   Q6_K (210 bytes): 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales,
 *        f16 d; w = d * sc[i / 16] * (q - 32), q in 0..63
 * Sub-blocks 2j and 2j + 1 of Q4_K/Q5_K are the low and high nibbles of bytes 32j..32j+31;
 * Q6_K's half h (128 weights) keeps weights 0..63 in the low nibbles of its 64 bytes and
 * 64..127 in the high ones, and its high parts 32 bytes of 2-bit fields, 4 per byte.
 *
 * Arithmetic: each product above (an f16 times a 6- or 8-bit integer times q) is exact
 * in float32, so a weight has one rounding, at the subtraction, whatever the order of the
 * multiplies: it is ggml's (and `kernels.gguf_kquants`') dequantized float32 weight to
 * the bit. The accumulation is linear_gguf.c's (linear.c's float32 order: one 8-lane
 * accumulator over K, one horizontal sum), so a packed matrix gives exactly the numbers
 * of its dequantized float32 copy, on both builds.
 *
 * - Micro-kernel: R rows of x by C weight rows, linear_gguf.c's shapes; the C rows'
 *   super-block scales are decoded once, then chunk by chunk (32 weights, 4 vectors) each
 *   row's chunk serves the R rows of x.
 * - Blocking and threads: linear_gguf.c's plan (linear_run over 24-row units).
 *
 * bf16 weights (linear_gguf.c's `bf16_dot`): each chunk decoded as above and rounded to
 * bf16 (chunk_bf16: Q4_K and Q5_K through a table of the chunk's values), into a panel
 * of weight rows (linear_bf16_dot_decoded) from 4 rows of x up, in registers below
 * (dot_tile), the same sums either way.
 */
#include "linear.h"

enum { GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };

#define QK_K 256 /* weights per super-block */
#if defined(__AVX512F__)
#define COLS(R) ((R) == 1 ? 12 : (R) == 2 ? 8 : (R) == 3 ? 6 : 4)
#else
#define COLS(R) ((R) == 1 ? 8 : (R) == 2 ? 4 : (R) == 3 ? 3 : 2)
#endif

ALWAYS_INLINE int super_bytes(const int T) {
    return T == GGML_Q4_K ? 144 : T == GGML_Q5_K ? 176 : 210;
}

/* The super-block's float32 scales: a[s] = d * sc[s] and m[s] = dmin * mn[s] for the 8
 * sub-blocks (Q4_K, Q5_K); a[i] = d * sc[i] for the 16 of Q6_K. */
ALWAYS_INLINE void super_scales(const uint8_t *b, float *a, float *m, const int T) {
    if (T == GGML_Q6_K) {
        const float d = gguf_half(b + 208);
#if defined(__AVX2__)
        const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
        const __m256 dv = _mm256_set1_ps(d);
        _mm256_storeu_ps(a, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
        _mm256_storeu_ps(a + 8, _mm256_mul_ps(
            dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
#else
        for (int i = 0; i < 16; i++) a[i] = d * (float)(int8_t)b[192 + i];
#endif
        return;
    }
    const float d = gguf_half(b), dmin = gguf_half(b + 2);
    const uint8_t *p = b + 4;
    /* Sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7: a nibble
     * of bytes 8-11 below the top 2 bits of those bytes. */
#if defined(__AVX2__)
    /* The 16 six-bit values in byte lanes (scales 0-7, mins 8-15), then as floats: the
     * loop below, a few shuffles instead of ~100 scalar operations a super-block (a tile
     * decodes the scales of its every weight row per super-block). */
    uint32_t tail;
    memcpy(&tail, p + 8, 4);
    const __m128i v = _mm_insert_epi32(_mm_loadl_epi64((const __m128i *)p), (int)tail, 2);
    const __m128i low = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7,
                                                          8, 9, 10, 11));
    const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1,
                                                          -1, 4, 5, 6, 7));
    /* low bits: & 63 for sub-blocks 0-3, & 15 (scales) or >> 4 (mins) for 4-7 */
    const __m128i mins_hi = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1);
    const __m128i keep = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15,
                                       15, 15);
    const __m128i shifted = _mm_and_si128(_mm_srli_epi16(low, 4), _mm_set1_epi8(15));
    const __m128i bits = _mm_and_si128(_mm_blendv_epi8(low, shifted, mins_hi), keep);
    /* and for 4-7 the top 2 bits of bytes 0-3 (scales) or 4-7 (mins), as bits 4-5 */
    const __m128i high = _mm_srli_epi16(_mm_and_si128(top, _mm_set1_epi8((char)0xc0)), 2);
    const __m128i q = _mm_or_si128(bits, high);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
    _mm256_storeu_ps(a, _mm256_mul_ps(_mm256_set1_ps(d), sc));
    _mm256_storeu_ps(m, _mm256_mul_ps(_mm256_set1_ps(dmin), mn));
#else
    for (int s = 0; s < 8; s++) {
        const int sc = s < 4 ? p[s] & 63 : (p[s + 4] & 15) | (p[s - 4] >> 6) << 4;
        const int mn = s < 4 ? p[s + 4] & 63 : (p[s + 4] >> 4) | (p[s] >> 6) << 4;
        a[s] = d * (float)sc;
        m[s] = dmin * (float)mn;
    }
#endif
}

#if defined(__AVX2__)
/* Chunk s's 32 quantized values (0..63), one a byte, in order. */
ALWAYS_INLINE __m256i chunk_q(const uint8_t *b, const int s, const int T) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    if (T == GGML_Q6_K) {
        const int h = s >> 2, sub = s & 3;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (sub & 1)));
        ql = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (sub >> 1))), low4);
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        qh = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * sub));
        qh = _mm256_and_si256(qh, _mm256_set1_epi8(3));
        return _mm256_or_si256(ql, _mm256_slli_epi16(qh, 4)); /* bytes stay under 64 */
    }
    const uint8_t *qs = b + (T == GGML_Q5_K ? 48 : 16) + 32 * (s >> 1);
    __m256i q = _mm256_loadu_si256((const __m256i *)qs);
    q = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(4 * (s & 1))), low4);
    if (T == GGML_Q5_K) {
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        qh = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(1));
        q = _mm256_or_si256(q, _mm256_slli_epi16(qh, 4));
    }
    return q;
}
#endif

#if defined(__AVX512F__)
/* 16 values as weights: a * (q - 32) (Q6_K) or a * q - m. */
ALWAYS_INLINE __m512 scale16(__m128i q8, float a, float m, const int T) {
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q8));
    if (T == GGML_Q6_K) return _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps(32.0f)), _mm512_set1_ps(a));
    return _mm512_sub_ps(_mm512_mul_ps(q, _mm512_set1_ps(a)), _mm512_set1_ps(m));
}

/* Chunk s's 32 weights as 4 vectors of 8, in order. */
ALWAYS_INLINE void decode_chunk(const uint8_t *b, const int s, const float *a, const float *m,
                                v8f *w, const int T) {
    const __m256i q = chunk_q(b, s, T);
    const float a0 = T == GGML_Q6_K ? a[2 * s] : a[s], a1 = T == GGML_Q6_K ? a[2 * s + 1] : a[s];
    const float m0 = T == GGML_Q6_K ? 0.0f : m[s];
    gguf_split16(scale16(_mm256_castsi256_si128(q), a0, m0, T), &w[0], &w[1]);
    gguf_split16(scale16(_mm256_extracti128_si256(q, 1), a1, m0, T), &w[2], &w[3]);
}
#elif defined(__AVX2__)
ALWAYS_INLINE void decode_chunk(const uint8_t *b, const int s, const float *a, const float *m,
                                v8f *w, const int T) {
    const __m256i q = chunk_q(b, s, T);
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[j]));
        if (T == GGML_Q6_K) {
            const __m256 d = _mm256_set1_ps(a[2 * s + j / 2]);
            w[j] = (v8f)_mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(32.0f)), d);
        } else {
            const __m256 d = _mm256_set1_ps(a[s]);
            w[j] = (v8f)_mm256_sub_ps(_mm256_mul_ps(v, d), _mm256_set1_ps(m[s]));
        }
    }
}
#else /* any other CPU: the same roundings, one weight at a time */
ALWAYS_INLINE void decode_chunk(const uint8_t *b, const int s, const float *a, const float *m,
                                v8f *w, const int T) {
    for (int l = 0; l < 32; l++) {
        float v;
        if (T == GGML_Q6_K) {
            const int h = s >> 2, sub = s & 3;
            const int lo = b[64 * h + 32 * (sub & 1) + l] >> 4 * (sub >> 1) & 15;
            const int hi = b[128 + 32 * h + l] >> 2 * sub & 3;
            v = ((float)(lo | hi << 4) - 32.0f) * a[2 * s + l / 16];
        } else {
            const int off = T == GGML_Q5_K ? 48 : 16;
            int q = b[off + 32 * (s >> 1) + l] >> 4 * (s & 1) & 15;
            if (T == GGML_Q5_K) q |= (b[16 + l] >> s & 1) << 4;
            v = (float)q * a[s] - m[s];
        }
        w[l / 8][l % 8] = v;
    }
}
#endif

/* R rows of x from row m0 times C weight rows from row n: y[r][c] for the tile. */
ALWAYS_INLINE void tile(const gguf_args *A, int64_t m0, int64_t n, const int R, const int C,
                        const int T) {
    const float *x = A->x + m0 * A->x_rs;
    const uint8_t *w = A->w + n * A->w_rs;
    float *y = linear_y(&A->out, m0, n);
    const int supers = A->k / QK_K, BB = super_bytes(T);
    const int64_t rs = A->w_rs, xs = A->x_rs;
    v8f acc[GGUF_MAX_R][GGUF_MAX_C];
    gguf_tile_zero(acc, R, C);
    for (int sb = 0; sb < supers; sb++) {
        const uint8_t *blocks = w + (int64_t)sb * BB;
        float a[GGUF_MAX_C][16], m[GGUF_MAX_C][8];
#pragma GCC unroll 12
        for (int c = 0; c < C; c++) super_scales(blocks + c * rs, a[c], m[c], T);
        /* Chunks outer, weight rows inner (as linear_gguf.c's blocks): the unrolled body
         * is one chunk of each row, and each accumulator still sums k in order. */
        for (int s = 0; s < 8; s++) {
            const int k = sb * QK_K + 32 * s;
#pragma GCC unroll 12
            for (int c = 0; c < C; c++) {
                const uint8_t *block = blocks + c * rs;
                /* The next tile's rows, a 64-byte line at a time (as linear_gguf.c). */
                if (s < 4) __builtin_prefetch(block + C * rs + 64 * s, 0, 0);
                v8f wv[4];
                decode_chunk(block, s, a[c], m[c], wv, T);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const float *xr = x + r * xs + k;
                    /* lane j: k = j, j + 8, ...: linear.c's order for float32 weights */
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++)
                        acc[r][c] = v8_fma(v8_load(xr + 8 * j), wv[j], acc[r][c]);
                }
            }
        }
    }
    gguf_tile_put(A, y, n, acc, R, C);
}

LINEAR_ROWS_FN(rows_q4_k, gguf_args, tile, COLS, GGML_Q4_K)
LINEAR_ROWS_FN(rows_q5_k, gguf_args, tile, COLS, GGML_Q5_K)
LINEAR_ROWS_FN(rows_q6_k, gguf_args, tile, COLS, GGML_Q6_K)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* Chunk s's 32 weights rounded to bf16 (to nearest even), in order: the tiles' values,
 * then the rounding. Q4_K and Q5_K (one scale and minimum a chunk) look them up in a
 * table of the 16 (32) values the chunk's quants give, built by one FMA per 16 (a * q is
 * exact, so the FMA rounds once, as the subtraction does); Q6_K (two scales a chunk, 64
 * values each) converts. */
ALWAYS_INLINE __m512i chunk_bf16(const uint8_t *b, const int s, const float *a, const float *m,
                                 const int T) {
    const __m256i q = chunk_q(b, s, T);
    if (T == GGML_Q6_K) {
        const __m512 lo = scale16(_mm256_castsi256_si128(q), a[2 * s], 0.0f, T);
        const __m512 hi = scale16(_mm256_extracti128_si256(q, 1), a[2 * s + 1], 0.0f, T);
        return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    }
    const __m512 scale = _mm512_set1_ps(a[s]), minus = _mm512_set1_ps(-m[s]);
    const __m512 q0 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 t0 = _mm512_fmadd_ps(q0, scale, minus);
    __m512i table;
    if (T == GGML_Q5_K) {
        const __m512 t1 = _mm512_fmadd_ps(_mm512_add_ps(q0, _mm512_set1_ps(16.0f)), scale, minus);
        table = (__m512i)_mm512_cvtne2ps_pbh(t1, t0);
    } else {
        table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(t0));
    }
    return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), table);
}

/* Weight rows [n0, n1) as bf16 rows of kp (= K) weights at dst: each chunk decoded as the
 * tiles decode it, then rounded to bf16 (to nearest even). */
ALWAYS_INLINE void decode_rows_bf16(const gguf_args *A, int64_t n0, int64_t n1, uint16_t *dst,
                                    int kp, const int T) {
    const int supers = A->k / QK_K, BB = super_bytes(T);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = A->w + n * A->w_rs;
        uint16_t *out = dst + (n - n0) * kp;
        for (int sb = 0; sb < supers; sb++) {
            const uint8_t *b = row + (int64_t)sb * BB;
            float a[16], m[8] = {0};
            super_scales(b, a, m, T);
            for (int s = 0; s < 8; s++)
                _mm512_store_si512(out + sb * QK_K + 32 * s, chunk_bf16(b, s, a, m, T));
        }
    }
}

/* The panel tile (linear_bf16.c) with each chunk decoded in registers: the same products
 * in the same accumulators as the panel rows decode_rows_bf16 writes. */
ALWAYS_INLINE void dot_tile(const gguf_dot_args *A, int64_t m0, int64_t n, const int R,
                            const int C, const int T) {
    const uint16_t *xp = A->xp + m0 * A->kp;
    const uint8_t *w = A->g.w + n * A->g.w_rs;
    float *y = linear_y(&A->g.out, m0, n);
    const int supers = A->g.k / QK_K, BB = super_bytes(T);
    const int64_t rs = A->g.w_rs;
    __m512 acc[32]; /* R * C used; the rest stay zero for the sums */
#pragma GCC unroll 32
    for (int i = 0; i < 32; i++) acc[i] = _mm512_setzero_ps();
    for (int sb = 0; sb < supers; sb++) {
        const uint8_t *blocks = w + (int64_t)sb * BB;
        float a[GGUF_MAX_C][16], m[GGUF_MAX_C][8];
#pragma GCC unroll 12
        for (int c = 0; c < C; c++) super_scales(blocks + c * rs, a[c], m[c], T);
        for (int s = 0; s < 8; s++) {
            const int k = sb * QK_K + 32 * s;
            __m512i xv[GGUF_MAX_R];
#pragma GCC unroll 3
            for (int r = 0; r < R; r++) xv[r] = _mm512_load_si512(xp + r * A->kp + k);
#pragma GCC unroll 12
            for (int c = 0; c < C; c++) {
                const uint8_t *block = blocks + c * rs;
                if (s < 4) __builtin_prefetch(block + C * rs + 64 * s, 0, 0);
                const __m512bh wv = (__m512bh)chunk_bf16(block, s, a[c], m[c], T);
#pragma GCC unroll 3
                for (int r = 0; r < R; r++)
                    acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], (__m512bh)xv[r], wv);
            }
        }
    }
    linear_put_sums(&A->g.out, y, n, acc, R, C);
}

#define DOT_COLS(R) ((R) == 1 ? 12 : (R) == 2 ? 8 : 6)
LINEAR_ROWS_FN(dot_q4_k, gguf_dot_args, dot_tile, DOT_COLS, GGML_Q4_K)
LINEAR_ROWS_FN(dot_q5_k, gguf_dot_args, dot_tile, DOT_COLS, GGML_Q5_K)
LINEAR_ROWS_FN(dot_q6_k, gguf_dot_args, dot_tile, DOT_COLS, GGML_Q6_K)

linear_rows_fn linear_kquant_dot_rows(int64_t type) {
    return type == GGML_Q4_K   ? dot_q4_k
           : type == GGML_Q5_K ? dot_q5_k
           : type == GGML_Q6_K ? dot_q6_k
                               : NULL;
}

static void decode_q4_k_bf16(const void *src, int64_t n0, int64_t n1, uint16_t *dst, int kp) {
    decode_rows_bf16(src, n0, n1, dst, kp, GGML_Q4_K);
}
static void decode_q5_k_bf16(const void *src, int64_t n0, int64_t n1, uint16_t *dst, int kp) {
    decode_rows_bf16(src, n0, n1, dst, kp, GGML_Q5_K);
}
static void decode_q6_k_bf16(const void *src, int64_t n0, int64_t n1, uint16_t *dst, int kp) {
    decode_rows_bf16(src, n0, n1, dst, kp, GGML_Q6_K);
}

linear_bf16_decode_fn linear_kquant_decode_bf16(int64_t type) {
    return type == GGML_Q4_K   ? decode_q4_k_bf16
           : type == GGML_Q5_K ? decode_q5_k_bf16
           : type == GGML_Q6_K ? decode_q6_k_bf16
                               : NULL;
}
#else
linear_bf16_decode_fn linear_kquant_decode_bf16(int64_t type) {
    (void)type;
    return NULL;
}

linear_rows_fn linear_kquant_dot_rows(int64_t type) {
    (void)type;
    return NULL;
}
#endif

ALWAYS_INLINE void row_f32(const uint8_t *row, int k, float *out, const int T) {
    const int BB = super_bytes(T);
    for (int sb = 0; sb < k / QK_K; sb++) {
        const uint8_t *b = row + (int64_t)sb * BB;
        float a[16], m[8] = {0};
        super_scales(b, a, m, T);
        for (int s = 0; s < 8; s++) {
            v8f w[4];
            decode_chunk(b, s, a, m, w, T);
            for (int j = 0; j < 4; j++) v8_store(out + sb * QK_K + 32 * s + 8 * j, w[j]);
        }
    }
}

void linear_kquant_row_f32(const uint8_t *row, int k, int64_t type, float *out) {
    switch (type) {
    case GGML_Q4_K: row_f32(row, k, out, GGML_Q4_K); break;
    case GGML_Q5_K: row_f32(row, k, out, GGML_Q5_K); break;
    default: row_f32(row, k, out, GGML_Q6_K); break;
    }
}

linear_rows_fn linear_kquant_rows(int64_t type) {
    return type == GGML_Q4_K   ? rows_q4_k
           : type == GGML_Q5_K ? rows_q5_k
           : type == GGML_Q6_K ? rows_q6_k
                               : NULL;
}
