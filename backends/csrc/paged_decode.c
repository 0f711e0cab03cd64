/* Attention on the CPU: paged decode (one query token per sequence, read straight from the paged cache), the cache
 * write, greedy sampling's row argmax, and prefill over a sequence's own keys (at the end of this file).
 *
 * Built and loaded by pagedattn/backends/native.py (plain C, no Python or torch headers: it compiles in
 * seconds; OpenMP threads are torch's own, the runtime torch already loaded). Semantics are
 * pagedattn/backends/reference.py's for a query that sees one run of keys [lo, hi):
 *
 *   s_j = scale * (q . k_j);  s_j = cap * tanh(s_j / cap) if cap > 0;  s_j += slope * (j - (hi - 1)) with ALiBi;
 *   p = softmax over j in [lo, hi) (plus the head's sink logit in the normalisation, with no value);
 *   out = sum_j p_j v_j,  in float32, cast to the cache's dtype.
 *
 * Work is cut into units of (item, part of the item's keys); each unit keeps the running maximum, normaliser and
 * weighted sum of its part for every head, and a second pass merges the parts of every (item, query head) by their
 * maxima (flash-decoding). Keys and values are read once per unit, a tile of keys at a time through the block table,
 * each key row once for the query heads that share it. Head sizes that are multiples of 16 take a vector path
 * (16 keys scored at once, bfloat16 and float16 widened in registers); others a scalar one.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pagedattn_abi.h"

/* bfloat16 scores by AVX512-BF16's pair dot products (exact bfloat16 products, float sums; bfloat16 subnormals,
 * below 1.2e-38, count as zero) where the target has them; PAGEDATTN_NO_DPBF16 keeps the widening path */
#if defined(__AVX512BF16__) && !defined(PAGEDATTN_NO_DPBF16)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#define MAX_HEAD PAGEDATTN_MAX_HEAD   /* head size bound */
#define MAX_GROUP PAGEDATTN_MAX_GROUP /* query heads per KV head */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192  /* K and V bytes read ahead of the key being scored (prefetch_ahead): on a 2-core EPYC,
                              * half as far made decodes from DRAM 7-15 % slower, twice as far 0-9 % */
#endif
#define TILE 32       /* keys scored at once (the scalar path; at least the vector path's 16) */
#define CHUNK_TILES 8 /* the vector path's tiles scored before their softmax and weighted sums */

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
#pragma omp simd
            for (int d = 0; d < D; d++) dst[t * D + d] = (float)r[d];
        }
    }
}

/* a tile's n rows as float: in place for float32, else converted into buf [n][D] */
static inline __attribute__((always_inline)) void rows_as_float(const float **out, float *restrict buf,
                                                                const char *const *src, int n, const int D,
                                                                int dtype) {
    if (dtype == 0) {
        for (int t = 0; t < n; t++) out[t] = (const float *)src[t];
        return;
    }
    load_rows(buf, src, n, D, dtype);
    for (int t = 0; t < n; t++) out[t] = buf + t * D;
}

/* key j's rows (every head), K and V, asked for from memory: block addresses come from the table, so no hardware
 * prefetcher sees them coming. Asked for prefetch_ahead() keys ahead, one key per key attended (spread over the
 * work: a burst of prefetches only queues behind the memory system) */
static inline void prefetch_key(const decode_args *a, const int32_t *table, const char *ck, const char *cv, int64_t j,
                                int64_t row_bytes, int64_t esz) {
    const int64_t off = ((int64_t)table[j / a->block_size] * a->c_block + (j % a->block_size) * a->c_token) * esz;
    for (int64_t o = 0; o < row_bytes; o += 64) {
        __builtin_prefetch(ck + off + o, 0, 3);
        __builtin_prefetch(cv + off + o, 0, 3);
    }
}

/* how many keys ahead prefetch_key() asks for: PREFETCH_BYTES of K and V rows (row_bytes each), 4 to 32 keys (a
 * fixed count of keys was too near for small rows and too far for large ones: lines evicted from L1 before use) */
static inline int64_t prefetch_ahead(int64_t row_bytes) {
    const int64_t keys = PREFETCH_BYTES / (2 * row_bytes);
    return keys < 4 ? 4 : keys > 32 ? 32 : keys;
}

/* The state a unit starts from, for every head: its query (scaled, as float), zero sums, maxima -inf, normalisers 0
 * and ALiBi slopes, laid out from `state` as q [H][D], acc [H][D], m [H], l [H], slope [H]; returns the unit's keys
 * [*k0, *k1) of its item's [lo, hi). */
static inline __attribute__((always_inline)) void unit_start(const decode_args *a, float *state, int64_t item,
                                                             int part, const int D, int64_t *k0, int64_t *k1) {
    const int64_t *it = a->items + 4 * item;
    const int H = a->num_heads;
    const int64_t esz = a->dtype == 0 ? 4 : 2;
    float *q = state, *acc = q + (int64_t)H * D, *m = acc + (int64_t)H * D, *l = m + H, *slope = l + H;
    *k0 = it[2] + (int64_t)part * a->part_keys;
    *k1 = *k0 + a->part_keys < it[3] ? *k0 + a->part_keys : it[3];
    for (int h = 0; h < H; h++) {
        const char *qp[1] = {(const char *)a->query + (it[0] * a->q_row + h * a->q_head) * esz};
        load_rows(q + h * D, qp, 1, D, a->dtype);
        for (int d = 0; d < D; d++) q[h * D + d] *= a->scale;
        for (int d = 0; d < D; d++) acc[h * D + d] = 0.0f;
        m[h] = -INFINITY;
        l[h] = 0.0f;
        slope[h] = a->alibi_slopes ? a->alibi_slopes[h] : 0.0f;
    }
}

/* a unit's sums, maxima and normalisers into its rows of the scratch, for the merge; sums kept de-interleaved
 * (the vector path's bfloat16 ones: accumulate()) are put back in order */
static inline __attribute__((always_inline)) void unit_finish(const decode_args *a, const float *state, int64_t unit,
                                                              const int D, int interleaved) {
    const int H = a->num_heads;
    const float *acc = state + (int64_t)H * D, *m = acc + (int64_t)H * D, *l = m + H;
    for (int h = 0; h < H; h++) {
        float *dst = a->scratch + (unit * H + h) * (int64_t)(D + 2);
        const float *src = acc + h * D;
        if (interleaved)
            for (int d = 0; d < D; d++) dst[d] = src[(d & ~31) + (d & 1) * 16 + (d & 31) / 2];
        else
            memcpy(dst, src, sizeof(float) * D);
        dst[D] = m[h];
        dst[D + 1] = l[h];
    }
}

