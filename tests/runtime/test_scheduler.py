"""Scheduler and block manager: swap preemption moves exactly a victim's blocks and brings them back."""

import pytest
import torch

from pagedattn.backends import get_backend
from pagedattn.runtime.blocks import BlockManager, BlockTable, NoFreeBlocks
from pagedattn.runtime.scheduler import (
    PreemptionConfig,
    Request,
    SamplingParams,
    Scheduler,
)

BS = 4


def _request(rid, prompt):
    return Request(rid, list(prompt), SamplingParams(max_new_tokens=8))


def _run(sched, plan, token=1):
    """What the engine does after a step: commit the chunks, append a token to completed ones."""
    for chunk in plan:
        req = chunk.request
        sched.blocks.commit(req.table, req.tokens, chunk.num_tokens)
        req.num_computed += chunk.num_tokens
        if chunk.completes:
            req.output.append(token)


def _two_running(num_host_blocks, prefix_caching=False, prompts=(range(8), range(10, 18))):
    """Two requests of 8 tokens fill a 4-block cache; their next tokens need a new block each."""
    bm = BlockManager(4, BS, enable_prefix_caching=prefix_caching, num_host_blocks=num_host_blocks)
    sched = Scheduler(bm, preemption_mode="swap")
    a, b = _request(0, prompts[0]), _request(1, prompts[1])
    sched.add(a)
    sched.add(b)
    _run(sched, sched.schedule())
    assert sched.running == [a, b] and bm.num_free == 0
    return bm, sched, a, b


def test_swap_out_moves_exactly_the_victims_blocks_and_keeps_its_tokens():
    bm, sched, a, b = _two_running(num_host_blocks=4)
    b_blocks = list(b.table.blocks)
    waiting = _request(2, [5, 6])
    sched.add(waiting)
    plan = sched.schedule()
    assert [c.request for c in plan] == [a]  # b made room for a; the newcomer waits behind b
    assert list(sched.swapped) == [b] and b.swapped and not a.swapped
    assert sched.waiting[0] is waiting
    out, into = bm.take_swaps()
    assert [d for d, _ in out] == b_blocks and into == []
    assert b.table.blocks == [h for _, h in out]  # the table now names host blocks, in order
    assert b.num_computed == b.table.num_cached_tokens == 8  # nothing to recompute
    assert (sched.num_swap_outs, sched.num_recomputes, sched.num_preemptions) == (1, 0, 1)
    assert bm.num_free_host == 2


def test_swap_in_restores_the_block_table_and_its_data():
    backend = get_backend("cpu")
    device = backend.allocate_kv_cache(4, BS, 1, 2)
    host = backend.allocate_kv_cache(4, BS, 1, 2)
    for blk in range(4):
        device[:, blk] = blk + 1  # each block holds its own marker

    def move():
        out, into = bm.take_swaps()
        for pairs, src, dst in ((out, device, host), (into, host, device)):
            if pairs:
                backend.swap_blocks(src, dst, torch.tensor(pairs))

    bm, sched, a, b = _two_running(num_host_blocks=4)
    markers = [float(device[0, blk, 0, 0, 0]) for blk in b.table.blocks]
    _run(sched, sched.schedule())  # b swapped out, a decodes into b's former block
    move()
    sched.finish(a, "length")
    device.fill_(-1)  # whatever reuses the freed blocks overwrites them: only the host copy survives
    plan = sched.schedule()
    assert [(c.request, c.start, c.num_tokens) for c in plan] == [(b, 8, 1)]
    assert not b.swapped and sched.num_swap_ins == 1 and not sched.swapped
    assert len(b.table.blocks) == 3 and b.table.num_cached_tokens == 8  # two back, one for the new token
    move()
    assert [float(device[0, blk, 0, 0, 0]) for blk in b.table.blocks[:2]] == markers
    assert [float(device[1, blk, -1, 0, -1]) for blk in b.table.blocks[:2]] == markers  # V too
    assert bm.num_free_host == 4


def test_full_host_pool_falls_back_to_recompute():
    bm, sched, a, b = _two_running(num_host_blocks=1)  # b has 2 blocks
    plan = sched.schedule()
    assert [c.request for c in plan] == [a]
    assert not b.swapped and sched.waiting[0] is b and b.num_computed == 0 and b.table.blocks == []
    assert (sched.num_swap_outs, sched.num_recomputes) == (0, 1)
    assert bm.take_swaps() == ([], []) and bm.num_free_host == 1


def _prefilled(bm, prompt):
    t = BlockTable()
    bm.allocate_prompt(t, prompt)
    bm.reserve(t, len(prompt) - t.num_cached_tokens)
    bm.commit(t, prompt, len(prompt) - t.num_cached_tokens)
    return t


@pytest.mark.parametrize("holder_finishes", [False, True])
def test_shared_prefix_blocks_are_copied_out_and_shared_again_on_swap_in(holder_finishes):
    bm = BlockManager(8, BS, num_host_blocks=8)
    shared = list(range(8))
    a = _prefilled(bm, shared + [1])
    b = _prefilled(bm, shared + [2])
    assert a.blocks[:2] == b.blocks[:2] and bm.ref[a.blocks[0]] == 2
    b_blocks = list(b.blocks)
    out = bm.swap_out(b)
    assert [d for d, _ in out] == b_blocks  # every block gets a host copy, shared ones too
    assert bm.ref[b_blocks[0]] == 1 and bm.ref[b_blocks[2]] == 0  # a keeps the prefix
    if holder_finishes:
        bm.free(a)  # the prefix blocks stay in the prefix cache
    bm.take_swaps()
    into = bm.swap_in(b)
    assert b.blocks[:2] == b_blocks[:2]  # the cached prefix is shared again, not copied
    assert into == [(out[2][1], b.blocks[2])]  # only the unshared last block moves
    assert bm.ref[b_blocks[0]] == (1 if holder_finishes else 2)


