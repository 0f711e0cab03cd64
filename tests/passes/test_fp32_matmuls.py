"""bf16 matmuls in fp32 on CPUs without a native bf16 GEMM (``Fp32Matmuls``, ``RewrittenModel.compile_paged``)."""

import pytest
import torch

import pagedattn
from pagedattn import PagedEngine, RewrittenModel
from pagedattn.backends import build_metadata
from pagedattn.passes import Fp32Matmuls, PassContext, fp32_matmuls, run_pipeline
from pagedattn.runtime import paged_context
from pagedattn.tracing import copy_graph_module

from ..support import tiny_model


@pytest.fixture
def no_native_bf16(monkeypatch):
    """Behave as on an AVX2-only CPU whatever this one has."""
    monkeypatch.setattr(fp32_matmuls, "native_cpu_matmul", lambda dtype: dtype not in (torch.bfloat16, torch.float16))


def _rewritten(dtype):
    m = tiny_model("llama", "eager").to(dtype)
    ids = torch.arange(8)[None] % 100
    return pagedattn.rewrite(m, (), {"input_ids": ids, "position_ids": torch.arange(8)[None], "use_cache": False})


@pytest.fixture(scope="module")
def bf16():
    """The tiny Llama in bf16, rewritten (tests that change its graph work on ``_with_graph`` copies)."""
    return _rewritten(torch.bfloat16)


def _with_graph(rm, gm):
    """The same rewritten model with another paged graph."""
    return RewrittenModel(rm.dropin_module, gm, rm.in_spec, rm.out_spec, rm.report, rm.cache_specs, rm.backend,
                          rm.block_size, example_inputs=rm.example_inputs, info=rm.info)


def _fp32(rm, cache_weights=True):
    """The pass on a copy of the paged graph; the copy and the pass's report."""
    gm = copy_graph_module(rm.graph_module)
    (report,) = run_pipeline(gm, PassContext(), (Fp32Matmuls(cache_weights=cache_weights),))
    return gm, report


def _paged_logits(gm, rm, tokens):
    caches = rm.allocate_kv_caches(4)
    meta = build_metadata([(0, len(tokens), [0, 1, 2, 3])], rm.block_size)
    kwargs = {"input_ids": torch.tensor([tokens]), "position_ids": torch.arange(len(tokens))[None], "use_cache": False}
    flat = rm.flatten_inputs((), kwargs)
    with torch.no_grad(), paged_context(caches, meta) as ctx:
        return gm(*flat, *ctx.graph_inputs(rm.num_sites))[0]


@pytest.mark.parametrize("cache_weights", [True, False])
def test_bf16_linears_run_in_fp32(no_native_bf16, cache_weights, bf16):
    rm = bf16
    gm = rm.graph_module
    before = gm.code
    new, report = _fp32(rm, cache_weights)
    n = sum(node.target is torch.ops.aten.linear.default for node in gm.graph.nodes)
    assert n > 0 and report.changed and report.detail == f"{n} matmuls in fp32"
    assert gm.code == before  # the pass ran on a copy: the rewritten model's graph is untouched
    fp32 = {k: b for k, b in new.named_buffers() if k.startswith("_fp32_")}
    if cache_weights:
        assert fp32 and all(b.dtype == torch.float32 for b in fp32.values())
    else:
        assert not fp32
    tokens = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    ref, got = _paged_logits(gm, rm, tokens), _paged_logits(new, rm, tokens)
    assert got.dtype == ref.dtype == torch.bfloat16
    # the same bf16 model to within bf16 rounding (fp32 sums in another order)
    torch.testing.assert_close(got.float(), ref.float(), atol=0.05, rtol=0.05)
    assert torch.equal(got[0].argmax(-1), ref[0].argmax(-1))


def test_native_or_fp32_models_are_left_alone(monkeypatch, bf16):
    rm = _rewritten(torch.float32)
    gm, report = _fp32(rm)
    assert not report.changed and gm.code == rm.graph_module.code
    rm16 = bf16
    monkeypatch.setattr(fp32_matmuls, "native_cpu_matmul", lambda dtype: True)
    gm, report = _fp32(rm16)
    assert not report.changed and report.detail == "0 matmuls in fp32" and gm.code == rm16.graph_module.code


def test_engine_serves_the_fp32_matmul_graph(no_native_bf16, bf16):
    prompts = [[5, 17, 9, 30, 2, 8, 1], [3, 3, 4], list(range(40, 60))]
    want = PagedEngine(bf16, compile=False, block_size=4, max_num_tokens=16).generate(prompts, max_new_tokens=4)
    # the packing check passes although the fp32 sums differ by an ulp with the step's size
    got = PagedEngine(_with_graph(bf16, _fp32(bf16)[0]), compile=False, block_size=4, max_num_tokens=16).generate(
        prompts, max_new_tokens=4)
    # bf16 greedy tokens may part after a rounding tie; the first ones agree on this model
    assert [g[:2] for g in got] == [w[:2] for w in want]


def test_compile_paged_runs_the_pass_before_compiling(no_native_bf16, bf16):
    # Dynamo's eager backend keeps this fast; the Inductor path of PagedEngine(compile=True) is
    # tests/runtime/test_engine.py::test_inductor_compiled_engine_matches_hf
    tokens = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    want = _paged_logits(_fp32(bf16)[0], bf16, tokens)
    before = bf16.graph_module.code
    rm = _with_graph(bf16, bf16.graph_module).compile_paged("eager")
    assert any(k.startswith("_fp32_") for k, _ in rm.graph_module._orig_mod.named_buffers())
    assert torch.equal(_paged_logits(rm.graph_module, rm, tokens), want)
    assert bf16.graph_module.code == before  # the pass ran on a copy of the graph
    converted = _with_graph(bf16, bf16.graph_module).compile_paged("eager", cpu_fp32_matmuls="convert")
    assert not any(k.startswith("_fp32_") for k, _ in converted.graph_module._orig_mod.named_buffers())
    assert "aten.to.dtype" in converted.graph_module._orig_mod.code
    off = _with_graph(bf16, bf16.graph_module).compile_paged("eager", cpu_fp32_matmuls="off")
    assert off.graph_module._orig_mod is bf16.graph_module
    with pytest.raises(ValueError, match="cpu_fp32_matmuls"):
        rm.compile_paged(cpu_fp32_matmuls="sometimes")
