/* pagedattn_native::linear: pagedattn::linear's CPU kernel as a dispatcher kernel in C++.

   A decode step of a small model calls its linears ~25 times; through the Python kernel (backends/cpu_linear.py)
   each call pays ~7 us of Python around a ~6 us kernel. This kernel does what that one does, in the same order:
   calls of at most the bound number of rows go to small_linear.c's pagedattn_linear (its address is bound once by
   native_ops.py: this library links to no symbol of that one), everything else, and any call that kernel refuses,
   to oneDNN's mkldnn::_linear_pointwise on the same weight. While pagedattn's validation is on, calls go to
   pagedattn::linear instead, whose Python kernel re-proves the weight's layout at every call.

   pagedattn_native::silu_mul is a gated MLP's SiLU(gate) * up by small_linear.c's kernel (bound likewise), which a
   compiled CPU step calls in place of Inductor's kernel (native_ops.SiluMul).

   pagedattn_native::onednn_from_buffer makes a oneDNN tensor over bytes of a buffer it does not own, as AOTInductor
   makes its packed constants from its blob: aot_step.py lays a CPU package's constants in one huge-page buffer so.

   Built by native_ops.py with the torch headers only (no Python or pybind headers: a few seconds to compile). */

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <strings.h>

#include "pagedattn_abi.h"

namespace {
std::atomic<int> validation{-1}; /* pagedattn's set_validation: -1 none (the environment decides), 0, 1 */
} // namespace

namespace pagedattn_native {
/* an environment flag as pagedattn's Python reads its flags: 1/true/yes/on set, 0/false/no/off unset (any case),
   `fallback` where it is missing or says neither (step_allocator.cpp reads one too) */
bool env_flag(const char *name, bool fallback) {
    const char *env = std::getenv(name);
    if (!env) return fallback;
    for (const char *on : {"1", "true", "yes", "on"})
        if (!strcasecmp(env, on)) return true;
    for (const char *off : {"0", "false", "no", "off"})
        if (!strcasecmp(env, off)) return false;
    return fallback;
}

/* whether pagedattn's validation is on: what metadata.validation_enabled says (paged_ops.cpp asks it too) */
bool validating() {
    int v = validation.load(std::memory_order_relaxed);
    if (v >= 0) return v == 1;
    return env_flag("PAGEDATTN_VALIDATE", false); /* as metadata.validation_enabled reads it */
}
} // namespace pagedattn_native

namespace {

using pagedattn_native::validating;
using linear_fn = decltype(&pagedattn_linear);

constexpr int64_t LAYOUT_PLAIN = 0;
std::atomic<linear_fn> bound_kernel{nullptr};
std::atomic<int64_t> small_rows[2] = {0, 0}; /* by dtype code (0 float32, 1 bfloat16): 0 where the kernel has none */

/* cpu_linear.onednn_rows: the rows a reduced-precision call goes to oneDNN with (see onednn_linear) */
int64_t onednn_rows(int64_t m) {
    if (m <= 64) return m;
    const int64_t step = int64_t(1) << (63 - __builtin_clzll(static_cast<uint64_t>(m)) - 3); /* 8 sizes an octave */
    return (m + step - 1) / step * step;
}

/* oneDNN reads a bias as contiguous whatever its strides (torch 2.13): one with gaps goes as a contiguous copy.
   oneDNN builds a GEMM for every new number of rows, and in bfloat16 on a Xeon with AMX that costs ~6 ms against
   ~2 ms to run a 1000 x 384 x 2048 one: as cpu_linear.linear does, a bfloat16 or float16 call of more than 64 rows
   goes padded with zero rows to one of onednn_rows' sizes, so that a serving loop's steps of every size share a
   few dozen GEMMs. */
at::Tensor onednn_linear(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                         .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const std::optional<at::Tensor> &,
                                           c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                           std::optional<c10::string_view>)>();
    const std::optional<at::Tensor> b = bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : bias;
    const int64_t k = x.dim() ? x.size(-1) : 0, m = k ? x.numel() / k : 0, mp = onednn_rows(m);
    if ((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) && mp != m) {
        at::Tensor padded = at::empty({mp, k}, x.options()); /* [Mp, K] */
        padded.narrow(0, 0, m).copy_(x.reshape({m, k}));
        padded.narrow(0, m, mp - m).zero_();
        at::Tensor out = op.call(padded, w, b, "none", c10::List<std::optional<c10::Scalar>>(), "").narrow(0, 0, m);
        auto shape = x.sizes().vec();
        shape.back() = out.size(1);
        return out.view(shape);
    }
    return op.call(x, w, b, "none", c10::List<std::optional<c10::Scalar>>(), "");
}

at::Tensor python_linear(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias,
                         int64_t layout) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("pagedattn::linear", "")
                         .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const std::optional<at::Tensor> &,
                                           int64_t)>();
    return op.call(x, w, bias, layout);
}

