"""bf16 matmuls in fp32 on CPUs without a native bf16 GEMM (``pagedattn.cpu_matmul``)."""

import pagedattn
import pytest
import torch
from pagedattn import PagedEngine, cpu_matmul
from pagedattn.backends import build_metadata
from pagedattn.runtime import paged_context

from .hf_models import tiny_model


@pytest.fixture
def no_native_bf16(monkeypatch):
    """Behave as on an AVX2-only CPU whatever this one has."""
    monkeypatch.setattr(cpu_matmul, "native_cpu_matmul", lambda dtype: dtype not in (torch.bfloat16, torch.float16))


def _rewritten(dtype):
    m = tiny_model("llama", "eager").to(dtype)
    ids = torch.arange(8)[None] % 100
    return m, pagedattn.rewrite(m, (), {"input_ids": ids, "position_ids": torch.arange(8)[None], "use_cache": False})


def _paged_logits(gm, rm, tokens):
    caches = rm.allocate_kv_caches(4)
    meta = build_metadata([(0, len(tokens), [0, 1, 2, 3])], rm.block_size)
    kwargs = {"input_ids": torch.tensor([tokens]), "position_ids": torch.arange(len(tokens))[None], "use_cache": False}
    flat = rm._flatten((), kwargs)
    with torch.no_grad(), paged_context(caches, meta) as ctx:
        return gm(*flat, *ctx.graph_inputs(rm.num_sites))[0]


@pytest.mark.parametrize("cache_weights", [True, False])
def test_bf16_linears_run_in_fp32(no_native_bf16, cache_weights):
    _, rm = _rewritten(torch.bfloat16)
    gm = rm.graph_module
    before = gm.code
    new, n = cpu_matmul.fp32_matmuls(gm, cache_weights=cache_weights)
    assert n == sum(node.target is torch.ops.aten.linear.default for node in gm.graph.nodes) > 0
    assert gm.code == before  # the original graph is untouched
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


def test_native_or_fp32_models_are_left_alone(monkeypatch):
    _, rm = _rewritten(torch.float32)
    assert cpu_matmul.fp32_matmuls(rm.graph_module) == (rm.graph_module, 0)
    _, rm16 = _rewritten(torch.bfloat16)
    monkeypatch.setattr(cpu_matmul, "native_cpu_matmul", lambda dtype: True)
    assert cpu_matmul.fp32_matmuls(rm16.graph_module) == (rm16.graph_module, 0)


def test_compiled_bf16_engine_uses_fp32_matmuls(no_native_bf16):
    _, rm = _rewritten(torch.bfloat16)
    eager = PagedEngine(rm, block_size=4, max_num_tokens=16)
    prompts = [[5, 17, 9, 30, 2, 8, 1], [3, 3, 4], list(range(40, 60))]
    want = eager.generate(prompts, max_new_tokens=4)
    _, rm2 = _rewritten(torch.bfloat16)
    # the packing check passes although the fp32 sums differ by an ulp with the step's size
    engine = PagedEngine(rm2, compile=True, block_size=4, max_num_tokens=16)
    assert any(k.startswith("_fp32_") for k, _ in rm2.graph_module._orig_mod.named_buffers())
    got = engine.generate(prompts, max_new_tokens=4)
    # bf16 greedy tokens may part after a rounding tie; the first ones agree on this model
    assert [g[:2] for g in got] == [w[:2] for w in want]
    with pytest.raises(ValueError, match="cpu_fp32_matmuls"):
        rm.compile_paged(cpu_fp32_matmuls="sometimes")
