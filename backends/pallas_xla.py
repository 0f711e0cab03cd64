"""Paged attention on XLA devices (torch_xla): ``ragged_paged_attention`` on TPU.

Cache layout: ``[num_blocks, block_size, 2 * num_kv_heads, head_size_padded]`` with K of KV head
``h`` at position ``2h`` and V at ``2h + 1`` of dim 2: the layout of
``torch.ops.xla.ragged_paged_attention``. The Pallas kernel wants the head size padded to a
multiple of 128 (zeros change neither ``q . k`` nor, once sliced off, the output).

Three ways to attend, chosen per backend instance (``mode``):

- ``"kernel"`` (default on TPU): one ``ragged_paged_attention`` call (the Pallas kernel) for
  prefills, decodes and chunked prefills together; output rows ``q.shape[0]``, padding zeroed.
- ``"static"`` (default elsewhere, e.g. XLA:CPU and XLA:GPU): each token attends over its
  sequence's gathered pages through :func:`pagedattn.backends.reference.dense_attention` (the
  library's one statement of the semantics), in plain torch ops whose shapes depend only on the
  input shapes. torch_xla's own reference path (``use_kernel=False``) loops over sequences in
  Python and slices by their lengths, which syncs with the host and compiles a new graph for
  every new length; this path compiles one graph per bucketed step shape. It also covers what the
  kernel lacks: ALiBi, attention sinks, chunked local attention and non-causal attention. Cost:
  every token gathers its sequence's ``pages_per_seq * block_size`` keys, so it suits development
  and verification more than long contexts.
- ``"reference"``: ``ragged_paged_attention(..., use_kernel=False)``, exact but data-dependent.

XLA compiles one graph per shape: pad each step with :func:`pad_step` / :class:`StepBuckets` so
that a serving loop compiles at most ``len(tokens) * len(seqs) * len(blocks)`` distinct graphs.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

try:
    import torch_xla
    import torch_xla.experimental.custom_kernel  # defines torch.ops.xla.*
except ImportError as e:  # the registry turns this into "the 'xla' backend cannot be loaded"
    raise ImportError(
        f"pagedattn's XLA backend needs torch_xla, which is built for exactly one torch release "
        f"(torch_xla 2.9.0 needs torch 2.9.0; this is torch {torch.__version__.split('+')[0]}): install a matching "
        f"pair, e.g. pip install torch==2.9.0 torch_xla==2.9.0 (see README 'XLA (torch_xla)'): {e}"
    ) from e

from pagedattn.backends import reference
from pagedattn.backends.base import AttentionBackend, common_reasons, register_backend
from pagedattn.backends.metadata import (
    AttentionMetadata,
)
from pagedattn.backends.params import AttentionConfig, AttentionParams
from pagedattn.backends.static_paged import padding_repeats_a_write

__all__ = ["PallasXlaBackend", "StepBuckets", "pad_step", "bucket", "is_tpu"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KERNEL_HEAD_ALIGN = 128  # lanes of a TPU vector register
_MODES = ("kernel", "static", "reference")


def is_tpu() -> bool:
    """Whether torch_xla's device is a TPU (the only device the Pallas kernels run on)."""
    try:
        import torch_xla.runtime as xr

        return xr.device_type() == "TPU"
    except Exception:  # no PJRT client could be started
        return False


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ------------------------------------------------------------------------ backend


