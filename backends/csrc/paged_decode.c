/* Attention on the CPU: paged decode (one query token per sequence, read straight from the paged cache), the cache
 * write and greedy sampling's row argmax (prefill over a sequence's own keys: paged_prefill.c).
 *
 * Built and loaded by pagedattn/backends/native.py (plain C, no Python or torch headers: it compiles in
 * seconds; OpenMP threads are torch's own, the runtime torch already loaded). Semantics are
 * pagedattn/backends/reference.py's for a query that sees one run of keys [lo, hi):
 *
 *   s_j = scale * (q . k_j);  s_j = cap * tanh(s_j / cap) if cap > 0;  s_j += slope * (j - (hi - 1)) with ALiBi;
 *   s_j += bias_j with a bias (a position program's: -inf for a key the query does not see);
 *   p = softmax over j in [lo, hi) (plus the head's sink logit in the normalisation, with no value); keys whose
 *   score is -inf weigh exactly 0, and a query that sees no key at all gets zeros;
 *   out = sum_j p_j v_j,  in float32, cast to the cache's dtype; for bfloat16 each weight p_j (before the
 *   normalisation) rounded to bfloat16 first, as the model's own bfloat16 attention rounds its weights (Hugging
 *   Face's eager softmax cast to the model's dtype, ATen's CPU flash kernel): the vector path then sums two keys'
 *   exact products at a time by AVX512-BF16 pair dot products where the CPU has them.
 *
 * Work is cut into units of (item, part of the item's keys); each unit keeps the running maximum, normaliser and
 * weighted sum of its part for every head, and a second pass merges the parts of every (item, query head) by their
 * maxima (flash-decoding). Keys and values are read once per unit, a tile of keys at a time through the block table,
 * each key row once for the query heads that share it. Head sizes 32, 64, 128 and 256 take a vector path (16 keys
 * scored at once, bfloat16 and float16 widened in registers); others a scalar one.
 */
#include "paged_common.h"

#include <time.h>

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192  /* K and V bytes read ahead of the key being scored (prefetch_ahead): on a 2-core EPYC,
                              * half as far made decodes from DRAM 7-15 % slower, twice as far 0-9 % */
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2 /* the prefetch cursor's requests go to L2 (prefetcht1): on a 2-core EPYC (Zen 4), decodes
                             * from DRAM 16-30 % faster than into L1 (prefetcht0), which holds only a few misses in
                             * flight; the same in cache (benchmarks/RESULTS.md) */
#endif
#define TILE 32       /* keys scored at once (the scalar path; at least the vector path's 16) */
#define CHUNK_TILES 8 /* the vector path's tiles scored before their softmax and weighted sums */


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

/* The keys a unit asks for from memory ahead of the one it scores: block addresses come from the table, so no
 * hardware prefetcher sees them coming. The cursor walks the unit's keys prefetch_ahead() keys in front and asks
 * for one key's rows (every head, K and V) per key attended: spread over the work (a burst of prefetches only
 * queues behind the memory system), and moved a token at a time, one table read per block (a division per key
 * cost more than the prefetches). */
typedef struct {
    int64_t key, end;     /* the next key asked for, and the unit's end */
    int64_t block, slot;  /* its block in the table and place in the block */
    int64_t off;          /* its byte offset in the caches (valid while key < end) */
} prefetch_cursor;

static inline void prefetch_start(prefetch_cursor *c, const decode_args *a, const int32_t *table, int64_t key,
                                  int64_t end, int64_t esz) {
    c->key = key;
    c->end = end;
    c->block = key / a->block_size;
    c->slot = key % a->block_size;
    c->off = key < end ? ((int64_t)table[c->block] * a->c_block + c->slot * a->c_token) * esz : 0;
}

