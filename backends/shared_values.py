"""An Inductor post-grad pass: a costly elementwise value that many nodes read is computed once per step.

Inductor's C++ code inlines a pointwise value into every kernel that reads it unless the value is costly by its
measure (``StorageBox.should_realize_on_reuse``: on the CPU, ``exp``, ``log``, ``sigmoid``, ``tanh`` and their
kind). Trigonometric functions are not on that list, so a rotary embedding's ``cos`` and ``sin`` (one ``[T, D]``
table a step, read by the query and key rotations of every layer) are evaluated again for every element of every
head of every layer: on llama16m (6 layers, 6 + 2 heads) a 1000-token prefill evaluates ~6 M sines and cosines where
~128 K suffice, a few milliseconds of a ~30 ms step (``benchmarks/RESULTS.md``).

:class:`RealizeSharedValues` marks such a value for Inductor to compute into a buffer of its own (the node meta key
``inductor_realize_to_strides``, which Inductor's lowering honours): the first node after the costly op where the
value fans out to more than one reader, following single-reader elementwise steps (a scaling, a dtype conversion) and
looking through views. What the step computes does not change beyond rounding: the buffer holds the value in the
node's own dtype, which is what eager mode computes too (Inductor's fused code keeps it in float32 instead).
"""

from __future__ import annotations

import logging

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

log = logging.getLogger("pagedattn")

__all__ = ["RealizeSharedValues", "COSTLY", "ELEMENTWISE", "VIEWS"]

aten = torch.ops.aten
prims = torch.ops.prims

# ops Inductor's C++ backend recomputes per reader although each costs tens of instructions per element
COSTLY = frozenset({aten.sin.default, aten.cos.default, aten.tan.default, aten.asin.default, aten.acos.default,
                    aten.atan.default, aten.sinh.default, aten.cosh.default, aten.erf.default, aten.erfinv.default})
# single-input elementwise steps a costly value passes through on its way to its readers
ELEMENTWISE = frozenset({aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.neg.default,
                         aten.add.Scalar, prims.convert_element_type.default, aten._to_copy.default})
# ops that only re-index their input: readers through them read the same buffer
VIEWS = frozenset({aten.view.default, aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim,
                   aten.expand.default, aten.permute.default, aten.transpose.int, aten.slice.Tensor,
                   aten.select.int, aten.alias.default, aten._unsafe_view.default})


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _readers(node: torch.fx.Node) -> int:
    """How many nodes read ``node``'s value, counting the readers of its views (not the views)."""
    count = 0
    for user in node.users:
        count += _readers(user) if user.op == "call_function" and user.target in VIEWS else 1
    return count


def _fan_out_point(node: torch.fx.Node) -> torch.fx.Node:
    """The last node of ``node``'s single-reader chain of elementwise steps (each with no other tensor input)."""
    while len(node.users) == 1:
        (user,) = node.users
        if user.op != "call_function" or user.target not in ELEMENTWISE or _tensor_inputs(user) != [node]:
            break
        node = user
    return node


class RealizeSharedValues(CustomGraphPass):
    """Inductor post-grad pass: see the module docstring."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        marked = 0
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in COSTLY:
                continue
            point = _fan_out_point(node)
            if _readers(point) > 1 and isinstance(point.meta.get("val"), torch.Tensor):
                point.meta["inductor_realize_to_strides"] = True
                marked += 1
        if marked:
            log.debug("pagedattn: %d shared elementwise values computed once a step", marked)

    def uuid(self) -> str:
        return get_hash_for_files((__file__,)).hex()  # the pass is this module
