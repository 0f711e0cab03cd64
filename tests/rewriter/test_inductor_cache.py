"""Inductor's FX graph cache for steps compiled with freezing: oneDNN-packed weights keyed by shape, dtype and proved
layout (pagedattn.inductor_cache)."""

import contextlib

import pytest
import torch
from torch._dynamo.utils import counters

from pagedattn import inductor_cache, program
from pagedattn.backends import cpu_linear
from pagedattn.inductor_cache import frozen_steps_cacheable
from pagedattn.program import inductor_freezing

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 96), torch.nn.Linear(96, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + x


def _compile_and_run(model, x, dynamic=True, options=None):
    """A fresh compile of ``model`` with freezing (Dynamo reset first): its output and the FX cache's counters."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="inductor", dynamic=dynamic, options=options)
    if dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad(), inductor_freezing(True):
        out = compiled(x)
    return out, {k[len("fxgraph_cache_"):]: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}


@pytest.fixture
def model(tmp_path, monkeypatch, fresh_dynamo):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    with torch._inductor.config.patch(fx_graph_cache=True):
        yield Mlp().eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_second_compile_of_a_frozen_step_loads_it_from_the_cache(model, dtype):
    model = model.to(dtype)
    tol = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 2e-2}  # bf16: fused against eager rounding
    x = torch.randn(5, 64, dtype=dtype)
    with torch.no_grad():
        want = model(x)
    first, stats = _compile_and_run(model, x)
    assert stats == {"miss": 1}, stats
    again, stats = _compile_and_run(model, x)
    assert stats == {"hit": 1}, stats
    torch.testing.assert_close(first, want, **tol)
    assert torch.equal(again, first)
    # another number of rows through the step loaded from the cache (one graph for every size)
    y = torch.randn(9, 64, dtype=dtype)
    out, stats = _compile_and_run(model, y)
    assert stats == {"hit": 1}, stats
    with torch.no_grad():
        torch.testing.assert_close(out, model(y), **tol)


def test_weights_packed_in_another_layout_are_compiled_again(model, monkeypatch):
    # the small-linear pass decides by the proved layout: a step compiled for one is never loaded for another
    x = torch.randn(5, 64)
    _compile_and_run(model, x)
    monkeypatch.setattr(cpu_linear, "proven_layout", lambda packed: -1)
    _, stats = _compile_and_run(model, x)
    assert stats == {"miss": 1}, stats


def test_weights_whose_bytes_cannot_be_read_leave_the_step_uncached(model, monkeypatch):
    def unreadable(packed):
        raise RuntimeError("this torch has no oneDNN tensors")

    monkeypatch.setattr(inductor_cache, "packed_weight_key", unreadable)
    x = torch.randn(5, 64)
    out, stats = _compile_and_run(model, x)
    assert stats == {"bypass": 1}, stats
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))


def test_new_weights_of_the_same_shapes_reuse_the_code_with_their_own_values(model):
    x = torch.randn(5, 64)
    _compile_and_run(model, x)
    other = Mlp().eval()  # other values, the same shapes and layout
    out, stats = _compile_and_run(other, x)
    assert stats == {"hit": 1}, stats
    with torch.no_grad():
        torch.testing.assert_close(out, other(x))


class TwoHeads(torch.nn.Module):
    """Two linears of one input, without biases (as Llama's q/k/v): freezing concatenates them, and MKL's linear
    keeps the joint weight transposed."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x)], -1) * 2


@pytest.mark.skipif(not cpu_linear.mkl_linear_targets() or not cpu_linear.small_linears_available(torch.float32),
                    reason="needs MKL's packed linear and the native small-row kernel")
def test_a_step_of_one_token_with_mkls_linears_is_cached_and_takes_its_plain_rows_from_its_own_weights(model,
                                                                                                     monkeypatch):
    # a static number of rows gets MKL's linears; the small-linear pass gives a transposed plain weight a contiguous
    # copy of its own, which a step loaded from the cache must make from the weights it is loaded for
    restored = []
    real = cpu_linear.restore_plain_rows
    monkeypatch.setattr(inductor_cache, "restore_plain_rows", lambda gm, names: restored.append(list(names)) or
                        real(gm, names))
    options = {"post_grad_custom_pre_pass": program.PostGradPasses((cpu_linear.SmallLinears(),))}
    x = torch.randn(1, 64)
    first = TwoHeads().eval()
    out, stats = _compile_and_run(first, x, dynamic=False, options=options)
    assert stats == {"miss": 1}, stats
    other = TwoHeads().eval()  # other values, the same shapes
    again, stats = _compile_and_run(other, x, dynamic=False, options=options)
    assert stats == {"hit": 1}, stats
    assert any(n.endswith(cpu_linear.plain_rows_name("")) for names in restored for n in names), restored
    with torch.no_grad():
        torch.testing.assert_close(out, first(x))
        torch.testing.assert_close(again, other(x))
        assert not torch.allclose(again, first(x))


def test_without_the_hooks_inductor_declines_packed_weights(model, monkeypatch):
    # the upstream behaviour this module works around; when torch caches them itself, this test says so
    monkeypatch.setattr(program, "frozen_steps_cacheable", contextlib.nullcontext)
    _, stats = _compile_and_run(model, torch.randn(5, 64))
    assert stats == {"bypass": 1}, stats


def test_the_hooks_are_undone_on_leaving():
    from torch._inductor import codecache, output_code

    def hooked():
        return (codecache.CacheabilityValidator.__dict__["check_tensor"], codecache.FxGraphCachePickler._reduce_tensor,
                output_code.CompiledFxGraphConstantsWithGm.unwrap)

    before = hooked()
    with frozen_steps_cacheable():
        assert all(a is not b for a, b in zip(hooked(), before))
    assert hooked() == before
