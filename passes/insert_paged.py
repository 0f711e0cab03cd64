"""Turn canonical attention nodes into a KV-cache write plus a paged attention call.

Adds graph inputs after the model's own: one cache per site (``kv_cache_<i>``), then the
metadata (``METADATA_FIELDS``: ``slot_mapping``, ``block_tables``, ``seq_lens``, ``query_start_loc``).
The paged sites are recorded in ``ctx.paged_sites``, in cache-input order.

In an encoder-decoder's decoder step (``ctx.encoder_inputs`` set), cross-attention sites
(``passes.cross_attention``) read a cache of their own (``cross_kv_cache_<j>``, after the
``kv_cache_<i>``), filled once per request, through their own metadata inputs
(``CROSS_METADATA_FIELDS``, after ``METADATA_FIELDS``) and the step's ``query_start_loc``: a
non-causal paged attend with no write (``key=None``). They are recorded in ``ctx.cross_sites``.

Sites whose position program reads per-request values (a prefix-LM mask from ``token_type_ids``) read
them, in paged mode, from one more input after all of those: ``position_values`` (``[num_seqs, count]``,
a row per sequence of the step; ``position_mod.values_from_input`` gives a request's row).
"""

from __future__ import annotations

import dataclasses

from torch.fx import GraphModule, Node

from pagedattn.backends.metadata import CROSS_METADATA_FIELDS, METADATA_FIELDS
from pagedattn.passes.canonical import attend_node, is_attention, paged_nodes, read_attention
from pagedattn.passes.context import PagedSite, PassContext, PassReport
from pagedattn.passes.cross_attention import cross_attention_sites, tokens_view
from pagedattn.passes.site import aten, same_size

__all__ = ["insert_paged", "is_self_attention", "metadata_inputs", "POSITION_VALUES"]

POSITION_VALUES = "position_values"  # the paged graph's input of per-sequence values


def is_self_attention(node: Node) -> bool:
    """Queries and keys come from the same tokens (same length): the site has a KV cache to page."""
    q, k = node.args[0].meta.get("val"), node.args[1].meta.get("val")
    return q is not None and k is not None and same_size(q.shape[2], k.shape[2]) and same_size(q.shape[0], k.shape[0])


def metadata_inputs(gm: GraphModule) -> dict[str, Node]:
    """The paged graph's metadata placeholders by name (empty for a graph without paged sites)."""
    return {n.name: n for n in gm.graph.nodes if n.op == "placeholder" and n.name in METADATA_FIELDS}


def insert_paged(gm: GraphModule, ctx: PassContext) -> PassReport:
    g = gm.graph
    # cross-attention of an encoder-decoder reads blocks filled once per request; other attention whose
    # keys are not this step's tokens keeps its canonical (dense) form
    cross = cross_attention_sites(gm, ctx)
    sites = [n for n in g.nodes if is_attention(n) and is_self_attention(n) and n not in cross]
    ctx.paged_sites, ctx.cross_sites = [], []
    if not sites:
        return PassReport("insert_paged", False, "no canonical attention" if not cross else
                          "cross-attention without self-attention: no decoder step to page")
    ctx.token_count = read_attention(sites[0]).query.meta["val"].shape[2]  # [B, H, S, D]: S
    last_ph = [n for n in g.nodes if n.op == "placeholder"][-1]
    caches, cross_caches, meta = [], [], {}
    with g.inserting_after(last_ph):
        if any(read_attention(n).params.position_data is not None for n in sites):
            meta[POSITION_VALUES] = g.placeholder(POSITION_VALUES)  # inserted first: it ends up last
        # inserted in reverse so they end up in order after the model's own inputs
        for name in reversed(CROSS_METADATA_FIELDS if cross else ()):
            meta[name] = g.placeholder(name)
        for name in reversed(METADATA_FIELDS):
            meta[name] = g.placeholder(name)
        for j in reversed(range(len(cross))):
            cross_caches.insert(0, g.placeholder(f"cross_kv_cache_{j}"))
        for i in reversed(range(len(sites))):
            caches.insert(0, g.placeholder(f"kv_cache_{i}"))
    for node, cache in zip(sites, caches):
        _page(g, node, cache, meta, cross=False)
    for node, cache in zip(cross, cross_caches):
        _page(g, node, cache, meta, cross=True)
    ctx.paged_sites = [PagedSite(c.name, n.meta.get("pagedattn_site")) for c, n in zip(caches, sites)]
    ctx.cross_sites = [PagedSite(c.name, n.meta.get("pagedattn_site")) for c, n in zip(cross_caches, cross)]
    for kind, paged in (("self", ctx.paged_sites), ("cross", ctx.cross_sites)):
        for p in paged:
            if any(s.name == p.site for s in ctx.sites):
                ctx.site(p.site).attention_type = kind
    detail = f"{len(sites)} sites paged" + (f", {len(cross)} cross-attention sites over filled caches" if cross else "")
    return PassReport("insert_paged", True, detail)


def _page(g, node: Node, cache: Node, meta: dict[str, Node], cross: bool) -> None:
    """Replace one canonical node: self-attention writes the step's K/V and attends; cross-attention
    attends (non-causal, no write) over its request's cross blocks."""
    site = read_attention(node)
    q, v = site.query.meta["val"], site.value.meta["val"]
    hq, d, dv, hkv = q.shape[1], q.shape[3], v.shape[3], site.params.num_kv_heads
    params = dataclasses.replace(site.params, head_size_v=int(dv))
    if params.position_data is not None:  # the model's input in drop-in mode; the step's values here
        params = dataclasses.replace(params, position_data=meta[POSITION_VALUES])
    with g.inserting_before(node):
        qt = tokens_view(g, site.query, hq, d)  # [B*S, Hq, D]
        if cross:
            o = attend_node(g, qt, None, None, cache, meta["cross_block_tables"], meta["cross_seq_lens"],
                            meta["query_start_loc"], dataclasses.replace(params, causal=False))
        else:
            kt = tokens_view(g, site.key, hkv, d)  # [B*L, Hkv, D]
            vt = tokens_view(g, site.value, hkv, dv)
            o = paged_nodes(g, qt, kt, vt, cache, meta, params)
        b = g.call_function(aten.sym_size.int, (site.query, 0))
        s = g.call_function(aten.sym_size.int, (site.query, 2))
        o = g.call_function(aten.view.default, (o, [b, s, hq, dv]))
        o = g.call_function(aten.transpose.int, (o, 1, 2))  # [B, Hq, S, Dv]
    node.replace_all_uses_with(o)
    g.erase_node(node)
