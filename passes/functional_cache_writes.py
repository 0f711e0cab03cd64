"""In-place cache writes made functional, for runtimes that cannot keep a custom op's mutation.

``write_kv_cache(k, v, cache, slots)`` becomes ``new = write_kv_cache_functional(k, v, cache, slots)``
and later reads of ``cache`` read ``new``. What happens to ``new`` is the mode:

- ``"copy_back"``: ``cache.copy_(new)`` (torch_xla's eager functionalization rejects custom ops that
  mutate an argument, and traces this as an update of the cache buffer);
- ``"outputs"``: the new caches are appended to the graph's outputs, in cache order (ONNX export,
  which drops input mutations).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule

from pagedattn.passes.canonical import is_cache_write
from pagedattn.passes.context import PassContext, PassReport

__all__ = ["FunctionalCacheWrites"]

_WRITE = torch.ops.pagedattn.write_kv_cache.default


@dataclass(frozen=True)
class FunctionalCacheWrites:
    """The pass, configured: ``mode`` is ``"copy_back"`` or ``"outputs"``."""

    mode: str = "copy_back"
    name: str = "functional_cache_writes"

    def __post_init__(self):
        if self.mode not in ("copy_back", "outputs"):
            raise ValueError(f"FunctionalCacheWrites: mode must be 'copy_back' or 'outputs', got {self.mode!r}")

    def __call__(self, gm: GraphModule, ctx: PassContext) -> PassReport:
        g = gm.graph
        order = {n: i for i, n in enumerate(g.nodes)}
        writes = [n for n in g.nodes if is_cache_write(n) and n.target is _WRITE]
        new_caches = []
        for w in writes:
            cache = w.args[2]
            with g.inserting_after(w):
                new = g.call_function(torch.ops.pagedattn.write_kv_cache_functional.default, w.args, w.kwargs)
            new.meta["val"] = cache.meta.get("val")
            if self.mode == "copy_back":
                with g.inserting_after(new):
                    g.call_function(torch.ops.aten.copy_.default, (cache, new))
            else:  # later reads see the written cache
                for u in list(cache.users):
                    if u is not w and u is not new and order.get(u, -1) > order[w]:
                        u.replace_input_with(cache, new)
                new_caches.append((order[cache], new))
            g.erase_node(w)
        if new_caches:
            out = next(n for n in g.nodes if n.op == "output")
            old = out.args[0]
            outs = list(old) if isinstance(old, (list, tuple)) else [old]
            out.args = (tuple(outs + [n for _, n in sorted(new_caches, key=lambda t: t[0])]),)
        return PassReport(self.name, bool(writes), f"{len(writes)} cache writes made functional ({self.mode})")
