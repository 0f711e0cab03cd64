"""Show that outside attention a token's outputs depend on that token alone, before a graph is paged.

A paged step packs the tokens of several sequences into one row, and a prompt may arrive in chunks over several
steps: only attention knows where a sequence starts and what its cache holds. Everything else in the graph must
treat each token on its own (projections, norms, MLPs, embeddings), and anything that numbers tokens must number
them by their position in their own sequence, not by their index in the step. This pass reads the drop-in graph
once, as an abstract interpretation over which dimensions of each tensor index tokens (the sizes that carry the
paged sites' query-length and batch symbols):

- *token* values: the model's per-token inputs (``input_ids``, ``position_ids``, an attention mask) and what is
  computed from them along their token dimensions: pointwise ops, reductions and norms over features, views that
  keep tokens apart from features, matmuls that contract features, lookups in constant tables, attention (the op
  that is paged), rows picked by an index the model takes as an input (``logits_to_keep``);
- *constant* values: parameters, buffers, literals, and tensors made from sizes (``zeros(T)``), the same at every
  token; *per-sequence* values: inputs with a batch dimension but no token one;
- *step indices*: ``arange`` over the token count from a constant start (``arange(T)``, ``arange(2, T + 2)``) and a
  constant table cut to it from its first row (``pe[:, :T]``). In the model's forward each is every token's
  position; in a paged step its index in the step. Where one is read as a number (an embedding lookup, rotary
  angles, a query temperature) ``packed_positions`` computes it from the step's positions
  (``PassContext.step_indices``); where one only moves values (an op this pass does not know, a scatter back to the
  tokens) it stays an index in the step; one that is both is refused.

A value that combines tokens (a reduction, softmax or cumulative sum over them, a contraction, slice, select,
concatenation, repeat or padding along them, a per-sequence value spread over them, the token count read as a
number, tokens picked by an index computed in the graph) and reaches an output is the graph's ``paged_refusal``: paged
mode refuses the program with it, and the drop-in, which runs the model's own forward, still serves it. An op or a
view this pass cannot follow shows nothing either way: where one reaches an output it is ``locality_unproven`` (a
mixture of experts' routing sorts the tokens by expert and scatters them back), and paged mode rests on
``PagedEngine``'s packing check as before.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import sympy
import torch
from torch.fx import GraphModule, Node

from pagedattn.passes.canonical import is_attention, read_attention
from pagedattn.passes.context import PassContext, PassReport, StepIndex
from pagedattn.passes.site import CAST_OPS, IDENTITY_OPS, aten, same_size, written_tensor

__all__ = ["token_locality"]

log = logging.getLogger("pagedattn.passes")

_MAX_INT = 2 ** 62  # a slice end at least this is "to the end"


@dataclass(frozen=True)
class _Tok:
    """A tensor whose elements at a token depend on that token alone; ``dims``: the dimensions indexing tokens;
    ``sources``: the step indices (node names) it is computed from."""

    dims: frozenset
    sources: frozenset = frozenset()
    guessed: bool = False  # computed from a value this pass could not follow: its dimensions are a guess


@dataclass(frozen=True)
class _Mixed:
    """A value this pass cannot show to keep tokens apart: ``why``, at node ``at``; ``combines``: a rule saw it
    combine tokens (a reduction over them, a slice of them), rather than an op or an indexing it cannot follow."""

    why: str
    at: str
    combines: bool = False


_CONST = None  # the same at every token (parameters, literals, sizes)


def token_locality(gm: GraphModule, ctx: PassContext) -> PassReport:
    """Record in ``ctx`` the step indices the paged graph must number by position (``step_indices``), where the
    graph combines tokens outside attention why paged mode cannot serve it (``paged_refusal``), and where it meets
    what it cannot follow (``locality_unproven``). Reads the graph; changes nothing."""
    ctx.step_indices, ctx.paged_refusal = {}, None
    sites = [n for n in gm.graph.nodes if is_attention(n)]
    if not sites:
        return PassReport("token_locality", False, "no attention to page")
    q = read_attention(sites[0]).query.meta["val"]  # [B, H, S, D]
    if not _free(q.shape[2]):
        return PassReport("token_locality", False, "a graph of fixed token count: not read")
    interp = _Interpreter(gm, ctx, tuple(q.shape))
    unproven, refusal = interp.run()
    ctx.paged_refusal, ctx.locality_unproven = refusal, unproven
    # the step indices read as numbers become positions; those that pick tokens stay indices in the step
    ctx.step_indices = {k: v for k, v in interp.indices.items() if k not in interp.picking}
    if refusal:
        return PassReport("token_locality", False, f"paged mode refused: {refusal}")
    if unproven:
        log.debug("token locality not shown: %s", unproven)
        return PassReport("token_locality", False, f"not shown to keep tokens apart: {unproven}")
    return PassReport("token_locality", False, f"tokens kept apart outside attention; "
                                               f"{len(ctx.step_indices)} step indices to number by position")


def _free(size) -> frozenset:
    return frozenset(_expr(size).free_symbols)


def _expr(size) -> sympy.Expr:
    if isinstance(size, torch.SymInt):
        return size.node.expr
    return size if isinstance(size, sympy.Expr) else sympy.Integer(int(size))


def _shape(n) -> Optional[tuple]:
    v = n.meta.get("val") if isinstance(n, Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _divides(a: sympy.Expr, b: sympy.Expr) -> bool:
    return sympy.fraction(sympy.cancel(b / a))[1] == 1


def _view_groups(a: Sequence, b: Sequence) -> Optional[list[tuple[list[int], list[int]]]]:
    """The dimensions of a view's input and output that hold the same elements, as groups ``(in, out)`` whose
    products agree (sizes of 1 alone); None where no such grouping is found."""
    a, b = [_expr(x) for x in a], [_expr(x) for x in b]
    i = j = 0
    groups = []
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < len(b) and b[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(a) or j >= len(b):
            return None
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while sympy.expand(pa - pb) != 0:
            if _divides(pa, pb) and i < len(a):
                pa, gi = pa * a[i], gi + [i]
                i += 1
            elif _divides(pb, pa) and j < len(b):
                pb, gj = pb * b[j], gj + [j]
                j += 1
            else:
                return None
        groups.append((gi, gj))
    return groups


@dataclass(frozen=True)
class _Row:
    """One value per sequence (an input with a batch dimension but no token dimension): a packed step, one row
    for several sequences, cannot spread it over their tokens."""

    name: str


class _Interpreter:
    """One reading of a graph: each node's abstract value (constant, per sequence, tokens along some dimensions, or
    mixed), in graph order; the rules for ops are ``_HANDLERS``' (pointwise ops by their tag)."""

    def __init__(self, gm: GraphModule, ctx: PassContext, query_shape: tuple):
        self.gm, self.ctx = gm, ctx
        self.batch, self.tokens = query_shape[0], query_shape[2]  # [B, H, S, D]: B and S
        self.symbols = _free(self.batch) | _free(self.tokens)
        self.env: dict[Node, Any] = {}
        self.indices: dict[str, StepIndex] = {}  # node name -> how it numbers tokens
        # step indices read as numbers (positions, in the model's forward) and used to pick tokens (indices in
        # the step, in any call): a step index is made positions where it is read as a number alone
        self.read_as_numbers: set[str] = set()
        self.picking: set[str] = set()
        self.unproven: dict[str, str] = {}  # node name -> what this pass could not follow there

    def run(self) -> tuple[Optional[str], Optional[str]]:
        """Interpret every node: ``(unproven, refusal)``, where an output holds a value this pass cannot follow
        (an op or an indexing it does not know) and where one combines tokens (each None when there is none)."""
        out = None
        for n in self.gm.graph.nodes:
            if n.op == "output":
                out = n
                continue
            try:
                v = self.node(n)
            except _Refuse as e:
                v = _Mixed(e.why, e.at or n.name, e.combines)
            except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:  # a form no rule expects
                v = _Mixed(f"{_name(n)} could not be read ({type(e).__name__}: {e})", n.name)
            if isinstance(v, _Mixed) and not v.combines:
                # what this pass cannot follow: noted where it is met, and read on as if it kept tokens apart, so
                # that what combines tokens after it is still seen
                self.unproven.setdefault(v.at, v.why)
                base = written_tensor(n)
                if base is not None:  # what reads the target afterwards reads what could not be followed
                    self.unproven.setdefault(base.name, v.why)
                v = self.guess(n)
            elif isinstance(v, _Mixed):
                self.spoil_base(n, v)
            self.env[n] = self.token_sized(n, v)
        both = sorted(self.read_as_numbers & self.picking)
        if both:
            return None, f"step index {both[0]} is both read as a number (a position) and used to pick tokens"
        outputs = [x for x in _leaves(out.args if out is not None else ()) if isinstance(x, Node)]
        combining = [m for x in outputs for m in _flat(self.env.get(x)) if isinstance(m, _Mixed)]
        if combining:
            return None, f"{combining[0].why} (node {combining[0].at})"
        reached = {x.name for x in _ancestors(outputs)}
        unproven = [f"{why} (node {at})" for at, why in self.unproven.items() if at in reached]
        return (unproven[0] if unproven else None), None

    def guess(self, n: Node):
        """A value for a node this pass cannot follow: tokens along its token-sized dimensions."""
        val = n.meta.get("val")
        vals = list(val) if isinstance(val, (list, tuple)) else [val]
        out = [_Tok(frozenset(d for d, size in enumerate(v.shape) if self.is_tokens(size)), guessed=True)
               if isinstance(v, torch.Tensor) else _CONST for v in vals]
        out = [o if not isinstance(o, _Tok) or o.dims else _CONST for o in out]
        return out if isinstance(val, (list, tuple)) else out[0]

    def token_sized(self, n: Node, v):
        """A constant with a dimension as long as the token count (``ones(T)``, a constant expanded to the tokens) is
        no longer the same at every token once an op reads along that dimension (a cumulative sum numbers them): it
        is read as a token value."""
        if isinstance(v, list):
            val = n.meta.get("val")
            return [self.token_sized_one(x, o) for x, o in zip(val, v)] if isinstance(val, (list, tuple)) else v
        return self.token_sized_one(n.meta.get("val"), v)

    def token_sized_one(self, val, v):
        if v is not _CONST or not isinstance(val, torch.Tensor):
            return v
        dims = frozenset(d for d, size in enumerate(val.shape) if self.is_tokens(size))
        if any(not self.is_batch(val.shape[d]) for d in dims):
            return _Tok(dims)
        return v

    def spoil_base(self, n: Node, v: "_Mixed") -> None:
        """An in-place op that combines tokens leaves its target (through views) combined as well."""
        base = written_tensor(n)
        if base is not None:
            self.env[base] = v

    # ----------------------------------------------------------------- reading arguments

    def value(self, a) -> Any:
        """A tensor argument's abstract value (refusing a mixed one); constant for literals."""
        if isinstance(a, Node):
            v = self.env.get(a)
            if isinstance(v, _Mixed):
                raise _Refuse(v.why, v.at, v.combines)
            return v
        return _CONST

    def step_scalar(self, a) -> bool:
        """Whether an argument holds a number that depends on the step's token count."""
        if isinstance(a, Node):
            a = a.meta.get("val")
        if isinstance(a, (list, tuple)):
            return any(self.step_scalar(x) for x in a)
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return bool(frozenset(a.node.expr.free_symbols) & self.symbols)
        return False

    def is_tokens(self, size) -> bool:
        return bool(_free(size) & self.symbols)

    def tensor_args(self, n: Node) -> list[Node]:
        return [x for x in _leaves((n.args, n.kwargs)) if isinstance(x, Node) and
                isinstance(x.meta.get("val"), torch.Tensor)]

    # ----------------------------------------------------------------- one node

    def node(self, n: Node):
        if n.op in ("get_attr", "call_module"):
            return _CONST  # state, and export's guard function (no value)
        if n.op == "placeholder":
            return self.placeholder(n)
        if n.op != "call_function":
            raise _Refuse(f"{n.op} {n.target}: not known to keep tokens apart")
        if n.target is operator.getitem:
            v = self.env.get(n.args[0])
            if isinstance(v, _Mixed):
                raise _Refuse(v.why, v.at, v.combines)
            return v[n.args[1]] if isinstance(v, list) else v
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) and not (isinstance(val, (list, tuple)) and any(
                isinstance(x, torch.Tensor) for x in val)):
            return _CONST  # a size, a flag or an assertion: a number is judged where a tensor op uses it
        if is_attention(n):
            return self.attention(n)
        values = [self.value(x) for x in self.tensor_args(n)]
        if any(isinstance(v, _Tok) and v.guessed for v in values):
            try:
                out = self.rule(n, values)
            except _Combines as e:  # on guessed dimensions a rule shows nothing either way
                raise _Refuse(f"{e.why}, after what could not be followed") from None
            return [_guessed(o) for o in out] if isinstance(out, list) else _guessed(out)
        return self.rule(n, values)

    def rule(self, n: Node, values: list):
        val = n.meta.get("val")
        sources = frozenset().union(*[v.sources for v in values if isinstance(v, _Tok)])
        handler = _HANDLERS.get(n.target)
        if handler is not None:
            out = handler(self, n)
        elif all(v is _CONST for v in values) and not self.step_scalar((n.args, n.kwargs)):
            out = _CONST
        elif not any(isinstance(v, _Tok) for v in values) and not self.step_scalar((n.args, n.kwargs)):
            out = next(v for v in values if isinstance(v, _Row))  # per-sequence data stays per sequence
        elif torch.Tag.pointwise in getattr(n.target, "tags", ()) or n.target in (aten.copy.default, aten.to.other):
            out = self.pointwise(n)
        else:
            self.picking |= sources  # whatever it does with them, they stay indices in the step
            raise _Refuse(f"{_name(n)} over tokens is not known to keep them apart")
        if isinstance(val, (list, tuple)) and not isinstance(out, list):
            out = [out] * len(val)
        if handler in _KEEPS_INDICES:  # values moved, not read: still the step indices they were
            out = [_with_sources(o, sources) for o in out] if isinstance(out, list) else _with_sources(out, sources)
        elif handler is not _index:  # read as numbers: what comes out is a value of positions, no index
            self.read_as_numbers |= sources
        self.mutate(n, out)
        return out

    def placeholder(self, n: Node):
        shape = _shape(n)
        if n.name in self.ctx.constant_inputs or shape is None:
            return _CONST
        dims = frozenset(d for d, s in enumerate(shape) if self.is_tokens(s))
        if not dims:
            return _CONST
        if all(_free(shape[d]) <= _free(self.batch) for d in dims) and _free(self.batch):
            return _Row(n.name)  # batch dimensions alone
        return _Tok(dims)

    def mutate(self, n: Node, out) -> None:
        """An in-place op writes its result into its first argument (through views)."""
        base = written_tensor(n)
        if base is None:
            return
        before = self.env.get(base)
        if out is _CONST and before is _CONST:
            return
        if base is n.args[0] and isinstance(out, _Tok) and before in (_CONST, out):
            self.env[base] = out
            return
        self.env[base] = _Mixed(f"{_name(n)} writes token values into {base.name} in place", n.name)

    # ----------------------------------------------------------------- shared rules

    def attention(self, n: Node):
        site = read_attention(n)
        q, k, v = (self.value(x) for x in (site.query, site.key, site.value))
        if not isinstance(q, _Tok):
            raise _Refuse("attention whose queries are not the step's tokens")
        for x in (k, v):
            # keys of the step's tokens (self-attention), constants, or a sequence's own (an encoder's output, read
            # from the cross-attention caches of its request)
            if x is not _CONST and not isinstance(x, _Row) and x.dims != q.dims:
                raise _Refuse("attention over keys that are neither the step's tokens, a sequence's own nor "
                              "constants")
        return _Tok(q.dims)

    def pointwise(self, n: Node):
        """Broadcasting ops: every token value must index the output's tokens along the same dimensions."""
        if self.step_scalar((n.args, n.kwargs)):
            raise _Combines(f"{_name(n)} reads the step's token count as a number")
        out_rank = len(_shape(n)) if _shape(n) is not None else len((n.meta["val"])[0].shape)
        toks = []
        for x in self.tensor_args(n):
            v = self.value(x)
            if isinstance(v, _Row):
                raise _Combines(f"input {v.name} (one value per sequence) meets the tokens")
            if isinstance(v, _Tok):
                shift = out_rank - len(_shape(x))
                toks.append(frozenset(d + shift for d in v.dims))
        return self.agree(n, toks)

    def agree(self, n: Node, toks: list) -> Any:
        """The output's token dimensions when every token operand indexes the same ones (else refused). An operand
        may lack the batch dimensions: a value of positions alone is the same in every row (a step has one)."""
        dims = frozenset().union(*toks) if toks else frozenset()
        shape = _shape(n) or tuple((n.meta["val"])[0].shape)
        rows = frozenset(d for d in dims if self.is_batch(shape[d]))
        if any(t - rows != dims - rows for t in toks):
            raise _Combines(f"{_name(n)} spreads a value over tokens it was not computed for")
        return _Tok(dims) if dims else _CONST

    def is_batch(self, size) -> bool:
        """A size of batch symbols alone (the rows of a call; a paged step has one)."""
        return bool(_free(size)) and _free(size) <= _free(self.batch)

    def keep(self, n: Node, drop: Sequence[int] = (), insert: Sequence[int] = ()):
        """The first argument's token dimensions, ``drop`` (input dimensions, not tokens) removed and ``insert``
        (output dimensions) added."""
        v = self.value(n.args[0])
        if not isinstance(v, _Tok):
            return v
        if set(drop) & v.dims:
            raise _Combines(f"{_name(n)} over the tokens")
        dims = [d - sum(x < d for x in drop) for d in v.dims]
        for d in sorted(insert):
            dims = [x + (x >= d) for x in dims]
        return _Tok(frozenset(dims))

    def count_of_tokens(self, size) -> bool:
        """A size that is the step's token count."""
        return same_size(size, self.tokens)


