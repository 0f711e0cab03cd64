"""``PagedEngine.abort`` and requests added and aborted from other threads while one thread steps.

Every test checks that the blocks come back (the free-block count returns to its start) and that the
requests left alone still generate their greedy reference tokens, token for token.
"""

import threading

from pagedattn import PagedEngine

from ..support import prompts

NEW = 12
# eager steps: these tests are about bookkeeping, and a compile per engine would dominate their time


def _run_out(engine: PagedEngine) -> dict[int, object]:
    """Step until nothing is left; every request's output, the aborted ones' included."""
    while engine.has_unfinished():
        engine.step()
    return {o.request_id: o for o in engine.collect()}


def test_abort_running_request_frees_its_blocks_and_spares_the_others(llama):
    _, ref, rewritten = llama
    engine = PagedEngine(rewritten, num_blocks=64, block_size=4, compile=False)
    start = engine.blocks.num_free
    ps = prompts()
    ids = [engine.add_request(p, max_new_tokens=NEW) for p in ps]
    for _ in range(4):
        engine.step()
    used = start - engine.blocks.num_free
    victim = ids[3]  # the longest prompt: it holds the most blocks
    engine.abort(victim)
    assert start - engine.blocks.num_free < used  # freed at once, before any further step
    outs = _run_out(engine)
    assert outs[victim].finish_reason == "abort" and 0 < len(outs[victim].tokens) < NEW
    assert outs[victim].tokens == ref[3][: len(outs[victim].tokens)]
    for i, rid in enumerate(ids):
        if rid != victim:
            assert outs[rid].tokens == ref[i][:NEW] and outs[rid].finish_reason == "length"
    assert engine.blocks.num_free == start


def test_abort_waiting_unknown_and_finished_ids(llama):
    _, ref, rewritten = llama
    engine = PagedEngine(rewritten, num_blocks=64, block_size=4, compile=False)
    start = engine.blocks.num_free
    a = engine.add_request(prompts()[0], max_new_tokens=4)
    b = engine.add_request(prompts()[1], max_new_tokens=4)
    engine.abort(b)  # never scheduled
    engine.abort(12345)  # unknown: ignored
    outs = _run_out(engine)
    assert outs[b].finish_reason == "abort" and outs[b].tokens == []
    assert outs[a].tokens == ref[0][:4]
    engine.abort(a)  # finished: ignored
    assert not engine.has_unfinished() and engine.collect() == [] and engine.blocks.num_free == start


def test_abort_swapped_out_request_frees_host_blocks(llama):
    _, ref, rewritten = llama
    engine = PagedEngine(rewritten, num_blocks=14, block_size=4, preemption_mode="swap", compile=False)
    start, host_start = engine.blocks.num_free, engine.blocks.num_free_host
    ids = [engine.add_request(p, max_new_tokens=NEW) for p in prompts()]
    swapped = []
    while engine.has_unfinished() and not swapped:
        engine.step()
        swapped = list(engine.scheduler.swapped)
    assert swapped, "the cache is too small for the batch: some request must be swapped out"
    victim = swapped[0].id
    engine.abort(victim)
    outs = _run_out(engine)
    assert outs[victim].finish_reason == "abort"
    for i, rid in enumerate(ids):
        if rid != victim:
            assert outs[rid].tokens == ref[i][:NEW]
    assert engine.blocks.num_free == start and engine.blocks.num_free_host == host_start


def test_add_and_abort_from_another_thread_while_stepping(llama):
    """One thread steps (as a server's engine loop does) while another adds requests and aborts half of them."""
    _, ref, rewritten = llama
    engine = PagedEngine(rewritten, num_blocks=64, block_size=4, compile=False)
    start = engine.blocks.num_free
    ps = prompts() * 3
    stop = threading.Event()
    done: dict[int, object] = {}
    errors: list[BaseException] = []

    def loop():
        try:
            while not stop.is_set() or engine.has_unfinished():
                if engine.has_unfinished():
                    engine.step()
                for o in engine.collect():
                    done[o.request_id] = o
        except BaseException as e:  # surfaced in the main thread's assertion
            errors.append(e)

    t = threading.Thread(target=loop)
    t.start()
    try:
        ids = []
        for i, p in enumerate(ps):
            ids.append(engine.add_request(p, max_new_tokens=NEW))
            if i % 2:
                engine.abort(ids[-1])
    finally:
        stop.set()
        t.join(60)
    assert not t.is_alive() and not errors
    assert sorted(done) == sorted(ids)  # nothing lost: every request finished or was reported aborted
    for i, rid in enumerate(ids):
        if i % 2:
            assert done[rid].finish_reason in ("abort", "length")  # it may have finished before the abort
        else:
            assert done[rid].tokens == ref[i % len(ref)][:NEW]
    assert engine.blocks.num_free == start


def test_unfinished_outputs_grow_by_step(llama):
    _, ref, rewritten = llama
    engine = PagedEngine(rewritten, compile=False)
    rid = engine.add_request(prompts()[0], max_new_tokens=3)
    assert engine.unfinished_outputs() == {rid: []}
    engine.step()
    engine.step()
    assert engine.unfinished_outputs() == {rid: ref[0][:2]}
    assert engine.unfinished_outputs(since={rid: 1}) == {rid: ref[0][1:2]}
    _run_out(engine)
    assert engine.unfinished_outputs() == {}
