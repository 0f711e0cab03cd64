/* Prefill on the CPU (one library with paged_decode.c, built by native.py): the queries of a run of a sequence over
 * that sequence's own keys (K/V rows of a tensor, not the paged cache): causal, optionally within a window, or not
 * causal; float32 sums over any of the three dtypes, the softmax's weights rounded to bfloat16 before they weigh
 * bfloat16 values (as paged_decode.c's, and the model's own bfloat16 attention).
 *
 * The keys are first transposed, per item and KV head, into tiles of [D][16] floats: a tile's scores for one query
 * row are then D fused multiply-adds on 16 keys at once, the row's query element broadcast. A unit is (item, KV head,
 * heads of its group, block of query positions): PM query rows whose score vectors stay in registers over a tile;
 * the scores of PCH tiles are then softmaxed together (one maximum, one rescale of the sums and no masks where every
 * row sees every key: ~20 % of a prefill's time against a tile at a time), and, per 16-float chunk of the head, PM
 * weighted sums stay in registers over those tiles' value rows. Head sizes that are multiples of 16, up to 256.
 * A term by distance (prefill_args' rel) is added to the scores after the scale: keys it makes -inf weigh exactly 0,
 * and a query that sees no key at all gets zeros. Rows may see runs of keys of their own (prefill_args' bounds: a
 * position program's mask, each row's one run) in place of causality and the window. */
#include "paged_common.h"

#if defined(__GNUC__) && !defined(__clang__)
/* GCC's -O3 takes ~16 s more here for its 24 instantiations (6 head sizes x 4 dtype paths) and makes them no faster
 * than -O2 (same-process timings of both builds); the decode kernel does need -O3 (~1.5x slower at -O2) */
#pragma GCC push_options
#pragma GCC optimize("O2")
#endif
#define PM 24  /* query rows of a unit */
#define PCH 8  /* tiles of keys a unit's softmax takes at once: one maximum, one rescale per 128 keys (kernel_ab.py
                * --kernel prefill: 0.94-0.96x the time of 64 in bf16, 0.97-0.98x in fp32; 256: slower than 128 on the mix) */


/* keys (indices into the item's keys) a query at position qpos sees: [*klo, *khi); bounds: the row's own run */
static inline void prefill_seen(const prefill_args *a, const int64_t *it, int64_t qpos, const int64_t *bounds,
                                int64_t *klo, int64_t *khi) {
    int64_t lo = 0, hi = it[4];
    if (bounds) {
        lo = bounds[0];
        hi = bounds[1];
    } else if (a->causal) {
        hi = qpos - it[5] + 1;
        if (a->window > 0) lo = qpos - a->window + 1 - it[5];
    }
    *klo = lo > 0 ? lo : 0;
    *khi = hi < it[4] ? hi : it[4];
}

#if HAVE_DPBF16
/* a chunk's weighted value rows by pair dot products: acc [PM][D] += sum over its keys t < n of bf16(p[r][t]) * v[t]
 * (p [PM][PCH * 16], v[t] at vrow + t * v_row_bytes, bfloat16), two keys a product. The weights are rounded to
 * bfloat16 first, as a bfloat16 model's own attention rounds them (Hugging Face's eager softmax cast to the model's
 * dtype, ATen's CPU flash kernel); the products are exact and their sums float32 */
