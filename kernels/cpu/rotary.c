/* Rotary embedding of q and k straight out of a fused QKV projection, with k and v
 * written into their paged KV-cache slots, in one call per layer.
 *
 * qkv [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] (row stride any, columns
 * contiguous): the query heads, then the key heads, then the value heads, as the fused
 * projection lays them out. The rotated queries go to q_out [num_tokens, num_heads,
 * head_dim] (any strides); rotated keys and the values go to the cache slot of their
 * token (a negative slot is padding: nothing written for it, its query still rotated).
 *
 * Neox-style rotation over the whole head_dim, as `rotary_embedding_ref` computes it:
 * with c, s the cos and sin at the token's position (cos_sin row = [cos | sin] of the
 * half-dimension angles), x1 = x[:half], x2 = x[half:],
 *   out[:half] = x1 * c - x2 * s,   out[half:] = x2 * c + x1 * s,
 * each product rounded to float32 before the sum (the build forbids contraction), so a
 * float32 model gets the reference's values bit for bit. A rotated value is rounded to
 * qkv's dtype (the reference returns it in the input dtype), then to the cache's (an
 * FP8 cache's as fp8(x / scale), the layer's k_scale or v_scale).
 * Every token's output depends on that token alone.
 */
#include "common.h"

#define MAX_HEAD_DIM 1024
#define MIN_ELEMENTS_PER_THREAD (1 << 16)

typedef struct {
    const void *qkv;
    int qkv_dt;
    int64_t qkv_rs;
    const void *positions;
    int pos_ix;
    const void *cos_sin;
    int cs_dt;
    int64_t cs_rs;
    void *q_out;
    int q_dt;
    int64_t q_st, q_sh, q_sd;
    kv_slots cache;
    int num_heads, num_kv_heads, head_dim;
} rotary_args;

/* n elements of base (dtype dt, contiguous from element off) into dst as float32. */
static void load_floats(const void *base, int dt, int64_t off, int n, float *dst) {
    if (dt == DT_F32) {
        memcpy(dst, (const float *)base + off, sizeof(float) * n);
    } else if (dt == DT_BF16) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_float(p[i]);
    } else {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int i = 0; i < n; i++) dst[i] = f16_to_float(p[i]);
    }
}

/* src [n] float32 into base at element off (contiguous), in dtype dt. */
static void store_floats(void *base, int dt, int64_t off, int n, const float *src) {
    if (dt == DT_F32) {
        memcpy((float *)base + off, src, sizeof(float) * n);
    } else if (dt == DT_BF16) {
        uint16_t *p = (uint16_t *)base + off;
        for (int i = 0; i < n; i++) p[i] = float_to_bf16(src[i]);
    } else {
        uint16_t *p = (uint16_t *)base + off;
        for (int i = 0; i < n; i++) p[i] = float_to_f16(src[i]);
    }
}

/* Values of dtype dt rounded as storing them there would (a no-op for float32). */
static void round_as(int dt, int n, float *x) {
    if (dt == DT_BF16)
        for (int i = 0; i < n; i++) x[i] = bf16_to_float(float_to_bf16(x[i]));
    else if (dt == DT_F16)
        for (int i = 0; i < n; i++) x[i] = f16_to_float(float_to_f16(x[i]));
}

/* x [d] rotated by (c, s) [half each] into out [d]. */
static void rotate(const float *x, const float *c, const float *s, int half, float *out) {
    for (int i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[half + i];
        out[i] = x1 * c[i] - x2 * s[i];
        out[half + i] = x2 * c[i] + x1 * s[i];
    }
}

