"""Linears that read the same input, as one linear of their summed width (a layer's q/k/v projections, its MLP's
gate and up projections).

On a GPU a decode step multiplies a few dozen rows by each weight, and a GEMM per weight is mostly launch latency
and tail for the narrow ones: a GQA layer's k and v read ~1 MB each, ~0.25 us at an H200's copy rate, where the
smallest GEMM kernels of a decode step's profile took ~5 us each (benchmarks/RESULTS.md; kernels attributed to
weights by their counts, not traced). One GEMM over the concatenated weight reads the same bytes in one launch;
the outputs are column slices of its output. Each output element is the same dot product as before, summed in
whatever order the GEMM picks (as any change of GEMM shape may), so results agree to rounding, not bit for bit.

The weights stay in one copy: each original parameter becomes a view of the concatenated tensor (same values,
same objects, so the model and the paged graph keep sharing them). A group is left alone where that cannot hold:
a weight shared with anything else (tied embeddings), not contiguous or not its storage's whole, or of another
dtype, device or input width than the group's, or biases on some of the group's linears and not others (a model
whose linears an earlier run of the pass joined keeps them as they are: its weights are views of one storage).
Savers that refuse tensors sharing memory (safetensors) need copies of such a model's weights afterwards.
Inductor's freezing concatenates such linears too, but as constants of the compiled graph: a second copy of the
weights and a longer start-up (benchmarks/RESULTS.md, 2026-11-26, tenth session).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from pagedattn.passes.context import PassContext, PassReport

log = logging.getLogger("pagedattn")

__all__ = ["ConcatLinears"]

aten = torch.ops.aten


def _storages(gm: GraphModule) -> dict[int, int]:
    """How many of ``gm``'s parameters and buffers use each storage (by its data pointer)."""
    counts: dict[int, int] = {}
    for t in (*gm.parameters(), *gm.buffers()):
        ptr = t.untyped_storage().data_ptr()
        counts[ptr] = counts.get(ptr, 0) + 1
    return counts


def _own_tensor(gm: GraphModule, node: Optional[Node], storages: dict[int, int]) -> Optional[torch.Tensor]:
    """The parameter a ``get_attr`` node reads, where it can become a view of a concatenated tensor: read by this
    node alone, contiguous, the whole of a storage no other parameter or buffer uses."""
    if node is None or node.op != "get_attr" or len(node.users) != 1:
        return None
    t = operator.attrgetter(node.target)(gm)
    if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.storage_offset() != 0 or \
            t.untyped_storage().nbytes() != t.numel() * t.element_size() or \
            storages.get(t.untyped_storage().data_ptr()) != 1:
        return None
    return t


def _bias(lin: Node) -> Optional[Node]:
    return lin.args[2] if len(lin.args) > 2 else None


def _group_key(gm: GraphModule, lin: Node, storages: dict[int, int]):
    """What linears must share to be concatenated (None: this one cannot be)."""
    if lin.target is not aten.linear.default or lin.kwargs:
        return None
    w = _own_tensor(gm, lin.args[1], storages)
    bias = _bias(lin)
    b = _own_tensor(gm, bias, storages) if bias is not None else None
    if w is None or w.dim() != 2 or (bias is not None and (b is None or b.dim() != 1)):
        return None
    return (w.dtype, w.device, w.shape[1], bias is not None, w.requires_grad)


def _concat(gm: GraphModule, nodes: list[Node], name: str) -> str:
    """Concatenate the ``get_attr`` tensors of ``nodes`` along dim 0 into a new parameter of ``gm`` (``name``, made
    unique), each original made a view of it; its name."""
    tensors = [operator.attrgetter(n.target)(gm) for n in nodes]
    joined = torch.nn.Parameter(torch.cat([t.detach() for t in tensors]), requires_grad=tensors[0].requires_grad)
    while hasattr(gm, name):
        name += "_"
    gm.register_parameter(name, joined)
    start = 0
    for t in tensors:
        t.data = joined.data[start:start + t.shape[0]]  # the same values in the joined storage: one copy
        start += t.shape[0]
    return name


@dataclass(frozen=True)
class ConcatLinears:
    """The pass: groups of ``aten.linear`` nodes reading the same input run as one linear, in place."""

    name: str = "concat_linears"

    def __call__(self, gm: GraphModule, ctx: PassContext) -> PassReport:
        g = gm.graph
        storages = _storages(gm)
        groups: list[list[Node]] = []
        for x in list(g.nodes):
            by_key: dict[tuple, list[Node]] = {}
            for user in x.users:
                if user.op == "call_function" and user.args and user.args[0] is x:
                    key = _group_key(gm, user, storages)
                    if key is not None:
                        by_key.setdefault(key, []).append(user)
            groups += [lins for lins in by_key.values() if len(lins) > 1]
        order = {n: i for i, n in enumerate(g.nodes)}
        for index, lins in enumerate(groups):
            lins.sort(key=order.__getitem__)
            x = lins[0].args[0]
            widths = [operator.attrgetter(lin.args[1].target)(gm).shape[0] for lin in lins]
            weight = _concat(gm, [lin.args[1] for lin in lins], f"_concat_linear_{index}")
            bias = None if _bias(lins[0]) is None else \
                _concat(gm, [_bias(lin) for lin in lins], f"_concat_linear_{index}_bias")
            with g.inserting_before(lins[0]):
                args = [x, g.get_attr(weight)]
                if bias is not None:
                    args.append(g.get_attr(bias))
                joined = g.call_function(aten.linear.default, tuple(args))  # [..., sum(widths)]
                parts = g.call_function(aten.split_with_sizes.default, (joined, widths, -1))
                outs = [g.call_function(operator.getitem, (parts, i)) for i in range(len(lins))]
            for lin, out in zip(lins, outs):
                old = [a for a in lin.args[1:] if isinstance(a, Node)]
                lin.replace_all_uses_with(out)
                g.erase_node(lin)
                for attr in old:
                    if not attr.users:
                        g.erase_node(attr)
        if groups:
            gm.recompile()
            log.info("%d groups of linears run as one linear each (%d linears)", len(groups),
                     sum(map(len, groups)))
        return PassReport(self.name, bool(groups), f"{len(groups)} groups of linears concatenated "
                                                   f"({sum(map(len, groups))} linears)")
