"""Hugging Face encoder-decoders served by PagedEngine equal ``generate`` token for token: Marian, mBART,
Pegasus, T5 (relative bias served by its position program), Whisper (features as the request's encoder
input); each with a cache small enough to preempt and a token budget that chunks recomputed prompts."""

from __future__ import annotations

import pytest
import torch

from pagedattn import PagedEngine
from pagedattn.seq2seq import hf_seq2seq, is_seq2seq

from .seq2seq_models import features, hf_seq2seq_generate, sources, tiny_seq2seq

NEW = 8


@pytest.mark.parametrize("arch", ["marian", "mbart", "pegasus", "t5"])
def test_text_seq2seq_equals_hf_generate(arch):
    model = tiny_seq2seq(arch)
    engine = PagedEngine(model, compile=False, block_size=4, num_blocks=12, max_num_tokens=5, progress=False)
    assert engine.generate(sources(), max_new_tokens=NEW) == hf_seq2seq_generate(model, sources(), NEW)
    assert engine.stats["preemptions"] > 0
    kinds = [(r["mask"], r["attention_type"]) for r in engine.model.report]
    self_mask = "positional" if arch == "t5" else "causal"  # T5's bucketed relative bias: its position program
    assert kinds == [(self_mask, "self"), ("none", "cross")] * 2


def test_pegasus_x_equals_hf_generate():
    # its decoder fills a sinusoidal position table in place from the decoder's length: the cross-attention
    # writer, cut from the decoder step, must drop those writes with the rest of the decoder's work
    import transformers

    from .hf_zoo import tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(tiny_config("pegasus_x"), attn_implementation="eager")
    model = model.eval().float()
    srcs = [[(7 * i + 3 * n) % 90 + 4 for i in range(n)] for n in (5, 17, 9)]
    engine = PagedEngine(model, compile=False, block_size=4, progress=False)
    assert engine.generate(srcs, max_new_tokens=6) == hf_seq2seq_generate(model, srcs, 6)
    assert [r["attention_type"] for r in engine.model.report].count("cross") == model.config.decoder_layers


def test_whisper_takes_features_and_equals_hf_generate():
    model = tiny_seq2seq("whisper")
    feats = features(model, 4)
    engine = PagedEngine(model, compile=False, block_size=4, num_blocks=12, max_num_tokens=5, progress=False,
                         preemption_mode="swap")
    got = engine.generate([{"input_features": f} for f in feats], max_new_tokens=NEW)
    assert got == hf_seq2seq_generate(model, feats, NEW)
    assert engine.stats["preemptions"] > 0
    with pytest.raises(ValueError, match="give each request as a dict"):
        engine.add_request([5, 6, 7], max_new_tokens=2)


def test_spec_of_hf_models_reads_the_generation_config():
    bart = tiny_seq2seq("bart")
    assert is_seq2seq(bart) and not is_seq2seq(torch.nn.Linear(2, 2))
    spec = hf_seq2seq(bart)
    assert spec.decoder_prompt == (2,) and spec.forced_eos == 2 and spec.encoder_input == "input_ids"
    assert hf_seq2seq(tiny_seq2seq("whisper")).encoder_input == "input_features"


def test_forced_bos_from_the_generation_config_equals_hf_generate():
    model = tiny_seq2seq("mbart")
    model.generation_config.forced_bos_token_id = 7  # mBART's target-language token, forced first
    engine = PagedEngine(model, compile=False, block_size=4, progress=False)
    got = engine.generate(sources()[:3], max_new_tokens=NEW)
    assert got == hf_seq2seq_generate(model, sources()[:3], NEW) and all(t[0] == 7 for t in got)


def test_encoder_states_reach_the_decoder_as_a_model_output():
    """Decoders read ``encoder_outputs.last_hidden_state`` or ``encoder_outputs[0]`` (a tuple has only the
    latter), and some read fields their own encoder's output class adds (NLLB-MoE's ``router_logits``,
    Canary's ``attention_mask``): those are None, as for states of one unpadded request."""
    from pagedattn.seq2seq import encoder_states_output

    states = torch.randn(2, 5, 8)
    out = encoder_states_output(states)
    assert out.last_hidden_state is states and out[0] is states
    assert out.router_logits is None and out.attention_mask is None
    with pytest.raises(AttributeError):
        getattr(out, "__deepcopy_hook__")  # noqa: B009 - dunder lookups still fail (copy, pickle probe them)
