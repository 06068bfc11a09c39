/* Prefill attention: ragged causal attention of new tokens over the cached prefix
 * plus themselves.
 *
 * - A work item is (sequence, tile of query tokens, kv head). Its rows are the tile's
 *   tokens x the GQA group's heads (about ROWS_TARGET rows); each key tile is read once
 *   for all of them and stays in L1 while they pass over it in chunks of MAX_CHUNK rows
 *   (an FP8 tile is widened to float32 once first, see widen_tile).
 * - Every row gets exactly the decode kernel's arithmetic (attend.h): the keys go block
 *   by block in tiles of SCORE_TILE from each block's start; a row whose position falls
 *   inside a tile takes the tile up to its position, as a decode step at that position
 *   would. So a token's output does not depend on how its prompt was chunked, on the
 *   other rows of the call, nor on whether it was computed here or in a decode step.
 *   With a sliding window each token runs the decode kernel's own loop over its window
 *   (the window's first tile starts at a position of its own).
 * - Online softmax in base 2 per row; the full score matrix never exists.
 * - Items are sorted by cost (longest key range first) and scheduled dynamically.
 */
#include "attend.h"

#define ROWS_TARGET 128

typedef struct {
    int64_t seq, q_row0;    /* sequence, and its first query row in `q` */
    int64_t pos0;           /* position of the tile's first token */
    int32_t tokens, kv_head;
    int64_t key_lo, key_hi; /* keys [key_lo, key_hi] */
} prefill_item;

typedef struct {
    float *qf, *acc, *m, *l, *sc;
    float *kf, *vf; /* an FP8 cache's key and value tile, widened (SCORE_TILE x dp each) */
    uint32_t *kt;   /* a bf16 key tile turned (pair_tile), in kf's place */
    uint16_t *vt;   /* its value tile interleaved (pair_values), in vf's place */
} tile_scratch;

/* n cache rows at src (row bytes apart) as their float readings (v8_load_as), dp floats
 * apart at dst: the values an FP8 variant's loads would give, so rows read from here
 * with DT_F32 get the same arithmetic. Widened once per tile instead of once for every
 * MAX_CHUNK rows that pass over it. */
ALWAYS_INLINE void widen_tile(const char *src, int64_t row, int n, int d, int dp, float *dst,
                              const int dt) {
    const int d8 = d & ~7;
    for (int t = 0; t < n; t++) {
        const char *r = src + t * row;
        float *o = dst + (int64_t)t * dp;
        for (int c = 0; c < d8; c += 8) v8_store(o + c, v8_load_as(r, dt, c));
        for (int c = d8; c < d; c++) o[c] = load_scalar(r, dt, c);
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define PAIRED_SCORES 1
/* A bf16 key tile turned for score_paired: kt[p * SCORE_TILE + t] is dims 2p and 2p + 1
 * of key t (one 32-bit word), for the d / 2 pairs of the n keys and zero for keys up to
 * the next 16. Turned once for all the rows that pass over the tile. */
ALWAYS_INLINE void pair_tile(const char *kr, int64_t row, int n, int d, uint32_t *kt) {
    const int pairs = d / 2, n16 = (n + 15) & ~15;
    for (int t = 0; t < n; t++) {
        const uint32_t *k = (const uint32_t *)(kr + t * row);
        for (int p = 0; p < pairs; p++) kt[p * SCORE_TILE + t] = k[p];
    }
    for (int p = 0; p < pairs; p++)
        for (int t = n; t < n16; t++) kt[p * SCORE_TILE + t] = 0;
}

/* score_tokens for DT_BF16_DOT with d a multiple of 16, over a turned tile: the same
 * scores to the bit with no horizontal sums. Lane t of accumulator j is key t's lane j
 * of score_block_dot's chain (pairs 8s + j, s = 0, 1, ... in order, the query pair
 * broadcast), and the eight accumulators are added in v8_sum8's order. R query rows
 * (R <= 3) share each load of the tile. */
ALWAYS_INLINE void score_paired_rows(const uint32_t *kt, int n, int d, const uint32_t *q, int dp,
                                     float *sc, const int R) {
    for (int t0 = 0; t0 < n; t0 += 16) {
        __m512 a[3][8];
#pragma GCC unroll 3
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) a[r][j] = _mm512_setzero_ps();
        for (int s = 0; s < d / 16; s++) {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m512bh k =
                    (__m512bh)_mm512_loadu_si512(kt + (8 * s + j) * SCORE_TILE + t0);
#pragma GCC unroll 3
                for (int r = 0; r < R; r++)
                    a[r][j] = _mm512_dpbf16_ps(
                        a[r][j], (__m512bh)_mm512_set1_epi32((int)q[r * dp + 8 * s + j]), k);
            }
        }
#pragma GCC unroll 3
        for (int r = 0; r < R; r++) {
            const __m512 lo = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]),
                                            _mm512_add_ps(a[r][2], a[r][3]));
            const __m512 hi = _mm512_add_ps(_mm512_add_ps(a[r][4], a[r][5]),
                                            _mm512_add_ps(a[r][6], a[r][7]));
            _mm512_storeu_ps(sc + r * SCORE_TILE + t0, _mm512_add_ps(lo, hi));
        }
    }
}

