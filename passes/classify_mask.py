"""Classify each site's mask and bias by what they compute, not by how they are spelled.

The mask/bias terms found on the score path are cut out of the graph as a small program of the
inputs they depend on, and evaluated at probe sizes — short, odd and far longer than the traced
example — so that a sliding window wider than the example is still found. The evaluated bias
is compared with causal / sliding-window / bidirectional masks, ALiBi, and causal combined with
key padding from a model input (Hugging Face's ``attention_mask``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.fx import Graph, GraphModule, Node

from pagedattn.passes.site import AttentionSite, PassResult, aten, shape

log = logging.getLogger("pagedattn.passes")

PROBE_SIZES = (13, 64, 257, 4100)  # beyond common sliding windows (4096)
_PAD = 3  # left padding of the second row in the padding probe
_MASKED = -9999.0
_ALIBI_FIT_MAX = 300  # bias values are fitted on probes up to this length  # additive values at or below this are masks (HF uses finfo.min, old code -1e4)


@dataclass(frozen=True)
class MaskClass:
    kind: str  # none | causal | sliding_window
    window: Optional[int]
    alibi: Optional[torch.Tensor]
    key_padding: Optional[str]  # placeholder name
    probed_up_to: int


class Unsupported(Exception):
    pass


def classify_mask(gm: GraphModule) -> PassResult:
    sites: list[AttentionSite] = gm.meta.get("pagedattn_sites", [])
    examples: dict[str, Any] = gm.meta.get("pagedattn_example_inputs", {})
    constants: set[str] = gm.meta.get("pagedattn_constant_inputs", set())
    memo: dict[tuple, Any] = {}
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for site in sites:
        if site.status != "matched":
            continue
        if not site.biases and not site.conds:
            site.mask_kind = "causal" if site.sdpa_causal else "none"
            continue
        if site.sdpa_causal:
            site.skip("SDPA with both is_causal and attn_mask")
            continue
        key = (tuple((id(n), f) for n, f in site.biases), tuple((id(n), k) for n, k in site.conds), site.num_heads)
        if key not in memo:
            try:
                with torch.no_grad():
                    memo[key] = _classify(gm, site, examples, constants)
            except Unsupported as e:
                memo[key] = str(e)
            except Exception as e:  # a probe that cannot run is a reason to leave the site alone
                memo[key] = f"mask could not be evaluated at probe sizes ({type(e).__name__}: {e})"
        res = memo[key]
        if isinstance(res, str):
            site.skip(res)
            continue
        site.mask_kind, site.window, site.alibi_slopes = res.kind, res.window, res.alibi
        site.key_padding = placeholders[res.key_padding] if res.key_padding else None
    n = sum(s.mask_kind is not None for s in sites)
    return PassResult("classify_mask", False, f"{n} masks classified")


# ----------------------------------------------------------------------- the probe


def _extract(gm: GraphModule, outputs: list[Node]) -> tuple[GraphModule, list[Node]]:
    """A module computing ``outputs`` from the placeholders they depend on."""
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


def _used_by_value(p: Node, nodes: set[Node]) -> bool:
    return any(u in nodes and u.target is not aten.sym_size.int for u in p.users)


def _symbols(x) -> set:
    return set(x.node.expr.free_symbols) if isinstance(x, torch.SymInt) else set()


def _concrete(dim, sub: dict) -> int:
    if isinstance(dim, int):
        return dim
    return int(dim.node.expr.subs(sub))


def _probe_input(p: Node, example: Any, sub: dict, pad: int, by_value: bool) -> Any:
    v = p.meta.get("val")
    if isinstance(v, torch.SymInt):  # a size handed in as an input
        return _concrete(v, sub)
    if not isinstance(v, torch.Tensor):
        return example
    shp = [_concrete(d, sub) for d in v.shape]
    if not by_value:  # only its shape reaches the mask
        return torch.zeros(shp, dtype=v.dtype)
    ex = example if isinstance(example, torch.Tensor) else None
    if v.dtype == torch.bool or (ex is not None and _is_01(ex)):
        t = torch.ones(shp, dtype=v.dtype)
        if pad and len(shp) == 2 and shp[0] >= 2:
            t[1, :pad] = 0
        return t
    if not v.dtype.is_floating_point:
        if ex is not None and ex.dim() >= 1 and ex.shape[-1] > 1 and _is_arange(ex):
            start = int(ex.reshape(-1, ex.shape[-1])[0, 0])
            return (torch.arange(shp[-1]) + start).to(v.dtype).expand(shp).clone()
        return torch.zeros(shp, dtype=v.dtype)
    raise Unsupported(f"the mask depends on the floating-point input '{p.name}' (a caller-provided mask or bias)")


def _is_01(t: torch.Tensor) -> bool:
    return t.numel() > 0 and bool(((t == 0) | (t == 1)).all())


def _is_arange(t: torch.Tensor) -> bool:
    rows = t.reshape(-1, t.shape[-1])
    return bool((rows - rows[:, :1] == torch.arange(t.shape[-1], dtype=t.dtype)).all())


def _classify(gm: GraphModule, site: AttentionSite, examples: dict, constants: set = frozenset()) -> MaskClass:
    terms = [n for n, _ in site.biases] + [n for n, _ in site.conds]
    mod, inputs = _extract(gm, terms)
    nodes = set(mod.graph.nodes)
    inner = {n.name: n for n in mod.graph.nodes if n.op == "placeholder"}
    by_value = [p for p in inputs if _used_by_value(inner[p.name], nodes) and p.name not in constants
                and isinstance(p.meta.get("val"), torch.Tensor)]
    sq, sk = shape(site.query), shape(site.key)
    seq_syms = _symbols(sq[2]) | _symbols(sk[2])
    for p in inputs:  # sizes handed in as inputs are their own symbols
        pv = p.meta.get("val")
        if isinstance(pv, torch.SymInt) and _symbols(pv) <= seq_syms | _symbols(sq[0]):
            pass
    batch_syms = _symbols(sq[0])
    static = not seq_syms
    if not static and (len(_symbols(sq[2])) != 1 or _symbols(sq[2]) != _symbols(sk[2]) or str(sq[2]) != str(sk[2])):
        raise Unsupported("query and key lengths differ (cross-attention or a cache) and a mask is present")

    pad_candidates = [p for p in by_value if _looks_like_padding(p, examples, seq_syms)]
    other = [p for p in by_value if p not in pad_candidates and not _looks_like_positions(p, examples)]
    if other:
        raise Unsupported(f"the mask depends on the values of input '{other[0].name}' (a caller-provided mask or bias)")

    def run(P: int, batch: int, pad: int) -> torch.Tensor:
        sub = {s: P for s in seq_syms}
        sub.update({s: batch for s in batch_syms})
        args = []
        for p in inputs:
            ex = examples.get(p.name)
            if p.name in constants:  # model state: used as it is
                args.append(ex)
                continue
            if p.meta.get("val") is not None and isinstance(p.meta["val"], torch.Tensor):
                for d in p.meta["val"].shape:
                    for s in _symbols(d) - set(sub):
                        sub[s] = batch
            args.append(_probe_input(p, ex, sub, pad, p in by_value))
        outs = mod(*args)
        return _combine(outs, site, P, batch)

    sizes = [int(sq[2])] if static else sorted(set(PROBE_SIZES))
    results: dict[int, torch.Tensor] = {}
    errors = []
    for P in sizes:
        try:
            results[P] = run(P, 1, 0)
        except Unsupported:
            raise
        except Exception as e:
            errors.append(f"{P}: {type(e).__name__}")
    if not results:
        raise Unsupported(f"mask could not be evaluated at any probe size ({'; '.join(errors)})")
    kind, window, alibi = None, None, None
    for P, total in sorted(results.items()):
        k, w, a = _kind_of(total, site.num_heads, fit_alibi=P <= _ALIBI_FIT_MAX)
        if kind is None:
            kind, window, alibi = k, w, a
        elif (k, w) != (kind, window):
            if kind == "causal" and k == "sliding_window" and w >= max(p for p in results if p < P):
                kind, window = k, w
            else:
                raise Unsupported(f"mask changes kind with length ({kind} {window} vs {k} {w} at {P})")
        if a is not None:
            alibi = a
    probed = max(results)
    key_padding = None
    if pad_candidates:
        P = min(results)
        padded = run(P, 2, _PAD)
        base = results[P]
        for b in range(2):
            keep = torch.ones(P, dtype=torch.bool)
            if b == 1:
                keep[:_PAD] = False
            if not _same_up_to_padding(padded[b], base[0], keep):
                raise Unsupported(f"the mask depends on input '{pad_candidates[0].name}' in a way that is not key padding")
        key_padding = pad_candidates[0].name
    return MaskClass(kind, window, alibi, key_padding, probed)


def _looks_like_positions(p: Node, examples: dict) -> bool:
    ex = examples.get(p.name)
    return (isinstance(ex, torch.Tensor) and not ex.dtype.is_floating_point and ex.dtype != torch.bool
            and ex.dim() >= 1 and ex.shape[-1] > 1 and _is_arange(ex))


def _looks_like_padding(p: Node, examples: dict, seq_syms: set) -> bool:
    v = p.meta.get("val")
    ex = examples.get(p.name)
    return (isinstance(v, torch.Tensor) and v.dim() == 2 and bool(_symbols(v.shape[1]) & seq_syms)
            and (v.dtype == torch.bool or (isinstance(ex, torch.Tensor) and _is_01(ex))))


def _combine(outs, site: AttentionSite, P: int, batch: int) -> torch.Tensor:
    """All terms as one additive float64 bias ``[batch, H, P, P]`` (-inf where masked).

    Each term is brought to ``[batch, H, P, P]`` on its own: terms can live at different
    layouts (ALiBi on ``[B*H, 1, L]`` scores, the causal mask on ``[B, 1, S, L]``).
    """
    nb = len(site.biases)
    dt = torch.float64 if P <= _ALIBI_FIT_MAX else torch.float32  # long probes only need the mask's extent
    total = torch.zeros(batch, site.num_heads, P, P, dtype=dt)
    neg_inf = torch.tensor(float("-inf"), dtype=dt)
    for (node, factor), t in zip(site.biases, outs[:nb]):
        if t.dtype == torch.bool:
            raise Unsupported("boolean tensor added to the scores")
        t = t.to(dt)
        total = total + _to_heads(torch.where(t <= _MASKED, neg_inf, t * factor), site.num_heads, P, batch)
    for (node, keep_when_true), c in zip(site.conds, outs[nb:]):
        masked = ~c.bool() if keep_when_true else c.bool()
        term = torch.zeros(masked.shape, dtype=dt).masked_fill(masked, float("-inf"))
        total = total + _to_heads(term, site.num_heads, P, batch)
    return total


def _to_heads(t: torch.Tensor, H: int, P: int, batch: int) -> torch.Tensor:
    t = t.reshape(1, 1) if t.dim() < 2 else t
    t = torch.broadcast_to(t, (*t.shape[:-2], P, P))
    lead = tuple(t.shape[:-2])
    n = 1
    for d in lead:
        n *= d
    flat = t.reshape(n, P, P)
    if n == 1:
        return flat.reshape(1, 1, P, P)
    if n == batch * H:
        return flat.reshape(batch, H, P, P)
    if n == H and len(lead) >= 1 and lead[-1] == H:
        return flat.reshape(1, H, P, P)
    if n == batch:
        return flat.reshape(batch, 1, P, P)
    raise Unsupported(f"mask has a leading shape {lead} that fits neither batch ({batch}) nor heads ({H})")


def _kind_of(total: torch.Tensor, H: int, fit_alibi: bool = True):
    """(kind, window, alibi slopes) of a ``[1, H, P, P]`` bias."""
    t = total[0]
    allowed = torch.isfinite(t)
    if not bool((allowed == allowed[:1]).all()):
        raise Unsupported("the mask differs between heads")
    a = allowed[0]
    P = a.shape[-1]
    i = torch.arange(P)
    diff = i[:, None] - i[None, :]
    if bool(a.all()):
        kind, window = "none", None
    elif bool((a == (diff >= 0)).all()):
        kind, window = "causal", None
    else:
        w = int(a[-1].sum())
        if w >= 1 and bool((a == ((diff >= 0) & (diff < w))).all()):
            kind, window = "sliding_window", w
        else:
            raise Unsupported("the mask is neither causal, sliding-window nor absent (an arbitrary mask)")
    if not fit_alibi:  # long probes only settle the mask's extent
        return kind, window, None
    finite = torch.where(allowed, t, torch.zeros((), dtype=t.dtype))
    if bool((finite == 0).all()):
        return kind, window, None
    return kind, window, _alibi_slopes(finite, allowed, H)


def _alibi_slopes(f: torch.Tensor, allowed: torch.Tensor, H: int) -> torch.Tensor:
    P = f.shape[-1]
    i = torch.arange(P)
    rel = (i[None, :] - i[:, None]).double()  # j - i
    row = torch.diagonal(f, dim1=-2, dim2=-1)[..., :, None]  # [H, P, 1] value at j = i
    g = f - row
    # least-squares slope per head over visible entries
    w = allowed.double()
    slopes = (g * rel * w).sum((-1, -2)) / (rel * rel * w).sum((-1, -2)).clamp_min(1e-12)
    fit = slopes[:, None, None] * rel
    err = ((g - fit).abs() * w).max()
    if err > 1e-3 * max(1.0, float(g.abs().max())):
        raise Unsupported("the additive bias is not ALiBi (e.g. a learned relative-position bias)")
    return slopes.float()


def _same_up_to_padding(padded: torch.Tensor, base: torch.Tensor, keep: torch.Tensor) -> bool:
    """``padded`` equals ``base`` with padded keys masked, on the rows of non-padded queries."""
    rows = keep.nonzero().flatten()
    exp_allowed = torch.isfinite(base) & keep[None, None, :]
    got_allowed = torch.isfinite(padded)
    if not bool((exp_allowed[:, rows] == got_allowed[:, rows]).all()):
        return False
    a = torch.where(exp_allowed, base, torch.zeros(()).double())[:, rows]
    b = torch.where(got_allowed, padded, torch.zeros(()).double())[:, rows]
    d = a - b  # may differ by a per-row constant (softmax is shift-invariant), e.g. ALiBi positions
    m = exp_allowed[:, rows]
    first = torch.where(m, d, torch.zeros(()).double())
    shift = first.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
    return bool(((d - shift).abs() * m).max() <= 1e-3 * max(1.0, float(a.abs().max())))
