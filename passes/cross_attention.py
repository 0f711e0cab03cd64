"""Cross-attention in an encoder-decoder's decoder step: which sites it is, and the graph that fills its cache.

A decoder step traced with the encoder's output as an input (``PassContext.encoder_inputs``) has
three kinds of attention: self-attention over the step's tokens (paged as usual), cross-attention
whose keys and values are projections of the encoder's output alone, and anything else (left as it
was). Cross-attention becomes a paged, non-causal attend over cross-attention blocks filled once per
request (``insert_paged``); ``cross_kv_writes`` turns a copy of the canonical graph into the graph that
fills them: ``(encoder states..., cross_kv_cache_<j>..., cross_slot_mapping) -> ()``, every cross site's
K/V projection followed by a cache write, nothing else (as vLLM writes the encoder's K/V into the
cross-attention blocks on the first decoder step of a request).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, GraphModule, Node

from pagedattn.passes.canonical import is_attention, read_attention
from pagedattn.passes.cleanup import remove_dead_code
from pagedattn.passes.context import PassContext, PassReport
from pagedattn.passes.site import AttentionSite, aten

__all__ = ["cross_attention_sites", "cross_refusal", "constant_over_positions", "mark_varying_masks", "input_ancestors", "cross_kv_writes", "tokens_view",
           "CROSS_SLOT_MAPPING"]

CROSS_SLOT_MAPPING = "cross_slot_mapping"


def input_ancestors(node: Node) -> frozenset[str]:
    """Names of the placeholders a node's values are computed from (sizes read off a tensor do not count:
    a batch size taken from the decoder's tokens shapes the encoder's K/V but carries no value of theirs)."""
    seen, stack, found = set(), [node], set()
    while stack:
        n = stack.pop()
        if n in seen or n.target is aten.sym_size.int:
            continue
        seen.add(n)
        if n.op == "placeholder":
            found.add(n.name)
        stack.extend(n.all_input_nodes)
    return frozenset(found)


def cross_refusal(site: Optional[AttentionSite]) -> Optional[str]:
    """Why a site whose keys come from the encoder cannot be served as cross-attention over a filled cache;
    None when it can (every encoder key visible to every query, nothing read per position or per key)."""
    if site is None:
        return "no classified site"
    p = site.params()
    if p.causal or site.mask_kind != "none":
        return f"its mask is {site.mask_kind!r}, not every encoder key for every decoder token"
    if site.key_padding is not None:
        return "it reads a key-padding mask (cross-attention blocks hold a request's encoder tokens only)"
    if p.alibi_slopes is not None or p.position_mod or p.sinks is not None:
        return "it adds a bias over positions or attention sinks"
    if site.mask_varying is None and (site.biases or site.conds or site.factors):
        return "its mask terms were not examined (mark_varying_masks did not run)"
    if site.mask_varying:
        # the mask was proven with queries at the last key positions (a decoder no longer than its encoder);
        # at runtime the decoder may be longer: only terms no position can change hold for every pair
        return (f"its mask term {site.mask_varying} is all-visible only for a decoder no longer than the encoder "
                "(a decoder step may outgrow it)")
    return None


def mark_varying_masks(gm: GraphModule, ctx: PassContext) -> PassReport:
    """Record on each site (``AttentionSite.mask_varying``) the first mask term whose value may differ between
    (query, key) pairs (:func:`constant_over_positions`), while the terms are still in the graph; cross-attention
    refuses such sites (:func:`cross_refusal`). Runs for encoder-decoder steps only (``ctx.encoder_inputs``)."""
    if not ctx.encoder_inputs:
        return PassReport("mark_varying_masks", False, "not an encoder-decoder step")
    marked = 0
    for site in ctx.sites:
        terms = [t[0] for t in (*site.biases, *site.conds, *site.factors)]
        site.mask_varying = ""
        if site.mask_kind == "none" and not all(constant_over_positions(t) for t in terms):
            why = _hides_keys_of_a_longer_decoder(gm, site, ctx)
            if why:
                site.mask_varying = f"{terms[0].name} ({why})"
                marked += 1
    return PassReport("mark_varying_masks", False, f"{marked} sites whose mask is proven only for a decoder no "
                                                   "longer than the encoder")


def _hides_keys_of_a_longer_decoder(gm: GraphModule, site: AttentionSite, ctx: PassContext) -> str:
    """Why the site's mask may hide a key or add a bias once the queries outnumber the keys ("" when it is
    proven not to): its mask program read as for the classification (``passes.mask_program.read_mask``),
    proven with every fact but ``S <= L`` (the queries being the last of the key positions), so that query
    and key counts are independent, as a decoder step's tokens and its encoder's are."""
    import z3

    from pagedattn.passes.classify_mask import input_roles
    from pagedattn.passes.mask_program import NotEstablished, read_mask

    roles, constants = input_roles(gm, site, ctx)
    try:
        with torch.no_grad():
            f = read_mask(gm, site, roles, constants, ctx.max_length, True, "x")
    except NotEstablished as e:
        return str(e)
    facts = [x for x in f.facts if not z3.eq(x, f.S <= f.L)]
    solver = z3.Solver()
    solver.set("timeout", 10_000)
    solver.add(*facts, z3.Not(z3.And(f.allowed, f.bias == 0)))
    verdict = solver.check()
    if verdict == z3.unsat:
        return ""
    if verdict == z3.sat:
        m = solver.model()
        at = ", ".join(f"{n} = {m.eval(v, model_completion=True)}" for n, v in
                       (("decoder tokens", f.S), ("encoder tokens", f.L), ("query", f.i), ("key", f.j)))
        return f"it hides a key or adds a bias at {at}"
    return "the solver could not decide it"


# ops whose result holds no position: a value filled in, reshaped, cast or combined elementwise (their
# inputs checked in turn); anything else (arange, triu/tril, indexing, a buffer, an input) may read one
_CONSTANT_OPS = frozenset(getattr(aten, n).default for n in (
    "full", "zeros", "ones", "scalar_tensor", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones",
    "new_full", "expand", "view", "reshape", "unsqueeze", "squeeze", "_to_copy", "clone", "alias", "lift_fresh_copy",
    "detach", "contiguous") if hasattr(getattr(aten, n, None), "default")) | frozenset(
    getattr(getattr(aten, n), o) for n in ("add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt", "ge",
                                           "logical_and", "logical_or", "logical_not", "neg", "masked_fill",
                                           "where", "to", "fill", "bitwise_and", "bitwise_or", "bitwise_not")
    for o in ("Tensor", "Scalar", "default", "Tensor_Scalar", "ScalarOther", "self", "dtype", "dtype_layout")
    if hasattr(getattr(aten, n, None), o))


def constant_over_positions(node: Node) -> bool:
    """Whether a mask term's value is the same at every (query, key) pair, for every size: every tensor it is
    computed from is filled with constants (sizes may shape it, values never come from an index, a buffer
    or an input). Cross-attention mask terms must be: a decoder step may run more tokens than its encoder has
    (see :func:`cross_refusal`)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):  # a size or a scalar: shapes the term, carries no position
            continue
        if n.op != "call_function" or n.target not in _CONSTANT_OPS or getattr(n, "_erased", False):
            return False
        stack.extend(n.all_input_nodes)
    return True


