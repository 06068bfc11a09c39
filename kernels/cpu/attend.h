/* The arithmetic of attention for one query token, shared by the decode and the
 * prefill kernel so that both give a token the same output to the bit: a token's KV
 * and logits do not depend on whether its attention ran in a decode step or inside a
 * prompt chunk (a migrated or preempted request recomputes its output tokens as a
 * prompt), nor on the other rows of the call.
 *
 * The definition, per query row over the keys [a, b) it sees: the keys go block by
 * block, each block in tiles of up to SCORE_TILE tokens from its start (or from a, in
 * a's block); per tile, each score is one 8-lane FMA chain over head_dim reduced by
 * v8_sum8, then the online-softmax update in base 2 (v8_exp2) and P.V as one FMA chain
 * per dimension. attend_tokens computes one tile for up to MAX_CHUNK rows at once, each
 * row's arithmetic independent of the others and of how many there are; register
 * blocks (QK_TOKENS keys per pass of q.k, PV_CHUNKS dims per pass of P.V, wider where
 * AVX-512 gives 32 registers) share loads between chains, never change one.
 *
 * A bf16 cache on a build and CPU with AVX512-BF16 (the linear layer's check; not with
 * PDSERVE_CPU_ISA=avx2) has variants of its own (DT_BF16_DOT): begin_row rounds the
 * scaled query row to bf16 once, and each score is one 8-lane `vdpbf16ps` chain over the
 * dims in pairs, 16 a step, reduced by v8_sum8 as before; the softmax stays float32.
 * Where head_dim is a multiple of 32, P.V is `vdpbf16ps` too (pv_dot): each tile's
 * probabilities rounded to bf16, two tokens an instruction against their value rows
 * interleaved, with the softmax sums over the float32 probabilities (as flash attention
 * kernels round P before P.V); ~12 % less CPU for decode and prefill attention alike.
 * Decode and prefill both take it, so the invariant holds there too.
 */
#ifndef PDSERVE_CPU_ATTEND_H
#define PDSERVE_CPU_ATTEND_H

#include "attention.h"

#define MAX_CHUNK 4 /* query heads per pass over a block */
#define SCORE_TILE 32

/* Token columns per register block of q.k: G heads x QK_TOKENS tokens of accumulators,
 * with G query vectors and the tokens' key vectors, fit the registers (32 ymm with
 * AVX-512, 16 without). */
#ifdef __AVX512F__
#define QK_TOKENS 4
#else
#define QK_TOKENS 2
#endif

/* Dims per register-blocked pass of P.V: G heads x PV_CHUNKS(G) vectors of 8 stay in
 * registers (with the G broadcast probabilities and one V vector). */
#ifdef __AVX512F__
#define PV_CHUNKS(G) ((G) <= 3 ? 8 : 4)
#else
#define PV_CHUNKS(G) ((G) == 1 ? 8 : (G) == 2 ? 4 : 2)
#endif

/* The dtype a variant's cache holds (DT_BF16_DOT reads as bf16). */
ALWAYS_INLINE int cache_dtype(const int dt) { return dt == DT_BF16_DOT ? DT_BF16 : dt; }

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
/* score_block for DT_BF16_DOT: the query row holds bf16 (begin_row packs it) and every
 * score is one 8-lane `vdpbf16ps` chain over 16 dims a step (lane j sums the pairs 2j,
 * 2j + 1, in increasing dims; a tail step masks the keys past d to zero and the query
 * is zero there), whatever TB is. */
