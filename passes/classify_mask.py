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

from pagedattn.passes.context import PassContext, PassReport
from pagedattn.passes.site import MASK_LIMIT, AttentionSite, aten, same_size, shape

log = logging.getLogger("pagedattn.passes")

PROBE_SIZES = (13, 64, 257, 4100)  # beyond common sliding windows (4096)
_PAD = 3  # left padding of the second row in the padding probe
_ALIBI_FIT_MAX = 300  # bias values are fitted on probes up to this key length


@dataclass(frozen=True)
class MaskClass:
    kind: str  # none | causal | sliding_window
    window: Optional[int]
    alibi: Optional[torch.Tensor]
    key_padding: Optional[str]  # placeholder name
    probed_up_to: int


class Unsupported(Exception):
    pass


def classify_mask(gm: GraphModule, ctx: PassContext) -> PassReport:
    sites, examples, constants, hints = ctx.sites, ctx.example_inputs, ctx.constant_inputs, ctx.mask_hints
    memo: dict[tuple, Any] = {}
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for i, site in enumerate(sites):
        if site.status != "matched":
            continue
        if hints is not None and _single_token(site):
            _apply_hint(site, hints, i, len(sites))
            continue
        if not site.biases and not site.conds and not site.factors:
            site.mask_kind = "causal" if site.sdpa_causal else "none"
            continue
        if site.sdpa_causal:
            site.skip("SDPA with both is_causal and attn_mask")
            continue
        key = (tuple((id(n), f) for n, f in site.biases), tuple((id(n), k) for n, k in site.conds),
               tuple((id(n), i, j) for n, i, j in site.factors), site.num_heads)
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
        site.probed_up_to = res.probed_up_to
        site.key_padding = placeholders[res.key_padding] if res.key_padding else None
    n = sum(s.mask_kind is not None for s in sites)
    return PassReport("classify_mask", False, f"{n} masks classified")


def _single_token(site: AttentionSite) -> bool:
    """A graph traced for one query against one key: no probe can tell a mask's extent there."""
    sq, sk = shape(site.query), shape(site.key)
    return not _symbols(sq[2]) and not _symbols(sk[2]) and int(sq[2]) == int(sk[2]) == 1


def _apply_hint(site: AttentionSite, hints: list[dict], index: int, num_sites: int) -> None:
    """Take the mask of the same site in a multi-token trace of the same model (``rewrite(mask_hints=...)``)."""
    if len(hints) != num_sites:
        site.skip(f"single-token graph: its mask cannot be probed, and the multi-token trace given as hints has "
                  f"{len(hints)} attention sites, not {num_sites}")
        return
    h = hints[index]
    if h.get("status") != "rewritten":
        site.skip(f"single-token graph: the multi-token trace left this site ({h.get('reason')})")
    elif h.get("alibi") or h.get("key_padding"):
        site.skip("single-token graph: ALiBi slopes and key padding cannot be probed on one token")
    else:
        site.mask_kind, site.window = h["mask"], h.get("window")
        site.probed_up_to = h.get("mask_probed_up_to")


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


def _hint(dim) -> int:
    return int(dim.node.hint) if isinstance(dim, torch.SymInt) else int(dim)


def _concrete(dim, sub: dict) -> int:
    if isinstance(dim, int):
        return dim
    return int(dim.node.expr.subs(sub))


def _probe_input(p: Node, example: Any, sub: dict, pad: int, by_value: bool, key_len: int) -> Any:
    v = p.meta.get("val")
    if isinstance(v, torch.SymInt):  # a size handed in as an input
        return _concrete(v, sub)
    if not isinstance(v, torch.Tensor):
        return example
    shp = [_concrete(d, sub) for d in v.shape]
    if not by_value:  # only its shape reaches the mask
        return torch.zeros(shp, dtype=v.dtype, device=v.device)
    ex = example if isinstance(example, torch.Tensor) else None
    if v.dtype == torch.bool or (ex is not None and _is_01(ex)):
        t = torch.ones(shp, dtype=v.dtype, device=v.device)
        if pad and len(shp) == 2:
            t[-1, :pad] = 0
        return t
    if not v.dtype.is_floating_point:
        if ex is not None and ex.dim() >= 1 and _is_arange(ex):
            # positions of the newest tokens, aligned bottom-right with the keys
            n = shp[-1]
            return (torch.arange(n, device=v.device) + (key_len - n)).to(v.dtype).expand(shp).clone()
        return torch.zeros(shp, dtype=v.dtype, device=v.device)
    raise Unsupported(f"the mask depends on the floating-point input '{p.name}' (a caller-provided mask or bias)")


