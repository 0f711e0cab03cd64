"""Decode steps planned together (``PagedEngine(plan_ahead=k)``): every ``step()`` of a run gives what the same step
planned on its own gives (tokens, streamed outputs, finish reasons, blocks and prefix-cache hits), and a run ends as
soon as anything changes (a request added, stopped, finished or aborted)."""

import pytest
import torch

import pagedattn
from pagedattn import PagedEngine, SamplingParams
from pagedattn.runtime.engine import TIMED_COUNTS, burst_steps

from ..support import engine_example, hf_generate, prompts, tiny_lfm2, tiny_model

NEW = 12


@pytest.fixture(scope="module")
def mistral():
    """A sliding-window model (window 6 in the tiny config: runs cross it), its HF tokens for ``prompts()`` and its
    rewrite."""
    m = tiny_model("mistral", "eager")
    return m, hf_generate(m, prompts(), NEW), pagedattn.rewrite(m, (), engine_example(m))


def _engine(rewritten, plan_ahead, **kw):
    kw = {"block_size": 4, "num_blocks": 96, **kw}
    return PagedEngine(rewritten, compile=False, progress=False, plan_ahead=plan_ahead, **kw)


def _serve(engine, requests, actions=None):
    """Step to the end; ``requests``: (prompt, SamplingParams) added first; ``actions``: {step: f(engine, ids)} run
    before that step. Returns every step's streamed outputs and finished requests, and the final counts."""
    ids = [engine.add_request(p, params) for p, params in requests]
    trace, step = [], 0
    while engine.has_unfinished():
        if actions and step in actions:
            actions[step](engine, ids)
        done = engine.step()
        trace.append((engine.unfinished_outputs(), [(r.request_id, r.tokens, r.finish_reason) for r in done]))
        step += 1
    trace.append(engine.collect())
    counts = {k: v for k, v in engine.stats.items()
              if isinstance(v, int) and k != "planned_steps" and k not in TIMED_COUNTS}
    return trace, counts, engine.blocks.prefix_hits, engine.blocks.num_free


def test_planned_steps_equal_hugging_face_and_single_steps(mistral):
    model, ref, rewritten = mistral
    planned = _engine(rewritten, 16)
    assert planned.generate(prompts(), max_new_tokens=NEW) == ref
    assert planned.stats["planned_steps"] > NEW // 2  # most decode steps ran from a plan
    single = _engine(rewritten, 1)
    assert single.generate(prompts(), max_new_tokens=NEW) == ref
    assert single.stats["planned_steps"] == 0  # counter-example: plan_ahead=1 plans nothing ahead
    assert planned.blocks.num_free == planned.num_blocks  # reserved blocks go back with their requests


@pytest.mark.parametrize("plan_ahead", [2, 3, 16])
def test_each_step_streams_as_a_single_step_does_through_stops_limits_adds_and_aborts(mistral, plan_ahead):
    """Requests of different token limits, one that stops on a token it generates mid-run, one sampled with a seed;
    a request added and another aborted between steps while a run is under way. Step by step, the streamed outputs,
    finished requests, statistics, blocks and prefix-cache hits are those of steps planned one at a time."""
    model, ref, rewritten = mistral
    ps = prompts()
    stop = ref[1][6]  # the 7th token request 1 generates: it stops there, inside a run
    requests = [(ps[0], SamplingParams(max_new_tokens=NEW)),
                (ps[1], SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,))),
                (ps[2], SamplingParams(max_new_tokens=5)),
                (ps[3], SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=20, seed=3)),
                (ps[4], SamplingParams(max_new_tokens=20))]
    late = ps[0] + ref[0][:8] + [5]  # shares the blocks request 0's run filled (prefix caching)
    actions = {7: lambda e, ids: e.abort(ids[4]),
               9: lambda e, ids: e.add_request(late, max_new_tokens=4)}
    planned = _serve(_engine(rewritten, plan_ahead), requests, actions)
    single = _serve(_engine(rewritten, 1), requests, actions)
    assert planned == single
    trace = planned[0]
    assert next(r for r in trace[-1] if r.request_id == 1).finish_reason == "stop"
    assert next(r for r in trace[-1] if r.request_id == 4).finish_reason == "abort"
    assert planned[2] > 0  # the late request found blocks registered by planned steps