class PallasXlaBackend(AttentionBackend):
    """``mode`` is ``"kernel"``, ``"static"`` or ``"reference"`` (see the module doc); ``None``
    picks the kernel on TPU and the static path elsewhere. ``head_align`` pads the cached head size
    (default: 128 in kernel mode, else 1)."""

    name = "pallas_xla"
    device_type = "xla"
    functional_cache_writes = True

    def __init__(self, mode: Optional[str] = None, head_align: Optional[int] = None):
        if mode is not None and mode not in _MODES:
            raise ValueError(f"pallas_xla: mode must be one of {_MODES} or None, got {mode!r}")
        self._mode = mode
        self._head_align = head_align

    @property
    def mode(self) -> str:
        if self._mode is None:  # decided on first use: asking for the device starts the runtime
            self._mode = "kernel" if is_tpu() else "static"
        return self._mode

    @property
    def head_align(self) -> int:
        if self._head_align is None:
            return _KERNEL_HEAD_ALIGN if self.mode == "kernel" else 1
        return self._head_align

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size):
        return (num_blocks, block_size, 2 * num_kv_heads, _round_up(head_size, self.head_align))

    def allocate_kv_cache(self, num_blocks, block_size, num_kv_heads, head_size, dtype=torch.float32, device=None):
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        cache = torch.zeros(shape, dtype=dtype, device=device or torch_xla.device())
        if cache.device.type == "xla":
            # materialise it now: a pending zeros() would make the first step's graph differ from
            # every later one (one more compilation per step shape)
            torch_xla._XLAC._xla_sync_multi([cache], [str(cache.device)], wait=False)
        return cache

    def cache_geometry(self, kv_cache):
        """``(num_blocks, block_size, num_kv_heads, padded head size)``."""
        if kv_cache.dim() != 4 or kv_cache.shape[2] % 2:
            raise ValueError(
                "pallas_xla: kv_cache must be [num_blocks, block_size, 2 * kv_heads, head_size] "
                f"(K and V interleaved), got {tuple(kv_cache.shape)}"
            )
        nb, bs, h2, d = kv_cache.shape
        return nb, bs, h2 // 2, d

    def supports(self, config: AttentionConfig) -> list[str]:
        reasons = common_reasons(config, _DTYPES)
        if self.mode != "static":
            # ragged_paged_attention masks causally and takes no bias
            if config.params.alibi_slopes is not None:
                reasons.append(f"ALiBi: ragged_paged_attention takes no positional bias ({self.mode} mode); "
                               "use PallasXlaBackend(mode='static')")
            if not config.params.causal:
                reasons.append(f"non-causal attention: ragged_paged_attention is causal only ({self.mode} mode); "
                               "use PallasXlaBackend(mode='static')")
            if config.params.sinks is not None:
                reasons.append(f"attention sinks: ragged_paged_attention takes no sink logits ({self.mode} mode); "
                               "use PallasXlaBackend(mode='static')")
            if config.params.position_mod:
                reasons.append("position program: ragged_paged_attention takes no mask or bias program "
                               f"({self.mode} mode); use PallasXlaBackend(mode='static')")
            if config.params.chunk:
                reasons.append("chunked local attention: ragged_paged_attention takes no chunk size "
                               f"({self.mode} mode); use PallasXlaBackend(mode='static')")
        return reasons

    # --- cache maintenance

    def stored_head_size(self, kv_cache, tokens, op: str) -> int:
        # heads are padded to the kernel's alignment in the cache: the tokens carry the real size
        _check_head(tokens.shape[2], self.cache_geometry(kv_cache)[3], self.head_align, op)
        return tokens.shape[2]

    def write(self, key, value, kv_cache, slot_mapping):
        nb, bs, hkv, dp = self.cache_geometry(kv_cache)
        T = key.shape[0]
        kv = torch.stack((key, value), dim=2).reshape(T, 2 * hkv, key.shape[2])  # [T, 2Hkv, D]: K, V interleaved
        kv = _pad_last(kv, dp)
        flat = kv_cache.reshape(nb * bs, 2 * hkv, dp)
        idx, kv = padding_repeats_a_write(slot_mapping.long(), kv, flat)
        # out of place, then one copy into the cache itself: inside a custom op's kernel torch_xla
        # tensors run without functionalization, and an in-place update of a view is lost there
        kv_cache.copy_(flat.index_copy(0, idx, kv).view(kv_cache.shape))

    def step_padder(self, max_num_tokens, max_num_seqs, max_blocks_per_seq):
        return functools.partial(pad_step, buckets=StepBuckets.up_to(max_num_tokens, max_num_seqs, max_blocks_per_seq))

    def sync(self):
        import torch_xla

        torch_xla.sync()

    def copy_blocks(self, kv_cache, src_to_dst):
        src = src_to_dst[:, 0].to(kv_cache.device, torch.long)
        dst = src_to_dst[:, 1].to(kv_cache.device, torch.long)
        kv_cache.index_copy_(0, dst, kv_cache.index_select(0, src))

    def swap_blocks(self, src_cache, dst_cache, src_to_dst):
        src = src_to_dst[:, 0].to(src_cache.device, torch.long)
        dst = src_to_dst[:, 1].to(dst_cache.device, torch.long)
        dst_cache.index_copy_(0, dst, src_cache.index_select(0, src).to(dst_cache.device))

    # --- attention

    def attend(self, query, key, value, kv_cache, metadata: AttentionMetadata, params: AttentionParams):
        if self.mode == "static":
            return _attend_static(query, kv_cache, metadata, params)
        if (params.alibi_slopes is not None or not params.causal or params.sinks is not None or params.chunk
                or params.position_mod):
            raise ValueError("pallas_xla: ragged_paged_attention supports neither ALiBi nor non-causal attention "
                             "nor attention sinks nor chunked local attention nor position programs; rewrite with "
                             "PallasXlaBackend(mode='static')")
        return _attend_ragged(query, kv_cache, metadata, params, use_kernel=self.mode == "kernel")


def _check_head(d: int, dp: int, align: int, op: str) -> None:
    if _round_up(d, align) != dp:
        raise ValueError(f"{op}: head size {d} (padded to a multiple of {align}: {_round_up(d, align)}) "
                         f"does not match the cache's {dp}")


def _pad_last(x: Tensor, size: int) -> Tensor:
    return x if x.shape[-1] == size else torch.nn.functional.pad(x, (0, size - x.shape[-1]))


def _num_seqs(query_start_loc: Tensor) -> Tensor:
    # padded sequences (see pad_step) have no new tokens and follow the real ones
    return (query_start_loc[1:] > query_start_loc[:-1]).sum().to(torch.int32).reshape(1)


