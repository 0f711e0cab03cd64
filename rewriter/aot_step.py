"""A paged step compiled ahead of time: AOTInductor's C++ runner over the exported paged program, its package
cached on disk.

A step compiled with ``torch.compile`` runs its kernels from Python: Dynamo's guards, AOTAutograd's wrappers, then
Inductor's generated Python calling each kernel (on the CPU a third of a small model's fp32 decode step,
``benchmarks/generate_cpu.py --breakdown``). AOTInductor compiles the same program, with the same Inductor options
and passes (``program.paged_step_options``) and freezing, into a shared library whose runner calls the kernels from
C++ (``benchmarks/aoti_step.py``: decode steps 0.70-0.93x the compiled step's time). Its package is kept in
Inductor's cache directory under a key of everything it is built from (:func:`package_key`), so a later start loads
it instead of tracing, exporting and compiling again.

What the runner computes is the program's for every input it takes:

- the program is exported without specialising sizes 0 and 1 (``export_paged(size_oblivious=True)``), so each of
  its dynamic sizes ranges from 0 and a step of one sequence, one block or one row runs the same code; where a
  size of 1 would change the computation (broadcasting), the program asserts at run time instead of assuming;
- the runner checks nothing about its inputs (AOTInductor's own checks are off unless an environment variable is
  set before the process first runs one), so :class:`InputGuard` checks every call: the inputs' count, dtypes,
  ranks, contiguity, each static size, each dynamic size against its range, sizes the program shares between
  inputs equal, and non-tensor inputs equal to the values the program was built for. A call it refuses runs the
  step compiled with ``torch.compile`` instead (built on first need), so the step serves every input the compiled
  step would.

A CPU package's model runs in AOTInductor's container runner with its constants copied to 64-byte-aligned memory
(:func:`load_cpu_package`): AOTInductor's package loader leaves each of them 16 bytes into a cache line.

Loading a package runs its code (a shared library), as Inductor loads the kernels it caches: the packages live in
Inductor's cache directory and are as trusted as it is.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import logging
import operator
import os
import platform
import shutil
import tempfile
import zipfile
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.fx import GraphModule

from pagedattn.backends import huge_pages
from pagedattn.report import first_line

log = logging.getLogger("pagedattn")

__all__ = ["AotStep", "InputGuard", "package_key", "package_dir", "load_or_build", "CpuPackage", "load_cpu_package",
           "AotUnsupported", "program_inputs", "hinted_inputs", "copies_on_huge_pages", "COPY_ALIGNMENT"]

# the package format's version: bump when what a package holds, or how it is keyed, changes
SCHEMA = "pagedattn-aot-step/1"
GUARD_METADATA = "pagedattn_input_guard"


class AotUnsupported(Exception):
    """The step cannot be compiled ahead of time (the message says why); it is compiled with ``torch.compile``."""


@dataclasses.dataclass(frozen=True)
class InputGuard:
    """What a step's inputs must be for the package's program to compute what the graph does.

    ``tensors``: per tensor input, ``(position, dtype, sizes)`` where a size is an ``int`` (static) or a
    ``str`` (a dynamic size's symbol; inputs naming the same symbol must agree). ``ranges``: each symbol's
    ``(lower, upper)`` bounds (``upper`` None: unbounded). ``constants``: per non-tensor input, its position and
    the value the program was built for. ``count``: the number of inputs.
    """

    count: int
    tensors: tuple[tuple[int, torch.dtype, tuple[int | str, ...]], ...]
    ranges: tuple[tuple[str, int, Optional[int]], ...]
    constants: tuple[tuple[int, Any], ...] = ()

    @classmethod
    def of(cls, program: torch.export.ExportedProgram) -> "InputGuard":
        """The guard of an exported program's user inputs (raises :class:`AotUnsupported` for an input whose size is
        an expression of symbols, or a non-tensor input whose value JSON cannot hold)."""
        values = program_inputs(program)
        tensors, constants, symbols = [], [], set()
        for i, val in enumerate(values):
            name = f"input {i}"
            if isinstance(val, torch.Tensor):
                sizes = []
                for d in val.shape:
                    if isinstance(d, int):
                        sizes.append(d)
                    elif isinstance(d, torch.SymInt) and d.node.expr.is_symbol:
                        sizes.append(str(d.node.expr))
                        symbols.add(d.node.expr)
                    else:
                        raise AotUnsupported(f"{name} has a size {d} that is not one symbol")
                tensors.append((i, val.dtype, tuple(sizes)))
            elif val is None or isinstance(val, (bool, int, float, str)):
                constants.append((i, val))
            else:
                raise AotUnsupported(f"{name} is a {type(val).__name__}, which the package cannot record")
        ranges = []
        for sym in sorted(symbols, key=str):
            vr = program.range_constraints.get(sym)
            lower = _finite(vr.lower) if vr is not None else None
            upper = _finite(vr.upper) if vr is not None else None
            lower = 0 if lower is None else max(lower, 0)
            ranges.append((str(sym), lower, upper))
        return cls(len(values), tuple(tensors), tuple(ranges), tuple(constants))

    def to_json(self) -> str:
        return json.dumps({"count": self.count, "ranges": self.ranges, "constants": self.constants,
                           "tensors": [(i, str(dtype).removeprefix("torch."), sizes) for i, dtype, sizes in self.tensors]})

    @classmethod
    def from_json(cls, text: str) -> "InputGuard":
        d = json.loads(text)
        dtypes = {}
        for _, name, _ in d["tensors"]:
            dtype = getattr(torch, name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {name!r}")
            dtypes[name] = dtype
        return cls(int(d["count"]), tuple((int(i), dtypes[name], tuple(sizes)) for i, name, sizes in d["tensors"]),
                   tuple((s, int(lo), None if hi is None else int(hi)) for s, lo, hi in d["ranges"]),
                   tuple((int(i), v) for i, v in d["constants"]))

    @functools.cached_property
    def _plan(self) -> tuple:
        """What :meth:`refusal` checks: per tensor input ``(position, dtype, number of dimensions, static sizes as
        (dimension, size), compared symbols as (dimension, k))``; the compared symbols' bounds ``(k, symbol, lower,
        upper)`` where their range has some; the number of compared symbols. A symbol is compared where another size
        names it too or its range bounds it: a size is never negative, so a symbol named once with the range
        ``[0, inf)`` holds whatever size comes."""
        uses = collections.Counter(s for _, _, sizes in self.tensors for s in sizes if isinstance(s, str))
        ranges = {s: (lower, upper) for s, lower, upper in self.ranges}

        def bounded(sym: str) -> bool:
            lower, upper = ranges.get(sym, (0, None))
            return lower > 0 or upper is not None

        compared = sorted(s for s in uses if uses[s] > 1 or bounded(s))
        index = {s: k for k, s in enumerate(compared)}
        checks = tuple((i, dtype, len(sizes), tuple((d, s) for d, s in enumerate(sizes) if isinstance(s, int)),
                        tuple((d, index[s]) for d, s in enumerate(sizes) if isinstance(s, str) and s in index))
                       for i, dtype, sizes in self.tensors)
        bounds = tuple((index[s], s, *ranges[s]) for s in compared if bounded(s))
        return checks, bounds, len(compared)

    def refusal(self, flat) -> Optional[str]:
        """Why the program cannot take these inputs, or None where it can. Runs before every step: each check is
        one the program needs, and sizes nothing constrains are not looked at."""
        if len(flat) != self.count:
            return f"{len(flat)} inputs, the program takes {self.count}"
        checks, bounds, num_compared = self._plan
        seen: list = [None] * num_compared
        for i, dtype, ndim, static, symbols in checks:
            t = flat[i]
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != ndim or not t.is_cpu or \
                    not t.is_contiguous():
                return f"input {i} is not a contiguous CPU tensor of {dtype} with {ndim} dimensions"
            shape = t.shape
            for d, s in static:
                if shape[d] != s:
                    return f"input {i} has sizes {tuple(shape)}, the program fixed one to {s}"
            for d, k in symbols:
                if seen[k] is None:
                    seen[k] = shape[d]
                elif seen[k] != shape[d]:
                    return f"input {i}'s size {shape[d]} differs from another input's that the program takes as equal"
        for k, sym, lower, upper in bounds:
            d = seen[k]
            if d is not None and (d < lower or (upper is not None and d > upper)):
                return f"size {d} outside the program's range [{lower}, {upper}] for {sym}"
        for i, value in self.constants:
            if type(flat[i]) is not type(value) or flat[i] != value:
                return f"input {i} is {flat[i]!r}, the program was built for {value!r}"
        return None


def program_inputs(program: torch.export.ExportedProgram) -> list:
    """An exported program's user inputs in order: each tensor input's fake value (its symbolic sizes), each non-tensor
    input's value (raises :class:`AotUnsupported` for an input of another kind, e.g. a symbolic integer)."""
    from torch.export.graph_signature import ConstantArgument, InputKind, TensorArgument

    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    out = []
    for i, spec in enumerate(s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT):
        if isinstance(spec.arg, ConstantArgument):
            out.append(spec.arg.value)
        elif isinstance(spec.arg, TensorArgument):
            out.append(nodes[spec.arg.name].meta.get("val"))
        else:
            raise AotUnsupported(f"input {i} is a {type(spec.arg).__name__}, which the package cannot record")
    return out


