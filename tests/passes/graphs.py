"""Export helpers for pass-level tests."""

import torch

from pagedattn.api import _flat_graph_module


def aten_graph(module, args):
    """The flat ATen graph pagedattn's passes see, with its example inputs recorded."""
    A = torch.export.Dim.AUTO
    shapes = tuple({i: A for i in range(a.dim())} for a in args)
    ep = torch.export.export(module.eval(), args, dynamic_shapes=shapes, strict=False)
    gm, _, _ = _flat_graph_module(ep)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    gm.meta["pagedattn_example_inputs"] = {p.name: a for p, a in zip(phs, args)}
    return gm


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]
