"""Quiet, early, single errors: no output nobody asked for, and one clear line for each mistake."""

import argparse
import json
import os
import warnings

import pytest
import torch

import pagedattn
from pagedattn.cli import main

from ..support import tiny_model


def test_serving_a_hugging_face_model_prints_nothing(capfd):
    m = tiny_model("llama", "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning the library lets through fails the test
        engine = pagedattn.PagedEngine(m, compile=False, num_blocks=32)
        started = capfd.readouterr()
        engine.generate([[1, 2, 3]], max_new_tokens=2)
        quiet = pagedattn.PagedEngine(m, compile=False, num_blocks=32, progress=False)
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)
    # start-up reports its stages (progress=True, the default) and nothing else
    assert started.out == "" and started.err and all(line.startswith("pagedattn: ")
                                                     for line in started.err.splitlines()), started
    assert quiet.servable is not None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    tiny_model("llama", "eager").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def out(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "rewritten"
    assert main([str(checkpoint), "-o", str(out)]) == 0
    return out


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    return code, capsys.readouterr()


def test_rewrite_prints_no_progress_bars_or_library_warnings(checkpoint, tmp_path, capfd):
    assert main([str(checkpoint), "-o", str(tmp_path / "o")]) == 0
    out, err = capfd.readouterr()
    assert "Loading weights" not in err + out and "specialized" not in err, err
    assert "2 of 2 attention sites rewritten" in out


def test_a_wrongly_shaped_weight_is_named(checkpoint, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(checkpoint):
        if f != "model.safetensors":
            (bad / f).write_bytes((checkpoint / f).read_bytes())
    sd = load_file(checkpoint / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    sd[key] = torch.zeros(sd[key].shape[0] // 2, sd[key].shape[1])
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    code, cap = _run(capsys, bad, "-o", tmp_path / "o")
    assert code == 2
    line = f"weight {key} has shape [16, 32], the config expects [32, 32]"
    assert line in cap.err and cap.err.count("\n") == 1 and "\x1b[" not in cap.err + cap.out, cap.err


def test_an_unwritable_output_fails_before_any_work(checkpoint, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    # a folder this user may not write to (chmod alone does not stop root, who runs CI)
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(locked) else real_access(p, mode))
    monkeypatch.setattr("pagedattn.checkpoint.load_checkpoint", lambda *a: pytest.fail("work started"))
    code, cap = _run(capsys, checkpoint, "-o", locked / "out")
    assert code == 2 and "no permission to create files in" in cap.err and ".tmp" not in cap.err


def test_an_output_in_a_missing_folder_is_refused_first(checkpoint, tmp_path, capsys):
    code, cap = _run(capsys, checkpoint, "-o", tmp_path / "missing" / "out")
    assert code == 2 and "does not exist" in cap.err


def test_an_empty_prompt_is_one_error_before_the_program_loads(out, capsys, monkeypatch):
    from pagedattn import cli

    monkeypatch.setattr(cli, "_load_program", lambda out: pytest.fail("the program loaded for a bad prompt"))
    for argv in (("--ids", ""), ("--ids", "3 4", "--ids", " , ")):
        code, cap = _run(capsys, "run", out, *argv)
        assert code == 2 and cap.err.count("error") == 1 and "the prompt is empty" in cap.err, cap.err
    # text that the tokenizer turns into no tokens (this checkpoint carries none: a stand-in)
    args = argparse.Namespace(prompt=["hi", " "], ids=[])
    with pytest.raises(cli.CliError, match="--prompt ' ': the prompt is empty"):
        cli._prompts(args, {}, lambda t, add_special_tokens: {"input_ids": [7] * len(t.strip())})


@pytest.mark.parametrize("flag", ["--num-blocks", "--max-new-tokens"])
def test_zero_blocks_or_tokens_are_refused(out, capsys, flag):
    code, cap = _run(capsys, "run", out, "--ids", "1 2", flag, "0")
    assert code == 2 and f"{flag} must be >= 1" in cap.err


def test_the_tokenizer_is_checked_before_the_program_loads(out, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    info = json.loads((out / "report.json").read_text())
    (broken / "report.json").write_text(json.dumps({**info, "tokenizer": False}))
    (broken / "model.pt2").write_bytes(b"not a program")
    code, cap = _run(capsys, "run", broken, "--prompt", "hello")
    assert code == 2 and "carries no tokenizer" in cap.err, cap.err
