"""pagedattn's C++ operators (``csrc/linear_op.cpp``, ``csrc/paged_ops.cpp``): kernels a compiled CPU step calls many
times a step, registered with torch's dispatcher so that a call runs no Python.

``pagedattn_native::linear`` is ``pagedattn::linear`` (a serving step's linears over frozen weights, see
:mod:`pagedattn.backends.cpu_linear`) with its CPU kernel in C++: the same native kernel (``csrc/small_linear.c``,
bound by address), the same row limits, the same oneDNN fallback, so its results are the Python kernel's bit for bit.
On llama16m bf16 (16 requests, 2-core EPYC) a decode step calls 25 linears; the Python kernel costs ~14 us a call
against ~8 us for this one (``benchmarks/RESULTS.md``).

``pagedattn_native::write_kv_cache`` and ``pagedattn_native::paged_attention`` take the paged ops' arguments and give
their results: a call runs ``csrc/paged_decode.c``'s write or decode kernel and ``csrc/paged_prefill.c``'s prefill
kernel from C++ when it is one the Python path would send there with no further work (the bound backend is the plain
:class:`SdpaCpuBackend`: :func:`use_backend` tells the C++ side per thread; every check passes; every sequence is a
decode, a fresh prompt (with the step's keys given) or a chunk over cached keys; no tensor parameters or position
program; for prompts and chunks no soft-cap or chunked attention, and none that SDPA's kernel takes on this machine),
and otherwise goes to the ``pagedattn::`` op unchanged, which then does what it always does.
:class:`NativePagedOps` puts them in a compiled CPU step.

While validation is on (``PAGEDATTN_VALIDATE``, ``metadata.set_validation``) every call goes to the ``pagedattn::``
op (the linear's re-proves the weight's layout).

Built on first use with a C++ compiler and torch's headers alone (no Python or pybind headers: ~12 s on 2 cores for
both files), cached like the C library (:func:`pagedattn.backends.native.build_shared`: private cache folder, keyed by the sources,
the compiler, torch's version and the machine) and loaded with ``torch.ops.load_library``. Without a C++ compiler,
or where the C library is not built, :func:`load` returns False and steps keep the ``pagedattn::`` ops.
``PAGEDATTN_NATIVE=0`` turns both off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
from importlib import resources
from pathlib import Path
from typing import Optional

import torch

from pagedattn.backends import metadata, native

log = logging.getLogger("pagedattn")

__all__ = ["load", "loaded", "cxx_compiler", "linear_op", "paged_ops", "bind_backend", "restore_backend",
           "bind_paged_kernels", "NativePagedOps", "source_digest", "SOURCES"]

SOURCES = ("pagedattn_abi.h", "linear_op.cpp", "paged_ops.cpp")


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
        path = native.build_shared(sources, cxx, _flags(), "native_ops", key=key, libs=_libs())
        if path is None:
            return False
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        log.debug("pagedattn: C++ operators off: %s", e)
        return False
    from pagedattn.backends.cpu_linear import SMALL_ROWS  # the policy's module imports this one

    rows = {dtype: SMALL_ROWS.get(dtype, 0) if dtype in native.linear_dtypes(lib) else 0
            for dtype in (torch.float32, torch.bfloat16)}
    address = functools.partial(_address, lib)
    ops = torch.ops.pagedattn_native
    ops.bind_linear(address("pagedattn_linear"), rows[torch.float32], rows[torch.bfloat16])
    bind_paged_kernels()
    from pagedattn.backends import ops  # the paged ops' own fakes (ops imports this module through base)

    torch.library.register_fake("pagedattn_native::linear", _fake_linear)
    torch.library.register_fake("pagedattn_native::write_kv_cache", ops.fake_write_kv_cache)
    torch.library.register_fake("pagedattn_native::paged_attention", ops.fake_paged_attention)
    metadata.on_validation_change(_sync_validation)
    _sync_validation(metadata.validation_override())
    return True


def bind_paged_kernels(sdpa_prefill_tokens: Optional[int] = None,
                       sdpa_chunk_bounds: Optional[tuple[int, int]] = None,
                       rest_batch_bytes: Optional[int] = None) -> None:
    """Bind the paged stand-ins to the C library's write, decode and prefill kernels, leaving to the Python op the
    steps that SDPA's kernel serves in part: a fresh bfloat16 prompt of ``sdpa_prefill_tokens`` or more, a bfloat16
    chunk after cached keys of at least ``sdpa_chunk_bounds``' queries and query-key pairs (None: where
    ``sdpa_cpu.sdpa_prefill_pays`` and ``sdpa_chunk_pays`` send such prompts and chunks to SDPA's kernel on this
    machine; 0: none). Chunks over cached keys are gathered in batches of at most ``rest_batch_bytes`` of K/V (None:
    ``sdpa_cpu.REST_BATCH_BYTES``, as the Python path batches them). Needs :func:`load`'s library."""
    from pagedattn.backends import sdpa_cpu  # it imports this module's package

    tokens = sdpa_cpu.sdpa_prefill_tokens() if sdpa_prefill_tokens is None else sdpa_prefill_tokens
    chunk_tokens, chunk_work = sdpa_cpu.sdpa_chunk_bounds() if sdpa_chunk_bounds is None else sdpa_chunk_bounds
    batch = sdpa_cpu.REST_BATCH_BYTES if rest_batch_bytes is None else rest_batch_bytes
    address = functools.partial(_address, native.load())
    torch.ops.pagedattn_native.bind_paged(address("pagedattn_paged_decode"), address("pagedattn_write_kv"),
                                          address("pagedattn_prefill"), tokens, chunk_tokens, chunk_work, batch)


def loaded() -> bool:
    """Whether :func:`load` ran and succeeded (never builds)."""
    return load.cache_info().currsize > 0 and load()


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _fake_linear(x, weight, bias, layout):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _sync_validation(enabled: Optional[bool]) -> None:
    """Tell the C++ side about ``metadata.set_validation`` (None: the environment decides, as in Python)."""
    torch.ops.pagedattn_native.set_validation(-1 if enabled is None else int(enabled))


def linear_op():
    """``torch.ops.pagedattn_native.linear.default`` where the operators run here (:func:`load`), else None."""
    return torch.ops.pagedattn_native.linear.default if native.enabled() and load() else None


def paged_ops() -> Optional[tuple]:
    """``(write_kv_cache, paged_attention)``: the C++ stand-ins of the paged ops where the operators run here
    (:func:`load`), else None."""
    if not (native.enabled() and load()):
        return None
    ops = torch.ops.pagedattn_native
    return ops.write_kv_cache.default, ops.paged_attention.default


def bind_backend(backend) -> Optional[bool]:
    """Tell this thread's C++ paged ops whether they stand in for ``backend`` (``use_backend``'s; None: the
    defaults, which they leave to the Python ops); the previous setting, for :func:`restore_backend`, or None where
    the operators are not loaded (nothing to tell)."""
    if not loaded():
        return None
    return torch.ops.pagedattn_native.set_plain_backend(backend is not None and backend.native_ops_stand_in())


def restore_backend(was: bool) -> None:
    """Give this thread's C++ paged ops back the setting :func:`bind_backend` returned."""
    torch.ops.pagedattn_native.set_plain_backend(was)


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


def source_digest() -> bytes:
    """A digest of the operators' sources and this module: part of the cache key of a pass that puts them in."""
    package = resources.files("pagedattn.backends")
    h = hashlib.sha256(package.joinpath("native_ops.py").read_bytes())
    for name in SOURCES:
        h.update(package.joinpath("csrc", name).read_bytes())
    return h.digest()