def cross_attention_sites(gm: GraphModule, ctx: PassContext) -> list[Node]:
    """Canonical attention nodes that are cross-attention: keys and values computed from the encoder
    inputs (and model state) alone, queries from the decoder's own inputs, and a mask that lets every
    decoder token see every encoder token. Empty without ``ctx.encoder_inputs``."""
    enc = ctx.encoder_inputs
    if not enc:
        return []
    out = []
    for n in gm.graph.nodes:
        if not is_attention(n):
            continue
        a = read_attention(n)
        kv = input_ancestors(a.key) | input_ancestors(a.value)
        q = input_ancestors(a.query)
        if not kv or not kv <= enc or q <= enc:
            continue
        site = _site_of(n, ctx)
        if cross_refusal(site) is None:
            out.append(n)
    return out


def _site_of(node: Node, ctx: PassContext) -> Optional[AttentionSite]:
    name = node.meta.get("pagedattn_site")
    return next((s for s in ctx.sites if s.name == name), None)


def cross_kv_writes(gm: GraphModule, ctx: PassContext) -> PassReport:
    """Turn a copy of the canonical graph into the cross-cache writer (see the module).

    The encoder states come in as a padded batch ``[B, L, hidden]``; ``cross_slot_mapping [B * L]``
    sends each token's K/V to its request's cross blocks (-1 for padding). Sites are taken in graph
    order, the order of the paged graph's ``cross_kv_cache_<j>`` inputs.
    """
    g = gm.graph
    sites = cross_attention_sites(gm, ctx)
    if not sites:
        return PassReport("cross_kv_writes", False, "no cross-attention")
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    caches = []
    with g.inserting_after(placeholders[-1]):
        slots = g.placeholder(CROSS_SLOT_MAPPING)
        for j in reversed(range(len(sites))):
            caches.insert(0, g.placeholder(f"cross_kv_cache_{j}"))
    writes = []
    for node, cache in zip(sites, caches):
        a = read_attention(node)
        hkv, d, dv = a.params.num_kv_heads, a.key.meta["val"].shape[3], a.value.meta["val"].shape[3]
        with g.inserting_before(node):
            kt = tokens_view(g, a.key, hkv, d)  # [B*L, Hkv, D]
            vt = tokens_view(g, a.value, hkv, dv)
            writes.append(g.call_function(torch.ops.pagedattn.write_kv_cache.default, (kt, vt, cache, slots)))
    out = next(n for n in g.nodes if n.op == "output")
    out.args = ((),)
    _sizes_from_encoder(g, ctx.encoder_inputs)
    for n in list(g.nodes):  # export's input guards check the decoder's inputs, which the writer does not take
        if n.op == "call_module" and str(n.target).startswith("_guards"):
            g.erase_node(n)
    remove_dead_code(gm, ctx)
    for p in placeholders:
        if not p.users and p.name not in ctx.encoder_inputs:
            g.erase_node(p)
    left = [p.name for p in g.nodes if p.op == "placeholder" and p.name not in ctx.encoder_inputs
            and p.name not in {c.name for c in caches} and p.name != CROSS_SLOT_MAPPING]
    if left:
        raise ValueError(f"cross_kv_writes: the cross-attention K/V read decoder inputs {left}")
    gm.recompile()
    return PassReport("cross_kv_writes", True, f"{len(writes)} cross-attention caches written")