/* the cursor's key asked for (row_bytes of each cache, from L2 on: PREFETCH_LOCALITY), and the cursor moved on */
static inline __attribute__((always_inline)) void prefetch_next(prefetch_cursor *c, const decode_args *a,
                                                                const int32_t *table, const char *ck, const char *cv,
                                                                int64_t row_bytes, int64_t esz) {
    if (c->key >= c->end) return;
    for (int64_t o = 0; o < row_bytes; o += 64) {
        __builtin_prefetch(ck + c->off + o, 0, PREFETCH_LOCALITY);
        __builtin_prefetch(cv + c->off + o, 0, PREFETCH_LOCALITY);
    }
    c->key++;
    if (++c->slot < a->block_size) {
        c->off += a->c_token * esz;
    } else {
        c->slot = 0;
        c->block++;
        /* the table is read only for keys the unit has: check() bounds those */
        c->off = c->key < c->end ? (int64_t)table[c->block] * a->c_block * esz : 0;
    }
}

/* how many keys ahead the prefetch cursor runs: PREFETCH_BYTES of K and V rows (row_bytes each), 4 to 32 keys (a
 * fixed count of keys was too near for small rows and too far for large ones: lines evicted before use) */
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

/* the orders in which accumulate() keeps 32 of a unit's bfloat16 sums, as indices into its two vectors: by widening,
 * the 16 even elements, then the 16 odd ones; by pair dot products, elements 0-3, 8-11, 16-19 and 24-27, then 4-7,
 * 12-15, 20-23 and 28-31 (vpunpck{l,h}wd's lanes of 128 bits) */
static const vi EVEN_ODD[2] = {{0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23},
                               {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31}};
