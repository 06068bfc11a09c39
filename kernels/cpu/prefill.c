/* Prefill attention: ragged causal attention of new tokens over the cached prefix
 * plus themselves, flash-style.
 *
 * - A work item is (sequence, tile of query tokens, kv head). Its rows are the tile's
 *   tokens x the GQA group's heads (about ROWS_TARGET rows), so each key/value tile
 *   is converted once for all of them.
 * - Keys stream in tiles of KEY_TILE tokens gathered through the block table (any
 *   block size): K is converted to fp32 and transposed ([head_dim][KEY_TILE]), V is
 *   converted row-major. Register-blocked micro-kernels compute S = Q K^T (6 rows x
 *   16 keys) and O += P V (6 rows x 16 dims) with fp32 accumulators.
 * - Online softmax in base 2 per row; the full score matrix never exists. Key tiles
 *   stop at the tile's last query position (causal) and start at its first query's
 *   window; masking runs only on tiles that straddle the diagonal or a window edge.
 * - Items are sorted by cost (longest key range first) and scheduled dynamically.
 */
#include "attention.h"

#define KEY_TILE 32
#define ROW_GROUP 6
#define COL_CHUNK 16
#define ROWS_TARGET 128

typedef struct {
    int64_t seq, q_row0;    /* sequence, and its first query row in `q` */
    int64_t pos0;           /* position of the tile's first token */
    int32_t tokens, kv_head;
    int64_t key_lo, key_hi; /* keys [key_lo, key_hi] */
} prefill_item;

typedef struct {
    float *qf, *o, *s, *kt, *vf, *m, *l, *corr;
} tile_scratch;

/* A micro-kernel's accumulators into rows r..r+6, columns c..c+16 of dst. */
ALWAYS_INLINE void store_row_group(float *dst, int row_stride, int r, int c,
                                   v8f acc[ROW_GROUP][2]) {
#pragma GCC unroll 6
    for (int i = 0; i < ROW_GROUP; i++) {
        v8_store(dst + (r + i) * row_stride + c, acc[i][0]);
        v8_store(dst + (r + i) * row_stride + c + 8, acc[i][1]);
    }
}

/* S[r..r+6)[cc..cc+16) = Qf rows . KT columns. */
ALWAYS_INLINE void qk_micro(const float *qf, const float *kt, float *s, int r, int cc, int dp) {
    v8f acc[ROW_GROUP][2];
#pragma GCC unroll 6
    for (int i = 0; i < ROW_GROUP; i++) acc[i][0] = acc[i][1] = v8_splat(0.0f);
    const float *q = qf + (int64_t)r * dp;
    for (int c = 0; c < dp; c++) {
        v8f k0 = v8_load(kt + c * KEY_TILE + cc), k1 = v8_load(kt + c * KEY_TILE + cc + 8);
#pragma GCC unroll 6
        for (int i = 0; i < ROW_GROUP; i++) {
            v8f b = v8_splat(q[i * dp + c]);
            acc[i][0] += b * k0;
            acc[i][1] += b * k1;
        }
    }
    store_row_group(s, KEY_TILE, r, cc, acc);
}

/* O[r..r+6)[c0..c0+16) = O * corr + P[:, :n] V[:n]. */
ALWAYS_INLINE void pv_micro(float *o, const float *p, const float *vf, const float *corr, int r,
                            int c0, int n, int dp) {
    v8f acc[ROW_GROUP][2];
#pragma GCC unroll 6
    for (int i = 0; i < ROW_GROUP; i++) {
        v8f f = v8_splat(corr[r + i]);
        acc[i][0] = v8_load(o + (r + i) * dp + c0) * f;
        acc[i][1] = v8_load(o + (r + i) * dp + c0 + 8) * f;
    }
    for (int t = 0; t < n; t++) {
        v8f v0 = v8_load(vf + t * dp + c0), v1 = v8_load(vf + t * dp + c0 + 8);
#pragma GCC unroll 6
        for (int i = 0; i < ROW_GROUP; i++) {
            v8f b = v8_splat(p[(r + i) * KEY_TILE + t]);
            acc[i][0] += b * v0;
            acc[i][1] += b * v1;
        }
    }
    store_row_group(o, dp, r, c0, acc);
}

