"""A fast slice of the model-zoo sweep (``benchmarks/zoo.py`` runs all of transformers' causal LMs).

Each architecture is built tiny from its own config, rewritten the way the engine calls it, compared
with the original in drop-in mode, and generates greedily through ``PagedEngine`` exactly like
Hugging Face ``generate``. The slice covers the mechanisms the sweep needed: GQA/MQA, sliding
windows and per-layer attention kinds, soft-caps, ALiBi, partial rotary, MoE routers (softmaxes
that are not attention), multi-head latent attention (value and key head sizes differ), learned
positions numbered inside the model (no ``position_ids``), mask values held in graph constants, scores
clamped at the dtype minimum, SDPA outputs viewed in their memory order, attention sinks (concatenated
logits, or a log-sum-exp rescaling), multiplicative 0/1 masks, position ids taken through ``**kwargs``,
and recurrent state carried beside the paged cache (hybrids and state-space models).
"""

import pytest
import torch

pytest.importorskip("transformers")

from .hf_zoo import check_eager, check_sdpa, hf_generate, inputs, tiny_model  # noqa: E402

CI_ARCHS = [
    "llama", "mistral", "qwen2", "gpt_neo", "qwen2_moe", "mixtral", "gemma2", "gemma3_text", "cohere2", "phi3",
    "gpt2", "gpt_neox", "gptj", "opt", "falcon", "bloom", "mpt", "deepseek_v3", "starcoder2", "olmo2", "granite",
    "blenderbot", "xglm", "gpt_oss", "granitemoe_swa", "openai-gpt", "whisper",
]


@pytest.mark.parametrize("arch", CI_ARCHS)
def test_zoo_arch_rewritten_and_generates_like_hf(arch):
    model = tiny_model(arch, "eager")
    res, engine = check_eager(model)
    assert "error" not in res, res
    assert res["sites"] > 0 and res["rewritten"] == res["sites"], res
    assert res["max_err"] < 1e-4, res
    assert engine == {"equal": True}, engine


# hybrids and state-space models: a state slot per request beside the paged cache (pagedattn.runtime.state);
# LFM2-MoE (short convolutions), MiniMax (its own cache class), Mamba-2 (no attention at all); Jamba below.
# MiniMax (~25 s) and Mamba-2 (~20 s) run with the slow tests, to keep the main suite within its 8 minutes (a model
# without attention, Mamba-1, stays in the main suite: test_engine_state.py)
STATE_ARCHS = ["lfm2_moe", pytest.param("minimax", marks=pytest.mark.slow), pytest.param("mamba2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("arch", STATE_ARCHS)
def test_zoo_model_with_state_generates_like_hf(arch):
    model = tiny_model(arch, "eager")
    res, engine = check_eager(model)
    assert res["state"] and "error" not in res, res
    assert res["rewritten"] == res["sites"] and (res["sites"] > 0) == (arch != "mamba2"), res
    assert engine.get("equal") or engine.get("equal_to_forward"), engine


def _jamba_engine(caplog):
    """Tiny Jamba served (warnings captured), and how its attention sites' masks were established."""
    import pagedattn

    model = tiny_model("jamba", "eager")
    with caplog.at_level("WARNING", logger="pagedattn"):
        engine = pagedattn.PagedEngine(model, compile=False, block_size=4)
    return model, engine, {r["mask_established"] for r in engine.servable.step.report if r["attention"]}


def test_single_token_steps_take_masks_proven_for_every_length_with_recurrent_layers_opaque(caplog):
    # Jamba (Mamba-1) runs one token per step, so its attention masks come from a multi-token trace. Its
    # Mamba scan loops over the tokens in Python, which fixes that trace's length (8 tokens); traced again with
    # the Mamba layers opaque, the code that builds the masks traces for every length, and the mask is proven
    # up to the model's 512 positions: requests far past 8 tokens generate as HF does, longer ones are refused
    model, engine, hows = _jamba_engine(caplog)
    assert hows == {"hint from a multi-token trace: proof, recurrent layers opaque"}
    assert "established up to" not in caplog.text
    assert engine.length_limit()[0] == model.config.max_position_embeddings == 512
    g = torch.Generator().manual_seed(0)
    # 300 tokens: past every length the mask was probed at before the proofs (257)
    ps = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (40, 13, 300)]
    assert engine.generate(ps, max_new_tokens=6) == hf_generate(model, ps, 6)
    with pytest.raises(ValueError, match=r"reach 513 positions, but .* established for sequences of up to 512"):
        engine.add_request([3] * 500, max_new_tokens=14)
    assert not engine.has_unfinished()


def test_hint_masks_of_a_fixed_length_trace_hold_only_up_to_that_length(caplog, monkeypatch):
    # without the opaque trace (here: no recurrent layer found), the masks hold up to the fixed trace's 8
    # tokens only: the report and a warning say so, and a request that would grow past it is refused when
    # added (not served on the assumption that the mask goes on as it was seen)
    import contextlib

    from pagedattn import tracing

    monkeypatch.setattr(tracing, "recurrent_layers_opaque", lambda model: contextlib.nullcontext(0))
    model, engine, hows = _jamba_engine(caplog)
    assert hows == {"hint from a multi-token trace: proof, at the trace's fixed length"}
    assert "established up to" in caplog.text
    assert engine.length_limit()[0] == 8
    ps = [[5, 9, 3, 11, 2, 8], [7, 1, 4, 2]]
    assert engine.generate(ps, max_new_tokens=3) == hf_generate(model, ps, 3)  # 6 + 3 - 1 = 8 positions
    with pytest.raises(ValueError, match=r"reach 9 positions, but .* established for sequences of up to 8 "
                                         r"\(hint from a multi-token trace: proof, at the trace's fixed length\); "
                                         r"shorten the request"):
        engine.add_request(ps[0], max_new_tokens=4)


@pytest.mark.parametrize("arch", ["afmoe", "gemma2", "qwen2_moe", "granitemoe"])
def test_zoo_sdpa_dropin(arch):
    eager = tiny_model(arch, "eager")
    ids, mask = inputs(eager, 2, 8, seed=1)
    res = check_sdpa(arch, eager, {"input_ids": ids, "attention_mask": mask, "use_cache": False})
    assert "error" not in res, res
    assert res["sites"] > 0 and res["rewritten"] == res["sites"] and res["max_err"] < 1e-4, res


def test_token_dependent_sparsity_is_refused():
    # DeepSeek-V3.2's indexer keeps each query's top-k keys by score: no fixed mask can express that
    res, engine = check_eager(tiny_model("deepseek_v32", "eager"))
    assert res["sites"] > 0 and res["rewritten"] == 0, res
    assert all("token values" in r for r in res["skipped"]), res
