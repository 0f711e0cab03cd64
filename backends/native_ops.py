"""pagedattn's C++ operators (``csrc/linear_op.cpp``, ``csrc/paged_ops.cpp``, ``csrc/step_allocator.cpp``): kernels a
compiled CPU step calls many times a step, registered with torch's dispatcher so that a call runs no Python.

``pagedattn_native::linear`` is ``pagedattn::linear`` (a serving step's linears over frozen weights, see
:mod:`pagedattn.backends.cpu_linear`) with its CPU kernel in C++: the same native kernel (``csrc/small_linear.c``,
bound by address), the same row limits, the same oneDNN fallback, so its results are the Python kernel's bit for bit.
On llama16m bf16 (16 requests, 2-core EPYC) a decode step calls 25 linears; the Python kernel costs ~14 us a call
against ~8 us for this one (``benchmarks/RESULTS.md``).

``pagedattn_native::write_kv_cache`` and ``pagedattn_native::paged_attention`` take the paged ops' arguments and give
their results: a call runs ``csrc/paged_decode.c``'s write or decode kernel and ``csrc/paged_prefill.c``'s prefill
kernel from C++ when it is one the Python path would send there with no further work (the bound backend is the plain
:class:`SdpaCpuBackend`: :func:`use_backend` tells the C++ side per thread, and where bindings of asyncio tasks on one
thread interleave, every call goes to the Python op until the thread has none left; every check passes; every
sequence is a decode, a fresh prompt (with the step's keys given) or a chunk over cached keys; no tensor parameters or
position program; for prompts and chunks no soft-cap or chunked attention, and none that SDPA's kernel takes on this
machine),
and otherwise goes to the ``pagedattn::`` op unchanged, which then does what it always does.
:class:`NativePagedOps` puts them in a compiled CPU step.

While validation is on (``PAGEDATTN_VALIDATE``, ``metadata.set_validation``) every call goes to the ``pagedattn::``
op (the linear's re-proves the weight's layout).

While a thread has the plain CPU backend bound (the serving scope), torch's CPU tensors come from a caching allocator
(``csrc/step_allocator.cpp``, :func:`step_memory`): a compiled step's ~90 buffers a decode step are then free-list
blocks, not malloc's (``PAGEDATTN_STEP_ALLOCATOR=0`` or :func:`set_step_allocator`: torch's allocator throughout;
:func:`release_step_memory`).

Built on first use with a C++ compiler and torch's headers alone (no Python or pybind headers: ~15 s on 2 cores for
the three files), cached like the C library (:func:`pagedattn.backends.native.build_shared`: private cache folder, keyed by the sources,
the compiler, torch's version and the machine) and loaded with ``torch.ops.load_library``. Without a C++ compiler,
or where the C library is not built, :func:`load` returns False and steps keep the ``pagedattn::`` ops.
``PAGEDATTN_NATIVE=0`` turns both off.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import threading
from importlib import resources
from pathlib import Path
from typing import Optional

import torch

from pagedattn.backends import metadata, native

log = logging.getLogger("pagedattn")

__all__ = ["load", "loaded", "cxx_compiler", "linear_op", "paged_ops", "Binding", "bind_backend", "restore_backend",
           "ask_backend_again",
           "bind_kernels", "bind_paged_kernels", "StepMemory", "step_memory", "set_step_allocator",
           "release_step_memory", "NativePagedOps", "SiluMul", "silu_mul_op", "source_digest", "SOURCES",
           "onednn_from_buffer"]

SOURCES = ("pagedattn_abi.h", "linear_op.cpp", "paged_ops.cpp", "step_allocator.cpp")


def cxx_compiler() -> Optional[str]:
    """The C++ compiler the operators are built with (``CXX``, else ``c++``, else ``g++``), None where there is none."""
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _flags() -> tuple[str, ...]:
    include = Path(torch.__file__).parent / "include"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ("-O2", "-std=gnu++20", "-shared", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{include}")


def _libs() -> tuple[str, ...]:
    lib = Path(torch.__file__).parent / "lib"
    return (f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch", "-ltorch_cpu", "-lc10")


@functools.lru_cache(maxsize=1)
def load() -> bool:
    """Build (or find in the cache) and load the operators, bound to the C library's kernels; False where they cannot
    run here (no C++ compiler, no C library, a failed build: the reason goes to the debug log)."""
    lib = native.load()
    cxx = cxx_compiler()
    if lib is None or cxx is None:
        log.debug("pagedattn: C++ operators off: %s", "no C library" if lib is None else "no C++ compiler (set CXX)")
        return False
    csrc = resources.files("pagedattn.backends").joinpath("csrc")
    sources = {name: csrc.joinpath(name).read_bytes() for name in SOURCES}
    key = f"{torch.__version__} {torch.version.git_version}".encode()
    try:
        # no object cache: torch's headers name the build's own temporary folder (__FILE__), so no unit would be found
        path = native.build_shared(sources, cxx, _flags(), "native_ops", key=key, libs=_libs(), unit_cache=False)
        if path is None:
            return False
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        log.debug("pagedattn: C++ operators off: %s", e)
        return False
    bind_kernels()
    from pagedattn.backends import ops  # the paged ops' own fakes (ops imports this module through base)

    torch.library.register_fake("pagedattn_native::linear", _fake_linear)
    torch.library.register_fake("pagedattn_native::silu_mul", _fake_silu_mul)
    torch.library.register_fake("pagedattn_native::write_kv_cache", ops.fake_write_kv_cache)
    torch.library.register_fake("pagedattn_native::paged_attention", ops.fake_paged_attention)
    metadata.on_validation_change(_sync_validation)
    _sync_validation(metadata.validation_override())
    return True


def bind_kernels(lib: Optional[ctypes.CDLL] = None) -> None:
    """Bind the operators to ``lib``'s kernels: the linears, SiLU x up, and the paged write, decode and prefill (as
    :func:`bind_paged_kernels` binds them); None: the C library's, as :func:`load` binds them. Which calls go to a
    kernel stays the C library's policy whatever ``lib`` is: the linears of up to ``cpu_linear.SMALL_ROWS`` rows in the
    dtypes it has a kernel for. Another library with the same symbols stands in for the kernels
    (``benchmarks/host_step.py`` binds no-ops to time the compiled step's own work around them). Needs :func:`load`'s
    operators."""
    from pagedattn.backends.cpu_linear import SMALL_ROWS  # the policy's module imports this one

    kernels = native.load()
    lib = kernels if lib is None else lib
    rows = {dtype: SMALL_ROWS.get(dtype, 0) if dtype in native.linear_dtypes(kernels) else 0
            for dtype in (torch.float32, torch.bfloat16)}
    address = functools.partial(_address, lib)
    ops = torch.ops.pagedattn_native
    ops.bind_linear(address("pagedattn_linear"), rows[torch.float32], rows[torch.bfloat16])
    ops.bind_silu_mul(address("pagedattn_silu_mul"))
    bind_paged_kernels(lib=lib)


def bind_paged_kernels(sdpa_prefill_tokens: Optional[int] = None,
                       sdpa_chunk_bounds: Optional[tuple[int, int]] = None,
                       rest_batch_bytes: Optional[int] = None, *, lib: Optional[ctypes.CDLL] = None) -> None:
    """Bind the paged stand-ins to the C library's write, decode and prefill kernels, leaving to the Python op the
    steps that SDPA's kernel serves in part: a fresh bfloat16 prompt of ``sdpa_prefill_tokens`` or more, a bfloat16
    chunk after cached keys of at least ``sdpa_chunk_bounds``' queries and query-key pairs (None: where
    ``sdpa_cpu.sdpa_prefill_pays`` and ``sdpa_chunk_pays`` send such prompts and chunks to SDPA's kernel on this
    machine; 0: none). Chunks over cached keys are gathered in batches of at most ``rest_batch_bytes`` of K/V (None:
    ``sdpa_cpu.REST_BATCH_BYTES``, as the Python path batches them). ``lib``: the library whose kernels are bound
    (None: the C library, :func:`native.load`). Needs :func:`load`'s operators."""
    from pagedattn.backends import sdpa_cpu  # it imports this module's package

    tokens = sdpa_cpu.sdpa_prefill_tokens() if sdpa_prefill_tokens is None else sdpa_prefill_tokens
    chunk_tokens, chunk_work = sdpa_cpu.sdpa_chunk_bounds() if sdpa_chunk_bounds is None else sdpa_chunk_bounds
    batch = sdpa_cpu.REST_BATCH_BYTES if rest_batch_bytes is None else rest_batch_bytes
    address = functools.partial(_address, native.load() if lib is None else lib)
    torch.ops.pagedattn_native.bind_paged(address("pagedattn_paged_decode"), address("pagedattn_write_kv"),
                                          address("pagedattn_prefill"), tokens, chunk_tokens, chunk_work, batch)


