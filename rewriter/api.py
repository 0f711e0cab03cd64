"""``pagedattn.rewrite()`` and the rewritten model it returns; ``pagedattn.load()``."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from types import SimpleNamespace
from typing import Any, Optional

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from pagedattn.backends import build_metadata, get_backend
from pagedattn.backends.base import AttentionConfig
from pagedattn.passes import CANONICAL_PIPELINE, PAGED_PIPELINE, METADATA_INPUTS, run_pipeline
from pagedattn.runtime.context import current_context, refuse_if_unpaged

log = logging.getLogger("pagedattn")

__all__ = ["rewrite", "rewrite_exported", "load", "RewrittenModel", "rewrite_graph"]


class RewrittenModel(nn.Module):
    """A model whose attention runs through pagedattn.

    Called like the original model it runs in *drop-in* mode (same outputs); inside
    ``pagedattn.runtime.paged_context(caches, metadata)`` it runs in *paged* mode.
    """

    def __init__(self, dropin: Optional[GraphModule], paged: GraphModule, in_spec, out_spec, report: list[dict],
                 cache_specs: list[dict], target: str, block_size: int, example_inputs: Optional[list] = None):
        super().__init__()
        self.dropin_module = dropin
        self.graph_module = paged
        self._in_spec, self._out_spec = in_spec, out_spec
        self.report = report
        self.cache_specs = cache_specs
        self.target = target
        self.block_size = block_size
        self._example_inputs = example_inputs
        self._exported: Optional[torch.export.ExportedProgram] = None
        self.graph_views: Optional[dict] = None  # see pagedattn.inspection.graph_views
        # input sizes torch.export fixed to the example's (a forward looping over tokens in Python):
        # {flat input index: {dim: size}}; other sizes are traced again (``_retrace``), like recompiles
        self.static_sizes: dict[int, dict[int, int]] = {}
        self._retrace: Optional[tuple] = None
        self._variants: dict[tuple, "RewrittenModel"] = {}
        self._skipped = [f"{r['name']}: {r['reason']}" for r in report
                         if r["status"] != "rewritten" and r.get("attention", True)]

    # --- running

    @property
    def num_sites(self) -> int:
        return len(self.cache_specs)

    def _flatten(self, args, kwargs) -> list:
        flat, spec = pytree.tree_flatten((args, kwargs or {}))
        if self._in_spec is not None and spec != self._in_spec:
            raise TypeError(
                "the rewritten model was traced with a different argument structure; call it with the same "
                f"positional and keyword arguments as the example given to rewrite() (expected {self._in_spec}, got {spec})"
            )
        return flat

    def _unflatten(self, out):
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        return pytree.tree_unflatten(out, self._out_spec) if self._out_spec is not None else tuple(out)

    def forward(self, *args, **kwargs):
        flat = self._flatten(args, kwargs)
        if self.static_sizes and not _fits(flat, self.static_sizes):
            return self._variant(flat, args, kwargs)(*args, **kwargs)
        ctx = current_context()
        if ctx is None:
            if self.dropin_module is None:
                raise RuntimeError("this rewritten program was loaded from disk and runs in paged mode only: "
                                   "call it inside pagedattn.runtime.paged_context(...) or through PagedEngine")
            return self._unflatten(self.dropin_module(*flat))
        refuse_if_unpaged(self._skipped)
        if not self.num_sites:  # nothing paged (a state-space model): the graph takes no caches or metadata
            return self._unflatten(self.graph_module(*flat))
        return self._unflatten(self.graph_module(*flat, *ctx.graph_inputs(self.num_sites)))

    def _variant(self, flat: list, args, kwargs) -> "RewrittenModel":
        """The model rewritten again for these input sizes (its traced program fixed some)."""
        key = tuple(tuple(flat[i].shape) for i in sorted(self.static_sizes))
        if key not in self._variants:
            fixed = "; ".join(f"input {i} dims {sorted(d)} = {[d[k] for k in sorted(d)]}"
                              for i, d in self.static_sizes.items())
            if self._retrace is None:
                raise ValueError(f"this program was traced for fixed input sizes ({fixed}; the model's forward "
                                 "specialises them, e.g. a Python loop over the tokens) and cannot run others; "
                                 "rewrite the model with pagedattn.rewrite() to get one that traces new sizes")
            model, target, block_size = self._retrace
            log.info("tracing again for input sizes %s: the traced program fixed %s", key, fixed)
            self._variants[key] = rewrite(model, args, kwargs, target=target, block_size=block_size)
        return self._variants[key]

    def compile_paged(self, backend: str = "inductor", *, cpu_fp32_matmuls: str = "cache") -> "RewrittenModel":
        """Compile the paged graph (dynamic shapes: one compilation serves every batch shape).

        ``cpu_fp32_matmuls``: on a CPU without native bf16/fp16 GEMMs (no AVX512/AMX), run those matmuls
        in fp32 (:mod:`pagedattn.cpu_matmul`; 3-9x faster there): ``"cache"`` converts their weights
        once and keeps the fp32 copies (4 more bytes per weight element), ``"convert"`` converts them on
        every call (no extra memory, slower at decode sizes), ``"off"`` leaves the matmuls as they are.
        """
        if cpu_fp32_matmuls not in ("cache", "convert", "off"):
            raise ValueError(f"cpu_fp32_matmuls must be 'cache', 'convert' or 'off', got {cpu_fp32_matmuls!r}")
        gm = self.graph_module
        if cpu_fp32_matmuls != "off":  # only matmuls traced on the CPU
            from pagedattn.cpu_matmul import fp32_matmuls

            gm, _ = fp32_matmuls(gm, cache_weights=cpu_fp32_matmuls == "cache")
        self.graph_module = torch.compile(gm, backend=backend, dynamic=True)
        return self

    def allocate_kv_caches(self, num_blocks: int, device: Optional[torch.device | str] = None,
                           dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
        """One cache per rewritten site, in the target backend's layout."""
        backend = get_backend(device or self.target)
        return [backend.allocate_kv_cache(num_blocks, self.block_size, s["num_kv_heads"], s["head_size"],
                                          dtype or getattr(torch, s["dtype"]), device)
                for s in self.cache_specs]

    # --- artefacts

    @property
    def exported_program(self) -> torch.export.ExportedProgram:
        """The paged graph as a ``torch.export`` program (inputs: model inputs, caches, metadata)."""
        if self._exported is None:
            self._exported = _export_paged(self)
        return self._exported

    def save(self, path: str) -> None:
        extra = {
            "pagedattn.json": json.dumps({
                "report": self.report, "cache_specs": self.cache_specs, "target": self.target,
                "block_size": self.block_size, "in_spec": _dump_spec(self._in_spec), "out_spec": _dump_spec(self._out_spec),
                "model_info": _model_info(self),
            })
        }
        torch.export.save(self.exported_program, path, extra_files=extra)

    def print_report(self) -> str:
        from pagedattn.report import site_table

        return site_table(self.report)


