"""Remove what the rewrite left dead (mask construction, the old score path)."""

from __future__ import annotations

from torch.fx import GraphModule

from pagedattn.passes.site import PassResult


def remove_dead_code(gm: GraphModule) -> PassResult:
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    removed = before - len(gm.graph.nodes)
    return PassResult("remove_dead_code", removed > 0, f"{removed} nodes removed")
