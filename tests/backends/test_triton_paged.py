"""The Triton paged attention kernel's plan, refusals and place in the static backend; its numerics run from
``triton_cases.py`` in Triton's interpreter (a process of their own, see there) and on CUDA
(``test_triton_paged_gpu.py``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedattn.backends import AttentionParams, get_backend, static_paged, triton_paged

from ..support import SHAPES, batch_params, make_batch


def _interpreted_cases(selection: str) -> None:
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'pagedattn[test]')")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-m",
                          selection, "tests/backends/triton_cases.py"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def test_the_kernel_matches_the_reference_in_tritons_interpreter():
    # every feature, layout and step shape once (the interpreter is pure Python: minutes on 2 cores)
    _interpreted_cases("not slow")


@pytest.mark.slow
def test_the_kernel_matches_the_reference_in_tritons_interpreter_for_the_rest_of_the_cross_product():
    _interpreted_cases("slow")


@pytest.mark.parametrize("width, rows, splits, per", [(1, 1, 1, 1), (7, 4, 7, 1), (16, 4, 16, 1), (17, 4, 9, 2),
                                                      (64, 4, 16, 4), (100, 4, 15, 7), (64, 256, 4, 16),
                                                      (64, 512, 2, 32), (64, 4096, 1, 64), (5, 100, 5, 1)])
def test_split_plan_covers_the_row_in_equal_splits_as_the_batch_needs(width, rows, splits, per):
    assert triton_paged.split_plan(width, rows) == (splits, per)
    assert splits <= triton_paged.MAX_SPLITS and (splits - 1) * per < width <= splits * per


def test_calls_it_does_not_take_say_why(monkeypatch):
    monkeypatch.setattr(triton_paged, "available", lambda device: True)
    q = torch.randn(3, 4, 64)
    p = AttentionParams(0.125, True, 0, 0.0, None, 2, 64)
    assert triton_paged.usable(q, torch.zeros(2, 4, 16, 2, 64), p)
    assert "block size 8" in triton_paged.unusable_reasons(q, torch.zeros(2, 4, 8, 2, 64), p)[0]
    assert "block size 24" in triton_paged.unusable_reasons(q, torch.zeros(2, 4, 24, 2, 64), p)[0]
    assert "head size" in triton_paged.unusable_reasons(torch.randn(3, 4, 320), torch.zeros(2, 4, 16, 2, 320),
                                                        p)[0]
    prog = AttentionParams(0.125, False, 0, 0.0, None, 2, 64, position_mod='{"version": 1}')
    assert "position program" in triton_paged.unusable_reasons(q, torch.zeros(2, 4, 16, 2, 64), prog)[0]
    monkeypatch.undo()
    if triton_paged.available("cpu"):
        pytest.skip("this process runs Triton's interpreter")
    assert triton_paged.unusable_reasons(q, torch.zeros(2, 4, 16, 2, 64), p)[0] in (
        "Triton is not installed", "not a CUDA device")


def test_the_static_backend_takes_the_kernel_where_it_applies_once_it_agrees(monkeypatch, caplog):
    # the captured step's backend: the kernel where usable and where its first call of a kind gave the gather
    # path's result; a kernel compiled wrong (here a stand-in off by 1) is dropped for that kind, with a warning
    b = make_batch(SHAPES["all_decode"], num_heads=4, num_kv_heads=2)
    p = batch_params(b, 0.125)
    static_paged.write(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    plain = static_paged.attend(b.query, b.kv_cache, b.meta, p)

    def run(offset):
        calls = []
        monkeypatch.setattr(triton_paged, "attend", lambda *a: calls.append(1) or plain + offset)
        backend = static_paged.StaticPagedBackend(get_backend("cpu"))
        outs = [backend.attend(b.query, None, None, b.kv_cache, b.meta, p) for _ in range(3)]
        return outs, len(calls)

    monkeypatch.setattr(triton_paged, "available", lambda device: False)
    outs, calls = run(0.0)
    assert calls == 0 and all(torch.equal(o, plain) for o in outs)
    monkeypatch.setattr(triton_paged, "available", lambda device: True)
    outs, calls = run(1e-5)
    assert calls == 3 and all(torch.equal(o, plain + 1e-5) for o in outs)  # once a call: the first one checked on its own result
    with caplog.at_level("WARNING", logger="pagedattn"):
        outs, calls = run(1.0)
    assert calls == 1 and all(torch.equal(o, plain) for o in outs)
    assert "differs from the portable path by 1" in caplog.text

    def broken(*a):
        raise RuntimeError("PassManager::run failed\nMLIR details")

    caplog.clear()
    with caplog.at_level("WARNING", logger="pagedattn"):
        monkeypatch.setattr(triton_paged, "attend", broken)
        backend = static_paged.StaticPagedBackend(get_backend("cpu"))
        out = backend.attend(b.query, None, None, b.kv_cache, b.meta, p)
    assert torch.equal(out, plain) and "failed (RuntimeError: PassManager::run failed)" in caplog.text
    program = batch_params(b, 0.125, causal=False, mod=('{"version": 1}', None))
    assert not triton_paged.usable(b.query, b.kv_cache, program)  # a position program keeps the static path


def test_the_static_backend_takes_the_kernel_write_once_it_stored_what_it_was_given(monkeypatch, caplog):
    # the same for the cache write: checked on its first call of a kind (the rows read back), then used; a write
    # that stores nothing (a stand-in) is dropped with a warning, and the scatter writes the step
    b = make_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, pad_tokens=3)
    want = b.kv_cache.clone()
    static_paged.write(b.key, b.value, want, b.meta.slot_mapping)
    monkeypatch.setattr(triton_paged, "write_usable", lambda *a: True)

    def run(kernel):
        calls = []
        monkeypatch.setattr(triton_paged, "write", lambda *a: calls.append(1) or kernel(*a))
        backend = static_paged.StaticPagedBackend(get_backend("cpu"))
        cache = b.kv_cache.clone()
        for _ in range(3):
            backend.write(b.key, b.value, cache, b.meta.slot_mapping)
        return cache, len(calls)

    cache, calls = run(static_paged.write)
    assert calls == 3 and torch.equal(cache, want)
    with caplog.at_level("WARNING", logger="pagedattn"):
        cache, calls = run(lambda *a: None)
    assert calls == 1 and torch.equal(cache, want) and "stored other values" in caplog.text

    def broken(*a):
        raise RuntimeError("out of resources")

    with caplog.at_level("WARNING", logger="pagedattn"):
        cache, calls = run(broken)
    assert torch.equal(cache, want) and "failed (RuntimeError: out of resources)" in caplog.text


def test_the_first_call_check_scales_with_the_outputs_size(monkeypatch):
    # values of ~100: a kernel within float rounding of the gather path (relative 5e-4) agrees, one off by 1 % does
    # not, though both differences are far above the tolerance at unit scale
    b = make_batch(SHAPES["all_decode"], num_heads=4, num_kv_heads=2)
    b.value.mul_(100.0)
    p = batch_params(b, 0.125)
    static_paged.write(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    plain = static_paged.attend(b.query, b.kv_cache, b.meta, p)
    assert plain.abs().max() > 50
    monkeypatch.setattr(triton_paged, "available", lambda device: True)
    for rel, used in ((5e-4, True), (1e-2, False)):
        monkeypatch.setattr(triton_paged, "attend", lambda *a, rel=rel: plain * (1 + rel))
        backend = static_paged.StaticPagedBackend(get_backend("cpu"))
        out = backend.attend(b.query, None, None, b.kv_cache, b.meta, p)
        assert torch.equal(out, plain * (1 + rel) if used else plain)