/* score_paired_rows for the G rows of a chunk, three at a time. */
ALWAYS_INLINE void score_paired(const uint32_t *kt, int n, int d, const float *qf, int dp,
                                float *sc, const int G) {
    const uint32_t *q = (const uint32_t *)qf; /* row i's bf16 pairs at q + i * dp */
    if (G == 4) {
        score_paired_rows(kt, n, d, q, dp, sc, 3);
        score_paired_rows(kt, n, d, q + 3 * dp, dp, sc + 3 * SCORE_TILE, 1);
    } else {
        score_paired_rows(kt, n, d, q, dp, sc, G);
    }
}
#else
#define PAIRED_SCORES 0
#endif

/* Whether a variant scores over turned tiles (pair_tile). */
ALWAYS_INLINE int scores_paired(const int dt, int d) {
    return PAIRED_SCORES && dt == DT_BF16_DOT && !(d & 15);
}

/* G rows of a chunk over the n keys at kr / vr (or the turned tile kt). */
ALWAYS_INLINE void attend_chunk(const char *kr, const char *vr, const uint32_t *kt,
                                const uint16_t *vt, int64_t row, int n, int d, int dp,
                                const float *q, float *m, float *l, float *acc, float *sc,
                                v8f *dots, const int G, const int dt) {
#if PAIRED_SCORES
    if (scores_paired(dt, d)) {
        score_paired(kt, n, d, q, dp, sc, G);
        attend_scores(vr, row, n, d, dp, m, l, acc, sc, d & 31 ? NULL : vt, G, dt);
        return;
    }
#endif
    (void)kt, (void)vt;
    attend_tokens(kr, vr, row, n, d, dp, q, m, l, acc, sc, dots, G, dt);
}

/* Rows [r0, r1) of the item (token-major: row = token * group + head) over the n keys
 * at kr / vr, in chunks of MAX_CHUNK. */
ALWAYS_INLINE void attend_rows(const char *kr, const char *vr, int64_t row, int n, int d, int dp,
                               int r0, int r1, const tile_scratch *w, v8f *dots, const int dt) {
    for (int r = r0; r < r1; r += MAX_CHUNK) {
        const float *q = w->qf + (int64_t)r * dp;
        float *m = w->m + r, *l = w->l + r, *acc = w->acc + (int64_t)r * dp, *sc = w->sc;
        const uint32_t *kt = w->kt;
        const uint16_t *vt = w->vt;
        switch (r1 - r < MAX_CHUNK ? r1 - r : MAX_CHUNK) {
        case 1: attend_chunk(kr, vr, kt, vt, row, n, d, dp, q, m, l, acc, sc, dots, 1, dt); break;
        case 2: attend_chunk(kr, vr, kt, vt, row, n, d, dp, q, m, l, acc, sc, dots, 2, dt); break;
        case 3: attend_chunk(kr, vr, kt, vt, row, n, d, dp, q, m, l, acc, sc, dots, 3, dt); break;
        default: attend_chunk(kr, vr, kt, vt, row, n, d, dp, q, m, l, acc, sc, dots, 4, dt); break;
        }
    }
}

