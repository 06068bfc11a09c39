/* The MLP's activation, silu(gate) * up over the two halves of each float32 gate/up
 * row, as `silu_and_mul_ref` defines it (silu rounded to float32, then the product).
 *
 * silu(x) = x * sigmoid(x), with t = e^-|x| from `exp_neg` below: sigmoid = 1 / (1 + t)
 * for x >= 0 and t / (1 + t) below. That is within a few float32 ulps of torch's silu,
 * not bit for bit: the eager step and the captured step (program.c) both run this
 * kernel, so a token's numbers do not depend on which of them computed it. The columns
 * past the last full vector go through the same vector code, so every column of a row
 * is computed the same way whatever the row count. Every row depends on that row alone.
 */
#include "common.h"

#define MIN_ELEMENTS_PER_THREAD (1 << 14)
#define EXP_FLOOR -87.33f /* e^x below it is under float32's smallest normal: 0 */

/* e^x for x <= 0. Cody-Waite reduction, x = n ln2 + r with |r| <= ln2 / 2: ln2's high
 * part has 16 significant bits, so n * LN2_HI and x - n * LN2_HI are exact (common.h's
 * exp2 of x * log2(e) would lose the rounding of that product, ~30 ulps at |x| = 28);
 * e^r by its Taylor series to r^7 (error < 6e-9), times 2^n built in the exponent. */
ALWAYS_INLINE v8f exp_neg(v8f x) {
    const v8f LN2_HI = v8_splat(0.693145751953125f), LN2_LO = v8_splat(1.428606765330187e-6f);
    v8i underflow = x < v8_splat(EXP_FLOOR);
    x = v8_max(x, v8_splat(EXP_FLOOR));
    v8f t = x * v8_splat(LOG2_E) + v8_splat(0.5f);
    v8i n = __builtin_convertvector(t, v8i); /* truncates toward zero */
    n += (__builtin_convertvector(n, v8f) > t); /* -1 where truncation rounded up: floor */
    v8f nf = __builtin_convertvector(n, v8f);
    v8f r = (x - nf * LN2_HI) - nf * LN2_LO;
    v8f p = v8_splat(1.0f / 5040.0f);
    p = v8_fma(p, r, v8_splat(1.0f / 720.0f));
    p = v8_fma(p, r, v8_splat(1.0f / 120.0f));
    p = v8_fma(p, r, v8_splat(1.0f / 24.0f));
    p = v8_fma(p, r, v8_splat(1.0f / 6.0f));
    p = v8_fma(p, r, v8_splat(0.5f));
    p = v8_fma(p, r, v8_splat(1.0f));
    p = v8_fma(p, r, v8_splat(1.0f));
    v8i bits = (n + 127) << 23;
    return (v8f)(((v8i)(p * (v8f)bits)) & ~underflow);
}

ALWAYS_INLINE v8f silu_times(v8f g, v8f u) {
    const v8f one = v8_splat(1.0f);
    v8f t = exp_neg(-v8_max(g, -g));
    v8f below = one / (one + t);
    v8f sigmoid = v8_select(g >= v8_splat(0.0f), below, t * below);
    return (g * sigmoid) * u;
}

typedef struct {
    int64_t x, x_rs, out, o_rs;
    int64_t rows, n, num_threads;
    int64_t bad;
} pd_silu_call;

int64_t pd_silu_call_size(void) { return sizeof(pd_silu_call); }

static void silu_row(const pd_silu_call *c, int64_t r) {
    const float *g = (const float *)PTR(c->x) + r * c->x_rs, *u = g + c->n;
    float *out = (float *)PTR(c->out) + r * c->o_rs;
    const int64_t n = c->n, full = n / 8 * 8;
    for (int64_t i = 0; i < full; i += 8) v8_store(out + i, silu_times(v8_load(g + i), v8_load(u + i)));
    if (full < n) {
        float gt[8] = {0}, ut[8] = {0}, ot[8];
        memcpy(gt, g + full, (size_t)(n - full) * sizeof(float));
        memcpy(ut, u + full, (size_t)(n - full) * sizeof(float));
        v8_store(ot, silu_times(v8_load(gt), v8_load(ut)));
        memcpy(out + full, ot, (size_t)(n - full) * sizeof(float));
    }
}

int pd_silu_and_mul(pd_silu_call *c) {
    int threads = threads_for((int)c->num_threads, c->rows * c->n, MIN_ELEMENTS_PER_THREAD);
    if (threads == 1) {
        for (int64_t r = 0; r < c->rows; r++) silu_row(c, r);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t r = 0; r < c->rows; r++) silu_row(c, r);
    }
    return PD_OK;
}
