"""Huge pages under a CPU step's long-lived buffers (``pagedattn.backends.huge_pages``): asked for and collapsed where
Linux allows them, contents unchanged, buffers without a whole huge page and a switched-off process left alone."""

import os
import re
import sys
from pathlib import Path

import pytest
import torch

from pagedattn.backends import huge_pages
from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _collapses() -> bool:
    """Linux 6.1 or later (``MADV_COLLAPSE``) with transparent huge pages not turned off."""
    if not sys.platform.startswith("linux") or not MODE.exists() or "[never]" in MODE.read_text():
        return False
    version = tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2])
    return version >= (6, 1)


needs_thp = pytest.mark.skipif(not _collapses(), reason="needs Linux 6.1+ with transparent huge pages not turned off")


def huge_bytes(t: torch.Tensor) -> int:
    """Bytes of anonymous huge pages in the mappings ``t``'s buffer lies in (``/proc/self/smaps``)."""
    address, size = huge_pages.buffer_span(t)
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < address + size and address < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


@needs_thp
def test_a_large_buffer_lands_on_huge_pages_with_its_contents():
    t = torch.arange(8 << 20, dtype=torch.float32)  # 32 MiB, touched: its pages are collapsed
    expected = t.clone()
    advised = huge_pages.advise_huge_pages(t)
    assert advised >= 30 << 20 and advised % huge_pages.HUGE_PAGE == 0
    assert huge_bytes(t) >= 2 << 20
    assert torch.equal(t, expected)


@needs_thp
def test_a_packed_onednn_weight_is_advised_by_its_own_buffer():
    w = torch.randn(2048, 1024)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)  # 8 MiB in oneDNN's layout
    address, size = huge_pages.buffer_span(packed)
    assert (address, size) == (torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed))
    assert huge_pages.advise_huge_pages(packed) >= 4 << 20
    assert torch.equal(packed.to_dense(), w)


@needs_thp
def test_cpu_kv_caches_are_zeros_on_huge_pages():
    cache = SdpaCpuBackend().allocate_kv_cache(512, 16, 4, 64, torch.bfloat16)  # 16 MiB
    assert cache.shape == SdpaCpuBackend().kv_cache_shape(512, 16, 4, 64) and not cache.any()
    assert huge_bytes(cache) >= 2 << 20


def test_buffers_without_a_whole_huge_page_or_with_it_off_are_left_alone(monkeypatch):
    assert huge_pages.advise_huge_pages(torch.zeros(1000)) == 0  # no whole 2 MiB stretch
    assert huge_pages.advise_huge_pages(torch.zeros(8 << 20, device="meta")) == 0
    monkeypatch.setenv("PAGEDATTN_HUGE_PAGES", "0")
    big = torch.zeros(8 << 20)
    assert not huge_pages.enabled() and huge_pages.advise_huge_pages(big) == 0
    cache = SdpaCpuBackend().allocate_kv_cache(512, 16, 4, 64, torch.float32)
    assert not cache.any()