def hinted_inputs(program: torch.export.ExportedProgram) -> tuple:
    """Inputs for AOTInductor to compile ``program`` with where it has none (a program loaded from disk: saving drops
    them): zeros of each tensor input's sizes at their hints (the sizes it was exported at), and the non-tensor inputs'
    values. AOTInductor reads their sizes and dtypes; it does not run the program on them."""
    out = []
    for i, val in enumerate(program_inputs(program)):
        if not isinstance(val, torch.Tensor):
            out.append(val)
            continue
        sizes = [d.node.hint if isinstance(d, torch.SymInt) else d for d in val.shape]
        if any(not isinstance(d, int) for d in sizes):
            raise AotUnsupported(f"input {i}'s sizes have no hints to compile with")
        out.append(torch.zeros(sizes, dtype=val.dtype))
    return tuple(out)


def _finite(bound) -> Optional[int]:
    """A range's bound as an int, or None where it is infinite."""
    try:
        return int(bound)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


class AotStep(nn.Module):
    """A paged step run by AOTInductor's runner, its inputs checked by an :class:`InputGuard`; inputs it refuses run
    ``fallback()`` (called once, on first need: the step compiled with ``torch.compile``). Holds the graph it was
    compiled from as ``_orig_mod``, as a ``torch.compile``'d module does."""

    def __init__(self, runner, guard: InputGuard, graph_module: nn.Module, fallback: Callable[[], Callable],
                 source: str):
        super().__init__()
        self._orig_mod = graph_module
        self.runner, self.guard, self.source = runner, guard, source  # source: "built" or "loaded"
        self._make_fallback, self._fallback = fallback, None

    def __getattr__(self, name: str):
        # what the module does not hold is the compiled graph's, as with a torch.compile'd module (its graph, code)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("_orig_mod"), name)

    def forward(self, *flat) -> list:
        return self.run(flat)

    def run(self, flat: Sequence) -> list:
        """``forward`` on a sequence of the inputs, without a module call's hooks around it (a serving loop's
        :class:`~pagedattn.program.PagedCall` calls this)."""
        why = self.guard.refusal(flat)
        if why is None:
            # the loader's own call: AOTICompiledModel.__call__ parses its input and output specs on every call
            return self.runner.loader.boxed_run([x for x in flat if isinstance(x, torch.Tensor)])
        if self._fallback is None:
            log.info("the ahead-of-time step cannot take these inputs (%s): they run the step compiled with "
                     "torch.compile", why)
            self._fallback = self._make_fallback()
        return self._fallback(*flat)

    def prepared(self, flat: Sequence) -> Optional[Callable[[], list]]:
        """``run(flat)`` as a call of no arguments, the inputs checked now rather than at each call: for a loop
        that runs the same inputs' tensors again with other values (their sizes, dtypes and layouts, which the
        guard checks, kept). None where the guard refuses them (``run`` then takes them to the fallback)."""
        if self.guard.refusal(flat) is not None:
            return None
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        # a list of its own each call: AOTInductor's package loader empties the one it is given
        return lambda: self.runner.loader.boxed_run(list(tensors))