class _Refuse(Exception):
    """This node's value is not shown to keep tokens apart (``at``: where an input's was not)."""

    def __init__(self, why: str, at: Optional[str] = None, combines: bool = False):
        super().__init__(why)
        self.why, self.at, self.combines = why, at, combines


class _Combines(_Refuse):
    """This node combines tokens: a reduction, a slice, a shift of them, a per-sequence value spread over them."""

    def __init__(self, why: str):
        super().__init__(why, None, True)


def _ancestors(nodes: Sequence[Node]) -> set[Node]:
    seen, stack = set(), list(nodes)
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(x.all_input_nodes)
    return seen


def _guessed(v):
    return _Tok(v.dims, v.sources, True) if isinstance(v, _Tok) else v


def _with_sources(v, sources: frozenset):
    return _Tok(v.dims, v.sources | sources, v.guessed) if isinstance(v, _Tok) and sources else v


def _name(n: Node) -> str:
    t = n.target
    return str(getattr(t, "__name__", None) or t)


def _leaves(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _leaves(y)
    else:
        yield x


def _flat(v):
    if isinstance(v, list):
        for x in v:
            yield from _flat(x)
    else:
        yield v


def _arg(n: Node, name: str, default=None):
    """Argument ``name`` of an ATen call, positional or keyword, by the op's schema."""
    if name in n.kwargs:
        return n.kwargs[name]
    schema = getattr(n.target, "_schema", None)
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.name == name:
                if i < len(n.args):
                    return n.args[i]
                return a.default_value if a.has_default_value() else default
    return default


def _rank(x: Node) -> int:
    return len(_shape(x))


# ----------------------------------------------------------------------------- handlers


def _same_value(it: _Interpreter, n: Node):
    """Copies, casts and aliases."""
    return it.value(n.args[0])


def _view(it: _Interpreter, n: Node):
    v = it.value(n.args[0])
    if not isinstance(v, _Tok):
        return v
    a, b = _shape(n.args[0]), _shape(n)
    groups = _view_groups(a, b)
    if groups is None:
        raise _Refuse(f"{_name(n)} from {list(a)} to {list(b)}: no grouping of its dimensions found")
    dims = set()
    for gi, gj in groups:
        if not any(d in v.dims for d in gi):
            continue
        if len(gi) == len(gj) == 1:
            dims.add(gj[0])
        elif all(d in v.dims for d in gi) and all(it.is_tokens(b[d]) for d in gj):
            dims |= set(gj)  # tokens merged or split among themselves (batch and sequence)
        else:
            raise _Refuse(f"{_name(n)} from {list(a)} to {list(b)} merges tokens with features")
    return _Tok(frozenset(dims))


def _permute(it: _Interpreter, n: Node):
    v = it.value(n.args[0])
    if not isinstance(v, _Tok):
        return v
    rank = _rank(n.args[0])
    if n.target is aten.t.default:
        perm = list(range(rank))[::-1]
    elif n.target is aten.permute.default:
        perm = [_dim(d, rank) for d in n.args[1]]
    else:
        x, y = _dim(n.args[1], rank), _dim(n.args[2], rank)
        perm = list(range(rank))
        perm[x], perm[y] = perm[y], perm[x]
    return _Tok(frozenset(perm.index(d) for d in v.dims))


def _unsqueeze(it: _Interpreter, n: Node):
    return it.keep(n, insert=[_dim(n.args[1], _rank(n))])


def _squeeze(it: _Interpreter, n: Node):
    a = _shape(n.args[0])
    if n.target is aten.squeeze.default:
        ds = range(len(a))
    else:
        ds = n.args[1] if isinstance(n.args[1], (list, tuple)) else [n.args[1]]
    return it.keep(n, drop=[_dim(d, len(a)) for d in ds if same_size(a[_dim(d, len(a))], 1)])


def _expand(it: _Interpreter, n: Node):
    v = it.value(n.args[0])
    a, b = _shape(n.args[0]), _shape(n)
    shift = len(b) - len(a)
    grown = [d for d in range(len(b)) if (d < shift or not same_size(a[d - shift], b[d])) and it.is_tokens(b[d])]
    if isinstance(v, _Row) and any(not it.is_batch(b[d]) for d in grown):
        raise _Combines(f"input {v.name} (one value per sequence) is spread over the tokens")
    if not isinstance(v, _Tok):
        return v
    if any(not it.is_batch(b[d]) for d in grown):
        raise _Combines(f"{_name(n)} spreads a value over tokens it was not computed for")
    return _Tok(frozenset(d + shift for d in v.dims) | frozenset(grown))


def _listed_dims(n: Node, name: str, rank: int) -> list[int]:
    """The dimensions argument ``name`` lists (one or several; none listed: every dimension)."""
    d = _arg(n, name)
    if d is None or (isinstance(d, (list, tuple)) and not d):
        return list(range(rank))
    return [_dim(x, rank) for x in (d if isinstance(d, (list, tuple)) else [d])]


def _reduction(it: _Interpreter, n: Node):
    """Reductions over ``dim`` (all dimensions when none): never over the tokens."""
    v = it.value(n.args[0])
    rank = _rank(n.args[0])
    dims = _listed_dims(n, "dim", rank)
    if isinstance(v, _Tok) and set(dims) & v.dims:
        raise _Combines(f"{_name(n)} over the tokens")
    val = n.meta["val"]
    out_rank = (val[0] if isinstance(val, (list, tuple)) else val).dim()
    return it.keep(n, drop=[] if out_rank == rank else dims)


def _along(it: _Interpreter, n: Node):
    """Ops along one dimension that keep the shape (softmax, cumsum, sort, topk): never along the tokens."""
    v = it.value(n.args[0])
    d = _dim(_arg(n, "dim", -1), _rank(n.args[0]))
    if isinstance(v, _Tok) and d in v.dims:
        raise _Combines(f"{_name(n)} along the tokens")
    return v


def _norm(it: _Interpreter, n: Node):
    v = it.value(n.args[0])
    rank, k = _rank(n.args[0]), len(_arg(n, "normalized_shape"))
    if isinstance(v, _Tok) and set(range(rank - k, rank)) & v.dims:
        raise _Combines(f"{_name(n)} normalises over the tokens")
    for name in ("weight", "bias"):
        w = _arg(n, name)
        if isinstance(w, Node) and it.value(w) is not _CONST:
            raise _Refuse(f"{_name(n)} with per-token weights")
    return v


def _linear(it: _Interpreter, n: Node):
    x = it.value(n.args[0])
    for w in n.args[1:]:
        if isinstance(w, Node) and it.value(w) is not _CONST:
            raise _Refuse(f"{_name(n)} with weights computed from tokens")
    if isinstance(x, _Tok) and _rank(n.args[0]) - 1 in x.dims:
        raise _Combines(f"{_name(n)} contracts the tokens")
    return x


def _matmul(it: _Interpreter, n: Node):
    """``[..., n, k] @ [..., k, m]``: the contraction never over tokens, and both operands' tokens the same."""
    with_bias = n.target in (aten.addmm.default, aten.baddbmm.default)
    a_node, b_node = (n.args[1], n.args[2]) if with_bias else (n.args[0], n.args[1])
    a, b = it.value(a_node), it.value(b_node)
    bias = it.value(n.args[0]) if with_bias else _CONST
    sa, sb, R = _shape(a_node), _shape(b_node), _rank(n)
    if any(isinstance(v, _Row) for v in (a, b, bias)):
        if all(not isinstance(v, _Tok) for v in (a, b, bias)):
            return next(v for v in (a, b, bias) if isinstance(v, _Row))
        raise _Combines(f"a per-sequence input meets the tokens in {_name(n)}")
    if len(sa) < 2 or len(sb) < 2:
        if a is _CONST and b is _CONST:
            return _CONST
        raise _Refuse(f"{_name(n)} of a vector over tokens")
    if isinstance(a, _Tok) and len(sa) - 1 in a.dims or isinstance(b, _Tok) and len(sb) - 2 in b.dims:
        raise _Combines(f"{_name(n)} contracts the tokens")
    toks = []
    for v, s, own in ((a, sa, R - 2), (b, sb, R - 1)):
        if isinstance(v, _Tok):
            toks.append(frozenset(d + R - len(s) if d < len(s) - 2 else own for d in v.dims))
    if isinstance(bias, _Tok):
        toks.append(frozenset(d + R - _rank(n.args[0]) for d in bias.dims))
    return it.agree(n, toks)


def _embedding(it: _Interpreter, n: Node):
    if it.value(n.args[0]) is not _CONST:
        raise _Refuse("an embedding whose table is computed from tokens")
    return it.value(n.args[1])


def _index(it: _Interpreter, n: Node):
    """Advanced indexing ``x[..., i, j, ...]``: a constant table read at per-token indices gives per-token values;
    tokens picked by an index that is a model input (``logits_to_keep``) stay tokens; any other pick of tokens
    (a fixed one, a computed one) is refused."""
    x = it.value(n.args[0])
    rank = _rank(n.args[0])
    indices = list(n.args[1])
    at = [i for i, t in enumerate(indices) if t is not None]
    if any(indices[i].meta["val"].dtype == torch.bool for i in at):
        raise _Refuse(f"{_name(n)} by a boolean mask (a count of rows known only when it runs)")
    vals = [it.value(indices[i]) for i in at]
    if any(isinstance(v, _Row) for v in [x, *vals]):
        if not any(isinstance(v, _Tok) for v in [x, *vals]):
            return next(v for v in [x, *vals] if isinstance(v, _Row))
        raise _Combines(f"a per-sequence input meets the tokens in {_name(n)}")
    out_rank = _rank(n)
    k_rank = out_rank - (rank - len(at))  # the indices' broadcast rank
    contiguous = at == list(range(at[0], at[0] + len(at)))
    first = at[0] if contiguous else 0  # where the index dimensions go
    rest = [d for d in range(rank) if d not in at]
    place = {d: (d if d < first else d - len(at) + k_rank) if contiguous else k_rank + rest.index(d) for d in rest}
    picked = isinstance(x, _Tok) and any(d in at for d in x.dims)
    index_sources = frozenset().union(*[v.sources for v in vals if isinstance(v, _Tok)])
    if picked:
        it.picking |= index_sources
        it.read_as_numbers |= x.sources
    else:  # a table read at the indices: they are numbers (a position embedding)
        it.read_as_numbers |= index_sources | (x.sources if isinstance(x, _Tok) else frozenset())
    if picked and not all(_is_input_index(indices[i], it) for i in at):
        raise _Combines(f"{_name(n)} picks tokens by an index computed in the graph (a fixed token, a step index)")
    out = {place[d] for d in x.dims if d not in at} if isinstance(x, _Tok) else set()
    idx = [frozenset(d + k_rank - _rank(indices[i]) + first for d in v.dims)
           for i, v in zip(at, vals) if isinstance(v, _Tok)]
    if picked:
        return _Tok(frozenset(out | set(range(first, first + k_rank))))
    toks = ([frozenset(out)] if out else []) + idx
    return it.agree(n, toks)


def _is_input_index(node, it: _Interpreter) -> bool:
    """An index that is a model input (the step's rows to keep), possibly cast."""
    while isinstance(node, Node) and node.op == "call_function" and node.target in _COPIES:
        node = node.args[0]
    return isinstance(node, Node) and node.op == "placeholder" and node.name not in it.ctx.constant_inputs


def _read_along(it: _Interpreter, n: Node) -> tuple:
    """``(x, index, dim)`` of an op reading ``x`` along ``dim`` at ``index`` (``index_select``, ``gather``): never
    along the tokens, nor a per-sequence input with them."""
    x, idx = it.value(n.args[0]), it.value(_arg(n, "index"))
    d = _dim(_arg(n, "dim"), _rank(n.args[0]))
    if isinstance(x, _Row) or isinstance(idx, _Row):
        raise _Combines(f"a per-sequence input meets the tokens in {_name(n)}")
    if isinstance(x, _Tok) and d in x.dims:
        raise _Combines(f"{_name(n)} picks tokens by an index computed in the graph")
    return x, idx, d


def _index_select(it: _Interpreter, n: Node):
    x, idx, d = _read_along(it, n)
    toks = [x.dims] if isinstance(x, _Tok) else []
    if isinstance(idx, _Tok):
        toks.append(frozenset({d}))
    return it.agree(n, toks)


def _slice(it: _Interpreter, n: Node):
    """A slice of the tokens must keep all of them; a constant cut to the token count from its first row (a
    sinusoidal table ``pe[:, :T]``) holds each token's index in the step: a step index."""
    x = it.value(n.args[0])
    shape = _shape(n.args[0])
    d = _dim(_arg(n, "dim", 0), len(shape))
    start, end, step = _arg(n, "start"), _arg(n, "end"), _arg(n, "step", 1)
    start = 0 if start is None else start
    end = _MAX_INT if end is None else end
    bounds = (start, end, step)
    if isinstance(x, _Tok):
        full = _is_zero(start) and step == 1 and (isinstance(end, int) and end >= _MAX_INT or _same_node(end, shape[d]))
        if d in x.dims and not full:
            raise _Combines(f"{_name(n)} keeps part of the tokens")
        if d not in x.dims and it.step_scalar(bounds):
            raise _Combines(f"{_name(n)} cuts features by the token count")
        return x
    if not it.step_scalar(bounds):
        return x
    return _table_cut(it, n, x, start if step == 1 else None, d)


def _table_cut(it: _Interpreter, n: Node, x, start, d: int):
    """A constant (or per-sequence input ``x``) cut along ``d`` by the token count from row ``start`` (None: not
    by one row at a time): a table of positions, a step index, when ``start`` is a fixed row."""
    if isinstance(x, _Row):
        raise _Combines(f"{_name(n)} cuts per-sequence input {x.name} by the token count")
    if isinstance(start, int) and start >= 0 and it.count_of_tokens(_shape(n)[d]):
        it.indices[n.name] = StepIndex("table", start, d)
        return _Tok(frozenset({d}), frozenset({n.name}))
    raise _Combines(f"{_name(n)} cuts a constant by the token count other than from a fixed row")


def _is_zero(x) -> bool:
    return isinstance(x, int) and x == 0


def _same_node(end, size) -> bool:
    v = end.meta.get("val") if isinstance(end, Node) else end
    return isinstance(v, (int, torch.SymInt)) and same_size(v, size)


def _select(it: _Interpreter, n: Node):
    v = it.value(n.args[0])
    d = _dim(n.args[1], _rank(n.args[0]))
    if isinstance(v, _Tok) and d in v.dims:
        raise _Combines(f"{_name(n)} picks one token")
    if it.step_scalar(n.args[2]):
        raise _Combines(f"{_name(n)} picks by the token count")
    return it.keep(n, drop=[d])


def _cat(it: _Interpreter, n: Node):
    R = _rank(n)
    d = _dim(_arg(n, "dim", 0), R)
    toks, rows = [], []
    for p in n.args[0]:
        v = it.value(p)
        if isinstance(v, _Row):
            rows.append(v)
        if isinstance(v, _Tok):
            if d in v.dims:
                raise _Combines(f"{_name(n)} joins along the tokens")
            toks.append(v.dims)
    if rows:
        if toks:
            raise _Combines(f"input {rows[0].name} (one value per sequence) meets the tokens")
        return rows[0]
    return it.agree(n, toks)


def _split(it: _Interpreter, n: Node):
    v = it.value(n.args[0])
    d = _dim(_arg(n, "dim", 0), _rank(n.args[0]))
    if isinstance(v, _Tok) and d in v.dims and len(n.meta["val"]) > 1:
        raise _Combines(f"{_name(n)} splits the tokens")
    return [v] * len(n.meta["val"])


def _unbind(it: _Interpreter, n: Node):
    d = _dim(_arg(n, "dim", 0), _rank(n.args[0]))
    return [it.keep(n, drop=[d])] * len(n.meta["val"])


def _arange(it: _Interpreter, n: Node):
    """A range as long as the token count from a constant start by 1 is each token's index in the step (plus
    the start): a step index. Other ranges as long are refused; ranges of other lengths over the tokens are not
    followed."""
    size = _shape(n)[0]
    if not it.is_tokens(size):
        if it.step_scalar((n.args, n.kwargs)):
            raise _Combines(f"{_name(n)} reads the token count")
        return _CONST
    start = 0 if n.target is aten.arange.default else n.args[0]
    step = n.args[2] if n.target is aten.arange.start_step else n.kwargs.get("step", 1)
    end = n.args[0] if n.target is aten.arange.default else n.args[1]
    if step == 1 and isinstance(start, (int, float)) and isinstance(end, Node) and \
            isinstance(end.meta.get("val"), torch.SymInt):
        size = end.meta["val"] - int(start)  # a float start's size reads ceil(end / 1.0): the same count
    if not it.count_of_tokens(size):  # a range over more or fewer (a mixture of experts' slots): not followed
        raise _Refuse(f"{_name(n)}: a range of {size} over the tokens")
    if isinstance(start, (int, float)) and float(start).is_integer() and step == 1:
        it.indices[n.name] = StepIndex("range", int(start), 0)
        return _Tok(frozenset({0}), frozenset({n.name}))
    raise _Combines(f"{_name(n)}: a range over the token count that is not each token's index plus a constant")


def _factory(it: _Interpreter, n: Node):
    """New tensors from sizes (zeros, ones, full, empty, ``*_like``): the same at every token, unless filled with
    the count."""
    fill = _arg(n, "fill_value")
    if n.target is aten.scalar_tensor.default:
        fill = n.args[0]
    if fill is not None and it.step_scalar(fill):
        raise _Combines(f"{_name(n)} fills with the token count")
    return _CONST


def _narrow(it: _Interpreter, n: Node):
    """``narrow(x, dim, start, length)``: a slice."""
    x = it.value(n.args[0])
    shape = _shape(n.args[0])
    d = _dim(n.args[1], len(shape))
    start, length = n.args[2], n.args[3]
    if isinstance(x, _Tok):
        if d in x.dims and not (_is_zero(start) and _same_node(length, shape[d])):
            raise _Combines(f"{_name(n)} keeps part of the tokens")
        if d not in x.dims and it.step_scalar((start, length)):
            raise _Combines(f"{_name(n)} cuts features by the token count")
        return x
    if not it.step_scalar((start, length)):
        return x
    return _table_cut(it, n, x, start, d)


def _dims_op(it: _Interpreter, n: Node):
    """Ops along listed dimensions that keep the shape (``flip``, ``roll``): never along the tokens."""
    v = it.value(n.args[0])
    ds = _listed_dims(n, "dims", _rank(n.args[0]))
    if isinstance(v, _Tok) and set(ds) & v.dims:
        raise _Combines(f"{_name(n)} along the tokens")
    return v


def _outer(it: _Interpreter, n: Node):
    a, b = it.value(n.args[0]), it.value(n.args[1])
    toks = [frozenset({0}) for v in (a,) if isinstance(v, _Tok) and v.dims] + \
        [frozenset({1}) for v in (b,) if isinstance(v, _Tok) and v.dims]
    if any(isinstance(v, _Row) for v in (a, b)):
        raise _Combines(f"a per-sequence input meets the tokens in {_name(n)}")
    return it.agree(n, toks)


def _einsum(it: _Interpreter, n: Node):
    """``einsum``: no token letter summed over, and every token operand's token letters the same."""
    eq, ops = n.args[0].replace(" ", ""), list(n.args[1])
    if "..." in eq or "->" not in eq:
        raise _Refuse(f"{_name(n)} with an implicit or broadcast equation")
    ins, out = eq.split("->")
    letters = ins.split(",")
    toks = []
    for term, op in zip(letters, ops):
        v = it.value(op)
        if isinstance(v, _Row):
            raise _Combines(f"a per-sequence input meets the tokens in {_name(n)}")
        if isinstance(v, _Tok):
            tl = {term[d] for d in v.dims}
            if tl - set(out):
                raise _Combines(f"{_name(n)} sums over the tokens")
            toks.append(frozenset(out.index(c) for c in tl))
    return it.agree(n, toks)


def _spatial(it: _Interpreter, n: Node):
    """Convolutions and pooling (``[N, C, *spatial]``): over the tokens when a token dimension is spatial."""
    v = it.value(n.args[0])
    if isinstance(v, _Tok) and any(d >= 2 for d in v.dims):
        raise _Combines(f"{_name(n)} over the tokens")
    raise _Refuse(f"{_name(n)} over tokens is not known to keep them apart")


def _stack(it: _Interpreter, n: Node):
    R = _rank(n)
    d = _dim(_arg(n, "dim", 0), R)
    toks = []
    for p in n.args[0]:
        v = it.value(p)
        if isinstance(v, _Row):
            raise _Combines(f"input {v.name} (one value per sequence) meets the tokens")
        if isinstance(v, _Tok):
            toks.append(frozenset(x + (x >= d) for x in v.dims))
    return it.agree(n, toks)


def _repeat(it: _Interpreter, n: Node):
    """``repeat``: copies along new leading dimensions or features; repeating the tokens themselves combines them."""
    v = it.value(n.args[0])
    reps, rank = list(n.args[1]), _rank(n.args[0])
    shift = len(reps) - rank
    if not isinstance(v, _Tok):
        return v
    if any(not same_size(reps[d + shift], 1) for d in v.dims):
        raise _Combines(f"{_name(n)} repeats the tokens")
    return _Tok(frozenset(d + shift for d in v.dims))


def _repeat_interleave(it: _Interpreter, n: Node):
    v = it.value(n.args[0])
    d = _arg(n, "dim")
    if not isinstance(v, _Tok):
        return v
    if d is None:
        raise _Refuse(f"{_name(n)} over a flattened tensor of tokens")
    if _dim(d, _rank(n.args[0])) in v.dims:
        raise _Combines(f"{_name(n)} repeats the tokens")
    return v


def _pad(it: _Interpreter, n: Node):
    """``constant_pad_nd``: pads features; padding the tokens shifts them."""
    v = it.value(n.args[0])
    pad, rank = list(n.args[1]), _rank(n.args[0])
    if isinstance(v, _Tok):
        for k in range(0, len(pad), 2):
            d = rank - 1 - k // 2
            if d in v.dims and not (same_size(pad[k], 0) and same_size(pad[k + 1], 0)):
                raise _Combines(f"{_name(n)} pads the tokens")
    if it.step_scalar(n.args[1]):
        raise _Combines(f"{_name(n)} pads by the token count")
    return v


def _gather(it: _Interpreter, n: Node):
    """``gather(x, dim, index)`` along a feature dimension: per token when the index is."""
    x, idx, _ = _read_along(it, n)
    return it.agree(n, [t.dims for t in (x, idx) if isinstance(t, _Tok)])


# copies and casts: the values they are given (site's; a dropout is the identity where it is traced for inference)
_COPIES = IDENTITY_OPS | CAST_OPS | {aten.dropout.default}

_HANDLERS = {
    **{op: _same_value for op in _COPIES},
    **{op: _view for op in (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                            aten.flatten.using_ints, aten.unflatten.int)},
    **{op: _permute for op in (aten.transpose.int, aten.permute.default, aten.t.default)},
    aten.unsqueeze.default: _unsqueeze,
    **{op: _squeeze for op in (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)},
    aten.expand.default: _expand,
    **{op: _reduction for op in (aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default,
                                 aten.amax.default, aten.amin.default, aten.max.dim, aten.min.dim, aten.max.default,
                                 aten.min.default, aten.var.correction, aten.var.dim, aten.std.correction,
                                 aten.std.dim, aten.var_mean.correction, aten.logsumexp.default, aten.argmax.default,
                                 aten.argmin.default, aten.any.dim, aten.all.dim, aten.prod.dim_int,
                                 aten.norm.ScalarOpt_dim, aten.linalg_vector_norm.default, aten.median.dim,
                                 aten.median.default, aten.nansum.default, aten.nanmean.default, aten.std_mean.correction,
                                 aten.std_mean.dim, aten.var_mean.dim,
                                 aten.mode.default, aten.count_nonzero.dim_IntList, aten.aminmax.default,
                                 aten.kthvalue.default, aten.nanmedian.dim)},
    **{op: _along for op in (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
                             aten.cumsum.default, aten.cumprod.default, aten.sort.default, aten._safe_softmax.default,
                             aten.topk.default, aten.cummax.default, aten.cummin.default, aten.logcumsumexp.default,
                             aten.argsort.default, aten.msort.default)},
    **{op: _norm for op in (aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default)},
    aten.linear.default: _linear,
    **{op: _matmul for op in (aten.matmul.default, aten.mm.default, aten.bmm.default, aten.addmm.default,
                              aten.baddbmm.default)},
    aten.embedding.default: _embedding,
    aten.index.Tensor: _index,
    aten.index_select.default: _index_select,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.cat.default: _cat,
    **{op: _split for op in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)},
    aten.unbind.int: _unbind,
    aten.repeat.default: _repeat,
    aten.narrow.default: _narrow,
    **{op: _spatial for op in (aten.convolution.default, aten.conv1d.default, aten.conv2d.default,
                               aten.avg_pool1d.default, aten.max_pool1d.default, aten.avg_pool2d.default,
                               aten.max_pool2d.default, aten.adaptive_avg_pool1d.default,
                               aten.max_pool1d_with_indices.default)},
    aten.flip.default: _dims_op,
    aten.roll.default: _dims_op,
    aten.outer.default: _outer,
    aten.einsum.default: _einsum,
    aten.expand_as.default: _expand,
    aten.pad.default: _pad,
    aten.stack.default: _stack,
    aten.repeat_interleave.self_int: _repeat_interleave,
    aten.constant_pad_nd.default: _pad,
    aten.gather.default: _gather,
    **{op: _arange for op in (aten.arange.default, aten.arange.start, aten.arange.start_step)},
    **{op: _factory for op in (aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format,
                               aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                               aten.empty_like.default, aten.new_zeros.default, aten.new_ones.default,
                               aten.new_full.default, aten.new_empty.default, aten.scalar_tensor.default)},
}

_KEEPS_INDICES = frozenset({_same_value, _view, _permute, _unsqueeze, _squeeze, _expand, _slice, _select, _narrow,
                            _split, _unbind, _cat, _stack, _repeat})
