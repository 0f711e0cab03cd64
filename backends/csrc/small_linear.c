/* Linear layers of a few rows on the CPU: out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), float32 or bfloat16, sums in
 * float32 and one rounding to the output's dtype (as oneDNN's); and the gated MLP's SiLU(gate) * up between two of
 * them (pagedattn_silu_mul, at the end). Built into the same library as paged_decode.c.
 *
 * Why: a decode step's linears have as many rows as the step has sequences (a few to a few dozen), so each weight
 * is read once for little arithmetic and the step is bound by reading weights. oneDNN costs ~10 us of set-up per
 * call (descriptors, allocations) and, at 16 rows, reads weights from DRAM at about half the copy rate.
 *
 * Three weight layouts, each read once per call, one contiguous stretch per thread with the lines ahead requested:
 * - panels of 64 columns (linear_panels): oneDNN's own packed buffers, whose layout the caller has proved; each row of
 *   x adds one broadcast per k (or pair of k) to the sums of 64 columns, so they need no reduction across lanes; rows
 *   beyond one group of MAX_MR (a decode step's batch) take K in chunks that every group reads from L1; on AMD's CPUs
 *   the weights are asked for non-temporally wherever every pass reads them from L1, so that they do not evict what
 *   the step reads again;
 * - bfloat16 panels of 32 or 64 columns by AMX tiles (linear_amx), where the CPU has AMX and the OS grants it;
 * - plain [N, K] rows (linear_plain): 4 x 4 blocks of (row, column) sums kept in registers along K, then one tree of
 *   shuffles from the block's 16 vectors of partial sums to one vector of 16 totals.
 * bfloat16 takes AVX512-BF16's pair dot products (exact bfloat16 products, float sums; subnormal bfloat16 inputs,
 * below 1.2e-38, count as zero), float32 AVX-512 FMAs. Without AVX-512, float32 takes small_linear_avx2.h's
 * kernels where the CPU has AVX2 and FMA; without either the library reports no linear kernel for the dtype
 * (pagedattn_linear_features) and callers keep oneDNN. */
#include <stdint.h>
#include <string.h>

#include "pagedattn_abi.h"

#if defined(__AVX512F__) && !PAGEDATTN_AVX2_PATHS
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_LINEAR_F32 1
#else
#define HAVE_LINEAR_F32 0
#endif
#if !HAVE_LINEAR_F32 && PAGEDATTN_AVX2_PATHS
#define HAVE_LINEAR_AVX2 1 /* float32 by small_linear_avx2.h */
#else
#define HAVE_LINEAR_AVX2 0
#endif
#if HAVE_LINEAR_F32 && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_LINEAR_BF16 1
#else
#define HAVE_LINEAR_BF16 0
#endif

/* silu_exp's e^r (r = x - n ln 2, ln 2 in two parts) by its polynomial into p, in either vector width: PS the
 * intrinsics' prefix (_mm512, or _mm256 in small_linear_avx2.h), V their vector type */
#define SILU_EXP_POLY(PS, V, x, n, p)                                                       \
    do {                                                                                  \
        V r_ = PS##_fnmadd_ps(n, PS##_set1_ps(0.693359375f), x);                          \
        r_ = PS##_fnmadd_ps(n, PS##_set1_ps(-2.12194440e-4f), r_);                        \
        p = PS##_set1_ps(1.9875691500e-4f);                                               \
        p = PS##_fmadd_ps(p, r_, PS##_set1_ps(1.3981999507e-3f));                         \
        p = PS##_fmadd_ps(p, r_, PS##_set1_ps(8.3334519073e-3f));                         \
        p = PS##_fmadd_ps(p, r_, PS##_set1_ps(4.1665795894e-2f));                         \
        p = PS##_fmadd_ps(p, r_, PS##_set1_ps(1.6666665459e-1f));                         \
        p = PS##_fmadd_ps(p, r_, PS##_set1_ps(5.0000001201e-1f));                         \
        p = PS##_fmadd_ps(PS##_mul_ps(p, r_), r_, PS##_add_ps(r_, PS##_set1_ps(1.0f)));   \
    } while (0)

/* sizes no kernel takes (both widths' linear_kernel refuse them first) */
static inline int linear_sizes_bad(const linear_args *a) {
    return a->M < 0 || a->N < 0 || a->K <= 0 || a->K > (1 << 24) || a->N > (1 << 30);
}

#ifndef LINEAR_PREFETCH_BYTES
#define LINEAR_PREFETCH_BYTES 8192 /* weight bytes requested ahead of the block being read: on a 2-core EPYC, 4 KiB
                                    * and 16 KiB were 0-10 % slower from DRAM, the hardware's prefetch alone ~1.6x */
#endif

static int linear_amx_ready(void);
/* 1 float32, 2 bfloat16, 4 bfloat16 by AMX tiles (layout 2's panels of 32 columns) */
int pagedattn_linear_features(void) {
    return (HAVE_LINEAR_F32 || HAVE_LINEAR_AVX2 ? 1 : 0) | (HAVE_LINEAR_BF16 ? 2 : 0) | (linear_amx_ready() ? 4 : 0);
}

#if HAVE_LINEAR_F32
#include <omp.h>

typedef uint16_t lin_bf16_t;

