import pytest

from pagedattn.backends import build_metadata, get_backend
from pagedattn.runtime.context import current_context, paged_context


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
