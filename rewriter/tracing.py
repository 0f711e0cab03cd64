"""Tracing a model to the flat ATen graph the passes work on (``torch.export``, every size dynamic)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections import Counter
from typing import Any, Optional

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

log = logging.getLogger("pagedattn")

__all__ = ["export_model", "flat_graph_module", "without_hf_cache", "static_sizes", "fits_static_sizes",
           "copy_graph_module", "quiet_tracing", "recurrent_layers_opaque", "uncompiled", "repeated_blocks",
           "fake_tensor_cache_for", "FAKE_TENSOR_CACHE_MIN_REPEATS"]


def dynamic_shapes(model: nn.Module, args, kwargs) -> dict:
    """Every tensor dimension dynamic (``Dim.AUTO``), keyed the way export binds ``forward``'s parameters."""

    def spec(x):
        if isinstance(x, torch.Tensor):
            return {i: torch.export.Dim.AUTO for i in range(x.dim())}
        return None

    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs)
    out = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out[name] = {k: pytree.tree_map(spec, v) for k, v in value.items()}
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            out[name] = tuple(pytree.tree_map(spec, v) for v in value)
        else:
            out[name] = pytree.tree_map(spec, value)
    return out


def _with_explicit_kwargs(model: nn.Module, kwargs: dict, args_given: bool = False) -> nn.Module:
    """``model``, or a wrapper naming every keyword it is called with when some land in ``**kwargs``.

    torch.export cannot match dynamic shapes to inputs bound to ``**kwargs`` (its constraint step
    flattens them differently from its input check); a wrapper whose signature names them all avoids it.
    """
    params = inspect.signature(model.forward).parameters
    if args_given or all(k in params and params[k].kind is not inspect.Parameter.VAR_KEYWORD for k in kwargs):
        return model

    def forward(self, **kw):
        return self.model(**kw)

    P = inspect.Parameter
    forward.__signature__ = inspect.Signature(
        [P("self", P.POSITIONAL_OR_KEYWORD)] + [P(k, P.KEYWORD_ONLY, default=None) for k in kwargs])
    wrapper = type(type(model).__name__, (nn.Module,), {"forward": forward})()
    wrapper.model = model
    return wrapper.eval()


@contextlib.contextmanager
def without_hf_cache(model: nn.Module):
    """Run or trace without Hugging Face's own KV cache object (pagedattn keeps the cache): some models
    build one from ``config.use_cache`` even when their forward takes no ``use_cache`` argument."""
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else None
    cfgs = [c for c in {id(c): c for c in (cfg, text)}.values() if c is not None and getattr(c, "use_cache", None)]
    for c in cfgs:
        c.use_cache = False
    try:
        yield
    finally:
        for c in cfgs:
            c.use_cache = True


# An op that stands for a whole layer while tracing: its output has the shape of its input and depends on it
# (in data flow) and on nothing else the graph shows. Eagerly it is the identity.
_TRACE_LIB = torch.library.Library("pagedattn_trace", "FRAGMENT")
_TRACE_LIB.define("opaque_layer(Tensor hidden_states) -> Tensor")
_TRACE_LIB.impl("opaque_layer", lambda x: x.clone(), "CompositeExplicitAutograd")
torch.library.register_fake("pagedattn_trace::opaque_layer", lambda x: torch.empty_like(x), lib=_TRACE_LIB)


@contextlib.contextmanager
def recurrent_layers_opaque(model: nn.Module):
    """Within it, the model's recurrent layers (by Hugging Face's convention, the innermost modules whose forward
    takes ``cache_params``: Mamba-style mixers) compute ``pagedattn_trace::opaque_layer`` of their hidden states
    instead; yields their number.

    A recurrent layer that loops over the tokens in Python (Jamba's Mamba-1 scan without its CUDA kernels)
    makes ``torch.export`` fix the sequence length, and with it every mask the trace shows. With the layers
    opaque, the code around them, masks included, traces for every length, while whatever reads a layer's
    output still shows reading it. For establishing masks only: the model computes something else meanwhile.
    """
    def takes_state(m: nn.Module) -> bool:
        try:
            params = inspect.signature(m.forward).parameters
        except (TypeError, ValueError):
            return False
        return "cache_params" in params and next(iter(params), None) == "hidden_states"

    stateful = {id(m): m for m in model.modules() if m is not model and takes_state(m)}
    inner = [m for m in stateful.values() if not any(id(c) in stateful for c in m.modules() if c is not m)]
    own = [m.__dict__.get("forward") for m in inner]  # a forward set on the instance itself, or None
    for m in inner:
        m.forward = _opaque_forward
    try:
        yield len(inner)
    finally:
        for m, f in zip(inner, own):
            if f is None:
                del m.forward  # back to the class's
            else:
                m.forward = f


def _opaque_forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return torch.ops.pagedattn_trace.opaque_layer(hidden_states)


# loggers of torch that report on tracing decisions (e.g. "0/1 specialized") at WARNING
_TRACING_LOGGERS = ("torch._export.non_strict_utils", "torch.fx.experimental.symbolic_shapes", "torch._export",
                    "torch.export", "torch._dynamo", "torch._functorch", "torch.fx.experimental.recording",
                    "torch.onnx._internal.exporter._registration")


