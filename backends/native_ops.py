"""pagedattn's C++ operators (``csrc/linear_op.cpp``): kernels a compiled CPU step calls many times a step, registered
with torch's dispatcher so that a call runs no Python.

``pagedattn_native::linear`` is ``pagedattn::linear`` (a serving step's linears over frozen weights, see
:mod:`pagedattn.backends.cpu_linear`) with its CPU kernel in C++: the same native kernel (``csrc/small_linear.c``,
bound by address), the same row limits, the same oneDNN fallback, so its results are the Python kernel's bit for bit.
On llama16m bf16 (16 requests, 2-core EPYC) a decode step calls 25 linears; the Python kernel costs ~14 us a call
against ~8 us for this one (``benchmarks/RESULTS.md``). While validation is on (``PAGEDATTN_VALIDATE``,
``metadata.set_validation``) a call goes to ``pagedattn::linear``, which re-proves the weight's layout.

Built on first use with a C++ compiler and torch's headers alone (no Python or pybind headers: ~6 s on 2 cores),
cached like the C library (:func:`pagedattn.backends.native.build_shared`: private cache folder, keyed by the source,
the compiler, torch's version and the machine) and loaded with ``torch.ops.load_library``. Without a C++ compiler,
or where the C library is not built, :func:`load` returns False and the step keeps ``pagedattn::linear``.
``PAGEDATTN_NATIVE=0`` turns both off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
from importlib import resources
from pathlib import Path
from typing import Optional

import torch

from pagedattn.backends import metadata, native

log = logging.getLogger("pagedattn")

__all__ = ["load", "linear_op", "SOURCE"]

SOURCE = "linear_op.cpp"


def _compiler() -> Optional[str]:
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
    cxx = _compiler()
    if lib is None or cxx is None:
        log.debug("pagedattn: C++ operators off: %s", "no C library" if lib is None else "no C++ compiler (set CXX)")
        return False
    source = resources.files("pagedattn.backends").joinpath("csrc", SOURCE).read_bytes()
    key = f"{torch.__version__} {torch.version.git_version}".encode()
    try:
        path = native.build_shared({SOURCE: source}, cxx, _flags(), "native_ops", key=key, libs=_libs())
        if path is None:
            return False
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        log.debug("pagedattn: C++ operators off: %s", e)
        return False
    from pagedattn.backends.cpu_linear import SMALL_ROWS  # the policy's module imports this one

    rows = {dtype: SMALL_ROWS.get(dtype, 0) if dtype in native.linear_dtypes(lib) else 0
            for dtype in (torch.float32, torch.bfloat16)}
    kernel = ctypes.cast(lib.pagedattn_linear, ctypes.c_void_p).value
    torch.ops.pagedattn_native.bind_linear(kernel, rows[torch.float32], rows[torch.bfloat16])
    torch.library.register_fake("pagedattn_native::linear", _fake_linear)
    metadata.on_validation_change(_sync_validation)
    _sync_validation(metadata.validation_override())
    return True


def _fake_linear(x, weight, bias, layout):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _sync_validation(enabled: Optional[bool]) -> None:
    """Tell the C++ side about ``metadata.set_validation`` (None: the environment decides, as in Python)."""
    torch.ops.pagedattn_native.set_validation(-1 if enabled is None else int(enabled))


def linear_op():
    """``torch.ops.pagedattn_native.linear.default`` where the operators run here (:func:`load`), else None."""
    return torch.ops.pagedattn_native.linear.default if native.enabled() and load() else None
