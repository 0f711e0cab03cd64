import pytest

from pagedattn.runtime.blocks import BlockManager, BlockTable, NoFreeBlocks


def test_allocate_and_free_with_refcounts():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    t = BlockTable()
    bm.reserve(t, 9)  # 3 blocks
    assert len(t.blocks) == 3 and bm.num_free == 1
    with pytest.raises(NoFreeBlocks):
        bm.reserve(BlockTable(), 8)
    bm.free(t)
    assert bm.num_free == 4 and all(r == 0 for r in bm.ref)


def test_reserve_is_all_or_nothing():
    bm = BlockManager(3, 4, enable_prefix_caching=False)
    t = BlockTable()
    with pytest.raises(NoFreeBlocks):
        bm.reserve(t, 13)
    assert t.blocks == [] and bm.num_free == 3


def test_prefix_blocks_are_shared_and_survive_their_owner():
    bm = BlockManager(8, 4)
    prompt = list(range(10))
    a = BlockTable()
    assert bm.allocate_prompt(a, prompt) == 0
    bm.reserve(a, 10)
    bm.commit(a, prompt, 10)
    b = BlockTable()
    assert bm.allocate_prompt(b, prompt + [99]) == 8  # two full blocks reused
    assert b.blocks == a.blocks[:2] and bm.ref[a.blocks[0]] == 2
    bm.free(a)
    bm.free(b)
    c = BlockTable()
    assert bm.allocate_prompt(c, prompt[:9] + [5, 6]) == 8  # still cached after both finished
    assert bm.prefix_hits == 4



def test_reset_prefix_cache_forgets_every_prefix_and_keeps_blocks_in_use():
    bm = BlockManager(8, 4)
    prompt = list(range(10))
    a, b = BlockTable(), BlockTable()
    for t in (a, b):
        bm.reserve(t, 10)
        bm.commit(t, prompt if t is a else [p + 100 for p in prompt], 10)
    bm.free(b)  # b's two full blocks: cached, held by nobody
    bm.reset_prefix_cache()
    assert bm.num_free == 5 and [bm.ref[x] for x in a.blocks] == [1, 1, 1]
    assert bm.allocate_prompt(BlockTable(), prompt + [1]) == 0  # a's blocks: in use, no longer found
    assert bm.allocate_prompt(BlockTable(), [p + 100 for p in prompt] + [1]) == 0
    bm.free(a)
    assert bm.num_free == 8 and bm.allocate_prompt(BlockTable(), prompt + [1]) == 0
    bm.reset_prefix_cache()  # nothing held: blocks handed out in their first order again
    fresh = BlockTable()
    bm.reserve(fresh, 12)
    assert fresh.blocks == [0, 1, 2]
    # counter-example: without the reset a finished prompt's blocks are found again
    bm.commit(fresh, prompt + [5, 6], 12)
    bm.free(fresh)
    assert bm.allocate_prompt(BlockTable(), prompt + [1]) == 8


def test_whole_prompt_cached_still_leaves_the_last_token():
    bm = BlockManager(8, 4)
    prompt = list(range(8))
    a = BlockTable()
    bm.reserve(a, 8)
    bm.commit(a, prompt, 8)
    b = BlockTable()
    assert bm.allocate_prompt(b, prompt) == 4  # the last token's logits are needed


def test_cached_blocks_are_evicted_when_space_is_needed():
    bm = BlockManager(3, 4)
    a = BlockTable()
    bm.reserve(a, 12)
    bm.commit(a, list(range(12)), 12)
    bm.free(a)
    assert bm.num_free == 3
    b = BlockTable()
    bm.reserve(b, 12)  # takes the cached blocks back
    assert len(b.blocks) == 3
    assert bm.allocate_prompt(BlockTable(), list(range(13))) == 0


def test_fork_then_copy_on_write():
    bm = BlockManager(8, 4)
    a = BlockTable()
    bm.reserve(a, 6)
    bm.commit(a, list(range(6)), 6)
    b = bm.fork(a)
    assert bm.ref[a.blocks[1]] == 2
    bm.reserve(b, 1)  # b writes into the shared, partly filled block: it gets its own copy
    (src, dst), = bm.take_copies()
    assert src == a.blocks[1] and b.blocks[1] == dst != src
    assert bm.ref[src] == 1 and bm.ref[dst] == 1
    assert b.blocks[0] == a.blocks[0]  # full blocks stay shared


def test_commit_asks_for_the_tokens_only_when_a_block_fills():
    tokens, asked = list(range(11)), []

    def give():
        asked.append(1)
        return tokens

    lazy, eager = BlockManager(8, 4), BlockManager(8, 4)
    a, b = BlockTable(), BlockTable()
    for bm, t in ((lazy, a), (eager, b)):
        bm.reserve(t, 11)
    for n in (3, 1, 1, 2, 1, 3):  # blocks fill at 4 and 8 tokens
        lazy.commit(a, give, n)
        eager.commit(b, tokens, n)
    assert len(asked) == 2 and a.hashes == b.hashes and len(a.hashes) == 2
