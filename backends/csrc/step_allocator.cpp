/* The CPU allocator of pagedattn's serving scope: while a thread has the plain CPU backend bound (use_backend, which
   tells paged_ops.cpp's set_plain_backend), torch's CPU allocator is this one, which keeps the blocks of freed tensors
   for the next tensors of their size class instead of giving them back to malloc.

   A compiled CPU step allocates its buffers anew at every call (AOTInductor's runner ~45 of them in a llama16m decode
   step, the C++ operators' outputs another ~40) and frees them before the next: through glibc's malloc each one is a
   search of its bins, and the blocks past its small sizes come back through its unsorted bin and its consolidation
   of fast bins (~20 % of the runner's own work around the kernels, `perf`). Here a block is a free list's last one,
   still warm in cache; a freed block goes back to its list. Steps repeat their sizes, so after a few steps every
   allocation is found.

   Size classes: 64-byte steps up to 4 KiB, then 8 to an octave (at most 12.5 % over the request). Blocks are
   c10::alloc_cpu's (64-byte aligned, a tensor's data pointer its deleter's context, as torch's allocator makes them),
   and a block's class is read back from its usable size. The free blocks kept are at most STEP_CACHE_BYTES together;
   a block freed past that goes back to the system, as does one larger than STEP_BLOCK_MAX. release_step_memory()
   gives them all back. The allocator of CPU tensors changes with the scope, so memory may be freed by another
   allocator than made it (the raw interface frees by the allocator current at the free): each takes the other's
   blocks. Allocations in the scope are not reported to torch's memory profiler.

   PAGEDATTN_STEP_ALLOCATOR=0 in the environment (read at load), or set_step_allocator(false), leaves torch's allocator
   in place. */

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <cstdint>
#include <malloc.h>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace pagedattn_native {
bool env_flag(const char *name, bool fallback); /* linear_op.cpp's */
}

