"""Per-step attention metadata: where every token of a step lives in the paged cache.

``build_metadata`` makes it from per-sequence ``(context_len, num_new_tokens, block_table)``;
the paged ops take its tensors as flat arguments and decode them back into an
:class:`AttentionMetadata` for the backend. The ``validate_*`` functions check a call against
the cache it touches (on when ``PAGEDATTN_VALIDATE=1`` or :func:`set_validation`).
"""

from __future__ import annotations

import array
import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

__all__ = [
    "AttentionMetadata",
    "CrossMetadata",
    "SequenceSpec",
    "METADATA_FIELDS",
    "CROSS_METADATA_FIELDS",
    "build_metadata",
    "build_cross_metadata",
    "cross_slot_mapping",
    "validation_enabled",
    "set_validation",
    "validation_override",
    "on_validation_change",
    "validate_write",
    "validate_attend",
    "check_write_cheap",
    "check_slot_values",
    "check_attend_cheap",
]

# the metadata tensors, in the order the paged graph takes them as inputs
METADATA_FIELDS = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")
# what cross-attention sites read besides the step's ``query_start_loc``, in the order the paged graph of
# an encoder-decoder takes them after ``METADATA_FIELDS``: each sequence's cross-attention blocks (its
# encoder's K/V, written once per request) and how many encoder tokens they hold
CROSS_METADATA_FIELDS = ("cross_block_tables", "cross_seq_lens")


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence of a batch step: tokens already cached, new tokens, its block table."""

    context_len: int
    num_new_tokens: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class AttentionMetadata:
    """Tensors that tell the paged ops where every token lives.

    Tokens of all sequences are flattened in order: sequence ``i``'s new tokens are rows
    ``query_start_loc[i]:query_start_loc[i+1]``; ``seq_lens[i]`` counts them plus the
    tokens already cached. ``slot_mapping[t]`` is the cache slot of token ``t``
    (``block * block_size + offset``) or -1 for padding (``None`` inside an attend call,
    which does not write).
    """

    slot_mapping: Optional[torch.Tensor]  # [T] int64
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    block_size: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0]) if self.slot_mapping is not None else int(self.query_start_loc[-1])

    # host-side summaries (each reads the tensors back: not for the hot path)

    def _q_lens(self) -> list[int]:
        qsl = self.query_start_loc.tolist()
        return [b - a for a, b in zip(qsl, qsl[1:])]

    def _prefill(self) -> list[bool]:
        return [q > 1 or q == L for q, L in zip(self._q_lens(), self.seq_lens.tolist())]

    @property
    def num_prefills(self) -> int:
        return sum(self._prefill())

    @property
    def num_prefill_tokens(self) -> int:
        return sum(q for q, p in zip(self._q_lens(), self._prefill()) if p)

    @property
    def num_decode_tokens(self) -> int:
        return sum(q for q, p in zip(self._q_lens(), self._prefill()) if not p)

    @property
    def max_query_len(self) -> int:
        return max(self._q_lens(), default=0)

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max()) if self.seq_lens.numel() else 0

    def tensors(self) -> list[torch.Tensor]:
        """The metadata as the paged graph takes it (``METADATA_FIELDS`` order)."""
        return [getattr(self, name) for name in METADATA_FIELDS]

    def to(self, device: torch.device | str) -> "AttentionMetadata":
        moved = {name: getattr(self, name).to(device) for name in METADATA_FIELDS
                 if getattr(self, name) is not None}
        return dataclasses.replace(self, **moved)


@dataclass(frozen=True)
class CrossMetadata:
    """Where each sequence of a step finds its encoder's K/V: the cross-attention blocks of its request.

    Row ``i`` belongs to sequence ``i`` of the step's :class:`AttentionMetadata`; a cross-attention site
    attends (non-causal) over ``seq_lens[i]`` keys in the blocks ``block_tables[i]``, with the step's own
    ``query_start_loc``, so the backends see an ordinary ``AttentionMetadata``.
    """

    block_tables: torch.Tensor  # [S, max_cross_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [S] int32: encoder tokens per sequence

    def tensors(self) -> list[torch.Tensor]:
        """The cross metadata as the paged graph takes it (``CROSS_METADATA_FIELDS`` order)."""
        return [self.block_tables, self.seq_lens]

    def to(self, device: torch.device | str) -> "CrossMetadata":
        return CrossMetadata(self.block_tables.to(device), self.seq_lens.to(device))


def build_cross_metadata(tables: Sequence[Sequence[int]], encoder_lens: Sequence[int], block_size: int,
                         device: torch.device | str = "cpu") -> CrossMetadata:
    """Cross metadata for a step's sequences from each one's cross block table and encoder length."""
    if len(tables) != len(encoder_lens):
        raise ValueError(f"build_cross_metadata: {len(tables)} block tables for {len(encoder_lens)} encoder lengths")
    for i, (t, n) in enumerate(zip(tables, encoder_lens)):
        if n < 1 or len(t) < -(-n // block_size):
            raise ValueError(f"build_cross_metadata: sequence {i} has {n} encoder tokens and {len(t)} blocks of "
                             f"{block_size}; it needs at least one token and {-(-max(n, 1) // block_size)} blocks")
    width = max(1, max((len(t) for t in tables), default=1))
    rows = [list(t) + [0] * (width - len(t)) for t in tables]
    return CrossMetadata(torch.tensor(rows, dtype=torch.int32, device=device),
                         torch.tensor(list(encoder_lens), dtype=torch.int32, device=device))


def cross_slot_mapping(tables: Sequence[Sequence[int]], encoder_lens: Sequence[int], padded_len: int,
                       block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[B * padded_len]`` slots of a padded ``[B, padded_len]`` encoder batch: request ``b``'s token ``j``
    goes to its cross block table at ``j``; padding tokens (``j >= encoder_lens[b]``) get -1."""
    slots = []
    for t, n in zip(tables, encoder_lens):
        if n > padded_len or len(t) < -(-n // block_size):
            raise ValueError(f"cross_slot_mapping: {n} encoder tokens do not fit {padded_len} padded positions "
                             f"or {len(t)} blocks of {block_size}")
        slots += [t[j // block_size] * block_size + j % block_size for j in range(n)] + [-1] * (padded_len - n)
    return torch.tensor(slots, dtype=torch.int64, device=device)


def _int_tensor(values: array.array) -> torch.Tensor:
    # the buffer as a tensor without a Python int per element (torch.tensor on a list costs ~40 ns each, a step's
    # block tables ~15 us); the tensor keeps the array alive
    return torch.frombuffer(values, dtype=torch.int64 if values.typecode == "q" else torch.int32)


def build_metadata(
    seqs: Sequence[SequenceSpec | tuple[int, int, Sequence[int]]],
    block_size: int,
    device: torch.device | str = "cpu",
    pad_tokens_to: Optional[int] = None,
) -> AttentionMetadata:
    """Build metadata from per-sequence ``(context_len, num_new_tokens, block_table)``.

    ``pad_tokens_to`` appends padding tokens (slot -1, attached to no sequence) so that
    the token dimension is a fixed size.
    """
    rows = [(s.context_len, s.num_new_tokens, s.block_table) if isinstance(s, SequenceSpec) else s for s in seqs]
    if not rows:
        raise ValueError("build_metadata: the batch has no sequences")
    try:
        return _build_metadata(rows, block_size, device, pad_tokens_to)
    except OverflowError:
        raise ValueError("build_metadata: a block id or sequence length does not fit in 32 bits (block tables and "
                         "lengths are int32): check the block tables") from None


def _build_metadata(rows: list, block_size: int, device: torch.device | str,
                    pad_tokens_to: Optional[int]) -> AttentionMetadata:
    # Python lists first, each made an array once: an array's extend converts element by element (a decode step's
    # block tables were ~30 % of this function)
    slots, lens, starts, flat, start = [], [], [0], [], 0
    max_blocks = max(1, max(len(table) for _, _, table in rows))
    zeros = [0] * max_blocks
    for i, (ctx, n, table) in enumerate(rows):
        end = ctx + n
        if n < 1:
            raise ValueError(f"build_metadata: sequence {i} has {n} new tokens (need >= 1)")
        if ctx < 0:
            raise ValueError(f"build_metadata: sequence {i} has a negative context length")
        if len(table) * block_size < end:
            raise ValueError(
                f"build_metadata: sequence {i} needs {-(-end // block_size)} blocks of {block_size} tokens "
                f"for {end} tokens but its block table has {len(table)}"
            )
        if n == 1:  # a decode: no generator per sequence
            slots.append(table[ctx // block_size] * block_size + ctx % block_size)
        else:  # a run of slots per block, not a Python expression per token
            p = ctx
            while p < end:
                block, offset = divmod(p, block_size)
                take = min(block_size - offset, end - p)
                first = table[block] * block_size + offset
                slots.extend(range(first, first + take))
                p += take
        lens.append(end)
        start += n
        starts.append(start)
        flat += table
        flat += zeros[len(table):]
    if pad_tokens_to is not None:
        if pad_tokens_to < len(slots):
            raise ValueError(f"build_metadata: pad_tokens_to={pad_tokens_to} < {len(slots)} tokens")
        slots.extend([-1] * (pad_tokens_to - len(slots)))
    slots, lens, starts, tables = (array.array("q", slots), array.array("i", lens), array.array("i", starts),
                                   array.array("i", flat))
    meta = AttentionMetadata(
        slot_mapping=_int_tensor(slots),
        block_tables=_int_tensor(tables).view(len(rows), max_blocks),
        seq_lens=_int_tensor(lens),
        query_start_loc=_int_tensor(starts),
        block_size=block_size,
    )
    return meta if torch.device(device).type == "cpu" else meta.to(device)


def build_decode_metadata(starts: Sequence[int], tables: Sequence[Sequence[int]], block_size: int, steps: int,
                          device: torch.device | str = "cpu") -> list[AttentionMetadata]:
    """The metadata of ``steps`` consecutive decode steps of the same sequences: in step ``j`` sequence ``i`` computes
    its token at position ``starts[i] + j`` (one token, ``starts[i] + j`` before it in the cache) over ``tables[i]``,
    which must hold blocks for every step's tokens. Step ``j``'s metadata is what ``build_metadata`` gives for
    ``[(starts[i] + j, 1, tables[i]), ...]``; the steps share their block tables and query start offsets (the same
    tensors: what a backend derives from a step's block table, it may keep for the next) and have their own slot
    mappings and sequence lengths (tensors of their own, not views into one buffer: compiled steps may assume their
    inputs aligned)."""
    if not starts or len(starts) != len(tables):
        raise ValueError(f"build_decode_metadata: {len(starts)} starts for {len(tables)} block tables (need >= 1, "
                         "one per sequence)")
    if steps < 1:
        raise ValueError(f"build_decode_metadata: steps must be >= 1, got {steps}")
    if min(starts) < 0:
        raise ValueError(f"build_decode_metadata: sequence {starts.index(min(starts))} has a negative context length")
    # the last step reaches furthest into every table: build_metadata checks them there, and its block tables and
    # query start offsets are every step's
    last = build_metadata([(c + steps - 1, 1, t) for c, t in zip(starts, tables)], block_size)
    metas = [dataclasses.replace(
        last, slot_mapping=_int_tensor(array.array("q", [t[(c + j) // block_size] * block_size + (c + j) % block_size
                                                         for c, t in zip(starts, tables)])),
        seq_lens=_int_tensor(array.array("i", [c + j + 1 for c in starts]))) for j in range(steps - 1)] + [last]
    if torch.device(device).type == "cpu":
        return metas
    shared = {"block_tables": last.block_tables.to(device), "query_start_loc": last.query_start_loc.to(device)}
    return [dataclasses.replace(m, slot_mapping=m.slot_mapping.to(device), seq_lens=m.seq_lens.to(device), **shared)
            for m in metas]


# ----------------------------------------------------------------------- validation

_VALIDATE_OVERRIDE: Optional[bool] = None


def validation_enabled() -> bool:
    """Whether the paged ops check their metadata (``PAGEDATTN_VALIDATE=1`` or ``set_validation``)."""
    if _VALIDATE_OVERRIDE is not None:
        return _VALIDATE_OVERRIDE
    return os.environ.get("PAGEDATTN_VALIDATE", "0").lower() in ("1", "true", "yes", "on")


def set_validation(enabled: Optional[bool]) -> None:
    """Turn metadata validation on or off; ``None`` defers to ``PAGEDATTN_VALIDATE``."""
    global _VALIDATE_OVERRIDE
    _VALIDATE_OVERRIDE = enabled
    for listener in _VALIDATION_LISTENERS:
        listener(enabled)


def validation_override() -> Optional[bool]:
    """What ``set_validation`` last set (None: ``PAGEDATTN_VALIDATE`` decides)."""
    return _VALIDATE_OVERRIDE


def on_validation_change(listener: Callable[[Optional[bool]], None]) -> None:
    """Call ``listener`` with every later ``set_validation`` value: for kernels outside Python that read the setting
    (``native_ops``)."""
    if listener not in _VALIDATION_LISTENERS:
        _VALIDATION_LISTENERS.append(listener)


_VALIDATION_LISTENERS: list = []


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def validate_write(
    key: torch.Tensor, value: torch.Tensor, num_slots: int, kv_heads: int, head_size: int,
    cache_dtype: torch.dtype, cache_device: torch.device, slot_mapping: torch.Tensor,
) -> None:
    """Check one cache write; ``num_slots``/``kv_heads``/``head_size`` come from the backend's layout."""
    _check(key.dim() == 3 and value.dim() == 3,
           f"write_kv_cache: key and value must be [tokens, kv_heads, head_size], "
           f"got {tuple(key.shape)} and {tuple(value.shape)}")
    _check(key.shape[:2] == value.shape[:2],
           f"write_kv_cache: key {tuple(key.shape)} and value {tuple(value.shape)} disagree on tokens or heads")
    _check(key.shape[1] == kv_heads, f"write_kv_cache: key has {key.shape[1]} kv heads but the cache holds {kv_heads}")
    _check(key.shape[2] == head_size,
           f"write_kv_cache: key head size {key.shape[2]} but the cache holds {head_size}")
    _check(key.dtype == cache_dtype and value.dtype == cache_dtype,
           f"write_kv_cache: key/value dtype {key.dtype}/{value.dtype} differs from the cache dtype "
           f"{cache_dtype}; cast them or allocate the cache in that dtype")
    _check(key.device == cache_device and value.device == cache_device and slot_mapping.device == cache_device,
           f"write_kv_cache: key {key.device}, value {value.device}, slot_mapping {slot_mapping.device} "
           f"and cache {cache_device} must share a device")
    _check(slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0],
           f"write_kv_cache: slot_mapping has shape {tuple(slot_mapping.shape)} for {key.shape[0]} tokens")
    _check(not slot_mapping.is_floating_point(), "write_kv_cache: slot_mapping must be an integer tensor")
    if slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        _check(lo >= -1, f"write_kv_cache: slot {lo} is negative (only -1, meaning padding, is allowed)")
        _check(hi < num_slots, f"write_kv_cache: slot {hi} is outside the cache ({num_slots} slots); "
                               "allocate more blocks or fix slot_mapping")


def validate_attend(
    query: torch.Tensor, num_blocks: int, kv_heads: int, head_size: int, cache_dtype: torch.dtype,
    cache_device: torch.device, metadata: AttentionMetadata, num_kv_heads: int, causal: bool,
    max_seq_len: int = 0,
) -> None:
    """Check one paged attention call against the cache it reads."""
    block_tables, seq_lens, query_start_loc = metadata.block_tables, metadata.seq_lens, metadata.query_start_loc
    _check(query.dim() == 3, f"paged_attention: query must be [tokens, heads, head_size], got {tuple(query.shape)}")
    _check(num_kv_heads == kv_heads,
           f"paged_attention: num_kv_heads={num_kv_heads} but the cache holds {kv_heads} kv heads")
    _check(query.shape[1] % kv_heads == 0,
           f"paged_attention: {query.shape[1]} query heads are not a multiple of {kv_heads} kv heads")
    _check(query.shape[2] == head_size,
           f"paged_attention: query head size {query.shape[2]} but the cache holds {head_size}")
    _check(query.dtype == cache_dtype,
           f"paged_attention: query dtype {query.dtype} differs from the cache dtype {cache_dtype}")
    for name, t in (("query", query), ("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        _check(t.device == cache_device, f"paged_attention: {name} is on {t.device} but the cache is on {cache_device}")
    n = seq_lens.shape[0]
    _check(block_tables.dim() == 2 and block_tables.shape[0] == n,
           f"paged_attention: block_tables {tuple(block_tables.shape)} does not have one row per sequence ({n})")
    _check(query_start_loc.shape == (n + 1,),
           f"paged_attention: query_start_loc must have {n + 1} entries, got {tuple(query_start_loc.shape)}")
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    _check(max_seq_len <= 0 or max(lens, default=0) <= max_seq_len, f"paged_attention: {too_long(max_seq_len)}")
    _check(qsl[0] == 0 and all(b >= a for a, b in zip(qsl, qsl[1:])),
           f"paged_attention: query_start_loc {qsl} must start at 0 and never decrease")
    _check(qsl[-1] <= query.shape[0], f"paged_attention: query_start_loc ends at {qsl[-1]} but there are "
                                      f"{query.shape[0]} tokens")
    block_size = metadata.block_size
    for i, (a, b, L) in enumerate(zip(qsl, qsl[1:], lens)):
        _check(L >= b - a or not causal,
               f"paged_attention: sequence {i} has seq_len {L}, shorter than its {b - a} new tokens")
        need = -(-L // block_size)
        _check(need <= block_tables.shape[1], f"paged_attention: sequence {i} of length {L} needs {need} blocks; "
                                              f"block_tables has {block_tables.shape[1]} columns")
        if need:
            used = block_tables[i, :need]
            lo, hi = int(used.min()), int(used.max())
            _check(0 <= lo and hi < num_blocks, f"paged_attention: sequence {i} uses block "
                                                f"{hi if hi >= num_blocks else lo}, outside the cache's {num_blocks} blocks")


# ------------------------------------------------------------------- cheap checks
# Always on. Shapes, dtypes and devices cost nothing; the value checks cost one small reduction per
# step: a step's metadata tensors are the same objects for every layer, so each is checked once
# (memo keyed by identity and version). On CUDA the value checks are device-side asserts (no host
# sync); on lazy devices (XLA) they are skipped: their steps are built and padded on the host.

_MEMO = threading.local()


_ASSERT_LIMIT = 255


def _fail(op: str, msg: str) -> None:
    raise ValueError(f"{op}: {msg}")


def _values_on_host(t: torch.Tensor) -> bool:
    """Whether the value checks read the metadata on the host: on the CPU a few list operations cost less than a
    dozen small tensor ops (~12 against ~35 us a step's fresh metadata); elsewhere they stay tensor ops (asserted on
    the device, with no host sync, on CUDA)."""
    return t.device.type == "cpu"


def _value_check(op: str, cond: "torch.Tensor | bool", msg: str) -> None:
    """Raise when ``cond`` (a 0-d bool tensor, or a bool found on the host) is false: on the host now, on CUDA
    asynchronously."""
    if isinstance(cond, bool):
        if not cond:
            _fail(op, msg)
    elif cond.device.type == "cpu":
        if not bool(cond):
            _fail(op, msg)
    elif cond.device.type == "cuda":
        text = f"{op}: {msg}"
        # CUDA's device-side assert takes messages shorter than 255 characters
        torch._assert_async(cond, text if len(text) < _ASSERT_LIMIT else text[:_ASSERT_LIMIT - 4] + "...")


def _checked(key: str, tensors: tuple, extra: tuple) -> bool:
    """Whether these very tensors (same objects, unchanged) passed the checks with ``extra`` already.

    A few entries per check are kept: an encoder-decoder step alternates its own metadata and the
    cross-attention metadata layer by layer, and each should be checked once per step, not per call."""
    versions = tuple(t._version for t in tensors)
    return any(len(seen) == len(tensors) and all(a is b for a, b in zip(seen, tensors))
               and (seen_versions, seen_extra) == (versions, extra)
               for seen, seen_versions, seen_extra in getattr(_MEMO, key, ()))


def _passed(key: str, tensors: tuple, extra: tuple) -> None:
    memo = _MEMO.__dict__.setdefault(key, [])
    memo.insert(0, (tensors, tuple(t._version for t in tensors), extra))
    del memo[_MEMO_ENTRIES:]


_MEMO_ENTRIES = 4


def check_write_cheap(key: torch.Tensor, value: torch.Tensor, num_slots: int, kv_heads: int, head_size: int,
                      cache_dtype: torch.dtype, cache_device: torch.device, slot_mapping: torch.Tensor,
                      values: bool = True) -> None:
    """The O(tokens) checks of a cache write that run on every call. ``values=False`` leaves out the slots' values
    (:func:`check_slot_values`), for a caller whose kernel checks every slot before it writes any."""
    op = "write_kv_cache"
    if key.dim() != 3 or value.dim() != 3 or key.shape[:2] != value.shape[:2]:
        _fail(op, f"key and value must be [tokens, kv_heads, head_size] alike, got {tuple(key.shape)} and "
                  f"{tuple(value.shape)}")
    if key.shape[1] != kv_heads or key.shape[2] != head_size:
        _fail(op, f"key is [{key.shape[1]} kv heads, head size {key.shape[2]}] but the cache holds "
                  f"[{kv_heads}, {head_size}]")
    if key.dtype != cache_dtype or value.dtype != cache_dtype:
        _fail(op, f"key/value dtype {key.dtype}/{value.dtype} differs from the cache dtype {cache_dtype}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        _fail(op, f"slot_mapping must be int64 or int32, got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        _fail(op, f"slot_mapping has shape {tuple(slot_mapping.shape)} for {key.shape[0]} tokens")
    if not (key.device == value.device == slot_mapping.device == cache_device):
        _fail(op, f"key, value, slot_mapping and the cache must share a device ({key.device}, {value.device}, "
                  f"{slot_mapping.device}, {cache_device})")
    if values:
        check_slot_values(slot_mapping, num_slots)


def check_slot_values(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Every slot is -1 (padding) or one of the cache's ``num_slots``; once per tensor (unchanged)."""
    if slot_mapping.numel() == 0 or slot_mapping.device.type not in ("cpu", "cuda") or \
            _checked("write", (slot_mapping,), (num_slots,)):
        return
    op = "write_kv_cache"
    if _values_on_host(slot_mapping):
        slots = slot_mapping.tolist()
        lo, hi = min(slots), max(slots)
    else:
        lo, hi = torch.aminmax(slot_mapping)
    _value_check(op, lo >= -1, "a slot is negative other than -1 (padding); fix slot_mapping")
    _value_check(op, hi < num_slots, f"a slot is outside the cache's {num_slots} slots; allocate more blocks "
                                     "or fix slot_mapping")
    _passed("write", (slot_mapping,), (num_slots,))


def check_attend_cheap(query: torch.Tensor, kv_heads: int, head_size: int, cache_dtype: torch.dtype,
                       cache_device: torch.device, metadata: AttentionMetadata, num_kv_heads: int,
                       causal: bool, max_seq_len: int = 0) -> None:
    """The O(tokens + sequences) checks of a paged attention call that run on every call."""
    op = "paged_attention"
    tables, seq_lens, qsl = metadata.block_tables, metadata.seq_lens, metadata.query_start_loc
    if query.dim() != 3 or query.shape[1] % kv_heads or query.shape[2] != head_size:
        _fail(op, f"query {tuple(query.shape)} must be [tokens, a multiple of {kv_heads} heads, {head_size}]")
    if num_kv_heads != kv_heads:
        _fail(op, f"num_kv_heads={num_kv_heads} but the cache holds {kv_heads} kv heads")
    if query.dtype != cache_dtype:
        _fail(op, f"query dtype {query.dtype} differs from the cache dtype {cache_dtype}")
    for name, t in (("block_tables", tables), ("seq_lens", seq_lens), ("query_start_loc", qsl)):
        if t.is_floating_point() or t.dtype == torch.bool:
            _fail(op, f"{name} must be an integer tensor, got {t.dtype}")
        if t.device != cache_device or query.device != cache_device:
            _fail(op, f"{name} is on {t.device}, the query on {query.device} and the cache on {cache_device}")
    n = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if n < 0 or tables.dim() != 2 or tables.shape[0] != n or qsl.shape != (n + 1,):
        _fail(op, f"seq_lens {tuple(seq_lens.shape)}, block_tables {tuple(tables.shape)} and query_start_loc "
                  f"{tuple(qsl.shape)} must describe the same sequences ([S], [S, blocks], [S + 1])")
    if n == 0 or qsl.device.type not in ("cpu", "cuda") or \
            _checked("attend", (tables, seq_lens, qsl), (query.shape[0], causal, metadata.block_size, max_seq_len)):
        return
    starts_msg = f"query_start_loc must start at 0, never decrease and end at most at the {query.shape[0]} tokens"
    short_msg = "a sequence's seq_len is shorter than its new tokens"
    table_msg = (f"a seq_len is negative or longer than its block table covers ({tables.shape[1]} blocks of "
                 f"{metadata.block_size})")
    covered = tables.shape[1] * metadata.block_size
    if _values_on_host(qsl):
        starts, lens = qsl.tolist(), seq_lens.tolist()
        _value_check(op, starts[0] == 0 and starts[-1] <= query.shape[0]
                     and all(a <= b for a, b in zip(starts, starts[1:])), starts_msg)
        if causal:
            _value_check(op, all(n >= b - a for n, a, b in zip(lens, starts, starts[1:])), short_msg)
        _value_check(op, min(lens) >= 0 and max(lens) <= covered, table_msg)
        if max_seq_len > 0:
            _value_check(op, max(lens) <= max_seq_len, too_long(max_seq_len))
    else:
        q_lens = qsl[1:] - qsl[:-1]
        _value_check(op, (qsl[0] == 0) & (q_lens >= 0).all() & (qsl[-1] <= query.shape[0]), starts_msg)
        if causal:
            _value_check(op, (seq_lens >= q_lens).all(), short_msg)
        _value_check(op, (seq_lens >= 0).all() & (seq_lens <= covered).all(), table_msg)
        if max_seq_len > 0:
            _value_check(op, (seq_lens <= max_seq_len).all(), too_long(max_seq_len))
    _passed("attend", (tables, seq_lens, qsl), (query.shape[0], causal, metadata.block_size, max_seq_len))


def too_long(max_seq_len: int) -> str:
    return (f"a sequence is longer than the {max_seq_len} positions this site's mask was established for (the "
            "model's maximum length, a buffer its mask reads, or the sizes a static graph was compiled at): "
            "cap requests at that length, or compile with dynamic shapes")
