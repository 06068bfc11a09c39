/* Decode attention over the paged KV cache: one query token per sequence.
 *
 * Memory-bound: every K/V byte of a sequence's visible context is read once per call.
 * - A work item is (sequence, kv head, context split). All query heads of the kv head
 *   (the GQA group) are processed together, so each K and V row is read from memory
 *   and converted once for the whole group; groups over 4 heads go in chunks of 4 that
 *   reuse the block from L1. Scores of eight tokens are reduced together, and P.V
 *   keeps each chunk's accumulators in registers over the block.
 * - The context streams block by block straight from the paged cache through the
 *   block table (no gather, no score matrix); an online softmax in base 2 (log2(e)
 *   folded into the query) keeps running max / sum / accumulator per head.
 * - Split-K: when sequences x kv heads cannot keep every thread busy (a batch of one
 *   long sequence), each context is cut into splits whose partial (max, sum, acc)
 *   go to a workspace and are merged afterwards.
 * - Only tokens inside [max(0, len - window), len) are touched, so slots past a
 *   sequence's end or unused table entries (which may hold NaN) are never read.
 * A sequence with context_len 0 (a padding row) gets zeros.
 */
#include "attention.h"

#define MAX_CHUNK 4 /* query heads per pass over a block */
#define SCORE_TILE 32
#define MIN_SPLIT_TOKENS 256
#define MIN_TOKENS_PER_THREAD 2048 /* token x kv-head pairs below which one thread runs */

/* Dims per register-blocked pass of P.V: G heads x PV_CHUNKS(G) vectors of 8 stay in
 * registers (with the G broadcast probabilities and one V vector: <= 16 ymm). */
#define PV_CHUNKS(G) ((G) == 1 ? 8 : (G) == 2 ? 4 : 2)

/* Scores, online-softmax update and P.V of G query heads (a chunk of the group) over
 * the n <= SCORE_TILE tokens at rows kr / vr. d is a compile-time constant where it
 * matters; dots is scratch for G x 8 vectors. */
ALWAYS_INLINE void attend_tokens(const char *kr, const char *vr, int64_t row, int n, int d, int dp,
                                 const float *qf, float *m, float *l, float *acc, float *sc,
                                 v8f *dots, const int G, const int dt) {
    const int d8 = d & ~7;
    /* q.k: one vector of partial products per (head, token), eight tokens reduced
     * together, so the horizontal sums cost ~1 op per score instead of ~7. */
    for (int t0 = 0; t0 < n; t0 += 8) {
        for (int t = 0; t < 8; t++) {
            v8f dot[MAX_CHUNK];
#pragma GCC unroll 4
            for (int i = 0; i < G; i++) dot[i] = v8_splat(0.0f);
            if (t0 + t < n) {
                const char *k = kr + (t0 + t) * row;
#pragma GCC unroll 8
                for (int c = 0; c < d8; c += 8) {
                    v8f kv = v8_load_as(k, dt, c);
#pragma GCC unroll 4
                    for (int i = 0; i < G; i++) dot[i] += v8_load(qf + i * dp + c) * kv;
                }
                for (int c = d8; c < d; c++) {
                    float kc = load_scalar(k, dt, c);
                    for (int i = 0; i < G; i++) dot[i][0] += qf[i * dp + c] * kc;
                }
            }
#pragma GCC unroll 4
            for (int i = 0; i < G; i++) dots[i * 8 + t] = dot[i];
        }
#pragma GCC unroll 4
        for (int i = 0; i < G; i++) v8_store(sc + i * SCORE_TILE + t0, v8_sum8(dots + i * 8));
    }
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
                v8f vv = v8_load_as(v, dt, c0 + 8 * u);
#pragma GCC unroll 4
                for (int i = 0; i < G; i++) o[i][u] += p[i] * vv;
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
            v8f vv = v8_load_as(vr + t * row, dt, c0);
#pragma GCC unroll 4
            for (int i = 0; i < G; i++) o[i] += v8_splat(sc[i * SCORE_TILE + t]) * vv;
        }
#pragma GCC unroll 4
        for (int i = 0; i < G; i++) v8_store(acc + i * dp + c0, o[i]);
    }
    for (int c = d8; c < d; c++) {
        for (int i = 0; i < G; i++) {
            float o = acc[i * dp + c] * corr[i];
            for (int t = 0; t < n; t++)
                o += sc[i * SCORE_TILE + t] * load_scalar(vr + t * row, dt, c);
            acc[i * dp + c] = o;
        }
    }
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
    const int64_t es = (int64_t)dtype_size(dt), row = A->c_st * es;
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

