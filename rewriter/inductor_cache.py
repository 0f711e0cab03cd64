"""Inductor's FX graph cache for steps compiled with freezing on the CPU.

Freezing repacks the linear layers' weights for oneDNN into mkldnn tensors, constants of the compiled step, and
Inductor's FX graph cache declines every graph that holds one ("mkldnn tensors unpickleable"): each start then
lowered and generated its steps' code afresh, and only the C++ builds of the kernels came from the disk (a warm start
of llama16m in bf16: ~40 s that way, ~28 s with the step's code from the cache; benchmarks/RESULTS.md).

With freezing, the cache keys a frozen constant by its metadata and takes its value from the graph module it is
loaded for (Inductor's own design: ``CompiledFxGraphConstantsWithGm``); the generated code reads a packed weight as
an opaque input. :func:`frozen_steps_cacheable` keys packed weights the same way, their metadata being what the
step may depend on (:func:`pagedattn.backends.cpu_linear.packed_weight_key`: shape, dtype and the layout their
bytes are proved to hold, which is what :class:`~pagedattn.backends.cpu_linear.SmallLinears` decides by). A step with
MKL's packed linears (a float32 step of one token) is cached too: where the pass gives one a contiguous copy of its
plain weight, a frozen attribute of the module that a step loaded from the cache reads but no pass made, the copy is
made again from that weight as the step loads (:func:`pagedattn.backends.cpu_linear.restore_plain_rows`).
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Iterator, Optional

from pagedattn.backends.cpu_linear import packed_weight_key, restore_plain_rows

__all__ = ["frozen_steps_cacheable"]


def _value(x: Any) -> Any:
    """A reduced object's stand-in in the cache key's pickle (the key hashes the pickle, never loads it)."""
    return x


@functools.cache  # facts about the torch this process runs
def _patches() -> Optional[tuple]:
    """``((class, attribute, patched value), ...)`` for Inductor's cache classes, or None where this torch has not
    the ones patched here. Built once: entering :func:`frozen_steps_cacheable` is then a few attribute writes (it
    runs around every step)."""
    try:
        from torch._inductor import codecache, output_code
        from torch._inductor.freezing_utils import is_frozen_param
    except ImportError:  # pragma: no cover - torch without Inductor's FX graph cache
        return None
    validator, pickler = getattr(codecache, "CacheabilityValidator", None), getattr(codecache, "FxGraphCachePickler",
                                                                                     None)
    constants = getattr(output_code, "CompiledFxGraphConstantsWithGm", None)
    needed = ((validator, "check_tensor"), (pickler, "_reduce_tensor"), (constants, "unwrap"))
    if any(cls is None or not isinstance(cls.__dict__.get(name), (staticmethod, types.FunctionType)) for cls, name in needed):
        return None
    check, reduce, unwrap = (cls.__dict__[name] for cls, name in needed)

    def packed(t) -> bool:
        return t.is_mkldnn and is_frozen_param(t)

    def check_tensor(t):
        if not packed(t):
            check.__func__(t)

    def unwrap_constants(self, graph):
        # a step loaded from the cache takes its frozen constants from self.gm by name; the plain-row weights among
        # them are made by a pass that ran only when the step was compiled
        restore_plain_rows(self.gm, graph.frozen_param_names.values())
        return unwrap(self, graph)

    def reduce_tensor(self, t):
        if packed(t):
            try:
                return _value, (packed_weight_key(t),)
            except RuntimeError:  # its buffer cannot be read here (no oneDNN helpers): Inductor's own refusal
                check.__func__(t)
        return reduce(self, t)

    return tuple(zip((validator, pickler, constants), ("check_tensor", "_reduce_tensor", "unwrap"),
                     (staticmethod(check_tensor), reduce_tensor, unwrap_constants)))


@contextlib.contextmanager
def frozen_steps_cacheable() -> Iterator[None]:
    """While it holds, Inductor's FX graph cache takes graphs whose frozen constants include oneDNN-packed weights,
    keyed by :func:`~pagedattn.backends.cpu_linear.packed_weight_key`, and a step loaded from it gets the plain-row
    weights the small-linear pass made for it; other graphs are cached as Inductor would.
    Where this torch lacks the hooks, nothing changes (such steps compile at every start, as before)."""
    patches = _patches()
    if patches is None:
        yield
        return
    saved = [(cls, name, cls.__dict__[name]) for cls, name, _ in patches]
    for cls, name, value in patches:
        setattr(cls, name, value)
    try:
        yield
    finally:
        for cls, name, value in saved:
            setattr(cls, name, value)