/* Causal attention without a window: each key tile once, every row that sees it. */
ALWAYS_INLINE void attend_causal(const attention_args *A, const prefill_item *it,
                                 const tile_scratch *w, const int dt, const int D) {
    const int d = D ? D : A->head_dim, dp = D ? D : A->dp, bs = A->block_size, g = A->group;
    const int64_t es = (int64_t)dtype_size(cache_dtype(dt)), row = A->c_st * es;
    const int64_t pos0 = it->pos0, tokens = it->tokens, last = pos0 + tokens - 1;
    const int fp8 = cache_dtype(dt) >= DT_E4M3, rows_dt = fp8 ? DT_F32 : dt; /* widen_tile */
    v8f dots[MAX_CHUNK * 8];
    for (int64_t blk = 0; blk * bs <= last; blk++) {
        int64_t id = load_index(A->tables, A->t_ix, it->seq * A->t_ss + blk * A->t_sb);
        const char *kb = A->cache + (id * A->c_sb + it->kv_head * A->c_sh) * es;
        const char *vb = kb + A->c_skv * es;
        const int64_t base = blk * bs;
        const int hi = (int)(last + 1 - base < bs ? last + 1 - base : bs);
        for (int t0 = 0; t0 < hi; t0 += SCORE_TILE) {
            const int64_t j0 = base + t0;
            const int whole = bs - t0 < SCORE_TILE ? bs - t0 : SCORE_TILE;
            const char *kr = kb + t0 * row, *vr = vb + t0 * row;
            int64_t tile_row = row;
            const int n = hi - t0 < SCORE_TILE ? hi - t0 : SCORE_TILE; /* keys any row sees */
#if PAIRED_SCORES
            if (scores_paired(dt, d)) {
                pair_tile(kr, row, n, d, w->kt);
                if (!(d & 31)) pair_values(vr, row, n, d, w->vt);
            }
#endif
            if (fp8) {
                widen_tile(kr, row, n, d, dp, w->kf, dt);
                widen_tile(vr, row, n, d, dp, w->vf, dt);
                kr = (const char *)w->kf, vr = (const char *)w->vf;
                tile_row = (int64_t)dp * (int64_t)sizeof(float);
            }
            /* Tokens before `full` end inside the tile: each takes it up to itself. */
            int64_t seen = j0 - pos0 > 0 ? j0 - pos0 : 0;
            int64_t full = j0 + whole - 1 - pos0 > 0 ? j0 + whole - 1 - pos0 : 0;
            if (full > tokens) full = tokens;
            for (int64_t t = seen; t < full; t++)
                attend_rows(kr, vr, tile_row, (int)(pos0 + t - j0 + 1), d, dp, (int)t * g,
                            (int)(t + 1) * g, w, dots, rows_dt);
            if (full < tokens)
                attend_rows(kr, vr, tile_row, whole, d, dp, (int)full * g, (int)tokens * g, w,
                            dots, rows_dt);
        }
    }
}

ALWAYS_INLINE void prefill_item_run(const attention_args *A, const prefill_item *it,
                                    const tile_scratch *w, const int dt, const int D) {
    const int g = A->group, dp = D ? D : A->dp, rows = it->tokens * g;
    for (int r = 0; r < rows; r++)
        begin_row(A, it->q_row0 + r / g, it->kv_head * g + r % g, w->qf + (int64_t)r * dp,
                  w->acc + (int64_t)r * dp, w->m + r, w->l + r);
    if (A->window > 0) {
        for (int t = 0; t < it->tokens; t++) {
            int64_t p = it->pos0 + t, a = p + 1 > A->window ? p + 1 - A->window : 0;
            attend_range(A, it->seq, it->kv_head, a, p + 1, w->qf + (int64_t)t * g * dp,
                         w->m + t * g, w->l + t * g, w->acc + (int64_t)t * g * dp, w->sc, dt, D);
        }
    } else {
        attend_causal(A, it, w, dt, D);
    }
    for (int r = 0; r < rows; r++)
        end_row(A, it->q_row0 + r / g, it->kv_head * g + r % g, w->acc + (int64_t)r * dp, w->l[r]);
}

#define PREFILL_VARIANT(name, DT, D)                                                          \
    static __attribute__((noinline)) void name(const attention_args *A, const prefill_item *it, \
                                               const tile_scratch *w) {                        \
        prefill_item_run(A, it, w, DT, D);                                                     \
    }
SPECIALISE(PREFILL_VARIANT, prefill)

typedef void (*prefill_fn)(const attention_args *, const prefill_item *, const tile_scratch *);

static prefill_fn prefill_variant(int dt, int head_dim) {
    static const prefill_fn table[NUM_CACHE_DTYPES][3] = SPECIALISATIONS(prefill);
    return table[dt][specialisation_of(head_dim)];
}

/* Item i of the job's list, in the thread's scratch. */
static void prefill_run(const attention_job *J, int64_t i, float *scratch) {
    const attention_args *A = J->A;
    const size_t rows = (size_t)A->rows_pad, dp = (size_t)A->dp;
    tile_scratch w = {.qf = scratch};
    w.acc = w.qf + rows * dp;
    w.m = w.acc + rows * dp;
    w.l = w.m + rows;
    w.sc = w.l + rows;
    w.kf = w.sc + MAX_CHUNK * SCORE_TILE;
    w.vf = w.kf + SCORE_TILE * dp;
    w.kt = (uint32_t *)w.kf;
    w.vt = (uint16_t *)w.vf;
    prefill_variant(A->kernel_dt, A->head_dim)(A, (const prefill_item *)J->items + i, &w);
}

static int64_t item_cost(const prefill_item *it) {
    return (int64_t)it->tokens * (it->key_hi - it->key_lo + 1);
}

static int by_cost_descending(const void *x, const void *y) {
    int64_t a = item_cost(x), b = item_cost(y);
    return a < b ? 1 : a > b ? -1 : 0;
}