/* One function per (cache dtype, head_dim) specialisation: small functions keep the
 * compiler's work (and the build) short. */
#define ATTEND_VARIANT(name, DT, D)                                                            \
    static __attribute__((noinline)) void name(const attention_args *A, int64_t s, int h,         \
                                               int64_t a, int64_t b, const float *qf,          \
                                               float *m, float *l, float *acc, float *sc) {    \
        attend_range(A, s, h, a, b, qf, m, l, acc, sc, DT, D);                                 \
    }
ATTEND_VARIANT(attend_bf16_d64, DT_BF16, 64)
ATTEND_VARIANT(attend_bf16_d128, DT_BF16, 128)
ATTEND_VARIANT(attend_bf16_any, DT_BF16, 0)
ATTEND_VARIANT(attend_f32_d64, DT_F32, 64)
ATTEND_VARIANT(attend_f32_d128, DT_F32, 128)
ATTEND_VARIANT(attend_f32_any, DT_F32, 0)
ATTEND_VARIANT(attend_f16_d64, DT_F16, 64)
ATTEND_VARIANT(attend_f16_d128, DT_F16, 128)
ATTEND_VARIANT(attend_f16_any, DT_F16, 0)

typedef void (*attend_fn)(const attention_args *, int64_t, int, int64_t, int64_t, const float *,
                          float *, float *, float *, float *);

static attend_fn attend_variant(int dt, int head_dim) {
    static const attend_fn table[3][3] = {
        {attend_f32_d64, attend_f32_d128, attend_f32_any},
        {attend_bf16_d64, attend_bf16_d128, attend_bf16_any},
        {attend_f16_d64, attend_f16_d128, attend_f16_any},
    };
    return table[dt][head_dim == 64 ? 0 : head_dim == 128 ? 1 : 2];
}

/* Tokens [start, len) a sequence attends to, split k of nsplit. */
static void split_range(const attention_args *A, int64_t s, int k, int nsplit, int64_t *a,
                        int64_t *b) {
    int64_t len = load_index(A->lens, A->l_ix, s * A->l_s);
    int64_t start = A->window > 0 && len > A->window ? len - A->window : 0;
    int64_t chunk = (len - start + nsplit - 1) / nsplit;
    *a = start + k * chunk < len ? start + k * chunk : len;
    *b = *a + chunk < len ? *a + chunk : len;
}

/* One item: every head of kv head h over split k. With one split the result is final
 * and goes to `out`; otherwise (max, sum, acc) rows go to the workspace. */
