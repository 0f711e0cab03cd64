"""Backend interface, attention metadata and the backend registry.

A backend owns one KV-cache layout and implements the two paged operations on it
(``write`` and ``attend``) plus block copies for forks and swaps for preemption.
Backends know nothing about pattern matching; the passes know nothing about devices.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

__all__ = [
    "AttentionConfig",
    "AttentionMetadata",
    "AttentionBackend",
    "SequenceSpec",
    "build_metadata",
    "get_backend",
    "register_backend",
    "validation_enabled",
    "set_validation",
    "validate_write",
    "validate_attend",
]


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class AttentionConfig:
    """What one attention site computes, as far as a backend needs to know."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    causal: bool = True
    sliding_window: Optional[int] = None
    softcap: Optional[float] = None
    alibi: bool = False
    dtype: torch.dtype = torch.float32
    head_size_v: Optional[int] = None
    sinks: bool = False  # per-head attention-sink logits

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


# ------------------------------------------------------------------------- metadata


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
    (``block * block_size + offset``) or -1 for padding.
    """

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def to(self, device: torch.device | str) -> "AttentionMetadata":
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


def _slots_for(spec: SequenceSpec, block_size: int) -> list[int]:
    positions = range(spec.context_len, spec.context_len + spec.num_new_tokens)
    return [spec.block_table[p // block_size] * block_size + p % block_size for p in positions]


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
    specs = [s if isinstance(s, SequenceSpec) else SequenceSpec(*s) for s in seqs]
    if not specs:
        raise ValueError("build_metadata: the batch has no sequences")
    for i, s in enumerate(specs):
        if s.num_new_tokens < 1:
            raise ValueError(f"build_metadata: sequence {i} has {s.num_new_tokens} new tokens (need >= 1)")
        if s.context_len < 0:
            raise ValueError(f"build_metadata: sequence {i} has a negative context length")
        need = -(-(s.context_len + s.num_new_tokens) // block_size)
        if len(s.block_table) < need:
            raise ValueError(
                f"build_metadata: sequence {i} needs {need} blocks of {block_size} tokens "
                f"for {s.context_len + s.num_new_tokens} tokens but its block table has {len(s.block_table)}"
            )
    slots = [slot for s in specs for slot in _slots_for(s, block_size)]
    num_real = len(slots)
    if pad_tokens_to is not None:
        if pad_tokens_to < num_real:
            raise ValueError(f"build_metadata: pad_tokens_to={pad_tokens_to} < {num_real} tokens")
        slots += [-1] * (pad_tokens_to - num_real)
    max_blocks = max(1, max(len(s.block_table) for s in specs))
    tables = [list(s.block_table) + [0] * (max_blocks - len(s.block_table)) for s in specs]
    q_lens = [s.num_new_tokens for s in specs]
    seq_lens = [s.context_len + s.num_new_tokens for s in specs]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    is_prefill = [q > 1 or s.context_len == 0 for q, s in zip(q_lens, specs)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        num_prefills=sum(is_prefill),
        num_prefill_tokens=sum(q for q, p in zip(q_lens, is_prefill) if p),
        num_decode_tokens=sum(q for q, p in zip(q_lens, is_prefill) if not p),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )


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


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def validate_write(
    key: torch.Tensor, value: torch.Tensor, num_slots: int, kv_heads: int, head_size: int,
    cache_dtype: torch.dtype, cache_device: torch.device, slot_mapping: torch.Tensor,
) -> None:
    """Check one cache write; ``num_slots``/``kv_heads``/``head_size`` come from the backend's layout."""
    _check(key.dim() == 3 and value.dim() == 3, f"write_kv_cache: key and value must be [tokens, kv_heads, head_size], got {tuple(key.shape)} and {tuple(value.shape)}")
    _check(key.shape[:2] == value.shape[:2], f"write_kv_cache: key {tuple(key.shape)} and value {tuple(value.shape)} disagree on tokens or heads")
    _check(key.shape[1] == kv_heads, f"write_kv_cache: key has {key.shape[1]} kv heads but the cache holds {kv_heads}")
    _check(key.shape[2] == head_size, f"write_kv_cache: key head size {key.shape[2]} but the cache holds {head_size}")
    _check(key.dtype == cache_dtype and value.dtype == cache_dtype, f"write_kv_cache: key/value dtype {key.dtype}/{value.dtype} differs from the cache dtype {cache_dtype}; cast them or allocate the cache in that dtype")
    _check(key.device == cache_device and value.device == cache_device and slot_mapping.device == cache_device, f"write_kv_cache: key {key.device}, value {value.device}, slot_mapping {slot_mapping.device} and cache {cache_device} must share a device")
    _check(slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0], f"write_kv_cache: slot_mapping has shape {tuple(slot_mapping.shape)} for {key.shape[0]} tokens")
    _check(not slot_mapping.is_floating_point(), "write_kv_cache: slot_mapping must be an integer tensor")
    if slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        _check(lo >= -1, f"write_kv_cache: slot {lo} is negative (only -1, meaning padding, is allowed)")
        _check(hi < num_slots, f"write_kv_cache: slot {hi} is outside the cache ({num_slots} slots); allocate more blocks or fix slot_mapping")


