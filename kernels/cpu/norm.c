/* RMSNorm of float32 rows, with the residual added first when given, as
 * `rms_norm_ref` computes it, bit for bit:
 *   s = x + residual;  var = sum(s * s) / n + eps;  out = weight * (s * (1 / sqrt(var)))
 * each operation rounded to float32 on its own (the build forbids contraction).
 *
 * The sum of squares adds in the order of torch's CPU sum over a contiguous row
 * (aten/src/ATen/native/cpu/SumKernel.cpp: `vectorized_inner_sum`): 8-lane vectors
 * (torch's x86 sum kernel is its AVX2 one, also on AVX-512 machines), four interleaved
 * accumulators cascaded in four levels (`multi_row_sum`), the accumulators folded, the
 * scalar tail, then the lanes left to right. So a float32 model's outputs are the
 * reference's; tests/kernels/test_cpu_norm.py pins the equality on rows of every kind
 * of length. Rows need at least 8 elements (shorter ones take torch's scalar path) and
 * fewer than 32768 (torch splits longer ones across threads): the caller checks.
 * Every row's output depends on that row alone.
 */
#include "common.h"

#define ILP 4
#define LEVELS 4
#define MIN_ELEMENTS_PER_THREAD (1 << 15)

typedef struct {
    const float *x, *residual, *weight;
    float *out, *residual_out;
    int64_t x_rs, r_rs, o_rs, ro_rs;
    int64_t n;
    float eps;
} norm_args;

static int ceil_log2(int64_t v) {
    int bits = 0;
    while (((int64_t)1 << bits) < v) bits++;
    return bits;
}

ALWAYS_INLINE v8f square_at(const float *s, int64_t vec) {
    v8f v = v8_load(s + vec * 8);
    return v * v;
}

/* sum(s[i]^2) for i < n, in torch's order (see above). */
static float sum_squares(const float *s, int64_t n) {
    const int64_t vecs = n / 8, size = vecs / ILP;
    int level_power = ceil_log2(size) / LEVELS;
    if (level_power < 4) level_power = 4;
    const int64_t step = (int64_t)1 << level_power, mask = step - 1;
    v8f acc[LEVELS][ILP];
    for (int j = 0; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++) acc[j][k] = v8_splat(0.0f);
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < ILP; k++) acc[0][k] += square_at(s, i * ILP + k);
        for (int j = 1; j < LEVELS; j++) {
            for (int k = 0; k < ILP; k++) {
                acc[j][k] += acc[j - 1][k];
                acc[j - 1][k] = v8_splat(0.0f);
            }
            if (i & (mask << (j * level_power))) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < ILP; k++) acc[0][k] += square_at(s, i * ILP + k);
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++) acc[0][k] += acc[j][k];
    for (int64_t v = size * ILP; v < vecs; v++) acc[0][0] += square_at(s, v);
    for (int k = 1; k < ILP; k++) acc[0][0] += acc[0][k];
    float total = 0.0f;
    for (int64_t e = vecs * 8; e < n; e++) total += s[e] * s[e];
    for (int lane = 0; lane < 8; lane++) total += acc[0][0][lane];
    return total;
}

static void norm_row(const norm_args *A, int64_t row) {
    const int64_t n = A->n;
    const float *s = A->x + row * A->x_rs;
    if (A->residual) {
        const float *r = A->residual + row * A->r_rs;
        float *sum = A->residual_out + row * A->ro_rs;
        for (int64_t i = 0; i < n; i++) sum[i] = s[i] + r[i];
        s = sum;
    }
    float var = sum_squares(s, n) / (float)n + A->eps;
    float inv = 1.0f / sqrtf(var);
    float *out = A->out + row * A->o_rs;
    for (int64_t i = 0; i < n; i++) out[i] = A->weight[i] * (s[i] * inv);
}

/* The call's arguments as one struct of 8-byte fields (kernels/cpu_ops.py packs it). */
typedef struct {
    int64_t x, x_rs, residual, r_rs, weight, out, o_rs, residual_out, ro_rs;
    int64_t rows, n, num_threads;
    double eps;
    int64_t bad;
} pd_norm_call;

int64_t pd_norm_call_size(void) { return sizeof(pd_norm_call); }

int pd_rms_norm(pd_norm_call *c) {
    norm_args A = {PTR(c->x),  PTR(c->residual), PTR(c->weight), PTR(c->out),
                   PTR(c->residual_out), c->x_rs, c->r_rs, c->o_rs, c->ro_rs, c->n,
                   (float)c->eps};
    int threads = threads_for((int)c->num_threads, c->rows * c->n, MIN_ELEMENTS_PER_THREAD);
    if (threads == 1) {
        for (int64_t r = 0; r < c->rows; r++) norm_row(&A, r);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t r = 0; r < c->rows; r++) norm_row(&A, r);
    }
    return PD_OK;
}