def _attend_ragged(query, kv_cache, metadata: AttentionMetadata, params: AttentionParams, use_kernel: bool):
    T, _, d = query.shape
    dp = kv_cache.shape[-1]
    qsl = metadata.query_start_loc
    out = torch.ops.xla.ragged_paged_attention(
        _pad_last(query, dp), kv_cache, metadata.seq_lens.to(torch.int32), metadata.block_tables.to(torch.int32),
        qsl.to(torch.int32), _num_seqs(qsl), sm_scale=params.scale,
        sliding_window=params.window or None, soft_cap=params.softcap if params.softcap > 0 else None,
        use_kernel=use_kernel,
    )[..., :d]
    if out.shape[0] < T:  # the reference path returns only the real tokens' rows
        out = torch.cat((out, out.new_zeros((T - out.shape[0], *out.shape[1:]))))
    rows = torch.arange(T, device=query.device)
    return torch.where((rows < qsl[-1])[:, None, None], out, torch.zeros_like(out))


def _attend_static(query, kv_cache, metadata: AttentionMetadata, params: AttentionParams):
    """Paged attention whose every shape follows from the input shapes (no host syncs): each token
    attends over its sequence's gathered pages with the reference's semantics."""
    T, hq, d = query.shape
    _, bs, h2, _ = kv_cache.shape
    hkv = h2 // 2
    block_tables, qsl = metadata.block_tables, metadata.query_start_loc
    S, P = block_tables.shape
    dev = query.device
    t = torch.arange(T, device=dev)
    seq = (t[:, None] >= qsl[None, 1:]).sum(1)  # [T] the token's sequence; S for padding
    real = seq < S
    seq = seq.clamp(max=S - 1)
    kv_len = metadata.seq_lens[seq].long()  # [T]
    q_pos = kv_len - (qsl[1:][seq].long() - t)  # [T] position of the token in its sequence
    kv = kv_cache[block_tables[seq].long()]  # [T, P, bs, 2Hkv, Dp]
    kv = kv.reshape(T, P * bs, hkv, 2, kv.shape[-1])[..., :d]
    k, v = kv[..., 0, :].transpose(1, 2), kv[..., 1, :].transpose(1, 2)  # [T, Hkv, L, D]
    k_pos = torch.arange(P * bs, device=dev)[None]  # [1, L]
    present = k_pos < kv_len[:, None]  # [T, L]
    # a program's per-request values: each token's sequence's (padding sequences hold any, never read)
    values = None if params.position_data is None else params.position_data.to(dev).index_select(0, seq)
    o = reference.dense_attention(query[:, :, None], k, v, params, q_pos[:, None], k_pos, present,
                                  exact=True, values=values)  # [T, Hq, 1, D]
    o = o.reshape(T, hq, d)
    return torch.where(real[:, None, None], o, torch.zeros_like(o))


# -------------------------------------------------------------------- static shapes


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``n``; a clear error when ``n`` exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}; raise the StepBuckets limits")


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], max(1, lo)
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class StepBuckets:
    """Sizes a step is padded to: tokens, sequences and block-table columns (powers of two up to
    each limit). Every combination is one graph, so a serving loop compiles at most
    ``len(tokens) * len(seqs) * len(blocks)`` of them."""

    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    blocks: tuple[int, ...]

    @classmethod
    def up_to(cls, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
              min_tokens: int = 16) -> "StepBuckets":
        return cls(_powers_of_two(min(min_tokens, max_num_tokens), max_num_tokens),
                   _powers_of_two(1, max_num_seqs), _powers_of_two(1, max_blocks_per_seq))

    @property
    def num_shapes(self) -> int:
        return len(self.tokens) * len(self.seqs) * len(self.blocks)


def pad_step(meta: AttentionMetadata, buckets: StepBuckets) -> AttentionMetadata:
    """``meta`` padded to bucket sizes (on its own device; pad on the host before moving it).

    Padding tokens get slot -1 and belong to no sequence; padding sequences have no tokens and
    length 0; padding block-table columns point at block 0 and are never read. Pad the step's
    token inputs (ids, positions) to ``result.num_tokens`` too.
    """
    T, S, P = meta.num_tokens, meta.num_seqs, meta.block_tables.shape[1]
    Tb, Sb, Pb = bucket(T, buckets.tokens), bucket(S, buckets.seqs), bucket(P, buckets.blocks)
    slots = torch.nn.functional.pad(meta.slot_mapping, (0, Tb - T), value=-1)
    tables = torch.nn.functional.pad(meta.block_tables, (0, Pb - P, 0, Sb - S), value=0)
    seq_lens = torch.nn.functional.pad(meta.seq_lens, (0, Sb - S), value=0)
    qsl = torch.nn.functional.pad(meta.query_start_loc, (0, Sb - S), value=int(meta.query_start_loc[-1]))
    return dataclasses.replace(meta, slot_mapping=slots, block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl)


BACKEND = register_backend(PallasXlaBackend())
