import pytest
import torch

from pagedattn.backends import build_metadata, get_backend
from pagedattn.runtime.context import cache_block_size, current_context, paged_context


def _cache(block_size):
    return get_backend("cpu").allocate_kv_cache(4, block_size, 2, 8)


def test_context_binds_caches_and_metadata():
    meta = build_metadata([(0, 3, [1])], block_size=16)
    assert current_context() is None
    with paged_context([_cache(16)], meta) as ctx:
        assert current_context() is ctx
        assert len(ctx.graph_inputs(1)) == 5
    assert current_context() is None


def test_block_size_mismatch_is_refused():
    # slots computed for 8-token blocks would land in the wrong places of a 16-token-block cache
    meta = build_metadata([(0, 3, [1])], block_size=8)
    with pytest.raises(ValueError, match="blocks of 16 tokens but the metadata was built for 8"):
        with paged_context([_cache(16)], meta):
            pass


def test_wrong_number_of_caches():
    meta = build_metadata([(0, 3, [1])], block_size=16)
    with paged_context([_cache(16)], meta) as ctx, pytest.raises(ValueError, match="one cache per site"):
        ctx.graph_inputs(2)


def test_the_block_size_of_caches():
    assert cache_block_size([_cache(8), _cache(8)]) == 8
    assert cache_block_size([torch.zeros(3)]) is None  # no backend reads it as a cache: the op will say why
    with pytest.raises(ValueError, match=r"different sizes \(\[8, 16\]\)"):
        cache_block_size([_cache(16), _cache(8)])
