"""Asynchronous decode steps (``PagedEngine(async_decode=True)``, the default where decode steps run through the
CUDA graphs' buffers), checked on the CPU over those buffers run eagerly: a step starts before the previous one is
read back, its input ids read on the device from the previous step's tokens. Its tokens must be the synchronous
engine's and Hugging Face generate's whatever makes requests stop, join, leave, wait or share blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedattn import PagedEngine, SamplingParams
from pagedattn.adapter import prepare_model
from pagedattn.backends import set_validation
from pagedattn.runtime.cuda_graphs import DecodeGraphs, DeviceTokens
from pagedattn.runtime.engine import PendingStep

from ..support import hf_generate, prompts
from .test_cuda_graphs import tiny_llama


def engine_with_graphs(model, async_decode: bool = True, **kw) -> PagedEngine:
    """A CPU engine whose decode steps go through the capture path's buffers (run eagerly), as on CUDA. ``model``: the
    model, or the ``servable`` fixture's program (one rewrite for the file's engines)."""
    kw = {"num_blocks": 96, "max_num_seqs": 8, **kw}
    engine = PagedEngine(model, block_size=4, compile=False, progress=False, async_decode=async_decode, **kw)
    engine.decode_graphs = DecodeGraphs(engine.servable, engine.kv_caches, kw["max_num_seqs"], engine.num_blocks,
                                        capture=False)
    return engine


def serve(engine: PagedEngine, requests) -> dict[int, tuple[list[int], str]]:
    """``requests``: (prompt, SamplingParams); every request to the end: tokens and finish reason by request."""
    ids = [engine.add_request(p, params) for p, params in requests]
    while engine.has_unfinished():
        engine.step()
    done = {r.request_id: (r.tokens, r.finish_reason) for r in engine.collect()}
    return {i: done[rid] for i, rid in enumerate(ids)}


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def servable(model):
    """``model`` rewritten and checked once, as ``engine_with_graphs`` would for each engine; engines share it as
    ``PagedEngine`` serves a ``ServableModel`` (each has caches of its own)."""
    return prepare_model(model, block_size=4, compile=False)


def test_a_decode_step_starts_before_the_previous_one_is_read_back(model, monkeypatch):
    """The first decode step runs from the host's tokens; each later one starts, its ids read on the device, before
    the one before it is read; the last is read when no request goes on past it."""
    events = []
    run, read = DecodeGraphs.run, PendingStep.read
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, ids, *a, **k: events.append(
        ("run", isinstance(ids, DeviceTokens))) or run(self, ids, *a, **k))
    monkeypatch.setattr(PendingStep, "read", lambda self: events.append(("read",)) or read(self))
    ps = prompts(lengths=(5, 17, 9))[:3]
    engine = engine_with_graphs(model)
    assert engine.generate(ps, max_new_tokens=8) == hf_generate(model, ps, 8)
    assert events == [("run", False)] + [("run", True), ("read",)] * 6 + [("read",)]
    assert engine.stats["overlapped_steps"] == 6 and engine.blocks.num_free == engine.num_blocks

    events.clear()
    sync = engine_with_graphs(model, async_decode=False)  # counter-example: every step read before the next
    assert sync.generate(ps, max_new_tokens=8) == hf_generate(model, ps, 8)
    assert ("read",) not in events and sync.stats["overlapped_steps"] == 0


def test_stop_tokens_and_token_limits_end_requests_as_the_synchronous_engine_does(servable):
    """A stop token ends a request whose next step is already under way (its token dropped, its blocks freed);
    requests of different token limits end at their own; the tokens are the synchronous engine's."""
    ps = prompts(lengths=(5, 17, 9, 30, 2))
    free = serve(engine_with_graphs(servable, async_decode=False), [(p, SamplingParams(max_new_tokens=12)) for p in ps])
    # stop tokens met mid-way: the 4th token of request 0, the 7th of request 3
    stops = (free[0][0][3], free[3][0][6])
    for limits in ((12,) * 7, (12, 3, 9, 12, 1, 7, 12)):  # the same limit: every stop met with a step under way
        requests = [(p, SamplingParams(max_new_tokens=n, stop_token_ids=stops)) for p, n in zip(ps, limits)]
        results = []
        for async_decode in (True, False):
            engine = engine_with_graphs(servable, async_decode=async_decode)
            results.append(serve(engine, requests))
            assert engine.blocks.num_free == engine.num_blocks and len(engine.collect()) == 0
        assert results[0] == results[1]
        assert results[0][0] == (free[0][0][:4], "stop")
        assert len(results[0][3][0]) <= 7 and results[0][3][1] == "stop"


