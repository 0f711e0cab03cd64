"""Step indices become each token's position in its own sequence.

A model that takes no ``position_ids`` numbers its tokens with ``arange(S)`` over the token
dimension (learned or rotary embeddings, a query temperature), or cuts a table of positions to
the token count (``pe[:, :S]``). A paged step packs several sequences into one row, each
continuing its cache, so each such step index (``token_locality`` finds them) becomes
``seq_lens[i] - (query_start_loc[i+1] - t)`` for token ``t`` of sequence ``i``, computed from the
step's metadata: the range its positions (plus its start), the table its rows at the positions.
A graph of fixed token count is not read by ``token_locality``: there ranges that reach a
position embedding or rotary cos/sin are taken (with one token, every range).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from pagedattn.passes.context import PassContext, PassReport, StepIndex
from pagedattn.passes.insert_paged import metadata_inputs
from pagedattn.passes.site import aten, same_size

__all__ = ["packed_positions"]

_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_POSITION_CONSUMERS = {aten.embedding.default, aten.cos.default, aten.sin.default}


def packed_positions(gm: GraphModule, ctx: PassContext) -> PassReport:
    meta = metadata_inputs(gm)
    if not meta or ctx.token_count is None:
        return PassReport("packed_positions", False, "no paged sites")
    nodes = {n.name: n for n in gm.graph.nodes}
    if ctx.step_indices is not None:  # token_locality read the graph: every step index it found
        found = [(nodes[name], s) for name, s in ctx.step_indices.items() if name in nodes]
    else:  # a graph of fixed token count: ranges that reach a position encoding (one token: any range)
        found = [(n, StepIndex("range", 0, 0)) for n in gm.graph.nodes if _token_range(n, ctx.token_count) and
                 (same_size(ctx.token_count, 1) or _feeds_position_encoding(n))]
    if not found:
        return PassReport("packed_positions", False, "no step indices")
    pos = _positions(gm.graph, meta)
    for n, s in found:
        with gm.graph.inserting_before(n.next):
            f = gm.graph.call_function
            if s.kind == "range":
                end = n.args[0] if n.target is aten.arange.default else n.args[1]
                cut = f(aten.slice.Tensor, (pos, 0, 0, end if s.start == 0 else f(operator.sub, (end, s.start))))
                if s.start:
                    cut = f(aten.add.Tensor, (cut, s.start))
                new = f(aten._to_copy.default, (cut,), {"dtype": n.meta["val"].dtype})
            else:  # a table cut to T rows from a fixed one: its rows at the positions (past that row)
                table = n.args[0]
                if n.target is aten.narrow.default:  # narrow(table, dim, start, length)
                    length = n.args[3]
                else:  # slice(table, dim, start, end)
                    length = n.args[3] if s.start == 0 else f(operator.sub, (n.args[3], s.start))
                rows = f(aten.slice.Tensor, (pos, 0, 0, length))
                if s.start:
                    rows = f(aten.add.Tensor, (rows, s.start))
                new = f(aten.index_select.default, (table, s.dim, rows))
        n.replace_all_uses_with(new)
    return PassReport("packed_positions", True, f"{len(found)} step indices made positions")


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


def _positions(g, meta: dict[str, Node]) -> Node:
    """``[T]`` each token's position in its sequence, from the metadata (placed after the inputs)."""
    last_ph = [n for n in g.nodes if n.op == "placeholder"][-1]
    with g.inserting_before(last_ph.next):
        f = g.call_function
        slots = meta["slot_mapping"]
        t = f(aten.sub.Tensor, (f(aten.cumsum.default, (f(aten.ones_like.default, (slots,)), 0)), 1))  # [T]
        qsl = f(aten._to_copy.default, (meta["query_start_loc"],), {"dtype": torch.int64})
        lens = f(aten._to_copy.default, (meta["seq_lens"],), {"dtype": torch.int64})
        # the sequences that end at or before t: the starts at or below t, less the first (0). Searched in the
        # whole tensor, not in a slice of it: torch 2.11's Inductor cannot lower searchsorted over a view on CUDA
        seq = f(aten.sub.Tensor, (f(aten.searchsorted.Tensor, (qsl, t), {"right": True}), 1))
        # padding tokens (past the last sequence) index one past the end: repeat the last entry there
        qsl = f(aten.cat.default, ([qsl, f(aten.slice.Tensor, (qsl, 0, -1))],))
        lens = f(aten.cat.default, ([lens, f(aten.slice.Tensor, (lens, 0, -1))],))
        nxt = f(aten.index.Tensor, (qsl, [f(aten.add.Tensor, (seq, 1))]))
        return f(aten.add.Tensor, (f(aten.sub.Tensor, (f(aten.index.Tensor, (lens, [seq])), nxt)), t))  # [T]