# ---------------------------------------------------------------------- the package


def package_dir() -> str:
    """Where packages are kept: ``pagedattn_steps`` in Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "pagedattn_steps")


@functools.cache  # a fact about the code installed for this process
def _code_digest() -> str:
    """A digest of pagedattn's own sources (Python and the native library's C): a package built by other code is
    not loaded."""
    import pagedattn
    import pagedattn.backends
    import pagedattn.passes

    h = hashlib.sha256()
    roots = sorted({os.path.dirname(m.__file__) for m in (pagedattn, pagedattn.backends, pagedattn.passes)})
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith((".py", ".c", ".cpp", ".h")):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, root).encode() + b"\0")
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


def _host() -> str:
    """The machine a package's code is built for: its architecture and the vector ISA Inductor picks."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = str(pick_vec_isa())
    except Exception:  # pragma: no cover - torch without Inductor's ISA detection
        isa = "unknown"
    return f"{platform.machine()}/{isa}"


def _tensor_digest(h, name: str, t: torch.Tensor) -> None:
    h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:{t.device.type}\0".encode())
    if t.device.type != "meta":
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _option_text(value) -> str:
    uuid = getattr(value, "uuid", None)
    return f"{type(value).__qualname__}({uuid()})" if callable(uuid) else repr(value)


