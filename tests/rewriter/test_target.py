"""The backend is a parameter: an ``AttentionBackend`` instance given to ``rewrite``, ``load``,
``paged_context``, ``torch.compile``'s options or ``PagedEngine`` is the one the paged ops call, and the
per-device default stays as it was."""

import collections

import pytest
import torch

import pagedattn
from pagedattn import PagedEngine
from pagedattn.backends import active_backend, build_metadata, get_backend
from pagedattn.backends.sdpa_cpu import SdpaCpuBackend
from pagedattn.compile import compiled_graphs

from ..support import hf_generate, prompts, run_packed, tiny_model
from . import zoo

CPU = torch.device("cpu")


class CountingBackend(SdpaCpuBackend):
    """The CPU backend, counting the calls it serves."""

    name = "counting_cpu"

    def __init__(self):
        self.calls = collections.Counter()

    def write(self, *args, **kwargs):
        self.calls["write"] += 1
        return super().write(*args, **kwargs)

    def attend(self, *args, **kwargs):
        self.calls["attend"] += 1
        return super().attend(*args, **kwargs)


@pytest.fixture
def default_untouched():
    """The CPU default before the test; afterwards it must still be the default, and be what the ops use."""
    default = get_backend("cpu")
    assert type(default) is SdpaCpuBackend
    yield default
    assert get_backend("cpu") is default and active_backend(CPU) is default


def _gqa(target="cpu"):
    m = zoo.GQAExpand().eval()
    return m, pagedattn.rewrite(m, zoo.example_args("gqa_expand"), target=target, block_size=4)


def test_rewrite_with_an_instance_runs_its_paged_graph_there(default_untouched):
    mine = CountingBackend()
    m, rm = _gqa(mine)
    assert rm.backend is mine and rm.target == "cpu"
    a, b = torch.randn(1, 6, zoo.C), torch.randn(1, 3, zoo.C)
    pa, pb = run_packed(rm, [a, b])
    assert mine.calls == {"write": 1, "attend": 1}  # one site, one step
    with torch.no_grad():
        torch.testing.assert_close(pa, m(a), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(pb, m(b), atol=2e-5, rtol=1e-4)
    _, plain = _gqa()
    assert plain.backend is default_untouched
    run_packed(plain, [a])
    assert mine.calls["attend"] == 1  # a model rewritten for the default does not reach the instance


def test_the_context_backend_overrides_the_programs(default_untouched):
    mine, theirs = CountingBackend(), CountingBackend()
    _, rm = _gqa(mine)
    run_packed(rm, [torch.randn(1, 5, zoo.C)], backend=theirs)
    assert theirs.calls["attend"] == 1 and mine.calls["attend"] == 0


def test_a_loaded_program_runs_on_the_backend_it_is_given(default_untouched, tmp_path):
    _, rm = _gqa()
    rm.save(str(tmp_path / "m.pt2"))
    mine = CountingBackend()
    loaded = pagedattn.load(str(tmp_path / "m.pt2"), backend=mine)
    assert loaded.backend is mine
    caches = loaded.allocate_kv_caches(4)
    with torch.no_grad(), pagedattn.paged_context(caches, build_metadata([(0, 6, [1, 2])], 4)):
        loaded(torch.randn(1, 6, zoo.C))
    assert mine.calls["attend"] == 1
    assert pagedattn.load(str(tmp_path / "m.pt2")).backend is default_untouched  # its target's default


def test_compiled_graphs_take_the_instance_from_the_options(default_untouched, fresh_dynamo):
    mine = CountingBackend()
    m = zoo.GQAExpand().eval()
    c = torch.compile(m, backend="pagedattn", options={"inner": "eager", "target": mine})
    x = torch.randn(1, 6, zoo.C)
    with torch.no_grad(), compiled_graphs() as graphs:
        c(x)  # drop-in: compiles; no paged op runs
        caches = mine.allocate_kv_caches(graphs[0].cache_specs, num_blocks=4, block_size=16)
        with pagedattn.paged_context(caches, build_metadata([(0, 6, [1])], 16)):
            out = c(x)
    assert graphs[0].backend is mine and mine.calls["attend"] == 1
    torch.testing.assert_close(out, m(x), atol=2e-5, rtol=1e-4)


def test_engine_serves_through_the_instance(default_untouched):
    m = tiny_model("llama")
    mine = CountingBackend()
    ps = prompts()[:3]
    engine = PagedEngine(m, compile=False, target=mine, block_size=4)  # rewritten by the engine, for the instance
    assert engine.backend is mine and engine.servable.backend is mine and engine.model.backend is mine
    before = mine.calls["attend"]  # the packing check ran through it already
    assert before > 0
    assert engine.generate(ps, max_new_tokens=5) == hf_generate(m, ps, 5)
    assert mine.calls["attend"] > before