def test_requests_that_join_or_leave_while_a_step_is_under_way_get_hf_generates_tokens(model, servable):
    """Requests added while a step is pending (the next step reads the pending one first, then admits them) and a
    request aborted while its next token is under way (its token dropped): each one's tokens are HF generate's
    (the aborted one's a prefix of them)."""
    ps = prompts(lengths=(5, 17, 9, 30, 2))
    engine = engine_with_graphs(servable)
    first = [engine.add_request(p, max_new_tokens=10) for p in ps[:3]]
    while engine._pending is None:
        engine.step()
    engine.step()  # a step started from the device's tokens
    assert engine.stats["overlapped_steps"] >= 1
    later = [engine.add_request(p, max_new_tokens=10) for p in ps[3:]]
    engine.step()
    engine.step()
    assert engine._pending is not None
    engine.abort(first[1])
    while engine.has_unfinished():
        engine.step()
    done = {r.request_id: r for r in engine.collect()}
    want = hf_generate(model, ps, 10)
    for rid, w in zip(first + later, want):
        if rid == first[1]:
            assert done[rid].finish_reason == "abort" and w[:len(done[rid].tokens)] == done[rid].tokens
        else:
            assert done[rid].tokens == w
    assert engine.stats["overlapped_steps"] > 6 and engine.blocks.num_free == engine.num_blocks


def test_a_cache_too_small_for_every_request_preempts_and_recomputes_with_generates_tokens(model, servable):
    """Blocks run out: the next step cannot be sure of room, so the pending one is read first and the scheduler
    preempts as it does without asynchronous steps."""
    ps = prompts(lengths=(5, 17, 9, 30, 2))
    engine = engine_with_graphs(servable, num_blocks=30)
    assert engine.generate(ps, max_new_tokens=16) == hf_generate(model, ps, 16)
    assert engine.stats["preemptions"] > 0 and engine.stats["overlapped_steps"] > 0
    assert engine.blocks.num_free == engine.num_blocks