static void decode_item(const attention_args *A, int64_t s, int h, int k, int nsplit, float *ws,
                        float *scratch) {
    const int dp = A->dp, d = A->head_dim, group = A->group;
    float *qf = scratch, *acc = qf + group * dp, *m = acc + group * dp, *l = m + group;
    float *sc = l + group;
    int64_t a, b;
    split_range(A, s, k, nsplit, &a, &b);
    for (int i = 0; i < group; i++) {
        int head = h * group + i;
        load_row(A->q, A->q_dt, s * A->q_ss + head * A->q_sh, A->q_sd, d, dp, A->qmul,
                 qf + i * dp);
        memset(acc + i * dp, 0, sizeof(float) * dp);
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    if (a < b) attend_variant(A->c_dt, A->head_dim)(A, s, h, a, b, qf, m, l, acc, sc);
    for (int i = 0; i < group; i++) {
        int head = h * group + i;
        if (nsplit == 1) {
            float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
            store_row(A->out, A->o_dt, s * A->o_ss + head * A->o_sh, A->o_sd, d, acc + i * dp,
                      inv);
        } else {
            float *w = ws + (((s * A->num_kv_heads + h) * nsplit + k) * group + i) * (int64_t)(dp + 2);
            w[0] = m[i];
            w[1] = l[i];
            memcpy(w + 2, acc + i * dp, sizeof(float) * d);
        }
    }
}

/* Merge the splits of one (sequence, query head). */
static void merge_splits(const attention_args *A, int64_t s, int head, int nsplit, const float *ws,
                         float *tmp) {
    const int dp = A->dp, d = A->head_dim, h = head / A->group, i = head % A->group;
    const int64_t stride = (int64_t)A->group * (dp + 2);
    const float *w0 = ws + ((s * A->num_kv_heads + h) * nsplit * A->group + i) * (int64_t)(dp + 2);
    float mx = -INFINITY, total = 0.0f;
    for (int k = 0; k < nsplit; k++) mx = w0[k * stride] > mx ? w0[k * stride] : mx;
    memset(tmp, 0, sizeof(float) * d);
    if (mx != -INFINITY) {
        for (int k = 0; k < nsplit; k++) {
            const float *w = w0 + k * stride;
            if (w[1] == 0.0f) continue;
            float f = exp2f(w[0] - mx);
            total += w[1] * f;
            for (int c = 0; c < d; c++) tmp[c] += w[2 + c] * f;
        }
    }
    store_row(A->out, A->o_dt, s * A->o_ss + head * A->o_sh, A->o_sd, d, tmp,
              total > 0.0f ? 1.0f / total : 0.0f);
}

/* Context splits per (sequence, kv head): enough items for ~4 per thread when the
 * batch alone cannot keep the threads busy, each split at least MIN_SPLIT_TOKENS. */
int64_t pd_decode_splits(int64_t num_seqs, int64_t num_kv_heads, int64_t tokens, int64_t max_span,
                         int64_t num_threads) {
    int threads = threads_for((int)num_threads, tokens * num_kv_heads, MIN_TOKENS_PER_THREAD);
    int64_t items = num_seqs * num_kv_heads, nsplit = 1;
    if (threads > 1 && items > 0 && items < 4 * threads) {
        nsplit = (4 * threads + items - 1) / items;
        int64_t cap = max_span / MIN_SPLIT_TOKENS;
        if (nsplit > cap) nsplit = cap < 1 ? 1 : cap;
    }
    return nsplit;
}

typedef struct {
    const attention_args *A;
    float *ws;
    int nsplit, num_heads;
    work_queue items, merges;
    size_t scratch_floats;
    int failed;
} decode_job;

/* One thread's share: items from the queue, then (after every item is done) merges. */
static void decode_worker(void *job) {
    decode_job *J = job;
    const attention_args *A = J->A;
    const int nsplit = J->nsplit, kvh = A->num_kv_heads;
    float *scratch = malloc(sizeof(float) * J->scratch_floats);
    if (!scratch) __atomic_store_n(&J->failed, 1, __ATOMIC_RELAXED);
    for (int64_t it; (it = take_item(&J->items)) < J->items.end;)
        if (scratch)
            decode_item(A, it / (kvh * nsplit), (int)(it / nsplit % kvh), (int)(it % nsplit),
                        nsplit, J->ws, scratch);
    if (J->merges.end > 0) {
#pragma omp barrier
        for (int64_t r; (r = take_item(&J->merges)) < J->merges.end;)
            if (scratch)
                merge_splits(A, r / J->num_heads, (int)(r % J->num_heads), nsplit, J->ws, scratch);
    }
    free(scratch);
}

int64_t pd_decode_call_size(void) { return sizeof(pd_attention_call); }

int pd_decode_attention(pd_attention_call *c) {
    const attention_args A = attention_args_of(c, ((int)c->head_dim + 7) & ~7);
    const int64_t num_seqs = c->num_seqs, window = c->window;
    const int num_heads = (int)c->num_heads, num_kv_heads = A.num_kv_heads;
    const int block_size = A.block_size, num_threads = (int)c->num_threads;
    int64_t tokens = 0, max_span = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t len = load_index(A.lens, A.l_ix, s * A.l_s);
        if (len < 0 || len > c->table_width * block_size)
            return fail_at(&c->bad, s, PD_BAD_CONTEXT_LEN);
        int64_t start = window > 0 && len > window ? len - window : 0;
        for (int64_t blk = start / block_size; blk * block_size < len; blk++) {
            int64_t id = load_index(A.tables, A.t_ix, s * A.t_ss + blk * A.t_sb);
            if (id < 0 || id >= c->num_blocks) return fail_at(&c->bad, s, PD_BAD_BLOCK_ID);
        }
        tokens += len - start;
        max_span = len - start > max_span ? len - start : max_span;
    }
    const int64_t items = num_seqs * num_kv_heads;
    int threads = threads_for(num_threads, tokens * num_kv_heads, MIN_TOKENS_PER_THREAD);
    int nsplit = (int)pd_decode_splits(num_seqs, num_kv_heads, tokens, max_span, num_threads);
    float *ws = NULL;
    if (nsplit > 1) {
        ws = malloc(sizeof(float) * items * nsplit * A.group * (A.dp + 2));
        if (!ws) return PD_NO_MEMORY;
    }
    decode_job job = {.A = &A, .ws = ws, .nsplit = nsplit, .num_heads = num_heads,
                      .items = {0, items * nsplit}, .merges = {0, nsplit > 1 ? num_seqs * num_heads : 0},
                      .scratch_floats = (size_t)A.group * (2 * A.dp + 2) + MAX_CHUNK * SCORE_TILE};
    run_workers(decode_worker, &job, threads);
    free(ws);
    return job.failed ? PD_NO_MEMORY : PD_OK;
}
