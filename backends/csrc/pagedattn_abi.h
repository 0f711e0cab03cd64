/* The native library's call arguments: shared by its C sources (paged_decode.c, paged_prefill.c, small_linear.c) and by the C++
 * operators that call it by address (linear_op.cpp, paged_ops.cpp). native.py's ctypes Structures mirror them field
 * for field. */
#ifndef PAGEDATTN_ABI_H
#define PAGEDATTN_ABI_H

#include <stdint.h>

#define PAGEDATTN_MAX_HEAD 512 /* the decode kernel's head size bound */
#define PAGEDATTN_MAX_GROUP 64 /* and query heads per KV head */
#define PAGEDATTN_PREFILL_MAX_HEAD 256 /* the prefill kernel's: head sizes that are multiples of 16 up to this */

/* The kernels' AVX2 paths (8-lane intrinsics where GCC's code for the 16-lane vectors is slow: compares, shuffles,
 * sums held across loops), taken on CPUs with AVX2, FMA and F16C but not AVX-512, or on any with them where
 * PAGEDATTN_AVX2 asks (the tests of an AVX-512 machine build both) */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && (!defined(__AVX512F__) || defined(PAGEDATTN_AVX2))
#define PAGEDATTN_AVX2_PATHS 1
#else
#define PAGEDATTN_AVX2_PATHS 0
#endif

#ifdef __cplusplus
extern "C" {
#endif

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
    /* an additive float32 term per score (a position program's bias and mask, -inf: the key not seen), or NULL:
     * item i's key j (lo <= j < hi) for query head h at bias[i * bias_item + h * bias_head + j - lo]; bias_numel
     * bounds every read */
    const float *bias;
    int64_t bias_item, bias_head, bias_numel;
} decode_args;

/* the cache write: token t's K and V rows [Hkv][D] into slot slots[t] of the paged caches (-1: padding, skipped) */
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

typedef struct {
    const void *x;
    int64_t x_row; /* elements between rows of x */
    const void *w; /* layout 0: [N, K], rows contiguous; 1: panels (see small_linear.c's linear_panels) */
    const void *bias; /* [N] or NULL */
    void *out;
    int64_t o_row;
    int64_t M, N, K;
    int32_t dtype; /* 0 float32, 1 bfloat16 */
    int32_t num_threads;
    int32_t layout;
    int64_t w_bytes; /* the weight buffer's size: the layout's own, or the call refuses */
} linear_args;

/* paged_prefill.c: the queries of runs of sequences over their own K/V rows (not the paged cache) */
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
    /* a term added to each score by the distance between key and query (a position program that reads positions
     * only through it: its bias and mask, -inf where it hides a key), or NULL: item i's query r over its key j, for
     * query head h, reads rel[i * rel_item + h * rel_head + j - r + queries - 1]; each (item, head) row holds
     * queries + keys + 15 floats (a tile's keys past the last read it); rel_numel bounds every read */
    const float *rel;
    int64_t rel_item, rel_head, rel_numel;
    /* each query row's keys as one run, or NULL: query row t (of the query tensor) sees its item's keys
     * [bounds[2t], bounds[2t + 1]) (indices into the item's keys), in place of causality and the window; a row
     * that sees none is left as it is. num_bounds (rows) bounds every read */
    const int64_t *bounds;
    int64_t num_bounds;
} prefill_args;

/* small_linear.c: out = SiLU(gate) * up, row by row: [rows, cols] of float32 or bfloat16 */
typedef struct {
    const void *gate, *up;
    void *out;
    int64_t gate_row, up_row, out_row; /* elements between rows (a row's elements contiguous) */
    int64_t rows, cols;
    int32_t dtype; /* 0 float32, 1 bfloat16 */
    int32_t num_threads;
} silu_mul_args;

/* 0, or the first check that failed with nothing written (see each definition) */
int pagedattn_paged_decode(const decode_args *a, const int64_t *parts_start);
int pagedattn_prefill(const prefill_args *a);
int pagedattn_write_kv(const write_args *a);
int pagedattn_linear(const linear_args *a);
int pagedattn_silu_mul(const silu_mul_args *a);

/* The kernel clock, for benchmarks' breakdowns of a step (benchmarks/roofline.py's decode_breakdown): while it is on,
 * each entry point of the library adds one call and its wall time on the calling thread (its OpenMP workers' work
 * inside it) to its kind's counters. Off until turned on: a call then pays one relaxed load. */
enum {
    PAGEDATTN_CLOCK_LINEAR,
    PAGEDATTN_CLOCK_DECODE,
    PAGEDATTN_CLOCK_PREFILL,
    PAGEDATTN_CLOCK_WRITE,
    PAGEDATTN_CLOCK_SILU_MUL,
    PAGEDATTN_CLOCK_ARGMAX,
    PAGEDATTN_CLOCK_KINDS
};
void pagedattn_clock(int32_t on);                       /* on: the counters zeroed, then counting; off: stopped */
void pagedattn_clock_read(int64_t *out);                /* [2 * KINDS]: kind k's calls, then its nanoseconds */
int64_t pagedattn_clock_start(void);                    /* 0 while off, else the time now (ns) */
void pagedattn_clock_stop(int32_t kind, int64_t start); /* one call of kind since start (0: nothing counted) */
/* the body of an entry point that returns `call`'s result, timed as a call of `kind` */
#define PAGEDATTN_TIMED(kind, call)                            \
    do {                                                       \
        const int64_t pagedattn_t0_ = pagedattn_clock_start(); \
        const int pagedattn_r_ = (call);                       \
        pagedattn_clock_stop((kind), pagedattn_t0_);           \
        return pagedattn_r_;                                   \
    } while (0)

#ifdef __cplusplus
}
#endif

#endif
