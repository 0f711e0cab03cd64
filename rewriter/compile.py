"""``torch.compile(model, backend="pagedattn")``.

Dynamo hands over its graph with real example inputs. The graph is exported to ATen (dimensions
Dynamo already treats as dynamic stay dynamic), the passes run, and the result is a callable
that runs the drop-in graph outside a runtime context and the paged graph inside one, with
the caches and metadata appended from the context. Each graph is compiled once by the inner
compiler: ``"inductor"`` (default; it re-inplaces the cache write) or ``"eager"``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Any, Callable, Iterator, Optional

import torch
from torch.fx import GraphModule

from pagedattn.backends import AttentionBackend, get_backend, use_backend
from pagedattn.driver import RewriteResult, rewrite_graph
from pagedattn.program import check_padding, check_positions
from pagedattn.runtime.context import current_context, refuse_if_unpaged, sites_seeing_later_keys
from pagedattn.tracing import quiet_tracing

log = logging.getLogger("pagedattn")

__all__ = ["pagedattn_backend", "CompiledGraph", "compiled_graphs", "resolve_options"]

DEFAULT_OPTIONS = {"inner": "inductor", "target": "auto", "block_size": 16}


def resolve_options(options: Optional[dict]) -> dict:
    """The backend's options with their defaults; a clear error for unknown ones."""
    opts = dict(DEFAULT_OPTIONS)
    unknown = set(options or {}) - set(opts)
    if unknown:
        raise ValueError(f"unknown pagedattn options {sorted(unknown)}; known: {sorted(opts)}")
    opts.update(options or {})
    if "inner" not in (options or {}) and get_backend(opts["target"]).device_type == "xla":
        opts["inner"] = "openxla"  # torch_xla's compiler
    if opts["inner"] not in ("inductor", "eager", "openxla"):
        raise ValueError(f"options['inner'] must be 'inductor', 'eager' or 'openxla', got {opts['inner']!r}")
    return opts


def _module_state(gm: GraphModule) -> set[int]:
    """Positions of inputs that are the model's parameters and buffers (Dynamo lifts them)."""
    out = set()
    for i, ph in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        ga = ph.meta.get("grapharg")
        name = ga.source.name if ga is not None and ga.source is not None else ""
        name = name() if callable(name) else name  # a method before torch 2.10
        if "._parameters[" in name or "._buffers[" in name:
            out.add(i)
    return out


def _aten_graph(gm: GraphModule) -> GraphModule:
    """Retrace Dynamo's graph to ATen with Dynamo's own fake inputs, so its symbols carry over."""
    from torch.fx.experimental.proxy_tensor import make_fx

    fakes = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = next(f.fake_mode for f in fakes if isinstance(f, torch.Tensor))
    # torch 2.9 hands backends a tracing context with a fake mode of its own: trace in the inputs' one
    ctx = torch._guards.TracingContext.try_get()
    saved = ctx.fake_mode if ctx is not None else None
    if ctx is not None:
        ctx.fake_mode = fake_mode
    try:
        with fake_mode, torch.no_grad():
            flat = make_fx(gm, pre_dispatch=True)(*fakes)
            baked = _fake_constants(flat)
            if baked:
                # a higher-order op run in Python at pre-dispatch (associative_scan in Jamba's Mamba scan)
                # leaves its intermediates as fake constants: trace below dispatch instead
                log.info("retracing a graph below dispatch: pre-dispatch tracing baked fake constants %s", baked[:3])
                flat = make_fx(gm, pre_dispatch=False)(*fakes)
            return flat
    finally:
        if ctx is not None:
            ctx.fake_mode = saved


def _fake_constants(gm: GraphModule) -> list[str]:
    from torch._subclasses.fake_tensor import FakeTensor

    return [n.target for n in gm.graph.nodes if n.op == "get_attr"
            and isinstance(getattr(gm, n.target, None), FakeTensor)]


def _real(x: Any) -> Any:
    if isinstance(x, torch.SymInt):
        return int(x.node.hint)
    return x


def _inner_compile(gm: GraphModule, inner: str) -> Callable:
    if inner == "eager":
        return gm
    if inner == "openxla":  # XLA compiles per shape: pad steps to buckets (pagedattn.backends.pallas_xla)
        from pagedattn.xla import OpenXlaPerShape

        return OpenXlaPerShape(gm)
    return torch.compile(gm, backend="inductor", dynamic=True)


class CompiledGraph:
    """What the backend returns to Dynamo for one graph: its drop-in and paged forms, compiled lazily.

    Carries what it found: ``report`` (one row per site) and ``cache_specs`` (one per paged site).
    """

    def __init__(self, result: RewriteResult, backend: AttentionBackend, inner: str):
        self.dropin, self.paged = result.dropin, result.paged
        self.report, self.cache_specs, self.skipped = result.report, result.cache_specs, result.skipped
        self.position_inputs = result.position_inputs
        self.padding_inputs = result.padding_inputs
        self.sees_later_keys = sites_seeing_later_keys(result.report)
        self.paged_refusal = result.paged_refusal
        self.backend, self.inner = backend, inner
        self._dropin_fn: Optional[Callable] = None
        self._paged_fn: Optional[Callable] = None

    @property
    def num_sites(self) -> int:
        return len(self.cache_specs)

    def __call__(self, *args):
        seen = _COLLECTING.get()
        if seen is not None and not any(g is self for g in seen):
            seen.append(self)
        ctx = current_context()
        if ctx is not None:
            refuse_if_unpaged(self.skipped, self.sees_later_keys, self.paged_refusal)
        if ctx is None or self.num_sites == 0:
            if ctx is None:
                check_positions(list(args), self.position_inputs)
                check_padding(list(args), self.padding_inputs)
            if self._dropin_fn is None:
                self._dropin_fn = _inner_compile(self.dropin, self.inner)
            return self._dropin_fn(*args)
        if self._paged_fn is None:
            self._paged_fn = _inner_compile(self.paged, self.inner)
        with use_backend(ctx.backend or self.backend):
            return self._paged_fn(*args, *ctx.graph_inputs(self.num_sites))


def pagedattn_backend(gm: GraphModule, example_inputs: list, options: Optional[dict] = None, **_: Any):
    """The Dynamo backend registered as ``"pagedattn"``."""
    opts = resolve_options(options)
    backend = get_backend(opts["target"])
    real = [_real(x) for x in example_inputs]
    with quiet_tracing():
        flat = _aten_graph(gm)
    result = rewrite_graph(flat, real, backend, constants=frozenset(_module_state(gm)))
    log.info("pagedattn backend: %d of %d attention sites rewritten",
             sum(s.status == "rewritten" for s in result.sites), len(result.sites))
    return CompiledGraph(result, backend, opts["inner"])


_COLLECTING: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("pagedattn_compiled", default=None)


@contextlib.contextmanager
def compiled_graphs() -> Iterator[list[CompiledGraph]]:
    """Collect the graphs compiled with ``backend="pagedattn"`` that run inside (compiled there or before),
    in the order they first run::

        with pagedattn.compile.compiled_graphs() as graphs:
            compiled_model(**inputs)
        reports = [g.report for g in graphs]
    """
    seen: list[CompiledGraph] = []
    token = _COLLECTING.set(seen)
    try:
        yield seen
    finally:
        _COLLECTING.reset(token)