/* two vectors -> one: a's halves summed in the low half, b's in the high; then quarters, pairs, lanes */
static inline __m512 fold2(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
static inline __m512 fold4(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
static inline __m512 fold8(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
}
static inline __m512 fold16(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

/* acc[m * 4 + n] (16 vectors) -> one vector whose lane m * 4 + n is acc[m * 4 + n]'s lane sum */
static inline __m512 block_totals(const __m512 *acc) {
    __m512 a0 = fold2(acc[0], acc[1]), a1 = fold2(acc[2], acc[3]), a2 = fold2(acc[4], acc[5]);
    __m512 a3 = fold2(acc[6], acc[7]), a4 = fold2(acc[8], acc[9]), a5 = fold2(acc[10], acc[11]);
    __m512 a6 = fold2(acc[12], acc[13]), a7 = fold2(acc[14], acc[15]);
    __m512 b0 = fold4(a0, a1), b1 = fold4(a2, a3), b2 = fold4(a4, a5), b3 = fold4(a6, a7);
    __m512 t = fold16(fold8(b0, b1), fold8(b2, b3));  /* lane n * 4 + m holds acc[m * 4 + n]'s total */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
}

/* The 4 x 4 (rows x columns) sums along K, in block_totals' order: rows x0..x3, weight rows w0..w3 (pointers may
 * repeat: padding). Whole vectors, then one masked step for K's remainder. Inlined so that the 16 sums stay in
 * registers. */
#define SUMS_STEP(LOADW, LOADX, MAC)                                                     \
    do {                                                                                 \
        const VEC_T v0 = LOADW(w0), v1 = LOADW(w1), v2 = LOADW(w2), v3 = LOADW(w3);      \
        const VEC_T u0 = LOADX(x0), u1 = LOADX(x1), u2 = LOADX(x2), u3 = LOADX(x3);      \
        MAC(0, v0, u0); MAC(1, v1, u0); MAC(2, v2, u0); MAC(3, v3, u0);                  \
        MAC(4, v0, u1); MAC(5, v1, u1); MAC(6, v2, u1); MAC(7, v3, u1);                  \
        MAC(8, v0, u2); MAC(9, v1, u2); MAC(10, v2, u2); MAC(11, v3, u2);                \
        MAC(12, v0, u3); MAC(13, v1, u3); MAC(14, v2, u3); MAC(15, v3, u3);              \
    } while (0)

#define VEC_T __m512
#define FMA(i, v, u) acc[i] = _mm512_fmadd_ps(v, u, acc[i])
static inline __attribute__((always_inline)) __m512 sums_f32(const float *x0, const float *x1, const float *x2,
                                                             const float *x3, const float *w0, const float *w1,
                                                             const float *w2, const float *w3, int64_t K) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
#define LOAD(p) _mm512_loadu_ps(p + k)
    for (; k + 16 <= K; k += 16) SUMS_STEP(LOAD, LOAD, FMA);
#undef LOAD
    if (k < K) {
        const __mmask16 mk = (__mmask16)((1u << (K - k)) - 1u);
#define LOAD(p) _mm512_maskz_loadu_ps(mk, p + k)
        SUMS_STEP(LOAD, LOAD, FMA);
#undef LOAD
    }
    return block_totals(acc);
}
#undef FMA
#undef VEC_T

#if HAVE_LINEAR_BF16
#define VEC_T __m512bh
#define DP(i, v, u) acc[i] = _mm512_dpbf16_ps(acc[i], v, u)
static inline __attribute__((always_inline)) __m512 sums_bf16(const lin_bf16_t *x0, const lin_bf16_t *x1,
                                                              const lin_bf16_t *x2, const lin_bf16_t *x3,
                                                              const lin_bf16_t *w0, const lin_bf16_t *w1,
                                                              const lin_bf16_t *w2, const lin_bf16_t *w3, int64_t K) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
#define LOAD(p) (__m512bh) _mm512_loadu_si512(p + k)
    for (; k + 32 <= K; k += 32) SUMS_STEP(LOAD, LOAD, DP);
#undef LOAD
    if (k < K) {
        const __mmask32 mk = (__mmask32)((1u << (K - k)) - 1u);
#define LOAD(p) (__m512bh) _mm512_maskz_loadu_epi16(mk, p + k)
        SUMS_STEP(LOAD, LOAD, DP);
#undef LOAD
    }
    return block_totals(acc);
}
#undef DP
#undef VEC_T
#endif

static inline float lin_bf16_to_f32(lin_bf16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}


/* One 4 x 4 block of out: rows m0.., columns n0.., mb x nb of them valid */
static inline __attribute__((always_inline)) void block(const linear_args *a, int64_t m0, int mb, int64_t n0, int nb, const int bf) {
    const int64_t K = a->K;
    const size_t esz = bf ? 2 : 4;
    const char *xs[4], *ws[4];
    for (int i = 0; i < 4; i++) {
        xs[i] = (const char *)a->x + (size_t)(m0 + (i < mb ? i : mb - 1)) * a->x_row * esz;
        ws[i] = (const char *)a->w + (size_t)(n0 + (i < nb ? i : nb - 1)) * K * esz;
    }
    __m512 t;
#if HAVE_LINEAR_BF16
    if (bf) {
        const lin_bf16_t *const *x = (const lin_bf16_t *const *)xs, *const *w = (const lin_bf16_t *const *)ws;
        t = sums_bf16(x[0], x[1], x[2], x[3], w[0], w[1], w[2], w[3], K);
    } else
#endif
    {
        const float *const *x = (const float *const *)xs, *const *w = (const float *const *)ws;
        t = sums_f32(x[0], x[1], x[2], x[3], w[0], w[1], w[2], w[3], K);
    }
    if (a->bias) {
        float b[4];
        for (int n = 0; n < 4; n++) {
            int64_t c = n0 + (n < nb ? n : nb - 1);
            b[n] = bf ? lin_bf16_to_f32(((const lin_bf16_t *)a->bias)[c]) : ((const float *)a->bias)[c];
        }
        t = _mm512_add_ps(t, _mm512_broadcast_f32x4(_mm_loadu_ps(b)));
    }
    if (bf) {
#if HAVE_LINEAR_BF16
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(t);  /* round to nearest even */
        lin_bf16_t *o = (lin_bf16_t *)a->out + m0 * a->o_row + n0;
        if (mb == 4 && nb == 4) {  /* 8 bytes a row */
            const __m128i lo = _mm256_castsi256_si128(h), hi = _mm256_extracti128_si256(h, 1);
            _mm_storel_epi64((__m128i *)o, lo);
            _mm_storeh_pd((double *)(o + a->o_row), _mm_castsi128_pd(lo));
            _mm_storel_epi64((__m128i *)(o + 2 * a->o_row), hi);
            _mm_storeh_pd((double *)(o + 3 * a->o_row), _mm_castsi128_pd(hi));
        } else {
            lin_bf16_t v[16];
            _mm256_storeu_si256((__m256i *)v, h);
            for (int m = 0; m < mb; m++)
                for (int n = 0; n < nb; n++) o[m * a->o_row + n] = v[m * 4 + n];
        }
#endif
    } else {
        float *o = (float *)a->out + m0 * a->o_row + n0;
        if (mb == 4 && nb == 4) {
            _mm_storeu_ps(o, _mm512_extractf32x4_ps(t, 0));
            _mm_storeu_ps(o + a->o_row, _mm512_extractf32x4_ps(t, 1));
            _mm_storeu_ps(o + 2 * a->o_row, _mm512_extractf32x4_ps(t, 2));
            _mm_storeu_ps(o + 3 * a->o_row, _mm512_extractf32x4_ps(t, 3));
        } else {
            float v[16];
            _mm512_storeu_ps(v, t);
            for (int m = 0; m < mb; m++)
                for (int n = 0; n < nb; n++) o[m * a->o_row + n] = v[m * 4 + n];
        }
    }
}

static int linear_plain(const linear_args *a) {
    const int64_t blocks = (a->N + 3) / 4;
    const size_t row_bytes = (size_t)a->K * (a->dtype == 1 ? 2 : 4);
    const char *w_end = (const char *)a->w + (size_t)a->N * row_bytes;
    int threads = a->num_threads > 0 ? a->num_threads : 1;
    if (threads > blocks) threads = blocks > 0 ? (int)blocks : 1;
#pragma omp parallel num_threads(threads)
    {
        /* one contiguous stretch of weight rows per thread: the reads stay sequential */
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t b0 = blocks * t / T, b1 = blocks * (t + 1) / T;
        const char *stop = (const char *)a->w + (size_t)(b1 * 4 < a->N ? b1 * 4 : a->N) * row_bytes;
        if (stop > w_end) stop = w_end;
        for (int64_t b = b0; b < b1; b++) {
            const int64_t n0 = b * 4;
            const int nb = a->N - n0 < 4 ? (int)(a->N - n0) : 4;
            const char *ahead = (const char *)a->w + (size_t)n0 * row_bytes + LINEAR_PREFETCH_BYTES;
            for (size_t o = 0; o < 4 * row_bytes; o += 64)
                if (ahead + o < stop) _mm_prefetch(ahead + o, _MM_HINT_T0);
            if (a->dtype == 1)  /* the dtype a constant of each inlined copy */
                for (int64_t m0 = 0; m0 < a->M; m0 += 4) block(a, m0, a->M - m0 < 4 ? (int)(a->M - m0) : 4, n0, nb, 1);
            else
                for (int64_t m0 = 0; m0 < a->M; m0 += 4) block(a, m0, a->M - m0 < 4 ? (int)(a->M - m0) : 4, n0, nb, 0);
        }
    }
    return 0;
}

/* Layout 1, oneDNN's packed weights for its AVX-512 GEMMs (AB16b64a2b in bfloat16, AB16b64a in float32): panels of 64
 * columns, N padded to whole panels and K to whole steps of 32 (bfloat16) or 16 (float32) with zeros; a panel is K's
 * steps one after another, a step 16 "slices" of 256 bytes, a slice one k (float32) or one pair of k (bfloat16) for
 * the 64 columns in order. So a slice is four vectors of 16 columns, and each row of x contributes one broadcast
 * value (or pair) per slice: the sums need no reduction across lanes. */
#define PANEL_COLS 64
#define SLICE_BYTES 256
#define MAX_MR 6 /* rows of x a pass over a panel keeps in registers: 6 x 4 sums (4 or 5: no faster) */
#define CHUNKED_ROWS 24 /* up to this many rows (a decode step's batch), K is taken in chunks (linear_panels) */
#ifndef LINEAR_CHUNK_STEPS
#define LINEAR_CHUNK_STEPS 4 /* steps of K (4 KiB of a panel each) a chunk holds: 2 or 8 no faster */
#endif

/* a weight line asked for: non-temporal where every pass reads it from L1 and the CPU is AMD's, so that streaming the
 * weights does not evict what the step reads again (its K/V, activations, the interpreter's data) from L2 and L3;
 * otherwise into every level. Every pass reads from L1 where the call has one group of rows, and where K is taken in
 * chunks (a decode step's batch); the chunked calls only on Zen 5 and later (family 26 on), which measured them faster
 * (a 2-core EPYC, llama16m decode steps at 16 requests: bf16 2-3 %, fp32 3-7 %; a 64 MB model 6 %; a 10 MB one, whose
 * weights L3 could keep, no slower). On Zen 4 (family 25) the chunked calls' weights asked for into L2 instead took
 * llama16m's 25 linears at 8-24 rows 10-18 % less time from DRAM and its decode steps 5-17 % less at 8-16 requests of
 * 176-600 keys (benchmarks/RESULTS.md). On a Xeon (Sapphire Rapids class) non-temporal requests made the 25 linears
 * 1.5-4.5x slower: its hardware prefetchers do not follow them */
static int amd_family(void) {
    static int family = -1; /* -1 not read yet (cpuid traps to a VM's hypervisor: read once); 0 not AMD */
    if (__atomic_load_n(&family, __ATOMIC_RELAXED) < 0) {
        unsigned int eax = 0, ebx, ecx, edx;
        int f = 0;
        if (__builtin_cpu_is("amd") && __get_cpuid(1, &eax, &ebx, &ecx, &edx)) {
            f = (int)((eax >> 8) & 0xf);
            if (f == 0xf) f += (int)((eax >> 20) & 0xff);
        }
        __atomic_store_n(&family, f, __ATOMIC_RELAXED);
    }
    return __atomic_load_n(&family, __ATOMIC_RELAXED);
}
static inline int lin_nta_pays(int chunked) {
    const int family = amd_family();
    return family > 0 && (!chunked || family >= 26);
}

/* where a requested weight line goes: PF_NTA (above), PF_L1 where one group of rows reads each line once, PF_L2 where
 * several groups do (K in chunks or not). A 2-vCPU Xeon (Emerald Rapids class), llama16m's 25 float32 linears with the
 * requests made slice by slice, against a step's made at once: into L1 4-16 % faster at 1-12 rows and 1-6 % at 16-24,
 * into L2 1-14 % and 8 % (benchmarks/RESULTS.md). Measured there only: AMD's CPUs keep PF_NTA where they had it */
enum { PF_L1, PF_L2, PF_NTA };

static inline __attribute__((always_inline)) void lin_prefetch(const char *p, int where) {
    if (where == PF_NTA)
        _mm_prefetch(p, _MM_HINT_NTA);
    else if (where == PF_L2)
        _mm_prefetch(p, _MM_HINT_T1);
    else
        _mm_prefetch(p, _MM_HINT_T0);
}

/* one slice's products: four vectors of 64 columns by each row's x at k (or pair of k) */
static inline __attribute__((always_inline)) void slice_macs(__m512 acc[][4], const char *w, const char *const *xr,
                                                             const int64_t k0, const int sl, const int mr, const int bf,
                                                             const int64_t K) {
    (void)K;
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 64);
    const __m512 w2 = _mm512_loadu_ps(w + 128), w3 = _mm512_loadu_ps(w + 192);
    for (int m = 0; m < mr; m++) {
#if HAVE_LINEAR_BF16
        if (bf) {
            const int64_t k = k0 + 2 * sl;
            uint32_t pair = 0; /* (x[k], x[k + 1]); past K a zero, never read */
            if (k + 1 < K)
                memcpy(&pair, xr[m] + k * 2, 4);
            else
                memcpy(&pair, xr[m] + k * 2, 2);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)w0, xb);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)w1, xb);
            acc[m][2] = _mm512_dpbf16_ps(acc[m][2], (__m512bh)w2, xb);
            acc[m][3] = _mm512_dpbf16_ps(acc[m][3], (__m512bh)w3, xb);
            continue;
        }