def _dump_spec(spec) -> Optional[str]:
    if spec is None:
        return None
    try:
        return pytree.treespec_dumps(spec)
    except Exception:  # e.g. an output class pytree cannot serialise: loaded models return flat tuples
        return None


def _load_spec(s: Optional[str]):
    """The saved pytree spec; output classes (e.g. Hugging Face's) register on import, so import them first."""
    if not s:
        return None
    try:
        return pytree.treespec_loads(s)
    except NotImplementedError:
        pass
    import importlib
    import re

    for module in set(re.findall(r'"([A-Za-z_][\w.]*)\.[A-Za-z_]\w*"', s)):
        try:
            importlib.import_module(module)
        except Exception:  # not a module path, or not installed here
            continue
    try:
        return pytree.treespec_loads(s)
    except NotImplementedError as e:
        log.warning("outputs come back as flat tuples: %s", e)
        return None


def load(path: str) -> RewrittenModel:
    """Load a program saved by :meth:`RewrittenModel.save` (in any process: the ops register on import)."""
    extra = {"pagedattn.json": ""}
    ep = torch.export.load(path, extra_files=extra)
    info = json.loads(extra["pagedattn.json"] or "{}")
    if not info:
        raise ValueError(f"{path} is not a pagedattn program (no pagedattn.json inside); save it with RewrittenModel.save")
    gm = ep.module()
    model = RewrittenModel(None, _LoadedGraph(gm), _load_spec(info.get("in_spec")), _load_spec(info.get("out_spec")),
                           info["report"], info["cache_specs"], info["target"], info["block_size"])
    model._exported = ep
    info = info.get("model_info") or {}
    model.config = SimpleNamespace(**info)  # vocabulary and EOS ids for PagedEngine
    return model


