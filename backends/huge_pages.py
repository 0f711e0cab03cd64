"""Huge pages for a CPU step's long-lived buffers: its frozen weights and its KV caches.

A decode step streams its weights and its sequences' K/V from memory. With 4 KiB pages every page is a TLB miss, and
under a hypervisor each miss walks two page tables; the hardware's prefetchers also stop at page boundaries. On a
2-vCPU EPYC VM a 256 MiB copy ran at 31-34 GB/s on 4 KiB pages and 56-60 GB/s on 2 MiB ones, and decode steps took
0.90-0.99x the time with the weights and caches on huge pages (llama16m, llama34m; ``benchmarks/RESULTS.md``).

Linux only, and only where the kernel agrees: ``madvise(MADV_HUGEPAGE)`` asks for huge pages on the buffer's whole
2 MiB-aligned stretches (honoured where transparent huge pages are ``madvise`` or ``always``), and ``MADV_COLLAPSE``
(Linux 6.1+) turns pages already touched into huge pages at once. Contents never change. Elsewhere, or where the kernel
refuses, the buffer stays as it was. ``PAGEDATTN_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from typing import Optional

import torch
from torch import Tensor

log = logging.getLogger("pagedattn")

__all__ = ["HUGE_PAGE", "enabled", "buffer_span", "advise_huge_pages", "zeros"]

HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB base pages) transparent huge page
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


def enabled() -> bool:
    """Whether buffers are put on huge pages here: Linux, unless ``PAGEDATTN_HUGE_PAGES`` says 0."""
    flag = os.environ.get("PAGEDATTN_HUGE_PAGES", "1").strip().lower()
    return sys.platform.startswith("linux") and flag not in ("0", "false", "no", "off")


@functools.cache  # the process's C library, once
def _madvise() -> Optional[ctypes._CFuncPtr]:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def buffer_span(t: Tensor) -> tuple[int, int]:
    """``(address, bytes)`` of the memory ``t`` reads: its storage's, or a oneDNN tensor's buffer."""
    if t.is_mkldnn:
        return torch.ops.mkldnn.data_ptr(t), torch.ops.mkldnn._nbytes(t)
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _stretch(t: Tensor) -> Optional[tuple[int, int]]:
    """``(start, bytes)`` of the whole huge pages inside ``t``'s buffer where it may be advised, else None."""
    if t.device.type != "cpu" or not enabled() or _madvise() is None:
        return None
    address, size = buffer_span(t)
    lo, hi = -(-address // HUGE_PAGE) * HUGE_PAGE, (address + size) // HUGE_PAGE * HUGE_PAGE
    return (lo, hi - lo) if hi > lo else None


def _advise(stretch: tuple[int, int], advice: int) -> bool:
    if _madvise()(*stretch, advice) == 0:
        return True
    log.debug("pagedattn: madvise(%d) refused: %s", advice, os.strerror(ctypes.get_errno()))
    return False


def advise_huge_pages(t: Tensor) -> int:
    """Ask for huge pages under ``t``'s buffer (a CPU tensor): its 2 MiB-aligned stretches are advised, and the pages
    already touched are made huge now (where the kernel has no free huge page, or predates 6.1, later or never).
    Returns the bytes the kernel took the advice for (0: none, where the buffer has no whole huge page, this is not
    Linux, it is turned off, or the kernel refused)."""
    stretch = _stretch(t)
    if stretch is None or not _advise(stretch, _MADV_HUGEPAGE):
        return 0
    _advise(stretch, _MADV_COLLAPSE)
    return stretch[1]


def zeros(shape, dtype: torch.dtype) -> Tensor:
    """A CPU tensor of zeros whose pages are asked to be huge before they are first touched (a fresh buffer then
    faults in huge pages, with no copy); any already touched are collapsed."""
    t = torch.empty(shape, dtype=dtype)
    stretch = _stretch(t)
    advised = stretch is not None and _advise(stretch, _MADV_HUGEPAGE)
    t.zero_()
    if advised:
        _advise(stretch, _MADV_COLLAPSE)
    return t