def loaded() -> bool:
    """Whether :func:`load` ran and succeeded (never builds)."""
    return load.cache_info().currsize > 0 and load()


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _fake_linear(x, weight, bias, layout):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _fake_silu_mul(gate, up):
    return gate.new_empty(gate.shape)


def _sync_validation(enabled: Optional[bool]) -> None:
    """Tell the C++ side about ``metadata.set_validation`` (None: the environment decides, as in Python)."""
    torch.ops.pagedattn_native.set_validation(-1 if enabled is None else int(enabled))


def linear_op():
    """``torch.ops.pagedattn_native.linear.default`` where the operators run here (:func:`load`), else None."""
    return torch.ops.pagedattn_native.linear.default if native.enabled() and load() else None


def silu_mul_op():
    """``torch.ops.pagedattn_native.silu_mul.default`` where the operators run here (:func:`load`), else None."""
    return torch.ops.pagedattn_native.silu_mul.default if native.enabled() and load() else None


def onednn_from_buffer(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    """A oneDNN tensor laid out as ``like`` (a oneDNN tensor: its sizes, dtype and memory descriptor) over the bytes of
    ``buffer`` (contiguous uint8, CPU) from ``offset`` on, which it does not own: the caller keeps ``buffer``. None where
    the operators do not run here. The bytes are ``buffer``'s as they are: copying ``like``'s in is the caller's."""
    if not (native.enabled() and load()):
        return None
    try:
        serialized = torch.ops.mkldnn._get_mkldnn_serialized_md
    except AttributeError:  # a torch without it: no descriptor to make the tensor from
        return None
    descriptor = serialized(like)
    return torch.ops.pagedattn_native.onednn_from_buffer(buffer, offset, list(like.shape), like.dtype, descriptor)


def paged_ops() -> Optional[tuple]:
    """``(write_kv_cache, paged_attention)``: the C++ stand-ins of the paged ops where the operators run here
    (:func:`load`), else None."""
    if not (native.enabled() and load()):
        return None
    ops = torch.ops.pagedattn_native
    return ops.write_kv_cache.default, ops.paged_attention.default


@dataclasses.dataclass(eq=False)
class Binding:
    """One live ``use_backend`` binding on a thread, as :func:`bind_backend` told the C++ ops about it."""

    backend: object
    was: bool  # the C++ ops' setting before it


# This thread's live bindings, innermost last, and whether they interleave. The C++ ops keep their setting per thread
# and ``use_backend`` its binding per context: asyncio tasks on one thread may bind and unbind out of order, and then
# no setting of the thread's fits each task's binding, so the C++ ops leave every call to the Python op (which reads
# the task's own binding) until the thread has no binding left.
_THREAD = threading.local()


def bind_backend(backend, outer=None) -> Optional[Binding]:
    """Tell this thread's C++ paged ops whether they stand in for ``backend`` (``use_backend``'s, bound inside
    ``outer``, its context's binding before; None: the defaults, which they leave to the Python ops); the binding, for
    :func:`restore_backend`, or None where the operators are not loaded (nothing to tell)."""
    if not loaded():
        return None
    live = _THREAD.__dict__.setdefault("live", [])
    if (live[-1].backend if live else None) is not outer:  # another context's binding is live on this thread
        _THREAD.interleaved = True
    on = backend is not None and not getattr(_THREAD, "interleaved", False) and backend.native_ops_stand_in()
    binding = Binding(backend, torch.ops.pagedattn_native.set_plain_backend(on))
    live.append(binding)
    return binding


def restore_backend(binding: Binding) -> None:
    """End a binding :func:`bind_backend` made: the C++ ops' setting before it (nested bindings), off where the
    thread's bindings interleaved or none is left."""
    live = _THREAD.live
    live.remove(binding)
    if not live:
        _THREAD.interleaved = False
    on = binding.was and bool(live) and not getattr(_THREAD, "interleaved", False)
    torch.ops.pagedattn_native.set_plain_backend(on)


def ask_backend_again(backend) -> None:
    """Tell this thread's C++ ops again whether they stand in for ``backend``, the innermost binding's (its methods may
    have been wrapped since, ``ops.forget_prepared_calls``)."""
    live = getattr(_THREAD, "live", None)
    if loaded() and live and live[-1].backend is backend and not getattr(_THREAD, "interleaved", False):
        torch.ops.pagedattn_native.set_plain_backend(backend.native_ops_stand_in())


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """The serving scope's CPU allocator (``csrc/step_allocator.cpp``): while a thread has the plain CPU backend bound
    it makes torch's CPU tensors, keeping freed blocks for the next tensors of their size class."""

    active: bool  # it makes CPU tensors now
    kept_bytes: int  # free blocks it keeps
    made: int  # blocks of its size classes it took from the system
    reused: int  # blocks it handed out again


def step_memory() -> Optional[StepMemory]:
    """Where the serving scope's CPU allocator stands; None where the operators are not loaded."""
    if not loaded():
        return None
    active, kept, made, reused = torch.ops.pagedattn_native.step_allocator_stats()
    return StepMemory(bool(active), kept, made, reused)


def set_step_allocator(on: bool) -> Optional[bool]:
    """Whether the serving scope's CPU tensors come from its caching allocator from now on (the default unless
    ``PAGEDATTN_STEP_ALLOCATOR=0``; inside the scope it changes at once); the previous setting, or None where the
    operators are not loaded."""
    if not loaded():
        return None
    return torch.ops.pagedattn_native.set_step_allocator(bool(on))


def release_step_memory() -> None:
    """Give the free blocks the serving scope's CPU allocator keeps back to the system (tensors still in use stay)."""
    if loaded():
        torch.ops.pagedattn_native.release_step_memory()


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - torch without Inductor's custom passes
    CustomGraphPass = object


class NativePagedOps(CustomGraphPass):
    """Inductor post-grad pass (before Inductor's own): the paged ops of a compiled CPU step become their C++
    stand-ins (:func:`paged_ops`), the cache write inside its functionalized wrapper as well. The stand-ins decide per
    call whether they run it, so the pass needs to know nothing about the backend that will be bound."""

    def __call__(self, graph) -> None:
        found = paged_ops()
        if found is None:
            return
        write, attend = found
        swap = {torch.ops.pagedattn.write_kv_cache.default: write, torch.ops.pagedattn.paged_attention.default: attend}
        wrappers = {getattr(torch.ops.higher_order, name, None) for name in ("auto_functionalized",
                                                                              "auto_functionalized_v2")} - {None}
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            if node.target in swap:
                node.target = swap[node.target]
            elif node.target in wrappers and node.args and node.args[0] in swap:
                node.args = (swap[node.args[0]], *node.args[1:])

    def uuid(self) -> str:
        return hashlib.sha256(b"native paged ops " + source_digest() + (b"c++" if paged_ops() else b"python")).hexdigest()


def _silu_input(node) -> Optional[torch.fx.Node]:
    """The ``x`` of a graph node that computes ``SiLU(x)``: ``aten.silu``, or Inductor's decomposition of it,
    ``x / (1 + exp(-x))`` with ``x`` converted to float32 first and the result converted back, or neither (float32);
    None for any other node."""
    aten, convert = torch.ops.aten, torch.ops.prims.convert_element_type.default
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.silu.default:
        return node.args[0] if isinstance(node.args[0], torch.fx.Node) else None
    if node.target is convert:
        node = node.args[0]
        if not isinstance(node, torch.fx.Node) or node.op != "call_function":
            return None
    if node.target is not aten.div.Tensor or len(node.args) != 2:
        return None
    x, den = node.args
    if not (isinstance(den, torch.fx.Node) and den.target is aten.add.Tensor and len(den.args) == 2
            and den.args[1] == 1 and not den.kwargs):
        return None
    e = den.args[0]
    if not (isinstance(e, torch.fx.Node) and e.target is aten.exp.default):
        return None
    neg = e.args[0]
    if not (isinstance(neg, torch.fx.Node) and neg.target is aten.neg.default and neg.args[0] is x):
        return None
    if isinstance(x, torch.fx.Node) and x.target is convert and x.args[1] == torch.float32:
        return x.args[0]
    return x


def _same_rows(a, b) -> bool:
    """Whether graph values ``a`` and ``b`` are tensors of one shape and of one dtype the kernel takes here (those of
    the linears: ``native.linear_dtypes``)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    va, vb = (n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (a, b))
    # sizes equal for every size the step accepts, not just at the sizes traced (and no guard added to decide it)
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype and \
        va.dtype in native.linear_dtypes(native.load()) and statically_known_true(sym_eq(va.shape, vb.shape))


class SiluMul(CustomGraphPass):
    """Inductor post-grad pass (before Inductor's own): a gated MLP's ``SiLU(gate) * up`` (:func:`_silu_input`, then an
    ``aten.mul`` by a tensor of the same shape and dtype) becomes ``pagedattn_native::silu_mul(gate, up)``: the same
    float32 arithmetic, one rounding (Inductor's own fused kernel does not round SiLU's result either), by the native
    kernel, ~0.65x the time of Inductor's (Sleef's exp and a division per element; ``benchmarks/RESULTS.md``). Nodes the
    product alone used are dropped; any other product is left as it is."""

    def __call__(self, graph) -> None:
        op = silu_mul_op()
        if op is None:
            return
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not torch.ops.aten.mul.Tensor or len(node.args) != 2 \
                    or node.kwargs:
                continue
            for silu, up in (node.args, node.args[::-1]):
                gate = _silu_input(silu)
                if gate is not None and _same_rows(gate, up) and _same_rows(gate, node):
                    with graph.inserting_before(node):
                        fused = graph.call_function(op, (gate, up))
                    fused.meta.update(node.meta)
                    node.replace_all_uses_with(fused)
                    graph.erase_node(node)
                    _drop_unused(silu)
                    break

    def uuid(self) -> str:
        return hashlib.sha256(b"silu mul " + source_digest() + (b"c++" if silu_mul_op() else b"off")).hexdigest()


def _drop_unused(node) -> None:
    """``node`` and, in turn, the inputs it alone used, out of the graph where nothing else reads them (pure
    arithmetic only: the SiLU's nodes)."""
    pure = {torch.ops.aten.silu.default, torch.ops.aten.div.Tensor, torch.ops.aten.add.Tensor,
            torch.ops.aten.exp.default, torch.ops.aten.neg.default, torch.ops.prims.convert_element_type.default}
    todo, erased = [node], set()
    while todo:
        n = todo.pop()
        if isinstance(n, torch.fx.Node) and n not in erased and n.op == "call_function" and n.target in pure \
                and not n.users:
            todo.extend(n.all_input_nodes)
            n.graph.erase_node(n)
            erased.add(n)


def source_digest() -> bytes:
    """A digest of the operators' sources and this module: part of the cache key of a pass that puts them in."""
    package = resources.files("pagedattn.backends")
    h = hashlib.sha256(package.joinpath("native_ops.py").read_bytes())
    for name in SOURCES:
        h.update(package.joinpath("csrc", name).read_bytes())
    return h.digest()