def _model_info(model: nn.Module) -> dict:
    """What a server needs besides the graph: vocabulary size and EOS ids."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    eos = None
    for c in (getattr(model, "generation_config", None), cfg):
        eos = getattr(c, "eos_token_id", None) if c is not None else None
        if eos is not None:
            break
    info = {"vocab_size": getattr(cfg, "vocab_size", None), "eos_token_id": eos,
            "model_type": getattr(cfg, "model_type", None)}
    return {k: v for k, v in info.items() if v is not None}


class _LoadedGraph(nn.Module):
    """Calls an unlifted exported module with flat inputs."""

    def __init__(self, gm: nn.Module):
        super().__init__()
        self.gm = gm

    def forward(self, *flat):
        out = self.gm(*flat)
        return pytree.tree_flatten(out)[0]


# ------------------------------------------------------------------------ rewriting


def _dynamic_shapes(model: nn.Module, args, kwargs) -> dict:
    """Every tensor dimension dynamic (``Dim.AUTO``), keyed the way export binds ``forward``'s parameters."""
    import inspect

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
    import inspect

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


def _flat_graph_module(ep: torch.export.ExportedProgram) -> tuple[GraphModule, Any, Any]:
    gm = ep.module()
    info = gm.graph._codegen.pytree_info
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm._forward_pre_hooks.clear()
    gm.recompile()
    return gm, info.in_spec, info.out_spec


