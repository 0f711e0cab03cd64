"""Saving and loading rewritten programs (``torch.export`` archives with a ``pagedattn.json`` inside)."""

from __future__ import annotations

import json
import logging
import math
from typing import Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pagedattn.backends import AttentionBackend, CacheSpec, build_metadata, get_backend
from pagedattn.passes.canonical import is_paged_attention, read_paged
from pagedattn.program import ModelInfo, RewrittenModel

log = logging.getLogger("pagedattn")

__all__ = ["save", "load", "export_paged", "example_paged_inputs", "example_sequences"]

_INFO_FILE = "pagedattn.json"


def save(model: RewrittenModel, path: str) -> None:
    extra = {
        _INFO_FILE: json.dumps({
            "report": model.report, "cache_specs": [s.to_json() for s in model.cache_specs], "target": model.target,
            "block_size": model.block_size, "in_spec": _dump_spec(model.in_spec),
            "out_spec": _dump_spec(model.out_spec), "model_info": model.info.to_json(),
        })
    }
    torch.export.save(model.exported_program, path, extra_files=extra)


def load(path: str, backend: "str | AttentionBackend | None" = None) -> RewrittenModel:
    """Load a program saved by :meth:`RewrittenModel.save` (in any process: the ops register on import).

    ``backend`` (an instance or a target name) runs its paged graph; default: the default backend of
    the target it was rewritten for.
    """
    extra = {_INFO_FILE: ""}
    ep = torch.export.load(path, extra_files=extra)
    info = json.loads(extra[_INFO_FILE] or "{}")
    if not info:
        raise ValueError(f"{path} is not a pagedattn program (no {_INFO_FILE} inside); save it with RewrittenModel.save")
    model = RewrittenModel(
        None, _LoadedGraph(ep.module()), _load_spec(info.get("in_spec")), _load_spec(info.get("out_spec")),
        info["report"], [CacheSpec.from_json(s) for s in info["cache_specs"]],
        get_backend(backend if backend is not None else info["target"]), info["block_size"],
        info=ModelInfo.from_json(info.get("model_info") or {}))
    model._exported = ep
    return model


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
    node = next(n for n in model.graph_module.graph.nodes if is_paged_attention(n))
    tokens = read_paged(node).query.meta.get("val")  # [B*S, Hq, D]
    specs = example_sequences(_hint(tokens.shape[0]), model.block_size)
    meta = build_metadata(specs, model.block_size)
    caches = model.allocate_kv_caches(sum(len(t) for _, _, t in specs) + 1, device="cpu")
    return caches, meta


def export_paged(model: RewrittenModel) -> torch.export.ExportedProgram:
    if model.example_inputs is None:
        raise RuntimeError("no example inputs to export with")
    caches, meta = example_paged_inputs(model)
    inputs = [*model.example_inputs, *caches, *meta.tensors()]
    dyn = tuple({i: torch.export.Dim.AUTO for i in range(x.dim())} if isinstance(x, torch.Tensor) else None
                for x in inputs)
    with torch.no_grad():
        return torch.export.export(model.graph_module, tuple(inputs), dynamic_shapes=dyn, strict=False)

