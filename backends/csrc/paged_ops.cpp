/* pagedattn_native::write_kv_cache and pagedattn_native::paged_attention: pagedattn's paged ops with their CPU
   fast paths in C++, for a compiled CPU step.

   Each takes the same arguments as the pagedattn:: op of its name and gives the same result. A call runs here only
   when everything about it is what the Python path (sdpa_cpu) would send to the native kernels with no further
   work: the bound backend is the plain CPU one (native_ops.py sets that flag per thread, from use_backend),
   validation is off, the tensors have the kernels' layouts, every check passes, the site has no tensor parameters
   (ALiBi, sinks) or position program, and (attention) every sequence is a decode, a fresh prompt or a chunk over
   cached keys, the last two only where the native prefill takes them and SDPA's kernel would not (no soft-cap or
   chunked attention; sdpa_cpu's AMX bounds, bound by native_ops.py). Any other call, and any call a kernel refuses,
   goes to the pagedattn:: op, boxed as it came: its Python kernel then does what it always does, refusals and their
   messages included. The kernels are paged_decode.c's and paged_prefill.c's, bound by address (native_ops.py).

   A step calls the attention once per layer with the same metadata tensors: what a call derives from them (the
   checks, the decode and prefill items, the chunks' gathers, the int32 block tables) is kept per thread for the next
   calls, keyed by the tensors themselves and their versions, as backends/ops.py keeps its prepared calls. */

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "pagedattn_abi.h"

namespace pagedattn_native {
bool validating(); /* linear_op.cpp's */
void step_allocator_scope(bool enter); /* step_allocator.cpp's */
}

