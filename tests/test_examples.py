"""The runnable examples still run and check what they claim (each exits 0 only when its tokens equal the
reference's)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_serve_seq2seq_example_generates_like_hugging_face(capsys):
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(EXAMPLES / "serve_seq2seq.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    assert "t5: 5/5 requests" in out and "whisper: 3/3 requests" in out


@pytest.mark.parametrize("script, claim", [
    ("serve_hf.py", "6/6 prompts generate the same tokens as Hugging Face generate"),
    ("paged_batch.py", "OK: paged attention matches dense attention"),
])
def test_examples_check_what_they_claim(script, claim, capsys):
    try:
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    except SystemExit as done:
        assert done.code in (0, None), capsys.readouterr().out
    assert claim in capsys.readouterr().out