def rewrite_graph(gm: GraphModule, example_inputs: list, target: str = "cpu",
                  constants: frozenset[int] = frozenset(),
                  mask_hints: Optional[list[dict]] = None) -> tuple[GraphModule, GraphModule, list]:
    """Run the passes on a flat ATen graph: (drop-in graph, paged graph, sites).

    ``constants`` are positions of inputs that hold model state (parameters, buffers). ``mask_hints``
    (the report of a multi-token trace of the same model) gives the masks of a graph traced for a
    single token, which no probe can settle.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if mask_hints is not None:
        gm.meta["pagedattn_mask_hints"] = list(mask_hints)
    gm.meta["pagedattn_example_inputs"] = {p.name: x for p, x in zip(placeholders, example_inputs)}
    gm.meta["pagedattn_constant_inputs"] = {placeholders[i].name for i in constants}
    t0 = time.perf_counter()
    results = run_pipeline(gm, CANONICAL_PIPELINE)
    sites = gm.meta["pagedattn_sites"]
    backend = get_backend(target)
    for s in sites:
        if s.status == "rewritten":
            reasons = backend.supports(AttentionConfig(
                num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_size=s.head_dim, scale=s.scale,
                causal=s.mask_kind != "none", sliding_window=s.window, softcap=s.softcap,
                alibi=s.alibi_slopes is not None, sinks=s.sinks is not None, dtype=s.query.meta["val"].dtype,
                head_size_v=s.value.meta["val"].shape[-1]))
            if reasons:
                raise ValueError(f"backend {backend.name} cannot run site {s.name}: {'; '.join(reasons)}")
    paged = _copy_graph_module(gm)
    results += run_pipeline(paged, PAGED_PIPELINE)
    for r in results:
        log.debug("pass %s: %s", r.name, r.detail)
    log.info("passes took %.3fs", time.perf_counter() - t0)
    _log_sites(sites)
    return gm, paged, sites


def _copy_graph_module(gm: GraphModule) -> GraphModule:
    """A second module over the same parameters with its own copy of the graph."""
    g = torch.fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return GraphModule(gm, g)


def _log_sites(sites) -> None:
    for s in sites:
        if s.status == "rewritten":
            log.info("site %s rewritten: %s heads / %s kv heads, head %s, scale %.4g, mask %s%s%s%s%s", s.name,
                     s.num_heads, s.num_kv_heads, s.head_dim, s.scale, s.mask_kind,
                     f", window {s.window}" if s.window else "", f", softcap {s.softcap}" if s.softcap else "",
                     ", alibi" if s.alibi_slopes is not None else "", ", sinks" if s.sinks is not None else "")
        else:
            log.info("site %s skipped: %s", s.name, s.reason)
    if sites and not any(s.status == "rewritten" for s in sites):
        log.warning("pagedattn found %d softmax/SDPA sites but rewrote none: %s", len(sites),
                    "; ".join(f"{s.name}: {s.reason}" for s in sites))


def cache_specs(paged: GraphModule, sites) -> list[dict]:
    """One entry per ``kv_cache_<i>`` input of the paged graph, in order."""
    by_name = {s.name: s for s in sites}
    out = []
    for name in paged.meta.get("pagedattn_cache_sites", []):
        s = by_name[name]
        out.append({"site": s.name, "num_kv_heads": s.num_kv_heads, "head_size": s.head_dim,
                    "dtype": str(s.key.meta["val"].dtype).replace("torch.", "")})
    return out


@contextlib.contextmanager
def _without_hf_cache(model: nn.Module):
    """Trace without Hugging Face's own KV cache object (pagedattn keeps the cache): some models build one
    from ``config.use_cache`` even when their forward takes no ``use_cache`` argument."""
    cfgs = [c for c in {id(c): c for c in (getattr(model, "config", None),
                                           getattr(getattr(model, "config", None), "get_text_config", lambda: None)())
                        }.values() if c is not None and getattr(c, "use_cache", None)]
    for c in cfgs:
        c.use_cache = False
    try:
        yield
    finally:
        for c in cfgs:
            c.use_cache = True


def rewrite(model: nn.Module, args: tuple = (), kwargs: Optional[dict] = None, *, target: str = "auto",
            block_size: int = 16, mask_hints: Optional[list[dict]] = None) -> RewrittenModel:
    """Export ``model`` on an example input, find its attention and replace it with paged attention.

    The example's batch and sequence sizes are not baked in: the rewritten model accepts any.
    Use a sequence length of at least 2 (export specialises sizes of 1). A single-token example
    needs ``mask_hints``: the ``report`` of a rewrite of the same model on a longer example, whose
    masks it takes site by site (one query and one key show no causal mask or window).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"rewrite() takes an nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        args = (args,)
    kwargs = dict(kwargs or {})
    backend = get_backend(target)
    ep = export_model(model, args, kwargs)
    flat = pytree.tree_flatten((args, kwargs))[0]
    rm = _rewrite_program(ep, flat, backend.device_type, block_size, mask_hints)
    if rm.static_sizes:
        log.info("torch.export fixed input sizes %s of %s (its forward specialises them): other sizes "
                 "are traced again when they come", rm.static_sizes, type(model).__name__)
        rm._retrace = (model, target, block_size)
    # generation settings travel along (EOS ids, vocabulary) for the engine
    rm.config = getattr(model, "config", None)
    rm.generation_config = getattr(model, "generation_config", None)
    return rm


def export_model(model: nn.Module, args: tuple = (), kwargs: Optional[dict] = None) -> torch.export.ExportedProgram:
    """``torch.export`` of ``model`` in eval mode with every input dimension dynamic."""
    kwargs = dict(kwargs or {})
    model.eval()
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), _without_hf_cache(model):
            traced = _with_explicit_kwargs(model, kwargs, bool(args))
            ep = torch.export.export(traced, args, kwargs, dynamic_shapes=_dynamic_shapes(traced, args, kwargs),
                                     strict=False)
    except Exception as e:
        raise RuntimeError(f"torch.export could not trace {type(model).__name__}: {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}") from e
    log.info("export took %.3fs", time.perf_counter() - t0)
    return ep