#endif
        const __m512 xb = _mm512_set1_ps(((const float *)xr[m])[k0 + sl]);
        acc[m][0] = _mm512_fmadd_ps(w0, xb, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(w1, xb, acc[m][1]);
        acc[m][2] = _mm512_fmadd_ps(w2, xb, acc[m][2]);
        acc[m][3] = _mm512_fmadd_ps(w3, xb, acc[m][3]);
    }
}

/* a slice's four lines requested with a constant hint */
#define PF_SLICE(p, HINT)                                                                         \
    do {                                                                                          \
        const char *pp_ = (p);                                                                    \
        _mm_prefetch(pp_, HINT), _mm_prefetch(pp_ + 64, HINT), _mm_prefetch(pp_ + 128, HINT);     \
        _mm_prefetch(pp_ + 192, HINT);                                                            \
    } while (0)
/* a whole step's 16 slices, each after its requests */
#define STEP_LOOP(REQUEST)                                                                        \
    for (int sl = 0; sl < 16; sl++) {                                                             \
        const char *w = wst + (size_t)sl * SLICE_BYTES;                                           \
        REQUEST;                                                                                  \
        slice_macs(acc, w, xr, k0, sl, mr, bf, K);                                                \
    }
/* STEP_LOOP requesting each slice's four lines at ADDR (an expression of sl and w) with where's hint */
#define STEP_LOOP_HINTED(ADDR)                                                                    \
    if (where == PF_L1) {                                                                         \
        STEP_LOOP(PF_SLICE(ADDR, _MM_HINT_T0))                                                    \
    } else if (where == PF_L2) {                                                                  \
        STEP_LOOP(PF_SLICE(ADDR, _MM_HINT_T1))                                                    \
    } else {                                                                                      \
        STEP_LOOP(PF_SLICE(ADDR, _MM_HINT_NTA))                                                   \
    }

