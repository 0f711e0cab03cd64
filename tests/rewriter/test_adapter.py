"""``prepare_model``: a plain, rewritten or compiled model becomes a ``ServableModel`` for the engine, or is
refused saying why (tokens that influence each other outside attention, nothing to page, ...).

A compiled model served (its caches from its own graphs, not another model's) is
tests/runtime/test_engine.py::test_compiled_model_through_engine.
"""

import dataclasses

import pytest
import torch
from torch import nn

import pagedattn
from pagedattn import PagedEngine
from pagedattn.adapter import ServableModel, accepted_inputs, example_inputs, prepare_model
from pagedattn.backends import CacheSpec, build_metadata, get_backend

from ..support import VOCAB, greedy_by_forward, tiny_model
from . import zoo

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5]]


class _LM(nn.Module):
    """Embeddings (tokens and positions), optionally a causal convolution, NanoGPT attention, a head."""

    def __init__(self, conv: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos = nn.Embedding(64, zoo.C), nn.Embedding(128, zoo.C)
        self.conv = nn.Conv1d(zoo.C, zoo.C, 2) if conv else None
        self.attn = zoo.NanoGPT()
        self.head = nn.Linear(zoo.C, 64)

    def logits(self, input_ids, position_ids):
        x = self.emb(input_ids) + self.pos(position_ids)
        if self.conv is not None:  # a causal convolution along the row: state outside attention
            x = x + self.conv(nn.functional.pad(x.transpose(1, 2), (1, 0))).transpose(1, 2)
        return self.head(self.attn(x))


class PlainLM(_LM):
    def forward(self, input_ids, position_ids):
        return self.logits(input_ids, position_ids)


class ConvLM(PlainLM):
    def __init__(self):
        super().__init__(conv=True)


class IndexPositionsLM(_LM):
    """Positions from the token's index in the row; no position_ids input."""

    def forward(self, input_ids):
        return self.logits(input_ids, torch.arange(input_ids.shape[1])[None])


class KwargsPositionsLM(_LM):
    """Positions arrive through ``**kwargs`` (Hugging Face's decoder-only wrappers pass them on that way)."""

    def __init__(self, honour=True):
        super().__init__()
        self.honour = honour

    def forward(self, input_ids, **kwargs):
        pos = kwargs.get("position_ids") if self.honour else None
        return self.logits(input_ids, pos if pos is not None else torch.arange(input_ids.shape[1])[None])


class RouterLM(nn.Module):
    """A softmax, but no attention: nothing to page."""

    def __init__(self):
        super().__init__()
        self.emb, self.router, self.head = nn.Embedding(64, zoo.C), zoo.Router(), nn.Linear(zoo.C, 64)

    def forward(self, input_ids):
        return self.head(self.router(self.emb(input_ids)))


# --------------------------------------------------------------------------- what is served


def test_plain_model_is_served():
    m = PlainLM().eval()
    engine = PagedEngine(m, compile=False, block_size=4)
    assert engine.servable.input_names == {"input_ids", "position_ids"}
    assert engine.generate(PROMPTS, max_new_tokens=5) == greedy_by_forward(m, PROMPTS, 5, positions=True)


def test_prepare_a_hugging_face_model():
    m = tiny_model("llama")
    sv = prepare_model(m, target="cpu", block_size=8)
    assert isinstance(sv, ServableModel) and isinstance(sv.step, pagedattn.RewrittenModel)
    assert sv.input_names == {"input_ids", "position_ids", "use_cache", "logits_to_keep"}
    assert sv.backend is get_backend("cpu") and sv.device == torch.device("cpu") and sv.block_size == 8
    assert sv.cache_specs == tuple(CacheSpec(r["name"], 2, 8, torch.float32) for r in sv.step.report)
    assert sv.cache_dtype == torch.float32 and sv.vocab_size == VOCAB
    assert sv.eos_ids == {m.generation_config.eos_token_id} and sv.state is None and sv.fresh_step is None
    assert sv.bytes_per_block() == 2 * 2 * 8 * 8 * 4 * 2  # K and V, 8 tokens, 2 kv heads of 8, fp32, 2 layers
    # two sequences packed in one step give each its own forward's last logits
    caches = sv.allocate_kv_caches(4)
    a, b = [5, 9, 3, 11, 2], [7, 1, 4]
    meta = build_metadata([(0, len(a), [0]), (0, len(b), [2])], 8)
    got = sv.run_packed(caches, meta, a + b, list(range(len(a))) + list(range(len(b))), [len(a) - 1, len(a) + len(b) - 1])
    with torch.no_grad():
        want = [m(input_ids=torch.tensor([p]), use_cache=False).logits[0, -1] for p in (a, b)]
    torch.testing.assert_close(got, torch.stack(want), atol=2e-5, rtol=1e-4)


def test_a_packed_call_gives_what_the_paged_context_gives():
    """The step bound once to its caches (``packed_call``) computes what the call through ``paged_context`` does,
    writes the same K/V, and refuses what the context would: other caches, metadata of another block size, inputs
    in another order."""
    m = tiny_model("llama")
    sv = prepare_model(m, target="cpu", block_size=8)
    a, b = [5, 9, 3, 11, 2], [7, 1, 4]
    meta = build_metadata([(0, len(a), [0]), (0, len(b), [2])], 8)
    ids, pos, rows = a + b, list(range(len(a))) + list(range(len(b))), [len(a) - 1, len(a) + len(b) - 1]
    out = {}
    for how in ("context", "call"):
        caches = sv.allocate_kv_caches(4)
        call = sv.packed_call(caches) if how == "call" else None
        assert how == "context" or call is not None
        out[how] = sv.run_packed(caches, meta, ids, pos, rows, call=call), caches
    torch.testing.assert_close(out["call"][0], out["context"][0], rtol=0, atol=0)
    for x, y in zip(out["call"][1], out["context"][1]):
        assert torch.equal(x, y)
    caches = sv.allocate_kv_caches(4)
    call = sv.packed_call(caches)
    other = sv.allocate_kv_caches(4)  # a call made for other caches: the step runs through the context
    torch.testing.assert_close(sv.run_packed(other, meta, ids, pos, rows, call=call), out["context"][0], rtol=0, atol=0)
    assert all(not c.any() for c in caches)
    kwargs = sv.packed_inputs(ids, pos, rows)
    with pytest.raises(ValueError, match="blocks of 8 tokens"):
        call(kwargs, build_metadata([(0, len(a), [0, 1]), (0, len(b), [2])], 4))
    with pytest.raises(TypeError, match="keyword inputs"):
        call(dict(reversed(list(kwargs.items()))), meta)
    with pytest.raises(ValueError, match="2 attention sites but 1 KV caches"):
        sv.step.paged_call(caches[:1])


def test_no_packed_call_where_a_step_takes_more_than_caches_and_metadata(llama):
    rm = llama[2]
    sv = prepare_model(rm)
    assert sv.packed_call(sv.allocate_kv_caches(4)) is not None
    assert rm.paged_call(sv.allocate_kv_caches(4), output="no such output") is None
    with_values = dataclasses.replace(sv, values=object())  # masks reading per-request values: the context's path
    assert with_values.packed_call(sv.allocate_kv_caches(4)) is None


def test_prepare_a_rewritten_model(llama):
    rm = llama[2]
    sv = prepare_model(rm, eos_token_id=[3, 4])
    assert sv.step is rm and sv.input_names == rm.input_names and sv.cache_specs == tuple(rm.cache_specs)
    assert sv.eos_ids == {3, 4} and sv.vocab_size == rm.info.vocab_size == VOCAB
    assert PagedEngine(sv, compile=False).servable is sv  # a ServableModel is served as it is


class TwoGraphs(nn.Module):
    """Attention on both sides of a graph break: two compiled graphs per step."""

    def __init__(self):
        super().__init__()
        self.lm = PlainLM()
        self.second = zoo.NanoGPT()

    def forward(self, input_ids, position_ids):
        x = self.lm.emb(input_ids) + self.lm.pos(position_ids)
        x = self.lm.attn(x)
        torch._dynamo.graph_break()
        return self.lm.head(self.second(x))


def test_a_compiled_model_with_attention_in_two_graphs_is_refused(fresh_dynamo):
    compiled = torch.compile(TwoGraphs().eval(), backend="pagedattn", options={"inner": "eager"})
    with pytest.raises(ValueError, match="runs its attention in 2 graphs"):
        prepare_model(compiled)


def test_inputs_the_model_takes():
    m = tiny_model("llama")
    names = accepted_inputs(m)
    assert names == {"input_ids", "position_ids", "use_cache", "logits_to_keep"}
    kw = example_inputs(names, VOCAB)
    assert kw["input_ids"].shape == kw["position_ids"].shape == (1, 8) and kw["use_cache"] is False
    assert not torch.equal(kw["input_ids"][0, 1:] - kw["input_ids"][0, :-1], torch.ones(7, dtype=torch.long))
    assert kw["logits_to_keep"].tolist() == [7, 3]
    assert set(example_inputs({"input_ids"}, VOCAB)) == {"input_ids"}


# ------------------------------------------------------------------------------ refusals


def test_state_outside_attention_is_refused():
    with pytest.raises(ValueError, match="outside attention"):
        PagedEngine(ConvLM().eval(), compile=False)


def test_nothing_to_page_is_refused():
    with pytest.raises(ValueError, match="no rewritten attention sites: nothing to page"):
        prepare_model(RouterLM().eval())


def test_a_model_on_another_device_is_refused():
    pytest.importorskip("xformers", reason="the cuda backend needs xformers to load")
    with pytest.raises(ValueError, match="move the model first"):
        prepare_model(PlainLM().eval(), target="cuda")


def test_positions_from_the_row_index_are_made_per_sequence():
    # the rewrite turns arange(T) feeding the position embedding into each packed sequence's positions
    m = IndexPositionsLM().eval()
    got = PagedEngine(m, compile=False, block_size=4).generate(PROMPTS, max_new_tokens=4)
    assert got == greedy_by_forward(m, PROMPTS, 4)


def test_positions_through_kwargs_are_passed():
    m = KwargsPositionsLM().eval()
    engine = PagedEngine(m, compile=False, block_size=4)
    assert "position_ids" in engine.servable.input_names  # found by probing: shifted positions change the logits
    assert engine.generate(PROMPTS, max_new_tokens=4) == greedy_by_forward(m, PROMPTS, 4)


def test_kwargs_that_ignore_positions_are_not_passed():
    m = KwargsPositionsLM(honour=False).eval()
    assert "position_ids" not in accepted_inputs(m)
    engine = PagedEngine(m, compile=False, block_size=4)
    assert "position_ids" not in engine.servable.input_names


def test_segment_embeddings_are_not_taken_for_a_prefix_lms_token_types(caplog):
    """BERT-style causal LMs take ``token_type_ids`` as segment embeddings: all of one type computes what no
    types do, and mixed types change the output, as for a prefix-LM; but one token of the other type changes
    its own output, which a mask over spans (a span of one token is causal attention) never does. They are not
    traced, no warning is logged, and the engine serves the model as generate does."""
    from transformers import BertConfig, BertLMHeadModel

    from ..support import hf_generate, prompts

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, is_decoder=True, max_position_embeddings=128)
    torch.manual_seed(0)
    model = BertLMHeadModel(cfg).eval()
    assert "token_type_ids" not in accepted_inputs(model)
    with caplog.at_level("WARNING"):
        engine = PagedEngine(model, block_size=4, num_blocks=64, compile=False, progress=False)
    assert not [r for r in caplog.records if "token types" in r.getMessage()]
    ps = prompts(lengths=(5, 17, 9))
    assert engine.generate(ps, max_new_tokens=6) == hf_generate(model, ps, 6)


