"""Swap preemption in PagedEngine: victims' blocks go to a host cache and come back, tokens unchanged."""

import pytest

from pagedattn import PagedEngine

from ..support import prompts

NEW = 16  # the shared ``llama`` fixture's reference length (conftest.py)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("max_num_tokens", [8, 64])  # chunked prefill, or whole prompts
def test_swapped_requests_continue_without_recompute(llama, prefix_caching, max_num_tokens):
    _, ref, rewritten = llama
    engine = PagedEngine(rewritten, compile=False, num_blocks=16, block_size=4, max_num_tokens=max_num_tokens,
                         enable_prefix_caching=prefix_caching, preemption_mode="swap")
    assert engine.generate(prompts(), max_new_tokens=NEW) == ref
    stats = engine.stats
    assert stats["swap_outs"] > 0 and stats["swap_ins"] == stats["swap_outs"]
    assert stats["recomputes"] == 0 and stats["preemptions"] == stats["swap_outs"]
    assert engine.blocks.num_free_host == engine.blocks.num_host_blocks == engine.num_blocks
    assert (engine.blocks.prefix_hits > 0) == prefix_caching


def test_too_little_swap_space_falls_back_to_recompute(llama):
    _, ref, rewritten = llama
    probe = PagedEngine(rewritten, compile=False, num_blocks=14, block_size=4)
    # four blocks of host cache: room for the smaller victims only
    engine = PagedEngine(rewritten, compile=False, num_blocks=14, block_size=4, preemption_mode="swap",
                         swap_space=4 * probe.servable.bytes_per_block())
    assert engine.blocks.num_host_blocks == 4 and engine.host_kv_caches[0].shape[1] == 4
    assert engine.generate(prompts(), max_new_tokens=NEW) == ref
    assert engine.stats["swap_outs"] > 0 and engine.stats["recomputes"] > 0


def test_no_swap_space_recomputes_every_victim(llama):
    _, ref, rewritten = llama
    engine = PagedEngine(rewritten, compile=False, num_blocks=14, block_size=4, preemption_mode="swap", swap_space=0)
    assert engine.host_kv_caches == []
    assert engine.generate(prompts(), max_new_tokens=NEW) == ref
    assert engine.stats["recomputes"] > 0 and engine.stats["swap_outs"] == 0


def test_recompute_stays_the_default(llama):
    _, ref, rewritten = llama
    engine = PagedEngine(rewritten, compile=False, num_blocks=14, block_size=4)
    assert engine.host_kv_caches == [] and engine.blocks.num_host_blocks == 0
    assert engine.generate(prompts(), max_new_tokens=NEW) == ref
    assert engine.stats["recomputes"] == engine.stats["preemptions"] > 0 and engine.stats["swap_outs"] == 0


@pytest.mark.parametrize("kw, match", [
    ({"preemption_mode": "swapping"}, "preemption_mode must be 'recompute' or 'swap'"),
    ({"preemption_mode": "swap", "swap_space": -1}, "swap_space must be >= 0"),
    ({"swap_space": 1 << 30}, "pass preemption_mode='swap'"),
])
def test_bad_preemption_arguments_are_refused(llama, kw, match):
    with pytest.raises(ValueError, match=match):
        PagedEngine(llama[2], compile=False, num_blocks=14, block_size=4, **kw)
