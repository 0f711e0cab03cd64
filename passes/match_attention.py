"""Find attention structurally: from each softmax back to Q·Kᵀ and forward to ·V; and SDPA calls.

Sites are recorded in the pass context (``ctx.sites``); nothing in the graph changes here.
"""

from __future__ import annotations

import logging
import operator
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from pagedattn.passes.context import PassContext, PassReport
from pagedattn.passes.site import (
    MASK_LIMIT,
    CAST_OPS,
    CONTRACTION_OPS,
    IDENTITY_OPS,
    INPLACE_ALIASES,
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


def _keeps_last_two(node: Node) -> bool:
    """A view that only splits or merges leading dims, e.g. [B*H, S, L] <-> [B, H, S, L]."""
    a, b = shape(node.args[0]), shape(node)
    return bool(a and b and len(a) >= 2 and len(b) >= 2 and same_size(a[-1], b[-1]) and same_size(a[-2], b[-2]))


class NoMatch(Exception):
    """This softmax is not an attention the tool can express; the message says why."""


def match_attention(gm: GraphModule, ctx: PassContext) -> PassReport:
    matchers = {**{op: _match_softmax for op in SOFTMAX_OPS}, **{op: _match_sdpa for op in SDPA_OPS}}
    sites = []
    for node in gm.graph.nodes:
        match = matchers.get(node.target) if node.op == "call_function" else None
        if match is None:
            continue
        site = AttentionSite(name=f"attn_{len(sites)}:{node.name}", anchor=node)
        try:
            match(site, ctx.constant_inputs)
        except NoMatch as e:
            site.skip(str(e))
            if match is _match_softmax and not _attention_like(node, ctx.constant_inputs):
                site.attention = False
                if not site.reason.startswith("not attention"):
                    site.reason = f"not attention: {site.reason}"
            elif _has_sink_logits(node) and "sink" not in site.reason:
                site.reason = ("attention sinks in a form the paged op cannot take: extra logits concatenated to "
                               "the scores must be one per head from model state, last, and sliced off after the softmax")
            elif site.reason.startswith("not attention: "):
                site.reason = "unsupported attention: " + site.reason[len("not attention: "):]
        sites.append(site)
    ctx.sites = sites
    for s in sites:
        log.info("site %s: %s%s", s.name, s.status, f" ({s.reason})" if s.reason else "")
    return PassReport("match_attention", False, f"{sum(s.status == 'matched' for s in sites)} of {len(sites)} matched")


# ------------------------------------------------------------- attention or not at all

# ops that end a walk back from the scores: past a projection or an embedding lie other layers' results
_PROJECTIONS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.embedding.default}
_PASS_FORWARD = VIEW_OPS | CAST_OPS | {aten.slice.Tensor, aten.select.int, aten.clone.default, aten.contiguous.default,
                                       aten.dropout.default, aten.transpose.int, aten.permute.default,
                                       aten.expand.default, aten.unsqueeze.default, aten.narrow.default}


def _is_state(node, constants: frozenset[str], depth: int = 6) -> bool:
    """A parameter or buffer (through views and casts)."""
    while isinstance(node, Node) and depth > 0:
        if node.op == "get_attr":
            return True
        if node.op == "placeholder":
            return node.name in constants
        if node.op != "call_function" or node.target not in _PASS_FORWARD | {aten.t.default, aten.numpy_T.default}:
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
            if n.target is aten.cat.default and (n.args[1] if len(n.args) > 1 else 0) in (-1, len(shape(n) or ()) - 1):
                return True
            nxt.extend(n.all_input_nodes)
        frontier = nxt
    return False


