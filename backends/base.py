"""The backend interface and the registry of per-device default backends.

A backend owns one KV-cache layout and implements the paged operations on it: ``write`` new
tokens' K/V, ``attend`` (one call for prefills, decodes and chunked prefills), block copies for
forks and swaps for preemption, and ``supports()`` saying what of a site it cannot run exactly.
Backends know nothing about pattern matching; the passes know nothing about devices.

Which backend instance the ops use: the one bound by :func:`use_backend` (``rewrite()``,
``PagedEngine`` and the compiled graphs bind the one they were built for), else the default one
registered for the tensors' device type.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
from typing import Callable, Iterator, Optional, Sequence

import torch

from pagedattn.backends import huge_pages, native_ops
from pagedattn.backends.metadata import (
    AttentionMetadata,
    check_attend_cheap,
    check_write_cheap,
    validate_attend,
    validate_write,
)
from pagedattn.backends.params import AttentionConfig, AttentionParams, CacheSpec

log = logging.getLogger("pagedattn")

__all__ = [
    "AttentionBackend",
    "SplitKVBackend",
    "common_reasons",
    "get_backend",
    "register_backend",
    "use_backend",
    "active_backend",
    "argmax_rows",
    "argmax_tokens",
]


class AttentionBackend:
    """A device's paged attention: one cache layout and the operations on it.

    Subclasses set ``name`` and ``device_type`` and implement the methods that raise here.
    """

    name: str = "base"
    device_type: str = "cpu"
    # the device runs graphs op by op through a runtime that cannot keep a custom op's in-place cache
    # write (torch_xla's eager functionalization rejects it): graphs served eagerly there get
    # functional writes (pagedattn.passes.FunctionalCacheWrites); compiled ones need not
    functional_cache_writes: bool = False
    # the ops may keep calls this backend prepares for a step's later layers (prepare_attend, prepare_write)
    prepares_calls: bool = False

    # --- the cache

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        raise NotImplementedError

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
    ) -> torch.Tensor:
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        device = torch.device(device or self.device_type)
        if device.type == "cpu":  # a decode step reads K/V from all over the cache: fewer TLB misses on huge pages
            return huge_pages.zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    def allocate_kv_caches(self, specs: Sequence[CacheSpec], num_blocks: int, block_size: int,
                           dtype: Optional[torch.dtype] = None,
                           device: torch.device | str | None = None) -> list[torch.Tensor]:
        """One cache per spec (``dtype`` overrides the specs' own)."""
        return [self.allocate_kv_cache(num_blocks, block_size, s.num_kv_heads, s.head_size, dtype or s.dtype, device)
                for s in specs]

    def cache_geometry(self, kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
        """``(num_blocks, block_size, num_kv_heads, head_size)`` of a cache in this layout."""
        raise NotImplementedError

    # --- the paged operations

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Write K/V ``[T, Hkv, D]`` of the step's tokens at ``slot_mapping`` (-1: padding, skipped)."""
        raise NotImplementedError

    def attend(self, query: torch.Tensor, key: Optional[torch.Tensor], value: Optional[torch.Tensor],
               kv_cache: torch.Tensor, metadata: AttentionMetadata, params: AttentionParams) -> torch.Tensor:
        """``[T, Hq, Dv]``: each new token's attention over its sequence's cached keys (see ``ops``)."""
        raise NotImplementedError

    def prepare_attend(self, query: torch.Tensor, key: Optional[torch.Tensor], kv_cache: torch.Tensor,
                       metadata: AttentionMetadata, params: AttentionParams
                       ) -> Optional[Callable[..., torch.Tensor]]:
        """A call ``run(query, key, value, kv_cache)`` doing what ``attend`` does for every later call with these
        metadata tensors unchanged and operands of these shapes, strides, dtypes and devices (the other layers of
        the step), with what ``attend`` derives from them done once here; None (the default): ``attend`` each
        time. The op keeps it and checks that a call matches (``ops``). Asked only where ``prepares_calls``."""
        return None

    def prepare_write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> Optional[Callable[..., None]]:
        """As :meth:`prepare_attend`, for ``write``: ``run(key, value, kv_cache)`` for later calls with this
        ``slot_mapping`` unchanged and operands like these; None (the default): ``write`` each time."""
        return None

    def copy_blocks(self, kv_cache: torch.Tensor, src_to_dst: torch.Tensor) -> None:
        raise NotImplementedError

    def swap_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor, src_to_dst: torch.Tensor) -> None:
        raise NotImplementedError

    def supports(self, config: AttentionConfig) -> list[str]:
        """Reasons this backend cannot run ``config`` exactly; empty when it can."""
        raise NotImplementedError

    # --- checks (run by the ops: the cheap ones always, all of them when validation is on)

    def stored_head_size(self, kv_cache, tokens, op: str) -> int:
        """The head size the op ``op`` takes for ``tokens [T, heads, D]`` against ``kv_cache``: the cache's
        own, unless a layout pads heads in storage."""
        return self.cache_geometry(kv_cache)[3]

    def check_write(self, key, value, kv_cache, slot_mapping, full: bool = False) -> None:
        nb, bs, hkv, _ = self.cache_geometry(kv_cache)
        d = self.stored_head_size(kv_cache, key, "write_kv_cache")
        if full:
            validate_write(key, value, nb * bs, hkv, d, kv_cache.dtype, kv_cache.device, slot_mapping)
        else:
            check_write_cheap(key, value, nb * bs, hkv, d, kv_cache.dtype, kv_cache.device, slot_mapping,
                              values=not self.write_checks_slots(key, value, kv_cache, slot_mapping))

    def native_ops_stand_in(self) -> bool:
        """Whether ``native_ops``' C++ paged ops may run this backend's calls themselves (they do what
        :class:`SdpaCpuBackend` does with its native kernels, and nothing else). Default: no."""
        return False

    def write_checks_slots(self, key, value, kv_cache, slot_mapping) -> bool:
        """Whether ``write`` checks every slot's value before it writes any, refusing as
        ``metadata.check_slot_values`` does: the per-call checks then leave the values to it. Default: no."""
        return False

    def check_attend(self, query, kv_cache, metadata: AttentionMetadata, params: AttentionParams,
                     full: bool = False) -> None:
        nb, bs, hkv, _ = self.cache_geometry(kv_cache)
        d = self.stored_head_size(kv_cache, query, "paged_attention")
        if full:
            validate_attend(query, nb, hkv, d, kv_cache.dtype, kv_cache.device, metadata, params.num_kv_heads,
                            params.causal, params.max_seq_len)
        else:
            check_attend_cheap(query, hkv, d, kv_cache.dtype, kv_cache.device, metadata, params.num_kv_heads,
                               params.causal, params.max_seq_len)

    # --- serving loop hooks

    def step_padder(self, max_num_tokens: int, max_num_seqs: int,
                    max_blocks_per_seq: int) -> Optional[Callable[[AttentionMetadata], AttentionMetadata]]:
        """For devices that compile one graph per shape: a function padding a step's (host) metadata
        to a bounded set of shapes. None: steps run at their own size."""
        return None

    def warm_step_sizes(self, max_num_tokens: int, dtype: torch.dtype) -> tuple[int, ...]:
        """Step sizes (tokens) a compiled step should run once at start-up: sizes whose first step builds what later
        steps of that size reuse, so that the first serving steps of each do not pay for it. Empty: none."""
        return ()

    def sync(self) -> None:
        """End of a serving step; lazy-tensor devices run the step's graph here."""

    def argmax_rows(self, logits: torch.Tensor) -> list[int]:
        """Each row's argmax of ``logits [R, V]`` (greedy sampling), as ``torch.argmax`` gives it: the first
        maximum, a row's first NaN where it holds one. Backends with a faster kernel for it override this."""
        return argmax_rows(logits)

    def argmax_rows_into(self, logits: torch.Tensor, out: torch.Tensor) -> list[int]:
        """:meth:`argmax_rows`, the answer also written into ``out`` (``[R]`` int64 on the logits' device: a decode
        step's input ids for the next step)."""
        out.copy_(argmax_tokens(logits).view(out.shape))
        return out.tolist()

    def argmax_writer(self, out: torch.Tensor) -> Callable[[torch.Tensor, int], list[int]]:
        """A function ``write(logits, i)`` that does :meth:`argmax_rows_into` of ``logits [R, V]`` into row ``i`` of
        ``out`` (``[K, R]`` int64 on the logits' device: a run of decode steps' input ids, each step's tokens the next
        one's) and returns the tokens. For a loop that calls it once a step: backends with a kernel bind it here once."""
        rows = out.unbind(0)
        return lambda logits, i: self.argmax_rows_into(logits, rows[i])


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of ``logits [R, V]`` through ``torch.argmax`` (:func:`argmax_tokens`), as a list."""
    if not logits.numel():
        return []
    return argmax_tokens(logits).tolist()


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``[R]`` each row's argmax of ``logits [R, V]`` through ``torch.argmax``, on the logits' device. On the CPU,
    reduced-precision logits are widened first: float32 holds them exactly, so the result is the same, and the
    CPU's bf16/fp16 argmax is ~5x slower than the conversion plus a float32 one (0.9 against 0.18 ms over
    [32, 16000] bf16 logits on a 2-core EPYC)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits.argmax(-1)


def common_reasons(config: AttentionConfig, dtypes: Sequence[torch.dtype]) -> list[str]:
    """What no backend here can run exactly, whatever its kernels: shared by every ``supports()``."""
    p = config.params
    reasons = []
    if config.dtype not in dtypes:
        reasons.append(f"dtype {config.dtype} is not supported "
                       f"({', '.join(str(d).replace('torch.', '') for d in dtypes)})")
    if config.num_heads % p.num_kv_heads:
        reasons.append(f"{config.num_heads} query heads are not a multiple of {p.num_kv_heads} kv heads")
    if p.sliding_window > 0 and not p.causal:
        reasons.append("a sliding window needs causal attention")
    if p.chunk_size > 0 and not p.causal:
        reasons.append("chunked local attention needs causal attention")
    if p.head_size_v not in (0, config.head_size):
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

    def valid_slots(self, slot_mapping: torch.Tensor) -> Optional[torch.Tensor]:
        """Rows of ``slot_mapping`` that are not padding (-1), or None when all are."""
        if slot_mapping.numel() and bool((slot_mapping < 0).any()):
            return torch.nonzero(slot_mapping >= 0).flatten()
        return None

    def write(self, key, value, kv_cache, slot_mapping):
        nb, bs, hkv, d = self.cache_geometry(kv_cache)
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

# device type -> module path; each module registers its default backend instance on import
_BACKEND_MODULES: dict[str, str] = {
    "cpu": "pagedattn.backends.sdpa_cpu",
    "cuda": "pagedattn.backends.xformers_cuda",
    "xla": "pagedattn.backends.pallas_xla",
}
_DEFAULTS: dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    """Make ``backend`` the default for its device type (what a backend module does on import)."""
    _DEFAULTS[backend.device_type] = backend
    return backend


def _device_type(target: str | torch.device) -> str:
    if isinstance(target, torch.device):
        return target.type
    if target == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(target).type if target not in _BACKEND_MODULES else target


def get_backend(target: "str | torch.device | AttentionBackend" = "auto") -> AttentionBackend:
    """The backend for a target: an ``AttentionBackend`` itself, or the default backend of a device or
    target name (``cpu``, ``cuda``, ``xla``, ``auto``).

    ``auto`` takes the accelerator when its backend loads and falls back to the CPU otherwise.
    """
    if isinstance(target, AttentionBackend):
        return target
    if target == "auto" and _device_type("auto") != "cpu":
        try:
            return get_backend(_device_type("auto"))
        except ValueError as e:
            log.warning("target 'auto': %s; using the CPU backend", e)
            return get_backend("cpu")
    try:
        dev = _device_type(target)
    except RuntimeError as e:
        raise ValueError(f"unknown target {target!r}: use one of cpu, cuda, xla, auto") from e
    if dev not in _DEFAULTS:
        module = _BACKEND_MODULES.get(dev)
        if module is None:
            raise ValueError(f"no pagedattn backend for device type {dev!r}; available: {sorted(_BACKEND_MODULES)}")
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"the {dev!r} backend ({module}) cannot be loaded: {e}") from e
    if dev not in _DEFAULTS:
        raise ValueError(f"module {_BACKEND_MODULES[dev]} did not register a backend for {dev!r}")
    return _DEFAULTS[dev]


_ACTIVE: contextvars.ContextVar[Optional[AttentionBackend]] = contextvars.ContextVar(
    "pagedattn_backend", default=None)


@contextlib.contextmanager
def use_backend(backend: Optional[AttentionBackend]) -> Iterator[None]:
    """Run the paged ops inside with ``backend`` for tensors on its device type (``None``: the defaults). Inside a
    ``use_backend`` of the same backend it does nothing: a serving loop binds its backend once, not once a step."""
    if backend is not None and _ACTIVE.get() is backend:
        yield
        return
    outer = _ACTIVE.get()
    token = _ACTIVE.set(backend)
    # the C++ stand-ins of the paged ops (native_ops) run a call themselves only under a backend they stand in for
    binding = native_ops.bind_backend(backend, outer)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        if binding is not None:
            native_ops.restore_backend(binding)


def bound_backend() -> Optional[AttentionBackend]:
    """The backend :func:`use_backend` bound in this context; None: the defaults."""
    return _ACTIVE.get()


def active_backend(device: torch.device) -> AttentionBackend:
    """The backend the ops use for tensors on ``device``."""
    bound = _ACTIVE.get()
    if bound is not None and bound.device_type == device.type:
        return bound
    return get_backend(device)
