/* What the CPU kernels of paged_decode.c (decode, cache write, argmax) and paged_prefill.c (prefill) share: dtype
 * conversions, e^x, row loads and the 16-lane vector helpers. Two units so that a first start compiles them at once
 * (native.build_shared). */
#ifndef PAGEDATTN_PAGED_COMMON_H
#define PAGEDATTN_PAGED_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pagedattn_abi.h"

/* float16 rows widened 16 elements at a time by AVX-512's vcvtph2ps where the target has it: GCC widens a _Float16
 * vector lane by lane without AVX512-FP16 (decodes over a float16 cache took ~4x a bfloat16 one's time) */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
/* bfloat16 scores by AVX512-BF16's pair dot products (exact bfloat16 products, float sums; bfloat16 subnormals,
 * below 1.2e-38, count as zero) where the target has them; PAGEDATTN_NO_DPBF16 keeps the widening path */
#if defined(__AVX512BF16__) && !defined(PAGEDATTN_NO_DPBF16)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#define MAX_HEAD PAGEDATTN_MAX_HEAD   /* head size bound */
#define MAX_GROUP PAGEDATTN_MAX_GROUP /* query heads per KV head */

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16_t f32_to_bf16(float f) {  /* round to nearest even, NaN kept a NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

/* e^x = 2^n * e^r with n = round(x log2 e): r from x and n (ln 2 in two parts), then e^r by its polynomial. The
 * same steps for a float and for 16 lanes (exp_neg, vexp_neg); p starts at EXP_P5. */
#define EXP_P5 1.9875691500e-4f
#define EXP_POLY(x, n, r, p)                 \
    do {                                     \
        r = x - n * 0.693359375f;            \
        r = r - n * -2.12194440e-4f;         \
        p = p * r + 1.3981999507e-3f;        \
        p = p * r + 8.3334519073e-3f;        \
        p = p * r + 4.1665795894e-2f;        \
        p = p * r + 1.6666665459e-1f;        \
        p = p * r + 5.0000001201e-1f;        \
        p = p * r * r + r + 1.0f;            \
    } while (0)

/* e^x for x <= 0 (a score minus a running maximum), vectorisable: 2^n * p(r), |rel. error| < 2e-7.
 * Arguments below -87 give a tiny positive number where e^x would be ~0: always multiplied into sums
 * that it cannot change at float precision. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r, p = EXP_P5;
    EXP_POLY(x, n, r, p);
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}


/* n rows of D elements (row stride in elements) into float dst [n][D] */
static inline __attribute__((always_inline)) void load_rows(float *restrict dst, const char *const *src, int n,
                                                            const int D, int dtype) {
    if (dtype == 0) {
        for (int t = 0; t < n; t++) memcpy(dst + t * D, src[t], sizeof(float) * D);
    } else if (dtype == 1) {
        for (int t = 0; t < n; t++) {
            const bf16_t *r = (const bf16_t *)src[t];
#pragma omp simd
            for (int d = 0; d < D; d++) dst[t * D + d] = bf16_to_f32(r[d]);
        }
    } else {
        for (int t = 0; t < n; t++) {
            const _Float16 *r = (const _Float16 *)src[t];
            int d = 0;
#if defined(__AVX512F__)
            for (; d + 16 <= D; d += 16)
                _mm512_storeu_ps(dst + t * D + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + d))));
#endif
            for (; d < D; d++) dst[t * D + d] = (float)r[d];
        }
    }
}
/* ---- the vector path: head sizes that are multiples of 16, tiles of 16 keys (GCC/Clang vector extensions: the
 * compiler maps 16-float vectors to whatever the target has, one AVX-512 register or several narrower ones) */
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
#define VL 16
#define VEC_MAX_NV 16  /* the vector path's head sizes are at most 256 */

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* Lane masks (all ones where true) of comparisons. GCC compares 16-float vectors lane by lane in scalar code where the
 * target has no AVX-512 (a row's argmax took ~30x its time on a Zen 3 EPYC), so with AVX2 but not AVX-512 each
 * compares the two 8-lane halves by AVX2's own instructions; elsewhere the vector operators. */
#if PAGEDATTN_AVX2_PATHS
#include <immintrin.h>
#define VCMP_HALVES(a, b, OP)                                                       \
    do {                                                                            \
        __typeof__(a) a_ = (a), b_ = (b);                                           \
        __m256i lo_, hi_;                                                           \
        OP(lo_, 0);                                                                 \
        OP(hi_, 1);                                                                 \
        vi r_;                                                                      \
        memcpy(&r_, &lo_, 32);                                                      \
        memcpy((char *)&r_ + 32, &hi_, 32);                                         \
        return r_;                                                                  \
    } while (0)
#define VCMP_PS(dst, half, PRED)                                                    \
    do {                                                                            \
        __m256 x_, y_;                                                              \
        memcpy(&x_, (const char *)&a_ + 32 * (half), 32);                           \
        memcpy(&y_, (const char *)&b_ + 32 * (half), 32);                           \
        dst = _mm256_castps_si256(_mm256_cmp_ps(x_, y_, PRED));                     \
    } while (0)
#define VCMP_GT(dst, half) VCMP_PS(dst, half, _CMP_GT_OQ)
#define VCMP_NE(dst, half) VCMP_PS(dst, half, _CMP_NEQ_UQ)
#define VCMP_ILT(dst, half)                                                         \
    do {                                                                            \
        __m256i x_, y_;                                                             \
        memcpy(&x_, (const char *)&a_ + 32 * (half), 32);                           \
        memcpy(&y_, (const char *)&b_ + 32 * (half), 32);                           \
        dst = _mm256_cmpgt_epi32(y_, x_);                                           \
    } while (0)
static inline vi vgt(vf a, vf b) { VCMP_HALVES(a, b, VCMP_GT); }        /* a > b: false where either is NaN */
static inline vi vne(vf a, vf b) { VCMP_HALVES(a, b, VCMP_NE); }        /* a != b: true where either is NaN */
static inline vi vilt(vi a, vi b) { VCMP_HALVES(a, b, VCMP_ILT); }      /* a < b */
#else
static inline vi vgt(vf a, vf b) { return a > b; }
static inline vi vne(vf a, vf b) { return a != b; }
static inline vi vilt(vi a, vi b) { return a < b; }
#endif

/* x in every lane: one broadcast (`(vf){} + x` also adds the zeros, and `v * 0.0f + x` multiplies: neither may be
 * folded away, as -0.0 and infinities behave differently) */
static inline vf vsplat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

#if PAGEDATTN_AVX2_PATHS
/* hsum16 by AVX2's 8-lane instructions (GCC's code for the 16-lane shuffles below ran to ~430 instructions there):
 * each vector's halves added, then pairwise sums (vhaddps) of 8 keys at a time. Another order of the same sums than
 * the AVX-512 build's */
static inline __m256 hsum8_keys(const vf *x) {
    __m256 s[8];
    for (int t = 0; t < 8; t++) {
        __m256 lo, hi;
        memcpy(&lo, &x[t], 32);
        memcpy(&hi, (const char *)&x[t] + 32, 32);
        s[t] = _mm256_add_ps(lo, hi);
    }
    /* b0: keys 0-3's sums of lanes 0-3, then of lanes 4-7; b1: keys 4-7's */
    const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
    const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

static inline vf hsum16(const vf *x) {
    const __m256 lo = hsum8_keys(x), hi = hsum8_keys(x + 8);
    vf r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
}
#else
/* lane t of the result: the sum of x[t]'s lanes (16 dot products finished at once). Four rounds of pairings, each
 * halving the vectors: the first two within 128-bit quarters (unpacks, then 64-bit pairs), the last two across
 * quarters, so that lane t ends with key t's sum (in-lane shuffles for 24 of the 30 in place of two-source permutes:
 * a bf16 decode ~7 % faster on a Zen 4 EPYC) */
static inline vf hsum16(const vf *x) {
    const vi lo = {0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29};   /* unpacklo */
    const vi hi = {2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31}; /* unpackhi */
    const vi q01 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};  /* 64-bit halves, low */
    const vi q23 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}; /* and high */
    const vi even = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};  /* quarters 0, 2 of a, of b */
    const vi odd = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}; /* quarters 1, 3 */
    vf r8[8], r4[4], r2[2];
    /* r8[i], per quarter: (x[2i], x[2i + 1], x[2i], x[2i + 1]) partial sums */
    for (int i = 0; i < 8; i++)
        r8[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo) + __builtin_shuffle(x[2 * i], x[2 * i + 1], hi);
    /* r4[i], per quarter: keys 4i .. 4i + 3 */
    for (int i = 0; i < 4; i++)
        r4[i] = __builtin_shuffle(r8[2 * i], r8[2 * i + 1], q01) + __builtin_shuffle(r8[2 * i], r8[2 * i + 1], q23);
    /* r2[i]: keys 8i .. 8i + 3 (quarters 0 + 1, 2 + 3), then 8i + 4 .. 8i + 7 likewise */
    for (int i = 0; i < 2; i++)
        r2[i] = __builtin_shuffle(r4[2 * i], r4[2 * i + 1], even) + __builtin_shuffle(r4[2 * i], r4[2 * i + 1], odd);
    return __builtin_shuffle(r2[0], r2[1], even) + __builtin_shuffle(r2[0], r2[1], odd);
}
#endif