static void rotate_token(const rotary_args *A, int64_t t) {
    const int d = A->head_dim, half = d / 2;
    float cs[MAX_HEAD_DIM], x[MAX_HEAD_DIM], y[MAX_HEAD_DIM];
    int64_t pos = load_index(A->positions, A->pos_ix, t);
    load_floats(A->cos_sin, A->cs_dt, pos * A->cs_rs, d, cs);
    const int64_t row = t * A->qkv_rs;
    for (int h = 0; h < A->num_heads; h++) {
        load_floats(A->qkv, A->qkv_dt, row + (int64_t)h * d, d, x);
        rotate(x, cs, cs + half, half, y);
        round_as(A->qkv_dt, d, y);
        int64_t base = t * A->q_st + h * A->q_sh;
        if (A->q_sd == 1) {
            store_floats(A->q_out, A->q_dt, base, d, y);
        } else {
            for (int i = 0; i < d; i++) store_scalar(A->q_out, A->q_dt, base + i * A->q_sd, y[i]);
        }
    }
    const kv_slots *C = &A->cache;
    int64_t slot = kv_slot(C, t);
    if (slot < 0) return;
    const int64_t k_col = (int64_t)A->num_heads * d, v_col = k_col + (int64_t)A->num_kv_heads * d;
    for (int h = 0; h < A->num_kv_heads; h++) {
        const int64_t key_row = kv_key_row(C, slot, h);
        load_floats(A->qkv, A->qkv_dt, row + k_col + (int64_t)h * d, d, x);
        rotate(x, cs, cs + half, half, y);
        round_as(A->qkv_dt, d, y);
        load_floats(A->qkv, A->qkv_dt, row + v_col + (int64_t)h * d, d, x);
        if (C->dt >= DT_E4M3) {
            store_kv_row(C, key_row, d, y, C->k_scale);
            store_kv_row(C, key_row + C->skv, d, x, C->v_scale);
        } else {
            store_floats(C->base, C->dt, key_row, d, y);
            store_floats(C->base, C->dt, key_row + C->skv, d, x);
        }
    }
}

static int rotary_write(const rotary_args *A, int64_t num_tokens, int64_t num_blocks,
                        int64_t max_position, int num_threads, int64_t *bad) {
    if (A->head_dim > MAX_HEAD_DIM || A->head_dim % 2) return fail_at(bad, 0, PD_BAD_HEAD_DIM);
    for (int64_t t = 0; t < num_tokens; t++) {
        if (kv_slot_outside(&A->cache, kv_slot(&A->cache, t), num_blocks))
            return fail_at(bad, t, PD_BAD_SLOT);
        int64_t pos = load_index(A->positions, A->pos_ix, t);
        if (pos < 0 || pos >= max_position) return fail_at(bad, t, PD_BAD_POSITION);
    }
    int64_t per_token = (int64_t)(A->num_heads + 2 * A->num_kv_heads) * A->head_dim;
    int threads = threads_for(num_threads, num_tokens * per_token, MIN_ELEMENTS_PER_THREAD);
    if (threads == 1) {
        for (int64_t t = 0; t < num_tokens; t++) rotate_token(A, t);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < num_tokens; t++) rotate_token(A, t);
    }
    return PD_OK;
}

/* The call's arguments as one struct of 8-byte fields (kernels/cpu_ops.py packs it). */
typedef struct {
    int64_t qkv, qkv_dt, qkv_rs;
    int64_t positions, pos_ix;
    int64_t cos_sin, cs_dt, cs_rs, max_position;
    int64_t q_out, q_dt, q_st, q_sh, q_sd;
    int64_t cache, cache_dt, c_sb, c_skv, c_sh, c_st;
    int64_t slots, slot_ix;
    int64_t num_tokens, num_heads, num_kv_heads, head_dim, block_size, num_blocks, num_threads;
    double k_scale, v_scale;
    int64_t bad;
} pd_rotary_call;

int64_t pd_rotary_call_size(void) { return sizeof(pd_rotary_call); }

int pd_rotary_write_kv_cache(pd_rotary_call *c) {
    /* The slots come contiguous (kernels/cpu_layer_ops.py checks). */
    rotary_args A = {PTR(c->qkv), (int)c->qkv_dt, c->qkv_rs, PTR(c->positions), (int)c->pos_ix,
                     PTR(c->cos_sin), (int)c->cs_dt, c->cs_rs, PTR(c->q_out), (int)c->q_dt,
                     c->q_st, c->q_sh, c->q_sd,
                     {PTR(c->cache), (int)c->cache_dt, c->c_sb, c->c_skv, c->c_sh, c->c_st,
                      (int)c->block_size, PTR(c->slots), (int)c->slot_ix, 1, (float)c->k_scale,
                      (float)c->v_scale},
                     (int)c->num_heads, (int)c->num_kv_heads, (int)c->head_dim};
    return rotary_write(&A, c->num_tokens, c->num_blocks, c->max_position, (int)c->num_threads,
                        &c->bad);
}