static inline __attribute__((always_inline)) void panel_rows(const linear_args *a, const char *panel, int64_t n0,
                                                             int64_t m0, const int mr, const int bf,
                                                             const char *prefetch_stop, int64_t st0, int64_t st1,
                                                             float *keep, const char *next, int share, int shares,
                                                             const int where) {
    const int64_t K = a->K;
    const int64_t step_k = bf ? 32 : 16;
    const int64_t steps = (K + step_k - 1) / step_k;
    const size_t esz = bf ? 2 : 4;
    const char *xr[MAX_MR];
    for (int m = 0; m < mr; m++) xr[m] = (const char *)a->x + (size_t)(m0 + m) * a->x_row * esz;
    __m512 acc[MAX_MR][4];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = st0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(keep + (m * 4 + j) * 16);
    for (int64_t st = st0; st < st1; st++) {
        const int64_t k0 = st * step_k;
        const int64_t left = K - k0; /* k of this step that x has */
        const int slices = left >= step_k ? 16 : (int)(bf ? (left + 1) / 2 : left);
        const char *wst = panel + (size_t)st * 16 * SLICE_BYTES;
        /* a slice's lines are requested as the slice is read: all 64 of a step requested before its first slice
         * made the Xeon's calls slower (PF_L1 above) */
        const char *nst = next && (st - st0) % shares == share ? next + (st - st0) * 16 * SLICE_BYTES : NULL;
        /* whole steps whose lines ahead all lie before the stop (nearly all) take loops without a test per line;
         * the hint a constant of each copy. A pass requests either its own lines ahead or the next chunk's share
         * (linear_panels gives one of the two); anything else takes the loop with tests below */
        const int whole = slices == 16 && (!prefetch_stop || wst + 16 * SLICE_BYTES + LINEAR_PREFETCH_BYTES <= prefetch_stop);
        if (whole && prefetch_stop && !nst) {
            STEP_LOOP_HINTED(w + LINEAR_PREFETCH_BYTES)
            continue;
        }
        if (whole && nst && !prefetch_stop) {
            STEP_LOOP_HINTED(nst + (size_t)sl * SLICE_BYTES)
            continue;
        }
        if (whole && !prefetch_stop && !nst) {
            STEP_LOOP((void)0)
            continue;
        }
        for (int sl = 0; sl < slices; sl++) {
            const char *w = wst + (size_t)sl * SLICE_BYTES;
            if (prefetch_stop) /* the first pass over the panel brings it in */
                for (int o = 0; o < SLICE_BYTES; o += 64)
                    if (w + LINEAR_PREFETCH_BYTES + o < prefetch_stop) lin_prefetch(w + LINEAR_PREFETCH_BYTES + o, where);
            if (nst) /* a later pass: its share of the next chunk, brought in meanwhile */
                for (int o = 0; o < SLICE_BYTES; o += 64) lin_prefetch(nst + (size_t)sl * SLICE_BYTES + o, where);
            slice_macs(acc, w, xr, k0, sl, mr, bf, K);
        }
    }
    if (st1 < steps) { /* a chunk of K: the sums kept for the next */
        for (int m = 0; m < mr; m++)
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(keep + (m * 4 + j) * 16, acc[m][j]);
        return;
    }
    for (int j = 0; j < 4; j++) {
        const int64_t n = n0 + 16 * j;
        if (n >= a->N) break;
        const __mmask16 mk = a->N - n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (a->N - n)) - 1u);
        __m512 b = _mm512_setzero_ps();
        if (a->bias) {
#if HAVE_LINEAR_BF16
            if (bf)
                b = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, (const lin_bf16_t *)a->bias + n)), 16));
            else