/* exp_neg on 16 lanes (rounding by adding and removing 1.5 * 2^23: exact for |x * log2 e| < 2^22) */
static inline vf vexp_neg(vf x) {
    const vf lowest = vsplat(-87.0f);
    x = vselect(vgt(lowest, x), lowest, x);
    const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    vf r, p = vsplat(EXP_P5);
    EXP_POLY(x, n, r, p);
    const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)e;
}

/* 16 elements of a row of the cache's dtype DT (0 float32, 1 bfloat16, 2 float16) as floats: converted in registers */
typedef uint16_t vu16 __attribute__((vector_size(32)));
typedef _Float16 vh16 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) vf vload_as_float(const char *p, const int DT) {
    if (DT == 0) return vload((const float *)p);
    if (DT == 1) {
        vu16 u;
        memcpy(&u, p, sizeof u);
        return (vf)(__builtin_convertvector(u, vi) << 16);
    }
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#else
    vh16 h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vf);
#endif
}

/* x's lanes rounded to bfloat16's precision (to nearest even), kept as floats; for the weights of a softmax: finite
 * and not negative */
static inline vf round_bf16(vf x) {
    const vi u = (vi)x;
    return (vf)((u + 0x7fff + ((u >> 16) & 1)) & (int32_t)0xffff0000u);
}

