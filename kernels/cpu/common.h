/* Shared helpers of the CPU paged-attention kernels: dtype conversion, 8-lane float
 * vectors, a vector exp2, index loads and argument checks.
 *
 * Vectors are GCC vector extensions (8 x fp32): with -march=native on an AVX2 machine
 * they are ymm registers, elsewhere the compiler lowers them to SSE pairs or scalars,
 * so one source serves every x86-64 (and any other GCC target). Intrinsics appear only
 * where the generic form compiles badly (widening bf16 / fp16 loads, horizontal sums)
 * and are guarded by the ISA macros the compiler defines.
 *
 * bf16 -> fp32 is a 16-bit shift; fp32 -> bf16/fp16 rounds to nearest even, as torch
 * does. Every stride is in elements; the innermost (head_dim) stride of the KV cache
 * is 1 (the layout contract), other tensors carry all their strides.
 */
#ifndef PDSERVE_CPU_COMMON_H
#define PDSERVE_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define PTR(x) ((void *)(intptr_t)(x))
#define LOG2_E 1.4426950408889634f

/* The FP8 codes are KV-cache dtypes only (the kernels' caches, never their inputs). */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_E4M3 = 3, DT_E5M2 = 4 };
enum { IX_I32 = 0, IX_I64 = 1 };

/* Error codes; the offending index goes to *bad. */
enum {
    PD_OK = 0,
    PD_BAD_SLOT = -1,        /* write: slot's block past the cache */
    PD_BAD_CONTEXT_LEN = -2, /* context_len < 0 or past the block table's capacity */
    PD_BAD_BLOCK_ID = -3,    /* a used block-table entry outside [0, num_blocks) */
    PD_BAD_QUERY_START = -4, /* query_start_loc decreasing, or past the query rows */
    PD_QUERY_LONGER_THAN_CONTEXT = -5,
    PD_NO_MEMORY = -6,
    PD_BAD_POSITION = -7,    /* rotary: a position outside the cos/sin table */
    PD_BAD_HEAD_DIM = -8,    /* rotary: an odd head_dim, or one past its buffers */
    PD_UNSUPPORTED = -9,     /* a path this build or CPU does not have */
    PD_BAD_INT8_GROUPS = -10, /* int8 linear: groups that do not split K in whole vectors */
    PD_BAD_ROW_ID = -11,      /* GGUF rows: an id outside the matrix's rows */
};

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

/* A 3-D tensor as a call's struct passes it (kernels/cpu_ops.py packs the five fields in
 * this order), and as the kernels read it: data, dtype code, element strides. */
typedef struct {
    int64_t data, dt, s0, s1, s2;
} pd_tensor3;

typedef struct {
    void *data;
    int dt;
    int64_t s0, s1, s2;
} tensor3;

static inline tensor3 tensor3_of(const pd_tensor3 *t) {
    return (tensor3){PTR(t->data), (int)t->dt, t->s0, t->s1, t->s2};
}

static inline size_t dtype_size(int dt) { return dt == DT_F32 ? 4 : dt >= DT_E4M3 ? 1 : 2; }

static inline int64_t load_index(const void *base, int ix, int64_t i) {
    return ix == IX_I64 ? ((const int64_t *)base)[i] : (int64_t)((const int32_t *)base)[i];
}

/* ---- scalar conversions ---- */

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN stays a quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline uint16_t float_to_f16(float f) {
#ifdef __F16C__
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#elif defined(__FLT16_MANT_DIG__)
    _Float16 h = (_Float16)f;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
#else
    /* Round to nearest even through the float's bits. */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* overflows to inf */
    if (a < 0x38800000u) {                                  /* subnormal or zero */
        float mag;
        memcpy(&mag, &a, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(mag * 16777216.0f));
    }
    a += 0xfffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | ((a - 0x38000000u) >> 13));
#endif
}


/* ---- FP8 (KV cache) ----
 * An FP8 byte widens through float16 bits: e5m2 is float16's top byte as it stands, and
 * e4m3 (bias 7) moved into float16's fields (bias 15) reads 2^-8 of its value, subnormals
 * included. So every FP8 read is one float16 conversion; the attention kernels fold the
 * 2^8 (`fp8_read_scale`) into the per-tensor scale they already apply. */