#endif
                b = _mm512_maskz_loadu_ps(mk, (const float *)a->bias + n);
        }
        for (int m = 0; m < mr; m++) {
            const __m512 v = _mm512_add_ps(acc[m][j], b);
#if HAVE_LINEAR_BF16
            if (bf) {
                _mm256_mask_storeu_epi16((lin_bf16_t *)a->out + (m0 + m) * a->o_row + n, mk,
                                         (__m256i)_mm512_cvtneps_pbh(v));  /* round to nearest even */
                continue;
            }
#endif
            _mm512_mask_storeu_ps((float *)a->out + (m0 + m) * a->o_row + n, mk, v);
        }
    }
}

#define PANEL_ROWS_CASES(BF)                                                               \
    switch (mr) {                                                                          \
        case 1: panel_rows(a, panel, n0, m0, 1, BF, pf, st0, st1, kp, nx, sh, shs, where); break;                            \
        case 2: panel_rows(a, panel, n0, m0, 2, BF, pf, st0, st1, kp, nx, sh, shs, where); break;                            \
        case 3: panel_rows(a, panel, n0, m0, 3, BF, pf, st0, st1, kp, nx, sh, shs, where); break;                            \
        case 4: panel_rows(a, panel, n0, m0, 4, BF, pf, st0, st1, kp, nx, sh, shs, where); break;                            \
        case 5: panel_rows(a, panel, n0, m0, 5, BF, pf, st0, st1, kp, nx, sh, shs, where); break;                            \
        default: panel_rows(a, panel, n0, m0, MAX_MR, BF, pf, st0, st1, kp, nx, sh, shs, where); break;                      \
    }