def _attention_like(sm: Node, constants: frozenset[str]) -> bool:
    """Whether a softmax is attention-shaped: its scores come from (or its output feeds) a product of activations.

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


# ----------------------------------------------------------------------- score path


def _leads_to_contraction(node, depth: int = 12) -> bool:
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
    v = _const_value(x)
    if v is not None:
        return v <= MASK_LIMIT
    return False


def _match_softmax(site: AttentionSite, constants: frozenset[str]) -> None:
    sm = site.anchor
    if sm.args[1] not in (-1, len(shape(sm) or ()) - 1):
        raise NoMatch("softmax is not over the last dimension")
    scale, softcap = 1.0, None
    x = sm.args[0]
    score_path: list[Node] = []  # the score nodes from the softmax input back to Q·Kᵀ
    while True:
        x = _skip_recording(x, score_path)
        if not isinstance(x, Node) or x.op != "call_function":
            raise NoMatch("no Q·Kᵀ product feeds the softmax")
        t = INPLACE_ALIASES.get(x.target, x.target)
        if t in CONTRACTION_OPS:
            break
        score_path.append(x)
        if t in _SCORE_VIEWS and _keeps_last_two(x):
            x = x.args[0]
            continue
        if t in (aten.mul.Tensor, aten.mul.Scalar) and _scalar_arg(x) is not None:
            c, other = _scalar_arg(x)
            cap = _softcap_of(x)
            if cap is not None:
                if scale != 1.0:
                    raise NoMatch("the scores are scaled after the soft-cap")
                _record_chain(other, cap[1], score_path)
                softcap, x = cap[0], cap[1]
                continue
            scale *= c
            x = other
        elif t in (aten.div.Tensor, aten.div.Scalar) and scalar(x.args[1]) is not None:
            scale /= scalar(x.args[1])
            x = x.args[0]
        elif t is aten.add.Tensor and all(isinstance(a, Node) for a in x.args[:2]):
            a, b = x.args[:2]
            path, bias = (a, b) if _leads_to_contraction(a) else (b, a)
            if softcap is not None:
                raise NoMatch("an additive bias applied before the soft-cap")
            site.biases.append((bias, scale * (x.kwargs.get("alpha", 1) if path is a else 1)))
            x = path
        elif (t in (aten.maximum.default, aten.max.other) and _is_neg_fill(x.args[1])) or (
                t in (aten.clamp_min.default, aten.clamp.default) and _is_neg_fill(x.args[1])
                and (len(x.args) < 3 or x.args[2] is None)):
            x = x.args[0]  # scores clamped from below at a huge negative value: only -inf changes, to a mask value
        elif t is aten.mul.Tensor and all(isinstance(a, Node) for a in x.args[:2]) and \
                _leads_to_contraction(x.args[0]) != _leads_to_contraction(x.args[1]):
            if softcap is not None:
                raise NoMatch("the scores are multiplied by a tensor after the soft-cap")
            a, b = x.args[:2]
            path, factor = (a, b) if _leads_to_contraction(a) else (b, a)
            if _const_value(factor) is not None:  # a scale held in a one-element tensor
                scale *= _const_value(factor)
            else:  # checked to be a 0/1 mask when classified
                site.factors.append((factor, len(site.biases), len(site.conds)))
            x = path
        elif t is aten.sub.Tensor and _row_constant(x.args[1], x.args[0]):
            x = x.args[0]  # minus the row maximum (for stability): softmax(s - c) == softmax(s)
        elif t is aten.cat.default and (sink := _sink_concat(x, constants)) is not None:
            if site.sinks is not None:
                raise NoMatch("attention sinks concatenated twice")
            x, site.sinks = sink
        elif t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
            if not _is_neg_fill(x.args[2]):
                raise NoMatch(f"masked_fill with {x.args[2]} is not a mask")
            site.conds.append((x.args[1], False))
            x = x.args[0]
        elif t in (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf):
            cond, a, b = x.args[:3]
            if _is_neg_fill(b) and _leads_to_contraction(a):
                site.conds.append((cond, True))
                x = a
            elif _is_neg_fill(a) and _leads_to_contraction(b):
                site.conds.append((cond, False))
                x = b
            else:
                raise NoMatch("torch.where on the scores is not a mask")
        elif not _leads_to_contraction(x):
            raise NoMatch(f"not attention: the softmax input comes from {_op_name(x)}, not from a Q·Kᵀ product")
        else:
            raise NoMatch(f"{_op_name(x)} between Q·Kᵀ and softmax")
    qk = x
    q, kt, extra_scale = _qk_operands(site, qk)
    scale *= extra_scale
    pv, v, layout = _find_pv(sm, drop_sink=site.sinks is not None)
    lse_scaled = None
    outside = [u for _, u in _outside_users(sm, score_path + [qk])]
    if len(outside) == 1 and site.sinks is None:
        lse_scaled = _lse_sink(outside[0], sm, pv, constants)
    if outside and lse_scaled is None:
        raise NoMatch(f"the scores also feed {_op_name(outside[0])} outside the softmax: a paged step would "
                      "compute it over the step's own keys only")
    if lse_scaled is not None:
        site.sinks = lse_scaled[0]
    site.scale, site.softcap = scale, softcap
    _set_operands(site, q, kt, v, pv, layout, key_is_transposed=True)
    if lse_scaled is not None:
        site.output = lse_scaled[1]  # the sink's rescaling of softmax·V is part of the site
    if site.sinks is not None and shape(site.sinks) is not None and \
            torch.Size(shape(site.sinks)).numel() != site.num_heads:
        raise NoMatch(f"attention sinks hold {torch.Size(shape(site.sinks)).numel()} logits for "
                      f"{site.num_heads} query heads")


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


def _lse_sink(lse: Node, sm: Node, pv: Node, constants: frozenset[str]):
    """Sinks applied after the fact: ``(softmax(s)·V) * sigmoid(logsumexp(s) - sinks)`` -> (state, the product)."""
    if lse.target is not aten.logsumexp.default or skip_identity(lse.args[0]) is not skip_identity(sm.args[0]):
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
            if not _is_state(root, constants) or sr is None or torch.Size(sr).numel() != (shape(lse) or (0, 0))[-2]:
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


def _row_constant(c, x) -> bool:
    """``c`` is constant along the key dimension of the scores ``x`` (e.g. their row max): size 1 there."""
    sc, sx = shape(c), shape(x)
    return bool(sc and sx and len(sc) <= len(sx) and same_size(sc[-1], 1) and not same_size(sx[-1], 1))


# ops a per-head sink parameter passes through on its way to a [B, H, S, 1] column
_SINK_PATH = VIEW_OPS | CAST_OPS | {aten.expand.default, aten.unsqueeze.default, aten.clone.default,
                                    aten.contiguous.default, aten.alias.default, aten.detach.default}


def _sink_source(node):
    """Walk a sink term back through views, casts and broadcasts: (source node, the value before broadcasting)."""
    n, pre = node, node
    while isinstance(n, Node) and n.op == "call_function" and n.target in _SINK_PATH:
        if n.target is aten.expand.default:
            pre = n.args[0]
        n = n.args[0]
    return n, pre


def _sink_concat(cat: Node, constants: frozenset[str]):
    """``cat([scores, sinks], -1)`` with one sink logit per head from model state -> (scores, state node)."""
    tensors = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else 0
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
    if not _is_state(n, constants) or sp is None or len(sp) < 3 or sp[-3] != heads or torch.Size(sp).numel() != heads \
            or shape(n) is None or torch.Size(shape(n)).numel() != heads:
        return None
    return scores, n


def _scalar_arg(node: Node):
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
    return getattr(node.target, "__name__", str(node.target))


def _qk_operands(site: AttentionSite, qk: Node):
    """(q-like [*, S, D], kᵀ-like [*, D, L], scale) of the score contraction."""
    t = qk.target
    if t in (aten.matmul.default, aten.bmm.default):
        return qk.args[0], qk.args[1], 1.0
    if t is aten.baddbmm.default:
        beta = qk.kwargs.get("beta", 1)
        alpha = qk.kwargs.get("alpha", 1)
        if beta != 0:
            site.biases.append((qk.args[0], float(beta)))
        return qk.args[1], qk.args[2], float(alpha)
    if t is aten.einsum.default:
        return _einsum_qk(qk)
    raise NoMatch(f"unsupported contraction {_op_name(qk)}")


def _parse_einsum(eq: str):
    lhs, out = eq.replace(" ", "").split("->")
    a, b = lhs.split(",")
    if "." in eq or len(set(a)) != len(a) or len(set(b)) != len(b):
        raise NoMatch(f"einsum '{eq}' uses ellipsis or repeated letters")
    return a, b, out


def _einsum_qk(node: Node):
    eq, ops = node.args[0], node.args[1]
    if len(ops) != 2:
        raise NoMatch("einsum with more than two operands")
    a, b, out = _parse_einsum(eq)
    contracted = [c for c in a if c in b and c not in out]
    q_letter = [c for c in a if c in out and c not in b]
    k_letter = [c for c in b if c in out and c not in a]
    batch = [c for c in out if c in a and c in b]
    if len(contracted) != 1 or len(q_letter) != 1 or len(k_letter) != 1 or out != "".join(batch) + q_letter[0] + k_letter[0]:
        raise NoMatch(f"einsum '{eq}' is not a batched Q·Kᵀ")
    if len(a) != len(batch) + 2 or len(b) != len(batch) + 2:
        raise NoMatch(f"einsum '{eq}' has broadcast letters")
    d = contracted[0]
    q_perm = [a.index(c) for c in batch] + [a.index(q_letter[0]), a.index(d)]
    kt_perm = [b.index(c) for c in batch] + [b.index(d), b.index(k_letter[0])]
    return ("permute", ops[0], q_perm), ("permute", ops[1], kt_perm), 1.0


def _find_pv(sm: Node, drop_sink: bool = False):
    """Forward from the softmax through casts/dropout to the ·V contraction: (pv node, v, layout).

    ``drop_sink``: the last column holds attention-sink probabilities, sliced off before ·V.
    """
    p = sm
    while True:
        users = [u for u in p.users if u.target not in _CHECK_OPS]
        if len(users) != 1:
            raise NoMatch("attention probabilities are used elsewhere (e.g. returned as attention weights)")
        u = users[0]
        if u.target in CAST_OPS or u.target in (aten.clone.default, aten.contiguous.default) or (
            u.target in _SCORE_VIEWS and _keeps_last_two(u)) or (
            # matmul below dispatch: expand to the same shape, then a 3-D view into bmm
            u.target is aten.expand.default and shape(u) == shape(p)) or (
            u.target is aten.dropout.default and (u.args[1] == 0 or u.args[2] is False)
        ):
            p = u
            continue
        if u.target is aten.dropout.default:
            raise NoMatch("dropout is active on the attention probabilities (model in training mode?)")
        if drop_sink and _drops_last_column(u, p):
            drop_sink, p = False, u
            continue
        break
    if drop_sink:
        raise NoMatch("the attention-sink column is not sliced off the probabilities before ·V")
    if u.target in (aten.matmul.default, aten.bmm.default) and u.args[0] is p:
        return u, u.args[1], None
    if u.target is aten.einsum.default and u.args[1][0] is p and len(u.args[1]) == 2:
        a, b, out = _parse_einsum(u.args[0])
        k = [c for c in a if c in b and c not in out]
        q = [c for c in a if c in out and c not in b]
        d = [c for c in b if c in out and c not in a]
        batch = [c for c in a if c in b and c in out]
        if len(k) != 1 or len(q) != 1 or len(d) != 1 or a != "".join(batch) + q[0] + k[0] or len(b) != len(batch) + 2:
            raise NoMatch(f"einsum '{u.args[0]}' is not P·V")
        v_perm = [b.index(c) for c in batch] + [b.index(k[0]), b.index(d[0])]
        canon = "".join(batch) + q[0] + d[0]
        out_perm = [canon.index(c) for c in out]
        return u, ("permute", u.args[1][1], v_perm), ("permute", out_perm)
    raise NoMatch(f"softmax output feeds {_op_name(u)}, not a ·V product")


def _drops_last_column(u: Node, p: Node) -> bool:
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
    graph = out.graph
    q = _materialize(graph, q, out)
    kt = _materialize(graph, kt, out)
    v = _materialize(graph, v, out)
    sq, sk, sv = shape(q), shape(kt), shape(v)
    if sq is None or sk is None or sv is None:
        raise NoMatch("operand shapes are unknown")
    if 3 in (len(sq), len(sk), len(sv)):
        # 4-D operands flattened to 3-D for bmm (matmul below dispatch): Kᵀ itself may be one
        q4, kt4, v4 = (x if len(shape(x)) == 4 else _recover_4d(x) for x in (q, kt, v))
        if q4 is not None and kt4 is not None and v4 is not None:
            q, kt, v = q4, kt4, v4
            sq = shape(q)
            if len(shape(out)) == 3:
                layout = layout or ("flatten",)
    k = _transpose_back(graph, kt, out) if key_is_transposed else kt
    # scalars applied to q or k alone fold into the one scale
    q, qs = _strip_scalar(q)
    k, ks = _strip_scalar(k)
    site.scale *= qs * ks
    if len(sq) == 3 or len(sv) == 3:
        # scores from a 3-D bmm may meet 4-D values after a view (and the other way round)
        q4, k4, v4 = (x if len(shape(x)) == 4 else _recover_4d(x) for x in (q, k, v))
        if q4 is None or k4 is None or v4 is None:
            raise NoMatch("could not recover the heads of a 3-D [batch*heads, seq, dim] attention")
        q, k, v = q4, k4, v4
        if len(shape(out)) == 3:
            layout = layout or ("flatten",)
    elif len(sq) != 4:
        raise NoMatch(f"{len(sq)}-D attention operands")
    sq, sk, sv = shape(q), shape(k), shape(v)
    if len(sk) != 4 or len(sv) != 4:
        raise NoMatch("key/value are not 4-D")
    num_heads = sq[1]
    if not isinstance(num_heads, int):
        raise NoMatch("the number of heads is not static")
    k, hk = _strip_repeat_kv(k, num_heads)
    v, hv = _strip_repeat_kv(v, num_heads)
    sk, sv = shape(k), shape(v)
    if hk != hv or sk[1] != sv[1]:
        raise NoMatch("keys and values have different head layouts")
    if not (same_size(sk[0], sq[0]) and same_size(sv[0], sq[0])):
        raise NoMatch("query and key batch sizes differ (broadcast over batch)")
    hkv = sk[1]
    if not isinstance(hkv, int) or num_heads % hkv:
        raise NoMatch(f"{num_heads} query heads do not group over {hkv} kv heads")
    if hkv != num_heads and hkv != 1 and hk is None and not grouped:
        raise NoMatch("key heads broadcast in a way that is not GQA")
    site.query, site.key, site.value, site.output, site.output_layout = q, k, v, out, layout
    site.num_heads, site.num_kv_heads, site.head_dim = num_heads, hkv, sq[3]
    if not isinstance(sq[3], int) or not isinstance(sv[3], int):
        raise NoMatch("head size is not static")


def _transpose_back(graph, kt: Node, before: Node) -> Node:
    src = skip_identity(kt, casts=False)
    if src.target is aten.transpose.int and sorted(d % 4 if len(shape(src)) == 4 else d % 3 for d in src.args[1:3]) == (
        [2, 3] if len(shape(src)) == 4 else [1, 2]
    ):
        return src.args[0]
    nd = len(shape(kt))
    with graph.inserting_before(before):
        n = graph.call_function(aten.transpose.int, (kt, nd - 2, nd - 1))
        n.meta["val"] = kt.meta["val"].transpose(nd - 2, nd - 1)
    return n


def _match_sdpa(site: AttentionSite, constants: frozenset[str]) -> None:
    n = site.anchor
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    args = dict(zip(names, n.args))
    args.update(n.kwargs)
    if args.get("dropout_p", 0.0):
        raise NoMatch("SDPA with dropout_p > 0")
    q = args["query"]
    sq = shape(q)
    if sq is None or len(sq) != 4:
        raise NoMatch("SDPA on non 4-D inputs")
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
