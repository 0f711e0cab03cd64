"""Saving and loading rewritten programs (``torch.export`` archives with a ``pagedattn.json`` inside)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
from typing import Optional

import torch
import torch.fx.experimental._config as fx_config
from torch import nn
from torch.utils import _pytree as pytree

from pagedattn.backends import AttentionBackend, CacheSpec, build_metadata, get_backend, position_mod
from pagedattn.passes.canonical import is_paged_attention, read_paged
from pagedattn.program import ModelInfo, RewrittenModel
from pagedattn.runtime.context import mixes_tokens_reason
from pagedattn.runtime.shapes import no_duck_sizing
from pagedattn.safe_archive import UnsafeArchive, load_treespec, read_exported_program
from pagedattn.tracing import fake_tensor_cache_for, quiet_tracing, uncompiled

log = logging.getLogger("pagedattn")

__all__ = ["save", "load", "export_paged", "paged_export_inputs", "least_sizes", "example_paged_inputs", "example_sequences"]

_INFO_FILE = "pagedattn.json"


def save(model: RewrittenModel, path: str) -> None:
    """Write the paged program: graph and specs as data (JSON), weights as raw tensor payloads.

    The program carries no example inputs (a loaded program runs in paged mode and needs none), so
    nothing in the file is a pickle. An encoder-decoder's decoder step (cross-attention sites, filled by
    its ``cross_writer`` graph) is refused: the archive holds one graph, and a loaded step could not fill
    its cross-attention caches.
    """
    if model.cross_writer is not None or model.num_cross_sites:
        raise ValueError(f"cannot save an encoder-decoder's decoder step ({model.num_cross_sites} cross-attention "
                         "sites): the archive would lose the graph that fills their caches; serve the model itself "
                         "with PagedEngine(model)")
    if model.paged_refusal:
        raise ValueError(f"cannot save this program: its paged graph is all a file holds, and paged mode refuses it: "
                         f"{mixes_tokens_reason(model.paged_refusal)}")
    extra = {
        _INFO_FILE: json.dumps({
            "report": model.report, "cache_specs": [s.to_json() for s in model.cache_specs], "target": model.target,
            "block_size": model.block_size, "in_spec": _dump_spec(model.in_spec),
            "out_spec": _dump_spec(model.out_spec), "model_info": model.info.to_json(),
            # how the masks read per-request values (a prefix-LM's token types): the paged graph's last input
            "value_inputs": {str(i): spec.to_json() for i, spec in model.value_inputs.items()},
        })
    }
    ep = model.exported_program
    kept, ep.example_inputs = ep.example_inputs, None
    try:
        torch.export.save(ep, path, extra_files=extra)
    finally:
        ep.example_inputs = kept


def load(path: str, backend: "str | AttentionBackend | None" = None) -> RewrittenModel:
    """Load a program saved by :meth:`RewrittenModel.save`, in any process, without running code from
    the file (see :mod:`pagedattn.safe_archive`: anything that would be unpickled, evaluated or imported
    by name is refused with :class:`~pagedattn.safe_archive.UnsafeArchive`).

    ``backend`` (an instance or a target name) runs its paged graph; default: the default backend of
    the target it was rewritten for.
    """
    ep, extra = read_exported_program(path, extra_files=(_INFO_FILE,))
    try:
        info = json.loads(extra[_INFO_FILE] or "{}")
    except ValueError as e:
        raise UnsafeArchive(f"{path}: its {_INFO_FILE} is not valid JSON ({e})") from e
    if not info:
        raise ValueError(f"{path} is not a pagedattn program (no {_INFO_FILE} inside); save it with RewrittenModel.save")
    try:
        report, specs = list(info["report"]), [CacheSpec.from_json(s) for s in info["cache_specs"]]
        target, block_size = str(info["target"]), int(info["block_size"])
        model_info = ModelInfo.from_json(dict(info.get("model_info") or {}))
        values = {int(i): position_mod.ValueSpec.from_json(v) for i, v in dict(info.get("value_inputs") or {}).items()}
    except (KeyError, TypeError, ValueError) as e:
        raise UnsafeArchive(f"{path}: its {_INFO_FILE} is malformed ({type(e).__name__}: {e})") from e
    model = RewrittenModel(
        None, _LoadedGraph(ep.module()), load_treespec(info.get("in_spec"), f"{path} (in_spec)"),
        load_treespec(info.get("out_spec"), f"{path} (out_spec)"), report, specs,
        get_backend(backend if backend is not None else target), block_size, info=model_info)
    model.value_inputs = values
    model.min_sizes = least_sizes(ep)
    model._exported = ep
    return model


def least_sizes(program: torch.export.ExportedProgram) -> int:
    """The size every dynamic size of a saved program's inputs must reach (what a step is padded to): 0 for a program
    exported without specialising sizes 0 and 1 (``export_paged(size_oblivious=True)``), 2 for one exported with (files
    saved before; a size of 1 was specialised away there)."""
    from pagedattn.aot_step import program_inputs

    least = 0
    for val in program_inputs(program):
        for d in getattr(val, "shape", ()):
            if isinstance(d, torch.SymInt) and d.node.expr.is_symbol:
                vr = program.range_constraints.get(d.node.expr)
                if vr is not None and vr.lower.is_number and int(vr.lower) > least:
                    least = int(vr.lower)
    return least if least > 1 else 0


def _dump_spec(spec) -> Optional[str]:
    if spec is None:
        return None
    try:
        return pytree.treespec_dumps(spec)
    except Exception:  # e.g. an output class pytree cannot serialise: loaded models return flat tuples
        return None


class _LoadedGraph(nn.Module):
    """Calls an unlifted exported module with flat inputs."""

    def __init__(self, gm: nn.Module):
        super().__init__()
        self.gm = gm

    def forward(self, *flat):
        out = self.gm(*flat)
        return pytree.tree_flatten(out)[0]


# ------------------------------------------------------------------------- export


def _hint(x) -> int:
    return int(x.node.hint) if isinstance(x, torch.SymInt) else int(x)


def example_sequences(num_tokens: int, block_size: int) -> list[tuple[int, int, list[int]]]:
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


def example_paged_inputs(model: RewrittenModel):
    """Caches and metadata matching the example inputs: each batch row one fresh sequence."""
    node = next(n for n in uncompiled(model.graph_module).graph.nodes if is_paged_attention(n))
    tokens = read_paged(node).query.meta.get("val")  # [B*S, Hq, D]
    specs = example_sequences(_hint(tokens.shape[0]), model.block_size)
    meta = build_metadata(specs, model.block_size)
    caches = model.allocate_kv_caches(sum(len(t) for _, _, t in specs) + 1, device="cpu")
    return caches, meta


def paged_export_inputs(model: RewrittenModel) -> list:
    """The example inputs a paged program is exported with: the model's, then caches and metadata
    (:func:`example_paged_inputs`), then the per-request values where the masks read some."""
    if model.example_inputs is None:
        raise RuntimeError("no example inputs to export with")
    caches, meta = example_paged_inputs(model)
    inputs = [*model.example_inputs, *caches, *meta.tensors()]
    if model.value_spec is not None:  # [num_seqs, count]: the step's per-request values
        inputs.append(position_mod.default_values(model.value_spec, meta.num_seqs))
    return inputs


def export_paged(model: RewrittenModel, graph_module: Optional[nn.Module] = None, *,
                 size_oblivious: bool = False) -> torch.export.ExportedProgram:
    """The paged graph (``graph_module``, default the model's own) as a ``torch.export`` program over
    :func:`paged_export_inputs`, every dimension dynamic.

    By default export specialises sizes 0 and 1, so every dynamic size of the program is at least 2 (what
    :func:`example_sequences` gives). ``size_oblivious`` traces without that specialisation (torch's
    ``backed_size_oblivious``): the program's sizes range from 0, and where a size of 1 would have changed what
    it computes (broadcasting) the program holds a runtime assertion instead, so one program serves a step of one
    sequence, one block or one row as well."""
    inputs = paged_export_inputs(model)
    dyn = tuple({i: torch.export.Dim.AUTO for i in range(x.dim())} if isinstance(x, torch.Tensor) else None
                for x in inputs)
    gm = uncompiled(model.graph_module if graph_module is None else graph_module)
    oblivious = fx_config.patch(backed_size_oblivious=True) if size_oblivious else contextlib.nullcontext()
    # without duck sizing: the values' count (2 for one span) must not take the symbol of an equal number of sequences;
    # the graph is flat, so its attention sites (one a layer) stand for the blocks it repeats
    with torch.no_grad(), quiet_tracing(), no_duck_sizing(), fake_tensor_cache_for(model.num_sites), oblivious:
        # a compiled program (compile_paged) exports the graph it compiled, with what compile_paged's runtime passes
        # changed (linears joined, fp32 copies of weights): the same computation to rounding
        return torch.export.export(gm, tuple(inputs), dynamic_shapes=dyn, strict=False)