/* the floats one thread's units need: query and sums for every head, maxima, normalisers, slopes, a tile of
 * converted keys and values, a tile of scores per head of a group (the scalar path); a zero row, and for the vector
 * path every head's 16 keys' partial sums, a chunk's scores (then weights) and every head's running maximum over the
 * chunk (plus room to align) */
static int64_t state_floats(const decode_args *a) {
    const int64_t H = a->num_heads, D = a->head_size, G = a->num_heads / a->num_kv_heads;
    return 2 * H * D + 3 * H + 2 * TILE * D + G * TILE + D + H * 16 * 16 + H * CHUNK_TILES * 16 + H * 16 + 16;
}

/* one unit: an item's keys [k0, k1) for every head, a tile at a time (a tile's keys and values are read once for
 * all heads, while later keys are prefetched); D a constant where inlined */
static inline __attribute__((always_inline)) void run_unit(const decode_args *a, float *state, int64_t unit,
                                                           int64_t item, int part, const int D) {
    const int64_t seq = a->items[4 * item + 1], hi = a->items[4 * item + 3];
    const int H = a->num_heads, Hkv = a->num_kv_heads, G = H / Hkv, bs = a->block_size;
    const int64_t esz = a->dtype == 0 ? 4 : 2;
    float *q = state, *acc = q + (int64_t)H * D, *m = acc + (int64_t)H * D, *l = m + H, *slope = l + H;
    float *kt = slope + H, *vt = kt + TILE * D, *s = vt + TILE * D;
    const char *kp[TILE], *vp[TILE];
    const float *kr[TILE], *vr[TILE];
    int64_t k0, k1;
    unit_start(a, state, item, part, D, &k0, &k1);
    const int32_t *table = a->block_tables + seq * a->table_width;
    const char *ck = (const char *)a->k_cache, *cv = (const char *)a->v_cache;
    const int64_t row_bytes = ((int64_t)(Hkv - 1) * a->c_head + D) * esz;  /* a token's heads, first to last */
    const int64_t ahead = prefetch_ahead(row_bytes);
    for (int64_t t0 = k0; t0 < k1;) {
        const int64_t in_block = t0 % bs;
        int n = (int)(bs - in_block < k1 - t0 ? bs - in_block : k1 - t0);
        n = n < TILE ? n : TILE;
        const int64_t base = ((int64_t)table[t0 / bs] * a->c_block + in_block * a->c_token) * esz;
        for (int t = 0; t < n && t0 + t + ahead < k1; t++)
            prefetch_key(a, table, ck, cv, t0 + t + ahead, row_bytes, esz);
        for (int kvh = 0; kvh < Hkv; kvh++) {
            for (int t = 0; t < n; t++) {
                const int64_t off = base + (t * a->c_token + kvh * a->c_head) * esz;
                kp[t] = ck + off;
                vp[t] = cv + off;
            }
            rows_as_float(kr, kt, kp, n, D, a->dtype);
            rows_as_float(vr, vt, vp, n, D, a->dtype);
            for (int g = 0; g < G; g++) {
                const int h = kvh * G + g;
                const float *qh = q + h * D;
                float *sg = s + g * TILE;
                for (int t = 0; t < n; t++) {
                    const float *k = kr[t];
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int d = 0; d < D; d++) dot += qh[d] * k[d];
                    sg[t] = dot;
                }
                if (a->softcap > 0.0f)
                    for (int t = 0; t < n; t++) sg[t] = a->softcap * tanhf(sg[t] / a->softcap);
                if (a->alibi_slopes)
                    for (int t = 0; t < n; t++) sg[t] += slope[h] * (float)(t0 + t - (hi - 1));
                float mx = m[h];
                for (int t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
                const float alpha = exp_neg(m[h] - mx);
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int t = 0; t < n; t++) {
                    const float e = exp_neg(sg[t] - mx);
                    sg[t] = e;
                    sum += e;
                }
                l[h] = l[h] * alpha + sum;
                m[h] = mx;
                float *ah = acc + h * D;
#pragma omp simd
                for (int d = 0; d < D; d++) ah[d] *= alpha;
                for (int t = 0; t < n; t++) {
                    const float pt = sg[t];
                    const float *v = vr[t];
#pragma omp simd
                    for (int d = 0; d < D; d++) ah[d] += pt * v[d];
                }
            }
        }
        t0 += n;
    }
    unit_finish(a, state, unit, D, 0);
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

/* x in every lane: one broadcast (`(vf){} + x` also adds the zeros, and `v * 0.0f + x` multiplies: neither may be
 * folded away, as -0.0 and infinities behave differently) */
static inline vf vsplat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* lanes (0, 2, ..., 30) and (1, 3, ..., 31) of a:b, added: the pairwise sums of a, then of b */
static inline vf pairsum(vf a, vf b) {
    const vi even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

/* lane t of the result: the sum of x[t]'s lanes (16 dot products finished at once, 15 pairings) */
static inline vf hsum16(const vf *x) {
    vf r8[8], r4[4], r2[2];
    for (int i = 0; i < 8; i++) r8[i] = pairsum(x[2 * i], x[2 * i + 1]);
    for (int i = 0; i < 4; i++) r4[i] = pairsum(r8[2 * i], r8[2 * i + 1]);
    for (int i = 0; i < 2; i++) r2[i] = pairsum(r4[2 * i], r4[2 * i + 1]);
    return pairsum(r2[0], r2[1]);
}

/* exp_neg on 16 lanes (rounding by adding and removing 1.5 * 2^23: exact for |x * log2 e| < 2^22) */
static inline vf vexp_neg(vf x) {
    const vf lowest = vsplat(-87.0f);
    x = vselect(x < lowest, lowest, x);
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
    vh16 h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vf);
}