def rewrite_exported(ep: torch.export.ExportedProgram, *, target: str = "auto", block_size: int = 16) -> RewrittenModel:
    """Rewrite a program saved with ``torch.export`` (its stored example inputs drive the rewrite)."""
    if ep.example_inputs is None:
        raise ValueError("the exported program carries no example inputs; export it with torch.export.export(...) "
                         "from torch >= 2.6, which stores them")
    flat = pytree.tree_flatten(ep.example_inputs)[0]
    return _rewrite_program(ep, flat, get_backend(target).device_type, block_size)


def _rewrite_program(ep: torch.export.ExportedProgram, flat: list, device_type: str, block_size: int,
                     mask_hints: Optional[list[dict]] = None) -> RewrittenModel:
    from pagedattn.inspection import graph_views

    gm, in_spec, out_spec = _flat_graph_module(ep)
    before = _copy_graph_module(gm)
    dropin, paged, sites = rewrite_graph(gm, flat, device_type, mask_hints=mask_hints)
    report = [s.report() for s in sites]
    rm = RewrittenModel(dropin, paged, in_spec, out_spec, report, cache_specs(paged, sites), device_type,
                        block_size, example_inputs=flat)
    rm.graph_views = graph_views(before, paged, sites)
    rm.static_sizes = _static_sizes(ep, flat)
    return rm


def _static_sizes(ep: torch.export.ExportedProgram, flat: list) -> dict[int, dict[int, int]]:
    """Dimensions (of 2 or more) that export made constants although every one was asked dynamic."""
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


def _fits(flat: list, static: dict[int, dict[int, int]]) -> bool:
    return all(isinstance(flat[i], torch.Tensor) and flat[i].dim() > max(d) and
               all(flat[i].shape[k] == n for k, n in d.items()) for i, d in static.items())


# ------------------------------------------------------------------------- export


def _hint(x) -> int:
    return int(x.node.hint) if isinstance(x, torch.SymInt) else int(x)


def example_paged_inputs(model: RewrittenModel, num_tokens_hint: Optional[tuple[int, int]] = None):
    """Caches and metadata matching the example inputs: each batch row one fresh sequence."""
    q = next(n for n in model.graph_module.graph.nodes
             if n.op == "call_function" and n.target is torch.ops.pagedattn.paged_attention.default)
    qt = q.args[0].args[0].args[0]  # reshape <- transpose <- q [B, H, S, D]
    v = qt.meta.get("val")
    B, S = (num_tokens_hint or (_hint(v.shape[0]), _hint(v.shape[2])))
    specs = _example_sequences(B * S, model.block_size)
    meta = build_metadata(specs, model.block_size)
    caches = model.allocate_kv_caches(sum(len(t) for _, _, t in specs) + 1, device="cpu")
    return caches, meta


def _example_sequences(num_tokens: int, block_size: int) -> list[tuple[int, int, list[int]]]:
    """Tokens split over (up to) two sequences with cached context and different block counts.

    Sizes of 1 (one sequence, one block) would be specialised by export and the saved program
    would refuse real batches.
    """
    parts = [num_tokens] if num_tokens < 2 else [num_tokens // 2, num_tokens - num_tokens // 2]
    out, nxt = [], 0
    for i, n in enumerate(parts):
        context = (i + 1) * block_size + 1
        nblocks = math.ceil((context + n) / block_size)
        out.append((context, n, list(range(nxt, nxt + nblocks))))
        nxt += nblocks
    return out


def _export_paged(model: RewrittenModel) -> torch.export.ExportedProgram:
    if model._example_inputs is None:
        raise RuntimeError("no example inputs to export with")
    caches, meta = example_paged_inputs(model)
    inputs = [*model._example_inputs, *caches, *(getattr(meta, n) for n in METADATA_INPUTS)]
    dyn = []
    for x in inputs:
        dyn.append({i: torch.export.Dim.AUTO for i in range(x.dim())} if isinstance(x, torch.Tensor) else None)
    with torch.no_grad():
        return torch.export.export(model.graph_module, tuple(inputs), dynamic_shapes=tuple(dyn), strict=False)
