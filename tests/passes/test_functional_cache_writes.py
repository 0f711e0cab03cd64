"""``FunctionalCacheWrites``: the in-place cache write made functional, in both modes, on a two-site paged graph."""

import pytest
import torch

import pagedattn
from pagedattn.backends import build_metadata
from pagedattn.passes import FunctionalCacheWrites, PassContext, run_pipeline
from pagedattn.passes.canonical import is_paged_attention, read_paged
from pagedattn.tracing import copy_graph_module

from ..rewriter import zoo
from ..support import targets

WRITE = torch.ops.pagedattn.write_kv_cache.default
FUNCTIONAL = torch.ops.pagedattn.write_kv_cache_functional.default


@pytest.fixture(scope="module")
def two_sites():
    """A paged graph with two sites whose caches differ in shape (4 and 2 kv heads), and one step's inputs."""
    m = torch.nn.Sequential(zoo.NanoGPT(), zoo.GQAExpand()).eval()
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, zoo.C),), block_size=4)
    assert [s.num_kv_heads for s in rm.cache_specs] == [zoo.H, 2]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 9, zoo.C, generator=g)
    meta = build_metadata([(0, 5, [3, 0]), (0, 4, [1])], block_size=4)
    caches = [c.normal_(generator=g) for c in rm.allocate_kv_caches(5)]
    return rm, x, caches, meta


def _run(gm, x, caches, meta):
    """The graph on copies of the caches; (outputs, the caches afterwards)."""
    caches = [c.clone() for c in caches]
    with torch.no_grad():
        out = gm(x, *caches, *meta.tensors())
    return list(out), caches


def _functional(rm, mode):
    gm = copy_graph_module(rm.graph_module)
    (report,) = run_pipeline(gm, PassContext(), (FunctionalCacheWrites(mode),))
    assert report.changed and "2 cache writes" in report.detail
    return gm


def test_outputs_mode_returns_the_new_caches_in_cache_order(two_sites):
    rm, x, caches, meta = two_sites
    ref_out, ref_caches = _run(rm.graph_module, x, caches, meta)
    gm = _functional(rm, "outputs")
    t = targets(gm)
    assert WRITE not in t and t.count(FUNCTIONAL) == 2 and torch.ops.aten.copy_.default not in t
    # the paged attention reads the cache its own step wrote
    read = [read_paged(n).kv_cache for n in gm.graph.nodes if is_paged_attention(n)]
    assert len(read) == 2 and all(c.target is FUNCTIONAL for c in read)
    out, after = _run(gm, x, caches, meta)
    assert len(out) == len(ref_out) + 2
    for a, b in zip(out, ref_out):
        torch.testing.assert_close(a, b)
    assert all(torch.equal(a, b) for a, b in zip(after, caches)), "the input caches must stay untouched"
    assert [tuple(c.shape) for c in out[-2:]] == [tuple(c.shape) for c in caches]  # kv_cache_0, then kv_cache_1
    assert all(torch.equal(a, b) for a, b in zip(out[-2:], ref_caches))
    assert any(not torch.equal(a, b) for a, b in zip(ref_caches, caches))  # the step did write something


def test_copy_back_mode_updates_the_caches_in_place(two_sites):
    rm, x, caches, meta = two_sites
    ref_out, ref_caches = _run(rm.graph_module, x, caches, meta)
    gm = _functional(rm, "copy_back")
    t = targets(gm)
    assert WRITE not in t and t.count(FUNCTIONAL) == 2 and t.count(torch.ops.aten.copy_.default) == 2
    out, after = _run(gm, x, caches, meta)
    assert len(out) == len(ref_out)
    for a, b in zip(out, ref_out):
        torch.testing.assert_close(a, b)
    assert all(torch.equal(a, b) for a, b in zip(after, ref_caches))