static const vi PAIRED[2] = {{0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
                             {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};

/* 32 sums kept in one of those orders put back in order: two two-source shuffles (an element at a time, this was
 * ~40 % of a call's fixed cost at 16 short sequences) */
static inline __attribute__((always_inline)) void reorder32(float *dst, const float *src, const vi *order) {
    const vf a = vload(src), b = vload(src + VL);
    vstore(dst, __builtin_shuffle(a, b, order[0]));
    vstore(dst + VL, __builtin_shuffle(a, b, order[1]));
}

/* how accumulate() keeps a unit's sums: in order, de-interleaved (bfloat16 widened), or as its pair dot products
 * leave them (bfloat16 by pairs) */
enum { SUMS_IN_ORDER, SUMS_EVEN_ODD, SUMS_PAIRED };

/* a unit's sums, maxima and normalisers into its rows of the scratch, for the merge; sums kept in another order (the
 * vector path's bfloat16 ones, D a multiple of 32) are put back in order */
static inline __attribute__((always_inline)) void unit_finish(const decode_args *a, const float *state, int64_t unit,
                                                              const int D, int order) {
    const int H = a->num_heads;
    const float *acc = state + (int64_t)H * D, *m = acc + (int64_t)H * D, *l = m + H;
    for (int h = 0; h < H; h++) {
        float *dst = a->scratch + (unit * H + h) * (int64_t)(D + 2);
        const float *src = acc + h * D;
        if (order == SUMS_IN_ORDER)
            memcpy(dst, src, sizeof(float) * D);
        else
            for (int d = 0; d < D; d += 2 * VL) reorder32(dst + d, src + d, order == SUMS_EVEN_ODD ? EVEN_ODD : PAIRED);
        dst[D] = m[h];
        dst[D + 1] = l[h];
    }
}

/* the item's bias for head 0, indexed by key position (NULL without one) */
static inline const float *item_bias(const decode_args *a, int64_t item) {
    return a->bias ? a->bias + item * a->bias_item - a->items[4 * item + 2] : NULL;
}

/* the floats one thread's units need: query and sums for every head, maxima, normalisers, slopes, a tile of
 * converted keys and values, a tile of scores per head of a group (the scalar path); a zero row, and for the vector
 * path every head's 16 keys' partial sums, a chunk's scores (then weights), every head's running maximum over the
 * chunk and the query's bfloat16 rows (plus room to align both) */
static int64_t state_floats(const decode_args *a) {
    const int64_t H = a->num_heads, D = a->head_size, G = a->num_heads / a->num_kv_heads;
    return 2 * H * D + 3 * H + 2 * TILE * D + G * TILE + D + H * 16 * 16 + H * CHUNK_TILES * 16 + H * 16 + 16
           + H * D / 2 + 16;
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
    const float *bias = item_bias(a, item);
    const int32_t *table = a->block_tables + seq * a->table_width;
    const char *ck = (const char *)a->k_cache, *cv = (const char *)a->v_cache;
    const int64_t row_bytes = ((int64_t)(Hkv - 1) * a->c_head + D) * esz;  /* a token's heads, first to last */
    prefetch_cursor pf;
    prefetch_start(&pf, a, table, k0 + prefetch_ahead(row_bytes), k1, esz);
    for (int64_t t0 = k0; t0 < k1;) {
        const int64_t in_block = t0 % bs;
        int n = (int)(bs - in_block < k1 - t0 ? bs - in_block : k1 - t0);
        n = n < TILE ? n : TILE;
        const int64_t base = ((int64_t)table[t0 / bs] * a->c_block + in_block * a->c_token) * esz;
        for (int t = 0; t < n; t++) prefetch_next(&pf, a, table, ck, cv, row_bytes, esz);
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
                if (bias)
                    for (int t = 0; t < n; t++) sg[t] += bias[h * a->bias_head + t0 + t];
                float mx = m[h];
                for (int t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
                if (bias && mx == -INFINITY) continue;  /* no key seen yet (a bias hid them all): nothing to add */
                const float alpha = exp_neg(m[h] - mx);
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int t = 0; t < n; t++) {
                    const float e = sg[t] == -INFINITY ? 0.0f : exp_neg(sg[t] - mx);
                    sg[t] = e;
                    sum += e;
                }
                l[h] = l[h] * alpha + sum;
                m[h] = mx;
                float *ah = acc + h * D;
#pragma omp simd
                for (int d = 0; d < D; d++) ah[d] *= alpha;
                for (int t = 0; t < n; t++) {
                    /* bfloat16: the weight rounded to bfloat16, as the vector path's pairs take it */
                    const float pt = a->dtype == 1 ? bf16_to_f32(f32_to_bf16(sg[t])) : sg[t];
                    const float *v = vr[t];
#pragma omp simd
                    for (int d = 0; d < D; d++) ah[d] += pt * v[d];
                }
            }
        }
        t0 += n;
    }
    unit_finish(a, state, unit, D, SUMS_IN_ORDER);
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
#if HAVE_DPBF16
    if (DT == 1) {  /* two keys a product: their rows' elements interleaved, the weights as bfloat16 pairs */
        for (int i = 0; i < nt; i++) {
            uint32_t pb[6][VL / 2];  /* head b's weights of the tile's keys (2k, 2k + 1) */
            for (int b = 0; b < B; b++)
                _mm256_storeu_si256((__m256i *)pb[b], (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + b * pstride + i * VL)));
            const char *row = v + base[i];
            for (int t = 0; t < len[i]; t += 2, row += 2 * token_bytes) {
                __m512i vt[VEC_MAX_NV];
                for (int c = 0; c < NV / 2; c++) {
                    const __m512i r0 = _mm512_loadu_si512(row + c * 2 * VL * esz);
                    /* an odd tile's last key: paired with a zero row (its weight 0), nothing read past the tile */
                    const __m512i r1 = t + 1 < len[i] ? _mm512_loadu_si512(row + token_bytes + c * 2 * VL * esz)
                                                      : _mm512_setzero_si512();
                    vt[2 * c] = _mm512_unpacklo_epi16(r0, r1);
                    vt[2 * c + 1] = _mm512_unpackhi_epi16(r0, r1);
                }
                for (int b = 0; b < B; b++) {
                    const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pb[b][t / 2]);
                    for (int c = 0; c < NV; c++) x[b][c] = (vf)_mm512_dpbf16_ps((__m512)x[b][c], (__m512bh)vt[c], pp);
                }
            }
        }
    } else
#endif
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