static inline __attribute__((always_inline)) void weighted_pairs(float *acc, const float *p, const char *vrow,
                                                                 int64_t v_row_bytes, int64_t n, int nt, const int D) {
    uint32_t pb[PM][PCH * VL / 2];  /* row r's weights as bfloat16 pairs: pb[r][i] = (p[r][2i], p[r][2i + 1]) */
    for (int r = 0; r < PM; r++)
        for (int i = 0; 2 * i < nt; i++) {
            const __m512 lo = _mm512_loadu_ps(p + r * (PCH * VL) + 32 * i);
            const __m512 hi = 2 * i + 1 < nt ? _mm512_loadu_ps(p + r * (PCH * VL) + 32 * i + VL) : _mm512_setzero_ps();
            _mm512_storeu_si512(pb[r] + VL * i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    /* two value rows' 16 elements interleaved: element 2i of key t's, 2i + 1 of key t + 1's */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int c = 0; c < D / VL; c++) {
        __m512 x[PM];
#pragma GCC unroll 24
        for (int r = 0; r < PM; r++) x[r] = _mm512_loadu_ps(acc + r * D + c * VL);
        for (int64_t t = 0; t < n; t += 2) {
            const char *row = vrow + t * v_row_bytes + c * VL * 2;
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)row);
            /* an odd count's last pair: a zero row, never read past the keys */
            const __m256i v1 = t + 1 < n ? _mm256_loadu_si256((const __m256i *)(row + v_row_bytes)) : _mm256_setzero_si256();
            const __m512bh vp = (__m512bh)_mm512_permutexvar_epi16(
                pairs, _mm512_inserti64x4(_mm512_castsi256_si512(v0), v1, 1));
#pragma GCC unroll 24
            for (int r = 0; r < PM; r++)
                x[r] = _mm512_dpbf16_ps(x[r], vp, (__m512bh)_mm512_set1_epi32((int)pb[r][t / 2]));
        }
#pragma GCC unroll 24
        for (int r = 0; r < PM; r++) _mm512_storeu_ps(acc + r * D + c * VL, x[r]);
    }
}
#endif

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
    const float *rel[PM];  /* with a term by distance: row r's for key j at rel[r][j] (padding rows: a live one's) */
    const int has_rel = a->rel != NULL;
    int live = -1;
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
        prefill_seen(a, it, it[2] + i, a->bounds ? a->bounds + 2 * (it[0] + i) : NULL, &klo[r], &khi[r]);
        if (a->rel) {
            rel[r] = a->rel + item * a->rel_item + h * a->rel_head + nq - 1 - i;
            live = live < 0 ? r : live;
        }
        if (klo[r] < khi[r]) {
            first = klo[r] < first ? klo[r] : first;
            last = khi[r] > last ? khi[r] : last;
            seen_lo = klo[r] > seen_lo ? klo[r] : seen_lo;
            seen_hi = khi[r] < seen_hi ? khi[r] : seen_hi;
        }
    }
    if (a->rel && live >= 0)
        for (int r = 0; r < PM; r++)
            if (r / hb >= QB || qb * QB + r / hb >= nq || g0 + r % hb >= G) rel[r] = rel[live];
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
        /* masks where some live row does not see every key of the chunk, and wherever a term by distance may hide
         * some (-inf): those keys' weights are then exactly 0 */
        const int masked = !(j0 >= seen_lo && j0 + nt * VL <= seen_hi) || has_rel;
        for (int r = 0; r < PM; r++) {
            float *pr = p + r * (PCH * VL);
            vf sc[PCH], top_v = (vf){} - INFINITY;
            vi seen[PCH];
            if (klo[r] < khi[r]) {
                for (int tt = 0; tt < nt; tt++) {
                    sc[tt] = vload(pr + tt * VL);
                    if (masked) {
                        const vi key = lane + (int)(j0 + tt * VL);
                        seen[tt] = ~vilt(key, (vi){} + (int)klo[r]) & vilt(key, (vi){} + (int)khi[r]);
                        if (has_rel) {
                            sc[tt] += vload(rel[r] + j0 + tt * VL);
                            seen[tt] &= vne(sc[tt], (vf){} - INFINITY);
                        }
                        sc[tt] = vselect(seen[tt], sc[tt], (vf){} - INFINITY);
                    }
                    top_v = vselect(vgt(sc[tt], top_v), sc[tt], top_v);
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
                if (masked) pv = (vf)((vi)pv & seen[tt]);
                sum += pv;
                vstore(pr + tt * VL, pv);
            }
            vstore(l + r * VL, sum);
        }
        /* keys from `last` on are no live row's (their weights are zeros): their values are left out */
        const int64_t n = last - j0 < nt * VL ? last - j0 : nt * VL;
        const char *vrow = (const char *)a->value + ((it[3] + j0) * a->v_row + kvh * a->v_head) * esz;
#if HAVE_DPBF16
        if (DP) {
            weighted_pairs(acc, p, vrow, a->v_row * esz, n, nt, D);
            continue;
        }
#endif
        if (DT == 1)  /* the weights rounded to bfloat16, as weighted_pairs takes them */
            for (int r = 0; r < PM; r++)
                for (int64_t t = 0; t < n; t += VL) vstore(p + r * (PCH * VL) + t, round_bf16(vload(p + r * (PCH * VL) + t)));
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
        const float den = hadd16(vload(l + r * VL));
        const float inv = den > 0.0f ? 1.0f / den : 0.0f;  /* 0: a term hid every key it sees */
        for (int d = 0; d < D; d++) store_dt(DT, dst, d, acc[r * D + d] * inv);
    }
}

/* dst[c * 16 + t] = rows[t][c] for c < n, 32-bit elements (rows[t] NULL: zeros): a tile of 16 rows transposed 16
 * columns at a time by four rounds of shuffles where the target has AVX-512 (element by element, ~4 % of a prefill of
 * short prompts went to this) */