static inline uint16_t fp8_as_f16_bits(uint8_t b, int dt) {
    if (dt == DT_E5M2) return (uint16_t)((uint16_t)b << 8);
    return (uint16_t)(((uint16_t)(b & 0x80u) << 8) | ((uint16_t)(b & 0x7fu) << 7));
}

/* What an FP8 read through fp8_as_f16_bits must be multiplied by. */
static inline float fp8_read_scale(int dt) { return dt == DT_E4M3 ? 256.0f : 1.0f; }

/* x rounded to nearest even into e4m3fn / e5m2, saturating at the largest finite value
 * (448 / 57344; infinities too); NaN stays NaN. */
static inline uint8_t float_to_fp8(float x, int dt) {
    const int man = dt == DT_E4M3 ? 3 : 2, bias = dt == DT_E4M3 ? 7 : 15;
    const float largest = dt == DT_E4M3 ? 448.0f : 57344.0f;
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if (x != x) return sign | 0x7fu;
    float a = fabsf(x);
    if (a > largest) a = largest;
    if (a < ldexpf(1.0f, 1 - bias)) /* subnormal: whole steps of 2^(1 - bias - man) */
        return sign | (uint8_t)lrintf(a * ldexpf(1.0f, bias - 1 + man));
    memcpy(&u, &a, 4);
    u += (1u << (22 - man)) - 1u + ((u >> (23 - man)) & 1u);
    u >>= 23 - man;
    return sign | (uint8_t)(u - ((uint32_t)(127 - bias) << man));
}

/* An FP8 cache element as its float16-bits reading (2^-8 of the value for e4m3). */
static inline float fp8_to_float_raw(uint8_t b, int dt) { return f16_to_float(fp8_as_f16_bits(b, dt)); }

/* An FP8 element reads as fp8_to_float_raw (the caller applies fp8_read_scale); storing
 * into FP8 is `store_kv_row`'s, with its scale. */
static inline float load_scalar(const void *base, int dt, int64_t i) {
    if (dt == DT_F32) return ((const float *)base)[i];
    if (dt >= DT_E4M3) return fp8_to_float_raw(((const uint8_t *)base)[i], dt);
    if (dt == DT_BF16) return bf16_to_float(((const uint16_t *)base)[i]);
    return f16_to_float(((const uint16_t *)base)[i]);
}

static inline void store_scalar(void *base, int dt, int64_t i, float v) {
    if (dt == DT_F32)
        ((float *)base)[i] = v;
    else if (dt == DT_BF16)
        ((uint16_t *)base)[i] = float_to_bf16(v);
    else
        ((uint16_t *)base)[i] = float_to_f16(v);
}

/* n elements at base[off + k*stride] -> dst[k] * mul; dst zero-padded up to padded. */
static inline void load_row(const void *base, int dt, int64_t off, int64_t stride, int n,
                            int padded, float mul, float *dst) {
    int k = 0;
    for (; k < n; k++) dst[k] = load_scalar(base, dt, off + k * stride) * mul;
    for (; k < padded; k++) dst[k] = 0.0f;
}

static inline void store_row(void *base, int dt, int64_t off, int64_t stride, int n,
                             const float *src, float mul) {
    for (int k = 0; k < n; k++) store_scalar(base, dt, off + k * stride, src[k] * mul);
}

/* ---- 8-lane vectors ---- */

