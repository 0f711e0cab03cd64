"""Turn canonical attention nodes into a KV-cache write plus a paged attention call.

Adds graph inputs after the model's own: one cache per site (``kv_cache_<i>``), then the
metadata (``METADATA_FIELDS``: ``slot_mapping``, ``block_tables``, ``seq_lens``, ``query_start_loc``).
The paged sites are recorded in ``ctx.paged_sites``, in cache-input order.
"""

from __future__ import annotations

import dataclasses

from torch.fx import GraphModule, Node

from pagedattn.backends.metadata import METADATA_FIELDS
from pagedattn.passes.canonical import is_attention, paged_nodes, read_attention
from pagedattn.passes.context import PagedSite, PassContext, PassReport
from pagedattn.passes.site import aten, same_size

__all__ = ["insert_paged", "is_self_attention", "metadata_inputs"]


def is_self_attention(node: Node) -> bool:
    """Queries and keys come from the same tokens (same length): the site has a KV cache to page."""
    q, k = node.args[0].meta.get("val"), node.args[1].meta.get("val")
    return q is not None and k is not None and same_size(q.shape[2], k.shape[2]) and same_size(q.shape[0], k.shape[0])


def metadata_inputs(gm: GraphModule) -> dict[str, Node]:
    """The paged graph's metadata placeholders by name (empty for a graph without paged sites)."""
    return {n.name: n for n in gm.graph.nodes if n.op == "placeholder" and n.name in METADATA_FIELDS}


def insert_paged(gm: GraphModule, ctx: PassContext) -> PassReport:
    g = gm.graph
    # cross-attention keeps its canonical (dense) form: its keys are not this step's tokens
    sites = [n for n in g.nodes if is_attention(n) and is_self_attention(n)]
    ctx.paged_sites = []
    if not sites:
        return PassReport("insert_paged", False, "no canonical attention")
    ctx.token_count = read_attention(sites[0]).query.meta["val"].shape[2]  # [B, H, S, D]: S
    last_ph = [n for n in g.nodes if n.op == "placeholder"][-1]
    caches, meta = [], {}
    with g.inserting_after(last_ph):
        # inserted in reverse so they end up in order after the model's own inputs
        for name in reversed(METADATA_FIELDS):
            meta[name] = g.placeholder(name)
        for i in reversed(range(len(sites))):
            caches.insert(0, g.placeholder(f"kv_cache_{i}"))
    for node, cache in zip(sites, caches):
        site = read_attention(node)
        q, v = site.query.meta["val"], site.value.meta["val"]
        hq, d, dv, hkv = q.shape[1], q.shape[3], v.shape[3], site.params.num_kv_heads
        with g.inserting_before(node):
            qt = _tokens(g, site.query, hq, d)  # [B*S, Hq, D]
            kt = _tokens(g, site.key, hkv, d)  # [B*L, Hkv, D]
            vt = _tokens(g, site.value, hkv, dv)
            o = paged_nodes(g, qt, kt, vt, cache, meta, dataclasses.replace(site.params, head_size_v=int(dv)))
            b = g.call_function(aten.sym_size.int, (site.query, 0))
            s = g.call_function(aten.sym_size.int, (site.query, 2))
            o = g.call_function(aten.view.default, (o, [b, s, hq, dv]))
            o = g.call_function(aten.transpose.int, (o, 1, 2))  # [B, Hq, S, Dv]
        node.replace_all_uses_with(o)
        g.erase_node(node)
    ctx.paged_sites = [PagedSite(c.name, n.meta.get("pagedattn_site")) for c, n in zip(caches, sites)]
    return PassReport("insert_paged", True, f"{len(sites)} sites paged")


def _tokens(g, x: Node, heads: int, dim: int) -> Node:
    t = g.call_function(aten.transpose.int, (x, 1, 2))  # [B, S, H, D]
    t.meta["val"] = x.meta["val"].transpose(1, 2)
    r = g.call_function(aten.reshape.default, (t, [-1, heads, dim]))  # [B*S, H, D]
    r.meta["val"] = t.meta["val"].reshape(-1, heads, dim)
    return r
