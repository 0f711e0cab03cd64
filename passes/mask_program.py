"""A site's mask program read as a formula over query and key positions, and proofs about it (z3).

The mask and bias terms ``match_attention`` found on a site's score path are computed by a small
program of index arithmetic: ``arange``, comparisons, ``&``/``|``, ``where``, slices of buffers,
lookups into inputs such as ``attention_mask``. :func:`read_mask` interprets that program
symbolically: every tensor becomes one z3 expression in the index variables of its dimensions, so
the combined mask is a formula ``allowed(b, h, i, j)`` for batch row ``b``, head ``h``, query row
``i`` and key column ``j`` that holds for every size at once. :func:`establish` then proves which
kind of mask it is (causal, sliding window, chunked, none; with key padding) for every length the
program accepts, or says where it differs. Nothing is sampled: a window of 6,000 keys is found and
proven on a graph traced with 8 tokens.

What the program reads decides what a proof covers:

- sizes (query and key counts, batch) are symbols; a slice of a buffer bounds them (the program
  cannot run past the buffer), and so may the model's own maximum (``PassContext.max_length``);
- a ``[batch, keys]`` 0/1 or boolean input (``attention_mask``, ``src_key_padding_mask``) is an
  uninterpreted function: the proof holds whatever the caller passes;
- an integer input that counted up by one in the example (``position_ids``) stands for positions
  that count up by one from any offset per row; the proof covers those, and drop-in calls with
  other positions (restarting, packed documents) must be refused or split (``RewrittenModel``);
- constants (buffers, parameters) are read: small ones element by element, large 2-D ones when they
  are exactly a lower-triangular (causal) matrix;
- an input read as per-request values (a role that is a ``ValueSpec``: token types, a prefix length)
  stands for every input of that shape: ``[batch, tokens]`` token types of ``outside`` with up to
  ``runs`` runs of ``inside`` anywhere (each run's boundaries are unknowns of its row), or a ``[batch]``
  length ``>= 0``; running sums over such runs (Gemma-3's image-block ids) are read in closed form,
  checked against the sum's recurrence;
- anything else (token values, float masks handed in, ops this interpreter does not know) makes
  the program unreadable: :class:`NotEstablished` says why.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch._functorch.predispatch as _predispatch
from torch.fx import Graph, GraphModule, Node

from pagedattn.backends.position_mod import ValueSpec
from pagedattn.passes.site import MASK_LIMIT, AttentionSite, aten

try:
    import z3
except ImportError:  # pragma: no cover - a declared dependency; refuse rather than guess without it
    z3 = None

__all__ = ["NotEstablished", "MaskFormula", "MaskKind", "read_mask", "establish", "extract_program",
           "reads_by_value", "value_nodes"]

_NEG = -1e30  # stands for -inf and finfo.min: any value at or below MASK_LIMIT masks
_SMALL_CONSTANT = 4096  # constants up to this many elements are read element by element
_TIMEOUT_MS = 20_000
_MAX_POSITIONS = 2 ** 31  # seq_lens and block tables are int32: no sequence is longer


class NotEstablished(Exception):
    """The mask could not be established for every length; the message says why."""


# ----------------------------------------------------------------------------- extraction


def extract_program(gm: GraphModule, outputs: Sequence[Node]) -> tuple[GraphModule, list[Node]]:
    """A module computing ``outputs`` from the placeholders they depend on (and those placeholders)."""
    need: set[Node] = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in need:
            continue
        need.add(n)
        stack.extend(n.all_input_nodes)
    g = Graph()
    env: dict[Node, Node] = {}
    inputs = []
    for n in gm.graph.nodes:
        if n in need:
            env[n] = g.node_copy(n, lambda a: env[a])
            if n.op == "placeholder":
                inputs.append(n)
    g.output(tuple(env[o] for o in outputs))
    return GraphModule(gm, g), inputs


# ops whose first argument gives only a shape (and dtype): ``zeros_like(x)`` reads none of ``x``'s values
_SHAPE_OF_FIRST = frozenset({
    aten.sym_size.int, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.full_like.default, aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
    aten.new_full.default})


def value_nodes(module: GraphModule) -> set[Node]:
    """The nodes whose values reach the program's outputs; the others are read for their shapes only (a
    ``zeros_like`` of the token embeddings, GIT's mask): their values are never read nor interpreted."""
    out = next(n for n in module.graph.nodes if n.op == "output")
    need: set[Node] = set()
    stack = list(out.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in need:
            continue
        need.add(n)
        args = n.all_input_nodes
        if n.target in _SHAPE_OF_FIRST and n.args and isinstance(n.args[0], Node):
            args = [a for a in args if a is not n.args[0]]
        stack.extend(args)
    return need


def reads_by_value(p: Node, values: set[Node]) -> bool:
    """Whether the program reads a placeholder's values (not only its sizes): ``values`` from
    :func:`value_nodes`."""
    return p in values


# ----------------------------------------------------------------------------- values


@dataclass(frozen=True)
class _Dim:
    """One tensor dimension: its index (a z3 integer expression, None for a broadcast dimension whose
    values do not vary) and its size (a z3 expression)."""

    index: Any
    size: Any


@dataclass(frozen=True)
class _Val:
    dims: tuple  # of _Dim
    expr: Any  # z3 expression in the dims' indices
    kind: str  # "int" | "bool" | "float"


def _kind_of(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


class _Unreadable(Exception):
    pass


class _Interpreter:
    """Runs a mask program on z3 expressions instead of tensors."""

    def __init__(self, module: GraphModule, roles: dict[str, str], constants: dict[str, torch.Tensor],
                 prefix: str = "i"):
        self.module = module
        self.prefix = prefix  # index variables of one reading are named apart from another's
        self.roles = roles  # placeholder -> "padding" | "positions" | "constant" | "shape"
        self.constants = constants  # placeholder -> its value, for constant inputs
        self.facts: list = []  # ranges of indices, validity of sizes
        # what must hold at every index for the program to run (lookups inside their tensor): kept apart
        # from the facts, which would otherwise shrink the indices a proof covers
        self.obligations: list = []
        self.sizes: dict[str, Any] = {}
        self.counter = itertools.count()
        self.functions: dict[str, Any] = {}
        self.padding: dict[str, Callable] = {}  # placeholder -> (b, k) -> z3 Bool "key k of row b present"
        self.runs: dict[str, tuple] = {}  # placeholder -> (start, end): present keys as one run per row
        self.positions: list[str] = []
        # placeholder -> (its ValueSpec, row -> the z3 values of that row, the row functions behind them)
        self.values: dict[str, tuple] = {}
        # vmap (Hugging Face's mask functions over or/and overlays): level -> (index, size) of the dimension
        # it maps over, hidden from the batched values' dims while the level is open
        self.levels: dict[int, tuple] = {}
        self.objects: dict[Node, Any] = {}  # non-tensor attributes (flat_apply's input specs)
        self.env: dict[Node, Any] = {}
        self.concrete: dict[Node, Any] = {}  # nodes computed outright: constants and what only they feed
        self.tables: dict[str, torch.Tensor] = {}  # z3 function name -> the constant table it stands for
        self.float_dtypes: set = set()  # float dtypes the program computes in

    # --- sizes and indices

    def size(self, s) -> Any:
        if isinstance(s, bool):
            raise _Unreadable("a boolean used as a size")
        if isinstance(s, int):
            return z3.IntVal(s)
        if isinstance(s, torch.SymInt):
            return self._sympy(s.node.expr)
        raise _Unreadable(f"size {s!r}")

    def _sympy(self, e) -> Any:
        if e.is_Integer:
            return z3.IntVal(int(e))
        if e.is_Symbol:
            name = str(e)
            if name not in self.sizes:
                self.sizes[name] = z3.Int(name)
                self.facts.append(self.sizes[name] >= 1)
            return self.sizes[name]
        args = [self._sympy(a) for a in e.args]
        name = type(e).__name__
        if e.is_Add:
            return z3.Sum(args)
        if e.is_Mul:
            return math.prod(args[1:], start=args[0])
        if name == "FloorDiv":
            return args[0] / args[1]
        if name in ("Min", "Max"):
            out = args[0]
            for a in args[1:]:
                out = z3.If(a < out, a, out) if name == "Min" else z3.If(a > out, a, out)
            return out
        raise _Unreadable(f"size expression {e}")

    def fresh(self, size) -> Any:
        v = z3.Int(f"{self.prefix}{next(self.counter)}")
        self.facts += [v >= 0, v < size]
        return v

    def dims_of(self, shape) -> tuple:
        out = []
        for s in shape:
            size = self.size(s)
            out.append(_Dim(None, size) if isinstance(s, int) and s == 1 else _Dim(self.fresh(size), size))
        return tuple(out)

    # --- values

    def const(self, x) -> _Val:
        if isinstance(x, bool):
            return _Val((), z3.BoolVal(x), "bool")
        if isinstance(x, int):
            return _Val((), z3.IntVal(x), "int")
        if isinstance(x, float):
            if math.isinf(x) or math.isnan(x) or abs(x) >= 1e30:
                if math.isnan(x):
                    raise _Unreadable("NaN in the mask program")
                x = _NEG if x < 0 else -_NEG
            return _Val((), z3.RealVal(x), "float")
        if isinstance(x, torch.SymInt):
            return _Val((), self.size(x), "int")
        raise _Unreadable(f"constant {x!r}")

    def get(self, a) -> _Val:
        if isinstance(a, Node):
            if a not in self.env and a in self.concrete:
                value = self.concrete[a]
                self.env[a] = self.constant(value, a.name) if isinstance(value, torch.Tensor) else self.const(value)
            v = self.env[a]
            if v is None:
                raise _Unreadable(f"the values of {a.name}, which the program reads only by shape elsewhere")
            return v
        return self.const(a)

    @staticmethod
    def cast(v: _Val, kind: str) -> Any:
        e = v.expr
        if v.kind == kind:
            return e
        if kind == "bool":
            return e != 0
        if v.kind == "bool":
            return z3.If(e, z3.IntVal(1), z3.IntVal(0)) if kind == "int" else z3.If(e, z3.RealVal(1), z3.RealVal(0))
        if kind == "float":
            return z3.ToReal(e)
        # a float cast to an integer truncates toward zero, as torch does (z3's ToInt floors)
        return z3.If(e >= 0, z3.ToInt(e), -z3.ToInt(-e))

    def unify(self, vals: Sequence[_Val]) -> tuple[tuple, list[_Val]]:
        """Right-aligned broadcasting: the result's dims, and the operands with the dimensions they share
        under one index. An operand's own index is renamed in its expression, not tied by a fact, so a
        later renaming of the result's index (a slice, a second use) reaches every operand."""
        n = max((len(v.dims) for v in vals), default=0)
        out, subs = [], [[] for _ in vals]
        for k in range(n):
            here = [(vi, v.dims[k - n + len(v.dims)]) for vi, v in enumerate(vals) if k - n + len(v.dims) >= 0]
            varying = [(vi, d) for vi, d in here if d.index is not None and not _is_one(d.size)]
            if not varying:  # one element everywhere: read for every index of the others
                out.append(here[0][1] if here else _Dim(None, z3.IntVal(1)))
                continue
            first = varying[0][1]
            chosen = first
            if z3.is_const(first.index) and any(o.index is not None and o.index.eq(first.index) for o in out):
                # one index in two dims (``a[:, None] - a[None, :]`` of one ``a``): they are independent
                chosen = _Dim(self.fresh(first.size), first.size)
            for vi, d in varying:
                if d.index.eq(chosen.index):
                    continue
                if d.index.eq(first.index) or z3.is_const(d.index):
                    # one element of the result reads the same position of each operand: one index
                    subs[vi].append((d.index, chosen.index))
                else:
                    self.facts.append(d.index == chosen.index)
                if not d.size.eq(chosen.size):
                    self.facts.append(d.size == chosen.size)
            out.append(chosen)
        renamed = [_Val(v.dims, z3.substitute(v.expr, *sub), v.kind) if sub else v for v, sub in zip(vals, subs)]
        return tuple(out), renamed

    def data(self, name: str, dims: tuple, kind: str) -> Any:
        sort = {"bool": z3.BoolSort(), "int": z3.IntSort(), "float": z3.RealSort()}[kind]
        key = f"{name}:{len(dims)}:{kind}"
        if key not in self.functions:
            self.functions[key] = z3.Function(name, *([z3.IntSort()] * len(dims)), sort)
        return self.functions[key](*[d.index if d.index is not None else z3.IntVal(0) for d in dims])

    # --- inputs

    def placeholder(self, n: Node) -> Optional[_Val]:
        v = n.meta.get("val")
        role = self.roles.get(n.name, "shape")
        if isinstance(v, torch.SymInt):
            return _Val((), self.size(v), "int")
        if not isinstance(v, torch.Tensor) or role == "shape":
            return None
        if role == "constant":
            return self.constant(self.constants[n.name], n.name)
        if role in ("present", "present_false"):  # a padding input read as "every key present"
            one = {"bool": z3.BoolVal(role == "present"), "int": z3.IntVal(1), "float": z3.RealVal(1)}[_kind_of(v.dtype)]
            return _Val(tuple(_Dim(None, self.size(s)) for s in v.shape), one, _kind_of(v.dtype))
        dims = self.dims_of(v.shape)
        if role in ("padding", "padding_runs"):
            if len(dims) != 2:
                raise _Unreadable(f"padding input {n.name} is not [batch, keys]")
            kind = _kind_of(v.dtype)
            if role == "padding":
                # a 0/1 mask whatever its dtype (held to that at call time): a boolean per key, as a number
                f = self.data(f"pad_{n.name}", dims, "bool")
                fn = f.decl()
                self.padding[n.name] = lambda b, k: fn(b, k)
                one = {"bool": f, "int": z3.If(f, z3.IntVal(1), z3.IntVal(0)),
                       "float": z3.If(f, z3.RealVal(1), z3.RealVal(0))}[kind]
                return _Val(dims, one, kind)
            # the present keys of each row are one run [start, end) (left or right padding): a guard at
            # call time holds drop-in calls to that
            # 0 <= start < end <= keys for every row by construction (a row's index is renamed in the
            # expressions that read it, so a fact about one index would not follow it); a row without
            # any present key is refused at call time: nothing to attend to
            first = z3.Function(f"start_{n.name}", z3.IntSort(), z3.IntSort())
            extra = z3.Function(f"length_{n.name}", z3.IntSort(), z3.IntSort())
            keys = dims[1].size

            def start(r, first=first, keys=keys):
                s0 = _nonneg(first(r))
                return z3.If(s0 > keys - 1, keys - 1, s0)

            def end(r, extra=extra, keys=keys, start=start):
                e0 = start(r) + 1 + _nonneg(extra(r))
                return z3.If(e0 > keys, keys, e0)

            row = dims[0].index if dims[0].index is not None else z3.IntVal(0)
            self.runs[n.name] = (start, end)
            self.padding[n.name] = lambda b, k: z3.And(start(b) <= k, k < end(b))
            present = self.padding[n.name](row, dims[1].index if dims[1].index is not None else z3.IntVal(0))
            one = {"bool": present, "int": z3.If(present, z3.IntVal(1), z3.IntVal(0)),
                   "float": z3.If(present, z3.RealVal(1), z3.RealVal(0))}[kind]
            return _Val(dims, one, kind)
        if isinstance(role, ValueSpec):
            return self.value_input(n, v, role)
        if role == "positions":
            # positions that count up by one along the last dimension, from any offset per row
            self.positions.append(n.name)
            offset = z3.Function(f"offset_{n.name}", *([z3.IntSort()] * (len(dims) - 1)), z3.IntSort())
            lead = [d.index if d.index is not None else z3.IntVal(0) for d in dims[:-1]]
            off = _nonneg(offset(*lead))  # non-negative by construction: a fact would not follow renamed rows
            return _Val(dims, dims[-1].index + off if dims[-1].index is not None else off, "int")
        raise _Unreadable(f"input {n.name} ({role})")

    def value_input(self, n: Node, v: torch.Tensor, spec: ValueSpec) -> _Val:
        """An input read as per-request values (see the module doc). Every row's values are built from
        unknowns of that row so that they are valid by construction (a fact about one row index would not
        follow a renamed one): spans start at ``|x_0|``, are ``1 + |y_r|`` long and ``1 + |x_r|`` apart."""
        if v.dtype.is_floating_point:
            raise _Unreadable(f"input {n.name} as per-request values: a float tensor")
        dims = self.dims_of(v.shape)
        if spec.kind == "scalar":
            if len(dims) != 1:
                raise _Unreadable(f"input {n.name} as a length per row: not [batch]")
            fns = [z3.Function(f"val_{n.name}_z", z3.IntSort(), z3.IntSort())]
            self.values[n.name] = (spec, lambda r, fn=fns[0]: [_nonneg(fn(r))], fns)
            row = dims[0].index if dims[0].index is not None else z3.IntVal(0)
            return _Val(dims, _nonneg(fns[0](row)), "int")
        if len(dims) != 2:
            raise _Unreadable(f"input {n.name} as token types: not [batch, tokens]")
        fns = [z3.Function(f"val_{n.name}_{g}{r}", z3.IntSort(), z3.IntSort())
               for r in range(spec.runs) for g in "xy"]

        def bounds(r, fns=fns):
            out, end = [], None
            for k in range(spec.runs):
                start = _nonneg(fns[2 * k](r)) if end is None else end + 1 + _nonneg(fns[2 * k](r))
                end = start + 1 + _nonneg(fns[2 * k + 1](r))
                out += [start, end]
            return out

        self.values[n.name] = (spec, bounds, fns)
        row = dims[0].index if dims[0].index is not None else z3.IntVal(0)
        col = dims[1].index if dims[1].index is not None else z3.IntVal(0)
        b = bounds(row)
        inside = z3.Or([z3.And(b[2 * k] <= col, col < b[2 * k + 1]) for k in range(spec.runs)])
        if v.dtype == torch.bool:
            return _Val(dims, z3.If(inside, z3.BoolVal(spec.inside != 0), z3.BoolVal(spec.outside != 0)), "bool")
        return _Val(dims, z3.If(inside, z3.IntVal(spec.inside), z3.IntVal(spec.outside)), "int")

    def constant(self, t: torch.Tensor, name: str) -> _Val:
        """A buffer or parameter: a band around the diagonal (causal, windowed) as such, else element by
        element when small, else (float) as a table of unknown values in its range."""
        if t.is_meta:
            raise _Unreadable(f"constant {name} has no values (a meta tensor): load the weights first")
        t = t.detach().cpu()
        kind = _kind_of(t.dtype)
        if t.numel() == 1:
            x = t.reshape(()).item()
            c = self.const(bool(x) if kind == "bool" else float(x) if kind == "float" else int(x))
            return _Val(tuple(_Dim(None, z3.IntVal(1)) for _ in t.shape), c.expr, c.kind)
        dims = self.dims_of(tuple(t.shape))
        band = _diagonal_band(t)
        if band is not None:  # a causal or windowed matrix over its last two dimensions (nanoGPT's `bias`)
            on, off, lo, hi = band
            i, j = dims[-2].index, dims[-1].index
            value = {"bool": lambda x: z3.BoolVal(bool(x)), "float": _real, "int": lambda x: z3.IntVal(int(x))}[kind]
            inside = z3.And([c for c in (None if lo is None else i - j >= lo, None if hi is None else i - j <= hi)
                             if c is not None] or [z3.BoolVal(True)])
            return _Val(dims, z3.If(inside, value(on), value(off)), kind)
        line = _affine_rows(t) if kind != "bool" else None
        if line is not None and dims[-1].index is not None:
            # ALiBi tables (MPT's, built for the longest length): value = start + step * position in every row
            start, step = line
            lead = dims[:-1]
            k = dims[-1].index if kind == "int" else z3.ToReal(dims[-1].index)
            return _Val(dims, self._elementwise(start, lead, kind) + self._elementwise(step, lead, kind) * k, kind)
        if t.numel() <= _SMALL_CONSTANT:
            return _Val(dims, self._elementwise(t, dims, kind), kind)
        if kind == "float":
            # a learned table (a relative-position bias): its values are unknown to the proof, so only what
            # holds for every value follows from it (an additive table is never ALiBi, say)
            # (beyond their range, clamped in: a table of finite values never hides a key)
            table = z3.Function(f"table_{name}", *([z3.IntSort()] * len(dims)), z3.RealSort())
            self.tables[f"table_{name}"] = t
            raw = table(*[d.index if d.index is not None else z3.IntVal(0) for d in dims])
            low, high = _real(t.min().item()), _real(t.max().item())
            return _Val(dims, z3.If(raw < low, low, z3.If(raw > high, high, raw)), kind)
        raise _Unreadable(f"constant {name} of shape {tuple(t.shape)} is neither small nor a band around the "
                          "diagonal (a causal or windowed matrix)")

    @staticmethod
    def _elementwise(t: torch.Tensor, dims: tuple, kind: str) -> Any:
        flat = t.reshape(-1).tolist()
        strides = [math.prod(t.shape[k + 1:]) for k in range(t.dim())]

        def value(x):
            if kind == "bool":
                return z3.BoolVal(bool(x))
            if kind == "float":
                return _real(x)
            return z3.IntVal(int(x))

        index = z3.Sum([d.index * s for d, s in zip(dims, strides) if d.index is not None] or [z3.IntVal(0)])
        out = value(flat[-1])
        for pos in range(len(flat) - 2, -1, -1):
            if flat[pos] != flat[-1]:
                out = z3.If(index == pos, value(flat[pos]), out)
        return out

    # --- the program

    def run(self, outputs: Sequence[Node]) -> list[_Val]:
        values = value_nodes(self.module)
        for n in self.module.graph.nodes:
            if n.op == "output":
                break
            if n not in values:  # read for its shape only: sizes come from its metadata
                self.env[n] = None
                continue
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
                self.float_dtypes.add(v.dtype)
            if n.op == "placeholder":
                if self.roles.get(n.name) == "constant":
                    self.concrete[n] = self.constants[n.name]
                else:
                    self.env[n] = self.placeholder(n)
            elif n.op == "get_attr":
                obj = self.module
                for part in n.target.split("."):
                    obj = getattr(obj, part)
                if isinstance(obj, torch.utils._pytree.TreeSpec):  # how a flat_apply call unflattens its inputs
                    self.objects[n] = obj
                    continue
                if not isinstance(obj, torch.Tensor):
                    raise _Unreadable(f"attribute {n.target}")
                self.concrete[n] = obj
            elif self._fold(n):
                continue
            else:
                handler = _HANDLERS.get(n.target)
                if handler is None:
                    raise _Unreadable(f"op {getattr(n.target, '__name__', n.target)}")
                self.env[n] = handler(self, n)
        return [self.get(o) for o in outputs]

    def _fold(self, n: Node) -> bool:
        """Compute a node whose inputs are all known constants (ALiBi slopes from ``pow``, a causal buffer
        built with ``tril``): the program then reads its values like any constant's."""
        args = n.all_input_nodes
        if not all(a in self.concrete for a in args) or any(
                isinstance(x, torch.SymInt) for x in torch.utils._pytree.tree_leaves((n.args, n.kwargs))):
            return False
        if n.target in _VMAP_OPS:  # vmap's levels are read symbolically (batched tensors are no constants)
            return False
        if not args and n.target not in _FOLDABLE_SOURCES:
            return False
        real = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: self.concrete[a])
        try:
            with torch.no_grad():
                self.concrete[n] = n.target(*real[0], **real[1])
        except Exception:  # not computable here (e.g. a device this process lacks): read symbolically
            return False
        return True

    # --- reasoning inside the program

    def always(self, claim) -> bool:
        """Whether ``claim`` holds for every index and size the facts allow."""
        s = z3.Solver()
        s.set("timeout", _TIMEOUT_MS)
        s.add(*self.facts)
        s.add(z3.Not(claim))
        return s.check() == z3.unsat


def _affine_rows(t: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(start, step)`` over ``t``'s leading dims when every row along the last dim is
    ``start + step * position`` (to the rounding of ``t``'s dtype), else None."""
    if t.dim() < 1 or t.shape[-1] < 3 or not bool(torch.isfinite(t).all()):
        return None
    rows = t.reshape(-1, t.shape[-1]).double()
    start, step = rows[:, 0], rows[:, 1] - rows[:, 0]
    if not bool((step != 0).any()):
        return None
    fit = start[:, None] + step[:, None] * torch.arange(t.shape[-1], dtype=torch.float64)
    tol = 0.0 if not t.dtype.is_floating_point else 4 * torch.finfo(t.dtype).eps * float(rows.abs().max())
    if float((fit - rows).abs().max()) > tol:
        return None
    lead = t.shape[:-1]
    if t.dtype.is_floating_point:  # the step from the ends: exact for a rounded table
        step = (rows[:, -1] - rows[:, 0]) / (t.shape[-1] - 1)
    return start.reshape(lead).to(t.dtype), step.reshape(lead).to(t.dtype)


def _nonneg(x) -> Any:
    return z3.If(x < 0, -x, x)


def _real(x: float) -> Any:
    """A float constant for the solver; infinities (and float32's huge fill values) become a finite
    "minus a lot" that reads the same in a mask."""
    if math.isinf(x) or abs(x) >= 1e30:
        x = _NEG if x < 0 else -_NEG
    return z3.RealVal(x)


def _diagonal_band(t: torch.Tensor) -> Optional[tuple]:
    """``(value inside, value outside, lo, hi)`` when ``t``'s last two dims hold one value where
    ``lo <= row - column <= hi`` and another elsewhere, the same in every leading slice (a causal matrix:
    ``lo = 0``, a window of ``w``: also ``hi = w - 1``); a bound the matrix never reaches is None."""
    if t.dim() < 2 or t.shape[-1] != t.shape[-2] or t.shape[-1] < 2:
        return None
    m = t.reshape(-1, *t.shape[-2:])
    if not bool((m == m[:1]).all()):
        return None
    m, n = m[0], t.shape[-1]
    values = m.unique()
    if values.numel() != 2:
        return None
    d = torch.arange(n)[:, None] - torch.arange(n)[None, :]  # row - column
    for on, off in ((values[0], values[1]), (values[1], values[0])):
        inside = m == on
        lo, hi = int(d[inside].min()), int(d[inside].max())
        if bool((inside == ((d >= lo) & (d <= hi))).all()):
            return on.item(), off.item(), (None if lo == -(n - 1) else lo), (None if hi == n - 1 else hi)
    return None


# ------------------------------------------------------------------------------ op handlers


def _same(it, n):
    return it.get(n.args[0])


def _sym_size(it, n):
    return _Val((), it.size(n.meta["val"]), "int")


def _arange(it, n):
    a = n.args
    if n.target is aten.arange.default:
        start, step = z3.IntVal(0), z3.IntVal(1)
    else:
        start = it.get(a[0]).expr
        step = it.get(a[2]).expr if n.target is aten.arange.start_step else z3.IntVal(1)
    size = it.size(n.meta["val"].shape[0])
    v = it.fresh(size)
    return _Val((_Dim(v, size),), start + step * v, "int")


def _cast(it, n):
    src = it.get(n.args[0])
    k = _kind_of(n.meta["val"].dtype)
    return _Val(src.dims, it.cast(src, k), k)


def _unsqueeze(it, n):
    src = it.get(n.args[0])
    d = n.args[1] % (len(src.dims) + 1)
    dims = list(src.dims)
    dims.insert(d, _Dim(None, z3.IntVal(1)))
    return _Val(tuple(dims), src.expr, src.kind)


def _squeeze(it, n):
    src = it.get(n.args[0])
    if n.target is aten.squeeze.default:
        drop = {k for k, d in enumerate(src.dims) if d.index is None}
    else:
        ds = [n.args[1]] if n.target is aten.squeeze.dim else list(n.args[1])
        drop = {d % len(src.dims) for d in ds if src.dims[d % len(src.dims)].index is None}
    return _Val(tuple(d for k, d in enumerate(src.dims) if k not in drop), src.expr, src.kind)


def _expand(it, n):
    src = it.get(n.args[0])
    out = n.meta["val"].shape
    dims = [_Dim(None, z3.IntVal(1))] * (len(out) - len(src.dims)) + list(src.dims)
    # a broadcast dimension expanded keeps its values: it stays without an index, with the new size
    return _Val(tuple(d if d.index is not None else _Dim(None, it.size(s)) for d, s in zip(dims, out)),
                src.expr, src.kind)


def _view(it, n):
    """Views that insert or drop size-1 dims, merge dims into one, or split one into several."""
    src = it.get(n.args[0])
    out_shape = tuple(n.meta["val"].shape)
    big_in = [d for d in src.dims if not _is_one(d.size)]
    out_sizes = [it.size(s) for s in out_shape]
    big_out = [k for k, s in enumerate(out_shape) if not (isinstance(s, int) and s == 1)]
    dims = [_Dim(None, z3.IntVal(1)) if k not in big_out else None for k in range(len(out_shape))]
    a, b = 0, 0
    while a < len(big_in) and b < len(big_out):
        d = big_in[a]
        if it.always(d.size == out_sizes[big_out[b]]):
            dims[big_out[b]] = d
            a, b = a + 1, b + 1
            continue
        # merge: consecutive input dims whose sizes multiply to the output's
        for m in range(a + 2, len(big_in) + 1):
            group = big_in[a:m]
            if it.always(math.prod([g.size for g in group[1:]], start=group[0].size) == out_sizes[big_out[b]]):
                if all(g.index is None for g in group):  # constant along all of them: still constant
                    dims[big_out[b]] = _Dim(None, out_sizes[big_out[b]])
                    a, b = m, b + 1
                    break
                index, stride = z3.IntVal(0), z3.IntVal(1)
                for g in reversed(group):
                    # a dim the values do not vary along still spans its size in the merged index
                    part = g.index if g.index is not None else it.fresh(g.size)
                    index, stride = index + part * stride, stride * g.size
                dims[big_out[b]] = _Dim(index, out_sizes[big_out[b]])
                a, b = m, b + 1
                break
        else:
            # split: consecutive output dims whose sizes multiply to the input's
            for m in range(b + 2, len(big_out) + 1):
                group = [out_sizes[k] for k in big_out[b:m]]
                if it.always(math.prod(group[1:], start=group[0]) == d.size):
                    parts = [it.fresh(s) for s in group]
                    index, stride = z3.IntVal(0), z3.IntVal(1)
                    for p, s in zip(reversed(parts), reversed(group)):
                        index, stride = index + p * stride, stride * s
                    if d.index is not None:
                        it.facts.append(d.index == index)
                    for k, p, s in zip(big_out[b:m], parts, group):
                        dims[k] = _Dim(p, s)
                    a, b = a + 1, m
                    break
            else:
                raise _Unreadable(f"view {tuple(src.dims)} -> {out_shape}")
    if a != len(big_in) or b != len(big_out):
        raise _Unreadable(f"view to {out_shape}")
    return _Val(tuple(dims), src.expr, src.kind)


def _is_one(size) -> bool:
    return z3.is_int_value(size) and size.as_long() == 1


def _slice(it, n):
    """``x[start:end]`` along a dim; its size is what slicing gives at run time (clamped to the source), so
    a slice of a buffer bounds the lengths the program runs at where it meets a longer dimension."""
    a = list(n.args) + [None] * (5 - len(n.args))
    src = it.get(a[0])
    dim = (a[1] or 0) % len(src.dims)
    start, end, step = a[2] or 0, a[3], a[4] or 1
    if step != 1:
        raise _Unreadable("a strided slice")
    d = src.dims[dim]
    # an int bound from the end (``x[:, :-1]``) counts back from the dimension's size, as Python's does
    if isinstance(start, int) and start < 0:
        start = None if -start >= 2 ** 62 else start
    off = it.get(start).expr if isinstance(start, (Node, torch.SymInt)) else \
        z3.IntVal(0) if start is None else _from_end(d.size, start)
    stop = d.size if end is None or (isinstance(end, int) and end >= 2 ** 62) else \
        (it.get(end).expr if isinstance(end, (Node, torch.SymInt)) else _from_end(d.size, end))
    if not it.always(off >= 0) or not it.always(stop >= 0):
        raise _Unreadable("a slice from the end (negative bounds)")
    stop = z3.If(stop > d.size, d.size, stop)
    size = z3.If(stop > off, stop - off, z3.IntVal(0))
    static = n.meta["val"].shape[dim]
    if isinstance(static, int):  # a size the trace fixed: exact as it is
        size = z3.IntVal(static)
    elif it.always(size == 1):  # e.g. the last S rows of a dimension of one (MPT's ALiBi row): one, always
        size, static = z3.IntVal(1), 1
    dims = list(src.dims)
    if d.index is None:
        dims[dim] = _Dim(None, size)
        return _Val(tuple(dims), src.expr, src.kind)
    if isinstance(static, int) and static == 1:  # one element: the source at the slice's start
        dims[dim] = _Dim(None, size)
        return _Val(tuple(dims), z3.substitute(src.expr, (d.index, off)) if z3.is_const(d.index) else
                    _bound(it, src.expr, d.index, off), src.kind)
    nv = it.fresh(size)
    dims[dim] = _Dim(nv, size)
    return _Val(tuple(dims), z3.substitute(src.expr, (d.index, nv + off)) if z3.is_const(d.index) else
                _bound(it, src.expr, d.index, nv + off), src.kind)


def _from_end(size, bound: int) -> Any:
    """An int slice bound: from the start, or (negative) counted back from ``size``, clamped at 0."""
    if bound >= 0:
        return z3.IntVal(bound)
    return z3.If(size + bound > 0, size + bound, z3.IntVal(0))


def _bound(it, expr, index, value):
    """``expr`` with the compound index ``index`` taking ``value``: stated as a fact (one element per index)."""
    it.facts.append(index == value)
    return expr


def _select(it, n):
    src = it.get(n.args[0])
    dim = n.args[1] % len(src.dims)
    d = src.dims[dim]
    idx = it.get(n.args[2]).expr if isinstance(n.args[2], Node) else z3.IntVal(n.args[2])
    expr = src.expr if d.index is None else (z3.substitute(src.expr, (d.index, idx)) if z3.is_const(d.index) else
                                             _bound(it, src.expr, d.index, idx))
    return _Val(tuple(x for k, x in enumerate(src.dims) if k != dim), expr, src.kind)


def _permute(it, n):
    src = it.get(n.args[0])
    if n.target is aten.transpose.int:
        perm = list(range(len(src.dims)))
        i, j = n.args[1] % len(perm), n.args[2] % len(perm)
        perm[i], perm[j] = perm[j], perm[i]
    elif n.target is aten.t.default:
        perm = list(range(len(src.dims)))[::-1]
    else:
        perm = [p % len(src.dims) for p in n.args[1]]
    return _Val(tuple(src.dims[p] for p in perm), src.expr, src.kind)


def _arith(op: str):
    def handler(it, n):
        dims, (x, y) = it.unify([it.get(n.args[0]), it.get(n.args[1])])
        k = "float" if "float" in (x.kind, y.kind) or op == "/" else "int"
        xe, ye = it.cast(x, k), it.cast(y, k)
        alpha = n.kwargs.get("alpha", 1)
        if alpha != 1:
            ye = ye * (z3.RealVal(alpha) if k == "float" else z3.IntVal(alpha))
        e = {"+": lambda: xe + ye, "-": lambda: xe - ye, "*": lambda: xe * ye, "r-": lambda: ye - xe,
             "/": lambda: xe / ye}[op]()
        return _Val(dims, e, k)
    return handler


def _floordiv(it, n):
    dims, (x, y) = it.unify([it.get(n.args[0]), it.get(n.args[1])])
    mode = n.kwargs.get("rounding_mode", "floor") if n.target is not aten.floor_divide.default else "floor"
    if n.target in (aten.div.Tensor_mode, aten.div.Scalar_mode) and mode != "floor" and mode != "trunc":
        raise _Unreadable("true division of indices")
    if x.kind != "int" or y.kind != "int":
        raise _Unreadable("division of non-integers")
    if not it.always(y.expr > 0):
        raise _Unreadable("division by a divisor that may be negative")
    if mode == "trunc" and not it.always(x.expr >= 0):
        raise _Unreadable("truncating division of values that may be negative")
    return _Val(dims, x.expr / y.expr, "int")  # z3's integer division floors for y > 0


def _remainder(it, n):
    dims, (x, y) = it.unify([it.get(n.args[0]), it.get(n.args[1])])
    if x.kind != "int" or y.kind != "int" or not it.always(y.expr > 0):
        raise _Unreadable("remainder of non-integers or by a divisor that may be negative")
    return _Val(dims, x.expr % y.expr, "int")  # z3's mod is non-negative for y > 0


def _compare(op: str):
    def handler(it, n):
        dims, (x, y) = it.unify([it.get(n.args[0]), it.get(n.args[1])])
        k = "float" if "float" in (x.kind, y.kind) else ("bool" if x.kind == y.kind == "bool" else "int")
        xe, ye = it.cast(x, k), it.cast(y, k)
        e = {"<": lambda: xe < ye, "<=": lambda: xe <= ye, ">": lambda: xe > ye, ">=": lambda: xe >= ye,
             "==": lambda: xe == ye, "!=": lambda: xe != ye}[op]()
        return _Val(dims, e, "bool")
    return handler


def _logic(fn):
    def handler(it, n):
        dims, (x, y) = it.unify([it.get(n.args[0]), it.get(n.args[1])])
        if x.kind != "bool" or y.kind != "bool":
            raise _Unreadable("a bitwise operation on integers")
        return _Val(dims, fn(x.expr, y.expr), "bool")
    return handler


def _not(it, n):
    x = it.get(n.args[0])
    if x.kind != "bool":
        raise _Unreadable("a bitwise not of integers")
    return _Val(x.dims, z3.Not(x.expr), "bool")


def _neg(it, n):
    x = it.get(n.args[0])
    return _Val(x.dims, -x.expr, x.kind)


def _abs(it, n):
    x = it.get(n.args[0])
    return _Val(x.dims, z3.If(x.expr < 0, -x.expr, x.expr), x.kind)


def _minmax(fn):
    def handler(it, n):
        dims, (x, y) = it.unify([it.get(n.args[0]), it.get(n.args[1])])
        k = "float" if "float" in (x.kind, y.kind) else "int"
        xe, ye = it.cast(x, k), it.cast(y, k)
        return _Val(dims, z3.If(fn(xe, ye), xe, ye), k)
    return handler


def _clamp(it, n):
    x = it.get(n.args[0])
    lo = n.args[1] if len(n.args) > 1 else n.kwargs.get("min")
    hi = n.args[2] if len(n.args) > 2 else n.kwargs.get("max")
    if n.target is aten.clamp_min.default:
        hi = None
    if n.target is aten.clamp_max.default:
        lo, hi = None, n.args[1]
    bounds = [(it.get(b), below) for b, below in ((lo, True), (hi, False)) if b is not None]
    dims, (x, *bs) = it.unify([x] + [b for b, _ in bounds])
    e = x.expr
    for b, (_, below) in zip(bs, bounds):
        be = it.cast(b, x.kind)
        e = z3.If(e < be, be, e) if below else z3.If(e > be, be, e)
    return _Val(dims, e, x.kind)


def _where(it, n):
    dims, (c, x, y) = it.unify([it.get(a) for a in n.args[:3]])
    k = "float" if "float" in (x.kind, y.kind) else ("int" if "int" in (x.kind, y.kind) else "bool")
    return _Val(dims, z3.If(it.cast(c, "bool"), it.cast(x, k), it.cast(y, k)), k)


def _masked_fill(it, n):
    dims, (x, c, v) = it.unify([it.get(a) for a in n.args[:3]])
    k = "float" if "float" in (x.kind, v.kind) else x.kind
    return _Val(dims, z3.If(it.cast(c, "bool"), it.cast(v, k), it.cast(x, k)), k)


def _filled(it, n):
    """``ones``/``zeros``/``full`` and their ``_like``/``new_`` forms: one value everywhere."""
    v = n.meta["val"]
    t = n.target
    if t in (aten.full.default, aten.new_full.default, aten.full_like.default):
        fill = n.args[1]
    elif t is aten.scalar_tensor.default:
        fill = n.args[0]
    else:
        fill = 1 if "ones" in str(t) else 0
    k = _kind_of(v.dtype)
    c = it.get(fill) if isinstance(fill, Node) else it.const(fill)
    return _Val(tuple(_Dim(None, it.size(s)) for s in v.shape), it.cast(c, k), k)


def _index(it, n):
    """``base[i0, i1, ...]`` with index tensors for the leading dims: the base at those indices."""
    idx = list(n.args[1])
    if any(i is None for i in idx):
        raise _Unreadable("indexing that skips a dimension")
    return _index_values(it, it.get(n.args[0]), [it.get(i) for i in idx])


def _index_values(it, base: _Val, vals: list) -> _Val:
    if any(v.kind == "bool" for v in vals):
        raise _Unreadable("boolean indexing")
    if any(d.index is not None and not z3.is_const(d.index) for d in base.dims[:len(vals)]):
        raise _Unreadable("indexing a merged dimension")
    dims, vals = it.unify(vals)
    sub = [(d.index, v.expr) for d, v in zip(base.dims, vals) if d.index is not None]
    for d, v in zip(base.dims, vals):  # an index past the base's dimension is an error at run time
        it.obligations.append(z3.And(v.expr >= 0, v.expr < d.size))
    e = z3.substitute(base.expr, *sub) if sub else base.expr
    return _Val(dims + tuple(base.dims[len(vals):]), e, base.kind)


def _opaque(name: str):
    """A float function the proofs know nothing about but that it is a function (``log`` in T5's buckets,
    KERPLE's logarithmic bias): the same argument gives the same value, nothing more is assumed."""
    def handler(it, n):
        x = it.get(n.args[0])
        xe = it.cast(x, "float")
        fn = z3.Function(f"op_{name}", z3.RealSort(), z3.RealSort())
        # the sign the function takes, in the term itself (so it follows the term when indices are renamed):
        # a lookup by a bucket computed from a logarithm stays in its table for every length
        if name in _SIGN_SPLIT:
            below = z3.Function(f"op_{name}__below", z3.RealSort(), z3.RealSort())
            e = z3.If(xe >= _SIGN_SPLIT[name], _abs_real(fn(xe)), -_abs_real(below(xe)))
        elif name in ("exp", "sqrt", "rsqrt", "sigmoid"):
            e = _abs_real(fn(xe))
        else:
            e = fn(xe)
        return _Val(x.dims, e, "float")
    return handler


# logarithms: at or above this argument they are >= 0, below it < 0 (NaN below 0 is no number a mask keeps)
_SIGN_SPLIT = {"log": 1, "log2": 1, "log10": 1, "log1p": 0}


def _abs_real(x) -> Any:
    return z3.If(x >= 0, x, -x)


def _embedding(it, n):
    """``embedding(weight, indices)``: the weight's row at each index (T5's bias per bucket)."""
    weight, idx = it.get(n.args[0]), it.get(n.args[1])
    if len(weight.dims) != 2 or idx.kind != "int":
        raise _Unreadable("an embedding lookup that is not rows of a 2-D table by integer indices")
    row = weight.dims[0]
    if row.index is None or not z3.is_const(row.index):
        raise _Unreadable("an embedding lookup into a table with one row")
    it.obligations.append(z3.And(idx.expr >= 0, idx.expr < row.size))
    return _Val(idx.dims + (weight.dims[1],), z3.substitute(weight.expr, (row.index, idx.expr)), weight.kind)


def _tri(it, n):
    x = it.get(n.args[0])
    diag = n.args[1] if len(n.args) > 1 else 0
    if len(x.dims) < 2:
        raise _Unreadable("tril/triu of a vector")
    di, dj = x.dims[-2], x.dims[-1]
    di = di if di.index is not None else _Dim(it.fresh(di.size), di.size)
    dj = dj if dj.index is not None else _Dim(it.fresh(dj.size), dj.size)
    keep = (dj.index - di.index <= diag) if n.target is aten.tril.default else (dj.index - di.index >= diag)
    zero = z3.BoolVal(False) if x.kind == "bool" else it.cast(it.const(0), x.kind)
    return _Val((*x.dims[:-2], di, dj), z3.If(keep, x.expr, zero), x.kind)


def _diff(it, n):
    """``diff(x, 1, dim, prepend)``: each element minus the one before it (the prepended one first)."""
    a = list(n.args) + [None] * (5 - len(n.args))
    x, order, dim, prepend, append = it.get(a[0]), a[1] or 1, a[2] if a[2] is not None else -1, a[3], a[4]
    if order != 1 or append is not None:
        raise _Unreadable("diff of order > 1 or with append")
    dim %= len(x.dims)
    d = x.dims[dim]
    if d.index is None:  # the same value all along: give the dimension an index to difference over
        d = _Dim(it.fresh(d.size), d.size)
        x = _Val(tuple(d if k == dim else o for k, o in enumerate(x.dims)), x.expr, x.kind)
    if not z3.is_const(d.index):
        raise _Unreadable("diff along a merged dimension")
    size = it.size(n.meta["val"].shape[dim])
    v = it.fresh(size)
    k = "int" if x.kind == "bool" else x.kind
    dims = list(x.dims)
    if prepend is not None:  # one element before the first: out[0] = x[0] - prepend
        bdims, (x, p) = it.unify([x, it.get(prepend)])
        dims = list(bdims)
        xe = it.cast(x, k)
        first = z3.substitute(xe, (d.index, z3.IntVal(0))) - it.cast(p, k)
        e = z3.If(v == 0, first, z3.substitute(xe, (d.index, v)) - z3.substitute(xe, (d.index, v - 1)))
    else:
        xe = it.cast(x, k)
        e = z3.substitute(xe, (d.index, v + 1)) - z3.substitute(xe, (d.index, v))
    dims[dim] = _Dim(v, size)
    return _Val(tuple(dims), e, k)


def _cumsum(it, n):
    """A running sum along a dimension: exact when the summed values are the same all along it."""
    x = it.get(n.args[0])
    dim = n.args[1] % len(x.dims)
    d = x.dims[dim]
    e = it.cast(x, "int") if x.kind == "bool" else x.expr
    if _is_one(d.size):
        return _Val(x.dims, e, "int" if x.kind == "bool" else x.kind)
    if d.index is None:  # the same value all along: the running sum counts
        v = it.fresh(d.size)
        dims = list(x.dims)
        dims[dim] = _Dim(v, d.size)
        return _Val(tuple(dims), e * (v + 1), "int" if x.kind == "bool" else x.kind)
    if not z3.is_const(d.index):
        raise _Unreadable("a running sum along a merged dimension")
    other = it.fresh(d.size)
    if not it.always(z3.substitute(e, (d.index, other)) == e):
        ranks = _run_ranks(it, x, e, d.index)
        if ranks is None:
            ranks = _value_run_sum(it, x, e, d)
        if ranks is None:
            raise _Unreadable("a running sum of values that vary (token- or input-dependent)")
        return _Val(x.dims, ranks, "int" if x.kind == "bool" else x.kind)
    return _Val(x.dims, e * (d.index + 1), "int" if x.kind == "bool" else x.kind)


def _run_interval_count(it, dims: list, e, d: _Dim) -> Any:
    """The sum along ``d`` of 1 on one side of a padding run and 0 elsewhere: the keys before the run
    (Llama 4's left-padding count), in it, or after it."""
    k = d.index
    rows = [o.index for o in dims if o.index is not None and not o.index.eq(k)] + [z3.IntVal(0)]
    for start, end in it.runs.values():
        for r in rows:
            for lo, hi in ((z3.IntVal(0), start(r)), (start(r), end(r)), (end(r), d.size)):
                for one in (z3.IntVal(1), z3.RealVal(1)):
                    if e.sort() == one.sort() and it.always(e == z3.If(z3.And(lo <= k, k < hi), one, 0 * one)):
                        return (hi - lo) if one.is_int() else z3.ToReal(hi - lo)
    return None


def _run_ranks(it, x: _Val, e, k) -> Any:
    """The running count of a padding run's present keys (BLOOM's ALiBi positions from
    ``attention_mask.cumsum(-1)``: 0 before the run, ``k + 1 - start`` in it, its length after), or of
    the keys outside it (pad-aware chunk offsets from ``(1 - attention_mask).cumsum(-1)``)."""
    rows = [d.index for d in x.dims if d.index is not None and not d.index.eq(k)] + [z3.IntVal(0)]
    for start, end in it.runs.values():
        for r in rows:
            inside = z3.And(start(r) <= k, k < end(r))
            present = z3.If(k < start(r), 0, z3.If(k < end(r), k + 1 - start(r), end(r) - start(r)))
            for one in (z3.IntVal(1), z3.RealVal(1)):
                if e.sort() != one.sort():
                    continue
                for counted, count in ((z3.If(inside, one, 0 * one), present),
                                       (z3.If(inside, 0 * one, one), k + 1 - present)):
                    if it.always(e == counted):
                        return count if one.is_int() else z3.ToReal(count)
    return None


def _value_run_sum(it, x: _Val, e, d: _Dim) -> Any:
    """The running sum along ``d`` of a term that token types read as runs (``_Interpreter.value_input``)
    decide. Tried in turn: how many runs began (Gemma-3's image-block ids count "a block starts here"),
    ended, how many positions so far are inside runs or outside them, and in general each piece between
    the runs' boundaries summed (its first value, which may read the position before it, and its other
    values times how many of its positions are counted). A form is accepted only where the solver shows
    that it is the running sum: it starts with the term's first value and grows by the term's value at
    each later position."""
    k = d.index
    rows = [o.index for o in x.dims if o.index is not None and not o.index.eq(k)] + [z3.IntVal(0)]
    real = not e.is_int()
    for spec, bounds, _ in it.values.values():
        if spec.kind != "runs":
            continue
        for r in rows:
            b = bounds(r)
            for total in _run_sum_forms(b, k, e):
                if real:
                    total = z3.ToReal(total) if total.is_int() else total
                at = lambda p, t=total: z3.substitute(t, (k, p))  # noqa: E731
                if it.always(at(z3.IntVal(0)) == z3.substitute(e, (k, z3.IntVal(0)))) and \
                        it.always(z3.Implies(k >= 1, total - at(k - 1) == e)):
                    return total
    return None


def _run_sum_forms(b: list, k, e):
    """Closed forms of a running sum over runs with boundaries ``b = [s_0, e_0, s_1, ...]`` (see
    ``_value_run_sum``), simplest first."""
    starts, ends = b[0::2], b[1::2]
    one, zero = z3.IntVal(1), z3.IntVal(0)
    yield z3.Sum([z3.If(s <= k, one, zero) for s in starts])
    yield z3.Sum([z3.If(t <= k, one, zero) for t in ends])
    inside = z3.Sum([z3.If(k + 1 <= s, zero, z3.If(k + 1 >= t, t - s, k + 1 - s)) for s, t in zip(starts, ends)])
    yield inside
    yield k + 1 - inside
    cuts = [zero, *b]  # non-decreasing; a piece [cuts[i], cuts[i + 1]) may be empty
    total = None
    for i, lo in enumerate(cuts):
        hi = cuts[i + 1] if i + 1 < len(cuts) else None
        first = z3.substitute(e, (k, lo))
        rest = z3.substitute(e, (k, lo + 1))
        has = lo <= k if hi is None else z3.And(lo <= k, lo < hi)
        end = k + 1 if hi is None else z3.If(hi < k + 1, hi, k + 1)
        counted = end - lo - 1  # the piece's positions after its first, up to k
        many = z3.If(counted > 0, counted, 0)
        term = z3.If(has, first, 0 * first) + rest * (many if first.is_int() else z3.ToReal(many))
        total = term if total is None else total + term
    yield total


def _pad(it, n):
    """``pad(x, [lo, hi, ...], "constant", value)``: the padded dims read the value outside the source
    (Gemma-3's "the token before" as a padded, sliced copy)."""
    x = it.get(n.args[0])
    widths = list(n.args[1])
    mode = n.args[2] if len(n.args) > 2 else n.kwargs.get("mode", "constant")
    fill = n.args[3] if len(n.args) > 3 else n.kwargs.get("value", None)
    if n.target is aten.constant_pad_nd.default:
        mode, fill = "constant", (n.args[2] if len(n.args) > 2 else n.kwargs.get("value", 0))
    if mode != "constant" or any(not isinstance(w, int) or w < 0 for w in widths) or len(widths) % 2:
        raise _Unreadable("a padding that is not a constant one of non-negative widths")
    c = it.cast(it.const(0 if fill is None else fill), x.kind)
    dims, e = list(x.dims), x.expr
    out_shape = n.meta["val"].shape
    for a in range(len(widths) // 2):
        dim = len(dims) - 1 - a
        lo, hi = widths[2 * a], widths[2 * a + 1]
        if lo == hi == 0:
            continue
        src = dims[dim]
        size = it.size(out_shape[dim])
        v = it.fresh(size)
        inside = z3.And(v >= lo, v < lo + src.size)
        if src.index is None:
            e = z3.If(inside, e, c)
        elif z3.is_const(src.index):
            e = z3.If(inside, z3.substitute(e, (src.index, v - lo)), c)
        else:
            raise _Unreadable("padding a merged dimension")
        dims[dim] = _Dim(v, size)
    return _Val(tuple(dims), e, x.kind)


def _add_batch_dim(it, n):
    """vmap's ``_add_batch_dim(x, dim, level)``: ``x`` with ``dim`` mapped over at ``level`` (hidden from its
    dims; its index stays in the expression, one index per level)."""
    x, dim, level = it.get(n.args[0]), n.args[1], n.args[2]
    dim %= len(x.dims)
    d = x.dims[dim]
    e = x.expr
    if level in it.levels:
        index, size = it.levels[level]
        if d.index is not None:
            if not z3.is_const(d.index):
                raise _Unreadable("vmap over a merged dimension")
            e = z3.substitute(e, (d.index, index))
        it.facts.append(d.size == size)
    else:
        index = d.index if d.index is not None and z3.is_const(d.index) else it.fresh(d.size)
        if d.index is not None and not z3.is_const(d.index):
            raise _Unreadable("vmap over a merged dimension")
        it.levels[level] = (index, d.size)
    return _Val(tuple(o for k, o in enumerate(x.dims) if k != dim), e, x.kind)


def _remove_batch_dim(it, n):
    """vmap's ``_remove_batch_dim(x, level, size, out_dim)``: the level's dimension back at ``out_dim``."""
    x, level, size, out_dim = it.get(n.args[0]), n.args[1], n.args[2], n.args[3]
    if level in it.levels:
        index, dsize = it.levels.pop(level)
        dim = _Dim(index, dsize)
    else:  # a level nothing was mapped over at: the values do not vary along it
        dim = _Dim(None, it.size(size))
    dims = list(x.dims)
    dims.insert(out_dim % (len(dims) + 1), dim)
    return _Val(tuple(dims), x.expr, x.kind)


def _flat_apply(it, n):
    """``flat_apply`` of the one custom function mask functions call under vmap: Dynamo's ``ModIndex``
    (``x[indices]`` with batched scalar indices), read as an index."""
    func, spec = it.objects.get(n.args[0]), it.objects.get(n.args[1])
    if func is None or spec is None:
        raise _Unreadable("flat_apply of an unknown function")
    fn = torch.utils._pytree.tree_unflatten([], func) if func.num_leaves == 0 else None
    target = getattr(fn, "func", None)
    args, kwargs = torch.utils._pytree.tree_unflatten(list(n.args[2:]), spec)
    if getattr(target, "__name__", "") != "_call_custom_autograd_function_in_pre_dispatch" or kwargs or \
            len(args) != 3 or "ModIndex" not in str(args[0]) or not isinstance(args[2], (list, tuple)):
        raise _Unreadable(f"flat_apply of {getattr(target, '__name__', target)}")
    return _index_values(it, it.get(args[1]), [it.get(a) for a in args[2]])


def _sum(it, n):
    x = it.get(n.args[0])
    dims = n.args[1] if len(n.args) > 1 else list(range(len(x.dims)))
    keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    e = it.cast(x, "int") if x.kind == "bool" else x.expr
    out = list(x.dims)
    for dim in sorted((d % len(x.dims) for d in dims), reverse=True):
        d = x.dims[dim]
        if d.index is not None:
            other = it.fresh(d.size)
            if not z3.is_const(d.index) or not it.always(z3.substitute(e, (d.index, other)) == e):
                count = _run_interval_count(it, out, e, d)
                if count is None:
                    raise _Unreadable("a sum of values that vary along the summed dimension")
                e = count
                if keep:
                    out[dim] = _Dim(None, z3.IntVal(1))
                else:
                    del out[dim]
                continue
        e = e * d.size
        if keep:
            out[dim] = _Dim(None, z3.IntVal(1))
        else:
            del out[dim]
    return _Val(tuple(out), e, "int" if x.kind in ("bool", "int") else x.kind)


def _any_all(fn):
    def handler(it, n):
        x = it.get(n.args[0])
        if x.kind != "bool":
            raise _Unreadable("any/all of non-booleans")
        dims = [n.args[1]] if len(n.args) > 1 and isinstance(n.args[1], int) else \
            list(n.args[1]) if len(n.args) > 1 else list(range(len(x.dims)))
        out = list(x.dims)
        for dim in sorted((d % len(x.dims) for d in dims), reverse=True):
            d = x.dims[dim]
            if d.index is not None:
                other = it.fresh(d.size)
                if not z3.is_const(d.index) or not it.always(z3.substitute(x.expr, (d.index, other)) == x.expr):
                    raise _Unreadable("any/all of values that vary")
            del out[dim]
        return _Val(tuple(out), x.expr, "bool")
    return handler


_IDENTITY = (aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
             aten.detach_.default, aten.lift_fresh_copy.default, aten.lift_fresh.default,
             aten.dropout.default)
_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.to.device, aten.type_as.default)

# vmap's ops (Hugging Face's mask overlays): read symbolically, never folded as constants
_VMAP_OPS = frozenset({_predispatch._add_batch_dim, _predispatch._remove_batch_dim, torch.ops.higher_order.flat_apply})

# ops that make a constant from nothing but their static arguments
_FOLDABLE_SOURCES = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.ones.default,
                     aten.zeros.default, aten.full.default, aten.scalar_tensor.default}

def _size_arith(fn):
    """Python arithmetic on sizes (``SymInt``s the trace kept as nodes)."""
    def handler(it, n):
        x, y = (it.get(a).expr for a in n.args[:2])
        return _Val((), fn(x, y), "int")
    return handler


_HANDLERS: dict[Any, Callable] = {
    operator.add: _size_arith(lambda a, b: a + b), operator.sub: _size_arith(lambda a, b: a - b),
    operator.mul: _size_arith(lambda a, b: a * b), operator.floordiv: _size_arith(lambda a, b: a / b),
    operator.mod: _size_arith(lambda a, b: a % b),
    operator.truediv: lambda it, n: _Val((), it.cast(it.get(n.args[0]), "float") / it.cast(it.get(n.args[1]), "float"),
                                         "float"),
    torch.sym_float: lambda it, n: _Val((), it.cast(it.get(n.args[0]), "float"), "float"),
    torch.sym_max: _size_arith(lambda a, b: z3.If(a >= b, a, b)),
    torch.sym_min: _size_arith(lambda a, b: z3.If(a <= b, a, b)),
    **{t: _same for t in _IDENTITY},
    **{t: _cast for t in _CASTS},
    aten._assert_tensor_metadata.default: lambda it, n: None,
    aten.sym_size.int: _sym_size,
    aten.arange.default: _arange, aten.arange.start: _arange, aten.arange.start_step: _arange,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.default: _squeeze, aten.squeeze.dim: _squeeze, aten.squeeze.dims: _squeeze,
    aten.expand.default: _expand,
    aten.view.default: _view, aten.reshape.default: _view, aten._unsafe_view.default: _view,
    aten.slice.Tensor: _slice, aten.select.int: _select,
    aten.permute.default: _permute, aten.transpose.int: _permute, aten.t.default: _permute,
    aten.add.Tensor: _arith("+"), aten.add.Scalar: _arith("+"), aten.sub.Tensor: _arith("-"),
    aten.sub.Scalar: _arith("-"), aten.mul.Tensor: _arith("*"), aten.mul.Scalar: _arith("*"),
    aten.rsub.Scalar: _arith("r-"), aten.rsub.Tensor: _arith("r-"),
    aten.div.Tensor: _arith("/"), aten.div.Scalar: _arith("/"),
    aten.floor_divide.default: _floordiv, aten.div.Tensor_mode: _floordiv, aten.div.Scalar_mode: _floordiv,
    aten.remainder.Tensor: _remainder, aten.remainder.Scalar: _remainder,
    **{t: _compare(op) for op, ts in {
        "<": (aten.lt.Tensor, aten.lt.Scalar), "<=": (aten.le.Tensor, aten.le.Scalar),
        ">": (aten.gt.Tensor, aten.gt.Scalar), ">=": (aten.ge.Tensor, aten.ge.Scalar),
        "==": (aten.eq.Tensor, aten.eq.Scalar), "!=": (aten.ne.Tensor, aten.ne.Scalar)}.items() for t in ts},
    aten.__and__.Tensor: _logic(lambda a, b: z3.And(a, b)), aten.bitwise_and.Tensor: _logic(lambda a, b: z3.And(a, b)),
    aten.logical_and.default: _logic(lambda a, b: z3.And(a, b)),
    aten.__or__.Tensor: _logic(lambda a, b: z3.Or(a, b)), aten.bitwise_or.Tensor: _logic(lambda a, b: z3.Or(a, b)),
    aten.logical_or.default: _logic(lambda a, b: z3.Or(a, b)),
    aten.bitwise_xor.Tensor: _logic(lambda a, b: z3.Xor(a, b)), aten.logical_xor.default: _logic(lambda a, b: z3.Xor(a, b)),
    aten.bitwise_not.default: _not, aten.logical_not.default: _not,
    aten.neg.default: _neg, aten.abs.default: _abs,
    aten.minimum.default: _minmax(lambda a, b: a <= b), aten.maximum.default: _minmax(lambda a, b: a >= b),
    aten.min.other: _minmax(lambda a, b: a <= b), aten.max.other: _minmax(lambda a, b: a >= b),
    aten.clamp.default: _clamp, aten.clamp_min.default: _clamp, aten.clamp_max.default: _clamp,
    aten.where.self: _where, aten.where.ScalarOther: _where, aten.where.ScalarSelf: _where, aten.where.Scalar: _where,
    aten.masked_fill.Scalar: _masked_fill, aten.masked_fill.Tensor: _masked_fill,
    aten.masked_fill_.Scalar: _masked_fill, aten.masked_fill_.Tensor: _masked_fill,
    **{t: _filled for t in (aten.new_ones.default, aten.ones.default, aten.ones_like.default, aten.new_zeros.default,
                            aten.zeros.default, aten.zeros_like.default, aten.full.default, aten.full_like.default,
                            aten.new_full.default, aten.scalar_tensor.default)},
    aten.index.Tensor: _index, aten.embedding.default: _embedding,
    **{getattr(aten, f).default: _opaque(f) for f in ("log", "log2", "log10", "log1p", "exp", "sqrt", "rsqrt",
                                                      "sigmoid", "tanh", "sin", "cos", "erf")},
    aten.tril.default: _tri, aten.triu.default: _tri,
    aten.diff.default: _diff, aten.cumsum.default: _cumsum,
    aten.pad.default: _pad, aten.constant_pad_nd.default: _pad,
    _predispatch._add_batch_dim: _add_batch_dim, _predispatch._remove_batch_dim: _remove_batch_dim,
    torch.ops.higher_order.flat_apply: _flat_apply,
    aten.sum.dim_IntList: _sum, aten.sum.default: _sum,
    aten.any.dim: _any_all(z3.Or), aten.any.dims: _any_all(z3.Or), aten.all.dim: _any_all(z3.And),
}


# ------------------------------------------------------------------------------ the formula


@dataclass
class MaskFormula:
    """A site's combined mask as a formula over score indices ``b, h, i, j`` (batch row, head, query
    row, key column) and sizes ``B, H, S, L``: ``allowed`` (the key is seen) and ``bias`` (what is added
    to a seen score), valid where ``facts`` hold."""

    facts: list
    b: Any
    h: Any
    i: Any
    j: Any
    B: Any
    H: Any
    S: Any
    L: Any
    allowed: Any
    bias: Any  # z3 Real; 0 without additive terms
    padding: dict  # input name -> z3 Bool "key j of row b is present" (keep-when-true reading)
    positions: list  # position inputs the program reads
    run_starts: dict = field(default_factory=dict)  # padding input -> its run's first key in row b
    # input read as per-request values -> (its ValueSpec, row -> that row's values, the row functions)
    values: dict = field(default_factory=dict)
    tables: dict = field(default_factory=dict)  # z3 function name -> the constant table it stands for
    float_dtype: torch.dtype = torch.float32  # what the program computes floats in

    @property
    def q_pos(self):
        """The query's position: queries are the last S of L positions."""
        return self.i + (self.L - self.S)

    def holds(self, claim, *assume) -> tuple[Optional[bool], Any]:
        """(True, None) when ``claim`` holds wherever the facts (and ``assume``) do; (False, model) with a
        counterexample; (None, reason) when the solver gives up."""
        s = z3.Solver()
        s.set("timeout", _TIMEOUT_MS)
        s.add(*self.facts, *assume)
        s.add(z3.Not(claim))
        r = s.check()
        if r == z3.unsat:
            return True, None
        if r == z3.sat:
            return False, s.model()
        return None, s.reason_unknown()

    def minimize(self, term, *where) -> Optional[int]:
        """The least value of ``term`` over the indices and sizes where the facts and ``where`` hold."""
        o = z3.Optimize()
        o.set("timeout", _TIMEOUT_MS)
        o.add(*self.facts, *where)
        o.minimize(term)
        if o.check() != z3.sat:
            return None
        v = o.model().eval(term, model_completion=True)
        return v.as_long() if z3.is_int_value(v) else None

    def maximize(self, term) -> Optional[int]:
        """The largest value of ``term`` (None: unbounded, or the solver gave up)."""
        o = z3.Optimize()
        o.set("timeout", _TIMEOUT_MS)
        o.add(*self.facts)
        h = o.maximize(term)
        if o.check() != z3.sat:
            return None
        v = o.upper(h)
        return v.as_long() if z3.is_int_value(v) else None


def read_mask(gm: GraphModule, site: AttentionSite, roles: dict[str, str], constants: dict[str, torch.Tensor],
              max_length: Optional[int] = None, keys_present: bool = False, prefix: str = "i") -> MaskFormula:
    """Interpret the site's mask and bias terms. ``roles`` says what each placeholder the terms read by
    value is ("padding", "positions", "constant"); ``keys_present`` reads padding inputs as all ones
    (the mask's position-only part). Raises :class:`NotEstablished` when the program is unreadable."""
    if z3 is None:
        raise NotEstablished("proving masks needs z3 (pip install z3-solver)")
    terms = [n for n, _ in site.biases] + [n for n, _ in site.conds] + [n for n, _, _ in site.factors]
    module, inputs = extract_program(gm, terms)
    inner_roles = dict(roles)
    if keys_present == "runs":  # padding inputs whose present keys are one run per row
        inner_roles = {k: ("padding_runs" if r == "padding" else r) for k, r in roles.items()}
    elif keys_present:  # True: present as 1/True; "false": a boolean input whose True means "ignore"
        present = "present_false" if keys_present == "false" else "present"
        inner_roles = {k: (present if r == "padding" else r) for k, r in roles.items()}
    it = _Interpreter(module, inner_roles, constants, prefix)
    try:
        outs = it.run(list(next(n for n in module.graph.nodes if n.op == "output").args[0]))
    except _Unreadable as e:
        raise NotEstablished(f"the mask program cannot be read for every length: {e}") from None
    q, k = site.query.meta["val"], site.key.meta["val"]
    B, H, S, L = it.size(q.shape[0]), z3.IntVal(int(site.num_heads)), it.size(q.shape[2]), it.size(k.shape[2])
    b, h, i, j = it.fresh(B), it.fresh(H), it.fresh(S), it.fresh(L)
    it.facts += [S <= L, L < _MAX_POSITIONS]
    if max_length is not None:
        it.facts.append(L <= max_length)
    nb, nc = len(site.biases), len(site.conds)
    masks, bias = [], z3.RealVal(0)
    for (_node, factor), v in zip(site.biases, outs[:nb]):
        e = _aligned(it, v, b, h, i, j, B, H, S, L)
        e = it.cast(_Val((), e, v.kind), "float")
        if it.always(z3.Or(e == 0, e <= MASK_LIMIT)):  # a pure mask: 0 or a large negative value
            masks.append(e > MASK_LIMIT)
            continue
        # a bias: only -inf / the dtype's minimum masks (a bias of -1e4 far from the query is a value)
        masks.append(e > _NEG / 10)
        bias = bias + z3.If(e > _NEG / 10, e * z3.RealVal(float(factor)), z3.RealVal(0))
    for (_node, keep_when_true), v in zip(site.conds, outs[nb:nb + nc]):
        e = it.cast(_Val((), _aligned(it, v, b, h, i, j, B, H, S, L), v.kind), "bool")
        masks.append(e if keep_when_true else z3.Not(e))
    traced_length = k.shape[2].node.hint if isinstance(k.shape[2], torch.SymInt) else k.shape[2]
    it.facts += _length_bound(it.facts, it.obligations, L, int(traced_length))
    _check_example(it.facts, (B, S, L), (q.shape[0], q.shape[2], k.shape[2]))
    _check_coverage(it.facts, b, h, i, j, B, H, S, L)
    formula = MaskFormula(it.facts, b, h, i, j, B, H, S, L, z3.And(masks) if masks else z3.BoolVal(True),
                          bias, {}, list(it.positions), tables=dict(it.tables),
                          float_dtype=torch.float64 if torch.float64 in it.float_dtypes else torch.float32)
    for (_node, after_b, after_c), v in zip(site.factors, outs[nb + nc:]):
        f = it.cast(_Val((), _aligned(it, v, b, h, i, j, B, H, S, L), v.kind), "float")
        later = masks[:after_b] + masks[nb:nb + after_c]
        ok, _ = formula.holds(z3.And(z3.Or(f == 0, f == 1), z3.Implies(f == 0, z3.Not(z3.And(later)) if later
                                                                           else z3.BoolVal(False))))
        if not ok:
            raise NotEstablished("the scores are multiplied by a tensor that is not a 0/1 mask whose zeros a later "
                                 "term masks (zero is a score, not a mask)")
    for name, present in it.padding.items():
        formula.padding[name] = present(b, j)
    for name, (start, _) in it.runs.items():
        formula.run_starts[name] = start(b)
    formula.values = dict(it.values)
    return formula


def _length_bound(facts: list, obligations: list, L, traced_length: int) -> list:
    """What the program's lookups staying inside their tensors asks of the sizes: nothing when that holds
    everywhere; else ``L <= n`` for the largest such ``n`` when a length bound is what it takes (the
    program fails past it); else the lookups themselves, as conditions the sizes of a valid call meet
    (a batch index of one input reading another's rows: the two batch sizes agree at run time; a key
    index reading a mask input whose length is its own size), also when a bound would exclude the
    ``traced_length`` the program ran at.
    ``_check_coverage`` then makes sure no query, key, row or head is left out."""
    if not obligations:
        return []
    need = z3.And(obligations)

    def fine_up_to(n: Optional[int]) -> bool:
        s = z3.Solver()
        s.set("timeout", _TIMEOUT_MS)
        s.add(*facts, z3.Not(need))
        if n is not None:
            s.add(L <= n)
        return s.check() == z3.unsat

    if fine_up_to(None):
        return []
    lo, hi = 0, _MAX_POSITIONS
    while lo < hi:  # the largest n that is fine
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fine_up_to(mid) else (lo, mid - 1)
    if lo >= max(traced_length, 1):
        return [L <= lo]
    return list(obligations)


def _check_example(facts: list, sizes: tuple, traced: tuple) -> None:
    """The sizes the model was traced at ran the program: a reading that excludes them is wrong."""
    hints = [int(t.node.hint) if isinstance(t, torch.SymInt) else int(t) for t in traced]
    s = z3.Solver()
    s.set("timeout", _TIMEOUT_MS)
    s.add(*facts, *[z == v for z, v in zip(sizes, hints)])
    if s.check() == z3.unsat:
        raise NotEstablished(f"the mask program's reading excludes the sizes it was traced at {tuple(hints)}")


def _check_coverage(facts: list, b, h, i, j, B, H, S, L) -> None:
    """Refuse a reading whose facts leave out some queries, keys, rows or heads: a proof would say nothing
    about them. At the longest length the program runs at (or a very long one), the first and last of
    each must be reachable."""
    o = z3.Optimize()
    o.set("timeout", _TIMEOUT_MS)
    o.add(*facts)
    top = o.maximize(L)
    if o.check() != z3.sat:
        raise NotEstablished("the mask program runs at no length at all")
    upper = o.upper(top)
    longest = upper.as_long() if z3.is_int_value(upper) else 2 ** 20
    corners = [(i == S - 1, j == L - 1), (i == S - 1, j == 0), (i == 0, j == 0), (b == B - 1,), (h == H - 1,),
               (b == 0, h == 0)]
    for corner in corners:
        s = z3.Solver()
        s.set("timeout", _TIMEOUT_MS)
        s.add(*facts, L == longest, *corner)
        if s.check() == z3.unsat:
            raise NotEstablished(f"the mask program's indices do not cover every query, key, row and head at "
                                 f"{longest} keys")


def _aligned(it: _Interpreter, v: _Val, b, h, i, j, B, H, S, L):
    """A term's expression at score indices (b, h, i, j): its dims laid right-aligned over
    ``[B, H, S, L]`` (or ``[B*H, S, L]`` for scores of a 3-D bmm)."""
    dims = list(v.dims)
    if len(dims) > 4:
        raise NotEstablished(f"a mask term of {len(dims)} dimensions")
    targets = [(i, S), (j, L)]
    lead = dims[:-2] if len(dims) >= 2 else []
    tail = dims[-2:] if len(dims) >= 2 else [None] * (2 - len(dims)) + dims
    for d, (idx, size) in zip(tail, targets):
        if d is None or _is_one(d.size):
            continue
        it.facts.append(d.size == size)  # the term broadcasts over the scores only at their own size
        if d.index is not None:
            it.facts.append(d.index == idx)
    if len(lead) == 2:
        for d, (idx, size) in zip(lead, ((b, B), (h, H))):
            if d.index is not None and not _is_one(d.size):
                it.facts += [d.index == idx, d.size == size]
    elif len(lead) == 1 and lead[0].index is not None and not _is_one(lead[0].size):
        d = lead[0]
        for idx, size in ((b * H + h, B * H), (b, B), (h, H)):
            s = z3.Solver()
            s.add(*it.facts, d.size != size)
            if s.check() == z3.unsat:
                it.facts.append(d.index == idx)
                break
        else:
            raise NotEstablished("a mask term's leading dimension fits neither batch, heads nor both")
    return v.expr


# ----------------------------------------------------------------------------- the kinds


@dataclass(frozen=True)
class MaskKind:
    """What a proof established: the kind (none, causal, sliding_window, chunked), its parameter, the
    padding input and its convention, ALiBi slopes, and the longest key length the proof covers."""

    kind: str
    window: Optional[int] = None
    chunk: Optional[int] = None
    key_padding: Optional[str] = None
    padding_keeps_true: bool = True  # False: True means "ignore" (nn.MultiheadAttention's convention)
    alibi: Optional[torch.Tensor] = None
    up_to: Optional[int] = None  # None: every length
    positions: tuple = ()
    how: str = "proof"
    padding_runs: bool = False  # established for padding whose present keys are one run per row
    positions_from_first_key: bool = False  # with padding, positions count from the run's first key
    position_mod: str = ""  # kind "positional": the program kernels evaluate (pagedattn.backends.position_mod)
    position_tables: Optional[torch.Tensor] = None
    values_input: Optional[str] = None  # the input the program reads per-request values from (token types)
    later_keys: bool = False  # a position program that may let a query see a later key: paged mode refuses it


def establish(read: Callable[[Any, str], MaskFormula], padding_inputs: Sequence[str]) -> MaskKind:
    """Prove the kind of mask for every length the program accepts, else raise NotEstablished.

    ``read(keys_present, prefix)`` reads the site's mask program (see :func:`read_mask`).
    """
    present = True
    f = read(True, "p")
    try:
        kind, window, chunk = _position_kind(f)
    except NotEstablished:
        if not padding_inputs:
            raise
        # boolean padding inputs whose True means "ignore this key" (nn.MultiheadAttention's convention)
        present = "false"
        f = read(present, "p")
        kind, window, chunk = _position_kind(f)
    r = read(present, "r")  # a second reading, to compare two keys of one row
    alibi = _alibi(f, r)
    key_padding, keeps_true, runs, relative = None, True, False, False
    if padding_inputs:
        # padding as any pattern of present keys; else as one run per row (left or right padding), which
        # running counts of the padding (BLOOM's positions) need: calls are then held to such padding
        try:
            d, e, mode = read(False, "d"), read(False, "e"), False
        except NotEstablished as first:
            try:
                d, e, mode = read("runs", "d"), read("runs", "e"), "runs"
            except NotEstablished as second:
                raise NotEstablished(f"its padding input is read in a way that cannot be established: {first}; "
                                     f"as left or right padding: {second}") from None
        key_padding, keeps_true, relative = _padding(d, padding_inputs, kind, window, chunk)
        _padding_keeps_bias(d, e, f, r, key_padding)
        runs = mode == "runs"
    longest = f.maximize(f.L)
    up_to = None if longest is None or longest >= _MAX_POSITIONS - 1 else longest
    return MaskKind(kind, window, chunk, key_padding, keeps_true, alibi, up_to, tuple(f.positions),
                    padding_runs=runs, positions_from_first_key=relative)


def _visible(kind: str, q, k, window=None, chunk=None):
    if kind == "none":
        return z3.BoolVal(True)
    out = k <= q
    if window:
        out = z3.And(out, q - k < window)
    if chunk:
        out = z3.And(out, q / chunk == k / chunk)
    return out


def _describe(f: MaskFormula, model, expected) -> str:
    ev = lambda x: model.eval(x, model_completion=True)  # noqa: E731
    seen = z3.is_true(ev(f.allowed))
    return (f"at query position {ev(f.q_pos)} and key position {ev(f.j)} ({ev(f.L)} keys, {ev(f.S)} queries) the "
            f"mask {'lets the key be seen' if seen else 'hides the key'}")


def _position_kind(f: MaskFormula) -> tuple[str, Optional[int], Optional[int]]:
    q, k = f.q_pos, f.j
    ok, model = f.holds(f.allowed == _visible("causal", q, k))
    if ok:
        return "causal", None, None
    if ok is None:
        raise NotEstablished(f"the solver could not establish the mask ({model})")
    causal_cx = _describe(f, model, None)
    ok, _ = f.holds(f.allowed)
    if ok and f.maximize(f.S) != 1:
        return "none", None, None
    # a key the causal mask shows but this one hides, as near the query as possible: the window
    w = f.minimize(q - k, k <= q, z3.Not(f.allowed))
    if w is not None and w >= 1 and f.holds(f.allowed == _visible("causal", q, k, window=w))[0]:
        return "sliding_window", w, None
    # the first query that cannot see the key right before it: where the second chunk starts
    c = f.minimize(q, k == q - 1, q >= 1, z3.Not(f.allowed))
    if c is not None and c >= 1:
        if f.holds(f.allowed == _visible("causal", q, k, chunk=c))[0]:
            return "chunked", None, c
        if w is not None and w >= 1 and f.holds(f.allowed == _visible("causal", q, k, window=w, chunk=c))[0]:
            return "chunked", w, c
    raise NotEstablished(f"the mask is neither causal, a sliding window, chunked nor absent: {causal_cx} "
                         "where causal attention would do the opposite")


def _alibi(f: MaskFormula, other: MaskFormula) -> Optional[torch.Tensor]:
    """Per-head slopes when the bias is ``slope * (key - query)`` plus anything constant per row, on every
    seen key; None without a bias. ``other`` is a second reading of the same program (its own index
    variables), so that two keys of one query row can be compared. Refuses any other bias."""
    expected = _visible_of(f)
    if f.holds(f.bias == 0, expected)[0]:
        return None
    row = [f.b == other.b, f.h == other.h, f.i == other.i, f.S == other.S, f.L == other.L]
    both_seen = [expected, _visible_of(other)]
    slopes = [_slope(f, other, head, row, both_seen) for head in range(f.H.as_long())]
    for head, slope in enumerate(slopes):
        # one head at a time, its index a constant in the claim: tables of per-head values then fold away
        # and the claim stays linear
        pin = [(f.h, z3.IntVal(head)), (other.h, z3.IntVal(head))]
        claim = z3.simplify(z3.substitute(f.bias - other.bias - slope * z3.ToReal(f.j - other.j), *pin)) == 0
        ok, model = f.holds(claim, f.h == head, *other.facts, *row, *both_seen)
        if not ok:
            where = _describe(f, model, None) if ok is False else f"the solver gave up ({model})"
            raise NotEstablished(f"the additive bias is not ALiBi (a slope per head times the distance) for "
                                 f"every length: {where}")
    return torch.tensor([_float(v) for v in slopes], dtype=torch.float32)


def _slope(f: MaskFormula, other: MaskFormula, head: int, row: list, both_seen: list):
    """The bias difference between two adjacent seen keys of one row of ``head``."""
    s = z3.Solver()
    s.set("timeout", _TIMEOUT_MS)
    s.add(*f.facts, *other.facts, *row, *both_seen, f.h == head, f.j == other.j + 1)
    if s.check() != z3.sat:
        raise NotEstablished("the additive bias has no two adjacent seen keys to read a slope from")
    m = s.model()
    return m.eval(f.bias - other.bias, model_completion=True)


def _float(v) -> float:
    if z3.is_rational_value(v):
        return float(v.numerator_as_long()) / float(v.denominator_as_long())
    return float(v.as_decimal(20).rstrip("?"))


def _visible_of(f: MaskFormula):
    """The mask's own seen keys (the bias matters only there)."""
    return f.allowed


def _padding_keeps_bias(d: MaskFormula, e: MaskFormula, f: MaskFormula, r: MaskFormula, name: str) -> None:
    """With padding, the bias between two seen keys of a row differs as it does with every key present
    (``f``, ``r``): only a constant per row may change, which softmax ignores. ``d`` and ``e`` are two
    readings with the padding as data, sharing its values."""
    row = []
    for a in (e, f, r):
        row += [a.b == d.b, a.h == d.h, a.i == d.i, a.B == d.B, a.S == d.S, a.L == d.L]
    seen = [d.allowed, e.allowed, d.padding[name], e.padding[name], f.j == d.j, r.j == e.j]
    ok, model = d.holds((d.bias - e.bias) == (f.bias - r.bias), *e.facts, *f.facts, *r.facts, *row, *seen)
    if not ok:
        where = _describe(d, model, None) if ok is False else f"the solver gave up ({model})"
        raise NotEstablished(f"the additive bias changes with the padding input {name!r} other than by a constant "
                             f"per row: {where}")


def _padding(f: Optional[MaskFormula], names: Sequence[str], kind, window, chunk) -> tuple[str, bool, bool]:
    """The key-padding input, its convention and where positions count from: with it read as data, the
    mask must be the position-only mask and the input's keys (True/nonzero = keep, or for booleans True =
    ignore), positions counted from 0, or (read as one run per row) from the run's first key, as
    Hugging Face's chunked masks count them under left padding."""
    if f is None:
        raise NotEstablished("the mask's dependence on its padding input cannot be read")
    gave_up = None
    for name in names:
        present = f.padding.get(name)
        if present is None:
            continue
        start = f.run_starts.get(name)
        origins = [(False, z3.IntVal(0))] + ([(True, start)] if start is not None and chunk else [])
        for relative, origin in origins:
            expected = _visible(kind, f.q_pos - origin, f.j - origin, window, chunk)
            for keeps_true, term in ((True, present), (False, z3.Not(present))):
                ok, why = f.holds(f.allowed == z3.And(expected, term))
                if ok:
                    return name, keeps_true, relative
                gave_up = why if ok is None else gave_up
    if gave_up is not None:
        raise NotEstablished(f"the mask's dependence on input {names[0]!r} could not be established (the solver gave "
                             f"up: {gave_up}; a product of the padding and positions, say)")
    raise NotEstablished(f"the mask depends on input {names[0]!r} in a way that is not key padding")
