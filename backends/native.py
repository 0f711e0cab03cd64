"""The CPU's native kernels (``csrc/paged_decode.c``, ``csrc/paged_prefill.c``: attention; ``csrc/small_linear.c``: a
serving step's linears of few rows, :func:`linear`): built on first use into one library (its units compiled at
once, :func:`build_shared`), loaded with ctypes.

Why native: a decode step's attention through SDPA gathers every sequence's blocks into a dense buffer first
(a second pass over the keys) and pays Python per call around a dozen small ops; the decode kernel reads keys and
values in place through the block table, in one call per layer, with torch's own OpenMP threads. Prefills
(:func:`prefill`): SDPA's CPU flash kernel runs short causal prefills at a small fraction of the matmul rate (a
256-token GQA prefill ~6x slower than its FLOPs at the measured rate); the native one keeps a block of query rows'
scores in registers over keys transposed once per call, ~2.5x faster, all of a step's fresh prefills in one call.
The same library writes the cache (one call a layer) and takes greedy sampling's argmax (:func:`argmax_rows`: ATen's
CPU argmax costs ~8x its max).

Why plain C through ctypes, not a torch C++ extension: it compiles in seconds (~7 s on 2 cores) with no torch or
Python headers (``torch.utils.cpp_extension`` takes minutes and ninja), and the call needs nothing but pointers.
Where a ctypes call's Python costs as much as its kernel (a decode step's linears), :mod:`native_ops` registers a
C++ operator that calls the same kernel by address (torch's headers only, :func:`build_shared`). The shared object
is cached under ``$PAGEDATTN_CACHE_DIR`` (default ``~/.cache/pagedattn``), keyed by the source, the compiler, its
flags and the machine, so a second process loads it without compiling; it is loaded from there only while that
folder and file can be written by this user alone (loading runs the file's code).

The kernel is optional: without a C compiler, or where torch does not run GNU OpenMP (the kernel's threads
must be torch's, not a second runtime competing for the cores), :func:`load` returns None and the backend
keeps its SDPA path. ``PAGEDATTN_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import array
import atexit
import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
from filelock import FileLock, Timeout
from torch import Tensor

from pagedattn.backends.metadata import check_slot_values

log = logging.getLogger("pagedattn")

__all__ = ["load", "library", "missing_prerequisite", "enabled", "write", "write_usable", "usable", "part_keys",
           "DecodeCall", "prefill", "prefill_usable", "argmax_rows", "ArgmaxWriter", "DTYPE_CODES", "MAX_HEAD_SIZE",
           "MAX_GROUP", "PREFILL_MAX_HEAD_SIZE", "build_library", "features", "FEATURE_DPBF16", "FEATURE_LINEAR_F32",
           "FEATURE_LINEAR_BF16", "FEATURE_LINEAR_AMX", "FEATURE_PREFILL_DPBF16", "linear", "linear_dtypes",
           "linear_layouts", "silu_mul", "LINEAR_PLAIN", "LINEAR_PANELS", "LINEAR_PANELS32", "PANEL_COLUMNS", "to_panels",
           "linear_panel_bytes", "onednn_bytes", "build_shared", "ObjectCache", "SOURCES", "CLOCK_KINDS", "kernel_clock"]

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_HEAD_SIZE = 512  # csrc/pagedattn_abi.h's PAGEDATTN_MAX_HEAD
MAX_GROUP = 64  # and PAGEDATTN_MAX_GROUP
# the C library's files (csrc/)
SOURCES = ("pagedattn_abi.h", "paged_common.h", "paged_decode.c", "paged_prefill.c", "small_linear.c",
           "small_linear_avx2.h")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC")
_INT32_MAX = 2**31 - 1  # a wider window than this sees every key a sequence can hold: the kernels' int32 takes it so
_BUILD_WAIT_S = 600  # how long a process waits for another's build of the same object before building it itself


class _Args(ctypes.Structure):
    """``decode_args`` of ``csrc/pagedattn_abi.h``, field for field."""

    _fields_ = [
        ("query", ctypes.c_void_p), ("q_row", ctypes.c_int64), ("q_head", ctypes.c_int64),
        ("out", ctypes.c_void_p), ("o_row", ctypes.c_int64), ("o_head", ctypes.c_int64),
        ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("c_block", ctypes.c_int64), ("c_token", ctypes.c_int64), ("c_head", ctypes.c_int64),
        ("block_tables", ctypes.c_void_p), ("table_width", ctypes.c_int64),
        ("items", ctypes.c_void_p), ("num_items", ctypes.c_int64),
        ("num_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32), ("head_size", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
        ("alibi_slopes", ctypes.c_void_p), ("sinks", ctypes.c_void_p),
        ("dtype", ctypes.c_int32), ("part_keys", ctypes.c_int32),
        ("scratch", ctypes.c_void_p), ("num_threads", ctypes.c_int32),
        ("num_blocks", ctypes.c_int64), ("num_rows", ctypes.c_int64), ("num_seqs", ctypes.c_int64),
        ("bias", ctypes.c_void_p), ("bias_item", ctypes.c_int64), ("bias_head", ctypes.c_int64),
        ("bias_numel", ctypes.c_int64),
    ]


class _WriteArgs(ctypes.Structure):
    """``write_args`` of ``csrc/pagedattn_abi.h``, field for field."""

    _fields_ = [
        ("key", ctypes.c_void_p), ("value", ctypes.c_void_p),
        ("k_row", ctypes.c_int64), ("k_head", ctypes.c_int64), ("v_row", ctypes.c_int64), ("v_head", ctypes.c_int64),
        ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("c_block", ctypes.c_int64), ("c_token", ctypes.c_int64), ("c_head", ctypes.c_int64),
        ("slots", ctypes.c_void_p), ("slots_are_64_bit", ctypes.c_int32),
        ("num_tokens", ctypes.c_int64), ("num_blocks", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int32), ("head_size", ctypes.c_int32), ("block_size", ctypes.c_int32),
        ("element_size", ctypes.c_int32),
    ]


class _LinearArgs(ctypes.Structure):
    """``linear_args`` of ``csrc/pagedattn_abi.h``, field for field."""

    _fields_ = [
        ("x", ctypes.c_void_p), ("x_row", ctypes.c_int64), ("w", ctypes.c_void_p), ("bias", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("o_row", ctypes.c_int64),
        ("M", ctypes.c_int64), ("N", ctypes.c_int64), ("K", ctypes.c_int64),
        ("dtype", ctypes.c_int32), ("num_threads", ctypes.c_int32), ("layout", ctypes.c_int32),
        ("w_bytes", ctypes.c_int64),
    ]


class _SiluMulArgs(ctypes.Structure):
    """``silu_mul_args`` of ``csrc/pagedattn_abi.h``, field for field."""

    _fields_ = [
        ("gate", ctypes.c_void_p), ("up", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("gate_row", ctypes.c_int64), ("up_row", ctypes.c_int64), ("out_row", ctypes.c_int64),
        ("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("dtype", ctypes.c_int32), ("num_threads", ctypes.c_int32),
    ]


class _PrefillArgs(ctypes.Structure):
    """``prefill_args`` of ``csrc/pagedattn_abi.h``, field for field."""

    _fields_ = [
        ("query", ctypes.c_void_p), ("q_row", ctypes.c_int64), ("q_head", ctypes.c_int64),
        ("key", ctypes.c_void_p), ("k_row", ctypes.c_int64), ("k_head", ctypes.c_int64),
        ("value", ctypes.c_void_p), ("v_row", ctypes.c_int64), ("v_head", ctypes.c_int64),
        ("out", ctypes.c_void_p), ("o_row", ctypes.c_int64), ("o_head", ctypes.c_int64),
        ("items", ctypes.c_void_p), ("num_items", ctypes.c_int64),
        ("num_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32), ("head_size", ctypes.c_int32),
        ("causal", ctypes.c_int32), ("window", ctypes.c_int32), ("dtype", ctypes.c_int32),
        ("scale", ctypes.c_float), ("scratch", ctypes.c_void_p), ("num_threads", ctypes.c_int32),
        ("num_q_rows", ctypes.c_int64), ("num_k_rows", ctypes.c_int64),
        ("rel", ctypes.c_void_p), ("rel_item", ctypes.c_int64), ("rel_head", ctypes.c_int64),
        ("rel_numel", ctypes.c_int64), ("bounds", ctypes.c_void_p), ("num_bounds", ctypes.c_int64),
    ]


# pagedattn_paged_decode's refusals (it checks every index it would read before reading any)
_ERRORS = {
    1: "head size, head counts or part size outside the kernel's bounds",
    2: "a decode item names a query row or sequence outside the call",
    3: "a sequence needs more blocks than its block table row holds",
    4: "a block table entry is not a block of the cache",
    5: "out of memory for the kernel's per-thread state",
    7: "the bias does not cover an item's keys for every head",
}
# pagedattn_prefill's
_PREFILL_ERRORS = {1: "head size or head counts outside its bounds", 2: "an item's rows outside the tensors",
                   3: "the term by distance does not cover an item's queries and keys for every head",
                   4: "the rows' runs of keys do not cover an item's queries",
                   5: "out of memory for its per-thread state"}
# what each (item, head) row of a prefill's term by distance holds past its queries + keys - 1 distances: a tile's
# keys past an item's last one read it (csrc/pagedattn_abi.h's prefill_args)
REL_PAD = 16


def enabled() -> bool:
    """Whether the native kernel may be used (``PAGEDATTN_NATIVE=0`` turns it off)."""
    return os.environ.get("PAGEDATTN_NATIVE", "1") != "0"


def _cache_dir() -> Path:
    base = os.environ.get("PAGEDATTN_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedattn"


def _torch_runs_gnu_openmp() -> bool:
    """torch's threads are GNU OpenMP's, already loaded: the kernel's ``libgomp.so.1`` binds to that one."""
    if sys.platform != "linux" or "OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return "libgomp" in maps


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _cpu_features() -> str:
    """The CPU's feature flags (Linux): the object is built with ``-march=native``, so one built on another CPU (a
    shared home folder, a migrated VM) may not run here and is not reused."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _private(path: Path) -> bool:
    """Whether only this user can have written ``path`` (a file or folder): it is theirs and no one else may write
    it. A shared object found in the cache is loaded only then (loading it runs its code)."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _build(sources: dict[str, bytes], cc: str, defines: tuple[str, ...] = ()) -> Optional[Path]:
    """The C library's shared object (:func:`build_shared` with the kernels' flags)."""
    return build_shared(sources, cc, (*_FLAGS, *(f"-D{d}" for d in defines)), "paged_decode", libs=("-lm",))


