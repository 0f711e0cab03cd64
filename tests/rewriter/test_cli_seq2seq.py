"""``rewrite-model`` on encoder-decoder checkpoints (tiny random-weight folders made with ``save_pretrained``):
the three kinds of site in the report and ``inspect``, ``run`` from text ids or Whisper features equal to
Hugging Face ``generate``, and saving a decoder step with cross-attention refused in one line."""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest
import torch

import pagedattn
from pagedattn.cli import main

from .seq2seq_models import features, hf_seq2seq_generate, tiny_seq2seq


@pytest.fixture(autouse=True)
def eager_engine(monkeypatch):
    """The CLI's engine runs eager here (compiling the decoder step takes 30-60 s on 2 cores)."""
    monkeypatch.setattr(pagedattn, "PagedEngine", functools.partial(pagedattn.PagedEngine, compile=False))


def _rewrite(tmp_path, arch: str):
    model = tiny_seq2seq(arch)
    ckpt, out = tmp_path / arch, tmp_path / f"{arch}-out"
    model.save_pretrained(ckpt)
    assert main([str(ckpt), "-o", str(out)]) == 0
    return model, out


def test_bart_folder_three_kinds_of_site_and_run_equals_generate(tmp_path, capsys):
    model, out = _rewrite(tmp_path, "bart")
    report = json.load(open(out / "report.json"))
    assert report["kind"] == "seq2seq" and not os.path.exists(out / "model.pt2")
    assert [r["attention_type"] for r in report["report"]] == ["encoder self"] * 2 + ["decoder self", "cross"] * 2
    capsys.readouterr()
    assert main(["inspect", str(out), "--no-diff"]) == 0
    assert "2 encoder self, 2 decoder self, 2 cross (6 of 6 rewritten)" in capsys.readouterr().out
    src = [5, 17, 9, 30, 3, 12]
    assert main(["run", str(out), "--ids", " ".join(map(str, src)), "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out.splitlines()[0]
    assert printed == f"[0] {hf_seq2seq_generate(model, [src], 6)[0]}"
    assert main(["export-onnx", str(out)]) == 2  # not supported: one line
    assert main(["run", str(out), "--features", "x.npy"]) == 2  # features for a text model: one line
    assert "takes text" in capsys.readouterr().err


def test_whisper_folder_runs_features_files(tmp_path, capsys):
    model, out = _rewrite(tmp_path, "whisper")
    feats = features(model, 2)
    np.save(tmp_path / "a.npy", feats[0].numpy())
    torch.save(feats[1], tmp_path / "b.pt")
    capsys.readouterr()
    assert main(["run", str(out), "--features", str(tmp_path / "a.npy"), "--features", str(tmp_path / "b.pt"),
                 "--max-new-tokens", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"[{i}] {toks}" for i, toks in enumerate(hf_seq2seq_generate(model, feats, 5))]
    assert main(["run", str(out), "--ids", "1 2"]) == 2  # text for a speech model: one clear line
    assert "takes audio features" in capsys.readouterr().err


def test_saving_a_decoder_step_with_cross_attention_is_refused(tmp_path):
    from pagedattn.backends import get_backend
    from pagedattn.seq2seq import prepare_seq2seq

    step = prepare_seq2seq(tiny_seq2seq("bart"), get_backend("cpu"), 16).step
    with pytest.raises(ValueError, match="cannot save an encoder-decoder's decoder step"):
        step.save(str(tmp_path / "step.pt2"))