/* Keys/values j0..j0+n of the item's sequence and kv head into KT / Vf. Keys go
 * through 8x8 register transposes, eight tokens at a time. */
ALWAYS_INLINE void load_key_tile(const attention_args *A, const prefill_item *it, int64_t j0, int n,
                                 const tile_scratch *w, const int dt) {
    const int d = A->head_dim, d8 = d & ~7, dp = A->dp, bs = A->block_size;
    const int64_t es = (int64_t)dtype_size(dt);
    const char *krow[KEY_TILE];
    for (int jj = 0; jj < n; jj++) {
        int64_t j = j0 + jj;
        int64_t id = load_index(A->tables, A->t_ix, it->seq * A->t_ss + (j / bs) * A->t_sb);
        krow[jj] = A->cache + (id * A->c_sb + it->kv_head * A->c_sh + (j % bs) * A->c_st) * es;
        const char *vr = krow[jj] + A->c_skv * es;
        for (int c = 0; c < d8; c += 8) v8_store(w->vf + jj * dp + c, v8_load_as(vr, dt, c));
        for (int c = d8; c < d; c++) w->vf[jj * dp + c] = load_scalar(vr, dt, c);
    }
    int jj = 0;
    for (; jj + 8 <= n; jj += 8) {
        for (int c = 0; c < d8; c += 8) {
            v8f r[8];
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) r[u] = v8_load_as(krow[jj + u], dt, c);
            v8_transpose8(r);
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) v8_store(w->kt + (c + u) * KEY_TILE + jj, r[u]);
        }
    }
    for (; jj < n; jj++)
        for (int c = 0; c < d8; c += 8) {
            v8f kv = v8_load_as(krow[jj], dt, c);
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) w->kt[(c + u) * KEY_TILE + jj] = kv[u];
        }
    for (int t = 0; t < n; t++)
        for (int c = d8; c < d; c++) w->kt[c * KEY_TILE + t] = load_scalar(krow[t], dt, c);
    /* Columns n.. of KT keep stale values: their scores are masked to -inf by
     * assignment, and no other column reads them. */
}

/* Causal / window mask of one key tile, then the online-softmax update of every row:
 * S becomes P, corr holds each row's rescale factor. */
static void softmax_tile(const attention_args *A, const prefill_item *it, int64_t j0, int n,
                         int rows_pad, const tile_scratch *w) {
    const int g = A->group, rows = it->tokens * g;
    const int64_t W = A->window;
    const int64_t last_pos = it->pos0 + it->tokens - 1;
    int full = j0 + n - 1 <= it->pos0 && (W <= 0 || j0 > last_pos - W);
    for (int r = 0; r < rows_pad; r++) {
        float *s = w->s + r * KEY_TILE;
        if (r >= rows) { /* padding row: contributes nothing */
            memset(s, 0, sizeof(float) * KEY_TILE);
            w->corr[r] = 1.0f;
            continue;
        }
        int hi = n - 1, lo = 0;
        if (!full) {
            int64_t p = it->pos0 + r / g;
            if (p - j0 < hi) hi = (int)(p - j0);
            if (W > 0 && p - W + 1 - j0 > lo) lo = (int)(p - W + 1 - j0);
        }
        for (int t = 0; t < KEY_TILE; t++)
            if (t < lo || t > hi) s[t] = -INFINITY;
        v8f mx8 = v8_max(v8_max(v8_load(s), v8_load(s + 8)), v8_max(v8_load(s + 16), v8_load(s + 24)));
        float mx = v8_hmax(mx8);
        if (mx == -INFINITY) { /* no visible key in this tile yet */
            memset(s, 0, sizeof(float) * KEY_TILE);
            w->corr[r] = 1.0f;
            continue;
        }
        float mn = mx > w->m[r] ? mx : w->m[r];
        w->corr[r] = exp2f(w->m[r] - mn);
        w->m[r] = mn;
        v8f mv = v8_splat(mn), sum = v8_splat(0.0f);
        for (int t = 0; t < KEY_TILE; t += 8) {
            v8f pr = v8_exp2(v8_load(s + t) - mv);
            v8_store(s + t, pr);
            sum += pr;
        }
        w->l[r] = w->l[r] * w->corr[r] + v8_hsum(sum);
    }
}

