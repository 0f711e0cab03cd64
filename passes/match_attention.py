"""Find attention structurally: from each softmax back to Q·Kᵀ and forward to ·V; and SDPA calls.

The walk back from a softmax is a table of score steps (``_SCORE_STEPS``): each entry names the ops it
applies to, a guard on the node and a small handler that folds the step into the walk (a scale, a
soft-cap, a mask term, attention sinks) and returns the node before it. A site that cannot be matched
carries a :class:`NoMatch`, rendered into its reason in one place.

Sites are recorded in the pass context (``ctx.sites``); nothing in the graph changes here.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
from torch.fx import GraphModule, Node

from pagedattn.passes.context import PassContext, PassReport
from pagedattn.passes.site import (
    CAST_OPS,
    CONTRACTION_OPS,
    IDENTITY_OPS,
    INPLACE_ALIASES,
    MASK_LIMIT,
    SDPA_OPS,
    SOFTMAX_OPS,
    VIEW_OPS,
    AttentionSite,
    aten,
    same_size,
    scalar,
    shape,
    skip_identity,
)

log = logging.getLogger("pagedattn.passes")

_CHECK_OPS = {aten._assert_tensor_metadata.default}
_SCORE_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


# ------------------------------------------------------------------------ no-match reasons

NoMatchKind = Literal["not_attention", "untraced", "unsupported", "sinks"]

# how each kind of reason reads in the report
_REASON_PREFIX: dict[str, str] = {
    "not_attention": "not attention: ",  # no attention at all (a router): the softmax may stay as it is
    "untraced": "unsupported attention: ",  # attention-shaped, but its scores lead back to no Q·Kᵀ
    "unsupported": "",  # an attention with something the paged op cannot express
    "sinks": "",  # attention sinks the paged op cannot take
}


@dataclass(frozen=True)
class NoMatch:
    """Why a softmax or SDPA call is left as it is: a kind of reason and what the matcher found."""

    kind: NoMatchKind
    detail: str

    def render(self) -> str:
        """The reason as the site reports it."""
        return _REASON_PREFIX[self.kind] + self.detail


class _Unmatched(Exception):
    """Raised by a matcher to leave its site unmatched, for the reason ``why``."""

    def __init__(self, why: NoMatch):
        super().__init__(why.render())
        self.why = why


def _no_match(detail: str, kind: NoMatchKind = "unsupported") -> _Unmatched:
    """The exception that leaves a site unmatched (``raise _no_match(...)``)."""
    return _Unmatched(NoMatch(kind, detail))


_SINKS_IN_ANOTHER_FORM = NoMatch("sinks", "attention sinks in a form the paged op cannot take: extra logits "
                                          "concatenated to the scores must be one per head from model state, "
                                          "last, and sliced off after the softmax")


def _settle(why: NoMatch, anchor: Node, constants: frozenset[str], softmax: bool) -> NoMatch:
    """The reason a site is reported with, whatever step of its matcher failed.

    A softmax that is no attention at all says so, since it may stay as it is while an unmatched
    attention blocks paged mode; scores concatenated with extra logits are attention sinks in a form
    the paged op cannot take, unless the matcher already said what is wrong with the sinks.
    """
    if softmax and not _attention_like(anchor, constants):
        return NoMatch("not_attention", why.detail)
    if _has_sink_logits(anchor) and why.kind != "sinks":
        return _SINKS_IN_ANOTHER_FORM
    return why


# ---------------------------------------------------------------------------------- the pass


def match_attention(gm: GraphModule, ctx: PassContext) -> PassReport:
    """Record an :class:`AttentionSite` for every softmax and SDPA call, matched or with its reason."""
    matchers = {**{op: _match_softmax for op in SOFTMAX_OPS}, **{op: _match_sdpa for op in SDPA_OPS}}
    sites = []
    for node in gm.graph.nodes:
        match = matchers.get(node.target) if node.op == "call_function" else None
        if match is None:
            continue
        site = AttentionSite(name=f"attn_{len(sites)}:{node.name}", anchor=node)
        try:
            match(site, ctx.constant_inputs)
        except _Unmatched as e:
            why = _settle(e.why, node, ctx.constant_inputs, softmax=match is _match_softmax)
            site.skip(why.render())
            site.attention = why.kind != "not_attention"
        sites.append(site)
    ctx.sites = sites
    for s in sites:
        log.info("site %s: %s%s", s.name, s.status, f" ({s.reason})" if s.reason else "")
    matched = sum(s.status == "matched" for s in sites)
    return PassReport("match_attention", False, f"{matched} of {len(sites)} matched")


# ------------------------------------------------------------- attention or not at all

# ops that end a walk back from the scores: past a projection or an embedding lie other layers' results
_PROJECTIONS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.embedding.default}
_PASS_FORWARD = VIEW_OPS | CAST_OPS | {aten.slice.Tensor, aten.select.int, aten.clone.default,
                                       aten.contiguous.default, aten.dropout.default, aten.transpose.int,
                                       aten.permute.default, aten.expand.default, aten.unsqueeze.default,
                                       aten.narrow.default}
_STATE_PATH = _PASS_FORWARD | {aten.t.default, aten.numpy_T.default}


def _is_state(node, constants: frozenset[str], depth: int = 6) -> bool:
    """A parameter or buffer (through views and casts)."""
    while isinstance(node, Node) and depth > 0:
        if node.op == "get_attr":
            return True
        if node.op == "placeholder":
            return node.name in constants
        if node.op != "call_function" or node.target not in _STATE_PATH:
            return False
        node = node.args[0]
        depth -= 1
    return False


def _activation_contraction(node: Node, constants: frozenset[str]) -> bool:
    """A matmul/bmm/einsum of two activations (not activation × weight)."""
    if node.target not in CONTRACTION_OPS:
        return False
    ops = node.args[1] if node.target is aten.einsum.default else node.args[:2]
    if node.target is aten.baddbmm.default:
        ops = node.args[1:3]
    return not any(_is_state(o, constants) for o in ops)


def _has_sink_logits(sm: Node, depth: int = 4) -> bool:
    """Scores concatenated with other logits along the key dimension before the softmax (attention sinks)."""
    frontier = [sm.args[0]]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if not isinstance(n, Node) or n.op != "call_function":
                continue
            if n.target is aten.cat.default and _cat_dim(n) in (-1, len(shape(n) or ()) - 1):
                return True
            nxt.extend(n.all_input_nodes)
        frontier = nxt
    return False


def _attention_like(sm: Node, constants: frozenset[str]) -> bool:
    """Whether a softmax is attention-shaped: its scores come from (or its output feeds) a product of
    activations.

    A softmax that is attention but could not be matched must block paged mode; one that is not
    attention at all (an MoE router: softmax of a projection) can stay as it is.
    """
    seen, frontier = set(), [sm.args[0]]
    for _ in range(24):
        nxt = []
        for n in frontier:
            if not isinstance(n, Node) or n in seen or n.op != "call_function" or n.target in _PROJECTIONS:
                continue
            seen.add(n)
            if _activation_contraction(n, constants):
                return True
            nxt.extend(n.all_input_nodes)
        frontier = nxt
    frontier = [sm]
    for _ in range(8):
        nxt = []
        for n in frontier:
            for u in n.users:
                if _activation_contraction(u, constants):
                    return True
                if u.target in _PASS_FORWARD or u.target is operator.getitem:
                    nxt.append(u)
        frontier = nxt
    return False


# ------------------------------------------------------------------ the softmax matcher


def _match_softmax(site: AttentionSite, constants: frozenset[str]) -> None:
    """softmax(f(Q·Kᵀ))·V: the score walk back to Q·Kᵀ, the probabilities on to ·V, the operands."""
    sm = site.anchor
    if sm.args[1] not in (-1, len(shape(sm) or ()) - 1):
        raise _no_match("softmax is not over the last dimension")
    walk = _ScoreWalk(site, constants)
    qk = _walk_to_contraction(walk, sm.args[0])
    q, kt, extra_scale = _qk_operands(walk, qk)
    pv, v, layout = _find_pv(sm, drop_sink=site.sinks is not None)
    lse_scaled = _outside_readers(sm, walk.path + [qk], pv, site, constants)
    if lse_scaled is not None:
        site.sinks = lse_scaled[0]
    site.scale, site.softcap = walk.scale * extra_scale, walk.softcap
    _set_operands(site, q, kt, v, pv, layout, key_is_transposed=True)
    if lse_scaled is not None:
        site.output = lse_scaled[1]  # the sink's rescaling of softmax·V is part of the site
    if site.sinks is not None and shape(site.sinks) is not None and \
            torch.Size(shape(site.sinks)).numel() != site.num_heads:
        raise _no_match(f"attention sinks hold {torch.Size(shape(site.sinks)).numel()} logits for "
                        f"{site.num_heads} query heads", "sinks")


def _outside_readers(sm: Node, path: list, pv: Node, site: AttentionSite, constants: frozenset[str]):
    """Refuse scores read outside the softmax, but for a log-sum-exp sink rescaling (-> (state, product))."""
    outside = [u for _, u in _outside_users(sm, path)]
    lse_scaled = None
    if len(outside) == 1 and site.sinks is None:
        lse_scaled = _lse_sink(outside[0], sm, pv, constants)
    if outside and lse_scaled is None:
        raise _no_match(f"the scores also feed {_op_name(outside[0])} outside the softmax: a paged step "
                        "would compute it over the step's own keys only")
    return lse_scaled


# ------------------------------------------------------------------------ the score walk


@dataclass
class _ScoreWalk:
    """What the walk from the softmax back to Q·Kᵀ has gathered so far.

    ``scale`` and ``softcap`` are folded from the steps passed; ``path`` records the score nodes passed
    (their other readers are checked later); mask terms and sinks go straight onto ``site``.
    """

    site: AttentionSite
    constants: frozenset[str]
    scale: float = 1.0
    softcap: Optional[float] = None
    path: list[Node] = field(default_factory=list)


@dataclass(frozen=True)
class _Step:
    """One spelling of a step on the score path: the ops it applies to, a guard on the node, and the
    handler that folds the step into the walk and returns the node before it (or refuses the site)."""

    ops: frozenset
    take: Callable[[_ScoreWalk, Node], Node]
    when: Callable[[_ScoreWalk, Node], bool] = lambda walk, x: True


def _walk_to_contraction(walk: _ScoreWalk, x) -> Node:
    """Walk back from the softmax input through ``_SCORE_STEPS`` to the Q·Kᵀ contraction; return it."""
    while True:
        x = _skip_recording(x, walk.path)
        if not isinstance(x, Node) or x.op != "call_function":
            raise _no_match("no Q·Kᵀ product feeds the softmax")
        t = INPLACE_ALIASES.get(x.target, x.target)
        if t in CONTRACTION_OPS:
            return x
        walk.path.append(x)
        step = next((s for s in _SCORE_STEPS if t in s.ops and s.when(walk, x)), None)
        if step is None:
            raise _unknown_step(x)
        x = step.take(walk, x)


def _unknown_step(x: Node) -> _Unmatched:
    """An op on the score path that no step takes: the scores come from elsewhere, or a step is unknown."""
    if not _leads_to_contraction(x):
        return _no_match(f"the softmax input comes from {_op_name(x)}, not from a Q·Kᵀ product",
                         "untraced")
    return _no_match(f"{_op_name(x)} between Q·Kᵀ and softmax")


def _through_view(walk: _ScoreWalk, x: Node) -> Node:
    """A view that only splits or merges the leading dims of the scores ([B*H, S, L] <-> [B, H, S, L])."""
    return x.args[0]


def _soft_cap(walk: _ScoreWalk, x: Node) -> Node:
    """``tanh(s / c) * c``: a soft-cap of ``c`` on the scores ``s``; any scale must come before it."""
    if walk.scale != 1.0:
        raise _no_match("the scores are scaled after the soft-cap")
    cap, inner = _softcap_of(x)
    _record_chain(_scalar_arg(x)[1], inner, walk.path)
    walk.softcap = cap
    return inner


def _scalar_scale(walk: _ScoreWalk, x: Node) -> Node:
    """``s * c`` (either side) for a number ``c``: a factor of the scale."""
    c, other = _scalar_arg(x)
    walk.scale *= c
    return other


def _scalar_divisor(walk: _ScoreWalk, x: Node) -> Node:
    """``s / c`` for a number ``c``: a divisor of the scale."""
    walk.scale /= scalar(x.args[1])
    return x.args[0]


def _additive_term(walk: _ScoreWalk, x: Node) -> Node:
    """``s + m`` (either side): an additive mask or bias, weighted by the scale folded so far."""
    a, b = x.args[:2]
    path, bias = (a, b) if _leads_to_contraction(a) else (b, a)
    if walk.softcap is not None:
        raise _no_match("an additive bias applied before the soft-cap")
    alpha = x.kwargs.get("alpha", 1)
    # s + alpha * m scales the bias; m + alpha * s scales the scores themselves
    walk.site.biases.append((bias, walk.scale * (alpha if path is a else 1)))
    if path is b:
        walk.scale *= alpha
    return path


def _clamp_below(walk: _ScoreWalk, x: Node) -> Node:
    """Scores clamped from below at a huge negative value: only -inf changes, to a mask value."""
    return x.args[0]


def _tensor_factor(walk: _ScoreWalk, x: Node) -> Node:
    """``s * f`` with ``f`` a tensor of its own: a scale held in a one-element tensor, else a 0/1 mask."""
    if walk.softcap is not None:
        raise _no_match("the scores are multiplied by a tensor before the soft-cap")
    a, b = x.args[:2]
    path, factor = (a, b) if _leads_to_contraction(a) else (b, a)
    if (c := _const_value(factor)) is not None:
        walk.scale *= c
    else:  # checked to be a 0/1 mask when classified, against the terms recorded before it
        walk.site.factors.append((factor, len(walk.site.biases), len(walk.site.conds)))
    return path


def _minus_row_constant(walk: _ScoreWalk, x: Node) -> Node:
    """Minus the row maximum (for stability): softmax(s - c) == softmax(s)."""
    return x.args[0]


def _sink_column(walk: _ScoreWalk, x: Node) -> Node:
    """``cat([s, sinks], -1)``: one attention-sink logit per head from model state."""
    if walk.site.sinks is not None:
        raise _no_match("attention sinks concatenated twice", "sinks")
    if walk.softcap is not None or walk.scale != 1:  # the op adds its sinks as they are, past the scale and cap
        raise _no_match("attention sinks concatenated before the scores are scaled or soft-capped", "sinks")
    scores, walk.site.sinks = _sink_concat(x, walk.constants)
    return scores


def _masked_fill(walk: _ScoreWalk, x: Node) -> Node:
    """``s.masked_fill(m, -inf)``: a boolean mask, keeping the scores where ``m`` is false."""
    if not _is_neg_fill(x.args[2]):
        raise _no_match(f"masked_fill with {x.args[2]} is not a mask")
    if walk.softcap is not None:  # tanh(-inf) is finite: the keys it fills stay visible
        raise _no_match("a mask applied before the soft-cap")
    walk.site.conds.append((x.args[1], False))
    return x.args[0]


def _where_mask(walk: _ScoreWalk, x: Node) -> Node:
    """``where(m, s, -inf)`` or ``where(m, -inf, s)``: a boolean mask."""
    cond, a, b = x.args[:3]
    if walk.softcap is not None and (_is_neg_fill(a) or _is_neg_fill(b)):  # tanh(-inf) is finite: keys stay visible
        raise _no_match("a mask applied before the soft-cap")
    if _is_neg_fill(b) and _leads_to_contraction(a):
        walk.site.conds.append((cond, True))
        return a
    if _is_neg_fill(a) and _leads_to_contraction(b):
        walk.site.conds.append((cond, False))
        return b
    raise _no_match("torch.where on the scores is not a mask")


def _two_tensors(x: Node) -> bool:
    """Both operands of a binary op are graph nodes (no number)."""
    return all(isinstance(a, Node) for a in x.args[:2])


def _one_side_scores(x: Node) -> bool:
    """Exactly one operand of a binary op leads back to Q·Kᵀ: the other is a term of its own."""
    return _leads_to_contraction(x.args[0]) != _leads_to_contraction(x.args[1])


def _no_upper_bound(x: Node) -> bool:
    """A clamp from below only: ``clamp_min(s, lo)`` or ``clamp(s, lo)``."""
    return len(x.args) < 3 or x.args[2] is None


_MULS = frozenset({aten.mul.Tensor, aten.mul.Scalar})
_DIVS = frozenset({aten.div.Tensor, aten.div.Scalar})
_MAXIMUMS = frozenset({aten.maximum.default, aten.max.other})
_CLAMPS = frozenset({aten.clamp_min.default, aten.clamp.default})
_MASKED_FILLS = frozenset({aten.masked_fill.Scalar, aten.masked_fill.Tensor})
_WHERES = frozenset({aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf})

# The spellings of score steps, tried in order (in-place ops read as their functional form): the first
# entry whose ops hold the node's and whose guard passes takes the step; an op none takes ends the walk
# (``_unknown_step``). Order matters where entries share an op: a ``mul`` by a number is a soft-cap before
# it is a scale, and a ``mul.Tensor`` of the scores by a tensor is a 0/1 factor only when no number is
# involved (a one-element constant tensor is a scale again, see ``_tensor_factor``).
_SCORE_STEPS: tuple[_Step, ...] = (
    _Step(frozenset(_SCORE_VIEWS), _through_view, lambda w, x: _keeps_last_two(x)),
    _Step(_MULS, _soft_cap, lambda w, x: _scalar_arg(x) is not None and _softcap_of(x) is not None),
    _Step(_MULS, _scalar_scale, lambda w, x: _scalar_arg(x) is not None),
    _Step(_DIVS, _scalar_divisor, lambda w, x: scalar(x.args[1]) is not None),
    _Step(frozenset({aten.add.Tensor}), _additive_term, lambda w, x: _two_tensors(x)),
    _Step(_MAXIMUMS, _clamp_below, lambda w, x: _is_neg_fill(x.args[1])),
    _Step(_CLAMPS, _clamp_below, lambda w, x: _is_neg_fill(x.args[1]) and _no_upper_bound(x)),
    _Step(frozenset({aten.mul.Tensor}), _tensor_factor, lambda w, x: _two_tensors(x) and _one_side_scores(x)),
    _Step(frozenset({aten.sub.Tensor}), _minus_row_constant,
          lambda w, x: _row_constant(x.args[1], x.args[0])),
    _Step(frozenset({aten.cat.default}), _sink_column, lambda w, x: _sink_concat(x, w.constants) is not None),
    _Step(_MASKED_FILLS, _masked_fill),
    _Step(_WHERES, _where_mask),
)


# ------------------------------------------------------------------- score-step helpers


def _keeps_last_two(node: Node) -> bool:
    """A view that only splits or merges leading dims, e.g. [B*H, S, L] <-> [B, H, S, L]."""
    a, b = shape(node.args[0]), shape(node)
    return bool(a and b and len(a) >= 2 and len(b) >= 2 and same_size(a[-1], b[-1])
                and same_size(a[-2], b[-2]))


def _leads_to_contraction(node, depth: int = 12) -> bool:
    """Whether a chain of inputs of ``node`` (``depth`` ops at most) reaches a contraction: the score side."""
    while isinstance(node, Node) and depth > 0:
        if node.target in CONTRACTION_OPS:
            return True
        if node.op != "call_function" or not node.args:
            return False
        nxt = [a for a in node.args if isinstance(a, Node)]
        if not nxt:
            return False
        if len(nxt) > 1:
            return any(_leads_to_contraction(a, depth - 1) for a in nxt)
        node = nxt[0]
        depth -= 1
    return False


def _const_value(x) -> Optional[float]:
    """A number, or a one-element constant tensor of the graph (``torch.tensor(finfo.min)``), or None."""
    v = scalar(x)
    if v is not None:
        return v
    x = skip_identity(x)
    if isinstance(x, Node) and x.op == "call_function" and x.target is aten.full.default and not x.args[0] \
            and scalar(x.args[1]) is not None:
        return scalar(x.args[1])  # a 0-d tensor filled in the graph
    if isinstance(x, Node) and x.op == "call_function" and x.target is aten.lift_fresh_copy.default:
        x = x.args[0]
    if isinstance(x, Node) and x.op == "get_attr" and x.graph.owning_module is not None:
        t = x.graph.owning_module
        for part in x.target.split("."):
            t = getattr(t, part, None)
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and t.numel() == 1:
            return float(t.reshape(()))
    return None


def _is_neg_fill(x) -> bool:
    """A constant at or below the mask limit (-inf, finfo.min, -1e4): a fill that masks a score out."""
    v = _const_value(x)
    return v is not None and v <= MASK_LIMIT


def _skip_recording(x, path: list):
    """``skip_identity`` that records the nodes it passes."""
    while isinstance(x, Node) and skip_identity(x) is not x:
        path.append(x)
        x = x.args[0]
    return x


def _record_chain(top: Node, bottom: Node, path: list) -> None:
    """Record the single-input chain from ``top`` down to ``bottom`` (e.g. a soft-cap's tanh and division)."""
    n = top
    for _ in range(8):
        if not isinstance(n, Node) or n is bottom:
            return
        path.append(n)
        nxt = [a for a in n.all_input_nodes if scalar(a) is None and _const_value(a) is None]
        n = nxt[0] if nxt else None


def _row_constant(c, x) -> bool:
    """``c`` is constant along the key dimension of the scores ``x`` (e.g. their row max): size 1 there."""
    sc, sx = shape(c), shape(x)
    return bool(sc and sx and len(sc) <= len(sx) and same_size(sc[-1], 1) and not same_size(sx[-1], 1))


def _scalar_arg(node: Node):
    """``x * c`` or ``c * x`` with ``c`` a number -> ``(c, x)``; else None."""
    a, b = node.args[:2]
    if scalar(b) is not None and isinstance(a, Node):
        return scalar(b), a
    if scalar(a) is not None and isinstance(b, Node):
        return scalar(a), b
    return None


def _softcap_of(mul: Node):
    """``tanh(y / c) * c`` -> ``(c, y)``."""
    c, inner = _scalar_arg(mul)
    inner = skip_identity(inner)
    if not (isinstance(inner, Node) and inner.target is aten.tanh.default):
        return None
    d = skip_identity(inner.args[0])
    if d.target in (aten.div.Tensor, aten.div.Scalar) and scalar(d.args[1]) is not None:
        if abs(scalar(d.args[1]) - c) <= 1e-6 * abs(c):
            return c, d.args[0]
    if d.target in (aten.mul.Tensor, aten.mul.Scalar) and _scalar_arg(d) is not None:
        k, y = _scalar_arg(d)
        if abs(k * c - 1) <= 1e-6:
            return c, y
    return None


def _strip_scalar(node):
    """``x * c`` / ``x / c`` (through casts) -> (x, c)."""
    factor = 1.0
    while True:
        n = skip_identity(node)
        if isinstance(n, Node) and n.target in (aten.mul.Tensor, aten.mul.Scalar) and _scalar_arg(n):
            c, node = _scalar_arg(n)
            factor *= c
        elif isinstance(n, Node) and n.target in (aten.div.Tensor, aten.div.Scalar) and scalar(n.args[1]):
            factor /= scalar(n.args[1])
            node = n.args[0]
        else:
            return node, factor


def _op_name(node: Node) -> str:
    """The op's short name for reasons (``matmul``, not ``aten.matmul.default``)."""
    return getattr(node.target, "__name__", str(node.target))


# -------------------------------------------------------------- readers of the scores


_HARMLESS_USERS = _CHECK_OPS | {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int}


def _outside_users(sm: Node, path: list) -> list:
    """(node, user) pairs where a score node is read by something other than the next step to the softmax."""
    inside = set(path) | {sm}
    return [(n, u) for n in path for u in n.users
            if u not in inside and u.target not in _HARMLESS_USERS and not _only_recentres(u, inside)
            and not _reads_metadata_only(u, n)]


# ``x.type_as(scores)``, ``mask.expand_as(scores)`` (XLM): only the scores' dtype or shape is read
_READS_METADATA_OF_ARG1 = {aten.type_as.default, aten.expand_as.default, aten.view_as.default,
                           aten.reshape_as.default}


def _reads_metadata_only(u: Node, n: Node) -> bool:
    """``u`` reads only the dtype or shape of ``n`` (its second argument)."""
    return u.target in _READS_METADATA_OF_ARG1 and u.args[1] is n and u.args[0] is not n


def _only_recentres(u: Node, inside: set, depth: int = 4) -> bool:
    """``u`` (e.g. the row max) flows only into the row-constant term subtracted from the scores."""
    if not u.users:
        return u.target is operator.getitem  # an unread part of a tuple (the max's indices)
    for w in u.users:
        if w in inside:
            if not (w.target is aten.sub.Tensor and w.args[1] is u):
                return False
        elif depth == 0 or not _only_recentres(w, inside, depth - 1):
            return False
    return True


# ---------------------------------------------------------------------- attention sinks


def _lse_sink(lse: Node, sm: Node, pv: Node, constants: frozenset[str]):
    """Sinks applied after the fact: ``(softmax(s)·V) * sigmoid(logsumexp(s) - sinks)``
    -> (state, the product)."""
    if lse.target is not aten.logsumexp.default \
            or skip_identity(lse.args[0]) is not skip_identity(sm.args[0]):
        return None
    dims = lse.args[1] if len(lse.args) > 1 else None
    nd = len(shape(lse.args[0]) or ())
    if list(dims or []) not in ([-1], [nd - 1]) or (len(lse.args) > 2 and lse.args[2]):
        return None
    n, sink, seen_sigmoid = lse, None, False
    for _ in range(12):
        users = [u for u in n.users if u.target not in _CHECK_OPS]
        if len(users) != 1:
            return None
        u = users[0]
        if u.target is aten.sub.Tensor and u.args[0] is n and sink is None:
            root, _ = _sink_source(u.args[1])
            sr = shape(root)
            if not _is_state(root, constants) or sr is None \
                    or torch.Size(sr).numel() != (shape(lse) or (0, 0))[-2]:
                return None
            sink = root
        elif u.target is aten.sigmoid.default and sink is not None:
            seen_sigmoid = True
        elif u.target is aten.mul.Tensor and seen_sigmoid and pv in u.args[:2] and shape(u) == shape(pv):
            return sink, u
        elif not (u.target in CAST_OPS or u.target in IDENTITY_OPS or
                  (u.target is aten.unsqueeze.default and u.args[1] in (-1, len(shape(n) or ())))):
            return None
        n = u
    return None


# ops a per-head sink parameter passes through on its way to a [B, H, S, 1] column
_SINK_PATH = VIEW_OPS | CAST_OPS | {aten.expand.default, aten.unsqueeze.default, aten.clone.default,
                                    aten.contiguous.default, aten.alias.default, aten.detach.default}


def _sink_source(node):
    """Walk a sink term back through views, casts and broadcasts: (source node, value before broadcasting)."""
    n, pre = node, node
    while isinstance(n, Node) and n.op == "call_function" and n.target in _SINK_PATH:
        if n.target is aten.expand.default:
            pre = n.args[0]
        n = n.args[0]
    return n, pre


def _cat_dim(cat: Node) -> int:
    """The dimension a ``cat`` joins along."""
    return cat.args[1] if len(cat.args) > 1 else 0


def _sink_concat(cat: Node, constants: frozenset[str]):
    """``cat([scores, sinks], -1)`` with one sink logit per head from model state -> (scores, state node)."""
    tensors = cat.args[0]
    dim = _cat_dim(cat)
    out = shape(cat)
    if out is None or dim not in (-1, len(out) - 1) or len(tensors) != 2:
        return None
    scores, col = tensors
    sc = shape(col)
    if not sc or len(sc) < 3 or not same_size(sc[-1], 1) or not isinstance(sc[-3], int):
        return None
    heads = sc[-3]
    n, pre = _sink_source(col)
    # views keep the flat order; before broadcasting, the heads must sit at dim -3 with all else 1
    sp = shape(pre)
    if not _is_state(n, constants) or sp is None or len(sp) < 3 or sp[-3] != heads \
            or torch.Size(sp).numel() != heads or shape(n) is None or torch.Size(shape(n)).numel() != heads:
        return None
    return scores, n


# ---------------------------------------------------------------------- Q·Kᵀ and P·V


def _qk_operands(walk: _ScoreWalk, qk: Node):
    """(q-like [*, S, D], kᵀ-like [*, D, L], scale) of the score contraction; ``baddbmm``'s added input
    is a bias weighted by the scale the walk folded after it."""
    t = qk.target
    if t in (aten.matmul.default, aten.bmm.default):
        return qk.args[0], qk.args[1], 1.0
    if t is aten.baddbmm.default:
        beta = qk.kwargs.get("beta", 1)
        alpha = qk.kwargs.get("alpha", 1)
        if beta != 0:
            if walk.softcap is not None:
                raise _no_match("an additive bias applied before the soft-cap")
            walk.site.biases.append((qk.args[0], walk.scale * float(beta)))
        return qk.args[1], qk.args[2], float(alpha)
    if t is aten.einsum.default:
        return _einsum_qk(qk)
    raise _no_match(f"unsupported contraction {_op_name(qk)}")


def _parse_einsum(eq: str):
    """A two-operand equation -> (letters of a, letters of b, output letters); no ellipsis or repeats."""
    if eq.count("->") != 1 or eq.split("->")[0].count(",") != 1:
        raise _no_match(f"einsum '{eq}' has no explicit output or not two operands")
    lhs, out = eq.replace(" ", "").split("->")
    a, b = lhs.split(",")
    if "." in eq or len(set(a)) != len(a) or len(set(b)) != len(b):
        raise _no_match(f"einsum '{eq}' uses ellipsis or repeated letters")
    return a, b, out


def _einsum_qk(node: Node):
    """A batched Q·Kᵀ einsum -> q and kᵀ as permutes to [batch..., S, D] and [batch..., D, L]."""
    eq, ops = node.args[0], node.args[1]
    if len(ops) != 2:
        raise _no_match("einsum with more than two operands")
    a, b, out = _parse_einsum(eq)
    contracted = [c for c in a if c in b and c not in out]
    q_letter = [c for c in a if c in out and c not in b]
    k_letter = [c for c in b if c in out and c not in a]
    batch = [c for c in out if c in a and c in b]
    if len(contracted) != 1 or len(q_letter) != 1 or len(k_letter) != 1 \
            or out != "".join(batch) + q_letter[0] + k_letter[0]:
        raise _no_match(f"einsum '{eq}' is not a batched Q·Kᵀ")
    if len(a) != len(batch) + 2 or len(b) != len(batch) + 2:
        raise _no_match(f"einsum '{eq}' has broadcast letters")
    d = contracted[0]
    q_perm = [a.index(c) for c in batch] + [a.index(q_letter[0]), a.index(d)]
    kt_perm = [b.index(c) for c in batch] + [b.index(d), b.index(k_letter[0])]
    return ("permute", ops[0], q_perm), ("permute", ops[1], kt_perm), 1.0


def _passes_probabilities(u: Node, p: Node) -> bool:
    """``u`` hands the probabilities ``p`` on unchanged: a cast, a copy, a head view, inactive dropout."""
    return (u.target in CAST_OPS or u.target in (aten.clone.default, aten.contiguous.default)
            or (u.target in _SCORE_VIEWS and _keeps_last_two(u))
            # matmul below dispatch: expand to the same shape, then a 3-D view into bmm
            or (u.target is aten.expand.default and shape(u) == shape(p))
            or (u.target is aten.dropout.default and (u.args[1] == 0 or u.args[2] is False)))


def _find_pv(sm: Node, drop_sink: bool = False):
    """Forward from the softmax through casts/dropout to the ·V contraction: (pv node, v, layout).

    ``drop_sink``: the last column holds attention-sink probabilities, sliced off before ·V.
    """
    p = sm
    while True:
        users = [u for u in p.users if u.target not in _CHECK_OPS]
        if len(users) != 1:
            raise _no_match("attention probabilities are used elsewhere (e.g. returned as attention weights)")
        u = users[0]
        if _passes_probabilities(u, p):
            p = u
            continue
        if u.target is aten.dropout.default:
            raise _no_match("dropout is active on the attention probabilities (model in training mode?)")
        if drop_sink and _drops_last_column(u, p):
            drop_sink, p = False, u
            continue
        break
    if drop_sink:
        raise _no_match("the attention-sink column is not sliced off the probabilities before ·V", "sinks")
    if u.target in (aten.matmul.default, aten.bmm.default) and u.args[0] is p:
        return u, u.args[1], None
    if u.target is aten.einsum.default and u.args[1][0] is p and len(u.args[1]) == 2:
        return _einsum_pv(u)
    raise _no_match(f"softmax output feeds {_op_name(u)}, not a ·V product")


def _einsum_pv(u: Node):
    """A P·V einsum -> (u, v as a permute to [batch..., L, Dv], the permute of [batch..., S, Dv] onto u)."""
    a, b, out = _parse_einsum(u.args[0])
    k = [c for c in a if c in b and c not in out]
    q = [c for c in a if c in out and c not in b]
    d = [c for c in b if c in out and c not in a]
    batch = [c for c in a if c in b and c in out]
    if len(k) != 1 or len(q) != 1 or len(d) != 1 or a != "".join(batch) + q[0] + k[0] \
            or len(b) != len(batch) + 2:
        raise _no_match(f"einsum '{u.args[0]}' is not P·V")
    v_perm = [b.index(c) for c in batch] + [b.index(k[0]), b.index(d[0])]
    canon = "".join(batch) + q[0] + d[0]
    out_perm = [canon.index(c) for c in out]
    return u, ("permute", u.args[1][1], v_perm), ("permute", out_perm)


def _drops_last_column(u: Node, p: Node) -> bool:
    """``u`` is ``p[..., :-1]``: the attention-sink column sliced off the probabilities."""
    if u.target is not aten.slice.Tensor or u.args[0] is not p:
        return False
    sp = shape(p)
    args = list(u.args) + [None] * (5 - len(u.args))
    dim, start, end, step = args[1], args[2], args[3], args[4]
    if sp is None or dim not in (-1, len(sp) - 1) or start not in (None, 0) or step not in (None, 1):
        return False
    return end == -1 or (end is not None and same_size(end, sp[-1] - 1))


# ------------------------------------------------------------------------- operands


def _materialize(gm_graph, spec, before: Node) -> Node:
    """Operands may be ``("permute", node, perm)``: insert that permute."""
    if isinstance(spec, tuple) and spec[0] == "permute":
        _, node, perm = spec
        if perm == list(range(len(perm))):
            return node
        with gm_graph.inserting_before(before):
            n = gm_graph.call_function(aten.permute.default, (node, perm))
            n.meta["val"] = node.meta["val"].permute(perm)
        return n
    return spec


def _recover_4d(node: Node) -> Optional[Node]:
    """A ``[B*H, S, D]`` operand built by reshaping ``[B, H, S, D]``: return the 4-D node."""
    n = skip_identity(node)
    if isinstance(n, Node) and n.target in VIEW_OPS:
        src = skip_identity(n.args[0])
        if isinstance(src, Node) and src.target is aten.expand.default and shape(src) == shape(src.args[0]):
            src = skip_identity(src.args[0])  # matmul below dispatch: expand to the same shape, then view
        s_src, s_dst = shape(src), shape(n)
        if s_src and len(s_src) == 4 and len(s_dst) == 3 and same_size(s_src[0] * s_src[1], s_dst[0]) \
                and same_size(s_src[2], s_dst[1]) and same_size(s_src[3], s_dst[2]):
            return src
    return None


def _all_4d(*nodes: Node) -> Optional[tuple]:
    """The operands with each 3-D one replaced by the 4-D node it was reshaped from; None if one was not."""
    heads = tuple(x if len(shape(x)) == 4 else _recover_4d(x) for x in nodes)
    return None if any(x is None for x in heads) else heads


def _flattened(layout, out: Node):
    """The output layout where the site's output is the 3-D [B*H, S, Dv] of a flattened attention."""
    if len(shape(out)) == 3:
        return layout or ("flatten",)
    return layout


def _strip_repeat_kv(node: Node, num_heads: int):
    """``[B, Hkv, L, D]`` repeated to ``[B, Hq, L, D]`` (expand+reshape or repeat_interleave) -> (kv, Hkv)."""
    n = skip_identity(node)
    if n.target is aten.repeat_interleave.self_int:
        reps = n.args[1]
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
        if dim in (1, -3) and isinstance(reps, int):
            return n.args[0], num_heads // reps
    if n.target in VIEW_OPS:
        e = skip_identity(n.args[0])
        if e.target is aten.expand.default:
            u = skip_identity(e.args[0])
            if u.target is aten.unsqueeze.default and u.args[1] == 2:
                src = u.args[0]
                s = shape(src)
                if s and len(s) == 4 and isinstance(s[1], int) and num_heads % s[1] == 0:
                    return src, s[1]
    return node, None


def _set_operands(site: AttentionSite, q, kt, v, out: Node, layout, key_is_transposed: bool,
                  grouped: bool = False) -> None:
    """Bring q, k(ᵀ), v to the canonical 4-D [B, H, S, D] operands (recovering heads of a flattened 3-D
    attention, folding scalars on q or k into the scale), then record them and the head layout."""
    graph = out.graph
    q = _materialize(graph, q, out)
    kt = _materialize(graph, kt, out)
    v = _materialize(graph, v, out)
    sq, sk, sv = shape(q), shape(kt), shape(v)
    if sq is None or sk is None or sv is None:
        raise _no_match("operand shapes are unknown")
    if 3 in (len(sq), len(sk), len(sv)):
        # 4-D operands flattened to 3-D for bmm (matmul below dispatch): Kᵀ itself may be one
        heads = _all_4d(q, kt, v)
        if heads is not None:
            q, kt, v = heads
            sq = shape(q)
            layout = _flattened(layout, out)
    k = _transpose_back(graph, kt, out) if key_is_transposed else kt
    # scalars applied to q or k alone fold into the one scale
    q, qs = _strip_scalar(q)
    k, ks = _strip_scalar(k)
    site.scale *= qs * ks
    if len(sq) == 3 or len(sv) == 3:
        # scores from a 3-D bmm may meet 4-D values after a view (and the other way round)
        heads = _all_4d(q, k, v)
        if heads is None:
            raise _no_match("could not recover the heads of a 3-D [batch*heads, seq, dim] attention")
        q, k, v = heads
        layout = _flattened(layout, out)
    elif len(sq) != 4:
        raise _no_match(f"{len(sq)}-D attention operands")
    _set_heads(site, q, k, v, out, layout, grouped)


def _set_heads(site: AttentionSite, q: Node, k: Node, v: Node, out: Node, layout, grouped: bool) -> None:
    """Record 4-D operands with their head counts: query heads grouped evenly over kv heads (GQA/MQA)."""
    sq, sk, sv = shape(q), shape(k), shape(v)
    if len(sk) != 4 or len(sv) != 4:
        raise _no_match("key/value are not 4-D")
    num_heads = sq[1]
    if not isinstance(num_heads, int):
        raise _no_match("the number of heads is not static")
    k, hk = _strip_repeat_kv(k, num_heads)
    v, hv = _strip_repeat_kv(v, num_heads)
    sk, sv = shape(k), shape(v)
    if hk != hv or sk[1] != sv[1]:
        raise _no_match("keys and values have different head layouts")
    if not (same_size(sk[0], sq[0]) and same_size(sv[0], sq[0])):
        raise _no_match("query and key batch sizes differ (broadcast over batch)")
    hkv = sk[1]
    if not isinstance(hkv, int) or num_heads % hkv:
        raise _no_match(f"{num_heads} query heads do not group over {hkv} kv heads")
    if hkv != num_heads and hkv != 1 and hk is None and not grouped:
        raise _no_match("key heads broadcast in a way that is not GQA")
    site.query, site.key, site.value, site.output, site.output_layout = q, k, v, out, layout
    site.num_heads, site.num_kv_heads, site.head_dim = num_heads, hkv, sq[3]
    if not isinstance(sq[3], int) or not isinstance(sv[3], int):
        raise _no_match("head size is not static")


def _transpose_back(graph, kt: Node, before: Node) -> Node:
    """K from Kᵀ: the input of a transpose of the last two dims, else one inserted before ``before``."""
    src = skip_identity(kt, casts=False)
    if src.target is aten.transpose.int and sorted(d % 4 if len(shape(src)) == 4 else d % 3
                                                   for d in src.args[1:3]) == (
            [2, 3] if len(shape(src)) == 4 else [1, 2]):
        return src.args[0]
    nd = len(shape(kt))
    with graph.inserting_before(before):
        n = graph.call_function(aten.transpose.int, (kt, nd - 2, nd - 1))
        n.meta["val"] = kt.meta["val"].transpose(nd - 2, nd - 1)
    return n


# --------------------------------------------------------------------------------- SDPA

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _match_sdpa(site: AttentionSite, constants: frozenset[str]) -> None:
    """``scaled_dot_product_attention``: its arguments are the site (a boolean mask keeps where true)."""
    n = site.anchor
    args = dict(zip(_SDPA_ARGS, n.args))
    args.update(n.kwargs)
    if args.get("dropout_p", 0.0):
        raise _no_match("SDPA with dropout_p > 0")
    q = args["query"]
    sq = shape(q)
    if sq is None or len(sq) != 4:
        raise _no_match("SDPA on non 4-D inputs")
    scale = args.get("scale")
    site.scale = float(scale) if scale is not None else sq[-1] ** -0.5
    site.sdpa_causal = bool(args.get("is_causal", False))
    mask = args.get("attn_mask")
    if mask is not None:
        mv = mask.meta.get("val")
        if mv is not None and mv.dtype == torch.bool:
            site.conds.append((mask, True))
        else:
            site.biases.append((mask, 1.0))
    _set_operands(site, q, args["key"], args["value"], n, None, key_is_transposed=False,
                  grouped=bool(args.get("enable_gqa", False)))