def build_shared(sources: dict[str, bytes], compiler: str, flags: Sequence[str], stem: str, *, key: bytes = b"",
                 libs: Sequence[str] = (), unit_cache: bool = True) -> Optional[Path]:
    """The shared object of ``sources`` (file name: text) built by ``compiler`` with ``flags``: cached under
    ``stem-<hash>.so``, else compiled into the cache (one process at a time builds it, then moves it in atomically);
    None where it does not compile. The hash covers the sources, the compiler's version, the flags, the machine and
    ``key``. With ``unit_cache``, its units are compiled through an :class:`ObjectCache` in the same folder (another
    build of the same files with another macro compiles only the units the macro changes; off for units whose text
    would differ at every build, see :meth:`ObjectCache.key`). A cache folder others may write to is not used: the
    object is then built afresh in a private temporary folder, every unit compiled."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout.encode()
    host = [platform.machine().encode(), platform.node().encode(), _cpu_features().encode()]
    named = [b"%s\0%s" % (name.encode(), text) for name, text in sorted(sources.items())]
    digest = hashlib.sha256(b"\0".join([*named, version, " ".join(flags).encode(), " ".join(libs).encode(), *host,
                                        key])).hexdigest()[:24]
    target = _cache_dir() / f"{stem}-{digest}.so"
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    objects: Optional[ObjectCache] = None
    if not _private(target.parent):
        log.debug("pagedattn: %s is writable by others: %s is built in a private folder instead", target.parent,
                  target.name)
        target = _private_folder() / target.name
    elif unit_cache:
        objects = ObjectCache(target.parent / "objects", b"\0".join([version, *host, key]))
    if target.exists() and _private(target):
        return target
    # processes starting at once on a fresh machine (a server's workers, a test run's) build it once: the others
    # wait for the first's object instead of compiling the same sources beside it on the same cores
    with _build_lock(target):
        if target.exists() and _private(target):
            return target
        return _compile_into(sources, compiler, flags, stem, libs, target, objects)


def _private_folder() -> Path:
    """A new folder of this user's alone for one build, removed as the process exits: a loaded library needs its file
    no longer, and each process that cannot use the cache builds its own (otherwise every such process would leave
    its build in the temporary folder)."""
    folder = Path(tempfile.mkdtemp(prefix="pagedattn-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


class ObjectCache:
    """Compiled units kept beside the shared objects (``folder``), each under a key of what it was compiled from: its
    text after the preprocessor (the sources it includes, the macros its flags define) and the flags that shape its
    code, on ``machine`` (the compiler's version, the CPU, the library's own key). A library built again with another
    macro, or with one of its files changed, compiles only the units whose preprocessed text changed (comments
    included: the preprocessor drops them): a build of the kernels with
    ``PAGEDATTN_PREFILL_PAIRS`` compiles ``paged_prefill.c`` alone (~7 s), not the three units (~12 s of the decode
    unit, ~4 s of the linears'). An object is taken only from a folder and file this user alone can write (it is
    linked into a library that is then loaded), and put there whole (renamed in)."""

    def __init__(self, folder: Path, machine: bytes):
        self.folder, self.machine = folder, machine

    def key(self, compiler: str, flags: Sequence[str], unit: Path) -> Optional[str]:
        """The unit's key; None where the preprocessor fails on it (the compile then says why) or where its text names
        the temporary folder it is compiled in (``__FILE__`` in torch's headers: a key of its own at every build, which
        is why the C++ operators' build leaves the cache off: ~0.3-0.4 s of preprocessing a unit for nothing)."""
        pre = subprocess.run([compiler, *flags, "-E", "-P", str(unit)], capture_output=True, check=False)
        if pre.returncode or os.fsencode(unit.parent) in pre.stdout:
            return None
        shaping = [f for f in flags if not f.startswith(("-D", "-U"))]  # macros act through the preprocessed text
        return hashlib.sha256(b"\0".join([self.machine, " ".join(shaping).encode(), unit.suffix.encode(),
                                          pre.stdout])).hexdigest()[:24]

    def compile(self, compiler: str, flags: Sequence[str], unit: Path, out: Path) -> str:
        """``unit`` compiled into ``out``: the cached object where there is one, else compiled and kept; the
        compiler's complaint, or ""."""
        key = self.key(compiler, flags, unit)
        if key is None:
            return _compile_unit(compiler, flags, unit, out)
        self.folder.mkdir(exist_ok=True, mode=0o700)
        if not _private(self.folder):
            return _compile_unit(compiler, flags, unit, out)
        cached = self.folder / f"{unit.stem}-{key}.o"
        if cached.exists() and _private(cached):
            shutil.copyfile(cached, out)
            return ""
        done = _compile_unit(compiler, flags, unit, out)
        if not done:
            part = cached.with_name(f"{cached.name}.{os.getpid()}.part")
            shutil.copyfile(out, part)
            os.chmod(part, 0o600)  # this user's alone whatever the umask: else it would never be taken again
            os.replace(part, cached)
        return done


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """Held while ``target`` is built here: one process at a time; another's build held past ``_BUILD_WAIT_S``, or a
    folder that takes no locks (some network file systems), builds without it, as every process did before."""
    path = Path(f"{target}.lock")
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=_BUILD_WAIT_S)
    except Timeout:
        log.debug("pagedattn: %s is still being built elsewhere after %d s: building it here too", target.name,
                  _BUILD_WAIT_S)
        yield
        return
    except OSError as e:
        log.debug("pagedattn: no lock for building %s (%s): building it without one", target.name, e)
        yield
        return
    try:
        yield
    finally:
        # no lock file left behind: removed by whoever held it last, once the build is over (a process that takes a
        # lock file made again finds the object, or builds it as the first did)
        path.unlink(missing_ok=True)
        lock.release()


