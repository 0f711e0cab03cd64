"""Paged write and attention that read no tensor value on the host, for the split-KV cache layout.

``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K then V), as ``sdpa_cpu`` and ``xformers_cuda`` keep
it. Every shape here follows from the input shapes and no value goes to the host (no ``.item()``, ``.tolist()``,
``bool(tensor)``, ``nonzero``), so a CUDA graph can capture a step that calls them: a captured step replays the
same kernels on the same buffers, and a host read would end the capture (or, worse, be baked into it). The
price is work on padding: each token attends over its sequence's whole block-table row (``W * block_size``
keys, the ones past its length masked), which is what a step padded to a capture size pays anyway.

The XLA backend's static mode solves the same problem for its interleaved layout (``pallas_xla``).
Semantics are :mod:`pagedattn.backends.reference`'s, through :func:`reference.dense_attention`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedattn.backends import reference, triton_paged
from pagedattn.backends.base import SplitKVBackend
from pagedattn.backends.metadata import AttentionMetadata
from pagedattn.backends.params import AttentionParams

__all__ = ["write", "attend", "padding_repeats_a_write", "StaticPagedBackend"]


def padding_repeats_a_write(slots: Tensor, rows: Tensor, flat: Tensor) -> tuple[Tensor, Tensor]:
    """``(index, rows)`` for a scatter into ``flat`` (``[slots, ...]``) in which padding tokens (slot -1)
    repeat a write that happens anyway, with the same data: the first real token's, or with no real token
    slot 0's own contents. Duplicate indices then carry equal rows, so the result does not depend on which
    of them a device's scatter applies last, and no shape depends on how many tokens are real."""
    valid = slots >= 0  # [T]
    # index_select, not slots[first]: indexing by a 0-d tensor reads its value on the host
    first = torch.argmax(valid.to(torch.int32)).reshape(1)  # the first real token (0 when there is none)
    any_valid = valid.any()
    fill_slot = torch.where(any_valid, slots.index_select(0, first), 0)  # [1]
    fill = torch.where(any_valid, rows.index_select(0, first), flat.index_select(0, fill_slot))  # [1, ...]
    index = torch.where(valid, slots, fill_slot)
    rows = torch.where(valid.reshape(-1, *[1] * (rows.dim() - 1)), rows, fill)
    return index, rows


def write(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` at ``slot_mapping`` ``[T]`` (-1: padding, not written)."""
    _, nb, bs, hkv, d = kv_cache.shape
    slots = slot_mapping.long()
    kv = torch.stack((key, value), dim=1)  # [T, 2, Hkv, D]: K and V of a token scattered together
    flat = kv_cache.view(2, nb * bs, hkv, d).transpose(0, 1)  # [slots, 2, Hkv, D], a view of the cache
    index, kv = padding_repeats_a_write(slots, kv, flat)
    flat.index_copy_(0, index, kv.to(kv_cache.dtype))


def attend(query: Tensor, kv_cache: Tensor, metadata: AttentionMetadata, params: AttentionParams) -> Tensor:
    """Every token of ``query`` ``[T, Hq, D]`` over its sequence's cached keys (its own new K/V already
    written): ``[T, Hq, Dv]``. Tokens past ``query_start_loc[-1]`` (padding) and sequences of length 0 get
    zeros."""
    T, hq, d = query.shape
    _, nb, bs, hkv, dv = kv_cache.shape
    tables, qsl = metadata.block_tables, metadata.query_start_loc
    S, W = tables.shape
    dev = query.device
    t = torch.arange(T, device=dev)
    seq = (t[:, None] >= qsl[None, 1:]).sum(1)  # [T] the token's sequence; S for padding tokens
    real = seq < S
    seq = seq.clamp(max=S - 1)
    kv_len = metadata.seq_lens.long().index_select(0, seq)  # [T]
    ends = qsl[1:].long().index_select(0, seq)  # [T] the end of the token's sequence's rows
    q_pos = kv_len - (ends - t)  # [T] the token's position in its sequence
    blocks = tables.long().index_select(0, seq)  # [T, W]
    k = kv_cache[0].index_select(0, blocks.flatten()).view(T, W * bs, hkv, d).transpose(1, 2)  # [T, Hkv, L, D]
    v = kv_cache[1].index_select(0, blocks.flatten()).view(T, W * bs, hkv, dv).transpose(1, 2)
    k_pos = torch.arange(W * bs, device=dev)[None]  # [1, L]
    present = k_pos < kv_len[:, None]  # [T, L]
    o = reference.dense_attention(query[:, :, None], k, v, params, q_pos[:, None], k_pos, present)  # [T, Hq, 1, Dv]
    keep = real & (kv_len > 0) & (q_pos >= 0)
    return torch.where(keep[:, None, None], o[:, :, 0], torch.zeros((), dtype=o.dtype, device=dev))


class StaticPagedBackend(SplitKVBackend):
    """``base``'s cache layout, checks and block moves, with :func:`write` and :func:`attend` for the paged ops:
    the backend a captured decode step binds (``runtime.cuda_graphs``). ``base`` keeps the split-KV layout
    (``sdpa_cpu``, ``xformers_cuda``). Its write and attention are :mod:`pagedattn.backends.triton_paged`'s
    kernels where they apply (CUDA with Triton) and their first call of a kind agreed with :func:`write` /
    :func:`attend`; else those."""

    def __init__(self, base: SplitKVBackend):
        if not isinstance(base, SplitKVBackend):
            raise ValueError(f"{base.name} does not keep the split-KV cache layout the static paged ops read")
        self.base = base
        self.name, self.device_type, self.dtypes = f"{base.name}+static", base.device_type, base.dtypes
        self.kernels = triton_paged.CheckedKernels()  # the Triton kernels, each kind once it agreed with the below

    def cache_geometry(self, kv_cache):
        return self.base.cache_geometry(kv_cache)

    def supports(self, config):
        return self.base.supports(config)

    def write(self, key, value, kv_cache, slot_mapping):
        # on CUDA, one Triton launch (slots below 0 skipped in the kernel) instead of the padding-safe scatter's ~10
        self.kernels.write(key, value, kv_cache, slot_mapping, lambda: write(key, value, kv_cache, slot_mapping))

    def attend(self, query, key, value, kv_cache, metadata: AttentionMetadata, params: AttentionParams):
        # on CUDA, the Triton kernel reads the blocks in place where it applies (no gather of whole table rows)
        return self.kernels.attend(query, kv_cache, metadata, params,
                                   lambda: attend(query, kv_cache, metadata, params))

