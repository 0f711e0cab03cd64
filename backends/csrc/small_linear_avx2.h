/* small_linear.c's kernels for CPUs with AVX2 and FMA but no AVX-512 (AMD's Zen 2 and 3, Intel's client cores): the
 * float32 linears in both of its layouts and SiLU(gate) * up in float32. Included by small_linear.c in the place of
 * its AVX-512 kernels (pagedattn_abi.h's PAGEDATTN_AVX2_PATHS). bfloat16 is left to the caller
 * (no linear kernel reported): oneDNN packs no bfloat16 weights on these CPUs, and a step there runs its bfloat16
 * matmuls in float32 (rewriter/program.py's cpu_fp32_matmuls).
 *
 * Why: on a 2-vCPU EPYC (Zen 3), oneDNN's float32 linears at a decode step's 1-16 rows took 1.1-1.4x these kernels'
 * time (its set-up per call, and its AVX2 GEMM's blocking for many rows); from 24 rows on the two are within 5 %
 * (benchmarks/RESULTS.md).
 *
 * Sixteen vector registers of 8 lanes (against AVX-512's 32 of 16) set the blocking:
 * - panels (layout 1, oneDNN's packing of 64 columns, the same bytes on these CPUs as on AVX-512 ones): a slice's
 *   64 columns are four cache lines; a pass takes L of them for up to 6 / L rows (one row all four, two or three rows
 *   two, more rows one line for six at a time: 12 sums in registers), each row adding one broadcast of x per k. K
 *   goes in chunks of AVX2_CHUNK_STEPS steps that every pass reads from L1, the sums kept between chunks in a
 *   buffer, while the first group's passes request the chunk AVX2_PF_AHEAD chunks on. Each sum takes its k in order
 *   by one FMA each, as the AVX-512 kernel's: the two give the same bits, and a row's sums never depend on the
 *   call's other rows;
 * - plain [N, K] rows (layout 0, MKL's weights for a step of one row): R rows x C weight rows of dot products in
 *   registers along K (R * C <= 12), then each vector's lanes summed. */
#include <immintrin.h>
#include <omp.h>

static int linear_amx_ready(void) { return 0; }

