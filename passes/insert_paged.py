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
    seq_q = sites[0].args[0]  # [B, H, S, D]: S is the token dimension
    for node, cache in zip(sites, caches):
        q, k, v, key_padding, scale, causal, window, softcap, alibi, hkv, sinks = (*node.args, None)[:11]
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
                 scale, causal, window, softcap, alibi, hkv, dv, sinks),
            )
            b = g.call_function(aten.sym_size.int, (q, 0))
            s = g.call_function(aten.sym_size.int, (q, 2))
            o = g.call_function(aten.view.default, (o, [b, s, hq, dv]))
            o = g.call_function(aten.transpose.int, (o, 1, 2))  # [B, Hq, S, Dv]
        node.replace_all_uses_with(o)
        g.erase_node(node)
    n_pos = _packed_positions(g, seq_q, meta)
    gm.meta["pagedattn_cache_inputs"] = [c.name for c in caches]
    gm.meta["pagedattn_cache_sites"] = [n.meta.get("pagedattn_site") for n in sites]
    return PassResult("insert_paged", True, f"{len(sites)} sites paged, {n_pos} token-index ranges made positions")


def _tokens(g, x: Node, heads: int, dim: int) -> Node:
    t = g.call_function(aten.transpose.int, (x, 1, 2))  # [B, S, H, D]
    return g.call_function(aten.reshape.default, (t, [-1, heads, dim]))


_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}


def _token_range(n: Node, tokens) -> bool:
    """``arange(S)`` over the token dimension (start 0, step 1)."""
    if n.op != "call_function" or n.target not in _ARANGES:
        return False
    v = n.meta.get("val")
    if v is None or v.dim() != 1 or not same_size(v.shape[0], tokens):
        return False
    if n.target is aten.arange.default:
        return True
    start = n.args[0]
    step = n.args[2] if n.target is aten.arange.start_step else 1
    return start == 0 and step == 1


_POSITION_CONSUMERS = {aten.embedding.default, aten.cos.default, aten.sin.default}


def _feeds_position_encoding(n: Node, depth: int = 40) -> bool:
    """Whether a range reaches a position embedding lookup or rotary cos/sin (not, say, a mask left over)."""
    seen, frontier = set(), [n]
    for _ in range(depth):
        nxt = []
        for x in frontier:
            for u in x.users:
                if u in seen:
                    continue
                seen.add(u)
                if u.target in _POSITION_CONSUMERS:
                    return True
                nxt.append(u)
        frontier = nxt
    return False


def _packed_positions(g, q: Node, meta: dict) -> int:
    """Ranges over the token dimension that survive the rewrite number positions (learned or rotary
    embeddings of a model that takes no ``position_ids``). In paged mode a step packs several
    sequences, each continuing its cache: such a range becomes every token's position in its own
    sequence, computed from the metadata (``seq_lens[i] - (query_start_loc[i+1] - t)`` for token
    ``t`` of sequence ``i``)."""
    qv = q.meta.get("val")
    if qv is None:
        return 0
    ranges = [n for n in g.nodes if _token_range(n, qv.shape[2]) and _feeds_position_encoding(n)]
    if not ranges:
        return 0
    last_ph = [n for n in g.nodes if n.op == "placeholder"][-1]
    with g.inserting_before(last_ph.next):
        f = g.call_function
        slots = meta["slot_mapping"]
        t = f(aten.sub.Tensor, (f(aten.cumsum.default, (f(aten.ones_like.default, (slots,)), 0)), 1))  # [T]
        qsl = f(aten._to_copy.default, (meta["query_start_loc"],), {"dtype": torch.int64})
        lens = f(aten._to_copy.default, (meta["seq_lens"],), {"dtype": torch.int64})
        ends = f(aten.slice.Tensor, (qsl, 0, 1))
        # padding tokens (past the last sequence) index one past the end: repeat the last entry there
        qsl = f(aten.cat.default, ([qsl, f(aten.slice.Tensor, (qsl, 0, -1))],))
        lens = f(aten.cat.default, ([lens, f(aten.slice.Tensor, (lens, 0, -1))],))
        seq = f(aten.searchsorted.Tensor, (ends, t), {"right": True})
        nxt = f(aten.index.Tensor, (qsl, [f(aten.add.Tensor, (seq, 1))]))
        pos = f(aten.add.Tensor, (f(aten.sub.Tensor, (f(aten.index.Tensor, (lens, [seq])), nxt)), t))  # [T]
    for n in ranges:
        with g.inserting_before(n.next):
            cut = g.call_function(aten.slice.Tensor, (pos, 0, 0, n.args[0] if n.target is aten.arange.default
                                                      else n.args[1]))
            new = g.call_function(aten._to_copy.default, (cut,), {"dtype": n.meta["val"].dtype})
        n.replace_all_uses_with(new)
        cut.update_arg(0, pos)
    return len(ranges)