/* the maximum and the sum of a vector's 16 lanes (a tree of halvings, no lane-by-lane loop) */
static const vi HALVES[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                             {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                             {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                             {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};

#if PAGEDATTN_AVX2_PATHS
/* the same halvings by AVX2's instructions (vmaxps takes its second operand where the first is not greater, NaN
 * included, as vselect(x > y, x, y)): the same results */
/* x's 16 lanes folded by halvings into one: summed (add) or their maximum */
static inline float fold16(vf x, const int add) {
    __m256 lo, hi;
    memcpy(&lo, &x, 32);
    memcpy(&hi, (const char *)&x + 32, 32);
    __m256 v = add ? _mm256_add_ps(lo, hi) : _mm256_max_ps(lo, hi);
    for (int i = 0; i < 3; i++) {
        const __m256 y = i == 0 ? _mm256_permute2f128_ps(v, v, 0x01) : i == 1 ? _mm256_permute_ps(v, 0x4e)
                                                                              : _mm256_permute_ps(v, 0xb1);
        v = add ? _mm256_add_ps(v, y) : _mm256_max_ps(v, y);
    }
    return _mm256_cvtss_f32(v);
}

static inline float hmax16(vf x) { return fold16(x, 0); }

static inline float hadd16(vf x) { return fold16(x, 1); }
#else
static inline float hmax16(vf x) {
    for (int i = 0; i < 4; i++) {
        const vf y = __builtin_shuffle(x, HALVES[i]);
        x = vselect(vgt(x, y), x, y);
    }
    return x[0];
}

static inline float hadd16(vf x) {
    for (int i = 0; i < 4; i++) x += __builtin_shuffle(x, HALVES[i]);
    return x[0];
}
#endif

/* element i of a row of dtype DT (0 float32, 1 bfloat16, 2 float16) set to x */
static inline void store_dt(int DT, void *dst, int64_t i, float x) {
    if (DT == 0) ((float *)dst)[i] = x;
    else if (DT == 1) ((bf16_t *)dst)[i] = f32_to_bf16(x);
    else ((_Float16 *)dst)[i] = (_Float16)x;
}

/* 1 where bfloat16 prefill scores are pair dot products on this CPU (paged_prefill.c) */
int pagedattn_prefill_pairs_pay(void);

#endif