/* The weight's buffer and its size in bytes, as the kernel reads them; false where it does not read this weight. */
bool weight_buffer(const at::Tensor &w, int64_t layout, const void **ptr, int64_t *bytes) {
    if (w.is_mkldnn()) {
        static auto data = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mkldnn::data_ptr", "")
                               .typed<int64_t(const at::Tensor &)>();
        static auto size = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mkldnn::_nbytes", "")
                               .typed<int64_t(const at::Tensor &)>();
        *ptr = reinterpret_cast<const void *>(data.call(w));
        *bytes = size.call(w);
        return true;
    }
    if (layout == LAYOUT_PLAIN && w.device().is_cpu() && w.is_contiguous()) {
        *ptr = w.data_ptr();
        *bytes = w.numel() * static_cast<int64_t>(w.element_size());
        return true;
    }
    return false;
}

/* x [..., K] @ w [N, K]^T (+ bias [N]) by the bound kernel; an undefined tensor where it does not take the call */
at::Tensor native_linear(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias,
                         int64_t layout) {
    linear_fn kernel = bound_kernel.load(std::memory_order_relaxed);
    const int code = x.scalar_type() == at::kFloat ? 0 : x.scalar_type() == at::kBFloat16 ? 1 : -1;
    if (!kernel || code < 0 || x.dim() == 0 || w.dim() != 2 || w.scalar_type() != x.scalar_type() ||
        !x.device().is_cpu() || x.is_mkldnn())
        return {};
    const int64_t n = w.size(0), k = w.size(1);
    if (k == 0 || x.size(-1) != k || x.numel() / k > small_rows[code].load(std::memory_order_relaxed)) return {};
    if (bias.has_value() && !(bias->scalar_type() == x.scalar_type() && bias->device().is_cpu() &&
                              !bias->is_mkldnn() && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous()))
        return {};
    const void *wp = nullptr;
    int64_t bytes = 0;
    if (!weight_buffer(w, layout, &wp, &bytes)) return {};
    at::Tensor rows = x.dim() == 2 ? x : x.reshape({-1, k}); /* [M, K] */
    if (rows.stride(1) != 1) rows = rows.contiguous();
    const int64_t m = rows.size(0);
    at::Tensor out = at::empty({m, n}, x.options());
    const linear_args a{rows.data_ptr(), rows.stride(0), wp, bias.has_value() ? bias->data_ptr() : nullptr,
                        out.data_ptr(), n, m, n, k, code, static_cast<int32_t>(at::get_num_threads()),
                        static_cast<int32_t>(layout), bytes};
    if (kernel(&a)) return {}; /* a layout it does not know, or a buffer of another size: nothing written */
    if (x.dim() == 2) return out;
    auto shape = x.sizes().vec();
    shape.back() = n;
    return out.view(shape);
}

at::Tensor linear(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias, int64_t layout) {
    if (validating()) return python_linear(x, w, bias, layout);
    at::Tensor out = native_linear(x, w, bias, layout);
    return out.defined() ? out : onednn_linear(x, w, bias);
}

/* rows, columns and the elements between rows of x [..., C] read as rows of its last dimension; false where its
   leading dimensions do not flatten into one stride or its rows are not contiguous */
bool rows_of(const at::Tensor &x, int64_t *rows, int64_t *cols, int64_t *row_stride) {
    if (x.dim() == 0 || (x.size(-1) > 1 && x.stride(-1) != 1)) return false;
    int64_t n = 1, stride = -1;
    for (int64_t d = x.dim() - 2; d >= 0; d--) {
        if (x.size(d) == 1) continue;
        if (stride < 0)
            stride = x.stride(d);
        else if (x.stride(d) != stride * n) /* this dimension's step spans the rows of those inside it */
            return false;
        n *= x.size(d);
    }
    *rows = n, *cols = x.size(-1), *row_stride = stride < 0 ? x.size(-1) : stride;
    return true;
}

using silu_fn = decltype(&pagedattn_silu_mul);
std::atomic<silu_fn> bound_silu{nullptr};

/* SiLU(gate) * up in float32, one rounding to the dtype (small_linear.c's pagedattn_silu_mul): the bound kernel where
   the tensors suit it, else the same arithmetic by ATen. A new contiguous tensor. */
at::Tensor silu_mul(const at::Tensor &gate, const at::Tensor &up) {
    silu_fn kernel = bound_silu.load(std::memory_order_relaxed);
    const int code = gate.scalar_type() == at::kFloat ? 0 : gate.scalar_type() == at::kBFloat16 ? 1 : -1;
    int64_t rows = 0, cols = 0, g_row = 0, u_rows = 0, u_cols = 0, u_row = 0;
    if (kernel && code >= 0 && up.scalar_type() == gate.scalar_type() && up.sizes() == gate.sizes() &&
        gate.device().is_cpu() && up.device().is_cpu() && !gate.is_mkldnn() && !up.is_mkldnn() &&
        rows_of(gate, &rows, &cols, &g_row) && rows_of(up, &u_rows, &u_cols, &u_row)) {
        at::Tensor out = at::empty(gate.sizes(), gate.options());
        const silu_mul_args a{gate.data_ptr(), up.data_ptr(), out.data_ptr(), g_row, u_row, cols, rows, cols, code,
                              static_cast<int32_t>(at::get_num_threads())};
        if (!kernel(&a)) return out;
    }
    return at::mul(at::silu(gate.to(at::kFloat)), up.to(at::kFloat)).to(gate.scalar_type());
}

