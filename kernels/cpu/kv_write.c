/* KV-cache write: scatter this step's keys and values into their paged slots.
 *
 * key/value [num_tokens, num_kv_heads, head_dim] (any strides); cache block-major
 * [num_blocks, 2, num_kv_heads, block_size, head_dim] addressed through its strides.
 * A negative slot is padding and writes nothing.
 */
#include "common.h"

ALWAYS_INLINE void copy_row(const void *src, int src_dt, int64_t off, int64_t stride, void *dst,
                            int dst_dt, int d) {
    if (src_dt == dst_dt && stride == 1) {
        size_t es = dtype_size(dst_dt);
        memcpy(dst, (const char *)src + off * es, (size_t)d * es);
        return;
    }
    for (int k = 0; k < d; k++) store_scalar(dst, dst_dt, k, load_scalar(src, src_dt, off + k * stride));
}

typedef struct {
    const void *key;
    int key_dt;
    int64_t k_st, k_sh, k_sd;
    const void *value;
    int value_dt;
    int64_t v_st, v_sh, v_sd;
    kv_slots cache;
    int num_kv_heads, head_dim;
} write_args;

static void write_tokens(const write_args *A, int64_t t0, int64_t t1) {
    const kv_slots *C = &A->cache;
    const int64_t es = (int64_t)dtype_size(C->dt);
    for (int64_t t = t0; t < t1; t++) {
        int64_t slot = kv_slot(C, t);
        if (slot < 0) continue;
        for (int h = 0; h < A->num_kv_heads; h++) {
            char *k = (char *)C->base + kv_key_row(C, slot, h) * es;
            copy_row(A->key, A->key_dt, t * A->k_st + h * A->k_sh, A->k_sd, k, C->dt,
                     A->head_dim);
            copy_row(A->value, A->value_dt, t * A->v_st + h * A->v_sh, A->v_sd, k + C->skv * es,
                     C->dt, A->head_dim);
        }
    }
}

static int write_kv_cache(const write_args *A, int64_t num_tokens, int64_t num_blocks,
                          int num_threads, int64_t *bad) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (kv_slot_outside(&A->cache, kv_slot(&A->cache, t), num_blocks))
            return fail_at(bad, t, PD_BAD_SLOT);
    int threads = threads_for(num_threads, num_tokens * A->num_kv_heads * A->head_dim, 1 << 15);
    if (threads == 1) {
        write_tokens(A, 0, num_tokens);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < num_tokens; t++) write_tokens(A, t, t + 1);
    }
    return PD_OK;
}

/* The call's arguments as one struct of 8-byte fields (kernels/cpu_ops.py packs it). */
typedef struct {
    int64_t key, key_dt, k_st, k_sh, k_sd;
    int64_t value, value_dt, v_st, v_sh, v_sd;
    int64_t cache, cache_dt, c_sb, c_skv, c_sh, c_st;
    int64_t slots, slot_ix, slot_stride;
    int64_t num_tokens, num_kv_heads, block_size, head_dim, num_blocks, num_threads;
    int64_t bad;
} pd_write_call;

int64_t pd_write_call_size(void) { return sizeof(pd_write_call); }

int pd_write_kv_cache(pd_write_call *c) {
    write_args A = {.key = PTR(c->key), .key_dt = (int)c->key_dt, .k_st = c->k_st,
                    .k_sh = c->k_sh, .k_sd = c->k_sd, .value = PTR(c->value),
                    .value_dt = (int)c->value_dt, .v_st = c->v_st, .v_sh = c->v_sh,
                    .v_sd = c->v_sd,
                    .cache = {PTR(c->cache), (int)c->cache_dt, c->c_sb, c->c_skv, c->c_sh,
                              c->c_st, (int)c->block_size, PTR(c->slots), (int)c->slot_ix,
                              c->slot_stride},
                    .num_kv_heads = (int)c->num_kv_heads, .head_dim = (int)c->head_dim};
    return write_kv_cache(&A, c->num_tokens, c->num_blocks, (int)c->num_threads, &c->bad);
}
