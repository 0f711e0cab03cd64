"""Remove what the rewrite left dead (mask construction, the old score path)."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from pagedattn.passes.context import PassContext, PassReport
from pagedattn.passes.site import written_tensor

_ASSERT = torch.ops.aten._assert_tensor_metadata.default
# functorch's vmap levels (Hugging Face builds some masks with vmap, and export keeps the calls): entering
# and leaving a level changes state that later calls read, whether or not their results are used
_VMAP_STATE = {"_vmap_increment_nesting", "_vmap_decrement_nesting"}


# ops that make a new tensor from nothing the graph holds (its contents are what the graph writes into it)
_FRESH = {torch.ops.aten.zeros.default, torch.ops.aten.empty.memory_format, torch.ops.aten.ones.default,
          torch.ops.aten.full.default, torch.ops.aten.zeros_like.default, torch.ops.aten.empty_like.default,
          torch.ops.aten.new_zeros.default, torch.ops.aten.new_empty.default, torch.ops.aten.new_ones.default,
          torch.ops.aten.new_full.default, torch.ops.aten.full_like.default, torch.ops.aten.ones_like.default}


def _scratch_base(n: Node):
    """For an in-place op writing (through views) into a tensor the graph created itself, that tensor's node;
    None for anything else (a write into an input, a buffer or a parameter is a side effect of its own)."""
    base = written_tensor(n)
    if base is not None and base.op == "call_function" and base.target in _FRESH:
        return base
    return None


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
    scratch = {n: base for n in gm.graph.nodes if (base := _scratch_base(n)) is not None}
    live: set[Node] = set()

    def mark(roots) -> None:
        stack = list(roots)
        while stack:
            n = stack.pop()
            if n not in live:
                live.add(n)
                stack.extend(n.all_input_nodes)

    mark(n for n in gm.graph.nodes if _impure(n) and n not in scratch)
    # an in-place write into a tensor the graph made itself matters only if something live reads that tensor
    while pending := [m for m, base in scratch.items() if m not in live and base in live]:
        mark(pending)
    for n in reversed(gm.graph.nodes):  # asserts about values nothing uses go with them
        if n.target is _ASSERT and not set(n.all_input_nodes) <= live:
            gm.graph.erase_node(n)
    gm.graph.eliminate_dead_code(
        is_impure_node=lambda n: n.target is _ASSERT or (_impure(n) and (n not in scratch or n in live)))
    removed = before - len(gm.graph.nodes)
    return PassReport("remove_dead_code", removed > 0, f"{removed} nodes removed")