static int linear_panels(const linear_args *a) {
    const int bf = a->dtype == 1;
    const int64_t panels = (a->N + PANEL_COLS - 1) / PANEL_COLS;
    const int64_t steps = (a->K + (bf ? 32 : 16) - 1) / (bf ? 32 : 16);
    const size_t panel_bytes = (size_t)steps * 16 * SLICE_BYTES;
    int threads = a->num_threads > 0 ? a->num_threads : 1;
    if (threads > panels) threads = panels > 0 ? (int)panels : 1;
    /* rows in more than one group: K in chunks of LINEAR_CHUNK_STEPS steps, each chunk read from memory by the first
     * group and then from L1 by the others, which meanwhile bring in the next chunk */
    const int groups = (int)((a->M + MAX_MR - 1) / MAX_MR);
    const int64_t chunk = groups > 1 && a->M <= CHUNKED_ROWS ? LINEAR_CHUNK_STEPS : steps;
    const int where = (groups == 1 || chunk < steps) && lin_nta_pays(groups > 1) ? PF_NTA /* every pass from L1 */
                    : groups == 1 ? PF_L1 : PF_L2;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t p0 = panels * t / T, p1 = panels * (t + 1) / T;
        const char *stop = (const char *)a->w + (size_t)p1 * panel_bytes;
        float keep[CHUNKED_ROWS * PANEL_COLS];  /* each row's 64 sums between chunks */
        for (int64_t p = p0; p < p1; p++) {
            const char *panel = (const char *)a->w + (size_t)p * panel_bytes;
            const int64_t n0 = p * PANEL_COLS;
            for (int64_t st0 = 0; st0 < steps; st0 += chunk) {
                const int64_t st1 = st0 + chunk < steps ? st0 + chunk : steps;
                /* the next chunk: this panel's, else the thread's next panel's first */
                const char *next = st1 < steps ? panel + (size_t)st1 * 16 * SLICE_BYTES
                                 : p + 1 < p1 ? panel + panel_bytes : NULL;
                for (int64_t m0 = 0; m0 < a->M; m0 += MAX_MR) {
                    const int mr = a->M - m0 < MAX_MR ? (int)(a->M - m0) : MAX_MR;
                    const char *pf = m0 == 0 ? stop : NULL;
                    const char *nx = m0 > 0 && chunk < steps ? next : NULL;
                    const int sh = (int)(m0 / MAX_MR) - 1, shs = groups > 1 ? groups - 1 : 1;
                    float *kp = keep + m0 * PANEL_COLS;
#if HAVE_LINEAR_BF16
                    if (bf) {
                        PANEL_ROWS_CASES(1)
                    } else
#endif
                    {
                        PANEL_ROWS_CASES(0)
                    }
                }
            }
        }
    }
    return 0;
}

/* bfloat16 panels by AMX tile dot products, where the CPU and the OS allow them (linear_amx_ready): layout 1's panels
 * of 64 columns and layout 2's of 32 (AB16b32a2b, oneDNN's packing for its AMX GEMMs: a slice is one pair of k for 32
 * columns, 128 bytes). Both are B tiles as they lie: 16 slices (a step of 32 k) of 64 bytes (16 columns) at the
 * slice's stride. A tile is 16 rows of x over a step; each 16 x 16 block of sums is one C tile, so a row's sums never
 * meet another row's. Two row groups and 32 columns at a time (4 C, 2 A, 2 B tiles): a tile product of a step costs
 * ~16 cycles, a few times less than reading its 1 KiB of weights from L2, so the call is bound by reading them once.
 * Rows of x that a tile would read past its end (a last group of fewer than 16 rows, K not a whole number of steps)
 * are read from a zero-padded copy. Each product sums in float32 as vdpbf16ps does (bfloat16 inputs below 1.2e-38
 * count as zero), and a row's sums take the same order whatever the call's other rows. */
#if HAVE_LINEAR_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_LINEAR_AMX 1
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_STAGE_MAX_BYTES (4 << 20) /* zero-padded copies of x beyond this: the call takes another kernel */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* Linux lets a process use AMX's tile data only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
 * the grant is the process's for good, so the answer is kept */
static int linear_amx_ready(void) {
    static int ready = -1; /* -1 not asked yet; the same answer whichever thread asks first */
    if (ready < 0) {
        int ok = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16");
        if (ok) ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
        __atomic_store_n(&ready, ok, __ATOMIC_RELAXED);
    }
    return __atomic_load_n(&ready, __ATOMIC_RELAXED);
}

/* a C tile's 16 x 16 sums (+ bias) into out's rows m0.. (rows of them valid) and columns n.. (up to N) */
static inline void amx_store(const linear_args *a, const float *c, int64_t m0, int rows, int64_t n) {
    if (n >= a->N) return;
    const __mmask16 mk = a->N - n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (a->N - n)) - 1u);
    __m512 b = _mm512_setzero_ps();
    if (a->bias)
        b = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, (const lin_bf16_t *)a->bias + n)), 16));
    for (int r = 0; r < rows; r++)
        _mm256_mask_storeu_epi16((lin_bf16_t *)a->out + (m0 + r) * a->o_row + n, mk,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * 16), b)));
}