ALWAYS_INLINE void score_block_dot(const char *kr, int64_t row, int d, int dp, const float *qf,
                                   v8f *dots, const int G, const int TB) {
    const int d16 = d & ~15;
    const uint16_t *q = (const uint16_t *)qf; /* row i at q + 2 * i * dp */
    __asm__("" : "+r"(q));                   /* as in score_block */
    __m256 dot[MAX_CHUNK][QK_TOKENS];
#pragma GCC unroll 4
    for (int i = 0; i < G; i++)
#pragma GCC unroll 4
        for (int t = 0; t < TB; t++) dot[i][t] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < d16; c += 16) {
        __m256bh kv[QK_TOKENS];
#pragma GCC unroll 4
        for (int t = 0; t < TB; t++) {
            const uint16_t *k = (const uint16_t *)(kr + t * row) + c;
            kv[t] = (__m256bh)_mm256_loadu_si256((const __m256i *)k);
        }
#pragma GCC unroll 4
        for (int i = 0; i < G; i++) {
            const __m256bh qv = (__m256bh)_mm256_loadu_si256((const __m256i *)(q + 2 * i * dp + c));
#pragma GCC unroll 4
            for (int t = 0; t < TB; t++) dot[i][t] = _mm256_dpbf16_ps(dot[i][t], qv, kv[t]);
        }
    }
    if (d16 < d) {
        const __mmask16 keep = (__mmask16)((1u << (d - d16)) - 1);
        for (int t = 0; t < TB; t++) {
            const __m256bh kv = (__m256bh)_mm256_maskz_loadu_epi16(
                keep, (const uint16_t *)(kr + t * row) + d16);
            for (int i = 0; i < G; i++) {
                const __m256bh qv =
                    (__m256bh)_mm256_loadu_si256((const __m256i *)(q + 2 * i * dp + d16));
                dot[i][t] = _mm256_dpbf16_ps(dot[i][t], qv, kv);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < G; i++)
#pragma GCC unroll 4
        for (int t = 0; t < TB; t++) dots[i * 8 + t] = (v8f)dot[i][t];
}

/* Two value rows' 32 dims from v0 and v1 interleaved in pairs for pv_dot: element 2j of
 * w[0] is v0's dim j and element 2j + 1 v1's, for dims 0-15; w[1] the same for dims
 * 16-31. v1 is read only where has_second (else zero). */
ALWAYS_INLINE void interleave_values(const uint16_t *v0, const uint16_t *v1, __mmask32 has_second,
                                     __m512bh *w) {
    const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                           40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                           32, 0);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    const __m512i a = _mm512_loadu_si512(v0);
    const __m512i b = _mm512_maskz_loadu_epi16(has_second, v1);
    w[0] = (__m512bh)_mm512_permutex2var_epi16(a, first, b);
    w[1] = (__m512bh)_mm512_permutex2var_epi16(a, second, b);
}

/* A value tile interleaved once for pv_dot's paired form (prefill, where many rows meet
 * the tile): token pair j's 16 dims from c at vt + (j * d / 16 + c / 16) * 32, d a
 * multiple of 32. */
ALWAYS_INLINE void pair_values(const char *vr, int64_t row, int n, int d, uint16_t *vt) {
    for (int j = 0; j < (n + 1) / 2; j++) {
        const uint16_t *v0 = (const uint16_t *)(vr + 2 * j * row);
        const uint16_t *v1 = (const uint16_t *)(vr + (2 * j + 1) * row);
        const __mmask32 has_second = 2 * j + 1 < n ? 0xffffffffu : 0;
        for (int c = 0; c < d; c += 32) {
            __m512bh w[2];
            interleave_values(v0 + c, v1 + c, has_second, w);
            _mm512_storeu_si512(vt + (j * (d / 16) + c / 16) * 32, (__m512i)w[0]);
            _mm512_storeu_si512(vt + (j * (d / 16) + c / 16 + 1) * 32, (__m512i)w[1]);
        }
    }
}

/* p.v for DT_BF16_DOT with d a multiple of 32: the tile's probabilities rounded to bf16
 * and taken two tokens at a time by `vdpbf16ps` against the two value rows interleaved
 * (lane j of an accumulator sums p_t v_t[j] + p_t+1 v_t+1[j] over the token pairs in
 * order), 32 products an instruction instead of 8 and no widening of the values. The
 * running sums l stay the float32 probabilities'. A pair past n reads no value row.
 * PAIRED: the values come interleaved already (pair_values at vt), the same numbers. */