def _compile_into(sources: dict[str, bytes], compiler: str, flags: Sequence[str], stem: str, libs: Sequence[str],
                  target: Path, cache: Optional[ObjectCache] = None) -> Optional[Path]:
    """Compile (units found in ``cache`` taken from there) and link ``sources`` in a temporary folder beside
    ``target``, then move the object there."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        files = [Path(tmp) / name for name in sorted(sources)]
        for f in files:
            f.write_bytes(sources[f.name])
        obj = Path(tmp) / "out.so"
        units = [f for f in files if f.suffix != ".h"]  # headers are there to be included
        objects = [str(u.with_suffix(".o")) for u in units]
        done = _compile_units(compiler, flags, units, cache) or _run([compiler, *flags, *objects, "-o", str(obj),
                                                                      *libs])
        if done:
            log.debug("pagedattn: %s did not compile (%s): %s", stem, compiler, done[-2000:])
            return None
        # this user's alone whatever the umask (Ubuntu's 002 made it group-writable, and then never loaded again:
        # every process built the library afresh)
        os.chmod(obj, 0o700)
        os.replace(obj, target)
    return target


def _run(command: Sequence[str]) -> str:
    """The compiler's complaint, or "" where ``command`` succeeded."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    return (done.stderr or f"exit status {done.returncode}") if done.returncode else ""


def _compile_units(compiler: str, flags: Sequence[str], units: Sequence[Path],
                   cache: Optional[ObjectCache] = None) -> str:
    """Each unit into its object beside it (from ``cache`` where it has it), as many at once as there are cores (on
    2 cores a first start's two builds take ~21 s this way, ~38 s one unit after another); the first complaint, or
    ""."""
    compile_flags = [f for f in flags if f != "-shared"]  # the link's
    one = _compile_unit if cache is None else cache.compile
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(units), os.cpu_count() or 1))) as pool:
        return next((e for e in pool.map(lambda u: one(compiler, compile_flags, u, u.with_suffix(".o")), units)
                     if e), "")


def _compile_unit(compiler: str, flags: Sequence[str], unit: Path, out: Path) -> str:
    """``unit`` compiled into the object ``out``: the compiler's complaint, or ""."""
    return _run([compiler, *flags, "-c", str(unit), "-o", str(out)])


def missing_prerequisite() -> Optional[str]:
    """What this machine lacks for the kernel (a C compiler, torch on GNU OpenMP), or None: then :func:`load`
    returning None means the build itself failed."""
    if not _torch_runs_gnu_openmp():
        return "torch does not run GNU OpenMP here"
    if _compiler() is None:
        return "no C compiler (set CC)"
    return None