/* lanes [0, n) of 8 set, for maskload / maskstore */
static inline __m256i avx2_lanes(int64_t n) {
    const int c = n <= 0 ? 0 : n >= 8 ? 8 : (int)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline float avx2_hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* ---- layout 0: [N, K] rows ---- */

/* v<i> for a constant i: the kernels' registers are named values, not arrays (see AVX2_PSLOTS) */
#define AVX2_PICK8(v, i) \
    ((i) == 0 ? v##0 : (i) == 1 ? v##1 : (i) == 2 ? v##2 : (i) == 3 ? v##3 : (i) == 4 ? v##4 : (i) == 5 ? v##5 \
     : (i) == 6 ? v##6 : v##7)

/* the block's sums as named registers, p<s> for row s / C and weight row s % C (an array of them GCC kept in memory) */
#define AVX2_PSLOTS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define AVX2_PDECLARE(s) __m256 p##s = _mm256_setzero_ps();
#define AVX2_PICK4(v, i) ((i) == 0 ? v##0 : (i) == 1 ? v##1 : (i) == 2 ? v##2 : v##3)
#define AVX2_PFMA(s, LOAD)                                                                                   \
    if ((s) < R * C)                                                                                         \
        p##s = _mm256_fmadd_ps(LOAD(AVX2_PICK8(w, (s) % C)), LOAD(AVX2_PICK4(x, (s) / C)), p##s);
#define AVX2_PFMA_WHOLE(s) AVX2_PFMA(s, AVX2_PLOAD)
#define AVX2_PFMA_TAIL(s) AVX2_PFMA(s, AVX2_PMASKLOAD)
#define AVX2_PLOAD(p) _mm256_loadu_ps((p) + k)
#define AVX2_PMASKLOAD(p) _mm256_maskload_ps((p) + k, mk)
#define AVX2_PSTORE(s)                                                                                       \
    if ((s) < R * C && (s) / C < rv && (s) % C < cv) {                                                       \
        float v = avx2_hsum(p##s);                                                                           \
        if (a->bias) v += ((const float *)a->bias)[n0 + (s) % C];                                            \
        ((float *)a->out)[(m0 + (s) / C) * a->o_row + n0 + (s) % C] = v;                                     \
    }
#define AVX2_PROW(i) const float *x##i = (const float *)a->x + (m0 + ((i) < rv ? (i) : rv - 1)) * a->x_row;
#define AVX2_PCOL(i) const float *w##i = (const float *)a->w + (n0 + ((i) < cv ? (i) : cv - 1)) * K;

/* out[m0 + r, n0 + c] for r < R, c < C (rows of x and of w past rv / cv repeat the last valid one, whose sums are
 * dropped) */
static inline __attribute__((always_inline)) void avx2_plain_block(const linear_args *a, int64_t m0, const int R,
                                                                   int rv, int64_t n0, const int C, int cv) {
    const int64_t K = a->K;
    AVX2_PROW(0) AVX2_PROW(1) AVX2_PROW(2) AVX2_PROW(3)
    AVX2_PCOL(0) AVX2_PCOL(1) AVX2_PCOL(2) AVX2_PCOL(3) AVX2_PCOL(4) AVX2_PCOL(5) AVX2_PCOL(6) AVX2_PCOL(7)
    AVX2_PSLOTS(AVX2_PDECLARE)
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        AVX2_PSLOTS(AVX2_PFMA_WHOLE)
    }
    if (k < K) {
        const __m256i mk = avx2_lanes(K - k);
        AVX2_PSLOTS(AVX2_PFMA_TAIL)
    }
    AVX2_PSLOTS(AVX2_PSTORE)
}

/* every group of R rows over weight rows [n0, n0 + C) */
#define AVX2_PLAIN_ROWS(R, C)                                                                   \
    for (int64_t m0 = 0; m0 < a->M; m0 += (R)) {                                                \
        const int rv = a->M - m0 < (R) ? (int)(a->M - m0) : (R);                                \
        avx2_plain_block(a, m0, (R), rv, n0, (C), cv);                                           \
    }

static int linear_plain(const linear_args *a) {
    /* R x C: one row takes 8 weight rows a pass (each k's x in one register), two 4, more 4 x 3 */
    const int C = a->M == 1 ? 8 : a->M == 2 ? 4 : 3;
    const int64_t blocks = (a->N + C - 1) / C;
    const size_t row_bytes = (size_t)a->K * 4;
    int threads = a->num_threads > 0 ? a->num_threads : 1;
    if (threads > blocks) threads = blocks > 0 ? (int)blocks : 1;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t b0 = blocks * t / T, b1 = blocks * (t + 1) / T;
        const char *stop = (const char *)a->w + (size_t)(b1 * C < a->N ? b1 * C : a->N) * row_bytes;
        for (int64_t b = b0; b < b1; b++) {
            const int64_t n0 = b * C;
            const int cv = a->N - n0 < C ? (int)(a->N - n0) : C;
            const char *ahead = (const char *)a->w + (size_t)n0 * row_bytes + LINEAR_PREFETCH_BYTES;
            for (size_t o = 0; o < (size_t)C * row_bytes; o += 64)
                if (ahead + o < stop) _mm_prefetch(ahead + o, _MM_HINT_T0);
            if (C == 8) {
                AVX2_PLAIN_ROWS(1, 8)
            } else if (C == 4) {
                AVX2_PLAIN_ROWS(2, 4)
            } else {
                AVX2_PLAIN_ROWS(4, 3)
            }
        }
    }
    return 0;
}

/* ---- layout 1: panels of 64 columns ---- */

#define PANEL_COLS 64
#define SLICE_BYTES 256
#define STEP_BYTES (16 * SLICE_BYTES) /* 16 k of a panel */
#define AVX2_MR 6                     /* rows a pass keeps in registers: 6 x 2 sums, 2 weight vectors, 1 broadcast */
#define AVX2_ROW_BLOCK 128            /* rows whose sums the keep buffer holds (cpu_linear.SMALL_ROWS) */
#ifndef AVX2_CHUNK_STEPS
#define AVX2_CHUNK_STEPS 2 /* steps of K a chunk holds (8 KiB of a panel) */
#endif
#ifndef AVX2_PF_AHEAD
#define AVX2_PF_AHEAD 2 /* chunks between the one read and the one requested (1, 4, 8: within the host's noise) */
#endif

/* the sums of a pass as twelve named registers, c<s> for row s / (2 L) and vector s % (2 L): GCC kept an array of
 * them in memory between the slices (2.5x the time), names it keeps in registers */
#define AVX2_SLOTS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define AVX2_USED(s) ((s) / (2 * L) < mr)
#define AVX2_DECLARE(s) __m256 c##s = _mm256_setzero_ps();
#define AVX2_LOAD(s) \
    if (AVX2_USED(s) && st0 > 0) c##s = _mm256_loadu_ps(keep + (s) / (2 * L) * PANEL_COLS + (s) % (2 * L) * 8);
#define AVX2_KEEP(s) \
    if (AVX2_USED(s)) _mm256_storeu_ps(keep + (s) / (2 * L) * PANEL_COLS + (s) % (2 * L) * 8, c##s);
#define AVX2_ROWS8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define AVX2_WLOAD(j) const __m256 w##j = (j) < 2 * L ? _mm256_loadu_ps(w + 8 * (j)) : _mm256_setzero_ps();
/* row by row, each row's broadcast beside its products (all six broadcasts first took registers the sums need) */
#define AVX2_FMA(s)                                                                                          \
    if (AVX2_USED(s))                                                                                        \
        c##s = _mm256_fmadd_ps(AVX2_PICK8(w, (s) % (2 * L)),                                                 \
                               _mm256_broadcast_ss(AVX2_PICK6(xp, (s) / (2 * L)) + k0 + sl), c##s);
#define AVX2_PICK6(v, i) ((i) == 0 ? v##0 : (i) == 1 ? v##1 : (i) == 2 ? v##2 : (i) == 3 ? v##3 : (i) == 4 ? v##4 : v##5)
#define AVX2_XPTR(m) const float *xp##m = (const float *)a->x + (m0 + ((m) < mr ? (m) : 0)) * a->x_row;

/* rows [m0, m0 + mr) of x over lines [q, q + L) (16 L columns) of a panel's steps [st0, st1): the sums from keep
 * (zeros at K's start) and back into it. Where pf is given (the first group's passes), each slice also requests L
 * lines of the chunk at pf, in the order they lie: the group's passes together request all of them */
static inline __attribute__((always_inline)) void avx2_line_rows(const char *panel, const linear_args *a, int64_t m0,
                                                                 const int mr,
                                                                 const int L, const int q, int64_t st0, int64_t st1,
                                                                 int64_t K, float *keep, const char *pf) {
    AVX2_XPTR(0) AVX2_XPTR(1) AVX2_XPTR(2) AVX2_XPTR(3) AVX2_XPTR(4) AVX2_XPTR(5)
    AVX2_SLOTS(AVX2_DECLARE)
    AVX2_SLOTS(AVX2_LOAD)
    const char *pl = pf ? pf + (size_t)q * (st1 - st0) * STEP_BYTES / 4 : NULL;
    for (int64_t st = st0; st < st1; st++) {
        const int64_t k0 = st * 16;
        const int slices = K - k0 >= 16 ? 16 : (int)(K - k0); /* x has no k past K (the panel's are zeros) */
        const char *wl = panel + (size_t)st * STEP_BYTES + q * 64;
/* one slice's products: 2 L vectors of w by each row's x at k0 + sl (named values: see AVX2_SLOTS) */
#define AVX2_SLICE(sl)                                                                                     \
    do {                                                                                                   \
        const float *w = (const float *)(wl + (size_t)(sl) * SLICE_BYTES);                                 \
        AVX2_ROWS8(AVX2_WLOAD)                                                                             \
        AVX2_SLOTS(AVX2_FMA)                                                                               \
    } while (0)
        /* a whole step (nearly all) by loops of a constant count, with or without requests; K's last step slice by
         * slice */
        if (slices == 16 && pl) {
            for (int sl = 0; sl < 16; sl++) {
                for (int l = 0; l < L; l++) _mm_prefetch(pl + (size_t)(sl * L + l) * 64, _MM_HINT_T0);
                AVX2_SLICE(sl);
            }
        } else if (slices == 16) {
            for (int sl = 0; sl < 16; sl++) AVX2_SLICE(sl);
        } else {
            for (int sl = 0; sl < slices; sl++) {
                if (pl)
                    for (int l = 0; l < L; l++) _mm_prefetch(pl + (size_t)(sl * L + l) * 64, _MM_HINT_T0);
                AVX2_SLICE(sl);
            }
        }
#undef AVX2_SLICE
        if (pl) pl += (size_t)16 * L * 64;
    }
    AVX2_SLOTS(AVX2_KEEP)
}

/* a pass of mr rows over L lines, mr and L constants of each inlined copy (L x mr <= 6: 2 L x mr sums) */
#define AVX2_LINE_CASES                                                                                     \
    if (L == 4) {                                                                                           \
        avx2_line_rows(panel, a, r0 + m0, 1, 4, q, st0, st1, a->K, kp, pf);                                         \
    } else if (L == 2) {                                                                                    \
        switch (mr) {                                                                                       \
            case 1: avx2_line_rows(panel, a, r0 + m0, 1, 2, q, st0, st1, a->K, kp, pf); break;                      \
            case 2: avx2_line_rows(panel, a, r0 + m0, 2, 2, q, st0, st1, a->K, kp, pf); break;                      \
            default: avx2_line_rows(panel, a, r0 + m0, 3, 2, q, st0, st1, a->K, kp, pf); break;                     \
        }                                                                                                   \
    } else {                                                                                                \
        switch (mr) {                                                                                       \
            case 1: avx2_line_rows(panel, a, r0 + m0, 1, 1, q, st0, st1, a->K, kp, pf); break;                      \
            case 2: avx2_line_rows(panel, a, r0 + m0, 2, 1, q, st0, st1, a->K, kp, pf); break;                      \
            case 3: avx2_line_rows(panel, a, r0 + m0, 3, 1, q, st0, st1, a->K, kp, pf); break;                      \
            case 4: avx2_line_rows(panel, a, r0 + m0, 4, 1, q, st0, st1, a->K, kp, pf); break;                      \
            case 5: avx2_line_rows(panel, a, r0 + m0, 5, 1, q, st0, st1, a->K, kp, pf); break;                      \
            default: avx2_line_rows(panel, a, r0 + m0, AVX2_MR, 1, q, st0, st1, a->K, kp, pf); break;               \
        }                                                                                                   \
    }

/* the kept sums of rows [m0, m0 + rows) and columns n0 + [0, 64) (+ bias) into out, up to N */
static void avx2_store_panel(const linear_args *a, const float *keep, int64_t m0, int64_t rows, int64_t n0) {
    for (int j = 0; j < PANEL_COLS / 8; j++) {
        const int64_t n = n0 + 8 * j;
        if (n >= a->N) break;
        const __m256i mk = avx2_lanes(a->N - n);
        const __m256 b = a->bias ? _mm256_maskload_ps((const float *)a->bias + n, mk) : _mm256_setzero_ps();
        for (int64_t m = 0; m < rows; m++)
            _mm256_maskstore_ps((float *)a->out + (m0 + m) * a->o_row + n, mk,
                                _mm256_add_ps(_mm256_loadu_ps(keep + m * PANEL_COLS + 8 * j), b));
    }
}

static int linear_panels(const linear_args *a) {
    const int64_t panels = (a->N + PANEL_COLS - 1) / PANEL_COLS;
    const int64_t steps = (a->K + 15) / 16;
    const size_t panel_bytes = (size_t)steps * STEP_BYTES;
    int threads = a->num_threads > 0 ? a->num_threads : 1;
    if (threads > panels) threads = panels > 0 ? (int)panels : 1;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t p0 = panels * t / T, p1 = panels * (t + 1) / T;
        const char *stop = (const char *)a->w + (size_t)p1 * panel_bytes; /* the end of the thread's panels */
        float keep[AVX2_ROW_BLOCK * PANEL_COLS]; /* each row's 64 sums between chunks */
        /* a pass takes L lines of a slice for up to group rows: one row all four, two or three rows two, more one (two
         * lines for three rows at a time took 1.1-1.2x the time) */
        const int L = a->M == 1 ? 4 : a->M <= 3 ? 2 : 1, group = AVX2_MR / L;
        for (int64_t p = p0; p < p1; p++) {
            const char *panel = (const char *)a->w + (size_t)p * panel_bytes;
            const int64_t n0 = p * PANEL_COLS;
            const int lines = (int)((a->N - n0 + 15) / 16 < 4 ? (a->N - n0 + 15) / 16 : 4); /* past N: padding */
            for (int64_t r0 = 0; r0 < a->M; r0 += AVX2_ROW_BLOCK) {
                const int64_t rows = a->M - r0 < AVX2_ROW_BLOCK ? a->M - r0 : AVX2_ROW_BLOCK;
                for (int64_t st0 = 0; st0 < steps; st0 += AVX2_CHUNK_STEPS) {
                    const int64_t st1 = st0 + AVX2_CHUNK_STEPS < steps ? st0 + AVX2_CHUNK_STEPS : steps;
                    /* the chunk to request: the thread's panels lie one after another, so it is AVX2_PF_AHEAD
                     * chunks on in memory, this panel's or a later one's (none past the thread's last) */
                    const char *next = panel + (size_t)(st0 + AVX2_PF_AHEAD * AVX2_CHUNK_STEPS) * STEP_BYTES;
                    if (next + AVX2_CHUNK_STEPS * STEP_BYTES > stop) next = NULL;
                    for (int64_t m0 = 0; m0 < rows; m0 += group) {
                        const int mr = rows - m0 < group ? (int)(rows - m0) : group;
                        const char *pf = m0 == 0 ? next : NULL;
                        for (int q = 0; q < lines; q += L) {
                            float *kp = keep + m0 * PANEL_COLS + q * 16;
                            AVX2_LINE_CASES
                        }
                    }
                }
                avx2_store_panel(a, keep, r0, rows, n0);
            }
        }
    }
    return 0;
}

/* 0 done; 1 a dtype, layout or size this build does not take, 2 a weight buffer of another size than the layout's
 * (nothing written) */
static int linear_kernel(const linear_args *a) {
    if (linear_sizes_bad(a)) return 1;
    if (a->dtype != 0) return 1;
    const int64_t steps = (a->K + 15) / 16;
    if (a->layout == 0) return a->N * a->K * 4 != a->w_bytes ? 2 : linear_plain(a);
    if (a->layout == 1) {
        if ((a->N + PANEL_COLS - 1) / PANEL_COLS * steps * STEP_BYTES != a->w_bytes) return 2;
        return linear_panels(a);
    }
    return 1;
}

/* ---- SiLU(gate) * up, float32: small_linear.c's arithmetic on 8 lanes ---- */

/* e^x for x in [-104, 89] as small_linear.c's silu_exp: the same polynomial, then 2^n (n in [-150, 129]) applied
 * as two exact powers of two, n's halves, in place of vscalefps: the product is rounded once, where it leaves
 * float's normal range, as vscalefps rounds it */
static inline __m256 avx2_silu_exp(__m256 x) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 p;
    SILU_EXP_POLY(_mm256, __m256, x, n, p);
    const __m256i n1 = _mm256_cvttps_epi32(_mm256_mul_ps(n, _mm256_set1_ps(0.5f))); /* [-75, 64] */
    const __m256i n2 = _mm256_sub_epi32(_mm256_cvtps_epi32(n), n1);                 /* [-75, 65] */
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

static inline __m256 avx2_silu_times(__m256 x, __m256 u) {
    /* max and min give their second operand where one is a NaN: a NaN x's argument is -104, and x / ... stays NaN */
    const __m256 arg = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), _mm256_set1_ps(-104.0f)),
                                     _mm256_set1_ps(89.0f));
    return _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(avx2_silu_exp(arg), _mm256_set1_ps(1.0f))), u);
}

/* 0 done; 1 a dtype or size this build does not take (nothing written) */
static int silu_mul_kernel(const silu_mul_args *a) {
    if (a->rows < 0 || a->cols < 0 || a->dtype != 0) return 1;
    const int64_t rows = a->rows, cols = a->cols;
    int threads = a->num_threads > 0 ? a->num_threads : 1;
    if (rows * cols < 8192) threads = 1; /* a few rows: a second thread saves about what starting it costs */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < rows; i++) {
        const float *g = (const float *)a->gate + i * a->gate_row, *u = (const float *)a->up + i * a->up_row;
        float *o = (float *)a->out + i * a->out_row;
        int64_t j = 0;
        for (; j + 8 <= cols; j += 8)
            _mm256_storeu_ps(o + j, avx2_silu_times(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
        if (j < cols) {
            const __m256i mk = avx2_lanes(cols - j);
            _mm256_maskstore_ps(o + j, mk, avx2_silu_times(_mm256_maskload_ps(g + j, mk), _mm256_maskload_ps(u + j, mk)));
        }
    }
    return 0;
}