#if PAGEDATTN_AVX2_PATHS
/* accumulate() by AVX2's 8-lane instructions, one head and 64 of its sums (8 registers) at a time, each product
 * reading its value row from memory: GCC kept accumulate()'s 16-lane sums (up to 24 of them, 48 registers of 8 lanes)
 * in memory, a third of a decode's time on a Zen 3 EPYC. The sums keep accumulate()'s order (bfloat16 widened: each 32
 * elements' even ones, then its odd ones) and arithmetic (a product added by one FMA, in the keys' order) */
static inline __m256 acc_row8(const char *row, int j, const int DT) {
    if (DT == 0) return _mm256_loadu_ps((const float *)row + 8 * j);
    if (DT == 2) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)row + j));
    /* bfloat16: sums j = 4c + k of a 32-element chunk c: k 0, 1 the even elements of its two halves of 16 (words
     * shifted up), k 2, 3 their odd ones (words masked) */
    const __m256i w = _mm256_loadu_si256((const __m256i *)(row + 64 * (j / 4)) + (j % 2));
    return _mm256_castsi256_ps(j % 4 < 2 ? _mm256_slli_epi32(w, 16) : _mm256_and_si256(w, _mm256_set1_epi32((int32_t)0xffff0000u)));
}

#define ACC8_SLOTS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define ACC8_LOAD(j) __m256 s##j = (j) < cols ? _mm256_loadu_ps(acc + d0 + 8 * (j)) : _mm256_setzero_ps();
#define ACC8_FMA(j) if ((j) < cols) s##j = _mm256_fmadd_ps(pb, acc_row8(row + d0 * esz, j, DT), s##j);
#define ACC8_STORE(j) if ((j) < cols) _mm256_storeu_ps(acc + d0 + 8 * (j), s##j);

static inline __attribute__((always_inline)) void acc8_block(float *acc, const float *p, const char *v,
                                                              const int64_t *base, const int *len, int nt,
                                                              int64_t token_bytes, int d0, const int cols,
                                                              const int DT) {
    const int64_t esz = DT == 0 ? 4 : 2;
    ACC8_SLOTS(ACC8_LOAD)
    for (int i = 0; i < nt; i++) {
        const char *row = v + base[i];
        for (int t = 0; t < len[i]; t++, row += token_bytes) {
            const __m256 pb = _mm256_set1_ps(p[i * VL + t]);
            ACC8_SLOTS(ACC8_FMA)
        }
    }
    ACC8_SLOTS(ACC8_STORE)
}

static inline __attribute__((always_inline)) void accumulate_avx2(float *acc, const float *p, int64_t pstride,
                                                                  const char *v, const int64_t *base, const int *len,
                                                                  int nt, int64_t token_bytes, const int D,
                                                                  const int DT, int G) {
    for (int g = 0; g < G; g++)
        for (int d0 = 0; d0 < D; d0 += 64) {
            if (D - d0 >= 64)
                acc8_block(acc + (int64_t)g * D, p + g * pstride, v, base, len, nt, token_bytes, d0, 8, DT);
            else if (D - d0 >= 32)  /* D a multiple of 16; bfloat16's of 32 */
                acc8_block(acc + (int64_t)g * D, p + g * pstride, v, base, len, nt, token_bytes, d0, D - d0 >= 48 ? 6 : 4, DT);
            else
                acc8_block(acc + (int64_t)g * D, p + g * pstride, v, base, len, nt, token_bytes, d0, 2, DT);
        }
}
#define HAVE_ACC_AVX2 1
#else
#define HAVE_ACC_AVX2 0
#endif

/* the most heads accumulate() takes at once for head size D: 24 vector sums */
#define ACC_HEADS(D) ((D) <= 64 ? 6 : (D) <= 128 ? 3 : 1)

