"""The custom ops (``torch.ops.pagedattn.*``) and their fake kernels.

The schemas are flat (torch.library needs that): the per-site parameters are the fields of
:class:`~pagedattn.backends.params.AttentionParams`, generated into every schema that takes them,
and each kernel decodes its arguments once into ``AttentionParams`` and (for the paged ops)
:class:`~pagedattn.backends.metadata.AttentionMetadata`. One kernel per op serves every device:
it hands the call to the active backend for the tensors' device (``base.active_backend``).

Conventions shared by every backend:

- ``query`` / ``key`` / ``value`` are flattened over tokens: ``[T, heads, head_size]``;
- ``write_kv_cache`` runs before ``paged_attention`` reads the same step's tokens;
- ``sliding_window <= 0`` means no window, ``softcap <= 0`` no soft-cap.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pagedattn.backends import reference
from pagedattn.backends.base import active_backend
from pagedattn.backends.metadata import AttentionMetadata, validation_enabled
from pagedattn.backends.params import AttentionParams, params_schema

__all__ = ["write_kv_cache", "write_kv_cache_functional", "paged_attention", "attention", "PARAMS_OFFSET"]

_PARAMS = params_schema()
# positional index of the first AttentionParams field in each op's arguments
PARAMS_OFFSET = {"attention": 4, "paged_attention": 7}


def _write(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    backend = active_backend(kv_cache.device)
    if validation_enabled():
        backend.check_write(key, value, kv_cache, slot_mapping)
    backend.write(key, value, kv_cache, slot_mapping)


@torch.library.custom_op("pagedattn::write_kv_cache", mutates_args=("kv_cache",))
def write_kv_cache(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write the new tokens' K ``[T, Hkv, D]`` and V into ``kv_cache`` at ``slot_mapping`` (-1 skips)."""
    _write(key, value, kv_cache, slot_mapping)


@write_kv_cache.register_fake
def _(key, value, kv_cache, slot_mapping):
    return None


@torch.library.custom_op("pagedattn::write_kv_cache_functional", mutates_args=())
def write_kv_cache_functional(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> Tensor:
    """Like :func:`write_kv_cache` but returns the updated cache and leaves the input untouched."""
    out = kv_cache.clone()
    _write(key, value, out, slot_mapping)
    return out


@write_kv_cache_functional.register_fake
def _(key, value, kv_cache, slot_mapping):
    return torch.empty_like(kv_cache)


@torch.library.custom_op(
    "pagedattn::paged_attention", mutates_args=(),
    schema="(Tensor query, Tensor? key, Tensor? value, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
           f"Tensor query_start_loc, {_PARAMS}) -> Tensor")
def paged_attention(query: Tensor, key: Optional[Tensor], value: Optional[Tensor], kv_cache: Tensor,
                    block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, *params) -> Tensor:
    """Attention of every new token over its sequence's cached keys, in one call.

    ``query`` is ``[T, Hq, D]``; sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``
    and has ``seq_lens[i]`` keys in total (its new tokens included, causal aligned bottom-right).
    ``key``/``value`` are the new tokens' K/V (``None`` when the step has none, e.g. cross-attention
    over a cache filled once); backends may read them directly instead of the cache. ``params`` are
    the fields of ``AttentionParams``. Returns ``[T, Hq, head_size_v]``; rows past
    ``query_start_loc[-1]`` (padding) are zero.
    """
    p = AttentionParams.from_args(params)
    backend = active_backend(kv_cache.device)
    meta = AttentionMetadata(None, block_tables, seq_lens, query_start_loc, backend.cache_geometry(kv_cache)[1])
    if validation_enabled():
        backend.check_attend(query, kv_cache, meta, p)
    return backend.attend(query, key, value, kv_cache, meta, p)


@paged_attention.register_fake
def _(query, key, value, kv_cache, block_tables, seq_lens, query_start_loc, *params):
    p = AttentionParams.from_args(params)
    return query.new_empty((query.shape[0], query.shape[1], p.head_size_v))


# ---------------------------------------------------------------- canonical attention


@torch.library.custom_op(
    "pagedattn::attention", mutates_args=(),
    schema=f"(Tensor query, Tensor key, Tensor value, Tensor? key_padding, {_PARAMS}) -> Tensor")
def attention(query: Tensor, key: Tensor, value: Tensor, key_padding: Optional[Tensor], *params) -> Tensor:
    """Dense attention as the rewriter proved a site computes: the drop-in form of a site.

    ``query [B, Hq, S, D]``, ``key/value [B, Hkv, L, D]``; the ``S`` queries are the last ``S`` of
    ``L`` positions; ``key_padding [B, L]`` is nonzero for keys that may be seen. Semantics:
    :mod:`pagedattn.backends.reference`. Returns ``[B, Hq, S, Dv]``.
    """
    present = None if key_padding is None else key_padding != 0
    return reference.dense_attention(query, key, value, AttentionParams.from_args(params), key_present=present)


@attention.register_fake
def _(query, key, value, key_padding, *params):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))
