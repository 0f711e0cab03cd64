"""PagedEngine against Hugging Face generate, token for token.

The engine's settings (chunked prefill, preemption by recompute or swap, tiny blocks and budgets, prefix
caching) run on three architectures whose attention differs where those settings bite: sliding windows
(Mistral; Gemma 2 alternating with full layers, soft-capped), and ALiBi without position ids (BLOOM).
Every architecture's plain serving is the zoo slice's (``tests/rewriter/test_zoo.py``).
"""

import pytest
import torch

import pagedattn
from pagedattn import PagedEngine, RequestErrors
from pagedattn.adapter import accepted_inputs
from pagedattn.backends import set_validation
from pagedattn.runtime.engine import TIMED_COUNTS

from ..rewriter import zoo
from ..support import engine_example, hf_generate, prompts, tiny_model

NEW = 10
SETTING_ARCHS = ["bloom", "gemma2", "mistral"]

SETTINGS = {
    "default": dict(),
    "chunked_prefill": dict(max_num_tokens=8),
    "preemption": dict(num_blocks=14, block_size=4),  # far too small for the whole batch
    "swap": {"num_blocks": 14, "block_size": 4, "preemption_mode": "swap"},  # the same, preempting by swapping
    "tiny_blocks_tiny_budget": dict(block_size=4, max_num_tokens=4),
}