ALWAYS_INLINE void pv_dot(const char *vr, int64_t row, int n, int d, int dp, float *acc,
                          const float *sc, v8f corr, const uint16_t *vt, const int G,
                          const int PAIRED) {
    uint32_t pairs[MAX_CHUNK][SCORE_TILE / 2]; /* (p_2j, p_2j+1) as bf16, per head */
    const __mmask16 lo = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
    const __mmask16 hi = n >= 32 ? 0xffff : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : 0;
#pragma GCC unroll 4
    for (int i = 0; i < G; i++) {
        const __m512 a = _mm512_maskz_loadu_ps(lo, sc + i * SCORE_TILE);
        const __m512 b = _mm512_maskz_loadu_ps(hi, sc + i * SCORE_TILE + 16);
        _mm512_storeu_si512(pairs[i], (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
    const int np = (n + 1) / 2;
    for (int c0 = 0; c0 < d; c0 += 64) {
        const int halves = d - c0 >= 64 ? 2 : 1; /* 32 dims each */
        __m512 o[MAX_CHUNK][4];
#pragma GCC unroll 4
        for (int i = 0; i < G; i++)
#pragma GCC unroll 4
            for (int u = 0; u < 2 * halves; u++)
                o[i][u] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * dp + c0 + 16 * u),
                                        _mm512_set1_ps(corr[i]));
        for (int j = 0; j < np; j++) {
            __m512bh w[4];
            if (PAIRED) {
#pragma GCC unroll 4
                for (int u = 0; u < 2 * halves; u++)
                    w[u] = (__m512bh)_mm512_loadu_si512(vt + (j * (d / 16) + c0 / 16 + u) * 32);
            } else {
                const uint16_t *v0 = (const uint16_t *)(vr + 2 * j * row) + c0;
                const uint16_t *v1 = (const uint16_t *)(vr + (2 * j + 1) * row) + c0;
                const __mmask32 has_second = 2 * j + 1 < n ? 0xffffffffu : 0; /* zero, unread */
#pragma GCC unroll 2
                for (int h = 0; h < halves; h++)
                    interleave_values(v0 + 32 * h, v1 + 32 * h, has_second, w + 2 * h);
            }
#pragma GCC unroll 4
            for (int i = 0; i < G; i++) {
                const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pairs[i][j]);
#pragma GCC unroll 4
                for (int u = 0; u < 2 * halves; u++) o[i][u] = _mm512_dpbf16_ps(o[i][u], p, w[u]);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < G; i++)
#pragma GCC unroll 4
            for (int u = 0; u < 2 * halves; u++)
                _mm512_storeu_ps(acc + i * dp + c0 + 16 * u, o[i][u]);
    }
}

/* pv_dot per chunk size, each compiled alone: inlined into attend_tokens, the values
 * live around it spilled two of the 16 accumulators. */
#define PV_DOT_OF(G)                                                                           \
    static __attribute__((noinline)) void pv_dot##G(const char *vr, int64_t row, int n, int d, \
                                                    int dp, float *acc, const float *sc,       \
                                                    v8f corr) {                                \
        pv_dot(vr, row, n, d, dp, acc, sc, corr, NULL, G, 0);                                  \
    }                                                                                          \
    static __attribute__((noinline)) void pv_paired##G(const uint16_t *vt, int n, int d,       \
                                                       int dp, float *acc, const float *sc,    \
                                                       v8f corr) {                             \
        pv_dot(NULL, 0, n, d, dp, acc, sc, corr, vt, G, 1);                                    \
    }
PV_DOT_OF(1)
PV_DOT_OF(2)
PV_DOT_OF(3)
PV_DOT_OF(4)
#endif

/* q.k of G heads and TB consecutive tokens from kr: dots[i * 8 + t] for each head i and
 * token t of the block. Every score is the same 8-lane FMA chain over the dims in
 * increasing order whatever TB is (the block only shares the loads), so a token's score
 * does not depend on which block it fell in. */
ALWAYS_INLINE void score_block(const char *kr, int64_t row, int d, int dp, const float *qf,
                               v8f *dots, const int G, const int TB, const int dt) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    if (dt == DT_BF16_DOT) {
        score_block_dot(kr, row, d, dp, qf, dots, G, TB);
        return;
    }
