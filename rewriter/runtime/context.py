"""The runtime context that binds KV caches and attention metadata to rewritten graphs.

Inside ``with paged_context(caches, metadata):`` every rewritten model runs in paged mode: its
attention writes the new tokens' K/V into ``caches`` and reads through ``metadata``. Outside,
rewritten models run in drop-in mode, exactly like the original.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from pagedattn.backends import AttentionBackend, AttentionMetadata, CrossMetadata, get_backend

_CURRENT: contextvars.ContextVar[Optional["PagedContext"]] = contextvars.ContextVar("pagedattn_context", default=None)


@dataclass(frozen=True)
class PagedContext:
    """The caches and step metadata bound to rewritten graphs; ``backend`` runs their paged ops
    (``None``: the backend each program was rewritten for). An encoder-decoder's decoder step also
    takes ``cross``: where each sequence's cross-attention blocks are (its caches follow the
    self-attention ones in ``kv_caches``). A program whose masks read per-request values (a prefix-LM
    mask from token types) takes ``position_values``: ``[num_seqs, count]``, a row per sequence of the
    metadata (``position_mod.values_from_input`` of each request's token types)."""

    kv_caches: tuple[torch.Tensor, ...]
    metadata: AttentionMetadata
    backend: Optional[AttentionBackend] = None
    cross: Optional[CrossMetadata] = None
    position_values: Optional[torch.Tensor] = None

    def graph_inputs(self, num_caches: int, cross: bool = False, values: bool = False) -> list[torch.Tensor]:
        if len(self.kv_caches) != num_caches:
            raise ValueError(
                f"the rewritten model has {num_caches} attention sites but the context holds "
                f"{len(self.kv_caches)} KV caches; allocate one cache per site (RewrittenModel.allocate_kv_caches)"
            )
        extra = [self._values()] if values else []
        if not cross:
            return [*self.kv_caches, *self.metadata.tensors(), *extra]
        if self.cross is None:
            raise ValueError("the rewritten model has cross-attention sites but the paged context holds no cross "
                             "metadata: pass cross=build_cross_metadata(...) to paged_context")
        if self.cross.seq_lens.shape[0] != self.metadata.num_seqs:
            raise ValueError(f"the cross metadata has {self.cross.seq_lens.shape[0]} sequences but the step has "
                             f"{self.metadata.num_seqs}")
        return [*self.kv_caches, *self.metadata.tensors(), *self.cross.tensors(), *extra]

    def _values(self) -> torch.Tensor:
        v = self.position_values
        if v is None:
            raise ValueError("the rewritten model's masks read per-request values (token types): pass "
                             "position_values=[num_seqs, count] to paged_context (position_mod.values_from_input "
                             "of each sequence's token types; position_mod.default_values for sequences without)")
        if v.dim() != 2 or v.shape[0] != self.metadata.num_seqs:
            raise ValueError(f"position_values must have one row per sequence ({self.metadata.num_seqs}), got shape "
                             f"{tuple(v.shape)}")
        return v


def sites_seeing_later_keys(report: Sequence[dict]) -> list[str]:
    """The rewritten self-attention sites of a report whose mask may let a query see a later key: the drop-in serves
    them over the whole sequence, paged mode refuses them (:func:`refuse_if_unpaged`)."""
    return [r["name"] for r in report if r.get("status") == "rewritten" and r.get("later_keys")
            and r.get("attention_type") != "cross"]


def refuse_if_unpaged(skipped: Sequence[str], sees_later_keys: Sequence[str] = (),
                      mixes_tokens: Optional[str] = None) -> None:
    """Paged mode runs every sequence of a step in one row: attention left dense would mix them. Nor can a KV cache
    serve a site whose mask lets a query see a later key (``sees_later_keys``: their names): its keys are cached
    before the later tokens exist. Nor a graph that combines tokens outside attention (``mixes_tokens``: the
    rewrite's ``paged_refusal``)."""
    if skipped:
        raise RuntimeError("this graph cannot run in paged mode: attention left as it was would mix the "
                           "sequences of a step: " + "; ".join(skipped))
    if sees_later_keys:
        raise RuntimeError(f"this graph cannot run in paged mode: {later_keys_reason(sees_later_keys)}")
    if mixes_tokens:
        raise RuntimeError(f"this graph cannot run in paged mode: {mixes_tokens_reason(mixes_tokens)}")


def mixes_tokens_reason(why: str) -> str:
    """Why paged mode refuses a graph that combines tokens outside attention (``why``: where it does), in one
    sentence."""
    return (f"outside attention the model combines tokens ({why}), and a paged step packs several sequences, and "
            "chunks of one, into a row (the drop-in, over the whole sequence, can run it)")


def later_keys_reason(sites: Sequence[str]) -> str:
    """Why paged mode refuses ``sites`` (:func:`sites_seeing_later_keys`), in one sentence."""
    return (f"the mask of {', '.join(sites)} may let a query see a later key, which a KV cache cannot serve (the "
            "drop-in, over the whole sequence, can)")


def current_context() -> Optional[PagedContext]:
    return _CURRENT.get()


@contextlib.contextmanager
def paged_context(kv_caches: Sequence[torch.Tensor], metadata: AttentionMetadata,
                  backend: Optional[AttentionBackend] = None,
                  cross: Optional[CrossMetadata] = None,
                  position_values: Optional[torch.Tensor] = None) -> Iterator[PagedContext]:
    """Run rewritten models in paged mode with these caches and this step's metadata (and ``backend``;
    ``cross``: the cross-attention blocks of an encoder-decoder's sequences; ``position_values``: the
    sequences' per-request values, for masks that read some, see ``PagedContext``)."""
    _check_block_size(kv_caches, metadata, backend)
    ctx = PagedContext(tuple(kv_caches), metadata, backend, cross, position_values)
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def cache_block_size(kv_caches: Sequence[torch.Tensor], backend: Optional[AttentionBackend] = None) -> Optional[int]:
    """The block size of ``kv_caches`` as their backends (``backend`` for its device type) read them; None where no
    backend reads any of them. Caches of different block sizes are a ValueError: no metadata fits them all."""
    sizes = {size for _, size in _block_sizes(kv_caches, backend)}
    if len(sizes) > 1:
        raise ValueError(f"the KV caches have blocks of different sizes ({sorted(sizes)}): one step's metadata "
                         "cannot address them all")
    return next(iter(sizes), None)


def _check_block_size(kv_caches: Sequence[torch.Tensor], metadata: AttentionMetadata,
                      backend: Optional[AttentionBackend]) -> None:
    """Slots and block tables mean nothing for a cache of another block size: refuse, never misread."""
    for i, block_size in _block_sizes(kv_caches, backend):
        if block_size != metadata.block_size:
            raise ValueError(f"KV cache {i} has blocks of {block_size} tokens but the metadata was built for "
                             f"{metadata.block_size}; build it with build_metadata(..., block_size={block_size})")


def _block_sizes(kv_caches: Sequence[torch.Tensor], backend: Optional[AttentionBackend]) -> list[tuple[int, int]]:
    """(index, block size) of each cache a backend reads (others: the op itself will say what is wrong)."""
    by_type: dict = {}  # a step's caches share a device: one backend lookup
    out = []
    for i, cache in enumerate(kv_caches):
        kind = cache.device.type
        if kind not in by_type:
            by_type[kind] = backend if backend is not None and backend.device_type == kind else \
                _backend_or_none(cache.device)
        b = by_type[kind]
        if b is None:  # no backend for this device
            continue
        try:
            out.append((i, b.cache_geometry(cache)[1]))
        except (ValueError, NotImplementedError):  # not a cache of that backend's layout
            continue
    return out


def _backend_or_none(device: torch.device) -> Optional[AttentionBackend]:
    """The default backend for ``device``, None where there is none."""
    try:
        return get_backend(device)
    except (ValueError, NotImplementedError):
        return None


def step_mode(device: torch.device | str):
    """The grad mode a packed step runs in (a compiled step's guards check it: the same step in another mode
    compiles again). On the CPU, inference mode, not just no_grad: every op of the step (the paged ops' Python
    kernels above all) skips the autograd dispatch layer, ~5 % of a small model's decode step (same-process A/B,
    llama16m and BART). Elsewhere no_grad: torch_xla's functionalization sets version counters, which inference
    tensors refuse."""
    return torch.inference_mode() if torch.device(device).type == "cpu" else torch.no_grad()