def validate_attend(
    query: torch.Tensor, num_blocks: int, kv_heads: int, head_size: int, cache_dtype: torch.dtype,
    cache_device: torch.device, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor, block_size: int, num_kv_heads: int,
) -> None:
    """Check one paged attention call against the cache it reads."""
    _check(query.dim() == 3, f"paged_attention: query must be [tokens, heads, head_size], got {tuple(query.shape)}")
    _check(num_kv_heads == kv_heads, f"paged_attention: num_kv_heads={num_kv_heads} but the cache holds {kv_heads} kv heads")
    _check(query.shape[1] % kv_heads == 0, f"paged_attention: {query.shape[1]} query heads are not a multiple of {kv_heads} kv heads")
    _check(query.shape[2] == head_size, f"paged_attention: query head size {query.shape[2]} but the cache holds {head_size}")
    _check(query.dtype == cache_dtype, f"paged_attention: query dtype {query.dtype} differs from the cache dtype {cache_dtype}")
    for name, t in (("query", query), ("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        _check(t.device == cache_device, f"paged_attention: {name} is on {t.device} but the cache is on {cache_device}")
    n = seq_lens.shape[0]
    _check(block_tables.dim() == 2 and block_tables.shape[0] == n, f"paged_attention: block_tables {tuple(block_tables.shape)} does not have one row per sequence ({n})")
    _check(query_start_loc.shape == (n + 1,), f"paged_attention: query_start_loc must have {n + 1} entries, got {tuple(query_start_loc.shape)}")
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    _check(qsl[0] == 0 and all(b >= a for a, b in zip(qsl, qsl[1:])), f"paged_attention: query_start_loc {qsl} must start at 0 and never decrease")
    _check(qsl[-1] <= query.shape[0], f"paged_attention: query_start_loc ends at {qsl[-1]} but there are {query.shape[0]} tokens")
    for i, (a, b, L) in enumerate(zip(qsl, qsl[1:], lens)):
        _check(L >= b - a, f"paged_attention: sequence {i} has seq_len {L}, shorter than its {b - a} new tokens")
        need = -(-L // block_size)
        _check(need <= block_tables.shape[1], f"paged_attention: sequence {i} of length {L} needs {need} blocks; block_tables has {block_tables.shape[1]} columns")
        if need:
            used = block_tables[i, :need]
            lo, hi = int(used.min()), int(used.max())
            _check(0 <= lo and hi < num_blocks, f"paged_attention: sequence {i} uses block {hi if hi >= num_blocks else lo}, outside the cache's {num_blocks} blocks")


# -------------------------------------------------------------------------- backend


class AttentionBackend:
    """A device's paged attention: one cache layout and the operations on it.

    Subclasses set ``name`` and ``device_type`` and implement every method below.
    """

    name: str = "base"
    device_type: str = "cpu"

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        raise NotImplementedError

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
    ) -> torch.Tensor:
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        return torch.zeros(shape, dtype=dtype, device=device or self.device_type)

    def cache_geometry(self, kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
        """``(num_blocks, block_size, num_kv_heads, head_size)`` of a cache in this layout."""
        raise NotImplementedError

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        raise NotImplementedError

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
        scale: float, causal: bool, sliding_window: int, softcap: float,
        alibi_slopes: Optional[torch.Tensor], num_kv_heads: int, sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def copy_blocks(self, kv_cache: torch.Tensor, src_to_dst: torch.Tensor) -> None:
        raise NotImplementedError

    def swap_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor, src_to_dst: torch.Tensor) -> None:
        raise NotImplementedError

    def supports(self, config: AttentionConfig) -> list[str]:
        """Reasons this backend cannot run ``config`` exactly; empty when it can."""
        raise NotImplementedError

    def step_padder(self, max_num_tokens: int, max_num_seqs: int,
                    max_blocks_per_seq: int) -> Optional[Callable[["AttentionMetadata"], "AttentionMetadata"]]:
        """For devices that compile one graph per shape: a function padding a step's (host) metadata
        to a bounded set of shapes. None: steps run at their own size."""
        return None

    def sync(self) -> None:
        """End of a serving step; lazy-tensor devices run the step's graph here."""


def common_reasons(config: AttentionConfig, dtypes: Sequence[torch.dtype]) -> list[str]:
    """What no backend here can run exactly, whatever its kernels: shared by every ``supports()``."""
    reasons = []
    if config.dtype not in dtypes:
        reasons.append(f"dtype {config.dtype} is not supported ({', '.join(str(d).replace('torch.', '') for d in dtypes)})")
    if config.num_heads % config.num_kv_heads:
        reasons.append(f"{config.num_heads} query heads are not a multiple of {config.num_kv_heads} kv heads")
    if config.sliding_window and not config.causal:
        reasons.append("a sliding window needs causal attention")
    if config.head_size_v not in (None, config.head_size):
        reasons.append("value head size differs from key head size (the cache stores one head size)")
    return reasons


class SplitKVBackend(AttentionBackend):
    """The ``[2, num_blocks, block_size, num_kv_heads, head_size]`` cache (K at 0, V at 1) and its
    maintenance: writes by ``index_copy_`` over flattened slots, block copies and swaps."""

    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def cache_geometry(self, kv_cache):
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError(f"{self.name}: kv_cache must be [2, num_blocks, block_size, kv_heads, head_size], "
                             f"got {tuple(kv_cache.shape)}")
        _, nb, bs, hkv, d = kv_cache.shape
        return nb, bs, hkv, d

    def supports(self, config: AttentionConfig) -> list[str]:
        return common_reasons(config, self.dtypes)

    def attend_geometry(self, query, kv_cache, block_tables, seq_lens, query_start_loc, causal: bool,
                        num_kv_heads: int) -> tuple[int, int, int, int]:
        """The cache geometry for ``attend``, with the step's metadata checked when validation is on."""
        nb, bs, hkv, d = self.cache_geometry(kv_cache)
        if validation_enabled():
            validate_attend(query, nb, hkv, d, kv_cache.dtype, kv_cache.device, block_tables,
                            seq_lens, query_start_loc, bs, num_kv_heads)
            if causal and bool((seq_lens < query_start_loc.diff()).any()):
                raise ValueError("paged_attention: a causal sequence has seq_len shorter than its new tokens")
        return nb, bs, hkv, d

    def valid_slots(self, slot_mapping: torch.Tensor) -> Optional[torch.Tensor]:
        """Rows of ``slot_mapping`` that are not padding (-1), or None when all are."""
        if slot_mapping.numel() and bool((slot_mapping < 0).any()):
            return torch.nonzero(slot_mapping >= 0).flatten()
        return None

    def write(self, key, value, kv_cache, slot_mapping):
        nb, bs, hkv, d = self.cache_geometry(kv_cache)
        if validation_enabled():
            validate_write(key, value, nb * bs, hkv, d, kv_cache.dtype, kv_cache.device, slot_mapping)
        slots = slot_mapping.long()
        keep = self.valid_slots(slot_mapping)
        if keep is not None:
            key, value, slots = key.index_select(0, keep), value.index_select(0, keep), slots.index_select(0, keep)
        kv_cache[0].view(nb * bs, hkv, d).index_copy_(0, slots, key)
        kv_cache[1].view(nb * bs, hkv, d).index_copy_(0, slots, value)

    def copy_blocks(self, kv_cache, src_to_dst):
        pairs = src_to_dst.to(kv_cache.device, torch.long)
        kv_cache[:, pairs[:, 1]] = kv_cache[:, pairs[:, 0]]

    def swap_blocks(self, src_cache, dst_cache, src_to_dst):
        src = src_to_dst[:, 0].to(src_cache.device, torch.long)
        dst = src_to_dst[:, 1].to(dst_cache.device, torch.long)
        # a non-blocking device-to-host copy lands in a buffer the host may read before it is written
        non_blocking = dst_cache.device.type != "cpu"
        dst_cache[:, dst] = src_cache[:, src].to(dst_cache.device, non_blocking=non_blocking)


# ------------------------------------------------------------------------- registry

# device type -> module path; modules register their backend class on import
_BACKEND_MODULES: dict[str, str] = {
    "cpu": "pagedattn.backends.sdpa_cpu",
    "cuda": "pagedattn.backends.xformers_cuda",
    "xla": "pagedattn.backends.pallas_xla",
}
_BACKENDS: dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    _BACKENDS[backend.device_type] = backend
    return backend


def _device_type(target: str | torch.device) -> str:
    if isinstance(target, torch.device):
        return target.type
    if target == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "cpu"
    return torch.device(target).type if target not in _BACKEND_MODULES else target


def get_backend(target: str | torch.device = "auto") -> AttentionBackend:
    """The backend for a device or target name (``cpu``, ``cuda``, ``xla``, ``auto``).

    ``auto`` takes the accelerator when its backend loads and falls back to the CPU otherwise.
    """
    if target == "auto" and _device_type("auto") != "cpu":
        try:
            return get_backend(_device_type("auto"))
        except ValueError as e:
            import logging

            logging.getLogger("pagedattn").warning("target 'auto': %s; using the CPU backend", e)
            return get_backend("cpu")
    try:
        dev = _device_type(target)
    except RuntimeError as e:
        raise ValueError(f"unknown target {target!r}: use one of cpu, cuda, xla, auto") from e
    if dev not in _BACKENDS:
        module = _BACKEND_MODULES.get(dev)
        if module is None:
            raise ValueError(f"no pagedattn backend for device type {dev!r}; available: {sorted(_BACKEND_MODULES)}")
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"the {dev!r} backend ({module}) cannot be loaded: {e}") from e
    if dev not in _BACKENDS:
        raise ValueError(f"module {_BACKEND_MODULES[dev]} did not register a backend for {dev!r}")
    return _BACKENDS[dev]