@functools.lru_cache(maxsize=1)
def load() -> Optional[ctypes.CDLL]:
    """The kernel's library, built on first use; None where it cannot run here (the reason goes to the debug
    log)."""
    return build_library()


def build_library(defines: tuple[str, ...] = (),
                  sources: Optional[dict[str, bytes]] = None) -> Optional[ctypes.CDLL]:
    """The kernel's library built with the C macros ``defines`` (``PAGEDATTN_NO_DPBF16``: bfloat16 scores by
    widening, as on CPUs without AVX512-BF16; ``PAGEDATTN_PREFILL_PAIRS``: prefill scores by pair dot products on any
    CPU that has them; both for tests) and cached like :func:`load`'s; None where it cannot run here. ``sources``:
    the C files by name (:data:`SOURCES`), for another version of the kernels (``benchmarks/kernel_ab.py``);
    None: this package's."""
    missing = missing_prerequisite()
    if missing:
        log.debug("pagedattn: native decode kernel off: %s", missing)
        return None
    if sources is None:
        csrc = resources.files("pagedattn.backends").joinpath("csrc")
        sources = {name: csrc.joinpath(name).read_bytes() for name in SOURCES}
    try:
        path = _build(sources, _compiler(), defines)
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.debug("pagedattn: native decode kernel off: %s", e)
        return None
    lib.pagedattn_paged_decode.argtypes = [ctypes.POINTER(_Args), ctypes.c_void_p]
    lib.pagedattn_paged_decode.restype = ctypes.c_int
    lib.pagedattn_write_kv.argtypes = [ctypes.POINTER(_WriteArgs)]
    lib.pagedattn_write_kv.restype = ctypes.c_int
    lib.pagedattn_prefill.argtypes = [ctypes.POINTER(_PrefillArgs)]
    lib.pagedattn_prefill.restype = ctypes.c_int
    lib.pagedattn_argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64,
                                          ctypes.c_int64, ctypes.c_void_p]
    lib.pagedattn_argmax_rows.restype = ctypes.c_int
    lib.pagedattn_features.argtypes = []
    lib.pagedattn_features.restype = ctypes.c_int
    lib.pagedattn_linear_features.argtypes = []
    lib.pagedattn_linear_features.restype = ctypes.c_int
    lib.pagedattn_linear.argtypes = [ctypes.POINTER(_LinearArgs)]
    lib.pagedattn_linear.restype = ctypes.c_int
    lib.pagedattn_silu_mul.argtypes = [ctypes.POINTER(_SiluMulArgs)]
    lib.pagedattn_silu_mul.restype = ctypes.c_int
    if hasattr(lib, "pagedattn_clock"):  # another commit's sources (benchmarks/kernel_ab.py) may predate the clock
        lib.pagedattn_clock.argtypes = [ctypes.c_int32]
        lib.pagedattn_clock.restype = None
        lib.pagedattn_clock_read.argtypes = [ctypes.c_void_p]
        lib.pagedattn_clock_read.restype = None
    return lib


# the kernel clock's kinds, in the order of pagedattn_abi.h's PAGEDATTN_CLOCK_* (each entry point of the library)
CLOCK_KINDS = ("linear", "decode", "prefill", "write", "silu_mul", "argmax")


@contextlib.contextmanager
def kernel_clock(lib: ctypes.CDLL) -> Iterator[dict[str, tuple[int, float]]]:
    """Counts the library's calls while the block runs: the dict it gives is filled on leaving it with each kind of
    :data:`CLOCK_KINDS` mapped to (calls, seconds of wall time on the calling threads, OpenMP workers' work inside
    them). For breakdowns of a step (``benchmarks/roofline.py``): no profiler between the calls, two clock reads a call
    of its own (below the noise of a 1.3 us call on a 2-vCPU EPYC). The counters are the library's (the C++
    operators call the same kernels); one clock at a time."""
    if not hasattr(lib, "pagedattn_clock"):
        raise ValueError("this build of the native library has no kernel clock: build this checkout's (native.load)")
    totals: dict[str, tuple[int, float]] = {}
    lib.pagedattn_clock(1)
    try:
        yield totals
    finally:
        lib.pagedattn_clock(0)
        counts = (ctypes.c_int64 * (2 * len(CLOCK_KINDS)))()
        lib.pagedattn_clock_read(counts)
        totals.update({k: (counts[2 * i], counts[2 * i + 1] / 1e9) for i, k in enumerate(CLOCK_KINDS)})


FEATURE_DPBF16 = 1  # bfloat16 decode scores by AVX512-BF16 pair dot products
FEATURE_LINEAR_F32 = 2  # small_linear.c's float32 kernel (AVX-512, or AVX2, FMA and F16C: small_linear_avx2.h)
FEATURE_LINEAR_BF16 = 4  # and its bfloat16 one (AVX512-BF16)
FEATURE_LINEAR_AMX = 8  # bfloat16 panels by AMX tiles, which the OS lets this process use (LINEAR_PANELS32)
FEATURE_PREFILL_DPBF16 = 16  # bfloat16 prefill scores by pair dot products: on CPUs where they pay (AMD's)


def features(lib: ctypes.CDLL) -> int:
    """What the library was built with: a sum of ``FEATURE_*`` flags."""
    return lib.pagedattn_features() | lib.pagedattn_linear_features() << 1


def library() -> Optional[ctypes.CDLL]:
    """The kernel's library where it may run now: built here (:func:`load`) and not turned off (:func:`enabled`)."""
    return load() if enabled() else None


