"""Turn canonical attention nodes into a KV-cache write plus a paged attention call.

Adds graph inputs after the model's own: one cache per site (``kv_cache_<i>``), then the
metadata ``slot_mapping``, ``block_tables``, ``seq_lens``, ``query_start_loc``.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from pagedattn.passes.site import PassResult, aten, same_size

METADATA_INPUTS = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")


def canonical_nodes(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.pagedattn.attention.default]


def is_self_attention(node: Node) -> bool:
    """Queries and keys come from the same tokens (same length): the site has a KV cache to page."""
    q, k = node.args[0].meta.get("val"), node.args[1].meta.get("val")
    return q is not None and k is not None and same_size(q.shape[2], k.shape[2]) and same_size(q.shape[0], k.shape[0])


def insert_paged(gm: GraphModule) -> PassResult:
    g = gm.graph
    # cross-attention keeps its canonical (dense) form: its keys are not this step's tokens
    sites = [n for n in canonical_nodes(gm) if is_self_attention(n)]
    if not sites:
        gm.meta["pagedattn_cache_inputs"] = []
        gm.meta["pagedattn_cache_sites"] = []
        return PassResult("insert_paged", False, "no canonical attention")
    last_ph = [n for n in g.nodes if n.op == "placeholder"][-1]
    caches, meta = [], {}
    with g.inserting_after(last_ph):
        # inserted in reverse so they end up in order after the model's own inputs
        for name in reversed(METADATA_INPUTS):
            meta[name] = g.placeholder(name)
        for i in reversed(range(len(sites))):
            caches.insert(0, g.placeholder(f"kv_cache_{i}"))
    for node, cache in zip(sites, caches):
        q, k, v, key_padding, scale, causal, window, softcap, alibi, hkv = node.args
        hq, d = q.meta["val"].shape[1], q.meta["val"].shape[3]
        dv = v.meta["val"].shape[3]
        with g.inserting_before(node):
            qt = _tokens(g, q, hq, d)  # [B*S, Hq, D]
            kt = _tokens(g, k, hkv, d)  # [B*L, Hkv, D]
            vt = _tokens(g, v, hkv, dv)
            g.call_function(torch.ops.pagedattn.write_kv_cache.default, (kt, vt, cache, meta["slot_mapping"]))
            o = g.call_function(
                torch.ops.pagedattn.paged_attention.default,
                (qt, kt, vt, cache, meta["block_tables"], meta["seq_lens"], meta["query_start_loc"],
                 scale, causal, window, softcap, alibi, hkv, dv),
            )
            b = g.call_function(aten.sym_size.int, (q, 0))
            s = g.call_function(aten.sym_size.int, (q, 2))
            o = g.call_function(aten.view.default, (o, [b, s, hq, dv]))
            o = g.call_function(aten.transpose.int, (o, 1, 2))  # [B, Hq, S, Dv]
        node.replace_all_uses_with(o)
        g.erase_node(node)
    gm.meta["pagedattn_cache_inputs"] = [c.name for c in caches]
    gm.meta["pagedattn_cache_sites"] = [n.meta.get("pagedattn_site") for n in sites]
    return PassResult("insert_paged", True, f"{len(sites)} sites paged")


def _tokens(g, x: Node, heads: int, dim: int) -> Node:
    t = g.call_function(aten.transpose.int, (x, 1, 2))  # [B, S, H, D]
    return g.call_function(aten.reshape.default, (t, [-1, heads, dim]))
