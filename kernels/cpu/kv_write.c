/* KV-cache write: scatter this step's keys and values into their paged slots.
 *
 * key/value [num_tokens, num_kv_heads, head_dim] (any strides); cache block-major
 * [num_blocks, 2, num_kv_heads, block_size, head_dim] addressed through its strides.
 * A negative slot is padding and writes nothing. Into an FP8 cache each element goes
 * as fp8(x / scale), the layer's k_scale or v_scale (common.h: float_to_fp8).
 */
#include "common.h"

ALWAYS_INLINE void copy_row(const void *src, int src_dt, int64_t off, int64_t stride, void *dst,
                            int dst_dt, int d, float scale) {
    if (dst_dt >= DT_E4M3) {
        for (int k = 0; k < d; k++)
            ((uint8_t *)dst)[k] = float_to_fp8(load_scalar(src, src_dt, off + k * stride) / scale,
                                               dst_dt);
        return;
    }
    if (src_dt == dst_dt && stride == 1) {
        size_t es = dtype_size(dst_dt);
        memcpy(dst, (const char *)src + off * es, (size_t)d * es);
        return;
    }
    for (int k = 0; k < d; k++) store_scalar(dst, dst_dt, k, load_scalar(src, src_dt, off + k * stride));
}

typedef struct {
    tensor3 key, value; /* [num_tokens, num_kv_heads, head_dim] */
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
            copy_row(A->key.data, A->key.dt, t * A->key.s0 + h * A->key.s1, A->key.s2, k, C->dt,
                     A->head_dim, C->k_scale);
            copy_row(A->value.data, A->value.dt, t * A->value.s0 + h * A->value.s1, A->value.s2,
                     k + C->skv * es, C->dt, A->head_dim, C->v_scale);
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
    pd_tensor3 key, value;
    int64_t cache, cache_dt, c_sb, c_skv, c_sh, c_st;
    int64_t slots, slot_ix, slot_stride;
    int64_t num_tokens, num_kv_heads, block_size, head_dim, num_blocks, num_threads;
    double k_scale, v_scale;
    int64_t bad;
} pd_write_call;

int64_t pd_write_call_size(void) { return sizeof(pd_write_call); }

int pd_write_kv_cache(pd_write_call *c) {
    write_args A = {.key = tensor3_of(&c->key), .value = tensor3_of(&c->value),
                    .cache = {PTR(c->cache), (int)c->cache_dt, c->c_sb, c->c_skv, c->c_sh,
                              c->c_st, (int)c->block_size, PTR(c->slots), (int)c->slot_ix,
                              c->slot_stride, (float)c->k_scale, (float)c->v_scale},
                    .num_kv_heads = (int)c->num_kv_heads, .head_dim = (int)c->head_dim};
    return write_kv_cache(&A, c->num_tokens, c->num_blocks, (int)c->num_threads, &c->bad);
}
