"""Loading never runs code from the file: crafted programs are refused and their payloads never run."""

import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

import pagedattn
from pagedattn.checkpoint import CheckpointError, load_checkpoint
from pagedattn.safe_archive import UnsafeArchive, check_expression, check_treespec, read_exported_program

from . import zoo


class _Payload:
    """Unpickling this runs ``touch <path>``: the marker of code run from a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """A real saved program (NanoGPT-style model) to tamper with."""
    m = zoo.NanoGPT().eval()
    rm = pagedattn.rewrite(m, zoo.example_args("nanogpt"))
    path = tmp_path_factory.mktemp("prog") / "model.pt2"
    rm.save(str(path))
    return path


def _rewrite_archive(src, dst, change):
    """Copy a zip archive, passing each (name, bytes) through ``change`` (which may return None to drop)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = change(info.filename, zin.read(info.filename))
            if data is not None:
                zout.writestr(info, data)


def _marker(tmp_path):
    path = tmp_path / "pwned"
    assert not path.exists()
    return path


def test_our_programs_load_safely(program):
    rm = pagedattn.load(str(program))
    assert rm.num_sites == 1
    with zipfile.ZipFile(program) as z:  # nothing pickled is stored: the example inputs record is empty
        assert [z.read(n) for n in z.namelist() if "sample_inputs" in n] == [b""]


def test_pickled_example_inputs_are_never_unpickled(program, tmp_path):
    marker = _marker(tmp_path)
    crafted = tmp_path / "inputs.pt2"
    payload = pickle.dumps(_Payload(marker))
    _rewrite_archive(program, crafted, lambda n, d: payload if "sample_inputs" in n else d)
    rm = pagedattn.load(str(crafted))  # a program needs no example inputs: they are not read at all
    assert rm.num_sites == 1 and not marker.exists()
    with pytest.raises(UnsafeArchive, match="example inputs"):  # a rewrite needs them: weights_only, no fallback
        read_exported_program(str(crafted), example_inputs=True)
    assert not marker.exists()


def _pickle_first_weight(program, crafted, marker):
    def change(name, data):
        if name.endswith("model_weights_config.json"):
            cfg = json.loads(data)
            first = next(iter(cfg["config"].values()))
            first["use_pickle"] = True
            change.path = first["path_name"]
            return json.dumps(cfg).encode()
        return data

    _rewrite_archive(program, crafted, change)
    _rewrite_archive(crafted, str(crafted) + ".tmp",
                     lambda n, d: pickle.dumps(_Payload(marker)) if n.endswith("/" + change.path) else d)
    shutil.move(str(crafted) + ".tmp", crafted)


def test_pickled_weights_are_refused(program, tmp_path):
    marker = _marker(tmp_path)
    crafted = tmp_path / "weights.pt2"
    _pickle_first_weight(program, crafted, marker)
    with pytest.raises(UnsafeArchive, match="stored pickled"):
        pagedattn.load(str(crafted))
    assert not marker.exists()


def test_spec_naming_an_arbitrary_module_is_refused(program, tmp_path, monkeypatch):
    # a local module the spec names would run on import; `this` prints the Zen of Python
    (tmp_path / "evil_spec_module.py").write_text(f"open({str(tmp_path / 'pwned')!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("this", "evil_spec_module"):
        crafted = tmp_path / f"spec_{module}.pt2"

        def change(name, data, module=module):
            if name.endswith("extra/pagedattn.json"):
                info = json.loads(data)
                info["out_spec"] = json.dumps([1, {"type": f"{module}.Zen", "context": "[]", "children_spec": []}])
                return json.dumps(info).encode()
            return data

        _rewrite_archive(program, crafted, change)
        was_loaded = module in sys.modules
        with pytest.raises(UnsafeArchive, match="neither registered"):
            pagedattn.load(str(crafted))
        assert (module in sys.modules) == was_loaded
    assert not (tmp_path / "pwned").exists()


def test_size_expression_with_code_is_refused(program, tmp_path):
    marker = _marker(tmp_path)
    crafted = tmp_path / "expr.pt2"

    def change(name, data):
        if name.endswith("models/model.json"):
            text = data.decode()
            i = text.index('"expr_str": "') + len('"expr_str": "')
            j = text.index('"', i)
            evil = f"__import__('os').system('touch {marker}')"
            return (text[:i] + evil.replace("'", "\\u0027") + text[j:]).encode()
        return data

    _rewrite_archive(program, crafted, change)
    with pytest.raises(UnsafeArchive, match="size expression"):
        pagedattn.load(str(crafted))
    assert not marker.exists()


@pytest.mark.parametrize("expr", ["Mul(Integer(2), Symbol('s0', positive=True, integer=True))", "s0 + 2*u1",
                                  "Max(1, s3)", "FloorDiv(s0, 16)"])
def test_size_expressions_torch_writes_are_accepted(expr):
    check_expression(expr, "test")


@pytest.mark.parametrize("expr", ["__import__('os')", "s0.__class__", "lambda: 1", "Symbol('a b')", "getattr(s0, 'x')"])
def test_size_expressions_that_are_not_arithmetic_are_refused(expr):
    with pytest.raises(UnsafeArchive):
        check_expression(expr, "test")


def test_specs_with_enums_or_foreign_defaultdict_factories_are_refused():
    enum_ctx = json.dumps([1, {"type": "builtins.dict", "context": json.dumps([{"__enum__": True, "fqn": "os:sep",
                                                                                 "name": "x"}]), "children_spec": []}])
    with pytest.raises(UnsafeArchive, match="enum"):
        check_treespec(enum_ctx, "test")
    dd = json.dumps([1, {"type": "collections.defaultdict", "children_spec": [],
                         "context": {"default_factory_module": "os", "default_factory_name": "system",
                                     "dict_context": []}}])
    with pytest.raises(UnsafeArchive, match="defaultdict"):
        check_treespec(dd, "test")


def test_rewrite_model_refuses_a_crafted_export_program(program, tmp_path):
    """``rewrite-model X.pt2`` reads a user's program with its example inputs: pickles refused there too."""
    marker = _marker(tmp_path)
    m = zoo.NanoGPT().eval()
    ep = torch.export.export(m, zoo.example_args("nanogpt"))
    src = tmp_path / "user.pt2"
    torch.export.save(ep, str(src))
    assert load_checkpoint(str(src)).program is not None  # plain tensors as example inputs: accepted
    crafted = tmp_path / "user_crafted.pt2"
    payload = pickle.dumps(_Payload(marker))
    _rewrite_archive(src, crafted, lambda n, d: payload if "sample_inputs" in n else d)
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_checkpoint(str(crafted))
    r = subprocess.run([sys.executable, "-m", "pagedattn.cli", str(crafted), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "refusing to load" in r.stderr and r.stderr.count("error") == 1, r.stderr
    assert not marker.exists()