/* A prefill call: the query rows of each sequence, then the decode call's fields. */
typedef struct {
    int64_t starts, s_ix, s_s, num_tokens;
    pd_attention_call a;
} pd_prefill_call;

int64_t pd_prefill_call_size(void) { return sizeof(pd_prefill_call); }

static int64_t query_start(const pd_prefill_call *call, int64_t s) {
    return load_index(PTR(call->starts), (int)call->s_ix, s * call->s_s);
}

/* Checks every sequence's query rows, context length and used block ids; counts the
 * work items and the (query, key) pairs. PD_OK, or an error with its index in `bad`. */
static int check_sequences(pd_prefill_call *call, const attention_args *A, int64_t *num_items,
                           int64_t *work) {
    pd_attention_call *c = &call->a;
    const int64_t window = A->window, bs = A->block_size;
    int64_t prev = query_start(call, 0);
    if (prev < 0) return fail_at(&c->bad, 0, PD_BAD_QUERY_START);
    for (int64_t s = 0; s < c->num_seqs; s++) {
        int64_t next = query_start(call, s + 1);
        int64_t len = load_index(A->lens, A->l_ix, s * A->l_s), qlen = next - prev;
        if (qlen < 0 || next > call->num_tokens) return fail_at(&c->bad, s, PD_BAD_QUERY_START);
        if (len < 0 || len > c->table_width * bs) return fail_at(&c->bad, s, PD_BAD_CONTEXT_LEN);
        if (qlen > len) return fail_at(&c->bad, s, PD_QUERY_LONGER_THAN_CONTEXT);
        if (qlen > 0) {
            int64_t first = len - qlen; /* first query position */
            int64_t lo = window > 0 && first - window + 1 > 0 ? first - window + 1 : 0;
            for (int64_t blk = lo / bs; blk * bs < len; blk++) {
                int64_t id = load_index(A->tables, A->t_ix, s * A->t_ss + blk * A->t_sb);
                if (id < 0 || id >= c->num_blocks) return fail_at(&c->bad, s, PD_BAD_BLOCK_ID);
            }
            *num_items += (qlen + A->tile_tokens - 1) / A->tile_tokens * A->num_kv_heads;
            *work += qlen * (len - lo);
        }
        prev = next;
    }
    return PD_OK;
}

/* One item per (sequence, tile of its query rows, kv head), into `items`. */
static void list_items(const pd_prefill_call *call, const attention_args *A,
                       prefill_item *items) {
    const int64_t window = A->window, tile_tokens = A->tile_tokens;
    int64_t n_it = 0;
    for (int64_t s = 0; s < call->a.num_seqs; s++) {
        int64_t q0 = query_start(call, s);
        int64_t qlen = query_start(call, s + 1) - q0;
        int64_t len = load_index(A->lens, A->l_ix, s * A->l_s);
        for (int64_t r0 = 0; r0 < qlen; r0 += tile_tokens) {
            int tokens = (int)(qlen - r0 < tile_tokens ? qlen - r0 : tile_tokens);
            int64_t pos0 = len - qlen + r0;
            int64_t lo = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
            for (int h = 0; h < A->num_kv_heads; h++) {
                prefill_item it = {.seq = s, .q_row0 = q0 + r0, .pos0 = pos0, .tokens = tokens,
                                   .kv_head = h, .key_lo = lo, .key_hi = pos0 + tokens - 1};
                items[n_it++] = it;
            }
        }
    }
}

int pd_prefill_attention(pd_prefill_call *call) {
    const pd_attention_call *c = &call->a;
    attention_args A = attention_args_of(c, ((int)c->head_dim + 7) & ~7);
    A.tile_tokens = ROWS_TARGET / A.group < 1 ? 1 : ROWS_TARGET / A.group;
    A.rows_pad = A.tile_tokens * A.group;
    int64_t num_items = 0, work = 0;
    int rc = check_sequences(call, &A, &num_items, &work);
    if (rc != PD_OK || num_items == 0) return rc;
    prefill_item *items = malloc(sizeof(prefill_item) * num_items);
    if (!items) return PD_NO_MEMORY;
    list_items(call, &A, items);
    qsort(items, num_items, sizeof(prefill_item), by_cost_descending);
    int threads = threads_for((int)c->num_threads, work * (int)c->num_heads, 1 << 16);
    if (threads > num_items) threads = (int)num_items;
    const size_t rows = (size_t)A.rows_pad;
    attention_job job = {.A = &A, .items = items, .run = prefill_run, .queue = {0, num_items},
                         .scratch_floats = rows * A.dp * 2 + 2 * rows + MAX_CHUNK * SCORE_TILE +
                                           2 * SCORE_TILE * (size_t)A.dp};
    rc = run_attention_job(&job, threads);
    free(items);
    return rc;
}