def package_key(gm: nn.Module, options: dict, inputs: list, program: str = "") -> str:
    """The key of the package built from ``gm`` with Inductor ``options`` over export ``inputs``: the graph's code
    and every tensor it reads (parameters, buffers, constants: their bytes, since freezing makes them part of the
    package), the options (a pass by its ``uuid()``), the inputs' dtypes, sizes and non-tensor values, how the program
    is had (``program``: exported here, or as saved), the versions of torch and of pagedattn's sources, and the host's
    architecture and vector ISA."""
    h = hashlib.sha256()
    for part in (SCHEMA, torch.__version__, _code_digest(), _host(), program):
        h.update(part.encode() + b"\0")
    for name, module in sorted(gm.named_modules(), key=lambda x: x[0]):
        code = module.code if isinstance(module, GraphModule) else repr(module)
        h.update(f"module {name} {type(module).__qualname__}\0{code}\0".encode())
    tensors: dict[str, torch.Tensor] = dict(gm.named_parameters(remove_duplicate=False))
    tensors.update(gm.named_buffers(remove_duplicate=False))
    for prefix, module in gm.named_modules():
        if not isinstance(module, GraphModule):
            continue
        for node in module.graph.nodes:
            name = f"{prefix}.{node.target}" if prefix else node.target
            if node.op == "get_attr" and name not in tensors:
                value = operator.attrgetter(node.target)(module)
                if isinstance(value, torch.Tensor):
                    tensors[name] = value
    for name in sorted(tensors):
        _tensor_digest(h, name, tensors[name])
    for name in sorted(options):
        h.update(f"option {name}={_option_text(options[name])}\0".encode())
    for x in inputs:  # sizes too: a size the program fixes makes a package whose guard refuses other sizes
        desc = f"tensor {x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"value {x!r}"
        h.update(desc.encode() + b"\0")
    return h.hexdigest()[:40]