class _ToDebug(logging.Filter):
    """Re-log a library's records below ERROR as pagedattn debug records (the user did not ask for them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        log.debug("%s: %s", record.name, record.getMessage())
        return False


@contextlib.contextmanager
def quiet_tracing():
    """Torch's tracing warnings and Python warnings raised while tracing go to pagedattn's debug log."""
    import warnings

    flt = _ToDebug()
    loggers = [logging.getLogger(n) for n in _TRACING_LOGGERS]
    for lg in loggers:
        lg.addFilter(flt)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for lg in loggers:
            lg.removeFilter(flt)
    for w in caught:
        log.debug("warning while tracing: %s: %s", w.category.__name__, w.message)


# How many times a model must repeat a block for FakeTensorMode's dispatch cache to stay on in its export (every size
# symbolic). The cache makes and checks an entry (symbolic sizes and strides) for nearly every op and hits once a
# block repeats: a Llama's export without it took, against with it (benchmarks/RESULTS.md), 0.61-0.83x the time at 1
# layer, 0.62-0.81x at 2, 0.82-0.98x at 4, 0.89-1.08x at 8, and 1.0-1.5x at 32.
FAKE_TENSOR_CACHE_MIN_REPEATS = 6


def repeated_blocks(model: nn.Module) -> int:
    """How many times ``model`` repeats its most repeated block: the most instances of one module class among its
    modules that hold others (a Llama's decoder layers, a GPT's blocks); 1 where none repeats."""
    counts = Counter(type(m) for m in model.modules()
                     if next(m.children(), None) is not None and not isinstance(m, (nn.ModuleList, nn.ModuleDict,
                                                                                    nn.Sequential)))
    return max(counts.values(), default=1)


def fake_tensor_cache_for(repeats: int):
    """A context for an export of a model that repeats a block ``repeats`` times: FakeTensorMode's dispatch cache on
    from ``FAKE_TENSOR_CACHE_MIN_REPEATS`` up, off below. A choice of speed only: the program is the same."""
    return torch._dynamo.config.patch(fake_tensor_cache_enabled=repeats >= FAKE_TENSOR_CACHE_MIN_REPEATS)


def export_model(model: nn.Module, args: tuple = (), kwargs: Optional[dict] = None) -> torch.export.ExportedProgram:
    """``torch.export`` of ``model`` in eval mode with every input dimension dynamic."""
    kwargs = dict(kwargs or {})
    model.eval()
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), without_hf_cache(model), quiet_tracing(), fake_tensor_cache_for(repeated_blocks(model)):
            traced = _with_explicit_kwargs(model, kwargs, bool(args))
            ep = torch.export.export(traced, args, kwargs, dynamic_shapes=dynamic_shapes(traced, args, kwargs),
                                     strict=False)
    except Exception as e:
        raise RuntimeError(f"torch.export could not trace {type(model).__name__}: {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}") from e
    log.info("export took %.3fs", time.perf_counter() - t0)
    return ep


def flat_graph_module(ep: torch.export.ExportedProgram) -> tuple[GraphModule, Any, Any]:
    """The program as a module over flat inputs and outputs, with the pytree specs to rebuild them."""
    gm = ep.module()
    info = gm.graph._codegen.pytree_info
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm._forward_pre_hooks.clear()
    gm.recompile()
    return gm, info.in_spec, info.out_spec


def uncompiled(module):
    """The module ``torch.compile`` wrapped (its ``_orig_mod``), or ``module`` itself where it is not compiled."""
    return getattr(module, "_orig_mod", module)


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A second module over the same parameters with its own copy of the graph."""
    g = torch.fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    copy = GraphModule(gm, g)
    copy.meta.update(getattr(gm, "meta", {}))
    return copy


def static_sizes(ep: torch.export.ExportedProgram, flat: list) -> dict[int, dict[int, int]]:
    """Dimensions (of 2 or more) that export made constants although every one was asked dynamic:
    ``{flat input index: {dim: size}}`` (a forward that loops over the tokens in Python fixes them)."""
    names = ep.graph_signature.user_inputs
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    out: dict[int, dict[int, int]] = {}
    for i, (name, x) in enumerate(zip(names, flat)):
        v = vals.get(name)
        if isinstance(x, torch.Tensor) and isinstance(v, torch.Tensor):
            dims = {d: c for d, c in enumerate(map(_constant, v.shape)) if c is not None and c >= 2 and c == x.shape[d]}
            if dims:
                out[i] = dims
    return out


def _constant(n) -> Optional[int]:
    if isinstance(n, int):
        return n
    expr = n.node.expr  # a size export replaced by a number
    return int(expr) if expr.is_number else None


def fits_static_sizes(flat: list, static: dict[int, dict[int, int]]) -> bool:
    return all(isinstance(flat[i], torch.Tensor) and flat[i].dim() > max(d) and
               all(flat[i].shape[k] == n for k, n in d.items()) for i, d in static.items())