#endif
    const int d8 = d & ~7;
    /* An opaque copy of the query pointer: the compiler would otherwise hoist every
     * query vector of the tile out of the callers' loop over tokens, keeping G x d / 8
     * vectors live and spilling the accumulators. */
    const float *q = qf;
    __asm__("" : "+r"(q));
    v8f dot[MAX_CHUNK][QK_TOKENS];
#pragma GCC unroll 4
    for (int i = 0; i < G; i++)
#pragma GCC unroll 4
        for (int t = 0; t < TB; t++) dot[i][t] = v8_splat(0.0f);
#pragma GCC unroll 8
    for (int c = 0; c < d8; c += 8) {
        v8f kv[QK_TOKENS];
#pragma GCC unroll 4
        for (int t = 0; t < TB; t++) kv[t] = v8_load_as(kr + t * row, cache_dtype(dt), c);
#pragma GCC unroll 4
        for (int i = 0; i < G; i++) {
            const v8f qv = v8_load(q + i * dp + c);
#pragma GCC unroll 4
            for (int t = 0; t < TB; t++) dot[i][t] = v8_fma(qv, kv[t], dot[i][t]);
        }
    }
    for (int c = d8; c < d; c++)
        for (int t = 0; t < TB; t++) {
            float kc = load_scalar(kr + t * row, cache_dtype(dt), c);
            for (int i = 0; i < G; i++) dot[i][t][0] += q[i * dp + c] * kc;
        }
#pragma GCC unroll 4
    for (int i = 0; i < G; i++)
#pragma GCC unroll 4
        for (int t = 0; t < TB; t++) dots[i * 8 + t] = dot[i][t];
}

/* The scores of G query heads (a chunk of the group) over the n <= SCORE_TILE tokens at
 * rows kr, into sc (SCORE_TILE a head): one vector of partial products per (head,
 * token), eight tokens reduced together, so the horizontal sums cost ~1 op per score
 * instead of ~7. Tokens past n get zero vectors. dots is scratch for G x 8 vectors. */
ALWAYS_INLINE void score_tokens(const char *kr, int64_t row, int n, int d, int dp, const float *qf,
                                float *sc, v8f *dots, const int G, const int dt) {
    for (int t0 = 0; t0 < n; t0 += 8) {
        int t = 0;
        for (; t + QK_TOKENS <= 8 && t0 + t + QK_TOKENS <= n; t += QK_TOKENS)
            score_block(kr + (t0 + t) * row, row, d, dp, qf, dots + t, G, QK_TOKENS, dt);
        for (; t < 8 && t0 + t < n; t++)
            score_block(kr + (t0 + t) * row, row, d, dp, qf, dots + t, G, 1, dt);
        for (; t < 8; t++)
#pragma GCC unroll 4
            for (int i = 0; i < G; i++) dots[i * 8 + t] = v8_splat(0.0f);
#pragma GCC unroll 4
        for (int i = 0; i < G; i++) v8_store(sc + i * SCORE_TILE + t0, v8_sum8(dots + i * 8));
    }
}

/* The online-softmax update and P.V of G query heads over the n <= SCORE_TILE tokens at
 * rows vr, their scores in sc (SCORE_TILE a head; overwritten with the probabilities). */
