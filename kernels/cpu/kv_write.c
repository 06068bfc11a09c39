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
    void *cache;
    int cache_dt;
    int64_t c_sb, c_skv, c_sh, c_st;
    const void *slots;
    int slot_ix;
    int64_t slot_stride;
    int num_kv_heads, block_size, head_dim;
} write_args;

static void write_tokens(const write_args *A, int64_t t0, int64_t t1) {
    const int64_t es = (int64_t)dtype_size(A->cache_dt);
    for (int64_t t = t0; t < t1; t++) {
        int64_t slot = load_index(A->slots, A->slot_ix, t * A->slot_stride);
        if (slot < 0) continue;
        int64_t block = slot / A->block_size, offset = slot % A->block_size;
        char *base = (char *)A->cache + (block * A->c_sb + offset * A->c_st) * es;
        for (int h = 0; h < A->num_kv_heads; h++) {
            copy_row(A->key, A->key_dt, t * A->k_st + h * A->k_sh, A->k_sd, base + h * A->c_sh * es,
                     A->cache_dt, A->head_dim);
            copy_row(A->value, A->value_dt, t * A->v_st + h * A->v_sh, A->v_sd,
                     base + (A->c_skv + h * A->c_sh) * es, A->cache_dt, A->head_dim);
        }
    }
}

static int write_kv_cache(const void *key, int key_dt, int64_t k_st, int64_t k_sh, int64_t k_sd,
                      const void *value, int value_dt, int64_t v_st, int64_t v_sh, int64_t v_sd,
                      void *cache, int cache_dt, int64_t c_sb, int64_t c_skv, int64_t c_sh,
                      int64_t c_st, const void *slots, int slot_ix, int64_t slot_stride,
                      int64_t num_tokens, int num_kv_heads, int block_size, int head_dim,
                      int64_t num_blocks, int num_threads, int64_t *bad) {
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = load_index(slots, slot_ix, t * slot_stride);
        if (slot >= 0 && slot / block_size >= num_blocks) {
            *bad = t;
            return PD_BAD_SLOT;
        }
    }
    int threads = threads_for(num_threads, num_tokens * num_kv_heads * head_dim, 1 << 15);
    write_args A = {key,   key_dt, k_st,  k_sh,  k_sd,  value, value_dt, v_st,
                    v_sh,  v_sd,   cache, cache_dt, c_sb, c_skv, c_sh,  c_st,
                    slots, slot_ix, slot_stride, num_kv_heads, block_size, head_dim};
    if (threads == 1) {
        write_tokens(&A, 0, num_tokens);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < num_tokens; t++) write_tokens(&A, t, t + 1);
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
    return write_kv_cache(PTR(c->key), c->key_dt, c->k_st, c->k_sh, c->k_sd, PTR(c->value),
                          c->value_dt, c->v_st, c->v_sh, c->v_sd, PTR(c->cache), c->cache_dt,
                          c->c_sb, c->c_skv, c->c_sh, c->c_st, PTR(c->slots), c->slot_ix,
                          c->slot_stride, c->num_tokens, c->num_kv_heads, c->block_size,
                          c->head_dim, c->num_blocks, c->num_threads, &c->bad);
}
