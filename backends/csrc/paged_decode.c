/* Paged decode attention on the CPU: one query token per sequence, read straight from the paged cache.
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

#define MAX_HEAD 512  /* head size bound */
#define MAX_GROUP 64  /* query heads per KV head */
#ifndef PREFETCH_KEYS
#define PREFETCH_KEYS 32  /* keys read ahead of the tile being attended */
#endif
#define TILE 32       /* keys scored at once (the scalar path; at least the vector path's 16) */

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

typedef struct {
    /* query [rows, Hq, D] and out [rows, Hq, D]: element strides of a row and of a head (D contiguous) */
    const void *query;
    int64_t q_row, q_head;
    void *out;
    int64_t o_row, o_head;
    /* K and V caches: element strides of a block, a token in a block and a KV head (D contiguous) */
    const void *k_cache, *v_cache;
    int64_t c_block, c_token, c_head;
    const int32_t *block_tables;  /* [seqs, table_width] */
    int64_t table_width;
    /* per item: query row, sequence (block table row), first visible key, keys (the query is key hi - 1) */
    const int64_t *items;
    int64_t num_items;
    int32_t num_heads, num_kv_heads, head_size, block_size;
    float scale, softcap;
    const float *alibi_slopes; /* [Hq] or NULL */
    const float *sinks;        /* [Hq] or NULL */
    int32_t dtype;             /* 0 float32, 1 bfloat16, 2 float16 */
    int32_t part_keys;         /* keys per unit */
    float *scratch;            /* per unit and query head: D sums, then max and normaliser */
    int32_t num_threads;
    int64_t num_blocks, num_rows, num_seqs; /* bounds every index read is checked against */
} decode_args;

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
 * prefetcher sees them coming. Asked for PREFETCH_KEYS keys ahead, one key per key attended (spread over the work:
 * a burst of prefetches only queues behind the memory system) */