/* the maximum and the sum of a vector's 16 lanes (a tree of halvings, no lane-by-lane loop) */
static const vi HALVES[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                             {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                             {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                             {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};

static inline float hmax16(vf x) {
    for (int i = 0; i < 4; i++) {
        const vf y = __builtin_shuffle(x, HALVES[i]);
        x = vselect(x > y, x, y);
    }
    return x[0];
}

static inline float hadd16(vf x) {
    for (int i = 0; i < 4; i++) x += __builtin_shuffle(x, HALVES[i]);
    return x[0];
}

/* B heads' sums plus a chunk's weighted value rows: acc[b] [D] += sum over the chunk's keys of p[b][key] * v[key].
 * For bfloat16 (DT 1) the sums are kept de-interleaved: each 32 elements' even ones, then their odd ones
 * (unit_finish puts them back in order), so that a value row widens with one shift or mask per 16 elements.
 * Tile i of the chunk holds len[i] keys, key t's value row at v + base[i] + t * token_bytes, and its weights at
 * p[b * pstride + i * 16 + t]. B and D constants with B * D / 16 at most 24: every sum stays in a register over the
 * chunk, each value row is loaded (and widened) once and each weight broadcast once */
static inline __attribute__((always_inline)) void accumulate(float *acc, const float *p, int64_t pstride,
                                                             const char *v, const int64_t *base, const int *len,
                                                             int nt, int64_t token_bytes, const int D, const int DT,
                                                             const int B) {
    const int NV = D / VL;
    const int64_t esz = DT == 0 ? 4 : 2;
    vf x[6][VEC_MAX_NV];  /* fixed sizes, not NV and B: a variable-length array would live in memory */
    for (int b = 0; b < B; b++)
        for (int c = 0; c < NV; c++) x[b][c] = vload(acc + (int64_t)b * D + c * VL);
    for (int i = 0; i < nt; i++) {
        const char *row = v + base[i];
        for (int t = 0; t < len[i]; t++, row += token_bytes) {
            vf vt[VEC_MAX_NV];
            if (DT == 1) {  /* 32 bfloat16 as 16 words: the even elements shifted up, the odd ones masked */
                for (int c = 0; c < NV / 2; c++) {
                    vi w;
                    memcpy(&w, row + c * 2 * VL * esz, sizeof w);
                    vt[2 * c] = (vf)(w << 16);
                    vt[2 * c + 1] = (vf)(w & (int32_t)0xffff0000u);
                }
            } else {
                for (int c = 0; c < NV; c++) vt[c] = vload_as_float(row + c * VL * esz, DT);
            }
            for (int b = 0; b < B; b++) {
                const vf pb = vsplat(p[b * pstride + i * VL + t]);
                for (int c = 0; c < NV; c++) x[b][c] += pb * vt[c];
            }
        }
    }
    for (int b = 0; b < B; b++)
        for (int c = 0; c < NV; c++) vstore(acc + (int64_t)b * D + c * VL, x[b][c]);
}

/* the most heads accumulate() takes at once for head size D: 24 vector sums */
#define ACC_HEADS(D) ((D) <= 64 ? 6 : (D) <= 128 ? 3 : 1)

/* accumulate() over a group's G heads, ACC_HEADS(D) at a time (p: G rows pstride floats apart) */
static inline __attribute__((always_inline)) void accumulate_group(float *acc, const float *p, int64_t pstride,
                                                                   const char *v, const int64_t *base, const int *len,
                                                                   int nt, int64_t token_bytes, const int D,
                                                                   const int DT, int G) {
    const int most = ACC_HEADS(D);
    for (int g = 0; g < G;) {
        const int b = G - g < most ? G - g : most;
        float *ag = acc + (int64_t)g * D;
        const float *pg = p + g * pstride;
#define ACC_CASE(B) accumulate(ag, pg, pstride, v, base, len, nt, token_bytes, D, DT, B)
        switch (b) {  /* the cases above `most` are never taken for this D: folded away */
            case 6: if (most >= 6) ACC_CASE(6); break;
            case 5: if (most >= 5) ACC_CASE(5); break;
            case 4: if (most >= 4) ACC_CASE(4); break;
            case 3: if (most >= 3) ACC_CASE(3); break;
            case 2: if (most >= 2) ACC_CASE(2); break;
            default: ACC_CASE(1);
        }
#undef ACC_CASE
        g += b;
    }
}

/* 16 keys' dot products with each query head of one KV head's group, before their lanes are summed: dots [H][16][16]
 * gets, at [h][t], 16 partial sums of head h's query and key row kp. The query: q [H][D] scaled floats, or for
 * bfloat16 pairs (DP) the query's own rows (qraw, heads q_head elements apart), unscaled */
static inline __attribute__((always_inline)) void score_row(float *dots, const float *q, const char *qraw,
                                                            int64_t q_head, const char *kp, int kvh, int G, int t,
                                                            const int D, const int DT, const int DP) {
    const int NV = D / VL;
    const int64_t esz = DT == 0 ? 4 : 2;
#if HAVE_DPBF16
    if (DP) {
        __m512i kc[VEC_MAX_NV / 2];
        for (int c = 0; c < NV / 2; c++) kc[c] = _mm512_loadu_si512(kp + c * 64);
        for (int g = 0; g < G; g++) {
            const int h = kvh * G + g;
            const char *qh = qraw + h * q_head * 2;
            __m512 sv = _mm512_setzero_ps();
            for (int c = 0; c < NV / 2; c++)
                sv = _mm512_dpbf16_ps(sv, (__m512bh)_mm512_loadu_si512(qh + c * 64), (__m512bh)kc[c]);
            _mm512_storeu_ps(dots + (h * VL + t) * VL, sv);
        }
        return;
    }
#else
    (void)qraw, (void)q_head, (void)DP;
#endif
    const float *qk = q + (int64_t)kvh * G * D;
    vf kc[VEC_MAX_NV];
    for (int c = 0; c < NV; c++) kc[c] = vload_as_float(kp + c * VL * esz, DT);
    for (int g = 0; g < G; g++) {
        vf sv = vload(qk + g * D) * kc[0];
        for (int c = 1; c < NV; c++) sv += vload(qk + g * D + c * VL) * kc[c];
        vstore(dots + ((kvh * G + g) * VL + t) * VL, sv);
    }
}

/* run_unit for D a multiple of 16 and the cache's dtype DT (constants where inlined). A chunk of up to CHUNK_TILES
 * tiles at a time: first every tile's scores (16 keys at once, each key's row read once and in order, every KV
 * head's slice against its group's queries; walking one head's slices of the tile's rows, then the next head's,
 * reads ~12 % slower from DRAM), then each head's maximum over the chunk, its sums rescaled once and the chunk's
 * weights, then the weighted value rows with the heads' sums in vectors over the chunk. Rescaling per chunk instead
 * of per tile keeps the maxima and normalisers, a chain of dependent steps per head, off the per-tile path. */
static inline __attribute__((always_inline)) void run_unit_vec(const decode_args *a, float *state, int64_t unit,
                                                               int64_t item, int part, const int D, const int DT) {
    const int NV = D / VL;
    const int64_t qrow = a->items[4 * item], seq = a->items[4 * item + 1], hi = a->items[4 * item + 3];
    const int H = a->num_heads, Hkv = a->num_kv_heads, G = H / Hkv, bs = a->block_size;
    const int64_t esz = DT == 0 ? 4 : 2;
    const int DP = HAVE_DPBF16 && DT == 1;
    float *q = state, *acc = q + (int64_t)H * D, *m = acc + (int64_t)H * D, *l = m + H, *slope = l + H;
    float *zero = slope + H;  /* a row of D zero floats (zero in every dtype): a short tile's missing keys */
    float *dots = (float *)(((uintptr_t)(zero + D) + 63) & ~(uintptr_t)63);  /* [H][16 keys][16] partial sums */
    const int64_t pstride = CHUNK_TILES * VL;
    float *sc = dots + H * VL * VL, *top = sc + H * pstride;  /* [H][chunk's keys] scores, then weights; [H][16] */
    const char *qraw = (const char *)a->query + qrow * a->q_row * esz;
    int64_t k0, k1;
    unit_start(a, state, item, part, D, &k0, &k1);
    for (int d = 0; d < D; d++) zero[d] = 0.0f;
    const int32_t *table = a->block_tables + seq * a->table_width;
    const char *ck = (const char *)a->k_cache, *cv = (const char *)a->v_cache;
    const int64_t row_bytes = ((int64_t)(Hkv - 1) * a->c_head + D) * esz, token_bytes = a->c_token * esz;
    const int64_t ahead = prefetch_ahead(row_bytes);
    vi lane;
    for (int t = 0; t < VL; t++) lane[t] = t;
    for (int64_t t0 = k0; t0 < k1;) {
        int64_t base[CHUNK_TILES];  /* tile i: byte offset of its first key in the caches, and its keys */
        int len[CHUNK_TILES], nt = 0;
        for (int h = 0; h < H; h++) vstore(top + h * VL, (vf){} - INFINITY);
        for (; nt < CHUNK_TILES && t0 < k1; nt++) {
            const int64_t in_block = t0 % bs;
            int n = (int)(bs - in_block < k1 - t0 ? bs - in_block : k1 - t0);
            n = n < VL ? n : VL;
            base[nt] = ((int64_t)table[t0 / bs] * a->c_block + in_block * a->c_token) * esz;
            len[nt] = n;
            for (int t = 0; t < VL; t++) {
                if (t < n && t0 + t + ahead < k1)
                    prefetch_key(a, table, ck, cv, t0 + t + ahead, row_bytes, esz);
                const char *krow = t < n ? ck + base[nt] + t * token_bytes : NULL;
                for (int kvh = 0; kvh < Hkv; kvh++)
                    score_row(dots, q, qraw, a->q_head, krow ? krow + kvh * a->c_head * esz : (const char *)zero,
                              kvh, G, t, D, DT, DP);
            }
            const vi live = lane < n;
            for (int h = 0; h < H; h++) {
                vf s = hsum16((const vf *)(dots + h * VL * VL));
                if (DP) s *= a->scale;
                if (a->softcap > 0.0f || a->alibi_slopes) {
                    float tmp[VL];
                    vstore(tmp, s);
                    for (int t = 0; t < VL; t++) {
                        if (a->softcap > 0.0f) tmp[t] = a->softcap * tanhf(tmp[t] / a->softcap);
                        if (a->alibi_slopes) tmp[t] += slope[h] * (float)(t0 + t - (hi - 1));
                    }
                    s = vload(tmp);
                }
                s = vselect(live, s, (vf){} - INFINITY);  /* a short tile's missing keys */
                vstore(sc + h * pstride + nt * VL, s);
                const vf tp = vload(top + h * VL);
                vstore(top + h * VL, vselect(s > tp, s, tp));
            }
            t0 += n;
        }
        for (int h = 0; h < H; h++) {
            const float tmax = hmax16(vload(top + h * VL)), mx = tmax > m[h] ? tmax : m[h];
            const float alpha = exp_neg(m[h] - mx);
            float *ah = acc + (int64_t)h * D;
            if (alpha != 1.0f)
                for (int c = 0; c < NV; c++) vstore(ah + c * VL, vload(ah + c * VL) * alpha);
            vf sum = {};
            for (int i = 0; i < nt; i++) {
                float *si = sc + h * pstride + i * VL;
                const vf pv = (vf)((vi)vexp_neg(vload(si) - mx) & (lane < len[i]));  /* missing keys weigh 0 */
                vstore(si, pv);
                sum += pv;
            }
            l[h] = l[h] * alpha + hadd16(sum);
            m[h] = mx;
        }
        for (int kvh = 0; kvh < Hkv; kvh++)
            accumulate_group(acc + (int64_t)kvh * G * D, sc + kvh * G * pstride, pstride,
                             cv + kvh * a->c_head * esz, base, len, nt, token_bytes, D, DT, G);
    }
    unit_finish(a, state, unit, D, DT == 1);
}

#define UNIT_VEC_DTYPES(D)                                                                                     \
    do {                                                                                                       \
        if (a->dtype == 0) run_unit_vec(a, state, unit, item, part, D, 0);                                     \
        else if (a->dtype == 1) run_unit_vec(a, state, unit, item, part, D, 1);                                \
        else run_unit_vec(a, state, unit, item, part, D, 2);                                                   \
    } while (0)

static void unit_any(const decode_args *a, float *state, int64_t unit, int64_t item, int part) {
    switch (a->head_size) {  /* the common head sizes and the dtype as constants: unrolled, vectorised loops */
        case 64: UNIT_VEC_DTYPES(64); break;
        case 128: UNIT_VEC_DTYPES(128); break;
        case 32: UNIT_VEC_DTYPES(32); break;
        case 256: UNIT_VEC_DTYPES(256); break;
        default: run_unit(a, state, unit, item, part, a->head_size);
    }
}

/* element i of a row of dtype DT (0 float32, 1 bfloat16, 2 float16) set to x */
static inline void store_dt(int DT, void *dst, int64_t i, float x) {
    if (DT == 0) ((float *)dst)[i] = x;
    else if (DT == 1) ((bf16_t *)dst)[i] = f32_to_bf16(x);
    else ((_Float16 *)dst)[i] = (_Float16)x;
}

/* what this build has: 1 for bfloat16 decode scores by AVX512-BF16 pair dot products, 16 for prefill scores by them
 * on this CPU (native.py's FEATURE_*) */
static inline int prefill_pairs_pay(void);
int pagedattn_features(void) { return (HAVE_DPBF16 ? 1 : 0) | (prefill_pairs_pay() ? 16 : 0); }

/* 0 when every index the call reads is in bounds, else what is wrong: the kernel never reads outside its tensors */
static int check(const decode_args *a, const int64_t *parts_start) {
    const int G = a->num_kv_heads > 0 ? a->num_heads / a->num_kv_heads : 0;
    if (a->head_size <= 0 || a->head_size > MAX_HEAD || G <= 0 || G > MAX_GROUP || a->block_size <= 0) return 1;
    if (a->num_heads != G * a->num_kv_heads || a->part_keys <= 0) return 1;
    if (parts_start[0] != 0) return 2;
    for (int64_t i = 0; i < a->num_items; i++) {
        const int64_t *it = a->items + 4 * i;
        if (it[0] < 0 || it[0] >= a->num_rows || it[1] < 0 || it[1] >= a->num_seqs) return 2;
        if (it[2] < 0 || it[3] < 0 || (it[3] + a->block_size - 1) / a->block_size > a->table_width) return 3;
        if (parts_start[i + 1] < parts_start[i] + 1) return 2;
        const int64_t keys = it[3] > it[2] ? it[3] - it[2] : 1;
        if ((parts_start[i + 1] - parts_start[i] - 1) * a->part_keys >= keys) return 2;  /* a part with no keys */
        const int32_t *table = a->block_tables + it[1] * a->table_width;
        for (int64_t b = it[2] / a->block_size; b * a->block_size < it[3]; b++)
            if (table[b] < 0 || table[b] >= a->num_blocks) return 4;
    }
    return 0;
}

/* parts_start[i]: the first part of item i (prefix sums of the items' part counts, parts_start[n] = total).
 * Returns 0, or check()'s code with nothing written. */
int pagedattn_paged_decode(const decode_args *a, const int64_t *parts_start) {
    const int bad = check(a, parts_start);
    if (bad) return bad;
    const int D = a->head_size;
    const int64_t n_parts = parts_start[a->num_items];
    const int64_t esz = a->dtype == 0 ? 4 : 2;
    int failed = 0;
#pragma omp parallel num_threads(a->num_threads)
    {
        float *state = malloc(sizeof(float) * state_floats(a));
        if (!state) {
#pragma omp atomic write
            failed = 1;
        }
        /* parts in order (item, part), handed out one at a time: parts of unequal length balance */
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < n_parts; p++) {
            if (!state) continue;
            int64_t lo = 0, hi = a->num_items;  /* the item holding part p */
            while (hi - lo > 1) {
                int64_t mid = (lo + hi) / 2;
                if (parts_start[mid] <= p) lo = mid; else hi = mid;
            }
            unit_any(a, state, p, lo, (int)(p - parts_start[lo]));
        }
        free(state);
        int merge;
#pragma omp atomic read
        merge = failed;
        merge = !merge;  /* the same in every thread: the loop above ended with a barrier */
#pragma omp for schedule(static)
        for (int64_t ih = 0; ih < (merge ? a->num_items * a->num_heads : 0); ih++) {
            const int64_t item = ih / a->num_heads;
            const int h = (int)(ih % a->num_heads);
            const int64_t row = a->items[4 * item];
            float mx = a->sinks ? a->sinks[h] : -INFINITY;
            for (int64_t p = parts_start[item]; p < parts_start[item + 1]; p++) {
                const float *src = a->scratch + (p * a->num_heads + h) * (int64_t)(D + 2);
                mx = src[D] > mx ? src[D] : mx;
            }
            float o[MAX_HEAD];
            float den = a->sinks ? exp_neg(a->sinks[h] - mx) : 0.0f;
            memset(o, 0, sizeof(float) * D);
            if (mx != -INFINITY) {
                for (int64_t p = parts_start[item]; p < parts_start[item + 1]; p++) {
                    const float *src = a->scratch + (p * a->num_heads + h) * (int64_t)(D + 2);
                    if (src[D + 1] == 0.0f) continue;
                    const float w = exp_neg(src[D] - mx);
                    den += w * src[D + 1];
                    for (int d = 0; d < D; d++) o[d] += w * src[d];
                }
            }
            char *dst = (char *)a->out + (row * a->o_row + h * a->o_head) * esz;
            const float inv = den > 0.0f ? 1.0f / den : 0.0f;
            for (int d = 0; d < D; d++) store_dt(a->dtype, dst, d, o[d] * inv);
        }
    }
    return failed ? 5 : 0;
}

/* ---- the cache write (write_args, pagedattn_abi.h) */

/* 0, or 6 when a slot is outside the cache (other than -1) with nothing written */
int pagedattn_write_kv(const write_args *a) {
    const int64_t num_slots = a->num_blocks * a->block_size;
    for (int64_t t = 0; t < a->num_tokens; t++) {
        const int64_t s = a->slots_are_64_bit ? ((const int64_t *)a->slots)[t] : ((const int32_t *)a->slots)[t];
        if (s < -1 || s >= num_slots) return 6;
    }
    const int64_t esz = a->element_size, row = (int64_t)a->head_size * esz;
    for (int64_t t = 0; t < a->num_tokens; t++) {
        const int64_t s = a->slots_are_64_bit ? ((const int64_t *)a->slots)[t] : ((const int32_t *)a->slots)[t];
        if (s < 0) continue;
        const int64_t base = (s / a->block_size) * a->c_block + (s % a->block_size) * a->c_token;
        for (int h = 0; h < a->num_kv_heads; h++) {
            memcpy((char *)a->k_cache + (base + h * a->c_head) * esz,
                   (const char *)a->key + (t * a->k_row + h * a->k_head) * esz, row);
            memcpy((char *)a->v_cache + (base + h * a->c_head) * esz,
                   (const char *)a->value + (t * a->v_row + h * a->v_head) * esz, row);
        }
    }
    return 0;
}

/* ---- each row's argmax, as torch.argmax: the first maximum, or a row's first NaN where it holds one (greedy
 * sampling's last step; ATen's CPU argmax tracks an index per element and is ~8x slower than its max). Every lane keeps
 * its largest value and the first column holding it, so the row's first maximum is the smallest column among the
 * lanes holding the row's maximum. x [rows] rows of `cols` elements of dtype DT, `row_stride` elements apart. */
#define ARGMAX_WAYS 4  /* independent running maxima: a compare-and-select chain per 16 lanes is latency-bound */
static inline __attribute__((always_inline)) int64_t argmax_row(const char *x, int64_t cols, const int DT) {
    const int64_t esz = DT == 0 ? 4 : 2, step = ARGMAX_WAYS * VL;
    const int64_t body = cols - cols % step;
    vi lane, nan = {};
    for (int t = 0; t < VL; t++) lane[t] = t;
    vf best[ARGMAX_WAYS];
    vi at[ARGMAX_WAYS], col[ARGMAX_WAYS];
    for (int w = 0; w < ARGMAX_WAYS; w++) best[w] = (vf){} - INFINITY, at[w] = col[w] = lane + w * VL;
    for (int64_t c = 0; c < body; c += step)
        for (int w = 0; w < ARGMAX_WAYS; w++) {
            const vf v = vload_as_float(x + (c + w * VL) * esz, DT);
            const vi more = v > best[w];
            best[w] = vselect(more, v, best[w]);
            at[w] = (more & col[w]) | (~more & at[w]);
            nan |= v != v;
            col[w] += (int32_t)step;  /* columns fit 32 bits: argmax_rows checks */
        }
    int any_nan = 0;
    for (int t = 0; t < VL; t++) any_nan |= nan[t];
    float top = -INFINITY;
    int64_t arg = -1;
    for (int w = 0; w < ARGMAX_WAYS && body; w++)
        for (int t = 0; t < VL; t++)
            if (arg < 0 || best[w][t] > top || (best[w][t] == top && at[w][t] < arg)) top = best[w][t], arg = at[w][t];
    for (int64_t c = body; c < cols; c++) {  /* the tail, after every column of the body: ties keep the body's */
        const float v = DT == 0 ? ((const float *)x)[c] : DT == 1 ? bf16_to_f32(((const bf16_t *)x)[c])
                                                                  : (float)((const _Float16 *)x)[c];
        any_nan |= v != v;
        if (arg < 0 || v > top) top = v, arg = c;
    }
    if (any_nan)
        for (int64_t c = 0; c < cols; c++) {
            const float v = DT == 0 ? ((const float *)x)[c] : DT == 1 ? bf16_to_f32(((const bf16_t *)x)[c])
                                                                      : (float)((const _Float16 *)x)[c];
            if (v != v) return c;
        }
    return arg;
}

/* 0, or 1 for a bad call (a dtype it does not read, no columns or 2^31 - 1 and more) with nothing written */
int pagedattn_argmax_rows(const void *x, int32_t dtype, int64_t rows, int64_t cols, int64_t row_stride,
                          int64_t *out) {
    if (dtype < 0 || dtype > 2 || cols <= 0 || cols >= INT32_MAX || rows < 0) return 1;
    const int64_t esz = dtype == 0 ? 4 : 2;
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * row_stride * esz;
        out[r] = dtype == 0 ? argmax_row(row, cols, 0) : dtype == 1 ? argmax_row(row, cols, 1)
                                                                     : argmax_row(row, cols, 2);
    }
    return 0;
}

/* ---- prefill: the queries of a run of a sequence over that sequence's own keys (K/V rows of a tensor, not the
 * paged cache): causal, optionally within a window, or not causal; float32 sums over any of the three dtypes.
 *
 * The keys are first transposed, per item and KV head, into tiles of [D][16] floats: a tile's scores for one query
 * row are then D fused multiply-adds on 16 keys at once, the row's query element broadcast. A unit is (item, KV head,
 * heads of its group, block of query positions): PM query rows whose score vectors stay in registers over a tile;
 * the scores of PCH tiles are then softmaxed together (one maximum, one rescale of the sums and no masks where every
 * row sees every key: ~20 % of a prefill's time against a tile at a time), and, per 16-float chunk of the head, PM
 * weighted sums stay in registers over those tiles' value rows. Head sizes that are multiples of 16, up to 256. */
#define PM 24  /* query rows of a unit */
#define PCH 4  /* tiles of keys a unit's softmax takes at once: one maximum, one rescale per 64 keys */

typedef struct {
    const void *query;
    int64_t q_row, q_head;
    const void *key;
    int64_t k_row, k_head;
    const void *value;
    int64_t v_row, v_head;
    void *out;
    int64_t o_row, o_head;
    /* per item: first query row, queries, position of the first query, first key row, keys, position of the first
     * key. A causal query at position p sees the item's keys at positions [p - window + 1, p] ([.., p] without a
     * window); a non-causal query sees all of them */
    const int64_t *items;
    int64_t num_items;
    int32_t num_heads, num_kv_heads, head_size, causal, window, dtype;
    float scale;
    float *scratch;  /* the transposed keys: sum over items of ceil(keys / 16) * Hkv * D * 16 floats */
    int32_t num_threads;
    int64_t num_q_rows, num_k_rows;  /* bounds every row read or written is checked against */
} prefill_args;

/* keys (indices into the item's keys) a query at position qpos sees: [*klo, *khi) */
static inline void prefill_seen(const prefill_args *a, const int64_t *it, int64_t qpos, int64_t *klo, int64_t *khi) {
    int64_t lo = 0, hi = it[4];
    if (a->causal) {
        hi = qpos - it[5] + 1;
        if (a->window > 0) lo = qpos - a->window + 1 - it[5];
    }
    *klo = lo > 0 ? lo : 0;
    *khi = hi < it[4] ? hi : it[4];
}

/* one unit: row r is position qb * QB + r / hb of the item's queries, head g0 + r % hb of KV head kvh's group;
 * rows past the queries, the block or the group are padding (zero queries, nothing written) */
static inline __attribute__((always_inline)) void prefill_unit(const prefill_args *a, float *buf, const float *kt,
                                                               int64_t item, int kvh, int g0, int hb, int64_t qb,
                                                               const int D, const int DT, const int DP) {
    const int NV = D / VL;
    const int64_t *it = a->items + 6 * item;
    const int64_t nq = it[1];
    const int G = a->num_heads / a->num_kv_heads, QB = PM / hb;
    const int64_t esz = DT == 0 ? 4 : 2;
    float *q = buf, *acc = q + PM * D, *p = acc + PM * D, *l = p + PM * PCH * VL, *m = l + PM * VL;
    int64_t klo[PM], khi[PM], first = it[4], last = 0;  /* each row's keys; the keys of any row */
    int64_t seen_lo = 0, seen_hi = it[4];  /* the keys every live row sees: [seen_lo, seen_hi) */
    for (int r = 0; r < PM; r++) {
        const int64_t i = qb * QB + r / hb;
        const int h = kvh * G + g0 + r % hb;
        m[r] = -INFINITY;
        vstore(l + r * VL, (vf){});
        for (int d = 0; d < D; d++) acc[r * D + d] = 0.0f;
        klo[r] = khi[r] = 0;
        if (r / hb >= QB || i >= nq || g0 + r % hb >= G) {
            if (DP)
                memset((uint32_t *)q + r * (D / 2), 0, (size_t)D * 2);
            else
                for (int d = 0; d < D; d++) q[r * D + d] = 0.0f;
            continue;
        }
        const char *qp[1] = {(const char *)a->query + ((it[0] + i) * a->q_row + h * a->q_head) * esz};
        if (DP) {
            memcpy((uint32_t *)q + r * (D / 2), qp[0], (size_t)D * 2);  /* the row's pairs, scaled after the sums */
        } else {
            load_rows(q + r * D, qp, 1, D, DT);
            for (int d = 0; d < D; d++) q[r * D + d] *= a->scale;
        }
        prefill_seen(a, it, it[2] + i, &klo[r], &khi[r]);
        if (klo[r] < khi[r]) {
            first = klo[r] < first ? klo[r] : first;
            last = khi[r] > last ? khi[r] : last;
            seen_lo = klo[r] > seen_lo ? klo[r] : seen_lo;
            seen_hi = khi[r] < seen_hi ? khi[r] : seen_hi;
        }
    }
    vi lane;
    for (int t = 0; t < VL; t++) lane[t] = t;
    for (int64_t j0 = first - first % VL; j0 < last; j0 += PCH * VL) {
        const int nt = (last - j0 + VL - 1) / VL < PCH ? (int)((last - j0 + VL - 1) / VL) : PCH;
        for (int tt = 0; tt < nt; tt++) {  /* the chunk's scores: p [PM][PCH * VL] */
            const float *tile = kt + (j0 / VL + tt) * (int64_t)D * VL;  /* [D][16] */
            vf s[PM];
#pragma GCC unroll 24
            for (int r = 0; r < PM; r++) s[r] = (vf){};
#if HAVE_DPBF16
            if (DP) {  /* exact bfloat16 products, float sums, then the scale (as the reference orders them) */
                const uint32_t *qp2 = (const uint32_t *)q;
                __m512 sd[PM];
#pragma GCC unroll 24
                for (int r = 0; r < PM; r++) sd[r] = _mm512_setzero_ps();
                for (int d2 = 0; d2 < D / 2; d2++) {
                    const __m512bh k = (__m512bh)_mm512_loadu_si512((const uint32_t *)tile + d2 * VL);
#pragma GCC unroll 24
                    for (int r = 0; r < PM; r++)
                        sd[r] = _mm512_dpbf16_ps(sd[r], k, (__m512bh)_mm512_set1_epi32((int)qp2[r * (D / 2) + d2]));
                }
                const vf scale = vsplat(a->scale);
#pragma GCC unroll 24
                for (int r = 0; r < PM; r++) s[r] = (vf)sd[r] * scale;
            } else
#endif
            for (int d = 0; d < D; d++) {
                const vf k = vload(tile + d * VL);
#pragma GCC unroll 24
                for (int r = 0; r < PM; r++) s[r] += q[r * D + d] * k;
            }
#pragma GCC unroll 24
            for (int r = 0; r < PM; r++) vstore(p + r * (PCH * VL) + tt * VL, s[r]);
        }
        /* every live row sees every key of the chunk (most chunks of a long prompt): no masks */
        const int full = j0 >= seen_lo && j0 + nt * VL <= seen_hi;
        for (int r = 0; r < PM; r++) {
            float *pr = p + r * (PCH * VL);
            vf sc[PCH], top_v = (vf){} - INFINITY;
            vi seen[PCH];
            if (klo[r] < khi[r]) {
                for (int tt = 0; tt < nt; tt++) {
                    sc[tt] = vload(pr + tt * VL);
                    if (!full) {
                        const vi key = lane + (int)(j0 + tt * VL);
                        seen[tt] = (key >= (int)klo[r]) & (key < (int)khi[r]);
                        sc[tt] = vselect(seen[tt], sc[tt], (vf){} - INFINITY);
                    }
                    top_v = vselect(sc[tt] > top_v, sc[tt], top_v);
                }
            }
            const float top = hmax16(top_v);
            if (top == -INFINITY) {  /* none of the chunk's keys (a padding row's: it sees none) */
                for (int tt = 0; tt < nt; tt++) vstore(pr + tt * VL, (vf){});
                continue;
            }
            if (top > m[r]) {  /* a new maximum: the sums so far scaled down to it */
                const float alpha = exp_neg(m[r] - top);
                m[r] = top;
                vstore(l + r * VL, vload(l + r * VL) * alpha);
                for (int c = 0; c < NV; c++) vstore(acc + r * D + c * VL, vload(acc + r * D + c * VL) * alpha);
            }
            const vf mr = vsplat(m[r]);
            vf sum = vload(l + r * VL);  /* the normaliser's lanes, added up at the end */
            for (int tt = 0; tt < nt; tt++) {
                vf pv = vexp_neg(sc[tt] - mr);
                if (!full) pv = (vf)((vi)pv & seen[tt]);
                sum += pv;
                vstore(pr + tt * VL, pv);
            }
            vstore(l + r * VL, sum);
        }
        const int64_t n = it[4] - j0 < nt * VL ? it[4] - j0 : nt * VL;
        const char *vrow = (const char *)a->value + ((it[3] + j0) * a->v_row + kvh * a->v_head) * esz;
        for (int c = 0; c < NV; c++) {
            vf x[PM];
#pragma GCC unroll 24
            for (int r = 0; r < PM; r++) x[r] = vload(acc + r * D + c * VL);
            for (int64_t t = 0; t < n; t++) {
                const vf v = vload_as_float(vrow + (t * a->v_row + c * VL) * esz, DT);
#pragma GCC unroll 24
                for (int r = 0; r < PM; r++) x[r] += p[r * (PCH * VL) + t] * v;
            }
#pragma GCC unroll 24
            for (int r = 0; r < PM; r++) vstore(acc + r * D + c * VL, x[r]);
        }
    }
    for (int r = 0; r < PM; r++) {
        if (klo[r] >= khi[r]) continue;  /* padding (a real row sees at least its own key) */
        const int64_t i = qb * QB + r / hb;
        const int h = kvh * G + g0 + r % hb;
        char *dst = (char *)a->out + ((it[0] + i) * a->o_row + h * a->o_head) * esz;
        const float inv = 1.0f / hadd16(vload(l + r * VL));
        for (int d = 0; d < D; d++) store_dt(DT, dst, d, acc[r * D + d] * inv);
    }
}

/* an item's keys of one KV head as tiles [ceil(keys / 16)][D][16] of floats (zeros past the last key); bfloat16 keys
 * where the pair dot products are built as tiles [D / 2][16] of pairs of bfloat16 (the first half of a tile's room) */
static inline __attribute__((always_inline)) void prefill_transpose(const prefill_args *a, float *kt, int64_t item,
                                                                    int kvh, int64_t tile, const int D,
                                                                    const int DT, const int DP) {
    const int64_t *it = a->items + 6 * item;
    const int64_t esz = DT == 0 ? 4 : 2;
    float *dst = kt + tile * (int64_t)D * VL;
    if (DP) {
        uint32_t *pairs = (uint32_t *)dst;
        for (int t = 0; t < VL; t++) {
            const int64_t j = tile * VL + t;
            const uint32_t *src = (const uint32_t *)((const char *)a->key + ((it[3] + j) * a->k_row + kvh * a->k_head) * 2);
            for (int d2 = 0; d2 < D / 2; d2++) {
                uint32_t v = 0;
                if (j < it[4]) memcpy(&v, src + d2, 4);  /* (k[2 d2], k[2 d2 + 1]) */
                pairs[d2 * VL + t] = v;
            }
        }
        return;
    }
    for (int t = 0; t < VL; t++) {
        const int64_t j = tile * VL + t;
        if (j >= it[4]) {
            for (int d = 0; d < D; d++) dst[d * VL + t] = 0.0f;
            continue;
        }
        const char *src[1] = {(const char *)a->key + ((it[3] + j) * a->k_row + kvh * a->k_head) * esz};
        float row[MAX_HEAD];
        load_rows(row, src, 1, D, DT);
        for (int d = 0; d < D; d++) dst[d * VL + t] = row[d];
    }
}

/* bfloat16 prefill scores by pair dot products (DP) or widened to float32 FMAs: pairs where they pay, AMD's CPUs
 * (a 2-core EPYC, Zen 5: the kernel ~2x faster); on a Sapphire Rapids class Xeon, whose pair dot products issue at
 * half the rate of its FMAs, widening was 25-35 % faster (4 x 250 and 1 x 1024 tokens). PAGEDATTN_PREFILL_PAIRS takes
 * pairs on any CPU that has them (tests) */
static inline int prefill_pairs_pay(void) {
#if HAVE_DPBF16 && defined(PAGEDATTN_PREFILL_PAIRS)
    return 1;
#elif HAVE_DPBF16
    return __builtin_cpu_is("amd");
#else
    return 0;
#endif
}

#define PREFILL_DTYPES(F, D, ...)                                                                              \
    do {                                                                                                       \
        if (a->dtype == 0) F(__VA_ARGS__, D, 0, 0);                                                            \
        else if (a->dtype == 1 && pairs) F(__VA_ARGS__, D, 1, HAVE_DPBF16);                                    \
        else if (a->dtype == 1) F(__VA_ARGS__, D, 1, 0);                                                       \
        else F(__VA_ARGS__, D, 2, 0);                                                                          \
    } while (0)

#define PREFILL_SIZES(F, ...)                                                                                  \
    do {                                                                                                       \
        switch (a->head_size) {                                                                                \
            case 64: PREFILL_DTYPES(F, 64, __VA_ARGS__); break;                                                \
            case 128: PREFILL_DTYPES(F, 128, __VA_ARGS__); break;                                              \
            case 32: PREFILL_DTYPES(F, 32, __VA_ARGS__); break;                                                \
            case 16: PREFILL_DTYPES(F, 16, __VA_ARGS__); break;                                                \
            case 256: PREFILL_DTYPES(F, 256, __VA_ARGS__); break;                                              \
            default: PREFILL_DTYPES(F, a->head_size, __VA_ARGS__); /* other multiples of 16 */                 \
        }                                                                                                      \
    } while (0)

/* 0 when every row the call reads or writes is in bounds, else 1 (sizes), 2 (an item's rows) */
static int prefill_check(const prefill_args *a) {
    const int D = a->head_size;
    if (D <= 0 || D > 256 || D % VL || a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads) return 1;
    for (int64_t i = 0; i < a->num_items; i++) {
        const int64_t *it = a->items + 6 * i;
        if (it[0] < 0 || it[1] < 0 || it[0] + it[1] > a->num_q_rows) return 2;
        if (it[3] < 0 || it[4] < 0 || it[3] + it[4] > a->num_k_rows) return 2;
    }
    return 0;
}

int pagedattn_prefill(const prefill_args *a) {
    const int bad = prefill_check(a);
    if (bad) return bad;
    const int H = a->num_heads, Hkv = a->num_kv_heads, G = H / Hkv, D = a->head_size;
    const int hb = G < PM ? G : PM, QB = PM / hb, hblocks = (G + hb - 1) / hb;
    const int pairs = prefill_pairs_pay(); /* one choice for the call: the scratch holds its key tiles' layout */
    const int64_t n = a->num_items;
    /* per item: its first tile in the scratch (tiles of every KV head) and its first unit */
    int64_t *tiles = malloc(sizeof(int64_t) * 2 * (n + 1));
    if (!tiles) return 5;
    int64_t *units = tiles + n + 1;
    tiles[0] = units[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t *it = a->items + 6 * i;
        tiles[i + 1] = tiles[i] + Hkv * ((it[4] + VL - 1) / VL);
        units[i + 1] = units[i] + (int64_t)Hkv * hblocks * ((it[1] + QB - 1) / QB);
    }
    int failed = 0;
#pragma omp parallel num_threads(a->num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t tt = 0; tt < tiles[n]; tt++) {
            int64_t lo = 0, hi = n;  /* the item holding tile tt */
            while (hi - lo > 1) {
                int64_t mid = (lo + hi) / 2;
                if (tiles[mid] <= tt) lo = mid; else hi = mid;
            }
            const int64_t per_head = (a->items[6 * lo + 4] + VL - 1) / VL, k = tt - tiles[lo];
            float *kt = a->scratch + (tiles[lo] + (k / per_head) * per_head) * (int64_t)D * VL;
            PREFILL_SIZES(prefill_transpose, a, kt, lo, (int)(k / per_head), k % per_head);
        }
        float *buf = malloc(sizeof(float) * (2 * PM * D + PM * PCH * VL + PM * VL + PM));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        /* the last units first: a causal item's later query blocks see the most keys */
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = units[n] - 1; u >= 0; u--) {
            if (!buf) continue;
            int64_t lo = 0, hi = n;
            while (hi - lo > 1) {
                int64_t mid = (lo + hi) / 2;
                if (units[mid] <= u) lo = mid; else hi = mid;
            }
            const int64_t blocks = (a->items[6 * lo + 1] + QB - 1) / QB, k = u - units[lo];
            const int kvh = (int)(k / (hblocks * blocks)), g0 = (int)((k / blocks) % hblocks) * hb;
            const int64_t per_head = (a->items[6 * lo + 4] + VL - 1) / VL;
            const float *kt = a->scratch + (tiles[lo] + kvh * per_head) * (int64_t)D * VL;
            PREFILL_SIZES(prefill_unit, a, buf, kt, lo, kvh, g0, hb, k % blocks);
        }
        free(buf);
    }
    free(tiles);
    return failed ? 5 : 0;
}