def load_or_build(key: str, build: Callable[[str], None], directory: Optional[str] = None) -> tuple[Any, InputGuard, str]:
    """The runner and input guard of the package ``key``: loaded from ``directory`` (default :func:`package_dir`), or
    built there first by ``build(path)`` (which writes a package whose metadata holds the guard). Returns
    ``(runner, guard, "loaded" | "built")``. A package that does not load is built again."""
    directory = directory or package_dir()
    path = os.path.join(directory, f"{key}.pt2")
    if os.path.exists(path):
        try:
            runner, guard = _load(path)
            return runner, guard, "loaded"
        except Exception as e:  # a truncated or foreign file: built again below
            log.info("the cached step package %s did not load (%s: %s): building it again", path, type(e).__name__, first_line(e))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{key}.{os.getpid()}.tmp.pt2")
    try:
        build(tmp)
        os.replace(tmp, path)  # atomic: another process sees the whole package or none
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    runner, guard = _load(path)
    return runner, guard, "built"


def _load(path: str) -> tuple[Any, InputGuard]:
    try:
        runner = load_cpu_package(path)
    except Exception as e:  # the package loader's turn: it loads what it can, or says why not
        log.debug("the package %s did not load through the container runner (%s: %s)", path, type(e).__name__,
                  first_line(e))
        runner = None
    runner = runner or torch._inductor.aoti_load_package(path)
    text = runner.get_metadata().get(GUARD_METADATA)
    if text is None:
        raise ValueError("the package has no input guard")
    return runner, InputGuard.from_json(text)


# ---------------------------------------------------------------------- constants aligned for vector loads

# AOTInductor's loader copies a CPU package's constants into one malloc'd blob at offsets of 64 bytes, but glibc puts
# a blob that large 16 bytes past a page boundary: every frozen weight starts 16 bytes into a cache line, and each
# 64-byte vector load of it spans two lines (benchmarks/RESULTS.md: llama16m's float32 decode steps ~0.93x once
# aligned)
_MODEL_DIR = "data/aotinductor/model/"


class CpuPackage:
    """A CPU package's model run by AOTInductor's container runner, its constants in 64-byte-aligned memory (see
    :func:`load_cpu_package`); it answers what :class:`AotStep` asks of
    AOTInductor's package loader (``loader.boxed_run``, ``get_metadata``)."""

    def __init__(self, runner, metadata: dict[str, str], constants: dict[str, torch.Tensor],
                 buffer: Optional[torch.Tensor] = None):
        self._runner, self._metadata = runner, dict(metadata)
        self._constants = constants  # the runner reads these tensors in place
        self._buffer = buffer  # the memory they lie in, where they share one (copies_on_huge_pages)
        self.loader = self

    def boxed_run(self, tensors: list) -> list:
        return self._runner.run(tensors)

    def get_metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def constants(self) -> dict[str, torch.Tensor]:
        """The tensors the runner reads, by the model's constant names."""
        return dict(self._constants)


def load_cpu_package(path: str) -> Optional[CpuPackage]:
    """The model of the CPU package at ``path`` (one shared library holding its constants) run by AOTInductor's
    container runner, its constants copied one after another into one buffer on huge pages, each 64-byte aligned
    (:func:`copies_on_huge_pages`; where that cannot be, each into memory of its own, as torch allocates it), and the
    runner's blob freed; None where the package is of another kind or this torch has no such runner (the caller then
    loads it with AOTInductor's package loader). The copies are the package's constants byte for byte.

    AOTInductor keeps a reference of its own to constants it is handed (``user_managed``) and never drops it, so the
    copies stay in memory until the process ends: a process loads each package once, and every step that uses it
    shares that one (the file's path, modification time and size name it)."""
    status = os.stat(path)
    return _load_cpu_package(os.path.realpath(path), status.st_mtime_ns, status.st_size)