static int linear_amx(const linear_args *a, const int cols) {
    const int64_t K = a->K, M = a->M, steps = (K + 31) / 32, kp = steps * 32;
    const int64_t panels = (a->N + cols - 1) / cols;
    const size_t slice = (size_t)cols * 4, step_bytes = 16 * slice, panel_bytes = (size_t)steps * step_bytes;
    const int64_t groups = (M + 15) / 16;
    /* each group of 16 rows: where its A tiles start and the bytes between its rows */
    const int whole_k = K % 32 == 0;
    const int64_t staged = whole_k ? (M % 16 ? 1 : 0) : groups; /* the last group, or every group */
    if (staged * 16 * kp * 2 > AMX_STAGE_MAX_BYTES) return 1;
    lin_bf16_t *stage = NULL;
    if (staged) {
        stage = (lin_bf16_t *)aligned_alloc(64, (size_t)staged * 16 * kp * 2);
        if (!stage) return 1;
        memset(stage, 0, (size_t)staged * 16 * kp * 2);
        for (int64_t g = groups - staged; g < groups; g++)
            for (int64_t r = 0; r < 16 && g * 16 + r < M; r++)
                memcpy(stage + ((g - (groups - staged)) * 16 + r) * kp,
                       (const lin_bf16_t *)a->x + (g * 16 + r) * a->x_row, (size_t)K * 2);
    }
    int threads = a->num_threads > 0 ? a->num_threads : 1;
    if (threads > panels) threads = panels > 0 ? (int)panels : 1;
#pragma omp parallel num_threads(threads)
    {
        amx_tilecfg cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        _tile_loadconfig(&cfg);
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t p0 = panels * t / T, p1 = panels * (t + 1) / T;
        const char *stop = (const char *)a->w + (size_t)p1 * panel_bytes;
        float c[4][256] __attribute__((aligned(64)));
        for (int64_t p = p0; p < p1; p++) {
            const char *panel = (const char *)a->w + (size_t)p * panel_bytes;
            for (int cb = 0; cb < cols / 32; cb++) {
                const int64_t n0 = p * cols + cb * 32;
                if (n0 >= a->N) break;
                for (int64_t g = 0; g < groups; g += 2) {
                    const int two = g + 1 < groups;
                    const char *xa[2];
                    size_t xs[2];
                    for (int i = 0; i < 1 + two; i++) {
                        const int64_t gi = g + i;
                        if (gi >= groups - staged) {
                            xa[i] = (const char *)(stage + (gi - (groups - staged)) * 16 * kp), xs[i] = (size_t)kp * 2;
                        } else {
                            xa[i] = (const char *)a->x + (size_t)gi * 16 * a->x_row * 2, xs[i] = (size_t)a->x_row * 2;
                        }
                    }
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    const int first = cb == 0 && g == 0; /* the first pass over the panel brings it in */
                    for (int64_t st = 0; st < steps; st++) {
                        const char *wst = panel + (size_t)st * step_bytes;
                        if (first)
                            for (size_t o = 0; o < step_bytes; o += 64)
                                if (wst + LINEAR_PREFETCH_BYTES + o < stop) _mm_prefetch(wst + LINEAR_PREFETCH_BYTES + o, _MM_HINT_T0);
                        const char *wb = wst + cb * 128;
                        _tile_loadd(6, wb, slice);
                        _tile_loadd(7, wb + 64, slice);
                        _tile_loadd(4, xa[0] + st * 64, xs[0]);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        if (two) {
                            _tile_loadd(5, xa[1] + st * 64, xs[1]);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    _tile_stored(0, c[0], 64);
                    _tile_stored(1, c[1], 64);
                    if (two) {
                        _tile_stored(2, c[2], 64);
                        _tile_stored(3, c[3], 64);
                    }
                    for (int i = 0; i < 1 + two; i++) {
                        const int64_t m0 = (g + i) * 16;
                        const int rows = M - m0 < 16 ? (int)(M - m0) : 16;
                        amx_store(a, c[2 * i], m0, rows, n0);
                        amx_store(a, c[2 * i + 1], m0, rows, n0 + 16);
                    }
                }
            }
        }
        _tile_release();
    }
    free(stage);
    return 0;
}
#else
#define HAVE_LINEAR_AMX 0
static int linear_amx_ready(void) { return 0; }
static int linear_amx(const linear_args *a, const int cols) {
    (void)a, (void)cols;
    return 1;
}
#endif

/* 0 done; 1 a dtype, layout or size this build does not take, 2 a weight buffer of another size than the layout's
 * (nothing written) */
static int linear_kernel(const linear_args *a) {
    if (linear_sizes_bad(a)) return 1;
    if (a->dtype == 1 ? !HAVE_LINEAR_BF16 : a->dtype != 0) return 1;
    const int64_t esz = a->dtype == 1 ? 2 : 4, step_k = a->dtype == 1 ? 32 : 16;
    const int64_t steps = (a->K + step_k - 1) / step_k;
    if (a->layout == 0) return a->N * a->K * esz != a->w_bytes ? 2 : linear_plain(a);
    if (a->layout == 1) {
        if ((a->N + PANEL_COLS - 1) / PANEL_COLS * steps * 16 * SLICE_BYTES != a->w_bytes) return 2;
        if (a->dtype == 1 && linear_amx_ready() && linear_amx(a, PANEL_COLS) == 0) return 0;
        return linear_panels(a);
    }
    if (a->layout == 2) { /* bfloat16 panels of 32 columns: AMX only */
        if (a->dtype != 1 || !linear_amx_ready()) return 1;
        if ((a->N + 31) / 32 * steps * 16 * 128 != a->w_bytes) return 2;
        return linear_amx(a, 32);
    }
    return 1;
}

/* SiLU(gate) * up, the gated MLP's activation between its linears: x / (1 + e^-x) * up in float32, one rounding to
 * the output's dtype (to nearest even, as Inductor's fused kernel computes it, without rounding SiLU's result first).
 * e^-x by the polynomial of paged_common.h's exp_neg and vscalefps (which gives inf past float's range and zero below
 * it), its argument clamped to [-104, 89] first: past those e^-x is inf or 0 in float32 all the same, and x's own
 * inf, -inf and NaN then give what the formula gives (inf, NaN, NaN). Inductor's kernel (Sleef's exp, ~1 ulp) took
 * 337 us on [1020, 2048] bfloat16 at 2 threads, this one 211 us (benchmarks/RESULTS.md). bfloat16 only where the
 * linears take it (native.linear_dtypes); elsewhere the operator computes it by ATen and the pass leaves it out. */
static inline __m512 silu_exp(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 p;
    SILU_EXP_POLY(_mm512, __m512, x, n, p);
    return _mm512_scalef_ps(p, n);
}

static inline __m512 silu_times(__m512 x, __m512 u) {
    const __m512 arg = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(-104.0f)),
                                     _mm512_set1_ps(89.0f)); /* a NaN x: max gives -104, and x/... stays NaN */
    return _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(silu_exp(arg), _mm512_set1_ps(1.0f))), u);
}

