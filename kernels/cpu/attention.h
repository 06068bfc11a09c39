/* The paged-attention calls' arguments, shared by the decode and the prefill kernel:
 * the struct kernels/cpu_ops.py packs, the typed view the attention loops read, and the
 * job that hands a call's work items to its threads.
 */
#ifndef PDSERVE_CPU_ATTENTION_H
#define PDSERVE_CPU_ATTENTION_H

#include "common.h"

/* A bf16 cache whose scores take bf16 dot products (attend.h): the kernels' variant
 * tables give it a row of its own, after the cache dtypes. */
#define DT_BF16_DOT 5

__attribute__((visibility("hidden"))) int linear_bf16_dot_available(void);

/* A decode call's arguments, and the tail of a prefill call's: one struct of 8-byte
 * fields, packed by kernels/cpu_ops.py. The last receives the index of a bad input. */
typedef struct {
    pd_tensor3 q;
    int64_t cache, c_dt, c_sb, c_skv, c_sh, c_st;
    int64_t tables, t_ix, t_ss, t_sb;
    int64_t lens, l_ix, l_s;
    pd_tensor3 out;
    int64_t num_seqs, num_heads, num_kv_heads, block_size, head_dim, num_blocks, table_width;
    double scale;
    int64_t window, num_threads;
    double k_scale, v_scale; /* an FP8 cache's per-tensor scales (1 for the others) */
    int64_t bad;
} pd_attention_call;

/* The same, typed, with what the attention loops derive from it. */
typedef struct {
    tensor3 q; /* [tokens, heads, head_dim] */
    const char *cache;
    int c_dt;
    int kernel_dt; /* the variant row: c_dt, or DT_BF16_DOT */
    int64_t c_sb, c_skv, c_sh, c_st;
    const void *tables;
    int t_ix;
    int64_t t_ss, t_sb;
    const void *lens;
    int l_ix;
    int64_t l_s;
    tensor3 out; /* like q */
    int num_kv_heads, block_size, head_dim, group;
    int dp; /* head_dim padded to the kernel's vector step */
    int tile_tokens, rows_pad; /* prefill's query tiles */
    int64_t window;
    float qmul; /* scale * log2(e) * the keys' read scale: scores in base 2 */
    float vmul; /* the values' read scale, applied to each output row */
} attention_args;

/* An FP8 cache's keys and values read as fp8_to_float_raw; their scales (with the
 * 2^8 of e4m3) fold into the query's multiplier and each output row's, so the loops
 * widen FP8 with one conversion and no multiply (1 for 16/32-bit caches). */
static inline attention_args attention_args_of(const pd_attention_call *c, int dp) {
    const int fp8 = c->c_dt >= DT_E4M3;
    const float kmul = fp8 ? (float)c->k_scale * fp8_read_scale((int)c->c_dt) : 1.0f;
    const float vmul = fp8 ? (float)c->v_scale * fp8_read_scale((int)c->c_dt) : 1.0f;
    /* bf16 keys against a bf16-rounded query where this build and CPU have AVX512-BF16,
     * as the linear layer decides (PDSERVE_CPU_ISA=avx2 builds without it). */
    const int dot = c->c_dt == DT_BF16 && linear_bf16_dot_available();
    return (attention_args){
        .q = tensor3_of(&c->q), .cache = PTR(c->cache), .c_dt = (int)c->c_dt,
        .kernel_dt = dot ? DT_BF16_DOT : (int)c->c_dt, .c_sb = c->c_sb,
        .c_skv = c->c_skv, .c_sh = c->c_sh, .c_st = c->c_st, .tables = PTR(c->tables),
        .t_ix = (int)c->t_ix, .t_ss = c->t_ss, .t_sb = c->t_sb, .lens = PTR(c->lens),
        .l_ix = (int)c->l_ix, .l_s = c->l_s, .out = tensor3_of(&c->out),
        .num_kv_heads = (int)c->num_kv_heads,
        .block_size = (int)c->block_size, .head_dim = (int)c->head_dim,
        .group = (int)(c->num_heads / c->num_kv_heads), .dp = dp, .window = c->window,
        .qmul = (float)c->scale * LOG2_E * kmul, .vmul = vmul};
}

/* A call as its threads see it: items handed out from one queue, each run by `run` with
 * the thread's own zeroed scratch of `scratch_floats` floats. */
typedef struct attention_job {
    const attention_args *A;
    const void *items; /* the kernel's list of items, where it has one */
    void (*run)(const struct attention_job *J, int64_t item, float *scratch);
    work_queue queue;
    size_t scratch_floats;
    int failed; /* a thread had no memory for its scratch */
} attention_job;

static inline void attention_worker(void *job) {
    attention_job *J = job;
    float *scratch = calloc(J->scratch_floats, sizeof(float));
    if (!scratch) {
        __atomic_store_n(&J->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t i; (i = take_item(&J->queue)) < J->queue.end;) J->run(J, i, scratch);
    free(scratch);
}

/* Every item of the job on `threads` threads: PD_OK, or PD_NO_MEMORY. */
static inline int run_attention_job(attention_job *J, int threads) {
    run_workers(attention_worker, J, threads);
    return J->failed ? PD_NO_MEMORY : PD_OK;
}

#endif