ALWAYS_INLINE void prefill_item_run(const attention_args *A, const prefill_item *it,
                                    const tile_scratch *w, const int dt) {
    const int g = A->group, dp = A->dp, d = A->head_dim, rows = it->tokens * g;
    const int rows_pad = (rows + ROW_GROUP - 1) / ROW_GROUP * ROW_GROUP;
    for (int r = 0; r < rows_pad; r++) {
        float *qr = w->qf + r * dp;
        if (r < rows) {
            int head = it->kv_head * g + r % g;
            load_row(A->q, A->q_dt, (it->q_row0 + r / g) * A->q_ss + head * A->q_sh, A->q_sd, d,
                     dp, A->qmul, qr);
        } else {
            memset(qr, 0, sizeof(float) * dp);
        }
        memset(w->o + r * dp, 0, sizeof(float) * dp);
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    for (int64_t j0 = it->key_lo; j0 <= it->key_hi; j0 += KEY_TILE) {
        int n = (int)(it->key_hi + 1 - j0 < KEY_TILE ? it->key_hi + 1 - j0 : KEY_TILE);
        load_key_tile(A, it, j0, n, w, dt);
        for (int cc = 0; cc < n; cc += COL_CHUNK)
            for (int r = 0; r < rows_pad; r += ROW_GROUP) qk_micro(w->qf, w->kt, w->s, r, cc, dp);
        softmax_tile(A, it, j0, n, rows_pad, w);
        for (int c0 = 0; c0 < dp; c0 += COL_CHUNK)
            for (int r = 0; r < rows_pad; r += ROW_GROUP)
                pv_micro(w->o, w->s, w->vf, w->corr, r, c0, n, dp);
    }
    for (int r = 0; r < rows; r++) {
        int head = it->kv_head * g + r % g;
        store_row(A->out, A->o_dt, (it->q_row0 + r / g) * A->o_ss + head * A->o_sh, A->o_sd, d,
                  w->o + r * dp, 1.0f / w->l[r]);
    }
}

static void prefill_item_any(const attention_args *A, const prefill_item *it, const tile_scratch *w) {
    if (A->c_dt == DT_BF16)
        prefill_item_run(A, it, w, DT_BF16);
    else if (A->c_dt == DT_F32)
        prefill_item_run(A, it, w, DT_F32);
    else
        prefill_item_run(A, it, w, DT_F16);
}

typedef struct {
    const attention_args *A;
    const prefill_item *items;
    work_queue queue;
    size_t scratch_floats;
    int failed;
} prefill_job;

static void prefill_worker(void *job) {
    prefill_job *J = job;
    const attention_args *A = J->A;
    const size_t rows = (size_t)A->rows_pad, dp = (size_t)A->dp;
    float *buf = calloc(J->scratch_floats, sizeof(float));
    if (!buf) {
        __atomic_store_n(&J->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    tile_scratch w = {.qf = buf};
    w.o = w.qf + rows * dp;
    w.s = w.o + rows * dp;
    w.kt = w.s + rows * KEY_TILE;
    w.vf = w.kt + dp * KEY_TILE;
    w.m = w.vf + KEY_TILE * dp;
    w.l = w.m + rows;
    w.corr = w.l + rows;
    for (int64_t i; (i = take_item(&J->queue)) < J->queue.end;) prefill_item_any(A, &J->items[i], &w);
    free(buf);
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
    const int dp = ((int)c->head_dim + COL_CHUNK - 1) / COL_CHUNK * COL_CHUNK;
    attention_args A = attention_args_of(c, dp);
    A.tile_tokens = ROWS_TARGET / A.group < 1 ? 1 : ROWS_TARGET / A.group;
    A.rows_pad = (A.tile_tokens * A.group + ROW_GROUP - 1) / ROW_GROUP * ROW_GROUP;
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
    prefill_job job = {.A = &A, .items = items, .queue = {0, num_items},
                       .scratch_floats = rows * dp * 2 + rows * KEY_TILE +
                                         (size_t)dp * KEY_TILE * 2 + 3 * rows};
    run_workers(prefill_worker, &job, threads);
    free(items);
    return job.failed ? PD_NO_MEMORY : PD_OK;
}