ALWAYS_INLINE void attend_scores(const char *vr, int64_t row, int n, int d, int dp, float *m,
                                 float *l, float *acc, float *sc, const uint16_t *vt, const int G,
                                 const int dt) {
    (void)vt; /* read by the AVX512-BF16 build alone */
    const int d8 = d & ~7;
    const int n8 = (n + 7) & ~7;
    v8f shift = v8_splat(0.0f); /* old max - new max per head: one exp2 rescales all */
#pragma GCC unroll 4
    for (int i = 0; i < G; i++) {
        float *si = sc + i * SCORE_TILE;
        for (int t = n; t < n8; t++) si[t] = -INFINITY;
        v8f mx8 = v8_load(si);
        for (int t = 8; t < n8; t += 8) mx8 = v8_max(mx8, v8_load(si + t));
        float mx = v8_hmax(mx8);
        float mn = mx > m[i] ? mx : m[i];
        shift[i] = mn == -INFINITY ? 0.0f : m[i] - mn;
        m[i] = mn;
    }
    const v8f corr = v8_exp2(shift);
#pragma GCC unroll 4
    for (int i = 0; i < G; i++) {
        float *si = sc + i * SCORE_TILE;
        v8f sum = v8_splat(0.0f), mv = v8_splat(m[i]);
        for (int t = 0; t < n8; t += 8) {
            v8f p = v8_exp2(v8_load(si + t) - mv);
            v8_store(si + t, p);
            sum += p;
        }
        l[i] = l[i] * corr[i] + v8_hsum(sum);
    }
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    if (dt == DT_BF16_DOT && !(d & 31) && vt) { /* values interleaved already (pair_values) */
        switch (G) {
        case 1: pv_paired1(vt, n, d, dp, acc, sc, corr); break;
        case 2: pv_paired2(vt, n, d, dp, acc, sc, corr); break;
        case 3: pv_paired3(vt, n, d, dp, acc, sc, corr); break;
        default: pv_paired4(vt, n, d, dp, acc, sc, corr); break;
        }
        return;
    }
    if (dt == DT_BF16_DOT && !(d & 31)) {
        switch (G) {
        case 1: pv_dot1(vr, row, n, d, dp, acc, sc, corr); break;
        case 2: pv_dot2(vr, row, n, d, dp, acc, sc, corr); break;
        case 3: pv_dot3(vr, row, n, d, dp, acc, sc, corr); break;
        default: pv_dot4(vr, row, n, d, dp, acc, sc, corr); break;
        }
        return;
    }
#endif
    /* p.v: accumulators of G heads x PV_CHUNKS vectors stay in registers over the
     * tokens; V is converted once per pass for all G heads. */
    const int CH = PV_CHUNKS(G);
    int c0 = 0;
    for (; c0 + 8 * CH <= d8; c0 += 8 * CH) {
        v8f o[MAX_CHUNK][8];
#pragma GCC unroll 4
        for (int i = 0; i < G; i++)
#pragma GCC unroll 8
            for (int u = 0; u < CH; u++)
                o[i][u] = v8_load(acc + i * dp + c0 + 8 * u) * v8_splat(corr[i]);
        for (int t = 0; t < n; t++) {
            const char *v = vr + t * row;
            v8f p[MAX_CHUNK];
#pragma GCC unroll 4
            for (int i = 0; i < G; i++) p[i] = v8_splat(sc[i * SCORE_TILE + t]);
#pragma GCC unroll 8
            for (int u = 0; u < CH; u++) {
                v8f vv = v8_load_as(v, cache_dtype(dt), c0 + 8 * u);
#pragma GCC unroll 4
                for (int i = 0; i < G; i++) o[i][u] = v8_fma(p[i], vv, o[i][u]);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < G; i++)
#pragma GCC unroll 8
            for (int u = 0; u < CH; u++) v8_store(acc + i * dp + c0 + 8 * u, o[i][u]);
    }
    for (; c0 < d8; c0 += 8) { /* head_dim not a multiple of 8 * CH */
        v8f o[MAX_CHUNK];
#pragma GCC unroll 4
        for (int i = 0; i < G; i++) o[i] = v8_load(acc + i * dp + c0) * v8_splat(corr[i]);
        for (int t = 0; t < n; t++) {
            v8f vv = v8_load_as(vr + t * row, cache_dtype(dt), c0);
#pragma GCC unroll 4
            for (int i = 0; i < G; i++) o[i] = v8_fma(v8_splat(sc[i * SCORE_TILE + t]), vv, o[i]);
        }
#pragma GCC unroll 4
        for (int i = 0; i < G; i++) v8_store(acc + i * dp + c0, o[i]);
    }
    for (int c = d8; c < d; c++) {
        for (int i = 0; i < G; i++) {
            float o = acc[i * dp + c] * corr[i];
            for (int t = 0; t < n; t++)
                o += sc[i * SCORE_TILE + t] * load_scalar(vr + t * row, cache_dtype(dt), c);
            acc[i * dp + c] = o;
        }
    }
}

/* Scores, online-softmax update and P.V of G query heads (a chunk of the group) over
 * the n <= SCORE_TILE tokens at rows kr / vr. d is a compile-time constant where it
 * matters; dots is scratch for G x 8 vectors. */
ALWAYS_INLINE void attend_tokens(const char *kr, const char *vr, int64_t row, int n, int d, int dp,
                                 const float *qf, float *m, float *l, float *acc, float *sc,
                                 v8f *dots, const int G, const int dt) {
    score_tokens(kr, row, n, d, dp, qf, sc, dots, G, dt);
    attend_scores(vr, row, n, d, dp, m, l, acc, sc, NULL, G, dt);
}

#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 2
#endif

/* The keys and values of kv head h in block blk of sequence s, towards the cache. */
ALWAYS_INLINE void prefetch_block(const attention_args *A, int64_t s, int h, int64_t blk,
                                  int64_t row, int row_bytes, int64_t es) {
    int64_t id = load_index(A->tables, A->t_ix, s * A->t_ss + blk * A->t_sb);
    const char *kb = A->cache + (id * A->c_sb + h * A->c_sh) * es;
    prefetch_rows(kb, A->block_size, row, row_bytes);
    prefetch_rows(kb + A->c_skv * es, A->block_size, row, row_bytes);
}

/* Every head of kv head h over tokens [a, b) of sequence s, block by block, updating
 * the running (m, l, acc) of each head. D: head_dim as a constant, or 0 (runtime). */
ALWAYS_INLINE void attend_range(const attention_args *A, int64_t s, int h, int64_t a, int64_t b,
                                const float *qf, float *m, float *l, float *acc, float *sc,
                                const int dt, const int D) {
    /* With D constant, dp (== D, a multiple of 8) is too: row offsets fold into
     * addressing modes instead of occupying registers. */
    const int d = D ? D : A->head_dim, dp = D ? D : A->dp, bs = A->block_size, group = A->group;
    const int64_t es = (int64_t)dtype_size(cache_dtype(dt)), row = A->c_st * es;
    const int row_bytes = d * (int)es;
    v8f dots[MAX_CHUNK * 8];
    const int64_t first = a / bs, last = (b - 1) / bs;
    for (int64_t blk = first; blk < first + PREFETCH_BLOCKS && blk <= last; blk++)
        prefetch_block(A, s, h, blk, row, row_bytes, es);
    for (int64_t blk = first; blk <= last; blk++) {
        /* Blocks ahead stream in while this one computes. */
        if (blk + PREFETCH_BLOCKS <= last)
            prefetch_block(A, s, h, blk + PREFETCH_BLOCKS, row, row_bytes, es);
        int64_t id = load_index(A->tables, A->t_ix, s * A->t_ss + blk * A->t_sb);
        const char *kb = A->cache + (id * A->c_sb + h * A->c_sh) * es;
        const char *vb = kb + A->c_skv * es;
        int64_t lo = blk * bs < a ? a - blk * bs : 0;
        int64_t hi = (blk + 1) * bs > b ? b - blk * bs : bs;
        for (int64_t t0 = lo; t0 < hi; t0 += SCORE_TILE) {
            const int n = (int)(hi - t0 < SCORE_TILE ? hi - t0 : SCORE_TILE);
            const char *kr = kb + t0 * row, *vr = vb + t0 * row;
            /* Chunks of the group reuse the block's K/V from L1. */
            for (int i0 = 0; i0 < group; i0 += MAX_CHUNK) {
                const float *q = qf + i0 * dp;
                float *mi = m + i0, *li = l + i0, *ai = acc + i0 * dp;
                switch (group - i0 < MAX_CHUNK ? group - i0 : MAX_CHUNK) {
                case 1: attend_tokens(kr, vr, row, n, d, dp, q, mi, li, ai, sc, dots, 1, dt); break;
                case 2: attend_tokens(kr, vr, row, n, d, dp, q, mi, li, ai, sc, dots, 2, dt); break;
                case 3: attend_tokens(kr, vr, row, n, d, dp, q, mi, li, ai, sc, dots, 3, dt); break;
                default: attend_tokens(kr, vr, row, n, d, dp, q, mi, li, ai, sc, dots, 4, dt); break;
                }
            }
        }
    }
}

/* Query row (token, head) loaded scaled into qf (zero-padded to dp) with a fresh running
 * state: no score yet. */
ALWAYS_INLINE void begin_row(const attention_args *A, int64_t token, int head, float *qf,
                             float *acc, float *m, float *l) {
    load_row(A->q.data, A->q.dt, token * A->q.s0 + head * A->q.s1, A->q.s2, A->head_dim, A->dp,
             A->qmul, qf);
    if (A->kernel_dt == DT_BF16_DOT) { /* bf16 in place, zero to the next 16 dims */
        uint16_t *qh = (uint16_t *)qf;
        const int d = A->head_dim, d16 = (d + 15) & ~15;
        for (int c = 0; c < d; c++) qh[c] = float_to_bf16(qf[c]);
        for (int c = d; c < d16; c++) qh[c] = 0;
    }
    memset(acc, 0, sizeof(float) * A->dp);
    *m = -INFINITY;
    *l = 0.0f;
}

/* Output row (token, head): the accumulator over the softmax sum, times the values'
 * read scale (zeros where no key was seen). */
ALWAYS_INLINE void end_row(const attention_args *A, int64_t token, int head, const float *acc,
                           float l) {
    store_row(A->out.data, A->out.dt, token * A->out.s0 + head * A->out.s1, A->out.s2,
              A->head_dim, acc, l > 0.0f ? A->vmul / l : 0.0f);
}

/* The (cache dtype, head_dim) specialisations each kernel compiles its loop for: head_dim
 * 64 and 128 as constants, any other at run time (0). SPECIALISE(MAKE, p) expands
 * MAKE(p_<dtype>_<dim>, DT, D) for each; SPECIALISATIONS(p) is their table, indexed
 * [dtype][specialisation_of(head_dim)]. Small functions keep the build short. */
#define SPECIALISE(MAKE, p)                                                                    \
    MAKE(p##_f32_d64, DT_F32, 64) MAKE(p##_f32_d128, DT_F32, 128) MAKE(p##_f32_any, DT_F32, 0) \
    MAKE(p##_bf16_d64, DT_BF16, 64) MAKE(p##_bf16_d128, DT_BF16, 128)                          \
    MAKE(p##_bf16_any, DT_BF16, 0) MAKE(p##_f16_d64, DT_F16, 64)                               \
    MAKE(p##_f16_d128, DT_F16, 128) MAKE(p##_f16_any, DT_F16, 0)                               \
    MAKE(p##_e4m3_d64, DT_E4M3, 64) MAKE(p##_e4m3_d128, DT_E4M3, 128)                          \
    MAKE(p##_e4m3_any, DT_E4M3, 0) MAKE(p##_e5m2_d64, DT_E5M2, 64)                             \
    MAKE(p##_e5m2_d128, DT_E5M2, 128) MAKE(p##_e5m2_any, DT_E5M2, 0)                          \
    MAKE(p##_dot_d64, DT_BF16_DOT, 64) MAKE(p##_dot_d128, DT_BF16_DOT, 128)                    \
    MAKE(p##_dot_any, DT_BF16_DOT, 0)
#define SPECIALISATIONS(p)                                                                     \
    {                                                                                          \
        {p##_f32_d64, p##_f32_d128, p##_f32_any}, {p##_bf16_d64, p##_bf16_d128, p##_bf16_any}, \
            {p##_f16_d64, p##_f16_d128, p##_f16_any},                                          \
            {p##_e4m3_d64, p##_e4m3_d128, p##_e4m3_any},                                       \
            {p##_e5m2_d64, p##_e5m2_d128, p##_e5m2_any},                                       \
            {p##_dot_d64, p##_dot_d128, p##_dot_any},                                          \
    }
#define NUM_CACHE_DTYPES 6

static inline int specialisation_of(int head_dim) {
    return head_dim == 64 ? 0 : head_dim == 128 ? 1 : 2;
}

#endif