ALWAYS_INLINE v8f v8_load(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

ALWAYS_INLINE void v8_store(float *p, v8f v) { memcpy(p, &v, sizeof v); }

ALWAYS_INLINE v8f v8_splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* a * b + c, fused where the CPU has FMA. The kernels build with -ffp-contract=off, so
 * this is the only fused multiply-add: the compiler would otherwise fuse some a * b + c
 * and not others depending on the surrounding code (a tile shape, an inlined caller),
 * and the same token's output would then depend on the shape of the call. */
ALWAYS_INLINE v8f v8_fma(v8f a, v8f b, v8f c) {
#ifdef __FMA__
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

ALWAYS_INLINE v8f v8_load_bf16(const uint16_t *p) {
#ifdef __AVX2__
    __m128i x = _mm_loadu_si128((const __m128i *)p);
    return (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
#else
    v8u16 x;
    memcpy(&x, p, sizeof x);
    return (v8f)(__builtin_convertvector(x, v8u32) << 16);
#endif
}

ALWAYS_INLINE v8f v8_load_f16(const uint16_t *p) {
#ifdef __F16C__
    return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    v8f r;
    for (int k = 0; k < 8; k++) r[k] = f16_to_float(p[k]);
    return r;
#endif
}

/* Eight FP8 bytes as their float16-bits reading (see fp8_as_f16_bits). */
ALWAYS_INLINE v8f v8_load_fp8(const uint8_t *p, const int dt) {
#if defined(__AVX2__) && defined(__F16C__)
    __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i h;
    if (dt == DT_E5M2) {
        h = _mm_slli_epi16(w, 8);
    } else {
        __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
        h = _mm_or_si128(sign, _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
    }
    return (v8f)_mm256_cvtph_ps(h);
#else
    v8f r;
    for (int k = 0; k < 8; k++) r[k] = fp8_to_float_raw(p[k], dt);
    return r;
#endif
}

/* Eight elements of a cache row in fp32 (FP8: their raw reading, see load_scalar); dt
 * is a compile-time constant at every use. */
ALWAYS_INLINE v8f v8_load_as(const void *base, int dt, int64_t i) {
    if (dt == DT_F32) return v8_load((const float *)base + i);
    if (dt >= DT_E4M3) return v8_load_fp8((const uint8_t *)base + i, dt);
    if (dt == DT_BF16) return v8_load_bf16((const uint16_t *)base + i);
    return v8_load_f16((const uint16_t *)base + i);
}

#ifdef __AVX__
/* Lane-wise sum or max of two 4-lane vectors, or of lane 0 only (`low`); `max` and
 * `low` are compile-time constants. */
ALWAYS_INLINE __m128 v4_combine(__m128 a, __m128 b, const int max, const int low) {
    if (low) return max ? _mm_max_ss(a, b) : _mm_add_ss(a, b);
    return max ? _mm_max_ps(a, b) : _mm_add_ps(a, b);
}

/* The 8 lanes of v folded into lane 0 by halves (sum or max, see v4_combine). */
ALWAYS_INLINE float v8_fold(v8f v, const int max) {
    __m128 x = v4_combine(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1),
                          max, 0);
    x = v4_combine(x, _mm_movehl_ps(x, x), max, 0);
    x = v4_combine(x, _mm_movehdup_ps(x), max, 1);
    return _mm_cvtss_f32(x);
}
#endif

ALWAYS_INLINE float v8_hsum(v8f v) {
#ifdef __AVX__
    return v8_fold(v, 0);
#else
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
#endif
}

/* Transpose 8 rows of 8 floats in place (rows[i][j] -> rows[j][i]). */
ALWAYS_INLINE void v8_transpose8(v8f *r) {
#ifdef __AVX__
    __m256 t0 = _mm256_unpacklo_ps((__m256)r[0], (__m256)r[1]);
    __m256 t1 = _mm256_unpackhi_ps((__m256)r[0], (__m256)r[1]);
    __m256 t2 = _mm256_unpacklo_ps((__m256)r[2], (__m256)r[3]);
    __m256 t3 = _mm256_unpackhi_ps((__m256)r[2], (__m256)r[3]);
    __m256 t4 = _mm256_unpacklo_ps((__m256)r[4], (__m256)r[5]);
    __m256 t5 = _mm256_unpackhi_ps((__m256)r[4], (__m256)r[5]);
    __m256 t6 = _mm256_unpacklo_ps((__m256)r[6], (__m256)r[7]);
    __m256 t7 = _mm256_unpackhi_ps((__m256)r[6], (__m256)r[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = (v8f)_mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = (v8f)_mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = (v8f)_mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = (v8f)_mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = (v8f)_mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = (v8f)_mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = (v8f)_mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = (v8f)_mm256_permute2f128_ps(u3, u7, 0x31);
#else
    for (int i = 0; i < 8; i++)
        for (int j = i + 1; j < 8; j++) {
            float x = r[i][j];
            r[i][j] = r[j][i];
            r[j][i] = x;
        }
#endif
}

/* Lane-wise mask ? a : b (C has no vector conditional). */
ALWAYS_INLINE v8f v8_select(v8i mask, v8f a, v8f b) {
    return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask));
}

/* The horizontal sums of v[0..8) as one vector: {sum(v[0]), ..., sum(v[7])}. */
ALWAYS_INLINE v8f v8_sum8(const v8f *v) {
#ifdef __AVX__
    __m256 h01 = _mm256_hadd_ps((__m256)v[0], (__m256)v[1]);
    __m256 h23 = _mm256_hadd_ps((__m256)v[2], (__m256)v[3]);
    __m256 h45 = _mm256_hadd_ps((__m256)v[4], (__m256)v[5]);
    __m256 h67 = _mm256_hadd_ps((__m256)v[6], (__m256)v[7]);
    __m256 lo4 = _mm256_hadd_ps(h01, h23); /* sums of 0-3: low halves | high halves */
    __m256 hi4 = _mm256_hadd_ps(h45, h67);
    return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(lo4, hi4, 0x20),
                              _mm256_permute2f128_ps(lo4, hi4, 0x31));
#else
    v8f r;
    for (int k = 0; k < 8; k++) r[k] = v8_hsum(v[k]);
    return r;
#endif
}

ALWAYS_INLINE v8f v8_max(v8f a, v8f b) {
#ifdef __AVX__
    return (v8f)_mm256_max_ps((__m256)a, (__m256)b);
#else
    return v8_select(a > b, a, b);
#endif
}

ALWAYS_INLINE v8f v8_min(v8f a, v8f b) {
#ifdef __AVX__
    return (v8f)_mm256_min_ps((__m256)a, (__m256)b);
#else
    return v8_select(a < b, a, b);
#endif
}

ALWAYS_INLINE float v8_hmax(v8f v) {
#ifdef __AVX__
    return v8_fold(v, 1);
#else
    float m = v[0];
    for (int k = 1; k < 8; k++) m = v[k] > m ? v[k] : m;
    return m;
#endif
}

/* 2^x for x <= 0 (softmax arguments); exactly 0 below -126, so -inf gives 0.
 * 2^x = 2^n * 2^f with n = round(x), |f| <= 1/2, and 2^f a degree-6 Taylor series
 * of e^(f ln 2): relative error < 2e-7. */
ALWAYS_INLINE v8f v8_exp2(v8f x) {
    const v8f lo = v8_splat(-126.0f);
    v8i underflow = x < lo;
    x = v8_min(v8_max(x, lo), v8_splat(0.0f));
    v8f t = x + v8_splat(0.5f);
    v8i n = __builtin_convertvector(t, v8i); /* truncates toward zero */
    n += (__builtin_convertvector(n, v8f) > t); /* -1 where truncation rounded up: floor */
    v8f f = x - __builtin_convertvector(n, v8f);
    v8f p = v8_splat(1.5403530393381606e-4f);
    p = v8_fma(p, f, v8_splat(1.3333558146428443e-3f));
    p = v8_fma(p, f, v8_splat(9.6181291076284772e-3f));
    p = v8_fma(p, f, v8_splat(5.5504108664821580e-2f));
    p = v8_fma(p, f, v8_splat(2.4022650695910072e-1f));
    p = v8_fma(p, f, v8_splat(6.9314718055994531e-1f));
    p = v8_fma(p, f, v8_splat(1.0f));
    v8i bits = (n + 127) << 23;
    return (v8f)(((v8i)(p * (v8f)bits)) & ~underflow);
}

/* Ask for rows [0, rows) of a cache slab (row stride in bytes) to be brought into
 * cache: the paged layout defeats the hardware prefetcher at every block boundary. */
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 3
#endif
ALWAYS_INLINE void prefetch_rows(const char *base, int rows, int64_t row_bytes, int bytes) {
    if (row_bytes == bytes) { /* one contiguous slab */
        const int total = rows * bytes;
        int off = 0;
        for (; off + 256 <= total; off += 256) {
            __builtin_prefetch(base + off, 0, PREFETCH_LOCALITY);
            __builtin_prefetch(base + off + 64, 0, PREFETCH_LOCALITY);
            __builtin_prefetch(base + off + 128, 0, PREFETCH_LOCALITY);
            __builtin_prefetch(base + off + 192, 0, PREFETCH_LOCALITY);
        }
        for (; off < total; off += 64) __builtin_prefetch(base + off, 0, PREFETCH_LOCALITY);
        return;
    }
    for (int t = 0; t < rows; t++)
        for (int off = 0; off < bytes; off += 64)
            __builtin_prefetch(base + t * row_bytes + off, 0, PREFETCH_LOCALITY);
}

/* The paged KV cache a kernel writes this step's keys and values into: one layer's
 * [num_blocks, 2, num_kv_heads, block_size, head_dim] through its strides (in elements),
 * and each token's slot, block * block_size + offset (negative: padding, not written). */
typedef struct {
    void *base;
    int dt;
    int64_t sb, skv, sh, st;
    int block_size;
    const void *slots;
    int slot_ix;
    int64_t slot_stride;
    float k_scale, v_scale; /* FP8 caches: stored = fp8(x / scale); 1 for the others */
} kv_slots;

static inline int64_t kv_slot(const kv_slots *C, int64_t token) {
    return load_index(C->slots, C->slot_ix, token * C->slot_stride);
}

/* A slot whose block lies past the cache's last one. */
static inline int kv_slot_outside(const kv_slots *C, int64_t slot, int64_t num_blocks) {
    return slot >= 0 && slot / C->block_size >= num_blocks;
}

/* Element offset of kv head h's key row at `slot`; its value row lies C->skv further. */
static inline int64_t kv_key_row(const kv_slots *C, int64_t slot, int h) {
    return (slot / C->block_size) * C->sb + (slot % C->block_size) * C->st + h * C->sh;
}

/* src [n] float32 into a cache row at element off (contiguous), in the cache's dtype;
 * into FP8 as fp8(x / scale). */
static inline void store_kv_row(const kv_slots *C, int64_t off, int n, const float *src,
                                float scale) {
    if (C->dt >= DT_E4M3) {
        uint8_t *p = (uint8_t *)C->base + off;
        for (int i = 0; i < n; i++) p[i] = float_to_fp8(src[i] / scale, C->dt);
    } else {
        for (int i = 0; i < n; i++) store_scalar(C->base, C->dt, off + i, src[i]);
    }
}

/* Work items handed out in order from a shared counter: dynamic scheduling without
 * the OpenMP loop machinery, and no OpenMP call at all on one thread, since a step
 * makes ~90 kernel calls and the small ones must cost microseconds. */
typedef struct {
    int64_t next, end;
} work_queue;

static inline int64_t take_item(work_queue *q) {
    return __atomic_fetch_add(&q->next, 1, __ATOMIC_RELAXED);
}

/* How many threads a call may use: the caller's share, and 1 for tiny work. */
static inline int threads_for(int requested, int64_t work, int64_t min_work_per_thread) {
    if (requested < 1) requested = 1;
    int64_t useful = work / (min_work_per_thread > 0 ? min_work_per_thread : 1);
    if (useful < requested) requested = useful < 1 ? 1 : (int)useful;
    return requested;
}

/* Records the index of a bad input for the caller and returns the error code. */
static inline int fail_at(int64_t *bad, int64_t index, int code) {
    *bad = index;
    return code;
}

/* Runs worker(job) on `threads` threads: in this one for a single thread, else as one
 * OpenMP team (a worker may use `omp barrier`). */
static inline void run_workers(void (*worker)(void *job), void *job, int threads) {
    if (threads == 1) {
        worker(job);
    } else {
#pragma omp parallel num_threads(threads)
        worker(job);
    }
}

#endif