def test_blocks_filled_by_asynchronous_steps_are_shared_by_later_prompts(model, servable):
    """A block that an asynchronous step fills is registered for prefix caching once its tokens are read back:
    a second round whose prompts continue the first round's outputs reuses every full block of them, as many as
    the synchronous engine reuses, and generates HF's tokens."""
    ps = prompts(lengths=(5, 17, 9, 30, 2))
    hits = []
    for async_decode in (True, False):
        engine = engine_with_graphs(servable, async_decode=async_decode, num_blocks=400)
        out = engine.generate(ps, max_new_tokens=11)
        assert out == hf_generate(model, ps, 11)
        before = engine.blocks.prefix_hits
        again = [p + o for p, o in zip(ps, out)]
        assert engine.generate(again, max_new_tokens=5) == hf_generate(model, again, 5)
        hits.append(engine.blocks.prefix_hits - before)
    # every full block of prompt and output but the prompts' shared prefix, found again
    assert hits[0] == hits[1] >= sum((len(p) - 1) // 4 for p in again) - 2 * (20 // 4)


def test_sampled_requests_run_synchronous_steps(servable):
    """Counter-example: a step with a request sampled at a temperature reads its logits on the host, so no step
    starts before it is read; seeded sampling gives the synchronous engine's tokens."""
    ps = prompts(lengths=(5, 17, 9))[:3]
    results = []
    for async_decode in (True, False):
        engine = engine_with_graphs(servable, async_decode=async_decode)
        results.append(engine.generate(ps, max_new_tokens=6, temperature=0.8, seed=3))
        assert engine.stats["overlapped_steps"] == 0
    assert results[0] == results[1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA is not available)")
def test_on_a_gpu_a_step_starts_behind_the_previous_one_without_a_host_sync(monkeypatch):
    """On a GPU, once its graphs are captured, an engine starts each decode step from the device's tokens with no
    host synchronisation (``torch.cuda.set_sync_debug_mode("error")`` around the start: the token copy goes to
    pinned memory, the buffers' staging is not waited for), and generates HF's tokens."""
    pytest.importorskip("xformers", reason="xformers is not installed (pip install 'pagedattn[cuda]')")
    set_validation(False)  # full validation reads metadata on the host (steps run eagerly under it)
    try:
        model = tiny_llama("cuda", torch.float16)
        ps = prompts(lengths=(5, 17, 9))
        engine = PagedEngine(model, target="cuda", block_size=4, num_blocks=96, max_num_seqs=8, compile=False,
                             progress=False)
        assert engine.generate(ps, max_new_tokens=8) == hf_generate(model, ps, 8)  # captures every shape
        launch, started = PagedEngine._launch, []

        def no_sync(self, plan):
            if self._pending is None:
                return launch(self, plan)
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = launch(self, plan)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            started.append(out is not None)
            return out

        monkeypatch.setattr(PagedEngine, "_launch", no_sync)
        assert engine.generate(ps, max_new_tokens=8) == hf_generate(model, ps, 8)
    finally:
        set_validation(True)
    assert len(started) == 6 and all(started) and engine.decode_graphs.stats["captures"] > 0


@pytest.fixture(scope="module")
def engines(servable):
    """One synchronous engine (the reference) and asynchronous ones with caches of 16, 24 and 96 blocks over the
    file's one program, reused by every example."""
    return {"sync": engine_with_graphs(servable, async_decode=False, num_blocks=400),
            **{n: engine_with_graphs(servable, num_blocks=n) for n in (16, 24, 96)}}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(st.data())
def test_any_mix_of_joins_aborts_stops_limits_and_a_small_cache_gives_the_synchronous_tokens(engines, data):
    """Random serving loops: requests of random lengths and token limits join at random steps, some are aborted
    at random steps, stop tokens end some, a small cache preempts. Every request the asynchronous engine finishes
    has the tokens the synchronous engine gives it alone; an aborted one a prefix of them."""
    n = data.draw(st.integers(2, 6), label="requests")
    lengths = data.draw(st.lists(st.integers(1, 24), min_size=n, max_size=n), label="lengths")
    limits = data.draw(st.lists(st.integers(1, 10), min_size=n, max_size=n), label="limits")
    joins = data.draw(st.lists(st.integers(0, 8), min_size=n, max_size=n), label="join steps")
    aborts = data.draw(st.lists(st.one_of(st.none(), st.integers(1, 12)), min_size=n, max_size=n), label="aborts")
    engine = engines[data.draw(st.sampled_from([16, 24, 96]), label="blocks")]
    ps = prompts(seed=data.draw(st.integers(0, 3), label="seed"), lengths=lengths, shared=0)[:n]
    sync = engines["sync"]
    free = sync.generate(ps[:2], max_new_tokens=10)
    stops = tuple({o[len(o) // 2] for o in free if len(o) > 2})
    params = [SamplingParams(max_new_tokens=m, stop_token_ids=stops) for m in limits]
    want = [serve(sync, [(p, sp)])[0] for p, sp in zip(ps, params)]
    rids: dict[int, int] = {}
    step = 0
    while len(rids) < n or engine.has_unfinished():
        for i in range(n):
            if i not in rids and joins[i] <= step:
                rids[i] = engine.add_request(ps[i], params[i])
            if i in rids and aborts[i] == step:
                engine.abort(rids[i])
        engine.step()
        step += 1
    done = {r.request_id: r for r in engine.collect()}
    for i, rid in rids.items():
        got = done[rid]
        if got.finish_reason == "abort":
            assert want[i][0][:len(got.tokens)] == got.tokens
        else:
            assert (got.tokens, got.finish_reason) == want[i]
    assert engine.blocks.num_free == engine.num_blocks


def test_the_warm_up_through_the_graphs_buffers_leaves_an_engine_that_serves_as_a_fresh_one(model, servable,
                                                                                            monkeypatch):
    """The start-up warm-up a CUDA engine runs (``PagedEngine._warm_kinds``), here over the capture path's buffers
    with asynchronous decode steps: afterwards the same tokens, overlapped steps, blocks and graph statistics as an
    engine that did not warm up; its graphs' replays and eager steps counted from zero."""
    warm, fresh = engine_with_graphs(servable), engine_with_graphs(servable)
    runs, run = [], DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, ids, *a, **k: runs.append(isinstance(ids, DeviceTokens))
                        or run(self, ids, *a, **k))
    warm._warm_kinds(True, progress=False)
    assert True in runs and False in runs  # decode steps through the buffers, asynchronous ones among them
    monkeypatch.undo()
    assert warm.decode_graphs.stats["replays"] == warm.decode_graphs.stats["eager"] == 0
    assert warm.stats["steps"] == 0 and warm.blocks.num_free == warm.num_blocks
    ps = prompts(lengths=(5, 17, 9))
    assert warm.generate(ps, max_new_tokens=8) == fresh.generate(ps, max_new_tokens=8) == hf_generate(model, ps, 8)
    assert warm.stats["overlapped_steps"] == fresh.stats["overlapped_steps"] > 0
    assert {k: warm.decode_graphs.stats[k] for k in ("replays", "eager")} == \
        {k: fresh.decode_graphs.stats[k] for k in ("replays", "eager")}
    assert warm.blocks.prefix_hits == fresh.blocks.prefix_hits