static inline void prefetch_key(const decode_args *a, const int32_t *table, const char *ck, const char *cv, int64_t j,
                                int64_t row_bytes, int64_t esz) {
    const int64_t off = ((int64_t)table[j / a->block_size] * a->c_block + (j % a->block_size) * a->c_token) * esz;
    for (int64_t o = 0; o < row_bytes; o += 64) {
        __builtin_prefetch(ck + off + o, 0, 3);
        __builtin_prefetch(cv + off + o, 0, 3);
    }
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

/* a unit's sums, maxima and normalisers into its rows of the scratch, for the merge */
static inline __attribute__((always_inline)) void unit_finish(const decode_args *a, const float *state, int64_t unit,
                                                              const int D) {
    const int H = a->num_heads;
    const float *acc = state + (int64_t)H * D, *m = acc + (int64_t)H * D, *l = m + H;
    for (int h = 0; h < H; h++) {
        float *dst = a->scratch + (unit * H + h) * (int64_t)(D + 2);
        memcpy(dst, acc + h * D, sizeof(float) * D);
        dst[D] = m[h];
        dst[D + 1] = l[h];
    }
}

/* the floats one thread's units need: query and sums for every head, maxima, normalisers, slopes, a tile of
 * converted keys and values, a tile of scores per head of a group */
static int64_t state_floats(const decode_args *a) {
    const int64_t H = a->num_heads, D = a->head_size, G = a->num_heads / a->num_kv_heads;
    return 2 * H * D + 3 * H + 2 * TILE * D + G * TILE + D;
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
    for (int64_t t0 = k0; t0 < k1;) {
        const int64_t in_block = t0 % bs;
        int n = (int)(bs - in_block < k1 - t0 ? bs - in_block : k1 - t0);
        n = n < TILE ? n : TILE;
        const int64_t base = ((int64_t)table[t0 / bs] * a->c_block + in_block * a->c_token) * esz;
        for (int t = 0; t < n && t0 + t + PREFETCH_KEYS < k1; t++)
            prefetch_key(a, table, ck, cv, t0 + t + PREFETCH_KEYS, row_bytes, esz);
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
    unit_finish(a, state, unit, D);
}

/* ---- the vector path: head sizes that are multiples of 16, tiles of 16 keys (GCC/Clang vector extensions: the
 * compiler maps 16-float vectors to whatever the target has, one AVX-512 register or several narrower ones) */
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
#define VL 16

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

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
    const vf lowest = x * 0.0f - 87.0f;
    x = vselect(x < lowest, lowest, x);
    const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    vf r, p = x * 0.0f + EXP_P5;
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

/* B heads' sums (B a constant: their chunks stay in registers), rescaled by alpha, plus each key's weight times its
 * value row: acc[b] [D] += sum over t < n of p[b][t] * v[t]. Each value chunk is loaded (and widened) once for
 * the B heads */
static inline __attribute__((always_inline)) void accumulate(float *acc, const vf *p, const float *alpha,
                                                             const char *const *v, int n, const int D, const int DT,
                                                             const int B) {
    const int64_t esz = DT == 0 ? 4 : 2;
    for (int c = 0; c < D / VL; c++) {
        vf x[B];
        for (int b = 0; b < B; b++) x[b] = vload(acc + (int64_t)b * D + c * VL) * alpha[b];
        for (int t = 0; t < n; t++) {
            const vf vt = vload_as_float(v[t] + c * VL * esz, DT);
            for (int b = 0; b < B; b++) x[b] += p[b][t] * vt;
        }
        for (int b = 0; b < B; b++) vstore(acc + (int64_t)b * D + c * VL, x[b]);
    }
}

/* run_unit for D a multiple of 16 and the cache's dtype DT (constants where inlined): keys scored 16 at a time,
 * each key row loaded once for the group's heads; the heads' sums stay in vectors over a tile's values */
static inline __attribute__((always_inline)) void run_unit_vec(const decode_args *a, float *state, int64_t unit,
                                                               int64_t item, int part, const int D, const int DT) {
    const int NV = D / VL;
    const int64_t seq = a->items[4 * item + 1], hi = a->items[4 * item + 3];
    const int H = a->num_heads, Hkv = a->num_kv_heads, G = H / Hkv, bs = a->block_size;
    const int64_t esz = DT == 0 ? 4 : 2;
    float *q = state, *acc = q + (int64_t)H * D, *m = acc + (int64_t)H * D, *l = m + H, *slope = l + H;
    float *zero = slope + H;  /* a row of D zero floats (zero in every dtype): a short tile's missing keys */
    const char *kr[VL], *vr[VL];  /* the tile's rows of one KV head, in the cache's dtype */
    vf part_dots[MAX_GROUP][VL], pvs[MAX_GROUP];
    float alphas[MAX_GROUP];
    int64_t k0, k1;
    unit_start(a, state, item, part, D, &k0, &k1);
    for (int d = 0; d < D; d++) zero[d] = 0.0f;
    const int32_t *table = a->block_tables + seq * a->table_width;
    const char *ck = (const char *)a->k_cache, *cv = (const char *)a->v_cache;
    const int64_t row_bytes = ((int64_t)(Hkv - 1) * a->c_head + D) * esz;
    vi lane;
    for (int t = 0; t < VL; t++) lane[t] = t;
    for (int64_t t0 = k0; t0 < k1;) {
        const int64_t in_block = t0 % bs;
        int n = (int)(bs - in_block < k1 - t0 ? bs - in_block : k1 - t0);
        n = n < VL ? n : VL;
        const int64_t base = ((int64_t)table[t0 / bs] * a->c_block + in_block * a->c_token) * esz;
        const vi live = lane < n;
        for (int kvh = 0; kvh < Hkv; kvh++) {
            for (int t = 0; t < VL; t++) {
                const int64_t off = base + (t * a->c_token + kvh * a->c_head) * esz;
                kr[t] = t < n ? ck + off : (const char *)zero;
                vr[t] = t < n ? cv + off : (const char *)zero;
            }
            const float *qk = q + (int64_t)kvh * G * D;
            for (int t = 0; t < VL; t++) {  /* each key row once, against the group's G queries */
                if (kvh == 0 && t < n && t0 + t + PREFETCH_KEYS < k1)
                    prefetch_key(a, table, ck, cv, t0 + t + PREFETCH_KEYS, row_bytes, esz);
                vf kc[NV];
                for (int c = 0; c < NV; c++) kc[c] = vload_as_float(kr[t] + c * VL * esz, DT);
                for (int g = 0; g < G; g++) {
                    vf s = vload(qk + g * D) * kc[0];
                    for (int c = 1; c < NV; c++) s += vload(qk + g * D + c * VL) * kc[c];
                    part_dots[g][t] = s;
                }
            }
            for (int g = 0; g < G; g++) {
                const int h = kvh * G + g;
                vf sc = hsum16(part_dots[g]);
                if (a->softcap > 0.0f || a->alibi_slopes) {
                    float tmp[VL];
                    vstore(tmp, sc);
                    for (int t = 0; t < VL; t++) {
                        if (a->softcap > 0.0f) tmp[t] = a->softcap * tanhf(tmp[t] / a->softcap);
                        if (a->alibi_slopes) tmp[t] += slope[h] * (float)(t0 + t - (hi - 1));
                    }
                    sc = vload(tmp);
                }
                float mx = m[h];
                for (int t = 0; t < n; t++) mx = sc[t] > mx ? sc[t] : mx;
                const float alpha = exp_neg(m[h] - mx);
                const vf pv = (vf)((vi)vexp_neg(sc - mx) & live);  /* the short tile's missing keys weigh 0 */
                float sum = 0.0f;
                for (int t = 0; t < n; t++) sum += pv[t];
                l[h] = l[h] * alpha + sum;
                m[h] = mx;
                pvs[g] = pv;
                alphas[g] = alpha;
            }
            float *ak = acc + (int64_t)kvh * G * D;  /* the values, for up to 4 heads of the group at a time */
            int g = 0;
            for (; g + 4 <= G; g += 4) accumulate(ak + (int64_t)g * D, pvs + g, alphas + g, vr, n, D, DT, 4);
            for (; g + 2 <= G; g += 2) accumulate(ak + (int64_t)g * D, pvs + g, alphas + g, vr, n, D, DT, 2);
            for (; g < G; g++) accumulate(ak + (int64_t)g * D, pvs + g, alphas + g, vr, n, D, DT, 1);
        }
        t0 += n;
    }
    unit_finish(a, state, unit, D);
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

static inline void store(const decode_args *a, void *dst, int64_t i, float x) {
    if (a->dtype == 0) ((float *)dst)[i] = x;
    else if (a->dtype == 1) ((bf16_t *)dst)[i] = f32_to_bf16(x);
    else ((_Float16 *)dst)[i] = (_Float16)x;
}

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
            for (int d = 0; d < D; d++) store(a, dst, d, o[d] * inv);
        }
    }
    return failed ? 5 : 0;
}

/* ---- the cache write: token t's K and V rows [Hkv][D] into slot slots[t] of the paged caches (-1: padding,
 * skipped) */
typedef struct {
    const void *key, *value;
    int64_t k_row, k_head, v_row, v_head;   /* element strides of a token and of a head (D contiguous) */
    void *k_cache, *v_cache;
    int64_t c_block, c_token, c_head;       /* as in decode_args */
    const void *slots;                      /* [tokens] */
    int32_t slots_are_64_bit;
    int64_t num_tokens, num_blocks;
    int32_t num_kv_heads, head_size, block_size, element_size;
} write_args;

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
