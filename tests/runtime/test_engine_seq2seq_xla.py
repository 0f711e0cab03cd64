"""PagedEngine serving encoder-decoders on XLA (XLA:CPU, the static paged path): greedy tokens equal Hugging Face
``generate`` for tiny BART, T5 and Whisper, under chunked prefill and preemption, with a bounded number of compiled
graphs; ``rewrite-model --target xla`` and ``run`` on a BART folder. Runs in the XLA environment only (``.ci/xla-tests``); elsewhere every test skips.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch_xla = pytest.importorskip(
    "torch_xla", reason="torch_xla is not installed: run the XLA tests with .ci/xla-tests (README 'XLA (torch_xla)')")

import torch_xla.debug.metrics as met  # noqa: E402

from pagedattn import PagedEngine  # noqa: E402
from pagedattn.backends import set_validation  # noqa: E402
from pagedattn.backends.pallas_xla import PallasXlaBackend  # noqa: E402

from ..rewriter.seq2seq_models import features, hf_seq2seq_generate, sources, tiny_seq2seq  # noqa: E402

pytestmark = pytest.mark.xla
DEV = torch_xla.device()
NEW = 7


def _compiles() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


@pytest.fixture(autouse=True)
def _no_host_checks():
    set_validation(False)  # validation reads metadata on the host: graphs of its own
    yield
    set_validation(None)


@pytest.fixture(scope="module")
def bart():
    model = tiny_seq2seq("bart")
    # no early EOS: every request generates all its tokens, so the steps mix decodes with admissions
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model


def test_bart_on_xla_equals_hf_generate_and_compiles_a_bounded_number_of_graphs(bart):
    ref = hf_seq2seq_generate(bart, sources(), NEW)
    engine = PagedEngine(tiny_seq2seq("bart").to(DEV), target="xla", block_size=4, num_blocks=200,
                         max_num_tokens=32, max_num_seqs=8, eos_token_id=[])
    before = _compiles()
    assert engine.generate(sources(), max_new_tokens=NEW) == ref
    first = _compiles() - before
    assert engine.stats["encoder_runs"] >= 1 and first <= engine.stats["steps"] + 2 * engine.stats["encoder_runs"]
    # the same shapes again (other tokens of the same lengths): nothing new to compile
    again = [[(t * 7 + 3) % 90 + 4 for t in s] for s in sources()]
    before = _compiles()
    assert engine.generate(again, max_new_tokens=NEW) == hf_seq2seq_generate(bart, again, NEW)
    assert _compiles() - before == 0, "step and encoder shapes seen before must not compile again"


def test_bart_on_xla_under_chunked_prefill_and_preemption(bart):
    ref = hf_seq2seq_generate(bart, sources(), NEW)
    for mode in ("recompute", "swap"):
        engine = PagedEngine(tiny_seq2seq("bart").to(DEV), target="xla", block_size=4, num_blocks=14,
                             max_num_tokens=3, max_num_seqs=4, preemption_mode=mode, eos_token_id=[])
        assert engine.generate(sources(), max_new_tokens=NEW) == ref, mode
        assert engine.stats["preemptions"] > 0, mode
        assert engine.blocks.num_free == engine.num_blocks


def test_t5_relative_bias_on_xla_equals_hf_generate():
    # T5's bucketed relative bias is a position program: XLA's static path evaluates it for each step's positions
    model = tiny_seq2seq("t5")
    ref = hf_seq2seq_generate(model, sources(), NEW)
    engine = PagedEngine(tiny_seq2seq("t5").to(DEV), target="xla", block_size=4, num_blocks=200, max_num_tokens=32,
                         max_num_seqs=8)
    assert engine.generate(sources(), max_new_tokens=NEW) == ref


def test_whisper_features_on_xla_equal_hf_generate():
    model = tiny_seq2seq("whisper")
    feats = features(model, 2)
    ref = hf_seq2seq_generate(model, feats, 5)
    engine = PagedEngine(tiny_seq2seq("whisper").to(DEV), target="xla", block_size=4, num_blocks=64,
                         max_num_tokens=16, max_num_seqs=4)
    assert engine.generate([{"input_features": f} for f in feats], max_new_tokens=5) == ref


def test_kernel_mode_refuses_cross_attention_with_the_reason():
    # ragged_paged_attention is causal only: cross-attention (every encoder token visible) cannot run there
    with pytest.raises(ValueError, match="non-causal"):
        PagedEngine(tiny_seq2seq("bart").to(DEV), target=PallasXlaBackend("reference"), block_size=4, num_blocks=32)


def test_rewrite_model_and_run_a_bart_folder_for_xla(tmp_path, capsys):
    # the CLI: the decoder step rewritten and checked on XLA, the encoder read and the weights saved from
    # the CPU; run rebuilds the engine on XLA from OUT
    import json

    from pagedattn.cli import main

    model = tiny_seq2seq("bart")
    ckpt, out = tmp_path / "bart", tmp_path / "bart-out"
    model.save_pretrained(ckpt)
    assert main([str(ckpt), "-o", str(out), "--target", "xla"]) == 0
    report = json.load(open(out / "report.json"))
    assert report["target"] == "xla" and report["kind"] == "seq2seq"
    assert [r["attention_type"] for r in report["report"]] == ["encoder self"] * 2 + ["decoder self", "cross"] * 2
    capsys.readouterr()
    src = [5, 17, 9, 30, 3, 12]
    assert main(["run", str(out), "--ids", " ".join(map(str, src)), "--max-new-tokens", "6"]) == 0
    out_lines = capsys.readouterr().out.splitlines()
    assert out_lines[0] == f"[0] {hf_seq2seq_generate(model, [src], 6)[0]}"
    assert "(xla, encoder-decoder)" in out_lines[-1]