class DecodeCall:
    """One step's decode items, ready to run at every layer of the step.

    ``items``: rows of (query row, sequence, first visible key, keys), an int64 ``[n, 4]`` tensor or a list of
    tuples: the query is the item's last key and sees keys ``[first, keys)``; each item's keys are cut into parts
    of ``part_keys`` keys, the threads' units of work (:func:`part_keys`).
    """

    def __init__(self, lib: ctypes.CDLL, items, part_keys: int, num_threads: int):
        # on the host: a step's few items cost less as a list than as tensor ops, and an array's buffer becomes a
        # tensor without a copy (the arrays stay with the call)
        if isinstance(items, Tensor):
            rows = items.tolist()
        else:
            rows, self._flat = items, array.array("q", [v for row in items for v in row])
            items = torch.frombuffer(self._flat, dtype=torch.int64).view(-1, 4) if self._flat else \
                torch.empty(0, 4, dtype=torch.int64)
        self.lib, self.items, self.part_keys, self.num_threads = lib, items, part_keys, num_threads
        self._starts, total, self._widest = array.array("q", [0]), 0, 0
        for _, _, first, keys in rows:
            total += -(-max(1, keys - first) // part_keys)
            self._starts.append(total)
            self._widest = max(self._widest, keys - first)
        self.parts_start = torch.frombuffer(self._starts, dtype=torch.int64)  # [n + 1]
        self.num_parts = total
        self._scratch: Optional[Tensor] = None
        # the arguments every layer of the step shares, set once; a call sets those of its own tensors
        self._args = _Args(items=items.data_ptr(), num_items=items.shape[0], part_keys=part_keys,
                           num_threads=num_threads)
        self._args_ref = ctypes.byref(self._args)
        self._parts_ptr = self.parts_start.data_ptr()

    def __call__(self, out: Tensor, query: Tensor, kv_cache: Tensor, block_tables: Tensor, scale: float,
                 softcap: float, alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                 bias: Optional[Tensor] = None) -> None:
        """Write the items' rows of ``out [T, Hq, D]`` from ``query [T, Hq, D]`` over ``kv_cache``
        ``[2, nb, bs, Hkv, D]``; ``block_tables`` int32 with contiguous rows, head dims contiguous everywhere
        (:func:`usable` says whether a call qualifies). ``bias [items, Hq or 1, W]`` float32, contiguous: added to
        item ``i``'s score of key ``first + j`` at ``bias[i, h, j]`` (``-inf``: the query does not see the key; one
        that sees none gets zeros)."""
        if block_tables.dtype != torch.int32 or (block_tables.shape[1] > 1 and block_tables.stride(1) != 1):
            raise ValueError("paged_attention: the native kernel reads int32 block tables with contiguous rows, "
                             f"got {block_tables.dtype} with strides {block_tables.stride()}")
        _, nb, bs, hkv, d = kv_cache.shape
        hq = query.shape[1]
        need = self.num_parts * hq * (d + 2)
        if self._scratch is None or self._scratch.numel() < need:  # the step's layers share it
            self._scratch = torch.empty(need, dtype=torch.float32)
        slopes = None if alibi_slopes is None else alibi_slopes.float().contiguous()
        sink = None if sinks is None else sinks.float().contiguous()
        cs = kv_cache.stride()
        k = kv_cache.data_ptr()  # K is kv_cache[0], V kv_cache[1]: addresses, not two select ops
        a = self._args
        a.query, a.q_row, a.q_head = query.data_ptr(), query.stride(0), query.stride(1)
        a.out, a.o_row, a.o_head = out.data_ptr(), out.stride(0), out.stride(1)
        a.k_cache, a.v_cache = k, k + cs[0] * kv_cache.element_size()
        a.c_block, a.c_token, a.c_head = cs[1], cs[2], cs[3]
        a.block_tables, a.table_width, a.num_seqs = block_tables.data_ptr(), block_tables.stride(0), \
            block_tables.shape[0]
        a.num_heads, a.num_kv_heads, a.head_size, a.block_size = hq, hkv, d, bs
        a.scale, a.softcap, a.dtype = scale, softcap, DTYPE_CODES[kv_cache.dtype]
        a.alibi_slopes = None if slopes is None else slopes.data_ptr()
        a.sinks = None if sink is None else sink.data_ptr()
        a.scratch, a.num_blocks, a.num_rows = self._scratch.data_ptr(), nb, min(query.shape[0], out.shape[0])
        if bias is None:
            a.bias, a.bias_item, a.bias_head, a.bias_numel = None, 0, 0, 0
        else:
            if bias.dtype != torch.float32 or not bias.is_contiguous() or bias.dim() != 3 or \
                    bias.shape[0] != self.items.shape[0] or bias.shape[1] not in (1, hq):
                raise ValueError(f"paged_attention: the native kernel reads a contiguous float32 bias [items, Hq or 1, "
                                 f"keys], got {bias.dtype} {tuple(bias.shape)} for {self.items.shape[0]} items")
            if bias.shape[2] < self._widest:
                raise ValueError(f"paged_attention: {_ERRORS[7]} (check the step's metadata)")
            a.bias, a.bias_item, a.bias_numel = bias.data_ptr(), bias.stride(0), bias.numel()
            a.bias_head = bias.stride(1) if bias.shape[1] > 1 else 0
        bad = self.lib.pagedattn_paged_decode(self._args_ref, self._parts_ptr)
        if bad:
            raise ValueError(f"paged_attention: {_ERRORS.get(bad, f'error {bad}')} (check the step's metadata)")


def usable(query: Tensor, kv_cache: Tensor, num_kv_heads: int) -> bool:
    """Whether a decode call's tensors suit the kernel as they are: CPU, a dtype it reads, head dims contiguous,
    sizes within its bounds, query and cache of one dtype (block tables: int32 rows, contiguous)."""
    return (kv_cache.device.type == "cpu" and kv_cache.dtype in DTYPE_CODES and query.dtype == kv_cache.dtype
            and kv_cache.dim() == 5 and kv_cache.stride(-1) == 1 and query.stride(-1) == 1
            and query.shape[-1] == kv_cache.shape[-1] <= MAX_HEAD_SIZE
            and query.shape[1] % num_kv_heads == 0 and query.shape[1] // num_kv_heads <= MAX_GROUP)


UNITS_PER_THREAD = 4  # csrc/paged_ops.cpp's part_keys takes the same


def part_keys(total_keys: int, num_threads: int, block_size: int) -> int:
    """Keys per unit of work (a part of one sequence's keys, every head): at least 64 (a unit's fixed cost), and
    small enough that the threads get about four units each of the step's keys (eight cut the streams shorter: a
    decode of 8 x 256 or 1 x 1024 keys from DRAM ~10 % slower, benchmarks/RESULTS.md)."""
    want = -(-total_keys // (UNITS_PER_THREAD * max(1, num_threads)))
    return max(64, -(-want // block_size) * block_size)


def write_usable(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> bool:
    """Whether :func:`write` takes these tensors as they are."""
    return (key.dtype == value.dtype == kv_cache.dtype and kv_cache.dtype in DTYPE_CODES
            and key.device.type == value.device.type == kv_cache.device.type == slot_mapping.device.type == "cpu"
            and kv_cache.dim() == 5 and kv_cache.stride(-1) == 1
            and key.stride(-1) == 1 and value.stride(-1) == 1 and slot_mapping.dim() == 1
            and slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.stride(0) == 1
            and key.shape[0] == value.shape[0] == slot_mapping.shape[0]
            and key.shape[1:] == value.shape[1:] == kv_cache.shape[3:])


def write(lib: ctypes.CDLL, key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
          checked: bool = False) -> bool:
    """Write ``key``/``value [T, Hkv, D]`` into ``kv_cache [2, nb, bs, Hkv, D]`` at ``slot_mapping`` (-1 skipped) in
    one call with no per-call tensor ops; False (nothing written) where the tensors do not suit it as they are
    (:func:`write_usable`): then the caller writes another way. ``checked``: the caller knows they suit it (tensors
    alike those it checked). Slots outside the cache are a ``ValueError``, with nothing written."""
    if not checked and not write_usable(key, value, kv_cache, slot_mapping):
        return False
    cs, ks, vs, shape = kv_cache.stride(), key.stride(), value.stride(), kv_cache.shape
    k, esz = kv_cache.data_ptr(), kv_cache.element_size()  # K is kv_cache[0], V kv_cache[1]
    a = _WriteArgs(key.data_ptr(), value.data_ptr(), ks[0], ks[1], vs[0], vs[1], k, k + cs[0] * esz, cs[1], cs[2],
                   cs[3], slot_mapping.data_ptr(), slot_mapping.dtype == torch.int64, key.shape[0], shape[1],
                   shape[3], shape[4], shape[2], esz)
    if lib.pagedattn_write_kv(ctypes.byref(a)):
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        check_slot_values(slot_mapping, num_slots)  # which slot is wrong, as the checks word it
        raise ValueError(f"write_kv_cache: a slot is outside the cache's {num_slots} slots (other than -1, padding); "
                         "fix slot_mapping")
    return True


PREFILL_MAX_HEAD_SIZE = 256  # csrc/paged_prefill.c: head sizes that are multiples of 16, up to this


def prefill_usable(query: Tensor, key: Tensor, value: Tensor, num_kv_heads: int) -> bool:
    """Whether a prefill call's tensors suit :func:`prefill` as they are: CPU, one dtype it reads, ``[rows, heads,
    D]`` with D contiguous, a multiple of 16 up to 256, the same for values, and whole groups of query heads."""
    d = query.shape[-1]
    return (query.device.type == "cpu" and query.dtype in DTYPE_CODES
            and query.dtype == key.dtype == value.dtype and query.dim() == key.dim() == value.dim() == 3
            and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
            and d % 16 == 0 and 0 < d <= PREFILL_MAX_HEAD_SIZE and key.shape[-1] == value.shape[-1] == d
            and key.shape[1] == value.shape[1] == num_kv_heads and query.shape[1] % num_kv_heads == 0)


def prefill(lib: ctypes.CDLL, out: Tensor, query: Tensor, key: Tensor, value: Tensor, items: Tensor, *,
            scale: float, causal: bool, window: int, num_threads: int, rel: Optional[Tensor] = None,
            bounds: Optional[Tensor] = None) -> None:
    """Attend ``query [Tq, Hq, D]`` rows over ``key``/``value [Tk, Hkv, D]`` rows into ``out [Tq, Hq, D]``, one
    item at a time: ``items [n, 6]`` int64 rows of (first query row, queries, position of the first query, first
    key row, keys, position of the first key). A causal query at position p sees its item's keys at positions
    ``[p - window + 1, p]`` (from the first without a window); a non-causal one all of them. Rows of ``out`` that
    no item covers are left as they are (:func:`prefill_usable` says whether tensors qualify).

    ``rel [n, Hq or 1, W]`` float32, contiguous: a term added to each score by distance, item ``i``'s query ``r``
    over its key ``j`` taking ``rel[i, h, j - r + queries - 1]`` (``-inf``: the query does not see the key; one that
    sees none gets zeros); ``W`` at least the items' ``queries + keys - 1 + REL_PAD``.

    ``bounds [Tq, 2]`` int64, contiguous: query row ``t`` sees its item's keys ``[bounds[t, 0], bounds[t, 1])``
    (indices into the item's keys) instead of what ``causal`` and ``window`` give; a row that sees none is left as
    it is."""
    if not prefill_usable(query, key, value, key.shape[1] if key.dim() == 3 else 0) or out.dtype != query.dtype \
            or out.dim() != 3 or out.shape[1:] != query.shape[1:] or out.stride(-1) != 1 or out.device != query.device:
        raise ValueError("paged_attention: the native prefill takes query/out [T, Hq, D] and key/value [T, Hkv, D] "
                         f"alike (D contiguous), got {tuple(query.shape)}, {tuple(out.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}; check prefill_usable first")
    items = items.to(torch.int64).contiguous()
    if items.dim() != 2 or items.shape[1] != 6:
        raise ValueError(f"paged_attention: the native prefill's items are [n, 6], got {tuple(items.shape)}")
    hkv, d = key.shape[1], key.shape[2]
    tiles = int(((items[:, 4] + 15) // 16).sum()) * hkv if len(items) else 0
    scratch = torch.empty(max(1, tiles * d * 16), dtype=torch.float32)
    a = _PrefillArgs(query.data_ptr(), query.stride(0), query.stride(1), key.data_ptr(), key.stride(0),
                     key.stride(1), value.data_ptr(), value.stride(0), value.stride(1), out.data_ptr(),
                     out.stride(0), out.stride(1), items.data_ptr(), items.shape[0], query.shape[1], hkv, d,
                     int(causal), min(int(window), _INT32_MAX), DTYPE_CODES[query.dtype], scale, scratch.data_ptr(),
                     num_threads,
                     min(query.shape[0], out.shape[0]), min(key.shape[0], value.shape[0]))
    if rel is not None:
        need = int((items[:, 1] + items[:, 4]).max()) - 1 + REL_PAD if len(items) else 0
        if rel.dtype != torch.float32 or not rel.is_contiguous() or rel.dim() != 3 or rel.device != query.device \
                or rel.shape[0] != items.shape[0] or rel.shape[1] not in (1, query.shape[1]) or rel.shape[2] < need:
            raise ValueError("paged_attention: the native prefill's term by distance is a contiguous float32 "
                             f"[items, Hq or 1, queries + keys - 1 + {REL_PAD}], got {rel.dtype} "
                             f"{tuple(rel.shape)} for {items.shape[0]} items needing {need}")
        a.rel, a.rel_item, a.rel_numel = rel.data_ptr(), rel.stride(0), rel.numel()
        a.rel_head = rel.stride(1) if rel.shape[1] > 1 else 0
    if bounds is not None:
        if bounds.dtype != torch.int64 or not bounds.is_contiguous() or bounds.dim() != 2 or bounds.shape[1] != 2 \
                or bounds.device != query.device:
            raise ValueError("paged_attention: the native prefill's runs of keys are a contiguous int64 [rows, 2], got "
                             f"{bounds.dtype} {tuple(bounds.shape)}")
        a.bounds, a.num_bounds = bounds.data_ptr(), bounds.shape[0]
    bad = lib.pagedattn_prefill(ctypes.byref(a))
    if bad:
        raise ValueError(f"paged_attention: the native prefill refused the call ({_PREFILL_ERRORS.get(bad, bad)})")


def argmax_rows(lib: ctypes.CDLL, logits: Tensor, out: Optional[Tensor] = None) -> Optional[list[int]]:
    """Each row's argmax of ``logits [R, V]``, as ``torch.argmax`` gives it (the first maximum; a row's first NaN
    where it holds one), read in the logits' own dtype; None where the tensor does not suit the kernel as it is (not
    a CPU matrix of a dtype it reads with contiguous rows): then the caller takes torch's. The answer is written into
    an array's buffer, not a tensor's (a decode step's call costs ~2x its kernel in Python around it, and each piece
    of that is slow after a step's kernels have left the interpreter's data out of cache), or into ``out``, a
    contiguous int64 CPU tensor of ``R`` elements, where one is given (a decode step's input ids for the next)."""
    code = DTYPE_CODES.get(logits.dtype)
    if code is None or not logits.is_cpu or logits.dim() != 2:
        return None
    rows, cols = logits.shape
    if cols <= 0 or (logits.stride(1) != 1 and cols != 1):
        return None
    if out is not None and (out.dtype != torch.int64 or not out.is_cpu or out.numel() != rows or
                            not out.is_contiguous()):
        return None
    buf = out if out is not None else array.array("q", bytes(8 * rows))
    address = out.data_ptr() if out is not None else buf.buffer_info()[0]
    if lib.pagedattn_argmax_rows(logits.data_ptr(), code, rows, cols, logits.stride(0), address):
        return None
    return buf.tolist()


class ArgmaxWriter:
    """:func:`argmax_rows` of a run of steps' logits into the rows of one buffer, ``write(logits, i)`` writing row
    ``i`` of ``out`` (a contiguous int64 CPU tensor ``[K, R]``: a run of decode steps' input ids) and returning the
    tokens. The checks that :func:`argmax_rows` makes at every call are made for the first logits, and later logits
    of the same dtype, sizes and strides (a compiled step's, call after call) go straight to the kernel; others take
    the checks again, and logits the kernel does not read go to ``fallback(logits, i)``."""

    __slots__ = ("lib", "fallback", "rows", "_addresses", "_layout", "_args")

    def __init__(self, lib: ctypes.CDLL, out: Tensor, fallback: Callable[[Tensor, int], list[int]]):
        if not self.takes(out):
            raise ValueError(f"ArgmaxWriter writes into a contiguous int64 CPU matrix, got {out.dtype} "
                             f"{tuple(out.shape)} on {out.device}")
        self.lib, self.fallback = lib, fallback
        self.rows = out.unbind(0)
        self._addresses = [r.data_ptr() for r in self.rows]
        self._layout: Optional[tuple] = None  # the logits the kernel was bound for: dtype, sizes, strides
        self._args: tuple = ()  # and its arguments before the output's address

    @staticmethod
    def takes(out: Tensor) -> bool:
        """Whether ``out`` is a buffer the writer writes into."""
        return out.dtype == torch.int64 and out.is_cpu and out.dim() == 2 and out.is_contiguous()

    def __call__(self, logits: Tensor, i: int) -> list[int]:
        if logits.is_cpu and (logits.dtype, logits.shape, logits.stride()) == self._layout and \
                not self.lib.pagedattn_argmax_rows(logits.data_ptr(), *self._args, self._addresses[i]):
            return self.rows[i].tolist()
        found = argmax_rows(self.lib, logits, self.rows[i])
        if found is None:
            return self.fallback(logits, i)
        rows, cols = logits.shape  # argmax_rows took them: a CPU matrix of a dtype the kernel reads
        self._layout = (logits.dtype, logits.shape, logits.stride())
        self._args = (DTYPE_CODES[logits.dtype], rows, cols, logits.stride(0))
        return found


_LINEAR_DTYPES = {torch.float32: (0, FEATURE_LINEAR_F32), torch.bfloat16: (1, FEATURE_LINEAR_BF16)}  # code, feature


@functools.lru_cache(maxsize=8)
def linear_dtypes(lib: ctypes.CDLL) -> dict:
    """The dtypes ``lib`` has a linear kernel for on this machine, with their codes."""
    return {dtype: code for dtype, (code, feature) in _LINEAR_DTYPES.items() if features(lib) & feature}


def _onednn_op(name: str):
    """A ``torch.ops.mkldnn`` overload (itself: a packet's call resolves one each time), None in a build without."""
    try:
        return getattr(torch.ops.mkldnn, name).default
    except (AttributeError, RuntimeError):
        return None


# a oneDNN tensor's buffer
_onednn_nbytes = _onednn_op("_nbytes")
_onednn_data_ptr = _onednn_op("data_ptr")

LINEAR_PLAIN = 0  # pagedattn_linear's weight layouts: [N, K], rows contiguous
LINEAR_PANELS = 1  # oneDNN's packed weights in panels of 64 columns (csrc/small_linear.c, linear_panels)
LINEAR_PANELS32 = 2  # bfloat16 in panels of 32 columns, oneDNN's packing for AMX (small_linear.c, linear_amx)
PANEL_COLUMNS = {LINEAR_PANELS: 64, LINEAR_PANELS32: 32}


def linear_layouts(lib: ctypes.CDLL, dtype: torch.dtype) -> frozenset:
    """The weight layouts ``lib``'s linear kernel takes for ``dtype`` on this machine (none where it has no kernel
    for it)."""
    if dtype not in linear_dtypes(lib):
        return frozenset()
    amx = dtype == torch.bfloat16 and features(lib) & FEATURE_LINEAR_AMX
    return frozenset((LINEAR_PLAIN, LINEAR_PANELS, LINEAR_PANELS32) if amx else (LINEAR_PLAIN, LINEAR_PANELS))


def _panel_step(dtype: torch.dtype) -> tuple[int, int]:
    """(k per step of a panel, k per 4-byte slot): bfloat16 in pairs of k, a step of 64 columns is 4 KiB."""
    return (32, 2) if dtype == torch.bfloat16 else (16, 1)


def linear_panel_bytes(weight: Tensor, columns: int = 64) -> int:
    """Bytes of ``weight [N, K]`` laid out in panels of ``columns`` (:data:`PANEL_COLUMNS`; N and K padded with
    zeros)."""
    n, k = weight.shape
    step, _ = _panel_step(weight.dtype)
    return -(-n // columns) * -(-k // step) * columns * step * weight.element_size()


def to_panels(weight: Tensor, columns: int = 64) -> Tensor:
    """``weight [N, K]`` (float32 or bfloat16) in panels of ``columns`` (:data:`PANEL_COLUMNS`), flat: the bytes the
    kernel reads."""
    n, k = weight.shape
    step, inner = _panel_step(weight.dtype)
    np_, kp = -(-n // columns) * columns, -(-k // step) * step
    padded = weight.new_zeros((np_, kp))
    padded[:n, :k] = weight
    # [panel, columns, step, slices, inner] -> [panel, step, slices, columns, inner]
    return padded.reshape(np_ // columns, columns, kp // step, step // inner, inner).permute(0, 2, 3, 1, 4).reshape(-1)


def linear(lib: ctypes.CDLL, x: Tensor, weight: Tensor, bias: Optional[Tensor], num_threads: int,
           layout: int = LINEAR_PLAIN) -> Optional[Tensor]:
    """``x [..., K] @ weight [N, K].T + bias [N]`` by ``csrc/small_linear.c``, made for few rows of ``x`` (it reads
    the weights once per call), or None (nothing computed) where the tensors do not suit it: then the caller computes
    it another way. It takes CPU tensors of one dtype the library has a kernel for, ``bias`` contiguous or None, and a
    ``weight`` that is contiguous (:data:`LINEAR_PLAIN`) or a oneDNN tensor whose buffer has the size of ``layout``
    (one of :func:`linear_layouts`: that it holds that layout is the caller's to prove, as
    ``cpu_linear.proven_layout`` does)."""
    code = linear_dtypes(lib).get(x.dtype)
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    if code is None or weight.dtype != x.dtype or k == 0 or x.dim() == 0 or x.shape[-1] != k or not x.is_cpu \
            or x.is_mkldnn \
            or (bias is not None and not (bias.dtype == x.dtype and bias.is_cpu and not bias.is_mkldnn
                                          and bias.shape == (n,) and bias.is_contiguous())):
        return None
    if weight.is_mkldnn:
        if _onednn_nbytes is None or _onednn_data_ptr is None:
            return None
        w, size = _onednn_data_ptr(weight), _onednn_nbytes(weight)
    elif layout == LINEAR_PLAIN and weight.is_cpu and weight.is_contiguous():
        w, size = weight.data_ptr(), n * k * weight.element_size()
    else:
        return None
    rows = x if x.dim() == 2 else x.reshape(-1, k)  # [M, K]
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = x.new_empty((m, n))
    if lib.pagedattn_linear(ctypes.byref(_LinearArgs(
            rows.data_ptr(), rows.stride(0), w, None if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n, k,
            code, num_threads, layout, size))):
        return None  # a layout it does not know, or a buffer of another size: nothing written
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def silu_mul(lib: ctypes.CDLL, gate: Tensor, up: Tensor, num_threads: int) -> Optional[Tensor]:
    """``SiLU(gate) * up`` in float32, rounded once to their dtype, by ``lib``'s kernel (``small_linear.c``'s
    ``pagedattn_silu_mul``, which the C++ operator ``pagedattn_native::silu_mul`` calls in a step), or None (nothing
    computed) where the tensors do not suit it: CPU tensors of one shape and of a dtype the library has a linear
    kernel for, rows of contiguous elements. For tests and benchmarks of one build of the library."""
    code = linear_dtypes(lib).get(gate.dtype)
    if code is None or up.dtype != gate.dtype or up.shape != gate.shape or gate.dim() == 0 or not gate.is_cpu \
            or not up.is_cpu:
        return None
    if not gate.numel():
        return torch.empty_like(gate)
    cols = gate.shape[-1]
    g, u = (t.reshape(-1, cols) if t.dim() != 2 else t for t in (gate, up))  # [rows, cols]
    g, u = (t if t.stride(-1) == 1 or cols <= 1 else t.contiguous() for t in (g, u))
    out = torch.empty_like(g, memory_format=torch.contiguous_format)
    if lib.pagedattn_silu_mul(ctypes.byref(_SiluMulArgs(
            g.data_ptr(), u.data_ptr(), out.data_ptr(), g.stride(0), u.stride(0), out.stride(0), g.shape[0], cols, code,
            num_threads))):
        return None
    return out.view(gate.shape)


def onednn_bytes(weight: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """A copy of the bytes of a oneDNN (``is_mkldnn``) tensor's buffer, as uint8: what its packed layout holds;
    copied into ``out`` (uint8, as many bytes) where given, and that returned."""
    if _onednn_nbytes is None or _onednn_data_ptr is None:
        raise RuntimeError("this torch has no oneDNN tensors")
    n = _onednn_nbytes(weight)
    if out is not None and (out.dtype != torch.uint8 or out.numel() != n):
        raise ValueError(f"onednn_bytes: out must be {n} uint8 bytes, got {out.numel()} {out.dtype}")
    if not n:
        return torch.empty(0, dtype=torch.uint8) if out is None else out
    view = torch.frombuffer((ctypes.c_uint8 * n).from_address(_onednn_data_ptr(weight)), dtype=torch.uint8, count=n)
    return view.clone() if out is None else out.copy_(view)
