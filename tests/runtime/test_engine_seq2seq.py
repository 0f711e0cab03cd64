"""PagedEngine serving encoder-decoders: greedy tokens equal Hugging Face ``generate`` (tiny BART) and a
hand-written ``nn.Transformer``'s own greedy loop, under chunked prefill, preemption (recompute and swap)
and prefix caching; cross-attention blocks come and go with their requests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedattn import PagedEngine
from pagedattn.adapter import prepare_model
from pagedattn.runtime.scheduler import SamplingParams
from pagedattn.seq2seq import Seq2SeqSpec, length_groups

from ..rewriter.seq2seq_models import (
    SRC_VOCAB,
    DecoderOf,
    EncoderOf,
    TinyTransformer,
    hf_seq2seq_generate,
    sources,
    tiny_seq2seq,
    transformer_greedy,
)

NEW = 10


@pytest.fixture(scope="module")
def bart():
    return tiny_seq2seq("bart")


@pytest.fixture(scope="module")
def servable(bart):
    return prepare_model(bart, block_size=4)  # rewritten and checked once, served by every engine below


@pytest.fixture(scope="module")
def reference(bart):
    return hf_seq2seq_generate(bart, sources(), NEW)


SETTINGS = {
    "whole": dict(num_blocks=400, max_num_tokens=64),
    "chunked_prefill_and_recompute": dict(num_blocks=14, max_num_tokens=3),
    "recompute": dict(num_blocks=14, max_num_tokens=64),
    "swap": dict(num_blocks=14, max_num_tokens=64, preemption_mode="swap"),
    "swap_small_host": dict(num_blocks=14, max_num_tokens=5, preemption_mode="swap", swap_space=6 * 4 * 2 * 4 * 4 * 32),
    "no_prefix_caching": dict(num_blocks=24, max_num_tokens=8, enable_prefix_caching=False),
}


@pytest.mark.parametrize("setting", SETTINGS, ids=list(SETTINGS))
def test_bart_tokens_equal_hf_generate(servable, reference, setting):
    engine = PagedEngine(servable, **SETTINGS[setting])
    assert engine.generate(sources(), max_new_tokens=NEW) == reference
    if setting != "whole":
        assert engine.stats["preemptions"] > 0 or setting == "no_prefix_caching"
    if "swap" in setting:
        assert engine.stats["swap_outs"] > 0
    assert engine.blocks.num_free == engine.num_blocks  # cross blocks freed with their requests


@pytest.mark.parametrize("setting", ["whole", "recompute"])
def test_bart_tokens_equal_hf_generate_on_the_hot_path(servable, reference, setting):
    # validation off, as users run: each step's layers take the ops' prepared calls, self- and cross-attention
    # alternating layer by layer (backends/ops.py)
    from pagedattn.backends import set_validation

    set_validation(False)
    try:
        assert PagedEngine(servable, **SETTINGS[setting]).generate(sources(), max_new_tokens=NEW) == reference
    finally:
        set_validation(True)


def test_the_encoder_runs_once_per_request_batched_at_admission(servable, reference):
    engine = PagedEngine(servable, num_blocks=400, max_num_tokens=64)
    assert engine.generate(sources(), max_new_tokens=NEW) == reference
    # all six admitted in the first step, encoded together in groups of similar lengths
    assert engine.stats["encoder_requests"] == 6
    assert engine.stats["encoder_runs"] == len(length_groups([len(s) for s in sources()])) > 1


def test_length_groups_trade_padding_against_calls():
    assert length_groups([]) == []
    assert length_groups([5, 5, 5]) == [[0, 1, 2]]  # alike: one batch
    assert length_groups([4, 300, 5, 290]) == [[0, 2], [3, 1]]  # two lengths apart: two batches, sorted
    assert length_groups([10, 300], group_cost=10_000) == [[0, 1]]  # calls dearer than padding: one batch
    for lens in ([7, 1, 128, 64, 3, 90, 90, 2], list(range(1, 40))):
        groups = length_groups(lens)
        assert sorted(i for g in groups for i in g) == list(range(len(lens)))


def test_decode_steps_reuse_the_cross_metadata_tensors(servable):
    engine = PagedEngine(servable, num_blocks=100, max_num_tokens=64)
    for s in sources()[:3]:
        engine.add_request(s, max_new_tokens=4)
    engine.step()
    first = engine._last_cross[1]
    engine.step()
    assert engine._last_cross[1] is first  # same requests, same cross blocks: the same tensors
    engine.add_request(sources()[3], max_new_tokens=4)
    engine.step()
    assert engine._last_cross[1] is not first and engine._last_cross[1].seq_lens.shape[0] == 4
    while engine.has_unfinished():
        engine.step()


def test_requests_of_different_lengths_through_the_step_api(servable, bart):
    srcs = sources(seed=3, lengths=(7, 2, 25))
    news = (3, 12, 6)
    engine = PagedEngine(servable, num_blocks=40, max_num_tokens=8)
    rids = [engine.add_request(s, SamplingParams(max_new_tokens=n)) for s, n in zip(srcs, news)]
    done = {}
    while engine.has_unfinished():
        for r in engine.step():
            done[r.request_id] = r.tokens
    for rid, s, n in zip(rids, srcs, news):
        assert done[rid] == hf_seq2seq_generate(bart, [s], n)[0]


def test_same_encoder_input_shares_decoder_blocks_other_inputs_do_not(servable, bart):
    src = sources()[3]
    engine = PagedEngine(servable, num_blocks=200, max_num_tokens=64)
    first = engine.generate([src], max_new_tokens=NEW)
    hits = engine.blocks.prefix_hits
    # a different encoder input: its decoder prompt (the start token) is the same, its blocks are not
    other = engine.generate([sources()[1]], max_new_tokens=NEW)
    assert other == hf_seq2seq_generate(bart, [sources()[1]], NEW)
    assert engine.generate([src], max_new_tokens=NEW) == first
    assert engine.blocks.prefix_hits == hits  # one-token decoder prompts leave no full block to share


def test_abort_frees_cross_blocks(servable):
    engine = PagedEngine(servable, num_blocks=100, max_num_tokens=64)
    rid = engine.add_request(sources()[3], max_new_tokens=NEW)
    engine.step()
    assert engine.blocks.num_free < engine.num_blocks - 1  # decoder and cross blocks held
    engine.abort(rid)
    assert engine.blocks.num_free == engine.num_blocks


@pytest.mark.parametrize("prompt, match", [
    ([], "empty"),
    ([5, 999], "outside the vocabulary"),
    (list(range(3, 90)) * 2, "encoder takes at most 128"),
    ({"input_features": torch.zeros(4, 4)}, "lack 'input_ids'"),
])
def test_bad_encoder_inputs_get_one_clear_error(servable, prompt, match):
    engine = PagedEngine(servable, num_blocks=100)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, max_new_tokens=4)


def test_a_request_the_cache_cannot_hold_is_refused(servable):
    engine = PagedEngine(servable, num_blocks=6)
    with pytest.raises(ValueError, match="cross-attention and decoder"):
        engine.add_request(sources()[3], max_new_tokens=NEW)


def test_generation_past_the_decoders_positions_is_refused_up_front(servable, bart):
    """BART's decoder has a table of 128 positions: Hugging Face's generate fails with an IndexError deep in a
    forward pass past it; the engine refuses such a request when it is added, and serves one that fits."""
    engine = PagedEngine(servable, num_blocks=100)
    assert bart.config.max_position_embeddings == 128
    with pytest.raises(ValueError, match="max_new_tokens is 129 but this model's decoder generates at most 128"):
        engine.add_request(sources()[0], max_new_tokens=129)
    engine.add_request(sources()[0], max_new_tokens=128)


# -------------------------------------------------------------------- a hand-written nn.Transformer


@pytest.fixture(scope="module")
def transformer():
    torch.manual_seed(0)
    return TinyTransformer().eval()


# nn.TransformerEncoder's own eager fast path (the model's code, run as the model runs it) notes its nested tensors
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_nn_transformer_tokens_equal_its_own_greedy_loop(transformer):
    spec = Seq2SeqSpec(encoder=EncoderOf(transformer), decoder=DecoderOf(transformer), hidden_size=32,
                       decoder_prompt=(1,), eos_token_id=2, vocab_size=SRC_VOCAB, max_source_len=128)
    engine = PagedEngine(spec, compile=False, block_size=4, num_blocks=30, max_num_tokens=6, progress=False)
    assert engine.generate(sources(), max_new_tokens=NEW) == transformer_greedy(transformer, sources(), NEW, 1, 2)
    assert engine.stats["preemptions"] > 0


@pytest.mark.slow  # Inductor compiles the encoder and the decoder step (30-60 s on 2 shared cores)
def test_compiled_encoder_and_decoder_step_equal_hf_generate_without_recompiling(bart, reference):
    from pagedattn.runtime.shapes import graph_count

    engine = PagedEngine(bart, block_size=4, num_blocks=14, max_num_tokens=5, progress=False)  # compiled by default
    assert engine.servable.seq2seq.compiled_encoder is not None
    before = graph_count()
    assert engine.generate(sources(), max_new_tokens=NEW) == reference
    assert engine.stats["preemptions"] > 0
    # a lone request of one token: the encoder's batch and length are padded to the compiled graph's sizes
    lone = sources(seed=3, lengths=(1,))
    assert engine.generate(lone, max_new_tokens=NEW) == hf_seq2seq_generate(bart, lone, NEW)
    assert graph_count() == before  # no recompiles while serving


def test_a_compiled_encoder_is_given_at_least_two_rows_and_two_tokens(servable):
    """Sizes 0 and 1 specialise a compiled graph: a lone one-token request is padded to two rows of two
    tokens (a masked pad token, a padding row), and gets the states the eager encoder gives it."""
    s2s = servable.seq2seq
    seen = []

    def recording(**inputs):
        seen.append({k: tuple(v.shape) for k, v in inputs.items()})
        return s2s.spec.encoder(**inputs)

    compiled = dataclasses.replace(s2s, compiled_encoder=recording)
    request = [s2s.request_inputs(sources(seed=3, lengths=(1,))[0])]
    states, lens = compiled.encode(request, "cpu")
    alone, alone_lens = s2s.encode(request, "cpu")
    assert seen == [{"input_ids": (2, 2), "attention_mask": (2, 2)}] and lens == alone_lens == [1]
    torch.testing.assert_close(states[:1, :1], alone, rtol=1e-5, atol=1e-5)


def test_without_a_decoder_start_token_the_bos_token_starts_the_decoder_as_generate_does():
    model = tiny_seq2seq("mbart", decoder_start_token_id=None)
    model.generation_config.decoder_start_token_id = None
    engine = PagedEngine(model, num_blocks=100, max_num_tokens=64, compile=False, progress=False)
    assert engine.servable.seq2seq.spec.decoder_prompt == (model.config.bos_token_id,)
    assert engine.generate(sources()[:2], max_new_tokens=6) == hf_seq2seq_generate(model, sources()[:2], 6)