@pytest.mark.parametrize("plan_ahead", [3, 16])
def test_steps_computed_ahead_stream_as_single_steps_through_stops_adds_and_aborts(mistral, plan_ahead):
    """Greedy runs computed as far ahead as a run goes (``burst_ms`` far above any step's time): a request that stops
    on a token inside a burst, one aborted and one added while a burst's later tokens wait to be given. Step by
    step, everything streamed, finished and counted is what steps planned one at a time give; the steps computed
    ahead and those dropped (the run ended under them) are counted."""
    model, ref, rewritten = mistral
    ps = prompts()
    stop = ref[1][6]
    requests = [(ps[0], SamplingParams(max_new_tokens=NEW)),
                (ps[1], SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,))),
                (ps[2], SamplingParams(max_new_tokens=5)),
                (ps[4], SamplingParams(max_new_tokens=20))]
    late = ps[0] + ref[0][:8] + [5]
    actions = {7: lambda e, ids: e.abort(ids[3]),
               11: lambda e, ids: e.add_request(late, max_new_tokens=4)}
    ahead = _engine(rewritten, plan_ahead, burst_ms=1e9)
    computed = _serve(ahead, requests, actions)
    assert computed == _serve(_engine(rewritten, 1), requests, actions)
    assert computed == _serve(_engine(rewritten, plan_ahead, burst_ms=0), requests, actions)
    assert next(r for r in computed[0][-1] if r.request_id == 1).finish_reason == "stop"
    assert ahead.stats["ahead_steps"] > 0 and ahead.stats["dropped_steps"] > 0
    # counter-example: with burst_ms=0 every step is computed by the step() that gives it
    one_by_one = _engine(rewritten, plan_ahead, burst_ms=0)
    one_by_one.generate(ps, max_new_tokens=NEW)
    assert one_by_one.stats["planned_steps"] > 0 and one_by_one.stats["ahead_steps"] == 0


def test_a_burst_ends_at_a_stop_token_and_drops_nothing(mistral):
    """A request's stop token ends the burst at its step: the run ends there anyway, so no step after it is
    computed for nothing."""
    model, ref, rewritten = mistral
    ps = prompts()
    requests = [(ps[0], SamplingParams(max_new_tokens=NEW)),
                (ps[1], SamplingParams(max_new_tokens=NEW, stop_token_ids=(ref[1][6],)))]
    ahead = _engine(rewritten, 16, burst_ms=1e9)
    assert _serve(ahead, requests) == _serve(_engine(rewritten, 1), requests)
    assert ahead.stats["ahead_steps"] > 0 and ahead.stats["dropped_steps"] == 0


def test_bursts_start_at_one_step_after_dropped_steps_and_grow_again(mistral):
    """Steps computed ahead and then dropped (a request aborted under them) make the next burst one step long; later
    bursts double again, up to the run's length."""
    rewritten = mistral[2]
    engine = _engine(rewritten, 16, burst_ms=1e9)
    ids = [engine.add_request(p, max_new_tokens=24) for p in prompts()[:3]]
    for _ in range(6):
        engine.step()
    engine.abort(ids[2])
    engine.step()
    assert engine.stats["dropped_steps"] > 0 and engine._burst_cap <= 2
    ahead = engine.stats["ahead_steps"]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats["ahead_steps"] > ahead  # bursts of more than one step again
    assert engine.blocks.num_free == engine.num_blocks


def test_steps_ahead_counts_the_steps_a_burst_computed_that_step_has_not_given(mistral):
    """``steps_ahead`` is what a timing of steps needs to start and end at a burst's edge: after a step that computed
    k steps ahead (``stats["ahead_steps"]`` grows by k) it is k, each later ``step()`` gives one of them without a
    burst of its own, and it is 0 once they are given, in runs that compute nothing ahead (a sampled request), and
    without a run."""
    rewritten = mistral[2]
    engine = _engine(rewritten, 16, burst_ms=1e9)
    assert engine.steps_ahead == 0
    for p in prompts()[:3]:
        engine.add_request(p, max_new_tokens=24)
    seen = []
    while engine.has_unfinished():
        left, computed = engine.steps_ahead, engine.stats["ahead_steps"]
        engine.step()
        grew = engine.stats["ahead_steps"] - computed
        if left:  # a step computed earlier, given now
            assert grew == 0 and engine.steps_ahead == left - 1
        else:  # this step ran the model, and a burst's later steps wait for the next calls
            assert engine.steps_ahead == grew
        seen.append(engine.steps_ahead)
    assert max(seen) > 1 and seen[-1] == 0  # bursts of several steps, all given by the end
    sampled = _engine(rewritten, 16, burst_ms=1e9)
    sampled.add_request(prompts()[0], max_new_tokens=NEW, temperature=0.8, seed=1)
    while sampled.has_unfinished():
        sampled.step()
        assert sampled.steps_ahead == 0  # counter-example: a sampled run computes each step as it is given
    assert sampled.stats["planned_steps"] > 0


