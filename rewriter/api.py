"""The front end's entry points: ``rewrite()`` a model, ``rewrite_exported()`` a saved program, ``load()``.

model --tracing.export_model--> ExportedProgram --rewrite_program--> driver.rewrite_graph (passes)
      --> RewrittenModel (program.py) --save/load--> serialization.py
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pagedattn.backends import AttentionBackend, get_backend, position_mod
from pagedattn.driver import rewrite_graph
from pagedattn.program import ModelInfo, RewrittenModel
from pagedattn.serialization import load
from pagedattn.tracing import copy_graph_module, export_model, flat_graph_module, static_sizes

log = logging.getLogger("pagedattn")

__all__ = ["rewrite", "rewrite_exported", "rewrite_program", "load", "RewrittenModel"]

Target = "str | AttentionBackend"


def rewrite(model: nn.Module, args: tuple = (), kwargs: Optional[dict] = None, *, target: Target = "auto",
            block_size: int = 16, mask_hints: Optional[list[dict]] = None,
            encoder_inputs: tuple[str, ...] = (), token_type_runs: int = 4) -> RewrittenModel:
    """Export ``model`` on an example input, find its attention and replace it with paged attention.

    ``target`` is a device name (``cpu``, ``cuda``, ``xla``, ``auto``: that device's default backend)
    or an ``AttentionBackend`` instance (e.g. ``PallasXlaBackend(mode="static")``); the rewritten
    model runs its paged graph with it. The example's batch and sequence sizes are not baked in: the
    rewritten model accepts any. Use a sequence length of at least 2 (export specialises sizes of 1).
    A single-token example needs ``mask_hints``: the ``report`` of a rewrite of the same model on a
    longer example, whose masks it takes site by site (one query and one key show no causal mask or window).
    ``encoder_inputs`` names keyword inputs that carry an encoder's output (the model is an encoder-decoder's
    decoder step): attention over keys computed from them alone becomes cross-attention over caches filled
    once per request by ``RewrittenModel.write_cross_kv`` (see ``pagedattn.seq2seq``).
    ``token_type_runs``: a mask built from token types (a prefix-LM's image blocks, as Gemma-3's) is proven, and
    served, for up to that many runs of image tokens per sequence (like vLLM's ``limit_mm_per_prompt``); the
    proof's time grows with it (about 20 s at 4, two minutes at 16, on 2 cores).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"rewrite() takes an nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        args = (args,)
    if not isinstance(token_type_runs, int) or token_type_runs < 1:
        raise ValueError(f"token_type_runs must be a positive integer, got {token_type_runs!r}")
    kwargs = dict(kwargs or {})
    backend = get_backend(target)
    missing = [n for n in encoder_inputs if n not in kwargs]
    if missing:
        raise ValueError(f"rewrite(): encoder_inputs {missing} are not keyword inputs of the example")
    ep = export_model(model, args, kwargs)
    flat = pytree.tree_flatten((args, kwargs))[0]
    rm = rewrite_program(ep, flat, backend, block_size, mask_hints, info=ModelInfo.of(model),
                         encoder_inputs=tuple(encoder_inputs), token_type_runs=token_type_runs)
    if rm.static_sizes:
        log.info("torch.export fixed input sizes %s of %s (its forward specialises them): other sizes "
                 "are traced again when they come", rm.static_sizes, type(model).__name__)
        rm.retrace = lambda a, kw: rewrite(model, a, kw, target=backend, block_size=block_size,
                                           mask_hints=mask_hints, encoder_inputs=encoder_inputs,
                                           token_type_runs=token_type_runs)
    return rm


def rewrite_exported(ep: torch.export.ExportedProgram, *, target: Target = "auto",
                     block_size: int = 16) -> RewrittenModel:
    """Rewrite a program saved with ``torch.export`` (its stored example inputs drive the rewrite)."""
    if ep.example_inputs is None:
        raise ValueError("the exported program carries no example inputs; export it with torch.export.export(...) "
                         "from torch >= 2.6, which stores them")
    flat = pytree.tree_flatten(ep.example_inputs)[0]
    return rewrite_program(ep, flat, get_backend(target), block_size)


def rewrite_program(ep: torch.export.ExportedProgram, flat: list, backend: AttentionBackend, block_size: int,
                    mask_hints: Optional[list[dict]] = None, info: Optional[ModelInfo] = None,
                    encoder_inputs: tuple[str, ...] = (), token_type_runs: int = 4) -> RewrittenModel:
    """Rewrite an exported program traced on the flat example inputs ``flat``."""
    from pagedattn.inspection import graph_views

    gm, in_spec, out_spec = flat_graph_module(ep)
    before = copy_graph_module(gm)
    names = dict(zip(ep.graph_signature.user_inputs, [n.name for n in gm.graph.nodes if n.op == "placeholder"]))
    res = rewrite_graph(gm, flat, backend, mask_hints=mask_hints,
                        max_length=info.max_length if info is not None else None,
                        encoder_inputs=frozenset(names.get(n, n) for n in encoder_inputs),
                        token_type_runs=token_type_runs)
    rm = RewrittenModel(res.dropin, res.paged, in_spec, out_spec, res.report, res.cache_specs, backend, block_size,
                        example_inputs=flat, info=info)
    rm.graph_views = graph_views(before, res.paged, res.sites, res.paged_sites)
    rm.position_inputs = res.position_inputs
    rm.padding_inputs = res.padding_inputs
    rm.value_inputs = value_inputs(res.dropin, res.sites)
    rm.static_sizes = static_sizes(ep, flat)
    rm.cross_writer, rm.num_cross_sites = res.cross_writer, len(res.cross_sites)
    rm.paged_refusal, rm.locality_unproven = res.paged_refusal, res.locality_unproven
    check_runs_on_example(res.dropin, flat)
    return rm


def value_inputs(dropin: torch.fx.GraphModule, sites) -> dict:
    """Flat input index -> ``ValueSpec`` of the input rewritten sites read per-request values from."""
    names = [n.name for n in dropin.graph.nodes if n.op == "placeholder"]
    out = {}
    for s in sites:
        if s.status == "rewritten" and s.position_data is not None and s.position_data.name in names:
            out[names.index(s.position_data.name)] = position_mod.value_spec(s.position_mod)
    return out


def check_runs_on_example(dropin: torch.fx.GraphModule, flat: list) -> None:
    """The rewritten graph runs on the example it was traced with (one forward): a program that cannot is
    a bug to report, never a result to hand back."""
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    if any(t.is_meta for t in tensors) or not tensors:
        return
    try:
        with torch.no_grad():
            dropin(*flat)
    except Exception as e:
        raise RuntimeError(f"pagedattn: the rewritten program fails on its own example input ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); please report this with the model") from e

