"""Tiny Hugging Face models: every attention site rewritten, drop-in logits equal the original."""

import pytest
import torch

import pagedattn

from .hf_models import TINY, example_inputs, tiny_model

pytest.importorskip("transformers")

CASES = [(arch, impl) for arch in sorted(TINY) for impl in ("eager", "sdpa")]


def _build(arch, impl):
    try:
        return tiny_model(arch, impl)
    except ValueError as e:  # e.g. BLOOM and MPT have no SDPA implementation in transformers
        if "does not support" in str(e):
            pytest.skip(f"{arch} has no {impl} attention in transformers")
        raise


@pytest.mark.parametrize("arch, impl", CASES, ids=[f"{a}-{i}" for a, i in CASES])
def test_hf_dropin(arch, impl):
    model = _build(arch, impl)
    ids, mask = example_inputs()
    rm = pagedattn.rewrite(model, (), {"input_ids": ids, "attention_mask": mask, "use_cache": False})
    assert rm.report and all(r["status"] == "rewritten" for r in rm.report), rm.print_report()
    assert len(rm.report) == model.config.num_hidden_layers
    cfg = model.config.get_text_config()
    if getattr(cfg, "sliding_window", None) and arch == "mistral":
        assert {r["window"] for r in rm.report} == {cfg.sliding_window}
    for pad in ((), (0, 4, 1)):
        ids2, mask2 = example_inputs(3, 13, left_pad=pad, seed=5)
        with torch.no_grad():
            ref = model(input_ids=ids2, attention_mask=mask2, use_cache=False).logits
            out = rm(input_ids=ids2, attention_mask=mask2, use_cache=False).logits
        keep = mask2.bool()  # padded positions' outputs are not defined by the model
        torch.testing.assert_close(out[keep], ref[keep], atol=2e-5, rtol=1e-4)


def test_hf_paged_mode_matches_per_sequence():
    """Sequences flattened into one [1, T] step with explicit positions, as vLLM runs HF models."""
    model = tiny_model("llama", "eager")
    ids, mask = example_inputs()
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    rm = pagedattn.rewrite(model, (), {"input_ids": ids, "position_ids": pos, "use_cache": False})
    from pagedattn.backends import build_metadata

    a, b = torch.randint(0, 100, (1, 6)), torch.randint(0, 100, (1, 11))
    caches = rm.allocate_kv_caches(8)
    meta = build_metadata([(0, 6, [3]), (0, 11, [1])], 16)
    flat = torch.cat([a, b], 1)
    flat_pos = torch.cat([torch.arange(6), torch.arange(11)])[None]
    with torch.no_grad(), pagedattn.paged_context(caches, meta):
        out = rm(input_ids=flat, position_ids=flat_pos, use_cache=False).logits
    with torch.no_grad():
        torch.testing.assert_close(out[:, :6], model(input_ids=a, use_cache=False).logits, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out[:, 6:], model(input_ids=b, use_cache=False).logits, atol=2e-5, rtol=1e-4)