/* accumulate() over a group's G heads, ACC_HEADS(D) at a time (p: G rows pstride floats apart) */
static inline __attribute__((always_inline)) void accumulate_group(float *acc, const float *p, int64_t pstride,
                                                                   const char *v, const int64_t *base, const int *len,
                                                                   int nt, int64_t token_bytes, const int D,
                                                                   const int DT, int G) {
#if HAVE_ACC_AVX2
    if (!(DT == 1 && HAVE_DPBF16)) {
        accumulate_avx2(acc, p, pstride, v, base, len, nt, token_bytes, D, DT, G);
        return;
    }
#endif
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

/* one key's dot products with each query head of one KV head's group, before their lanes are summed: dots [H][16][16]
 * gets, at [h][t], 16 partial sums of head h's query and key row kp. The query: q [H][D] scaled floats, or for
 * bfloat16 pairs (DP) qp [H][D], the query's rows unscaled. G, D constants where inlined: the group's queries at
 * fixed offsets, its loop unrolled */
static inline __attribute__((always_inline)) void score_row(float *dots, const float *q, const bf16_t *qp,
                                                            const char *kp, int kvh, const int G, int t, const int D,
                                                            const int DT, const int DP) {
    const int NV = D / VL;
    const int64_t esz = DT == 0 ? 4 : 2;
#if HAVE_DPBF16
    if (DP) {
        __m512i kc[VEC_MAX_NV / 2];
        for (int c = 0; c < NV / 2; c++) kc[c] = _mm512_loadu_si512(kp + c * 64);
        const bf16_t *qk = qp + (int64_t)kvh * G * D;
        float *dk = dots + ((int64_t)kvh * G * VL + t) * VL;
        for (int g = 0; g < G; g++) {
            __m512 sv = _mm512_setzero_ps();
            for (int c = 0; c < NV / 2; c++)
                sv = _mm512_dpbf16_ps(sv, (__m512bh)_mm512_loadu_si512(qk + g * D + c * 2 * VL), (__m512bh)kc[c]);
            _mm512_storeu_ps(dk + g * VL * VL, sv);
        }
        return;
    }
#else
    (void)qp, (void)DP;
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

/* a tile's 16 keys against every query head (score_row; the keys past its n live ones score the zero row), key t's
 * rows at krow + t * token_bytes, KV head kvh's slice head_bytes further; the prefetch cursor moves a key per live
 * key */
static inline __attribute__((always_inline)) void score_tile(float *dots, const float *q, const bf16_t *qp,
                                                             const char *krow, int n, const char *zero,
                                                             const decode_args *a, const int32_t *table,
                                                             prefetch_cursor *pf, int64_t row_bytes, const int G,
                                                             const int D, const int DT, const int DP) {
    const int64_t esz = DT == 0 ? 4 : 2, token_bytes = a->c_token * esz, head_bytes = a->c_head * esz;
    const char *ck = (const char *)a->k_cache, *cv = (const char *)a->v_cache;
    for (int t = 0; t < VL; t++) {
        const char *kr = zero;
        if (t < n) {
            prefetch_next(pf, a, table, ck, cv, row_bytes, esz);
            kr = krow + t * token_bytes;
        }
        for (int kvh = 0; kvh < a->num_kv_heads; kvh++)
            score_row(dots, q, qp, t < n ? kr + kvh * head_bytes : zero, kvh, G, t, D, DT, DP);
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
    bf16_t *qp = (bf16_t *)(((uintptr_t)(top + H * VL) + 63) & ~(uintptr_t)63);  /* [H][D] the query's rows (DP) */
    int64_t k0, k1;
    unit_start(a, state, item, part, D, &k0, &k1);
    const float *bias = item_bias(a, item);
    for (int d = 0; d < D; d++) zero[d] = 0.0f;
    if (DP)
        for (int h = 0; h < H; h++)
            memcpy(qp + (int64_t)h * D, (const char *)a->query + (qrow * a->q_row + h * a->q_head) * esz, D * esz);
    const int32_t *table = a->block_tables + seq * a->table_width;
    const char *ck = (const char *)a->k_cache, *cv = (const char *)a->v_cache;
    const int64_t row_bytes = ((int64_t)(Hkv - 1) * a->c_head + D) * esz, token_bytes = a->c_token * esz;
    prefetch_cursor pf;
    prefetch_start(&pf, a, table, k0 + prefetch_ahead(row_bytes), k1, esz);
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
            const char *krow = ck + base[nt];
#define SCORE_CASE(GC) score_tile(dots, q, qp, krow, n, (const char *)zero, a, table, &pf, row_bytes, GC, D, DT, DP)
            switch (G) {  /* the common group sizes as constants */
                case 1: SCORE_CASE(1); break;
                case 2: SCORE_CASE(2); break;
                case 3: SCORE_CASE(3); break;
                case 4: SCORE_CASE(4); break;
                case 8: SCORE_CASE(8); break;
                default: SCORE_CASE(G);
            }
#undef SCORE_CASE
            const vi live = vilt(lane, (vi){} + n);
            for (int h = 0; h < H; h++) {
                vf s = hsum16((const vf *)(dots + h * VL * VL));
                if (DP) s *= a->scale;
                if (a->softcap > 0.0f || a->alibi_slopes || bias) {
                    float tmp[VL];
                    vstore(tmp, s);
                    for (int t = 0; t < VL; t++) {
                        if (a->softcap > 0.0f) tmp[t] = a->softcap * tanhf(tmp[t] / a->softcap);
                        if (a->alibi_slopes) tmp[t] += slope[h] * (float)(t0 + t - (hi - 1));
                    }
                    if (bias)  /* the tile's keys only: a row's last tile may end before 16 */
                        for (int t = 0; t < n; t++) tmp[t] += bias[h * a->bias_head + t0 + t];
                    s = vload(tmp);
                }
                s = vselect(live, s, (vf){} - INFINITY);  /* a short tile's missing keys */
                vstore(sc + h * pstride + nt * VL, s);
                const vf tp = vload(top + h * VL);
                vstore(top + h * VL, vselect(vgt(s, tp), s, tp));
            }
            t0 += n;
        }
        for (int h = 0; h < H; h++) {
            const float tmax = hmax16(vload(top + h * VL)), mx = tmax > m[h] ? tmax : m[h];
            if (bias && mx == -INFINITY) {  /* no key seen yet (a bias hid them all): the chunk adds nothing */
                for (int i = 0; i < nt; i++) vstore(sc + h * pstride + i * VL, (vf){});
                continue;
            }
            const float alpha = exp_neg(m[h] - mx);
            float *ah = acc + (int64_t)h * D;
            if (alpha != 1.0f)
                for (int c = 0; c < NV; c++) vstore(ah + c * VL, vload(ah + c * VL) * alpha);
            vf sum = {};
            for (int i = 0; i < nt; i++) {
                float *si = sc + h * pstride + i * VL;
                vi keep = vilt(lane, (vi){} + len[i]);  /* missing keys weigh 0, and with a bias those it hides (-inf) */
                if (bias) keep &= vne(vload(si), (vf){} - INFINITY);
                const vf pv = (vf)((vi)vexp_neg(vload(si) - mx) & keep);
                vstore(si, DT == 1 && !HAVE_DPBF16 ? round_bf16(pv) : pv);  /* as accumulate()'s pairs take them */
                sum += pv;
            }
            l[h] = l[h] * alpha + hadd16(sum);
            m[h] = mx;
        }
        for (int kvh = 0; kvh < Hkv; kvh++)
            accumulate_group(acc + (int64_t)kvh * G * D, sc + kvh * G * pstride, pstride,
                             cv + kvh * a->c_head * esz, base, len, nt, token_bytes, D, DT, G);
    }
    unit_finish(a, state, unit, D, DT != 1 ? SUMS_IN_ORDER : HAVE_DPBF16 ? SUMS_PAIRED : SUMS_EVEN_ODD);
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


/* what this build has: 1 for bfloat16 decode scores by AVX512-BF16 pair dot products, 16 for prefill scores by them
 * on this CPU (native.py's FEATURE_*) */
int pagedattn_features(void) { return (HAVE_DPBF16 ? 1 : 0) | (pagedattn_prefill_pairs_pay() ? 16 : 0); }

/* 0 when every index the call reads is in bounds, else what is wrong: the kernel never reads outside its tensors */
static int check(const decode_args *a, const int64_t *parts_start) {
    const int G = a->num_kv_heads > 0 ? a->num_heads / a->num_kv_heads : 0;
    if (a->head_size <= 0 || a->head_size > MAX_HEAD || G <= 0 || G > MAX_GROUP || a->block_size <= 0) return 1;
    if (a->num_heads != G * a->num_kv_heads || a->part_keys <= 0) return 1;
    if (parts_start[0] != 0) return 2;
    if (a->bias && (a->bias_item < 0 || a->bias_head < 0)) return 7;
    for (int64_t i = 0; i < a->num_items; i++) {
        const int64_t *it = a->items + 4 * i;
        if (it[0] < 0 || it[0] >= a->num_rows || it[1] < 0 || it[1] >= a->num_seqs) return 2;
        if (it[2] < 0 || it[3] < 0 || (it[3] + a->block_size - 1) / a->block_size > a->table_width) return 3;
        if (parts_start[i + 1] < parts_start[i] + 1) return 2;
        const int64_t keys = it[3] > it[2] ? it[3] - it[2] : 1;
        if ((parts_start[i + 1] - parts_start[i] - 1) * a->part_keys >= keys) return 2;  /* a part with no keys */
        if (a->bias && it[3] > it[2] &&
            (i * a->bias_item + (int64_t)(a->num_heads - 1) * a->bias_head + it[3] - it[2] > a->bias_numel))
            return 7;
        const int32_t *table = a->block_tables + it[1] * a->table_width;
        for (int64_t b = it[2] / a->block_size; b * a->block_size < it[3]; b++)
            if (table[b] < 0 || table[b] >= a->num_blocks) return 4;
    }
    return 0;
}

/* parts_start[i]: the first part of item i (prefix sums of the items' part counts, parts_start[n] = total).
 * Returns 0, or check()'s code with nothing written. */
static int paged_decode(const decode_args *a, const int64_t *parts_start) {
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
static int write_kv(const write_args *a) {
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
            const vi more = vgt(v, best[w]);
            best[w] = vselect(more, v, best[w]);
            at[w] = (more & col[w]) | (~more & at[w]);
            nan |= vne(v, v);
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

#if PAGEDATTN_AVX2_PATHS
/* argmax_row by AVX2's 8-lane instructions, the same lanes' bookkeeping: GCC's code for the 16-lane vectors above
 * spills them (12 vectors of 64 bytes in 16 registers of 32) and took ~10x this one's time on a Zen 3 EPYC */
#define ARGMAX_ROW argmax_row_avx2
static inline __m256 argmax_load8(const char *p, const int DT) {
    if (DT == 0) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (DT == 1) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

static inline float argmax_at(const char *x, int64_t c, const int DT) {
    return DT == 0 ? ((const float *)x)[c] : DT == 1 ? bf16_to_f32(((const bf16_t *)x)[c])
                                                     : (float)((const _Float16 *)x)[c];
}

static inline __attribute__((always_inline)) int64_t argmax_row_avx2(const char *x, int64_t cols, const int DT) {
    const int64_t esz = DT == 0 ? 4 : 2, step = ARGMAX_WAYS * 8;
    const int64_t body = cols - cols % step;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), advance = _mm256_set1_epi32((int32_t)step);
    __m256 best[ARGMAX_WAYS], nan = _mm256_setzero_ps();
    __m256i at[ARGMAX_WAYS], col[ARGMAX_WAYS];
    for (int w = 0; w < ARGMAX_WAYS; w++) {
        best[w] = _mm256_set1_ps(-INFINITY);
        at[w] = col[w] = _mm256_add_epi32(lane, _mm256_set1_epi32(w * 8));
    }
    for (int64_t c = 0; c < body; c += step)
        for (int w = 0; w < ARGMAX_WAYS; w++) {
            const __m256 v = argmax_load8(x + (c + w * 8) * esz, DT);
            const __m256 more = _mm256_cmp_ps(v, best[w], _CMP_GT_OQ);
            best[w] = _mm256_blendv_ps(best[w], v, more);
            at[w] = _mm256_castps_si256(
                _mm256_blendv_ps(_mm256_castsi256_ps(at[w]), _mm256_castsi256_ps(col[w]), more));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            col[w] = _mm256_add_epi32(col[w], advance);  /* columns fit 32 bits: argmax_rows checks */
        }
    int any_nan = _mm256_movemask_ps(nan) != 0;
    float top = -INFINITY;
    int64_t arg = -1;
    for (int w = 0; w < ARGMAX_WAYS && body; w++) {
        float b[8];
        int32_t i[8];
        _mm256_storeu_ps(b, best[w]);
        _mm256_storeu_si256((__m256i *)i, at[w]);
        for (int t = 0; t < 8; t++)
            if (arg < 0 || b[t] > top || (b[t] == top && i[t] < arg)) top = b[t], arg = i[t];
    }
    for (int64_t c = body; c < cols; c++) {  /* the tail, after every column of the body: ties keep the body's */
        const float v = argmax_at(x, c, DT);
        any_nan |= v != v;
        if (arg < 0 || v > top) top = v, arg = c;
    }
    if (any_nan)
        for (int64_t c = 0; c < cols; c++)
            if (argmax_at(x, c, DT) != argmax_at(x, c, DT)) return c;
    return arg;
}
#else
#define ARGMAX_ROW argmax_row
#endif

/* 0, or 1 for a bad call (a dtype it does not read, no columns or 2^31 - 1 and more) with nothing written */
static int argmax_rows(const void *x, int32_t dtype, int64_t rows, int64_t cols, int64_t row_stride,
                       int64_t *out) {
    if (dtype < 0 || dtype > 2 || cols <= 0 || cols >= INT32_MAX || rows < 0) return 1;
    const int64_t esz = dtype == 0 ? 4 : 2;
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * row_stride * esz;
        out[r] = dtype == 0 ? ARGMAX_ROW(row, cols, 0) : dtype == 1 ? ARGMAX_ROW(row, cols, 1)
                                                                     : ARGMAX_ROW(row, cols, 2);
    }
    return 0;
}


/* ---- the entry points, timed while the kernel clock is on (pagedattn_abi.h) */

static int32_t clock_on;
static int64_t clock_counts[2 * PAGEDATTN_CLOCK_KINDS];

static int64_t clock_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

void pagedattn_clock(int32_t on) {
    __atomic_store_n(&clock_on, 0, __ATOMIC_RELEASE);
    if (!on) return;
    for (int k = 0; k < 2 * PAGEDATTN_CLOCK_KINDS; k++) __atomic_store_n(&clock_counts[k], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&clock_on, 1, __ATOMIC_RELEASE);
}

void pagedattn_clock_read(int64_t *out) {
    for (int k = 0; k < 2 * PAGEDATTN_CLOCK_KINDS; k++) out[k] = __atomic_load_n(&clock_counts[k], __ATOMIC_RELAXED);
}

int64_t pagedattn_clock_start(void) { return __atomic_load_n(&clock_on, __ATOMIC_RELAXED) ? clock_now() : 0; }

void pagedattn_clock_stop(int32_t kind, int64_t start) {
    if (!start || kind < 0 || kind >= PAGEDATTN_CLOCK_KINDS) return;
    __atomic_fetch_add(&clock_counts[2 * kind], 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&clock_counts[2 * kind + 1], clock_now() - start, __ATOMIC_RELAXED);
}

int pagedattn_paged_decode(const decode_args *a, const int64_t *parts_start) {
    PAGEDATTN_TIMED(PAGEDATTN_CLOCK_DECODE, paged_decode(a, parts_start));
}

int pagedattn_write_kv(const write_args *a) {
    PAGEDATTN_TIMED(PAGEDATTN_CLOCK_WRITE, write_kv(a));
}

int pagedattn_argmax_rows(const void *x, int32_t dtype, int64_t rows, int64_t cols, int64_t row_stride,
                          int64_t *out) {
    PAGEDATTN_TIMED(PAGEDATTN_CLOCK_ARGMAX, argmax_rows(x, dtype, rows, cols, row_stride, out));
}