void bind_silu_mul(int64_t kernel) { bound_silu.store(reinterpret_cast<silu_fn>(kernel)); }

void bind_linear(int64_t kernel, int64_t rows_float32, int64_t rows_bfloat16) {
    small_rows[0].store(rows_float32);
    small_rows[1].store(rows_bfloat16);
    bound_kernel.store(reinterpret_cast<linear_fn>(kernel));
}

void set_validation(int64_t mode) { validation.store(mode < 0 ? -1 : mode ? 1 : 0); }

/* A oneDNN tensor of `sizes` and `dtype` over buffer's bytes from `offset` on, in the layout that `descriptor` (a
   oneDNN tensor's serialized memory descriptor, torch.ops.mkldnn._get_mkldnn_serialized_md) gives, made as
   AOTInductor makes its oneDNN constants from its blob (its C shim): the tensor does not own the bytes, so the caller
   keeps `buffer` as long as the tensor is used. Refused (nothing made) where the layout's bytes would not lie inside
   the buffer. */
at::Tensor onednn_from_buffer(const at::Tensor &buffer, int64_t offset, at::IntArrayRef sizes, at::ScalarType dtype,
                              const at::Tensor &descriptor) {
    TORCH_CHECK(buffer.device().is_cpu() && buffer.scalar_type() == at::kByte && buffer.dim() == 1 &&
                    buffer.is_contiguous() && !buffer.is_mkldnn(),
                "onednn_from_buffer: the buffer must be a contiguous uint8 CPU tensor");
    TORCH_CHECK(descriptor.device().is_cpu() && descriptor.scalar_type() == at::kByte && descriptor.dim() == 1 &&
                    descriptor.is_contiguous() && descriptor.numel() > 0,
                "onednn_from_buffer: the descriptor must be a serialized oneDNN memory descriptor (uint8)");
    TORCH_CHECK(offset >= 0 && offset <= buffer.numel(), "onednn_from_buffer: offset ", offset, " outside the buffer");
    AtenTensorHandle handle = nullptr;
    const std::vector<int64_t> strides(sizes.size(), 0); /* a oneDNN tensor has none: the descriptor lays it out */
    const AOTITorchError err = aoti_torch_create_tensor_from_blob_v2(
        static_cast<char *>(buffer.data_ptr()) + offset, static_cast<int64_t>(sizes.size()), sizes.data(),
        strides.data(), 0, static_cast<int32_t>(dtype), aoti_torch_device_type_cpu(), 0, &handle,
        aoti_torch_layout__mkldnn(), descriptor.data_ptr<uint8_t>(), descriptor.numel());
    TORCH_CHECK(err == AOTI_TORCH_SUCCESS && handle, "onednn_from_buffer: oneDNN refused the descriptor");
    at::Tensor out = *torch::aot_inductor::tensor_handle_to_tensor_pointer(handle);
    aoti_torch_delete_tensor_object(handle);
    static auto size = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("mkldnn::_nbytes", "")
                           .typed<int64_t(const at::Tensor &)>();
    TORCH_CHECK(offset + size.call(out) <= buffer.numel(), "onednn_from_buffer: the layout's ", size.call(out),
                " bytes from offset ", offset, " pass the buffer's end (", buffer.numel(), " bytes)");
    return out;
}

} // namespace

TORCH_LIBRARY(pagedattn_native, m) {
    m.def("linear(Tensor x, Tensor weight, Tensor? bias, int layout) -> Tensor");
    m.def("bind_linear(int kernel, int rows_float32, int rows_bfloat16) -> ()");
    m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
    m.def("bind_silu_mul(int kernel) -> ()");
    m.def("set_validation(int mode) -> ()");
    m.def("onednn_from_buffer(Tensor buffer, int offset, int[] sizes, ScalarType dtype, Tensor descriptor) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedattn_native, CPU, m) {
    m.impl("linear", &linear);
    m.impl("silu_mul", &silu_mul);
}

TORCH_LIBRARY_IMPL(pagedattn_native, MkldnnCPU, m) { m.impl("linear", &linear); }

TORCH_LIBRARY_IMPL(pagedattn_native, CompositeExplicitAutograd, m) {
    m.impl("bind_linear", &bind_linear);
    m.impl("bind_silu_mul", &bind_silu_mul);
    m.impl("set_validation", &set_validation);
    m.impl("onednn_from_buffer", &onednn_from_buffer);
}