def _is_01(t: torch.Tensor) -> bool:
    return t.numel() > 0 and bool(((t == 0) | (t == 1)).all())


def _is_arange(t: torch.Tensor) -> bool:
    """Positions: each row counts up by one, possibly restarting (sequences packed in one row)."""
    rows = t.reshape(-1, t.shape[-1])
    if t.shape[-1] == 1:
        return bool((rows >= 0).all())
    d = rows[:, 1:] - rows[:, :-1]
    restart = rows[:, 1:] < rows[:, :-1]
    return bool((rows >= 0).all() and ((d == 1) | restart).all() and not restart.all())


def _classify(gm: GraphModule, site: AttentionSite, examples: dict, constants: set = frozenset()) -> MaskClass:
    terms = [n for n, _ in site.biases] + [n for n, _ in site.conds] + [n for n, _, _ in site.factors]
    mod, inputs = _extract(gm, terms)
    nodes = set(mod.graph.nodes)
    inner = {n.name: n for n in mod.graph.nodes if n.op == "placeholder"}
    by_value = [p for p in inputs if _used_by_value(inner[p.name], nodes) and p.name not in constants
                and isinstance(p.meta.get("val"), torch.Tensor)]
    sq, sk = shape(site.query), shape(site.key)
    s_len, l_len = sq[2], sk[2]
    seq_syms = _symbols(s_len) | _symbols(l_len)
    batch_syms = _symbols(sq[0]) - seq_syms

    pad_candidates = [p for p in by_value if _looks_like_padding(p, examples, l_len)]
    other = [p for p in by_value if p not in pad_candidates and not _looks_like_positions(p, examples)]
    if other:
        log.debug("mask input %s: shape %s, key length %s", other[0].name, shape(other[0]), l_len)
        v = other[0].meta.get("val")
        if v is not None and not v.dtype.is_floating_point and v.dtype != torch.bool:
            raise Unsupported(f"the mask depends on the token values of input '{other[0].name}' "
                              "(data-dependent sparsity, e.g. a top-k key indexer, or a mask computed from token ids)")
        raise Unsupported(f"the mask depends on the values of input '{other[0].name}' (a caller-provided mask or bias)")

    def sizes_for(P: int) -> dict:
        """Symbol values that make the key length P (queries: all of them, or a third when they differ)."""
        sub: dict = {}
        if str(s_len) == str(l_len) or not _symbols(l_len):
            sub.update({s: P for s in _symbols(s_len)})
        else:
            sub.update({s: max(1, P // 3) for s in _symbols(s_len)})
            extra = _symbols(l_len) - set(sub)
            base = int(l_len.node.expr.subs({**sub, **{s: 0 for s in extra}}))
            sub.update({s: max(1, P - base) for s in extra})
        return sub

    def run(P: int, batch: int, pad: int) -> torch.Tensor:
        sub = sizes_for(P)
        sub.update({s: batch for s in batch_syms})
        S, L = _concrete(s_len, sub), _concrete(l_len, sub)
        args = []
        for p in inputs:
            ex = examples.get(p.name)
            if p.name in constants:  # model state: used as it is
                args.append(ex)
                continue
            v = p.meta.get("val")
            dims = v.shape if isinstance(v, torch.Tensor) else [v] if isinstance(v, torch.SymInt) else []
            for d in dims:
                free = _symbols(d) - set(sub)
                if len(free) == 1 and len(_symbols(d)) == 1:
                    # a size of its own: match it to the key length, query length or batch it equals in the example
                    sub[free.pop()] = next((val for ref, val in ((l_len, L), (s_len, S), (sq[0], batch))
                                            if _hint(d) == _hint(ref)), _hint(d))
                for sym in free:
                    sub[sym] = batch
            args.append(_probe_input(p, ex, sub, pad, p in by_value, L))
        return _combine(mod(*args), site, S, L, batch)

    sizes = sorted(set(PROBE_SIZES)) if seq_syms else [int(l_len)]
    one = sq[0] if isinstance(sq[0], int) else 1  # a static batch stays what it is
    results: dict[int, torch.Tensor] = {}
    errors = []
    for P in sizes:
        try:
            results[P] = run(P, one, 0)[:1]
        except Unsupported:
            raise
        except Exception as e:
            errors.append(f"{P}: {type(e).__name__}")
    if not results:
        raise Unsupported(f"mask could not be evaluated at any probe size ({'; '.join(errors)})")
    kind, window, alibi, seen = None, None, None, 0
    for P, total in sorted(results.items()):
        k, w, a = _kind_of(total, fit_alibi=P <= _ALIBI_FIT_MAX)
        if kind is None or (k, w) == (kind, window):
            kind, window = k, w
        elif kind == "causal" and k == "sliding_window" and w >= seen:
            kind, window = k, w  # a window wider than every shorter probe
        else:
            raise Unsupported(f"the mask changes kind with length ({kind} {window or ''} vs {k} {w or ''} at {P})")
        seen = total.shape[-1]
        alibi = a if a is not None else alibi
    key_padding = None
    if pad_candidates:
        P = min(results)
        two = sq[0] if isinstance(sq[0], int) else 2
        padded, base = run(P, two, _PAD), run(P, two, 0)
        L = base.shape[-1]
        for b in range(two):
            keep = torch.ones(L, dtype=torch.bool)
            if b == two - 1:
                keep[:_PAD] = False  # _probe_input pads the last row
            if not _same_up_to_padding(padded[b], base[b], keep):
                raise Unsupported(f"the mask depends on input '{pad_candidates[0].name}' in a way that is not key padding")
        key_padding = pad_candidates[0].name
    return MaskClass(kind, window, alibi, key_padding, max(results))


def _looks_like_positions(p: Node, examples: dict) -> bool:
    ex = examples.get(p.name)
    return (isinstance(ex, torch.Tensor) and not ex.dtype.is_floating_point and ex.dtype != torch.bool
            and ex.dim() >= 1 and ex.numel() > 0 and _is_arange(ex))


def _looks_like_padding(p: Node, examples: dict, key_len) -> bool:
    """A ``[batch, keys]`` 0/1 input: Hugging Face's ``attention_mask``."""
    v = p.meta.get("val")
    ex = examples.get(p.name)
    return (isinstance(v, torch.Tensor) and v.dim() == 2 and (same_size(v.shape[1], key_len) or _hint(v.shape[1]) == _hint(key_len))
            and (v.dtype == torch.bool or (isinstance(ex, torch.Tensor) and _is_01(ex))))


def _combine(outs, site: AttentionSite, S: int, L: int, batch: int) -> torch.Tensor:
    """All terms as one additive bias ``[batch, H, S, L]`` (-inf where masked).

    Each term is brought to ``[batch, H, S, L]`` on its own: terms can live at different
    layouts (ALiBi on ``[B*H, 1, L]`` scores, the causal mask on ``[B, 1, S, L]``).
    """
    nb, nc = len(site.biases), len(site.conds)
    # long probes only settle the mask's extent: 0 / -inf in half precision keeps 4100² probes small
    long = L > _ALIBI_FIT_MAX
    dt = torch.float16 if long else torch.float64
    neg_inf = torch.tensor(float("-inf"), dtype=dt)
    bias_terms, cond_terms = [], []
    for (node, factor), t in zip(site.biases, outs[:nb]):
        if t.dtype == torch.bool:
            raise Unsupported("boolean tensor added to the scores")
        t = t.to(device="cpu")
        value = torch.zeros((), dtype=dt) if long else t.to(dt) * factor
        bias_terms.append(_to_heads(torch.where(t <= MASK_LIMIT, neg_inf, value), site.num_heads, S, L, batch))
    for (node, keep_when_true), c in zip(site.conds, outs[nb:nb + nc]):
        c = c.cpu()
        masked = ~c.bool() if keep_when_true else c.bool()
        term = torch.zeros(masked.shape, dtype=dt).masked_fill(masked, float("-inf"))
        cond_terms.append(_to_heads(term, site.num_heads, S, L, batch))
    zero = torch.zeros(batch, site.num_heads, S, L, dtype=dt)
    for (node, after_b, after_c), f in zip(site.factors, outs[nb + nc:]):
        f = f.cpu()
        if not _is_01(f):
            raise Unsupported("the scores are multiplied by a tensor that is not a 0/1 mask")
        later = sum(bias_terms[:after_b] + cond_terms[:after_c], zero)
        zeroed = _to_heads((f == 0).to(dt), site.num_heads, S, L, batch) > 0
        if bool((zeroed & torch.isfinite(later)).any()):
            raise Unsupported("a 0/1 factor zeroes scores that no later term masks (zero is a score, not a mask)")
    return sum(bias_terms + cond_terms, zero)


def _to_heads(t: torch.Tensor, H: int, S: int, L: int, batch: int) -> torch.Tensor:
    t = t.reshape(1, 1) if t.dim() < 2 else t
    t = torch.broadcast_to(t, (*t.shape[:-2], S, L))
    lead = tuple(t.shape[:-2])
    n = 1
    for d in lead:
        n *= d
    flat = t.reshape(n, S, L)
    if n == 1:
        return flat.reshape(1, 1, S, L)
    if n == batch * H:
        return flat.reshape(batch, H, S, L)
    if n == H and len(lead) >= 1 and lead[-1] == H:
        return flat.reshape(1, H, S, L)
    if n == batch:
        return flat.reshape(batch, 1, S, L)
    raise Unsupported(f"mask has a leading shape {lead} that fits neither batch ({batch}) nor heads ({H})")


def _positions(S: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query positions (the last S of L, bottom-right) and key positions."""
    return torch.arange(L - S, L), torch.arange(L)


def _kind_of(total: torch.Tensor, fit_alibi: bool = True):
    """(kind, window, alibi slopes) of a ``[1, H, S, L]`` bias."""
    t = total[0]
    allowed = torch.isfinite(t)
    if not bool((allowed == allowed[:1]).all()):
        raise Unsupported("the mask differs between heads")
    a = allowed[0]
    S, L = a.shape
    qp, kp = _positions(S, L)
    diff = qp[:, None] - kp[None, :]
    if bool(a.all()) and S > 1:
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
    return kind, window, _alibi_slopes(finite, allowed)


def _alibi_slopes(f: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    S, L = f.shape[-2:]
    qp, kp = _positions(S, L)
    rel = (kp[None, :] - qp[:, None]).double()  # j - i
    row = f[..., torch.arange(S), qp][..., None]  # [H, S, 1] value at the query's own position
    g = f - row
    w = allowed.double()
    slopes = (g * rel * w).sum((-1, -2)) / (rel * rel * w).sum((-1, -2)).clamp_min(1e-12)
    err = ((g - slopes[:, None, None] * rel).abs() * w).max()
    if err > 1e-3 * max(1.0, float(g.abs().max())):
        raise Unsupported("the additive bias is not ALiBi (e.g. a learned relative-position bias)")
    return slopes.float()


def _same_up_to_padding(padded: torch.Tensor, base: torch.Tensor, keep: torch.Tensor) -> bool:
    """``padded`` equals ``base`` with padded keys masked, on the rows of non-padded queries."""
    S, L = base.shape[-2:]
    rows = keep[L - S:].nonzero().flatten()
    exp_allowed = torch.isfinite(base) & keep[None, None, :]
    got_allowed = torch.isfinite(padded)
    if not bool((exp_allowed[:, rows] == got_allowed[:, rows]).all()):
        return False
    zero = torch.zeros((), dtype=base.dtype)
    a = torch.where(exp_allowed, base, zero)[:, rows]
    b = torch.where(got_allowed, padded, zero)[:, rows]
    d = a - b  # may differ by a per-row constant (softmax is shift-invariant), e.g. ALiBi positions
    m = exp_allowed[:, rows]
    shift = torch.where(m, d, zero).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
    return bool(((d - shift).abs() * m).max() <= 1e-3 * max(1.0, float(a.abs().max())))
