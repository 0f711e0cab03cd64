"""Remove what the rewrite left dead (mask construction, the old score path)."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from pagedattn.passes.context import PassContext, PassReport

_ASSERT = torch.ops.aten._assert_tensor_metadata.default
# functorch's vmap levels (Hugging Face builds some masks with vmap, and export keeps the calls): entering
# and leaving a level changes state that later calls read, whether or not their results are used
_VMAP_STATE = {"_vmap_increment_nesting", "_vmap_decrement_nesting"}


def _impure(n: Node) -> bool:
    """Side effects other than export's dtype asserts and random number use (SDPA counts as random:
    its dropout), which fx's DCE keeps, and with them the replaced attention that eager graphs would run."""
    if n.target is _ASSERT:
        return False
    if n.op == "call_function" and getattr(n.target, "__name__", "") in _VMAP_STATE:
        return True
    try:
        return n.is_impure(impure_random=False)
    except TypeError:  # torch < 2.9
        return n.is_impure()


def remove_dead_code(gm: GraphModule, ctx: PassContext) -> PassReport:
    before = len(gm.graph.nodes)
    live: set[Node] = set()
    stack = [n for n in gm.graph.nodes if _impure(n)]
    while stack:
        n = stack.pop()
        if n not in live:
            live.add(n)
            stack.extend(n.all_input_nodes)
    for n in reversed(gm.graph.nodes):  # asserts about values nothing uses go with them
        if n.target is _ASSERT and not set(n.all_input_nodes) <= live:
            gm.graph.erase_node(n)
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.target is _ASSERT or _impure(n))
    removed = before - len(gm.graph.nodes)
    return PassReport("remove_dead_code", removed > 0, f"{removed} nodes removed")