namespace {

using pagedattn_native::validating;
using decode_fn = decltype(&pagedattn_paged_decode);
using prefill_fn = decltype(&pagedattn_prefill);
using write_fn = decltype(&pagedattn_write_kv);

constexpr size_t KEPT = 4; /* an encoder-decoder step alternates two sets of metadata */

std::atomic<decode_fn> bound_decode{nullptr};
std::atomic<prefill_fn> bound_prefill{nullptr};
std::atomic<int64_t> sdpa_prefill_tokens{0}; /* sdpa_cpu.sdpa_prefill_pays' bound where it applies here, else 0 */
std::atomic<int64_t> sdpa_chunk_tokens{0}, sdpa_chunk_work{0}; /* sdpa_cpu.sdpa_chunk_pays' bounds, else 0 */
std::atomic<int64_t> rest_batch_bytes{1}; /* sdpa_cpu.REST_BATCH_BYTES: the K/V a batch of chunks gathers at most */
std::atomic<write_fn> bound_write{nullptr};
thread_local bool plain_backend = false;

int dtype_code(at::ScalarType t) {
    return t == at::kFloat ? 0 : t == at::kBFloat16 ? 1 : t == at::kHalf ? 2 : -1;
}

/* the pagedattn:: op of this name, called with the stack as it came */
void python_op(const char *name, torch::jit::Stack *stack) {
    c10::Dispatcher::singleton().findSchemaOrThrow(name, "").callBoxed(stack);
}

bool is_cpu_tensor(const c10::IValue &v) { return v.isTensor() && v.toTensor().device().is_cpu(); }

/* ---- the write */

bool write_fast(const at::Tensor &key, const at::Tensor &value, const at::Tensor &cache, const at::Tensor &slots) {
    write_fn fn = bound_write.load(std::memory_order_relaxed);
    if (!fn || !plain_backend || validating()) return false;
    const int code = dtype_code(cache.scalar_type());
    if (code < 0 || key.scalar_type() != cache.scalar_type() || value.scalar_type() != cache.scalar_type()) return false;
    if (!key.device().is_cpu() || !value.device().is_cpu() || !cache.device().is_cpu() || !slots.device().is_cpu())
        return false;
    if (cache.dim() != 5 || cache.size(0) != 2 || cache.stride(-1) != 1 || key.dim() != 3 || value.dim() != 3 ||
        key.stride(-1) != 1 || value.stride(-1) != 1)
        return false;
    if (slots.dim() != 1 || (slots.scalar_type() != at::kInt && slots.scalar_type() != at::kLong) ||
        slots.stride(0) != 1)
        return false;
    const int64_t t = key.size(0);
    if (value.size(0) != t || slots.size(0) != t || key.size(1) != cache.size(3) || key.size(2) != cache.size(4) ||
        value.size(1) != cache.size(3) || value.size(2) != cache.size(4))
        return false;
    const int64_t esz = cache.element_size();
    char *k = static_cast<char *>(cache.data_ptr());
    const write_args a{key.data_ptr(),  value.data_ptr(), key.stride(0),   key.stride(1),   value.stride(0),
                       value.stride(1), k,                k + cache.stride(0) * esz,        cache.stride(1),
                       cache.stride(2), cache.stride(3),  slots.data_ptr(), slots.scalar_type() == at::kLong,
                       t,               cache.size(1),    static_cast<int32_t>(cache.size(3)),
                       static_cast<int32_t>(cache.size(4)), static_cast<int32_t>(cache.size(2)),
                       static_cast<int32_t>(esz)};
    if (fn(&a)) return false; /* a refusal writes nothing: the Python op then says which slot is wrong */
    if (!cache.is_inference()) cache.unsafeGetTensorImpl()->bump_version(); /* as the Python op does */
    return true;
}

void write_kv_cache(const c10::OperatorHandle &, torch::jit::Stack *stack) {
    auto args = torch::jit::last(*stack, 4);
    if (args[0].isTensor() && args[1].isTensor() && args[2].isTensor() && args[3].isTensor() &&
        write_fast(args[0].toTensor(), args[1].toTensor(), args[2].toTensor(), args[3].toTensor())) {
        torch::jit::drop(*stack, 4);
        return;
    }
    python_op("pagedattn::write_kv_cache", stack);
}

/* ---- the attention: decodes, fresh prompts and chunks over cached keys */

struct RestBatch { /* chunks over cached keys gathered and attended together, as sdpa_cpu._rest_plan batches them */
    at::Tensor index, items; /* int64 [blocks]: their blocks, chunk after chunk; int64 [n, 6] (native.prefill's) */
    int64_t tiles;           /* their keys' tiles of 16 in all */
};

struct Plan { /* what the step's metadata gives every layer */
    at::Tensor tables, seq_lens, qsl;   /* the metadata tensors themselves: the key */
    int64_t versions[3];
    int64_t rows, window, chunk, block_size, threads, max_seq_len, num_kv_heads, num_blocks, row_bytes, batch_bytes;
    bool causal, has_key;
    at::Tensor tables_i32, items, parts_start; /* int32 [S, W] contiguous; the decodes' int64 [n, 4]; int64 [n + 1] */
    int64_t num_parts, part_keys;
    at::Tensor fresh_items; /* the fresh prompts' int64 [f, 6] (native.prefill's items); undefined without any */
    int64_t fresh_tiles, longest_fresh; /* their keys' tiles of 16 in all; the most queries of one */
    std::vector<RestBatch> rest;
    std::vector<int64_t> from_first; /* per chunk whose keys run from the first after cached ones: queries, query-key
                                        pairs (what sdpa_chunk_pays weighs, at the call: its bounds may be rebound) */
    bool every_row; /* the items cover every query row: none to zero */
};

thread_local std::vector<Plan> plans;

int64_t version(const at::Tensor &t) { return t.unsafeGetTensorImpl()->version_counter().current_version(); }

/* reference.earliest_visible_key for the query at q */
int64_t first_visible(int64_t q, int64_t window, int64_t chunk) {
    int64_t lo = 0;
    if (window > 0) lo = std::max(lo, q - window + 1);
    if (chunk > 0) lo = std::max(lo, q - q % chunk);
    return lo;
}

/* native.part_keys (UNITS_PER_THREAD units a thread) */
int64_t part_keys(int64_t total, int64_t threads, int64_t block_size) {
    const int64_t units = 4 * std::max<int64_t>(1, threads);
    const int64_t want = (total + units - 1) / units;
    return std::max<int64_t>(64, (want + block_size - 1) / block_size * block_size);
}

/* The plan for these metadata tensors, checked as metadata.check_attend_cheap checks them; false where they fail a
   check or a chunk's block is not one of the cache's (the Python op then refuses or runs them). Sequences split as sdpa_cpu._plan splits them: decodes, fresh prompts (with the step's
   keys given) and the rest, chunks over cached keys, batched as sdpa_cpu._rest_plan batches them. */
bool make_plan(Plan &p) {
    const at::Tensor &tables = p.tables, &lens_t = p.seq_lens, &qsl_t = p.qsl;
    for (const at::Tensor *t : {&tables, &lens_t, &qsl_t})
        if (!t->device().is_cpu() || (t->scalar_type() != at::kInt && t->scalar_type() != at::kLong)) return false;
    if (tables.scalar_type() != at::kInt) return false; /* int64 ids would be narrowed for the kernel: the Python op */
    if (lens_t.dim() != 1 || tables.dim() != 2) return false;
    const int64_t n = lens_t.size(0);
    if (n == 0 || tables.size(0) != n || qsl_t.dim() != 1 || qsl_t.size(0) != n + 1) return false;
    const at::Tensor lens = lens_t.to(at::kLong).contiguous(), qsl = qsl_t.to(at::kLong).contiguous();
    const int64_t *l = lens.data_ptr<int64_t>(), *q = qsl.data_ptr<int64_t>();
    const int64_t covered = tables.size(1) * p.block_size;
    if (q[0] != 0 || q[n] > p.rows) return false;
    std::vector<int64_t> items, fresh, starts(1, 0), rest_blocks, rest_items;
    int64_t total = 0, covered_rows = 0, rest_rows = 0, rest_tiles = 0;
    p.fresh_tiles = p.longest_fresh = 0;
    p.tables_i32 = tables.to(at::kInt).contiguous();
    const int32_t *table = p.tables_i32.data_ptr<int32_t>();
    const int64_t width = tables.size(1);
    auto close_batch = [&]() {
        if (rest_items.empty()) return;
        RestBatch b{at::empty({static_cast<int64_t>(rest_blocks.size())}, at::kLong),
                    at::empty({static_cast<int64_t>(rest_items.size() / 6), 6}, at::kLong), rest_tiles};
        std::copy(rest_blocks.begin(), rest_blocks.end(), b.index.data_ptr<int64_t>());
        std::copy(rest_items.begin(), rest_items.end(), b.items.data_ptr<int64_t>());
        p.rest.push_back(std::move(b));
        rest_blocks.clear(), rest_items.clear(), rest_rows = rest_tiles = 0;
    };
    for (int64_t i = 0; i < n; i++) {
        const int64_t ql = q[i + 1] - q[i];
        if (l[i] < 1 || l[i] > covered || (p.max_seq_len > 0 && l[i] > p.max_seq_len)) return false;
        if (p.causal && ql > l[i]) return false; /* fewer keys than new tokens: the Python op refuses it */
        if (ql == 1) {
            const int64_t first = (p.window > 0 || p.chunk > 0) ? first_visible(l[i] - 1, p.window, p.chunk) : 0;
            items.insert(items.end(), {q[i], i, first, l[i]});
            total += l[i] - first;
        } else if (p.has_key && ql > 1 && l[i] == ql) { /* all its keys are the step's own: native.prefill's item */
            fresh.insert(fresh.end(), {q[i], ql, 0, q[i], ql, 0});
            p.fresh_tiles += (ql + 15) / 16;
            p.longest_fresh = std::max(p.longest_fresh, ql);
        } else if (ql > 1 && p.chunk == 0) { /* a chunk over cached keys, from the block of its first visible key */
            const int64_t context = l[i] - ql, first = first_visible(context, p.window, 0) / p.block_size;
            const int64_t k0 = first * p.block_size, blocks = (l[i] + p.block_size - 1) / p.block_size - first;
            if (k0 == 0 && context > 0) p.from_first.insert(p.from_first.end(), {ql, ql * l[i]});
            if (!rest_items.empty() && (rest_rows + blocks * p.block_size) * p.row_bytes > p.batch_bytes) close_batch();
            for (int64_t j = first; j < first + blocks; j++) {
                const int64_t id = table[i * width + j];
                if (id < 0 || id >= p.num_blocks) return false; /* the Python op's gather says what is wrong */
                rest_blocks.push_back(id);
            }
            rest_items.insert(rest_items.end(), {q[i], ql, context, rest_rows, l[i] - k0, k0});
            rest_rows += blocks * p.block_size;
            rest_tiles += (l[i] - k0 + 15) / 16;
        } else {
            return false; /* an empty run, or a chunk of a chunked site: the Python op */
        }
        covered_rows += ql;
    }
    close_batch();
    const int64_t nd = static_cast<int64_t>(items.size() / 4), nf = static_cast<int64_t>(fresh.size() / 6);
    p.part_keys = part_keys(total, p.threads, p.block_size);
    for (int64_t i = 0; i < nd; i++) {
        const int64_t keys = std::max<int64_t>(1, items[4 * i + 3] - items[4 * i + 2]);
        starts.push_back(starts.back() + (keys + p.part_keys - 1) / p.part_keys);
    }
    p.num_parts = starts.back();
    p.items = at::empty({nd, 4}, at::kLong);
    std::copy(items.begin(), items.end(), p.items.data_ptr<int64_t>());
    p.parts_start = at::empty({nd + 1}, at::kLong);
    std::copy(starts.begin(), starts.end(), p.parts_start.data_ptr<int64_t>());
    if (nf) {
        p.fresh_items = at::empty({nf, 6}, at::kLong);
        std::copy(fresh.begin(), fresh.end(), p.fresh_items.data_ptr<int64_t>());
    }
    p.every_row = covered_rows == p.rows;
    return true;
}

const Plan *find_plan(const at::Tensor &tables, const at::Tensor &lens, const at::Tensor &qsl, int64_t rows,
                      int64_t window, int64_t chunk, int64_t block_size, bool causal, bool has_key, int64_t max_seq_len,
                      int64_t num_kv_heads, int64_t num_blocks, int64_t row_bytes, Plan *scratch_plan) {
    const int64_t threads = at::get_num_threads(), batch_bytes = rest_batch_bytes.load(std::memory_order_relaxed);
    const bool keyed = !tables.is_inference() && !lens.is_inference() && !qsl.is_inference();
    if (keyed) {
        const int64_t v[3] = {version(tables), version(lens), version(qsl)};
        for (const Plan &p : plans)
            if (p.tables.is_same(tables) && p.seq_lens.is_same(lens) && p.qsl.is_same(qsl) && p.versions[0] == v[0] &&
                p.versions[1] == v[1] && p.versions[2] == v[2] && p.rows == rows && p.window == window &&
                p.chunk == chunk && p.block_size == block_size && p.threads == threads && p.causal == causal &&
                p.has_key == has_key && p.max_seq_len == max_seq_len && p.num_kv_heads == num_kv_heads &&
                p.num_blocks == num_blocks && p.row_bytes == row_bytes && p.batch_bytes == batch_bytes)
                return &p;
    }
    Plan p;
    p.tables = tables, p.seq_lens = lens, p.qsl = qsl;
    p.rows = rows, p.window = window, p.chunk = chunk, p.block_size = block_size, p.threads = threads;
    p.causal = causal, p.has_key = has_key, p.max_seq_len = max_seq_len, p.num_kv_heads = num_kv_heads;
    p.num_blocks = num_blocks, p.row_bytes = row_bytes, p.batch_bytes = batch_bytes;
    if (!make_plan(p)) return nullptr;
    if (!keyed) {
        *scratch_plan = std::move(p);
        return scratch_plan;
    }
    p.versions[0] = version(tables), p.versions[1] = version(lens), p.versions[2] = version(qsl);
    plans.insert(plans.begin(), std::move(p));
    if (plans.size() > KEPT) plans.pop_back();
    return &plans.front();
}

/* Whether sdpa_cpu's attend sends its prompts and chunks to the native prefill kernel: no cap or chunked attention
   (sdpa_cpu._native_prefill_lib), D a multiple of 16 up to the kernel's bound. */
bool prefill_site(double softcap, int64_t chunk, int64_t d) {
    return softcap <= 0 && chunk == 0 && d % 16 == 0 && d <= PAGEDATTN_PREFILL_MAX_HEAD;
}

/* Whether sdpa_cpu sends some of the plan's prompts or chunks to SDPA's kernel on this machine (sdpa_prefill_pays,
   sdpa_chunk_pays: bfloat16, no window; a chunk causal, its keys from the first). */
bool sdpa_takes_some(const Plan &p, bool causal, int64_t window, int code) {
    if (code != 1 || window != 0) return false;
    const int64_t tokens = sdpa_prefill_tokens.load(std::memory_order_relaxed);
    if (p.fresh_items.defined() && tokens > 0 && p.longest_fresh >= tokens) return true;
    const int64_t ct = sdpa_chunk_tokens.load(std::memory_order_relaxed), cw = sdpa_chunk_work.load(std::memory_order_relaxed);
    if (!causal || ct <= 0) return false;
    for (size_t i = 0; i < p.from_first.size(); i += 2)
        if (p.from_first[i] >= ct && p.from_first[i + 1] >= cw) return true;
    return false;
}

/* items' queries over key/value rows [T, Hkv, D] through the prefill kernel into out, as native.prefill calls it
   (scale, causality, the site's window, the thread count); false where the tensors do not suit it
   (native.prefill_usable) or the kernel refuses, nothing written. */
bool run_prefill(prefill_fn fn, const at::Tensor &out, const at::Tensor &query, const at::Tensor &key,
                 const at::Tensor &value, const at::Tensor &items, int64_t tiles, int64_t hkv, double scale, bool causal,
                 int64_t window, int code, int64_t threads) {
    const int64_t hq = query.size(1), d = query.size(2);
    if (!key.device().is_cpu() || !value.device().is_cpu() || key.scalar_type() != query.scalar_type() ||
        value.scalar_type() != query.scalar_type() || key.dim() != 3 || value.dim() != 3 || key.stride(-1) != 1 ||
        value.stride(-1) != 1 || key.size(2) != d || value.size(2) != d || key.size(1) != hkv || value.size(1) != hkv)
        return false;
    at::Tensor scratch = at::empty({std::max<int64_t>(1, tiles * hkv * d * 16)}, query.options().dtype(at::kFloat));
    const prefill_args a{query.data_ptr(),
                         query.stride(0),
                         query.stride(1),
                         key.data_ptr(),
                         key.stride(0),
                         key.stride(1),
                         value.data_ptr(),
                         value.stride(0),
                         value.stride(1),
                         out.data_ptr(),
                         out.stride(0),
                         out.stride(1),
                         items.data_ptr<int64_t>(),
                         items.size(0),
                         static_cast<int32_t>(hq),
                         static_cast<int32_t>(hkv),
                         static_cast<int32_t>(d),
                         causal ? 1 : 0,
                         static_cast<int32_t>(std::min<int64_t>(window, INT32_MAX)), /* wider: every key */
                         code,
                         static_cast<float>(scale),
                         scratch.data_ptr<float>(),
                         static_cast<int32_t>(threads),
                         std::min(query.size(0), out.size(0)),
                         std::min(key.size(0), value.size(0))};
    return fn(&a) == 0;
}

/* The plan's fresh prompts and chunks over cached keys attended into out as sdpa_cpu's attend attends them: the
   prompts in one prefill call over the step's keys, each batch of chunks in one over its blocks gathered from the
   cache; false where that path would not send them there or a kernel refuses (then the Python op runs the whole
   call, out discarded). */
bool prefills(const at::Tensor &out, const at::Tensor &query, const c10::IValue &key, const c10::IValue &value,
              const at::Tensor &cache, const Plan &p, double scale, bool causal, int64_t window, int64_t chunk,
              double softcap, int code) {
    const prefill_fn fn = bound_prefill.load(std::memory_order_relaxed);
    if (!fn || !prefill_site(softcap, chunk, query.size(2)) || sdpa_takes_some(p, causal, window, code))
        return false;
    if (p.fresh_items.defined() && !run_prefill(fn, out, query, key.toTensor(), value.toTensor(), p.fresh_items,
                                                p.fresh_tiles, p.num_kv_heads, scale, causal, window, code, p.threads))
        return false;
    for (const RestBatch &b : p.rest) {
        const at::Tensor k = cache.select(0, 0).index_select(0, b.index).flatten(0, 1); /* [rows, Hkv, D] */
        const at::Tensor v = cache.select(0, 1).index_select(0, b.index).flatten(0, 1);
        if (!run_prefill(fn, out, query, k, v, b.items, b.tiles, p.num_kv_heads, scale, causal, window, code, p.threads))
            return false;
    }
    return true;
}

/* the attention computed here, or an undefined tensor (then the Python op) */
at::Tensor attend_fast(const torch::jit::Stack &stack, size_t base) {
    decode_fn fn = bound_decode.load(std::memory_order_relaxed);
    if (!fn || !plain_backend || validating()) return {};
    auto arg = [&](size_t i) -> const c10::IValue & { return stack[base + i]; };
    /* no tensor parameters (ALiBi slopes 11, sinks 14, position tables 19 and data 20), no position program (18) */
    if (!arg(11).isNone() || !arg(14).isNone() || !arg(19).isNone() || !arg(20).isNone() ||
        !arg(18).toStringRef().empty())
        return {};
    if (!is_cpu_tensor(arg(0)) || !is_cpu_tensor(arg(3)) || !arg(4).isTensor() || !arg(5).isTensor() ||
        !arg(6).isTensor())
        return {};
    const at::Tensor query = arg(0).toTensor(), cache = arg(3).toTensor();
    const double scale = arg(7).toDouble(), softcap = arg(10).toDouble();
    const bool causal = arg(8).toBool();
    const int64_t window = causal && arg(9).toInt() > 0 ? arg(9).toInt() : 0;
    const int64_t chunk = causal && arg(15).toInt() > 0 ? arg(15).toInt() : 0;
    const int64_t hkv = arg(12).toInt(), head_v = arg(13).toInt(), max_seq_len = arg(16).toInt();
    /* the checks that need no metadata values (check_attend_cheap) and the kernel's layouts (native.usable) */
    const int code = dtype_code(cache.scalar_type());
    if (code < 0 || cache.dim() != 5 || cache.size(0) != 2 || cache.stride(-1) != 1 || query.dim() != 3 ||
        query.scalar_type() != cache.scalar_type() || query.stride(-1) != 1)
        return {};
    const int64_t hq = query.size(1), d = cache.size(4), bs = cache.size(2);
    if (hkv != cache.size(3) || hkv <= 0 || hq % hkv || hq / hkv > PAGEDATTN_MAX_GROUP || query.size(2) != d ||
        d > PAGEDATTN_MAX_HEAD || head_v != d)
        return {};
    if (arg(1).isTensor() != arg(2).isTensor()) return {}; /* a key without its value: the Python op says so */
    const bool has_key = arg(1).isTensor();
    Plan local;
    const Plan *p = find_plan(arg(4).toTensor(), arg(5).toTensor(), arg(6).toTensor(), query.size(0), window, chunk,
                              bs, causal, has_key, max_seq_len, hkv, cache.size(1), 2 * hkv * d * cache.element_size(),
                              &local);
    if (!p) return {};
    at::Tensor out = p->every_row ? at::empty({query.size(0), hq, d}, query.options())
                                  : at::zeros({query.size(0), hq, d}, query.options());
    if ((p->fresh_items.defined() || !p->rest.empty()) &&
        !prefills(out, query, arg(1), arg(2), cache, *p, scale, causal, window, chunk, softcap, code))
        return {};
    if (p->items.size(0) == 0) return out;
    at::Tensor scratch = at::empty({p->num_parts * hq * (d + 2)}, query.options().dtype(at::kFloat));
    const int64_t esz = cache.element_size();
    const char *k = static_cast<const char *>(cache.data_ptr());
    const decode_args a{query.data_ptr(),
                        query.stride(0),
                        query.stride(1),
                        out.data_ptr(),
                        out.stride(0),
                        out.stride(1),
                        k,
                        k + cache.stride(0) * esz,
                        cache.stride(1),
                        cache.stride(2),
                        cache.stride(3),
                        p->tables_i32.data_ptr<int32_t>(),
                        p->tables_i32.size(1),
                        p->items.data_ptr<int64_t>(),
                        p->items.size(0),
                        static_cast<int32_t>(hq),
                        static_cast<int32_t>(hkv),
                        static_cast<int32_t>(d),
                        static_cast<int32_t>(bs),
                        static_cast<float>(scale),
                        static_cast<float>(softcap),
                        nullptr,
                        nullptr,
                        code,
                        static_cast<int32_t>(p->part_keys),
                        scratch.data_ptr<float>(),
                        static_cast<int32_t>(p->threads),
                        cache.size(1),
                        query.size(0),
                        p->tables_i32.size(0)};
    if (fn(&a, p->parts_start.data_ptr<int64_t>())) return {}; /* refused, nothing written: the Python op says why */
    return out;
}

void paged_attention(const c10::OperatorHandle &op, torch::jit::Stack *stack) {
    const size_t n = op.schema().arguments().size();
    at::Tensor out = attend_fast(*stack, stack->size() - n);
    if (!out.defined()) {
        python_op("pagedattn::paged_attention", stack);
        return;
    }
    torch::jit::drop(*stack, n);
    torch::jit::push(*stack, std::move(out));
}

void bind_paged(int64_t decode, int64_t write, int64_t prefill, int64_t sdpa_tokens, int64_t chunk_tokens,
                int64_t chunk_work, int64_t batch_bytes) {
    bound_decode.store(reinterpret_cast<decode_fn>(decode));
    bound_write.store(reinterpret_cast<write_fn>(write));
    bound_prefill.store(reinterpret_cast<prefill_fn>(prefill));
    sdpa_prefill_tokens.store(sdpa_tokens);
    sdpa_chunk_tokens.store(chunk_tokens);
    sdpa_chunk_work.store(chunk_work);
    rest_batch_bytes.store(batch_bytes);
}

bool set_plain_backend(bool on) {
    const bool was = plain_backend;
    plain_backend = on;
    if (!on) plans.clear(); /* the tensors they hold go with the step that used them */
    if (on != was) pagedattn_native::step_allocator_scope(on); /* the scope's CPU allocator (step_allocator.cpp) */
    return was;
}

} // namespace