def test_a_run_whose_requests_are_all_aborted_ends_with_them(mistral):
    # aborting every request of a run that computed steps ahead leaves nothing ahead and no run (the run, its
    # requests and its computed steps stayed until the next step() call, steps_ahead still counting them); aborting
    # one of two ends the run as well, and the other request's tokens stay Hugging Face's
    _, ref, rewritten = mistral
    engine = _engine(rewritten, 16, burst_ms=1e9)
    ids = [engine.add_request(p, max_new_tokens=24) for p in prompts()[:2]]
    while engine.steps_ahead == 0:
        engine.step()
    ahead = engine.steps_ahead
    for rid in ids:
        engine.abort(rid)
    assert not engine.has_unfinished() and engine.steps_ahead == 0 and engine.stats["dropped_steps"] == ahead
    assert engine.blocks.num_free == 96
    engine = _engine(rewritten, 16, burst_ms=1e9)
    ids = [engine.add_request(p, max_new_tokens=NEW) for p in prompts()[:2]]
    while engine.steps_ahead == 0:
        engine.step()
    engine.abort(ids[0])
    assert engine.steps_ahead == 0
    done = {}
    while engine.has_unfinished():
        done.update({r.request_id: r.tokens for r in engine.step()})
    assert done[ids[1]] == ref[1]


def test_a_run_with_a_sampled_request_computes_nothing_ahead(mistral):
    """A sampled token draws from its request's generator: drawing ahead for a step the run may drop would change the
    tokens sampled after it, so such runs compute each step as it is given."""
    rewritten = mistral[2]
    engine = _engine(rewritten, 16, burst_ms=1e9)
    engine.generate(prompts()[:3], max_new_tokens=NEW, temperature=0.8, seed=1)
    assert engine.stats["planned_steps"] > 0 and engine.stats["ahead_steps"] == 0


def test_burst_steps_fit_the_budget_within_bounds():
    assert burst_steps(0.02, 0.0021, 16, 16) == 9
    assert burst_steps(0.02, 0.0021, 5, 16) == 5  # the steps the run has left
    assert burst_steps(0.02, 0.0021, 16, 2) == 2  # the cap after dropped steps
    assert burst_steps(0.02, 0.05, 16, 16) == 1  # a step longer than the budget: one at a time
    assert burst_steps(0.02, None, 16, 16) == 1  # nothing measured yet
    assert burst_steps(0.0, 0.001, 16, 16) == 1


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "20", True, None])
def test_bad_burst_ms_is_named(mistral, bad):
    with pytest.raises(ValueError, match="burst_ms must be"):
        _engine(mistral[2], 16, burst_ms=bad)


def test_a_run_ends_when_a_request_arrives_and_it_is_admitted_at_the_next_step(mistral):
    _, _, rewritten = mistral
    engine = _engine(rewritten, 16)
    ps = prompts()
    engine.add_request(ps[0], max_new_tokens=30)
    while engine.stats["planned_steps"] < 2:
        engine.step()
    assert engine._run is not None and engine._run.taken < len(engine._run.metas)
    rid = engine.add_request(ps[1], max_new_tokens=2)
    engine.step()
    assert any(r.id == rid for r in engine.scheduler.running)  # its prompt ran in this step, not after the run
    assert len(engine.unfinished_outputs()[rid]) == 1


def test_no_run_without_free_blocks_for_all_its_steps(mistral):
    """Two requests in a cache with room for their next tokens but not for a run's (blocks of 4: a run from position
    3 would take two more blocks each, three are free): their steps are scheduled one at a time, nothing is preempted
    to make room for a plan, and every step is a single step's, through the preemption the cache forces later."""
    rewritten = mistral[2]
    requests = [([1, 2, 3], SamplingParams(max_new_tokens=10)), ([4, 5, 6], SamplingParams(max_new_tokens=10))]
    engine = _engine(rewritten, 16, num_blocks=5)
    engine.add_request(*requests[0])
    engine.add_request(*requests[1])
    engine.step()
    engine.step()  # the first decode step: no room for a run
    assert engine.stats["planned_steps"] == 0 and engine._run is None and engine.blocks.num_free == 3
    planned = _serve(_engine(rewritten, 16, num_blocks=5), requests)
    single = _serve(_engine(rewritten, 1, num_blocks=5), requests)
    assert planned == single and planned[1]["preemptions"] > 0


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, None])
def test_bad_plan_ahead_is_named(mistral, bad):
    with pytest.raises(ValueError, match="plan_ahead must be an int >= 1"):
        _engine(mistral[2], bad)


def test_models_with_recurrent_state_plan_nothing_ahead():
    # their steps run as rows: plan_ahead does not apply (and asks for nothing)
    model = tiny_lfm2()
    engine = PagedEngine(model, compile=False, progress=False)
    assert engine.plan_ahead == 1
    engine.generate([[3, 4, 5]], max_new_tokens=4)
    assert engine.stats["planned_steps"] == 0


def test_planned_tokens_match_a_float32_reference_past_a_block_boundary():
    """Greedy decoding by the model's own forward (no cache at all), across several runs and many block boundaries
    (blocks of 2 tokens)."""
    model = tiny_model("llama", "eager")
    p = prompts()[0]
    ids = torch.tensor([p])
    with torch.no_grad():
        for _ in range(20):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    engine = PagedEngine(model, compile=False, progress=False, block_size=2, num_blocks=64, plan_ahead=5)
    assert engine.generate([p], max_new_tokens=20) == [ids[0, len(p):].tolist()]
    assert engine.stats["planned_steps"] >= 15