/* bfloat16 where the linears take it (AVX512-BF16), rounded by vcvtneps2bf16: to nearest even, a NaN a quiet NaN, and
 * results below bfloat16's normal range (1.2e-38) flushed to zero, which the linear after the activation reads as
 * zeros anyway (this file's pair dot products, as oneDNN's bfloat16 GEMMs). Rounding by integer arithmetic instead
 * (paged_common.h's f32_to_bf16 on 32 lanes), which keeps them, took the kernel 1.2x the time. */
#if HAVE_LINEAR_BF16 && defined(__AVX512VL__)
#define HAVE_SILU_BF16 1
static inline __m512i silu_to_bf16(__m512 a, __m512 b) { /* a's 16, then b's */
    return _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(a)), (__m256i)_mm512_cvtneps_pbh(b), 1);
}
#else
#define HAVE_SILU_BF16 0
#endif

static inline __m512 silu_load(const char *p, int bf, __mmask16 mk) {
#if HAVE_SILU_BF16
    if (bf) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, p)), 16));
#endif
    return _mm512_maskz_loadu_ps(mk, p);
}

static inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xffff : n > 0 ? (__mmask16)((1u << n) - 1u) : 0; }

/* 0 done; 1 a dtype or size this build does not take (nothing written) */
static int silu_mul_kernel(const silu_mul_args *a) {
    if (a->rows < 0 || a->cols < 0 || (a->dtype != 0 && (a->dtype != 1 || !HAVE_SILU_BF16))) return 1;
    const int bf = a->dtype == 1;
    const size_t esz = bf ? 2 : 4;
    const int64_t rows = a->rows, cols = a->cols;
    int threads = a->num_threads > 0 ? a->num_threads : 1;
    if (rows * cols < 8192) threads = 1; /* a few rows: a second thread saves about what starting it costs */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < rows; i++) {
        const char *g = (const char *)a->gate + (size_t)i * a->gate_row * esz;
        const char *u = (const char *)a->up + (size_t)i * a->up_row * esz;
        char *o = (char *)a->out + (size_t)i * a->out_row * esz;
        for (int64_t j = 0; j < cols; j += 32) { /* two vectors of 16 columns (the second maybe empty) */
            const __mmask16 m0 = lanes(cols - j), m1 = lanes(cols - j - 16);
            const __m512 v0 = silu_times(silu_load(g + j * esz, bf, m0), silu_load(u + j * esz, bf, m0));
            const __m512 v1 = silu_times(silu_load(g + (j + 16) * esz, bf, m1), silu_load(u + (j + 16) * esz, bf, m1));
#if HAVE_SILU_BF16
            if (bf) {
                _mm512_mask_storeu_epi16(o + j * esz, (__mmask32)m0 | (__mmask32)m1 << 16, silu_to_bf16(v0, v1));
                continue;
            }
#endif
            _mm512_mask_storeu_ps(o + j * esz, m0, v0);
            _mm512_mask_storeu_ps(o + (j + 16) * esz, m1, v1);
        }
    }
    return 0;
}

#elif HAVE_LINEAR_AVX2
#include "small_linear_avx2.h"
#else
static int linear_amx_ready(void) { return 0; }
static int linear_kernel(const linear_args *a) {
    (void)a;
    return 1;
}
static int silu_mul_kernel(const silu_mul_args *a) {
    (void)a;
    return 1;
}
#endif

/* the entry points, timed while the kernel clock is on (pagedattn_abi.h) */
int pagedattn_linear(const linear_args *a) {
    PAGEDATTN_TIMED(PAGEDATTN_CLOCK_LINEAR, linear_kernel(a));
}

int pagedattn_silu_mul(const silu_mul_args *a) {
    PAGEDATTN_TIMED(PAGEDATTN_CLOCK_SILU_MUL, silu_mul_kernel(a));
}