TORCH_LIBRARY_FRAGMENT(pagedattn_native, m) {
    m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
    m.def("paged_attention(Tensor query, Tensor? key, Tensor? value, Tensor kv_cache, Tensor block_tables, "
          "Tensor seq_lens, Tensor query_start_loc, float scale, bool causal, int sliding_window, float softcap, "
          "Tensor? alibi_slopes, int num_kv_heads, int head_size_v, Tensor? sinks=None, int chunk_size=0, "
          "int max_seq_len=0, bool positions_from_first_key=False, str position_mod=\"\", "
          "Tensor? position_tables=None, Tensor? position_data=None) -> Tensor");
    m.def("bind_paged(int decode, int write, int prefill, int sdpa_prefill_tokens, int sdpa_chunk_tokens, "
          "int sdpa_chunk_work, int rest_batch_bytes) -> ()");
    m.def("set_plain_backend(bool on) -> bool");
}

TORCH_LIBRARY_IMPL(pagedattn_native, CPU, m) {
    m.impl("write_kv_cache", torch::CppFunction::makeFromBoxedFunction<&write_kv_cache>());
    m.impl("paged_attention", torch::CppFunction::makeFromBoxedFunction<&paged_attention>());
}

/* inference only, as the pagedattn:: op: a backward through it raises rather than leaving the inputs without grads */
TORCH_LIBRARY_IMPL(pagedattn_native, Autograd, m) {
    m.impl("paged_attention", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(pagedattn_native, CompositeExplicitAutograd, m) {
    m.impl("bind_paged", &bind_paged);
    m.impl("set_plain_backend", &set_plain_backend);
}