static inline void transpose_tile(uint32_t *dst, const uint32_t *const *rows, int n) {
#if defined(__AVX512F__)
    for (int c0 = 0; c0 < n; c0 += 16) {
        const int w = n - c0 < 16 ? n - c0 : 16;
        const __mmask16 mk = (__mmask16)((1u << w) - 1u);
        __m512i r[16], t[16];
        for (int i = 0; i < 16; i++) r[i] = rows[i] ? _mm512_maskz_loadu_epi32(mk, rows[i] + c0) : _mm512_setzero_si512();
        for (int i = 0; i < 16; i += 2) {  /* pairs of rows: elements interleaved */
            t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
            t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
        }
        for (int i = 0; i < 16; i += 4) {  /* fours of rows: pairs interleaved */
            r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
            r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
            r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
            r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
        }
        for (int i = 0; i < 16; i += 8)  /* then 128-bit quarters across rows 8 apart and 4 apart */
            for (int j = 0; j < 4; j++) {
                t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
                t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
            }
        for (int j = 0; j < 8; j++) {
            r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
            r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
        }
        for (int c = 0; c < w; c++) _mm512_storeu_si512(dst + (c0 + c) * 16, r[c]);
    }
#else
    for (int t = 0; t < VL; t++)
        for (int c = 0; c < n; c++) {
            uint32_t v = 0;
            if (rows[t]) memcpy(&v, rows[t] + c, 4);
            dst[c * VL + t] = v;
        }
#endif
}

/* an item's keys of one KV head as tiles [ceil(keys / 16)][D][16] of floats (zeros past the last key); bfloat16 keys
 * where the pair dot products are built as tiles [D / 2][16] of pairs of bfloat16 (the first half of a tile's room) */
static inline __attribute__((always_inline)) void prefill_transpose(const prefill_args *a, float *kt, int64_t item,
                                                                    int kvh, int64_t tile, const int D,
                                                                    const int DT, const int DP) {
    const int64_t *it = a->items + 6 * item;
    const int64_t esz = DT == 0 ? 4 : 2;
    const uint32_t *rows[VL];  /* each key's row as 32-bit elements: floats, or pairs of bfloat16 */
    float wide[VL][PAGEDATTN_PREFILL_MAX_HEAD];  /* bfloat16 or float16 keys widened to floats (not the pairs) */
    for (int t = 0; t < VL; t++) {
        const int64_t j = tile * VL + t;
        rows[t] = NULL;
        if (j >= it[4]) continue;
        const char *src = (const char *)a->key + ((it[3] + j) * a->k_row + kvh * a->k_head) * esz;
        if (DT == 0 || DP) {
            rows[t] = (const uint32_t *)src;
        } else {
            load_rows(wide[t], &src, 1, D, DT);
            rows[t] = (const uint32_t *)wide[t];
        }
    }
    transpose_tile((uint32_t *)(kt + tile * (int64_t)D * VL), rows, DP ? D / 2 : D);
}

/* bfloat16 prefill scores by pair dot products (DP) or widened to float32 FMAs: pairs where they pay, AMD's CPUs
 * (a 2-core EPYC, Zen 5: the kernel ~2x faster); on a Sapphire Rapids class Xeon, whose pair dot products issue at
 * half the rate of its FMAs, widening was 25-35 % faster (4 x 250 and 1 x 1024 tokens). PAGEDATTN_PREFILL_PAIRS takes
 * pairs on any CPU that has them (tests) */
int pagedattn_prefill_pairs_pay(void) {
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

/* 0 when every row the call reads or writes is in bounds, else 1 (sizes), 2 (an item's rows), 3 (the term's rows),
 * 4 (the rows' runs) */
static int prefill_check(const prefill_args *a) {
    const int D = a->head_size;
    if (D <= 0 || D > 256 || D % VL || a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads) return 1;
    if (a->rel && (a->rel_item < 0 || a->rel_head < 0)) return 3;
    for (int64_t i = 0; i < a->num_items; i++) {
        const int64_t *it = a->items + 6 * i;
        if (it[0] < 0 || it[1] < 0 || it[0] + it[1] > a->num_q_rows) return 2;
        if (it[3] < 0 || it[4] < 0 || it[3] + it[4] > a->num_k_rows) return 2;
        if (a->bounds && it[0] + it[1] > a->num_bounds) return 4;
        if (a->rel && it[1] > 0 && it[4] > 0 &&
            i * a->rel_item + (int64_t)(a->num_heads - 1) * a->rel_head + it[1] + it[4] + VL - 1 > a->rel_numel)
            return 3;
    }
    return 0;
}

static int prefill(const prefill_args *a) {
    const int bad = prefill_check(a);
    if (bad) return bad;
    const int H = a->num_heads, Hkv = a->num_kv_heads, G = H / Hkv, D = a->head_size;
    const int hb = G < PM ? G : PM, QB = PM / hb, hblocks = (G + hb - 1) / hb;
    /* one choice for the call: the scratch holds its key tiles' layout */
    const int pairs = pagedattn_prefill_pairs_pay();
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

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

int pagedattn_prefill(const prefill_args *a) {
    PAGEDATTN_TIMED(PAGEDATTN_CLOCK_PREFILL, prefill(a));
}
