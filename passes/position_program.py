"""A mask program proven to depend on positions only, turned into a position program the kernels evaluate.

When a site's mask or bias is none of the kinds with their own kernels (causal, window, chunks, ALiBi)
:func:`position_program` tries the generic path:

1. *Proof*: two readings of the program (``mask_program.read_mask``) with their own indices, sizes,
   rows and position offsets, agreeing only on the query position, the key position and (for the
   bias) the head, must give the same mask and the same bias on seen keys, for every length the
   program accepts. Then the mask is a function ``allowed(q, k)`` and the bias ``bias(h, q, k)``:
   nothing else (the batch row, how many queries the call had, an offset in ``position_ids``, the
   length) changes them.
2. *Program*: the reading's formula, with every index the facts tie to a query row, key column or head
   replaced by it and evaluated where queries and keys are the same positions (as many queries as
   keys: the query at row ``q`` is at position ``q``), is compiled into the JSON program of
   :mod:`pagedattn.backends.position_mod`: integer arithmetic exactly, floats in the dtype the model
   computed them in, float functions the proofs kept opaque (``log``) by name, constant tables as
   lookups.

What is refused: a mask or bias that depends on anything else (shown by a counterexample), a mask that
may hide every key of a query row (its own key, the first and the last are the witnesses sought), a mask that
differs per head, programs read only at one query (single-token graphs), tables of unknown values
larger than ``_MAX_TABLE`` elements.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

import torch

from pagedattn.backends.position_mod import FUNCTIONS
from pagedattn.passes.mask_program import MaskFormula, NotEstablished

try:
    import z3
except ImportError:  # pragma: no cover - mask_program refuses first
    z3 = None

__all__ = ["position_program", "program_padding", "prove_spans", "sees_later_keys"]

_MAX_TABLE = 1 << 22  # elements of constant tables a program may carry
_MIN_CHAIN = 3  # if-then-else chains over one index at least this long become table lookups


def position_program(read: Callable[[Any, str], MaskFormula], present: Any = True
                     ) -> tuple[str, Optional[torch.Tensor], MaskFormula, tuple]:
    """The site's mask and bias as a position program (JSON) and its tables, with the reading it was compiled
    from (its facts bound the lengths it holds for) and the program's ``(allowed, bias)`` terms in that
    reading's query row, key and head; or NotEstablished. ``present`` is how padding inputs are read
    (``read_mask``'s ``keys_present``: every key present, in either convention)."""
    f, g = read(present, "ga"), read(present, "gb")
    _prove_positions_only(f, g)
    allowed, bias = _bound(f)
    _prove_rows_keep_a_key(f, allowed)
    return (*_Compiler(f).build(allowed, bias), f, (allowed, bias))


def _prove_rows_keep_a_key(f: MaskFormula, allowed) -> None:
    """Every query row sees at least one key, for every length: a row that hides them all is no softmax over
    its seen keys (the model spreads it over every key when the fill is finite, -1e4 or the dtype's minimum,
    or gives NaN with -inf), which no kernel here reproduces. Shown by a witness per row: the query's own key,
    the first or the last key (``allowed`` is ``_bound``'s, over the row, the key and the counts alone). A bias
    hides a key only at -1e29 or below (a learned table's entries are clamped to their range where read; a
    logarithm is bounded by :func:`_log_ranges`)."""
    claim = z3.Or([z3.substitute(allowed, (f.j, w)) for w in (f.q_pos, z3.IntVal(0), f.L - 1)])
    ok, model = f.holds(claim, *_log_ranges(claim))
    if ok:
        return
    if ok is None:
        raise NotEstablished(f"the solver could not establish that every query row sees a key ({model})")
    ev = lambda x: model.eval(x, model_completion=True)  # noqa: E731
    raise NotEstablished(
        f"a query row may hide every key (query position {ev(f.q_pos)} of {ev(f.L)} keys hides its own, the first "
        "and the last): the model's softmax there runs over every key with the fill value (or gives NaN), which no "
        "cache can serve")


# logarithms are at most their argument where they are not negative (log1p from 0, the others from 1)
_LOG_FROM = {"op_log": 1, "op_log2": 1, "op_log10": 1, "op_log1p": 0}


def _log_ranges(e) -> list:
    """A true fact about each logarithm applied in ``e`` (which the mask reading keeps opaque): at or past its sign
    split it is at most its argument. Stated per application (no quantifiers)."""
    facts, seen, stack = [], set(), [e]
    while stack:
        x = stack.pop()
        if x.get_id() in seen:
            continue
        seen.add(x.get_id())
        if z3.is_app(x):
            if x.decl().name() in _LOG_FROM and x.num_args() == 1:
                a = x.arg(0)
                facts.append(z3.Implies(a >= _LOG_FROM[x.decl().name()], z3.And(x <= a, -x <= a)))
            stack.extend(x.children())
    return facts


def program_padding(read: Callable[[Any, str], MaskFormula], f: MaskFormula, terms: tuple, names: list[str]
                    ) -> tuple[str, bool, bool, bool]:
    """Key padding beside a position program: ``(input, keeps_true, one_run_per_row, positions_from_first_key)``.

    With the padding input read as data (any pattern of present keys, else one run per row), the mask must be
    the program's mask and the input's keys (either convention), and the bias the program's on every seen key,
    the program's positions counted from 0 or (one run per row) from the run's first key. Programs reading the
    sequence's length are refused: under padding, which length the model means is not established here."""
    allowed, bias = terms  # position_program's, over f's indices
    sizes = _consts([f.S, f.L])
    if any(name in sizes for name in _consts([allowed, bias])):
        raise NotEstablished("a position program that reads the sequence's length, beside key padding")
    gave_up, unread = None, []
    for mode in (False, "runs"):
        try:
            d = read(mode, "pd")
        except NotEstablished as e:
            unread.append(str(e))
            continue
        for name in names:
            found, why = _padding_beside(d, allowed, bias, f, name)
            if found is not None:
                return (name, found[0], mode == "runs", found[1])
            gave_up = why or gave_up
    if gave_up is not None:
        raise NotEstablished(f"the position program beside key padding could not be established (the solver gave "
                             f"up: {gave_up})")
    if len(unread) == 2:
        raise NotEstablished(f"its padding input is read in a way that cannot be established: {unread[0]}; as left "
                             f"or right padding: {unread[1]}")
    raise NotEstablished(f"the mask depends on input {names[0]!r} in a way that is not key padding beside the "
                         "position program")


def _padding_beside(d: MaskFormula, allowed, bias, f: MaskFormula, name: str) -> tuple[Optional[tuple], Any]:
    """``((keeps_true, positions_from_first_key), None)`` when reading ``d`` is the program beside padding
    input ``name``; else ``(None, why the solver gave up or None)``."""
    present = d.padding.get(name)
    if present is None:
        return None, None
    start = d.run_starts.get(name)
    gave_up = None
    # per-request values are read by column: positions counted from a run's first key would not index them
    relative_ok = start is not None and not d.values
    for relative, origin in [(False, z3.IntVal(0))] + ([(True, start)] if relative_ok else []):
        sub = [(f.i, d.q_pos - origin), (f.j, d.j - origin), (f.h, d.h), (f.b, d.b)]
        p_allowed, p_bias = z3.substitute(allowed, *sub), z3.substitute(bias, *sub)
        for keeps_true, term in ((True, present), (False, z3.Not(present))):
            ok, why = d.holds(z3.And(d.allowed == z3.And(p_allowed, term), z3.Implies(d.allowed, d.bias == p_bias)))
            if ok:
                return (keeps_true, relative), None
            gave_up = why if ok is None else gave_up
    return None, gave_up


# ----------------------------------------------------------------------------- the proof


def _consts(exprs) -> dict:
    """The free constants (0-ary uninterpreted symbols) of some expressions, by name."""
    out, seen, stack = {}, set(), list(exprs)
    while stack:
        e = stack.pop()
        if e.get_id() in seen:
            continue
        seen.add(e.get_id())
        if _is_symbol(e):
            out[e.decl().name()] = e
        stack.extend(e.children())
    return out


def _renamed(g: MaskFormula, prefix: str) -> tuple[list, dict]:
    """``g``'s facts and terms with its sizes renamed apart (index variables carry the reading's prefix
    already; size symbols are shared by name between readings)."""
    terms = {"b": g.b, "h": g.h, "i": g.i, "j": g.j, "S": g.S, "L": g.L, "allowed": g.allowed, "bias": g.bias}
    sizes = [c for name, c in _consts(list(g.facts) + list(terms.values())).items() if not name.startswith(prefix)]
    sub = [(c, z3.Int(f"{c.decl().name()}_{prefix}")) for c in sizes if c.sort() == z3.IntSort()]
    if not sub:
        return list(g.facts), terms
    return [z3.substitute(x, *sub) for x in g.facts], {k: z3.substitute(v, *sub) for k, v in terms.items()}


def _prove_positions_only(f: MaskFormula, g: MaskFormula) -> None:
    facts, t = _renamed(g, "gb")
    g_qpos = t["i"] + (t["L"] - t["S"])
    same_place = [f.q_pos == g_qpos, f.j == t["j"]]
    # per-request values (token types, a prefix length): the same request's, whichever row it is in
    same_place += [fn(f.b) == fn(t["b"]) for _, _, fns in f.values.values() for fn in fns]
    claim = z3.And(f.allowed == t["allowed"], z3.Implies(z3.And(f.h == t["h"], f.allowed), f.bias == t["bias"]))
    ok, model = f.holds(claim, *facts, *same_place)
    if ok:
        return
    if ok is None:
        raise NotEstablished(f"the solver could not establish that the mask depends on positions only ({model})")
    ev = lambda x: model.eval(x, model_completion=True)  # noqa: E731
    what = "the head and its request's values" if f.values else "the head"
    raise NotEstablished(
        f"the mask or bias depends on more than the query and key positions and {what}: at query position "
        f"{ev(f.q_pos)} and key position {ev(f.j)} it differs between {ev(f.L)} and {ev(t['L'])} keys (or between "
        "rows, or with the positions' offset)")


def sees_later_keys(f: MaskFormula) -> bool:
    """Whether some query may see a later key (True unless the solver proves that none does). A KV cache cannot
    serve such a site: a key's K/V are cached before any later token exists (a prefix-LM's spans, computed in one
    step, are proven apart by :func:`prove_spans`); the drop-in, which sees the whole sequence, can."""
    ok, _ = f.holds(z3.Implies(f.allowed, f.j <= f.q_pos))
    return not ok


def prove_spans(f: MaskFormula) -> None:
    """A mask over per-request values lets a query see later keys only inside its own span (a prefix, an
    image block), so that a span computed in one step holds every key its queries see, and tokens appended
    after the spans (generated ones) are seen by no earlier query. NotEstablished otherwise."""
    ((name, (spec, bounds, _)),) = f.values.items()
    b = bounds(f.b)
    q, k = f.q_pos, f.j
    pairs = [(z3.IntVal(0), b[0])] if spec.kind == "scalar" else \
        [(b[2 * r], b[2 * r + 1]) for r in range(spec.runs)]
    inside = z3.Or([z3.And(lo <= q, q < hi, lo <= k, k < hi) for lo, hi in pairs])
    ok, model = f.holds(z3.Implies(z3.And(f.allowed, k > q), inside))
    if ok:
        return
    if ok is None:
        raise NotEstablished(f"the solver could not establish which later keys a query sees ({model})")
    ev = lambda x: model.eval(x, model_completion=True)  # noqa: E731
    where = ", ".join(f"[{ev(lo)}, {ev(hi)})" for lo, hi in pairs)
    raise NotEstablished(
        f"a query sees a later key outside its own span of {name!r} (query position {ev(q)}, key position {ev(k)}; "
        f"spans {where}): no step could hold every key it sees")


# ----------------------------------------------------------------------------- binding the indices


def _bound(f: MaskFormula) -> tuple:
    """``allowed`` and ``bias`` with every free index replaced by the query row, key column, head or a
    constant the facts tie it to (indices of intermediate tensors are tied by facts, not substituted)."""
    if not (_is_symbol(f.S) and _is_symbol(f.L)) and not (z3.is_int_value(f.S) and f.S.eq(f.L)):
        # the program is evaluated with both counts set to the sequence's length: that is the place
        # where queries and keys are the same positions only when each count is one size of its own (or
        # both the one size a static graph fixed)
        raise NotEstablished(f"the mask program's query and key counts ({f.S}, {f.L}) are not plain sizes")
    known = {f.b.get_id(), f.h.get_id(), f.i.get_id(), f.j.get_id()}
    sizes = _consts([f.S, f.L])
    exprs = [f.allowed, f.bias]
    sub = []
    for name, v in _consts(exprs).items():
        if v.get_id() in known or name in sizes or v.sort() != z3.IntSort():
            continue
        value = _tied(f, v)
        if value is None:
            raise NotEstablished(f"the mask program's index {name} is tied to no query, key or head")
        sub.append((v, value))
    if sub:
        exprs = [z3.substitute(e, *sub) for e in exprs]
    for name, c in _consts(exprs).items():
        if c.get_id() not in known and name not in sizes:
            raise NotEstablished(f"the mask program reads a size or index ({name}) besides the query and key counts")
    s = z3.Solver()
    s.set("timeout", 20_000)
    s.add(*f.facts, f.S == f.L, f.L >= 2)
    if s.check() != z3.sat:
        raise NotEstablished("the mask program was read for a fixed number of queries (a single-token graph): it "
                             "cannot be evaluated where queries and keys are the same positions")
    return tuple(exprs)


def _is_symbol(e) -> bool:
    return z3.is_app(e) and e.decl().kind() == z3.Z3_OP_UNINTERPRETED and e.num_args() == 0


def _tied(f: MaskFormula, v) -> Any:
    s = z3.Solver()
    s.set("timeout", 20_000)
    s.add(*f.facts)
    if s.check() != z3.sat:
        return None
    for cand in (f.i, f.j, f.h, f.b, f.q_pos, s.model().eval(v, model_completion=True)):
        ok, _ = f.holds(v == cand)
        if ok:
            return cand
    return None


# ----------------------------------------------------------------------------- compiling


class _Compiler:
    """z3 terms -> the JSON node list of ``pagedattn.backends.position_mod``."""

    _BINARY = {z3.Z3_OP_DIV: "div", z3.Z3_OP_IDIV: "idiv", z3.Z3_OP_MOD: "mod", z3.Z3_OP_LT: "lt",
               z3.Z3_OP_LE: "le", z3.Z3_OP_GT: "gt", z3.Z3_OP_GE: "ge", z3.Z3_OP_EQ: "eq", z3.Z3_OP_XOR: "xor"}
    _FOLD = {z3.Z3_OP_ADD: "add", z3.Z3_OP_SUB: "sub", z3.Z3_OP_MUL: "mul", z3.Z3_OP_AND: "and",
             z3.Z3_OP_OR: "or"}

    def __init__(self, f: MaskFormula):
        self.f = f
        sizes = _consts([f.S, f.L])
        self.leaves = {f.i.get_id(): ["q"], f.j.get_id(): ["k"], f.h.get_id(): ["h"], f.b.get_id(): ["int", 0]}
        for c in sizes.values():
            self.leaves[c.get_id()] = ["n"]
        self.nodes: list = []
        self.memo: dict[int, int] = {}
        self.tables: list[torch.Tensor] = []
        self.table_size = 0
        self.table_at: dict[str, int] = {}
        self.values = None  # the ValueSpec of per-request values the program reads

    def build(self, allowed, bias) -> tuple[str, Optional[torch.Tensor]]:
        a = None if z3.is_true(z3.simplify(allowed)) else self.emit(z3.simplify(allowed) if self.f.values else allowed)
        b = None if _is_zero(bias) else self.emit(bias)
        if a is None and b is None:
            raise NotEstablished("the mask program neither masks nor biases")
        dtype = "float64" if self.f.float_dtype == torch.float64 else "float32"
        program = {"version": 1, "float": dtype, "nodes": self.nodes, "allowed": a, "bias": b}
        if self.values is not None:
            program["values"] = self.values.to_json()
        text = json.dumps(program, separators=(",", ":"))
        tables = torch.cat(self.tables).to(torch.float64) if self.tables else None
        if tables is not None and bool((tables == tables.to(torch.float32).to(torch.float64)).all()):
            tables = tables.to(torch.float32)  # every value exact in float32: half the bytes
        return text, tables

    def add(self, node: list) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def table(self, values: torch.Tensor) -> int:
        if self.table_size + values.numel() > _MAX_TABLE:
            raise NotEstablished(f"the mask program reads constant tables of more than {_MAX_TABLE} elements")
        at = self.table_size
        self.tables.append(values.detach().reshape(-1).to(torch.float64).cpu())
        self.table_size += values.numel()
        return at

    def emit(self, e) -> int:
        key = e.get_id()
        if key not in self.memo:
            self.memo[key] = self._emit(e)
        return self.memo[key]

    def _emit(self, e) -> int:
        if key := self.leaves.get(e.get_id()):
            return self.add(list(key))
        if z3.is_int_value(e):
            return self.add(["int", e.as_long()])
        if z3.is_rational_value(e):
            return self.add(["real", e.numerator_as_long() / e.denominator_as_long()])
        if z3.is_true(e) or z3.is_false(e):
            return self.add(["bool", z3.is_true(e)])
        if not z3.is_app(e):
            raise NotEstablished(f"the mask program has a term the kernels cannot evaluate ({e.sexpr()[:80]})")
        k, args = e.decl().kind(), e.children()
        if k == z3.Z3_OP_ITE:
            lut = self._lut(e)
            if lut is not None:
                return lut
            return self.add(["ite", *(self.emit(a) for a in args)])
        if k in self._FOLD:
            out = self.emit(args[0])
            for a in args[1:]:
                out = self.add([self._FOLD[k], out, self.emit(a)])
            return out
        if k in self._BINARY and len(args) == 2:
            return self.add([self._BINARY[k], self.emit(args[0]), self.emit(args[1])])
        if k == z3.Z3_OP_DISTINCT and len(args) == 2:
            return self.add(["ne", self.emit(args[0]), self.emit(args[1])])
        if k == z3.Z3_OP_UMINUS:
            return self.add(["neg", self.emit(args[0])])
        if k == z3.Z3_OP_NOT:
            return self.add(["not", self.emit(args[0])])
        if k == z3.Z3_OP_TO_REAL:
            return self.add(["to_real", self.emit(args[0])])
        if k == z3.Z3_OP_TO_INT:
            return self.add(["to_int", self.emit(args[0])])
        if k == z3.Z3_OP_UNINTERPRETED:
            return self._function(e, args)
        raise NotEstablished(f"the mask program has an operation the kernels cannot evaluate ({e.decl().name()})")

    def _function(self, e, args) -> int:
        name = e.decl().name()
        if name.startswith("offset_"):
            # a position input's offset: the proof showed the program does not depend on it
            return self.add(["int", 0])
        if name.startswith("op_") and name[3:].split("__")[0] in FUNCTIONS:  # op_log, op_log__below: log
            return self.add(["call", name[3:].split("__")[0], self.emit(args[0])])
        if name.startswith("val_"):
            return self._value(name, args)
        if name.startswith("table_") and name in self.f.tables:
            t = self.f.tables[name]
            if name not in self.table_at:
                self.table_at[name] = self.table(t)
            return self.add(["table", self.table_at[name], list(t.shape), *(self.emit(a) for a in args)])
        raise NotEstablished(f"the mask program reads {name}, which is no position (an input's values)")

    def _value(self, name: str, args) -> int:
        """A row function behind per-request values (``mask_program``'s ``value_input``) as the program's
        ``["val", i]`` leaves: a span's start ``x_0`` or the gaps ``x_r`` / lengths ``y_r`` between boundaries."""
        found = [(n, spec, fns) for n, (spec, _, fns) in self.f.values.items()
                 if any(fn.name() == name for fn in fns)]
        if not found or len(args) != 1 or not (z3.simplify(args[0]).eq(self.f.b) or self.f.holds(args[0] == self.f.b)[0]):
            raise NotEstablished(f"the mask program reads {name} other than as the query's request's values")
        (_, spec, fns), = found
        if self.values is not None and self.values != spec:
            raise NotEstablished("the mask program reads per-request values of two inputs")
        self.values = spec
        at = next(k for k, fn in enumerate(fns) if fn.name() == name)
        if at == 0:  # the prefix length, or the first span's start
            return self.add(["val", 0])
        one = self.add(["int", 1])
        # x_r = s_r - e_(r-1) - 1, y_r = e_r - s_r - 1: boundaries at values at and at - 1
        diff = self.add(["sub", self.add(["val", at]), self.add(["val", at - 1])])
        return self.add(["sub", diff, one])

    def _lut(self, e) -> Optional[int]:
        """``If(x == c0, v0, If(x == c1, v1, ... default))`` over one index and constant values: a table."""
        pairs, rest, x = {}, e, None
        while z3.is_app(rest) and rest.decl().kind() == z3.Z3_OP_ITE:
            cond, then, other = rest.children()
            if not (z3.is_app(cond) and cond.decl().kind() == z3.Z3_OP_EQ):
                break
            lhs, rhs = cond.children()
            if z3.is_int_value(lhs):
                lhs, rhs = rhs, lhs
            if not z3.is_int_value(rhs) or (x is not None and not lhs.eq(x)) or _value(then) is None:
                break
            x = lhs
            pairs.setdefault(rhs.as_long(), _value(then))  # the outermost test wins, as in the chain
            rest = other
        if x is None or len(pairs) < _MIN_CHAIN:
            return None
        kinds = {kind for kind, _ in pairs.values()}
        if len(kinds) != 1:
            return None
        (kind,) = kinds
        lo, hi = min(pairs), max(pairs)
        default = _value(rest)
        fill = default[1] if default is not None and default[0] == kind else 0
        values = torch.full((hi - lo + 1,), float(fill), dtype=torch.float64)
        for c, (_, v) in pairs.items():
            values[c - lo] = float(v)
        if default is None or default[0] != kind:
            # keys missing from the chain fall through to a default that is no constant: keep the chain for them
            missing = [c for c in range(lo, hi + 1) if c not in pairs]
            if missing:
                return None
        size = hi - lo + 1
        if default is not None and default[0] == kind:
            # a constant default (an embedding's last row, say) travels in the tables too: layers whose
            # programs differ only in learned values then share one program text
            at = self.table(torch.cat((values, torch.tensor([float(default[1])], dtype=torch.float64))))
            other = self.add(["tval", kind, at + size])
        else:
            at, other = self.table(values), self.emit(rest)
        return self.add(["lut", kind, self.emit(x), at, lo, size, other])


def _value(e) -> Optional[tuple]:
    if z3.is_int_value(e):
        return "int", e.as_long()
    if z3.is_rational_value(e):
        return "real", e.numerator_as_long() / e.denominator_as_long()
    if z3.is_true(e) or z3.is_false(e):
        return "bool", z3.is_true(e)
    return None


def _is_zero(e) -> bool:
    v = z3.simplify(e)
    return z3.is_rational_value(v) and v.numerator_as_long() == 0