def _sizes_from_encoder(g: Graph, encoder_inputs: frozenset[str]) -> None:
    """Sizes read off the decoder's inputs (a batch size shared with the encoder's) read off an encoder
    input of the same symbolic size instead, so that the writer takes the encoder inputs alone."""
    enc_dims = {}
    for p in g.nodes:
        if p.op == "placeholder" and p.name in encoder_inputs and isinstance(p.meta.get("val"), torch.Tensor):
            for d, size in enumerate(p.meta["val"].shape):
                enc_dims.setdefault(str(size), (p, d))
    for n in list(g.nodes):
        if n.target is not aten.sym_size.int or n.args[0].op != "placeholder" or n.args[0].name in encoder_inputs:
            continue
        size = n.args[0].meta["val"].shape[n.args[1]]
        if str(size) in enc_dims:
            n.args = enc_dims[str(size)]


def tokens_view(g: Graph, x: Node, heads: int, dim: int) -> Node:
    """``[B, H, S, D]`` -> ``[B*S, H, D]``: a canonical operand as the paged ops take tokens."""
    t = g.call_function(aten.transpose.int, (x, 1, 2))  # [B, S, H, D]
    t.meta["val"] = x.meta["val"].transpose(1, 2)
    r = g.call_function(aten.reshape.default, (t, [-1, heads, dim]))  # [B*S, H, D]
    r.meta["val"] = t.meta["val"].reshape(-1, heads, dim)
    return r
