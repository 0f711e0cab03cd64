"""rewrite-model end to end, on checkpoints the tests write themselves.

Most commands run in this process (``main([...])``, as the ``rewrite-model`` script calls it); the README's
main job and loading a saved program run in fresh processes, as users run them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from pagedattn.cli import main
from pagedattn.inspection import graphviz_missing

from ..support import hf_generate, tiny_model

pytest.importorskip("transformers")

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11]]
NEW = 6


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def _cli(*args, check=True) -> Result:
    """``rewrite-model ARGS`` in this process; its exit status and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    r = Result(code, out.getvalue(), err.getvalue())
    if check and r.returncode != 0:
        raise AssertionError(f"rewrite-model {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def _cli_process(*args) -> subprocess.CompletedProcess:
    """``python -m pagedattn.cli ARGS`` in a fresh process (the installed command's own entry point)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "pagedattn.cli", *args], capture_output=True, text=True, env=env,
                       timeout=600)
    if r.returncode != 0:
        raise AssertionError(f"rewrite-model {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def _hf_greedy(model, prompt, n) -> list[int]:
    return hf_generate(model, [prompt], n)[0]  # the checkpoint has no EOS: always n tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None  # fixed-length generation to compare token for token
    model.config.eos_token_id = None
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def rewritten(checkpoint, tmp_path_factory):
    path, _ = checkpoint
    out = tmp_path_factory.mktemp("out") / "rewritten"
    html = out.parent / "page.html"
    r = _cli(str(path), "-o", str(out), "--html", str(html), "--onnx")
    return out, html, r.stdout


def test_rewrite_writes_program_weights_and_reports(rewritten):
    out, _, stdout = rewritten
    assert {"model.pt2", "model.safetensors", "report.json", "report.txt", "graphs.json", "model.onnx",
            "config.json"} <= set(os.listdir(out))
    info = json.loads((out / "report.json").read_text())
    assert info["sites"] == 2 and info["rewritten"] == 2 and info["skipped"] == 0
    for row in info["report"]:
        assert row["status"] == "rewritten" and row["mask"] == "causal"
        assert (row["num_heads"], row["num_kv_heads"], row["head_dim"]) == (4, 2, 8)
    assert [s["num_kv_heads"] for s in info["cache_specs"]] == [2, 2]
    assert "2 of 2 attention sites rewritten" in stdout
    assert "onnxruntime (CPU) vs PyTorch" in stdout
    from safetensors.torch import load_file

    assert "model.embed_tokens.weight" in load_file(out / "model.safetensors")


def test_html_page(rewritten):
    _, html, _ = rewritten
    page = html.read_text()
    assert page.startswith("<!doctype html>") and "attn_0:" in page and "paged_attention" in page
    if graphviz_missing() is None:
        assert page.count("<svg") == 4  # before and after for each site
    else:
        assert "Site drawings are left out" in page and "<svg" not in page


def test_inspect_prints_sites_graphs_and_diff(rewritten):
    out, _, _ = rewritten
    r = _cli("inspect", str(out))
    text = r.stdout
    assert "2 of 2 sites rewritten" in text
    assert "--- attn_0:" in text and "+++ attn_0:" in text
    assert "+ write_kv_cache" in text and "pagedattn.paged_attention(" in text
    assert "=== unified diff of the graph code" in text and "+def forward(" in text


def test_saved_program_generates_like_hf_in_a_fresh_process(rewritten, checkpoint):
    out, _, _ = rewritten
    _, model = checkpoint
    code = (
        "import json, sys, pagedattn\n"
        f"rm = pagedattn.load({str(out / 'model.pt2')!r})\n"
        "eng = pagedattn.PagedEngine(rm, compile=False, target='cpu', num_blocks=16, eos_token_id=[])\n"
        f"print(json.dumps(eng.generate({PROMPTS!r}, max_new_tokens={NEW})))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == [_hf_greedy(model, p, NEW) for p in PROMPTS]


def test_run_command_generates_from_ids(rewritten, checkpoint):
    out, _, _ = rewritten
    _, model = checkpoint
    r = _cli("run", str(out), "--ids", "1 2 3", "--max-new-tokens", str(NEW))
    assert f"[0] prompt [1, 2, 3] -> {_hf_greedy(model, [1, 2, 3], NEW)}" in r.stdout
    assert "tok/s" in r.stdout


def test_onnx_model_runs_in_onnxruntime(rewritten):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    out, _, _ = rewritten
    onnx.checker.check_model(str(out / "model.onnx"))
    import pagedattn
    from pagedattn.onnx_export import verify_onnx

    errors = verify_onnx(pagedattn.load(str(out / "model.pt2")), str(out / "model.onnx"), num_tokens=9)
    assert set(errors) == {"prefill outputs", "prefill caches", "decode outputs", "decode caches"}
    assert max(errors.values()) < 1e-4, errors
    del ort


def test_rewrite_a_saved_export_program(tmp_path, checkpoint):
    _, model = checkpoint
    kw = {"input_ids": torch.tensor([[1, 2, 3, 4, 5, 6]]), "position_ids": torch.arange(6)[None], "use_cache": False}
    dyn = {"input_ids": {1: torch.export.Dim.AUTO}, "position_ids": {1: torch.export.Dim.AUTO}, "use_cache": None}
    ep = torch.export.export(model, (), kw, dynamic_shapes=dyn, strict=False)
    torch.export.save(ep, tmp_path / "llama.pt2")
    _cli(str(tmp_path / "llama.pt2"), "-o", str(tmp_path / "out"))
    info = json.loads((tmp_path / "out" / "report.json").read_text())
    assert info["kind"] == "pt2" and info["rewritten"] == 2
    r = _cli("run", str(tmp_path / "out"), "--ids", "5 6 7 8 9 10 11", "--max-new-tokens", str(NEW))
    assert f"-> {_hf_greedy(model, PROMPTS[1], NEW)}" in r.stdout


# ----------------------------------------------------------------------------- errors


def _error(capsys, *args) -> tuple[int, str]:
    code = main(list(args))
    err = capsys.readouterr().err.strip()
    return code, err


def test_missing_checkpoint(tmp_path, capsys):
    code, err = _error(capsys, str(tmp_path / "nope"), "-o", str(tmp_path / "out"))
    assert code == 2 and "not found" in err and "demo" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_token_type_runs_must_be_positive(tmp_path, capsys):
    code, err = _error(capsys, "demo", "-o", str(tmp_path / "out"), "--token-type-runs", "0")
    assert code == 2 and "--token-type-runs must be >= 1, got 0" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_folder_without_config(tmp_path, capsys):
    (tmp_path / "ck").mkdir()
    code, err = _error(capsys, str(tmp_path / "ck"), "-o", str(tmp_path / "out"))
    assert code == 2 and "without config.json" in err


def test_corrupt_weights(tmp_path, capsys, checkpoint):
    path, _ = checkpoint
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((path / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    code, err = _error(capsys, str(bad), "-o", str(tmp_path / "out"))
    assert code == 2 and "could not load the weights" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_unknown_architecture(tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"model_type": "definitely-not-a-model", "architectures": ["X"]}))
    code, err = _error(capsys, str(ck), "-o", str(tmp_path / "out"))
    assert code == 2 and "unknown architecture 'definitely-not-a-model'" in err


def test_no_attention_found(tmp_path, capsys):
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    ep = torch.export.export(mlp, (torch.randn(3, 4),))
    torch.export.save(ep, tmp_path / "mlp.pt2")
    code, err = _error(capsys, str(tmp_path / "mlp.pt2"), "-o", str(tmp_path / "out"))
    assert code == 2 and "no attention found" in err and "nothing was written" in err
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == ["mlp.pt2"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_unsupported_target(tmp_path, capsys, checkpoint):
    path, _ = checkpoint
    code, err = _error(capsys, str(path), "-o", str(tmp_path / "out"), "--target", "cuda")
    assert code == 2 and "needs an NVIDIA GPU" in err and "--target cpu" in err


def test_out_exists_without_force(tmp_path, checkpoint):
    path, _ = checkpoint
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    r = _cli(str(path), "-o", str(tmp_path / "out"), check=False)
    assert r.returncode == 2 and "exists; pass --force" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert os.listdir(tmp_path / "out") == ["keep.txt"]


def test_run_and_inspect_errors(tmp_path, capsys, rewritten):
    out, _, _ = rewritten
    code, err = _error(capsys, "inspect", str(tmp_path))
    assert code == 2 and "report.json" in err
    code, err = _error(capsys, "run", str(out), "--prompt", "hello")
    assert code == 2 and "no tokenizer" in err and "--ids" in err
    code, err = _error(capsys, "run", str(out), "--ids", "1 2 999999")
    assert code == 2 and "outside the vocabulary" in err
    code, err = _error(capsys, "inspect", str(out), "--site", "nope")
    assert code == 2 and "no site 'nope'" in err


def test_demo_main_job(tmp_path):
    """The README's main-job command: the built-in demo rewritten, reported, and generating its text."""
    r = _cli_process("demo", "-o", str(tmp_path / "out"), "--run", "--max-new-tokens", "120")
    assert "2 of 2 attention sites rewritten" in r.stdout
    assert "[0] Beautiful is better than ugly.\nExplicit is better than implicit." in r.stdout
    info = json.loads((tmp_path / "out" / "report.json").read_text())
    assert info["tokenizer"] and info["default_prompt"] == "Beautiful is"