@functools.lru_cache(maxsize=None)  # see load_cpu_package: a second load would hold the constants twice, for good
def _load_cpu_package(path: str, mtime_ns: int, size: int) -> Optional[CpuPackage]:
    make = getattr(torch._C._aoti, "AOTIModelContainerRunnerCpu", None)
    if make is None:
        return None
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        members = {n.split(_MODEL_DIR, 1)[1]: n for n in names if _MODEL_DIR in n}
        libs = [name for name in members if name.endswith(".so") and "/" not in name]
        if len(libs) != 1 or any("data/weights/" in n or "data/constants/" in n for n in names):
            return None  # weights beside the library, or several models: the package loader's to load
        stem = libs[0][:-len(".so")]
        if f"{stem}_metadata.json" not in members:
            return None
        metadata = json.loads(z.read(members[f"{stem}_metadata.json"]))
        with tempfile.TemporaryDirectory() as d:
            for name in (f"{stem}.so", f"{stem}.json"):  # the library, and how it calls operators outside it
                if name in members:
                    with z.open(members[name]) as src, open(os.path.join(d, name), "wb") as dst:
                        shutil.copyfileobj(src, dst)
            runner = make(os.path.join(d, f"{stem}.so"), 1)  # loaded: the files may go
    names_of = {fqn: name for name, fqn in runner.get_constant_names_to_original_fqns().items()}
    extracted = {names_of.get(fqn, fqn): t for fqn, t in runner.extract_constants_map(False).items()}
    if set(extracted) != set(names_of.values()):
        return None
    packed = copies_on_huge_pages(extracted)
    if packed is not None:
        buffer, constants = packed
    else:  # each copy on its own: huge pages only on the whole 2 MiB stretches inside each
        buffer, constants = None, {name: t.clone() for name, t in extracted.items()}
        for t in constants.values():
            huge_pages.advise_huge_pages(t)
    # the copies into the spare set, read in place; it becomes the one runs read, and the first set's blob is freed
    runner.update_constant_buffer(constants, True, False, True)
    runner.swap_constant_buffer()
    runner.free_inactive_constant_buffer()
    return CpuPackage(runner, metadata, constants, buffer)


COPY_ALIGNMENT = 64  # bytes: a cache line, and oneDNN's alignment for its buffers


def copies_on_huge_pages(tensors: dict[str, torch.Tensor]) -> Optional[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """``(buffer, copies)``: a copy of each of ``tensors`` (CPU, oneDNN or contiguous), one after another at
    :data:`COPY_ALIGNMENT` in one uint8 ``buffer`` asked onto huge pages before it is first touched, the copies byte
    for byte the tensors, each reading its own bytes of the buffer in place (checked; the caller keeps the buffer).
    A decode step streams its weights: on 4 KiB pages each page of them is a TLB miss, which a hypervisor's nested
    page tables make dearer, and a small model's weights (llama16m's are 0.3-1.5 MiB each) hold no whole 2 MiB page of
    their own (on a 2-vCPU EPYC VM, the 25 bf16 linears of a llama16m decode step took 0.91x the time with their
    weights in one huge-page buffer, float32 0.88x: ``benchmarks/RESULTS.md``). None where a copy cannot be made so (a
    strided view, a oneDNN tensor where pagedattn's C++ operators do not run, huge pages off): the caller copies them
    one by one."""
    from pagedattn.backends import native, native_ops

    if not huge_pages.enabled():
        return None
    places, total = {}, 0
    for name, t in tensors.items():
        if t.device.type != "cpu" or not (t.is_mkldnn or (t.is_contiguous() and t.storage_offset() == 0)):
            return None
        size = huge_pages.buffer_span(t)[1] if t.is_mkldnn else t.numel() * t.element_size()
        places[name] = (total, size)
        total += -(-size // COPY_ALIGNMENT) * COPY_ALIGNMENT
    buffer = huge_pages.zeros((total,), torch.uint8)
    copies = {}
    for name, t in tensors.items():
        offset, size = places[name]
        if t.is_mkldnn:
            native.onednn_bytes(t, out=buffer[offset:offset + size])
            try:
                copy = native_ops.onednn_from_buffer(buffer, offset, t)
            except RuntimeError as e:  # a layout the operator refuses: the copies one by one instead
                log.debug("a oneDNN constant could not be made over the buffer (%s)", first_line(e))
                return None
            # it reads these bytes, where they were just copied in
            if copy is None or huge_pages.buffer_span(copy) != (buffer.data_ptr() + offset, size):
                return None
        else:
            copy = buffer[offset:offset + size].view(t.dtype).view(t.shape).copy_(t)
        copies[name] = copy
    return buffer, copies