def test_long_bfloat16_prompts_through_sdpas_kernel_give_the_models_own_logits(monkeypatch):
    # with AMX (taken as present here), a bfloat16 prompt of SDPA_PREFILL_TOKENS or more is attended by SDPA's kernel
    # and a short one beside it in the same step by the native kernel, then a long chunk after the long prompt's cached
    # keys by SDPA's kernel again (two calls merged): each gives what the model's own forward gives
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedattn.backends import sdpa_cpu

    monkeypatch.setattr(sdpa_cpu, "_amx_tiles", lambda: True)
    routed = []
    one, chunk = sdpa_cpu.SdpaCpuBackend._one, sdpa_cpu._chunk_by_sdpa
    monkeypatch.setattr(sdpa_cpu.SdpaCpuBackend, "_one", lambda self, out, q, s, *a: routed.append(s.q_len) or
                        one(self, out, q, s, *a))
    monkeypatch.setattr(sdpa_cpu, "_chunk_by_sdpa", lambda out, q, s, *a: routed.append(-s.q_len) or chunk(out, q, s, *a))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    sv = prepare_model(m, target="cpu", block_size=16, compile=False, progress=False)
    g = torch.Generator().manual_seed(1)
    n = sdpa_cpu.SDPA_PREFILL_TOKENS
    a, b, c = (torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in (n + 18, 40, n + 3))
    caches = sv.allocate_kv_caches(80)
    meta = build_metadata([(0, len(a), list(range(34))), (0, len(b), [36, 37, 38])], 16)
    got = [*sv.run_packed(caches, meta, a + b, list(range(len(a))) + list(range(len(b))),
                          [len(a) - 1, len(a) + len(b) - 1])]
    meta = build_metadata([(len(a), len(c), list(range(34)) + list(range(40, 73)))], 16)  # a's blocks, and more
    got += [*sv.run_packed(caches, meta, c, list(range(len(a), len(a) + len(c))), [len(c) - 1])]
    assert sorted(set(routed)) == [-len(c), len(a)]  # the long prompt, then the chunk, at each layer
    with torch.no_grad():
        want = [m(input_ids=torch.tensor([p]), use_cache=False).logits[0, -1] for p in (a, b, a + c)]
    # logits up to ~0.8: a bf16 unit there is 0.004 (the largest difference seen); attending the long prompt without its
    # causal mask differs by 0.1, the chunk's own keys without it by 0.025
    torch.testing.assert_close(torch.stack(got).float(), torch.stack(want).float(), atol=0.02, rtol=0.01)