namespace {

/* A large block's malloc and free are small against the work on it; the many small ones of a decode step are not */
constexpr size_t STEP_CACHE_BYTES = size_t(64) << 20; /* free blocks kept, all classes together */
constexpr size_t STEP_BLOCK_MAX = size_t(4) << 20;    /* larger blocks are never kept */

/* the class a request of `bytes` takes: 64-byte steps to 4 KiB, then 8 to an octave */
size_t size_class(size_t bytes) {
    if (bytes <= 4096) return (bytes + 63) & ~size_t(63);
    const int octave = 63 - __builtin_clzll(bytes);
    const size_t step = size_t(1) << (octave - 3);
    return (bytes + step - 1) / step * step;
}

/* the largest class a block of `usable` bytes holds */
size_t class_below(size_t usable) {
    if (usable < 4096 + 512) return usable < 4096 ? usable & ~size_t(63) : 4096;
    const int octave = 63 - __builtin_clzll(usable);
    const size_t step = size_t(1) << (octave - 3);
    return usable / step * step;
}

/* the class of a block of the CPU allocators' (c10::alloc_cpu's, which malloc makes): the largest its usable size
   holds, so that a block kept under it never holds less than the tensors it is handed to ask; a block made for a class
   reads back as that class (glibc adds at most 56 bytes to a heap chunk and less than a page to a mapped one, below
   the classes' spacing there) */
size_t class_of(void *block) { return class_below(malloc_usable_size(block)); }

struct FreeBlocks {
    std::mutex mu;
    std::unordered_map<size_t, std::vector<void *>> by_class; /* free blocks by size class */
    size_t kept = 0;                                          /* bytes of the blocks kept */
    int64_t made = 0, reused = 0;                             /* blocks taken from the system, handed out again */
};

FreeBlocks &free_blocks() {
    static FreeBlocks *blocks = new FreeBlocks(); /* never destroyed: deleters may run at exit */
    return *blocks;
}

/* a tensor's deleter: its block kept for the next tensor of its class, or given back to the system */
void give_back(void *block) {
    if (!block) return;
    const size_t cls = class_of(block);
    if (cls && cls <= STEP_BLOCK_MAX) {
        FreeBlocks &f = free_blocks();
        std::lock_guard<std::mutex> lock(f.mu);
        if (f.kept + cls <= STEP_CACHE_BYTES) {
            f.by_class[cls].push_back(block);
            f.kept += cls;
            return;
        }
    }
    c10::free_cpu(block);
}

/* Blocks are c10::alloc_cpu's own, as torch's allocator makes them (64-byte aligned, the data pointer its deleter's
   context), and give_back takes any of them: the raw interface (raw_allocate, raw_deallocate: oneDNN's ideep takes its
   buffers so) frees by the allocator current at the free, which may not be the one that made the block, and either
   allocator frees the other's blocks rightly (torch's by c10::free_cpu, this one by keeping them under the class their
   size holds). */
struct StepAllocator final : at::Allocator {
    at::DataPtr allocate(size_t bytes) override {
        if (bytes == 0) return {nullptr, nullptr, &give_back, at::Device(at::DeviceType::CPU)};
        const size_t cls = size_class(bytes);
        if (cls > STEP_BLOCK_MAX) { /* never kept: no more than asked for */
            void *block = c10::alloc_cpu(bytes);
            return {block, block, &give_back, at::Device(at::DeviceType::CPU)};
        }
        FreeBlocks &f = free_blocks();
        {
            std::lock_guard<std::mutex> lock(f.mu);
            auto it = f.by_class.find(cls);
            if (it != f.by_class.end() && !it->second.empty()) {
                void *block = it->second.back(); /* the last freed: likeliest in cache */
                it->second.pop_back();
                f.kept -= cls;
                f.reused++;
                return {block, block, &give_back, at::Device(at::DeviceType::CPU)};
            }
            f.made++;
        }
        void *block = c10::alloc_cpu(cls);
        return {block, block, &give_back, at::Device(at::DeviceType::CPU)};
    }
    at::DeleterFnPtr raw_deleter() const override { return &give_back; }
    void copy_data(void *dest, const void *src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

StepAllocator &step_allocator() {
    static StepAllocator *a = new StepAllocator();
    return *a;
}

std::mutex scope_mu;
bool enabled = pagedattn_native::env_flag("PAGEDATTN_STEP_ALLOCATOR", true); /* whether the scope uses it */
int64_t scopes = 0;                /* threads inside the scope */
at::Allocator *outside = nullptr;  /* torch's allocator while this one makes CPU tensors, given back after */

/* with scope_mu held */
void install() {
    at::Allocator *now = c10::GetCPUAllocator();
    if (now == &step_allocator()) return;
    c10::SetCPUAllocator(&step_allocator(), 0); /* ignored where another was set at a higher priority */
    if (c10::GetCPUAllocator() == &step_allocator()) outside = now;
}

/* with scope_mu held */
void uninstall() {
    if (outside && c10::GetCPUAllocator() == &step_allocator()) c10::SetCPUAllocator(outside, 0);
    outside = nullptr;
}

/* whether the scope uses it from now on (inside it, at once); the previous setting */
bool set_step_allocator(bool on) {
    std::lock_guard<std::mutex> lock(scope_mu);
    const bool was = enabled;
    enabled = on;
    if (scopes > 0) {
        if (on)
            install();
        else
            uninstall();
    }
    return was;
}

/* the free blocks given back to the system */
void release_step_memory() {
    FreeBlocks &f = free_blocks();
    std::vector<void *> blocks;
    {
        std::lock_guard<std::mutex> lock(f.mu);
        for (auto &entry : f.by_class) blocks.insert(blocks.end(), entry.second.begin(), entry.second.end());
        f.by_class.clear();
        f.kept = 0;
    }
    for (void *b : blocks) c10::free_cpu(b);
}

/* [whether it makes CPU tensors now, bytes of free blocks kept, blocks made, blocks handed out again] */
std::vector<int64_t> step_allocator_stats() {
    FreeBlocks &f = free_blocks();
    const bool current = c10::GetCPUAllocator() == &step_allocator();
    std::lock_guard<std::mutex> lock(f.mu);
    return {current ? 1 : 0, static_cast<int64_t>(f.kept), f.made, f.reused};
}

} // namespace

namespace pagedattn_native {
/* a thread enters (true) or leaves (false) the serving scope (paged_ops.cpp's set_plain_backend, on its changes) */
void step_allocator_scope(bool enter) {
    std::lock_guard<std::mutex> lock(scope_mu);
    if (enter) {
        if (scopes++ == 0 && enabled) install();
    } else if (scopes > 0 && --scopes == 0) {
        uninstall();
    }
}
} // namespace pagedattn_native

TORCH_LIBRARY_FRAGMENT(pagedattn_native, m) {
    m.def("release_step_memory() -> ()");
    m.def("step_allocator_stats() -> int[]");
    m.def("set_step_allocator(bool on) -> bool");
}

TORCH_LIBRARY_IMPL(pagedattn_native, CompositeExplicitAutograd, m) {
    m.impl("release_step_memory", &release_step_memory);
    m.impl("step_allocator_stats", &step_allocator_stats);
    m.impl("set_step_allocator", &set_step_allocator);
}
