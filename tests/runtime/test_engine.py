"""PagedEngine against Hugging Face generate, token for token."""

import pytest
import torch

import pagedattn
from pagedattn import PagedEngine, RequestErrors

from ..rewriter.hf_models import TINY, tiny_model

ARCHS = sorted(TINY)  # 11 architectures
NEW = 10


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 2)]
    shared = torch.randint(0, 128, (20,), generator=g).tolist()
    return prompts + [shared + [7, 8], shared + [9]]  # the last two share a 20-token prefix


def _reference(model, prompts, new=NEW):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                               do_sample=False, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(arch):
        if arch not in cache:
            m = tiny_model(arch, "eager")
            cache[arch] = (m, _reference(m, _prompts()), pagedattn.rewrite(
                m, (), _example(m)))
        return cache[arch]

    return get


def _example(m):
    from pagedattn.runtime.engine import _accepted, _example_kwargs

    return _example_kwargs(_accepted(m), 128)


SETTINGS = {
    "default": dict(),
    "chunked_prefill": dict(max_num_tokens=8),
    "preemption": dict(num_blocks=14, block_size=4),  # far too small for the whole batch
    "swap": {"num_blocks": 14, "block_size": 4, "preemption_mode": "swap"},  # the same, preempting by swapping
    "tiny_blocks_tiny_budget": dict(block_size=4, max_num_tokens=4),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_equals_hf_generate(arch, setting, models):
    model, ref, rewritten = models(arch)
    engine = PagedEngine(rewritten, **SETTINGS[setting])
    got = engine.generate(_prompts(), max_new_tokens=NEW)
    assert got == ref
    if setting == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if setting == "swap":  # host space for every victim: nothing recomputed
        assert engine.stats["swap_outs"] > 0 and engine.stats["recomputes"] == 0
    if setting != "default":
        assert engine.blocks.prefix_hits > 0  # the shared prefix was reused


def test_engine_rewrites_an_nn_module_itself():
    m = tiny_model("qwen2", "eager")
    prompts = _prompts()[:3]
    assert PagedEngine(m).generate(prompts, max_new_tokens=6) == _reference(m, prompts, 6)


def test_sampling_is_seeded():
    m = tiny_model("llama", "eager")
    engine = PagedEngine(m)
    a = engine.generate(_prompts()[:3], max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=1)
    b = engine.generate(_prompts()[:3], max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=1)
    c = engine.generate(_prompts()[:3], max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=2)
    assert a == b and a != c


def test_stop_tokens_end_a_request():
    m = tiny_model("llama", "eager")
    prompt = _prompts()[1]
    ref = _reference(m, [prompt])[0]
    stop = ref[3]
    (got,) = PagedEngine(m).generate([prompt], max_new_tokens=NEW, stop_token_ids=[stop])
    assert got == ref[: ref.index(stop) + 1]


def test_step_api_streams():
    m = tiny_model("gpt2", "eager")
    engine = PagedEngine(m, max_num_tokens=16)
    ids = [engine.add_request(p, max_new_tokens=4) for p in _prompts()[:4]]
    finished, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            finished[out.request_id] = out
        steps += 1
    assert sorted(finished) == ids and all(len(o.tokens) == 4 and o.finish_reason == "length" for o in finished.values())
    assert steps > 4  # prefills were split across steps by the token budget


def test_bad_requests_are_named_and_others_go_on():
    m = tiny_model("llama", "eager")
    engine = PagedEngine(m, num_blocks=8, block_size=4)
    good = _prompts()[0]
    with pytest.raises(RequestErrors) as e:
        engine.generate([good, [], list(range(100)), [5, 999], good], max_new_tokens=4)
    msg = str(e.value)
    assert "request 1" in msg and "empty" in msg
    assert "request 2" in msg and "blocks" in msg
    assert "request 3" in msg and "vocabulary" in msg
    ref = _reference(m, [good], 4)[0]
    assert e.value.results[0] == ref and e.value.results[4] == ref
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request(good, max_new_tokens=0)


def test_memory_budget_sizes_the_cache():
    m = tiny_model("llama", "eager")
    engine = PagedEngine(m, memory=1 << 20)
    per_block = sum(2 * 16 * s["num_kv_heads"] * s["head_size"] * 4 for s in engine.cache_specs)
    assert engine.num_blocks == (1 << 20) // per_block
    assert engine.kv_bytes <= 1 << 20


def test_compiled_model_through_engine():
    torch._dynamo.reset()
    m = tiny_model("llama", "eager")
    prompts = _prompts()[:3]
    ref = _reference(m, prompts, 6)
    compiled = torch.compile(m, backend="pagedattn", options={"inner": "eager"})
    assert PagedEngine(compiled).generate(prompts, max_new_tokens=6) == ref
    torch._dynamo.reset()
