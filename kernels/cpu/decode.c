/* Decode attention over the paged KV cache: one query token per sequence.
 *
 * Memory-bound: every K/V byte of a sequence's visible context is read once per call.
 * - A work item is (sequence, kv head). All query heads of the kv head (the GQA group)
 *   are processed together, so each K and V row is read from memory and converted once
 *   for the whole group; groups over 4 heads go in chunks of 4 that reuse the block from
 *   L1 (attend.h: the arithmetic, shared with the prefill kernel).
 * - The context streams block by block straight from the paged cache through the
 *   block table (no gather, no score matrix); an online softmax in base 2 (log2(e)
 *   folded into the query) keeps running max / sum / accumulator per head.
 * - No split of a context across threads: where the split falls would change a
 *   token's rounding with the batch it shares (a batch of one long sequence keeps at
 *   most kv-heads threads busy).
 * - Only tokens inside [max(0, len - window), len) are touched, so slots past a
 *   sequence's end or unused table entries (which may hold NaN) are never read.
 * A sequence with context_len 0 (a padding row) gets zeros.
 */
#include "attend.h"

/* Token x kv-head pairs below which one thread runs: a second thread costs ~2 us to wake,
 * a batch-1 step of 3 kv heads at 300 tokens saves 3 us a layer with it. */
#define MIN_TOKENS_PER_THREAD 256

#define ATTEND_VARIANT(name, DT, D)                                                            \
    static __attribute__((noinline)) void name(const attention_args *A, int64_t s, int h,         \
                                               int64_t a, int64_t b, const float *qf,          \
                                               float *m, float *l, float *acc, float *sc) {    \
        attend_range(A, s, h, a, b, qf, m, l, acc, sc, DT, D);                                 \
    }
SPECIALISE(ATTEND_VARIANT, attend)

typedef void (*attend_fn)(const attention_args *, int64_t, int, int64_t, int64_t, const float *,
                          float *, float *, float *, float *);

static attend_fn attend_variant(int dt, int head_dim) {
    static const attend_fn table[NUM_CACHE_DTYPES][3] = SPECIALISATIONS(attend);
    return table[dt][specialisation_of(head_dim)];
}

/* Item `it`: every head of one kv head of one sequence over its visible context. */
static void decode_item(const attention_job *J, int64_t it, float *scratch) {
    const attention_args *A = J->A;
    const int64_t s = it / A->num_kv_heads;
    const int h = (int)(it % A->num_kv_heads), dp = A->dp, group = A->group;
    float *qf = scratch, *acc = qf + group * dp, *m = acc + group * dp, *l = m + group;
    float *sc = l + group;
    int64_t len = load_index(A->lens, A->l_ix, s * A->l_s);
    int64_t a = A->window > 0 && len > A->window ? len - A->window : 0;
    for (int i = 0; i < group; i++)
        begin_row(A, s, h * group + i, qf + i * dp, acc + i * dp, m + i, l + i);
    if (a < len) attend_variant(A->kernel_dt, A->head_dim)(A, s, h, a, len, qf, m, l, acc, sc);
    for (int i = 0; i < group; i++) end_row(A, s, h * group + i, acc + i * dp, l[i]);
}

int64_t pd_decode_call_size(void) { return sizeof(pd_attention_call); }

int pd_decode_attention(pd_attention_call *c) {
    const attention_args A = attention_args_of(c, ((int)c->head_dim + 7) & ~7);
    const int64_t num_seqs = c->num_seqs, window = c->window;
    const int block_size = A.block_size;
    int64_t tokens = 0;
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
    }
    const int64_t items = num_seqs * A.num_kv_heads;
    int threads = threads_for((int)c->num_threads, tokens * A.num_kv_heads, MIN_TOKENS_PER_THREAD);
    if (threads > items) threads = (int)items;
    const size_t scratch = (size_t)A.group * (2 * A.dp + 2) + MAX_CHUNK * SCORE_TILE;
    attention_job job = {.A = &A, .run = decode_item, .queue = {0, items},
                         .scratch_floats = scratch};
    return run_attention_job(&job, threads);
}