@pytest.fixture(scope="module")
def models():
    """arch -> (model, its HF greedy tokens for ``prompts()``, the model rewritten as the engine would)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            m = tiny_model(arch, "eager")
            cache[arch] = (m, hf_generate(m, prompts(), NEW), pagedattn.rewrite(m, (), engine_example(m)))
        return cache[arch]

    return get


def _first(ref, n):
    """The first ``n`` tokens of each greedy generation (a shorter greedy run is a prefix of a longer one)."""
    return [r[:n] for r in ref]


@pytest.mark.parametrize("arch", SETTING_ARCHS)
@pytest.mark.parametrize("setting", ["default", "preemption"])
def test_greedy_equals_hf_generate_on_the_hot_path(arch, setting, models):
    # validation off, as users run: each step's layers take the ops' prepared calls (backends/ops.py), alternating
    # between window and full layers (Gemma 2), never for ALiBi's slopes (BLOOM: parameters holding tensors)
    model, ref, rewritten = models(arch)
    set_validation(False)
    try:
        assert PagedEngine(rewritten, compile=False, **SETTINGS[setting]).generate(prompts(), max_new_tokens=NEW) == ref
    finally:
        set_validation(True)


@pytest.mark.parametrize("arch", SETTING_ARCHS)
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_equals_hf_generate(arch, setting, models):
    model, ref, rewritten = models(arch)
    engine = PagedEngine(rewritten, compile=False, **SETTINGS[setting])
    got = engine.generate(prompts(), max_new_tokens=NEW)
    assert got == ref
    if setting == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if setting == "swap":  # host space for every victim: nothing recomputed
        assert engine.stats["swap_outs"] > 0 and engine.stats["recomputes"] == 0
    if setting != "default":
        assert engine.blocks.prefix_hits > 0  # the shared prefix was reused


def test_phi_outside_the_zoo_slice(models):
    # partial rotary; the one architecture of hf_models.TINY that the zoo slice does not serve
    _, ref, rewritten = models("phi")
    assert PagedEngine(rewritten, compile=False).generate(prompts(), max_new_tokens=NEW) == ref


def test_engine_rewrites_an_nn_module_itself():
    m = tiny_model("qwen2", "eager")
    ps = prompts()[:3]
    engine = PagedEngine(m, compile=False)
    assert isinstance(engine.model, pagedattn.RewrittenModel) and engine.model is engine.servable.step
    assert engine.generate(ps, max_new_tokens=6) == hf_generate(m, ps, 6)


def test_sampling_is_seeded(llama):
    engine = PagedEngine(llama[2], compile=False)
    a = engine.generate(prompts()[:3], max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=1)
    b = engine.generate(prompts()[:3], max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=1)
    c = engine.generate(prompts()[:3], max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=2)
    assert a == b and a != c


def test_stop_tokens_end_a_request(llama):
    _, ref, rewritten = llama
    ref = ref[1][:NEW]
    stop = ref[3]
    (got,) = PagedEngine(rewritten, compile=False).generate([prompts()[1]], max_new_tokens=NEW, stop_token_ids=[stop])
    assert got == ref[: ref.index(stop) + 1]


def test_step_api_streams():
    m = tiny_model("gpt2", "eager")
    engine = PagedEngine(m, compile=False, max_num_tokens=16)
    ids = [engine.add_request(p, max_new_tokens=4) for p in prompts()[:4]]
    finished, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            finished[out.request_id] = out
        steps += 1
    assert sorted(finished) == ids and all(len(o.tokens) == 4 and o.finish_reason == "length" for o in finished.values())
    assert steps > 4  # prefills were split across steps by the token budget


def test_bad_requests_are_named_and_others_go_on(llama):
    _, ref, rewritten = llama
    engine = PagedEngine(rewritten, compile=False, num_blocks=8, block_size=4)
    good = prompts()[0]
    with pytest.raises(RequestErrors) as e:
        engine.generate([good, [], list(range(100)), [5, 999], good], max_new_tokens=4)
    msg = str(e.value)
    assert "request 1" in msg and "empty" in msg
    assert "request 2" in msg and "blocks" in msg
    assert "request 3" in msg and "vocabulary" in msg
    assert e.value.results[0] == ref[0][:4] and e.value.results[4] == ref[0][:4]
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request(good, max_new_tokens=0)


def test_requests_past_the_length_the_masks_are_established_for_are_refused_when_added(llama):
    # the tiny Llama's masks are proven up to its max_position_embeddings: a request that would grow past it
    # is refused with the site and the length named (it failed inside a step before, taking its step's other
    # requests with it), and a request ending exactly at the limit is served
    _, ref, rewritten = llama
    engine = PagedEngine(rewritten, compile=False)
    top, site, how = engine.length_limit()
    assert top == 256 and how == "proof", (top, how)

    def tokens(n):
        return [1 + i % 100 for i in range(n)]

    good = prompts()[0]
    with pytest.raises(RequestErrors) as e:  # top - 2 tokens + 3 new: the last new token is never attended
        engine.generate([good, tokens(top), tokens(top - 2)], max_new_tokens=3)
    msg = str(e.value)
    assert "request 1" in msg and f"reach {top + 2} positions" in msg and f"up to {top}" in msg and site in msg
    assert "request 2" not in msg and len(e.value.results[2]) == 3
    assert e.value.results[0] == ref[0][:3]


def test_memory_budget_sizes_the_cache(llama):
    engine = PagedEngine(llama[2], compile=False, memory=1 << 20)
    per_block = sum(2 * 16 * s.num_kv_heads * s.head_size * 4 for s in engine.cache_specs)
    assert per_block == engine.servable.bytes_per_block()
    assert engine.num_blocks == (1 << 20) // per_block
    assert engine.kv_bytes <= 1 << 20


def test_compiled_model_through_engine(llama, fresh_dynamo):
    m, ref, _ = llama
    compiled = torch.compile(m, backend="pagedattn", options={"inner": "eager"})
    with torch.no_grad():
        compiled(**engine_example(m))  # compiled first ...
        other = torch.compile(zoo.MQABroadcast().eval(), backend="pagedattn", options={"inner": "eager"})
        other(*zoo.example_args("mqa_broadcast"))  # ... then another model, with one kv head
    # the engine learns the caches from the compiled model's own graphs, not from the last one compiled
    engine = PagedEngine(compiled, compile=False)
    assert engine.model is compiled and engine.servable.input_names == accepted_inputs(m)
    assert [(s.num_kv_heads, s.head_size) for s in engine.cache_specs] == [(2, 8), (2, 8)]
    ps = prompts()[:3]
    assert engine.generate(ps, max_new_tokens=6) == _first(ref[:3], 6)
    with pytest.raises(ValueError, match="compile=True applies to models the engine rewrites"):
        PagedEngine(compiled, compile=True)


def test_inductor_compiled_engine_matches_hf(llama):
    # compile=True: the paged graph through Inductor, once for every step shape (dynamic)
    m, ref, _ = llama
    engine = PagedEngine(m, compile=True, block_size=4, max_num_tokens=16)
    assert engine.generate(prompts(), max_new_tokens=6) == _first(ref, 6)


def test_a_serving_loop_runs_its_packed_steps_through_the_call_bound_to_its_caches(models, monkeypatch):
    # the engine binds its packed step to its caches once (ServableModel.packed_call): no step enters paged_context,
    # and the tokens are the model's
    from pagedattn import adapter

    _, ref, rewritten = models("mistral")
    engine = PagedEngine(rewritten, compile=False)
    assert engine._packed_call is not None
    entered = []
    context = adapter.paged_context
    monkeypatch.setattr(adapter, "paged_context", lambda *a, **k: entered.append(1) or context(*a, **k))
    assert engine.generate(prompts(), max_new_tokens=NEW) == ref
    assert not entered and engine.stats["steps"] > 1


def test_generate_runs_its_steps_in_one_frame_and_one_binding(models, monkeypatch):
    # generate runs all its steps inside one spacer frame (pagedattn.runtime.frames: the steps' cost never depends on
    # how deep the caller's stack is) and with the backend bound once (PagedEngine.bound, not once a step); a step
    # called on its own gets a frame and a binding of its own; the tokens are the same either way
    from pagedattn.backends import native_ops
    from pagedattn.runtime import frames

    _, ref, rewritten = models("mistral")
    engine = PagedEngine(rewritten, compile=False)
    spacers, binds = [], []
    spacer, bind = frames._spacer, native_ops.bind_backend
    monkeypatch.setattr(frames, "_spacer", lambda fn: spacers.append(fn) or spacer(fn))
    monkeypatch.setattr(native_ops, "bind_backend", lambda backend, outer=None: binds.append(backend) or bind(backend, outer))
    assert engine.generate(prompts(), max_new_tokens=NEW) == ref
    assert len(spacers) == 1 and binds == [engine.backend] and engine.stats["steps"] > 1
    engine.add_request(prompts()[0], max_new_tokens=2)
    calls = 0
    while engine.has_unfinished():
        engine.step()
        calls += 1
    assert calls >= 2 and len(spacers) == 1 + calls and len(binds) == 1 + calls


def test_warm_up_serves_each_step_kind_once_and_leaves_nothing_behind(models, monkeypatch):
    """``warm_up=True`` (the default on CUDA) serves a fresh prompt and its decodes, then one step holding decodes
    and chunks over cached prefixes beside fresh prompts; the engine then serves as one that never warmed up:
    the same tokens (Hugging Face's), statistics, request ids, blocks and prefix-cache hits (none on the warm-up's
    own prompt)."""
    from pagedattn.runtime.engine import PagedEngine as Engine

    model, ref, rewritten = models("mistral")
    bs = 4
    steps = []
    run = Engine._run_packed
    monkeypatch.setattr(Engine, "_run_packed",
                        lambda self, plan: steps.append([(c.start, c.num_tokens) for c in plan]) or run(self, plan))
    planned = Engine._run_step  # decode steps planned together (plan_ahead)
    monkeypatch.setattr(Engine, "_run_step", lambda self, r, t0: steps.append(
        [(s + r.taken, 1) for s in r.starts]) or planned(self, r, t0))
    warm = PagedEngine(rewritten, compile=False, block_size=bs, num_blocks=64, warm_up=True, progress=False)
    assert [(0, 2 * bs + 3)] in steps
    assert [(2 * bs, 1), (2 * bs, 1), (2 * bs, 3), (2 * bs, 3), (0, bs + 1), (0, bs + 2)] in steps
    assert any(all(n == 1 for _, n in s) for s in steps)  # decode-only steps
    steps.clear()
    cold = PagedEngine(rewritten, compile=False, block_size=bs, num_blocks=64, warm_up=None, progress=False)
    assert steps == []  # counter-example: not on the CPU by default

    def serve(engine):
        ids = [engine.add_request(p, max_new_tokens=NEW) for p in prompts()]
        again = engine.add_request([1] * (2 * bs + 3), max_new_tokens=2)  # the warm-up's own prompt
        engine.step()
        tables = [list(r.table.blocks) for r in engine.scheduler.running]  # the blocks handed out first
        while engine.has_unfinished():
            engine.step()
        out = {r.request_id: r.tokens for r in engine.collect()}
        counts = {k: v for k, v in engine.stats.items() if isinstance(v, int) and k not in TIMED_COUNTS}  # not times
        return ids + [again], [out[i] for i in ids], counts, engine.blocks.prefix_hits, tables

    warm_served, cold_served = serve(warm), serve(cold)
    warm_ids, warm_out = warm_served[:2]
    assert warm_out == ref and warm_served == cold_served
    assert warm_ids[0] == 0 and warm.blocks.num_free == warm.num_blocks


def test_warm_up_where_it_cannot_run_says_why(models):
    _, _, rewritten = models("mistral")
    with pytest.raises(ValueError, match="prefix caching is off"):
        PagedEngine(rewritten, compile=False, enable_prefix_caching=False, warm_up=True, progress=False)
    with pytest.raises(ValueError, match="needs 4 blocks but the cache has 3"):  # a request it would refuse
        PagedEngine(rewritten, compile=False, block_size=4, num_blocks=3, warm_up=True, progress=False)