def test_evicted_prefix_blocks_are_copied_back():
    bm = BlockManager(3, BS, num_host_blocks=3)
    b = _prefilled(bm, list(range(9)))
    out = bm.swap_out(b)
    bm.take_swaps()
    other = _prefilled(bm, [50 + i for i in range(9)])  # needs all three blocks: b's prefix is evicted
    bm.free(other)
    into = bm.swap_in(b)
    assert [h for h, _ in into] == [h for _, h in out]  # nothing cached to share: all three come back
    assert len(set(b.blocks)) == 3

def test_swap_out_with_a_shared_block_keeps_the_other_holder():
    bm = BlockManager(6, BS, enable_prefix_caching=False, num_host_blocks=6)
    a = BlockTable()
    bm.reserve(a, 6)
    b = bm.fork(a)
    assert bm.ref[a.blocks[0]] == 2
    pairs = bm.swap_out(b)
    assert [d for d, _ in pairs] == a.blocks and all(bm.ref[x] == 1 for x in a.blocks)
    bm.take_swaps()
    bm.swap_in(b)
    assert set(b.blocks).isdisjoint(a.blocks)  # a private copy: a may write its blocks meanwhile
    bm.free(a)
    bm.free(b)
    bm.take_swaps()
    assert bm.num_free == 6 and bm.num_free_host == 6


def test_host_blocks_being_swapped_in_are_not_reused_before_the_move():
    bm = BlockManager(4, BS, enable_prefix_caching=False, num_host_blocks=2)
    t, u = BlockTable(), BlockTable()
    bm.reserve(t, 8)
    bm.swap_out(t)
    bm.take_swaps()
    bm.swap_in(t)
    bm.reserve(u, 4)
    assert not bm.can_swap_out(u)  # t's host blocks are read only when the engine runs the swaps
    bm.take_swaps()
    assert bm.can_swap_out(u)


def test_swap_bookkeeping_refuses_what_does_not_fit():
    bm = BlockManager(2, BS, enable_prefix_caching=False, num_host_blocks=1)
    t = BlockTable()
    bm.reserve(t, 8)
    with pytest.raises(NoFreeBlocks):
        bm.swap_out(t)
    with pytest.raises(ValueError, match="not swapped out"):
        bm.swap_in(t)
    assert not bm.can_swap_in(t, 1)


@pytest.mark.parametrize("mode, space, error, match", [
    ("bogus", None, ValueError, "preemption_mode must be 'recompute' or 'swap'"),
    ("swap", -1, ValueError, "swap_space must be >= 0"),
    ("swap", 1.5, TypeError, "byte count"),
    ("recompute", 1 << 20, ValueError, "preemption_mode='swap'"),
])
def test_bad_preemption_settings_are_named(mode, space, error, match):
    with pytest.raises(error, match=match):
        PreemptionConfig(mode, space)


def test_scheduler_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="preemption_mode"):
        Scheduler(BlockManager(4, BS), preemption_mode="swap-ish")


def test_host_blocks_from_swap_space():
    assert PreemptionConfig("swap", 1000).num_host_blocks(bytes_per_block=300, num_device_blocks=9) == 3
    assert PreemptionConfig("swap").num_host_blocks(300, 9) == 9  # None: like the device cache
    assert PreemptionConfig().num_host_blocks(300, 9) == 0


# ------------------------------------------------------------------ prefix-LM spans


@pytest.mark.parametrize("computed, budget, spans, want", [
    (0, 8, [(4, 10)], 4),  # cut before the span: its queries need all of its keys
    (0, 12, [(4, 12)], 12),  # the span ends within the budget: taken whole
    (4, 3, [(4, 10)], 0),  # a span longer than what is left of the step waits
    (6, 3, [(4, 10)], 0),  # begun in a cached block: all of the rest or nothing
    (6, 4, [(4, 10)], 4),  # the rest fits
    (0, 16, [(2, 4), (6, 30)], 6),
    (12, 16, [(2, 4), (6, 10)], 8),  # after the spans: plain chunks
], ids=["cut", "whole", "waits", "rest_waits", "rest", "second_cut", "after"])
def test_a_step_never_ends_inside_a_span(computed, budget, spans, want):
    req = Request(0, list(range(20)), SamplingParams(), spans=tuple(spans))
    req.num_computed = computed
    assert req.chunk(budget) == want


def test_a_span_that_does_not_fit_the_step_waits_for_room():
    bm = BlockManager(64, BS)
    sched = Scheduler(bm, max_num_tokens=12)
    decode = _request(0, range(3))
    sched.add(decode)
    _run(sched, sched.schedule())  # decode is now running, one token a step
    span = Request(1, list(range(20)), SamplingParams(), spans=((0, 12),))
    sched.add(span)
    plan = sched.schedule()
    assert [c.request.id for c in plan] == [0] and sched.waiting[0] is span and not span.table.blocks
    sched.finish(decode, "stop")
    plan = sched.schedule()
    assert [(c.request.id, c.start, c.num_tokens) for c in plan] == [(1, 0, 12)]


def test_token_slice_is_the_slice_of_prompt_and_output():
    req = Request(0, [1, 2, 3], SamplingParams(max_new_tokens=4), output=[4, 5])
    for a in range(7):
        for b in range(a, 8):
            assert req.token_slice(a, b) == req.tokens[a:b]
