"""Moving a rewritten model to an XLA device, and compiling its graphs with torch_xla's ``openxla``.

The paged ops themselves run on XLA through ``pagedattn.backends.pallas_xla``; pad serving steps to
its ``StepBuckets`` (``pad_step``) so that XLA compiles a bounded number of graphs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pagedattn.backends import AttentionBackend, active_backend
from pagedattn.passes import FunctionalCacheWrites, PassContext, run_pipeline
from pagedattn.tracing import copy_graph_module

__all__ = ["to_xla", "OpenXlaPerShape", "OpenXlaPerBackend"]


def to_xla(model: torch.nn.Module, device: Optional[torch.device] = None, openxla: bool = False) -> torch.nn.Module:
    """Move a rewritten model (traced on the CPU) to the XLA device, in place.

    Besides parameters and buffers, traced graphs carry device literals (``arange(...,
    device=cpu)``, tensor-metadata asserts); in every ``GraphModule`` inside ``model`` those naming
    the CPU are pointed at ``device`` (default: torch_xla's current device).

    ``openxla=False``: the graphs run op by op as lazy tensors; cache writes become functional
    (:class:`pagedattn.passes.FunctionalCacheWrites`: torch_xla's eager functionalization rejects
    custom ops that mutate an argument). ``openxla=True``: the paged graph of a
    ``RewrittenModel`` is handed to ``torch.compile(backend="openxla")``, whose AOT
    functionalization handles the in-place writes; Dynamo compiles once per step shape and per
    backend instance that runs the paged ops (:class:`OpenXlaPerBackend`), so bucket the steps
    (:func:`pad_step`) and keep their number under ``torch._dynamo.config.recompile_limit``.
    """
    if openxla and not isinstance(getattr(model, "graph_module", None), torch.fx.GraphModule):
        raise TypeError("to_xla(openxla=True) takes a RewrittenModel (pagedattn.rewrite); for a model of your "
                        "own use torch.compile(model, backend='pagedattn', options={'target': 'xla'})")
    import torch_xla

    device = torch.device(device or torch_xla.device())
    cpu = torch.device("cpu")

    def retarget(a):
        if isinstance(a, torch.device) and a == cpu:
            return device
        if isinstance(a, (list, tuple)):
            return type(a)(retarget(x) for x in a)
        if isinstance(a, dict):
            return {k: retarget(v) for k, v in a.items()}
        return a

    for gm in model.modules():
        if isinstance(gm, torch.fx.GraphModule):
            for node in gm.graph.nodes:
                node.args, node.kwargs = retarget(node.args), retarget(node.kwargs)
            if not openxla:
                run_pipeline(gm, PassContext(), (FunctionalCacheWrites("copy_back"),))
            gm.recompile()
    model.to(device)
    # materialise what the move left pending, or the first step's graph differs from later ones
    torch_xla.sync()
    if openxla:
        # static shapes: one graph per bucketed step shape, not a dynamic-shape graph openxla cannot run
        model.graph_module = OpenXlaPerBackend(model.graph_module)
    return model


def _running_backend(args) -> Optional[AttentionBackend]:
    """The backend the paged ops will use for these inputs (the bound one, else the XLA default)."""
    dev = next((a.device for a in args if isinstance(a, Tensor) and a.device.type == "xla"), None)
    return active_backend(dev) if dev is not None else None


class OpenXlaPerBackend(torch.nn.Module):
    """A paged graph compiled by ``torch.compile(backend="openxla", dynamic=False)`` once per backend
    instance that runs its ops (``use_backend``: ``paged_context(..., backend=)``, ``PagedEngine(target=)``).

    torch_xla runs the ops' Python once per step shape to extract the XLA graph, so the graph has
    the backend of that first call built in, and Dynamo's guards do not see which one is bound:
    each backend gets its own copy of the graph (same parameters), hence its own Dynamo cache.
    """

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__()
        self.gm = gm
        self._compiled: dict[int, tuple] = {}  # id(backend) -> (backend, compiled graph)

    def forward(self, *args):
        backend = _running_backend(args)
        entry = self._compiled.get(id(backend))
        if entry is None:
            gm = copy_graph_module(self.gm) if self._compiled else self.gm
            entry = self._compiled[id(backend)] = (backend, torch.compile(gm, backend="openxla", dynamic=False))
        return entry[1](*args)


class OpenXlaPerShape:
    """A graph compiled by torch_xla's ``openxla`` Dynamo backend once per input-shape signature.

    For graphs run where Dynamo does not trace (a backend's graph called from inside compiled
    code runs eagerly, and eager torch_xla rejects the in-place cache write): the backend is
    called directly, its AOT functionalization handles the write, and shapes are keyed here as
    Dynamo's guards would (XLA graphs are static: bucket the steps). The backend instance that runs
    the paged ops is part of the key: the extracted XLA graph has it built in.
    """

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm
        self.compiled: dict[tuple, object] = {}
        self._backends: dict[int, Optional[AttentionBackend]] = {}

    def __call__(self, *args):
        backend = _running_backend(args)
        key = (id(backend),) + tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, Tensor) else a
                                     for a in args)
        fn = self.compiled.get(key)
        if fn is None:
            from torch._dynamo import lookup_backend

            fn = self.compiled[key] = lookup_backend("openxla")(self.gm, list(args))
            self._backends[id(backend)] = backend  # keeps the id in the key from being reused
        return fn(*args)
