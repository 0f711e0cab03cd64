"""``torch.compile(model, backend="pagedattn")``: zoo and Hugging Face models, recompiles, cache copies,
and what each compiled graph reports (``compiled_graphs``)."""

import subprocess
import sys
import time

import pytest
import torch
import torch._dynamo

import pagedattn
from pagedattn.backends import AttentionBackend, build_metadata
from pagedattn.compile import compiled_graphs, resolve_options

from ..support import tiny_model
from . import zoo
from .hf_models import example_inputs

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _sites(graphs) -> list[dict]:
    """Every site the graphs report, in order."""
    return [s for g in graphs for s in g.report]


SELF_ATTENTION = sorted(n for n in zoo.ATTENTION if n != "cross_attention")


class SideBySide(torch.nn.Module):
    """Every self-attention spelling of the zoo on the same input, outputs apart: one graph for all of them."""

    def __init__(self, names):
        super().__init__()
        self.names = names
        self.mods = torch.nn.ModuleList(zoo.ATTENTION[n][0]() for n in names)

    def forward(self, x):
        return tuple(m(x) for m in self.mods)


def _expected(name) -> tuple:
    e = zoo.ATTENTION[name][1]
    return (e["mask"], e.get("num_kv_heads", zoo.H), e.get("window"), e.get("softcap"), e.get("alibi", False))


def test_zoo_through_compile():
    # each spelling compiled once for the example's shapes, then again with dynamic sizes for another
    m = SideBySide(SELF_ATTENTION).eval()
    c = torch.compile(m, backend="pagedattn", options={"inner": "eager"})
    with torch.no_grad(), compiled_graphs() as graphs:
        for B, T in [(2, 8), (3, 13)]:
            (x,) = zoo.example_args("nanogpt", B, T, seed=T)
            for name, got, want in zip(SELF_ATTENTION, c(x), m(x)):
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=name)
    assert len(graphs) == 2  # the static compilation and the dynamic one
    for g in graphs:
        assert [s["status"] for s in g.report] == ["rewritten"] * len(SELF_ATTENTION), g.report
    # what each site is, as the dynamic graph sees it (8 keys of the static one show no window of 100)
    got = sorted(((s["mask"], s["num_kv_heads"], s["window"], s["softcap"], s["alibi"]) for s in graphs[1].report),
                 key=str)
    assert got == sorted(map(_expected, SELF_ATTENTION), key=str)


def _paged_in_steps_of_8(c, x, graphs) -> torch.Tensor:
    caches = graphs[0].backend.allocate_kv_caches(graphs[0].cache_specs, num_blocks=8, block_size=16)
    outs = []
    for start in range(0, x.shape[1], 8):  # paged steps of the first call's size
        with pagedattn.paged_context(caches, build_metadata([(start, 8, list(range(8)))], 16)):
            outs.append(c(x[:, start:start + 8]))
    return torch.cat(outs, 1)


def test_a_static_graph_refuses_paged_steps_past_its_sizes():
    # a graph Dynamo compiles for [1, 8, C] shows its mask at 8 keys only: causal there, while the model
    # has a window of 100; paged steps of that size over a longer cache would reuse it
    m = zoo.SlidingWindow().eval()
    c = torch.compile(m, backend="pagedattn", options={"inner": "eager"})
    x = torch.randn(1, 128, zoo.C, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), compiled_graphs() as graphs:
        c(x[:, :8])
        assert [s["mask_up_to"] for s in graphs[0].report] == [8]
        with pytest.raises(ValueError, match="longer than the 8 positions"):
            _paged_in_steps_of_8(c, x, graphs)


def test_a_dynamic_graph_keeps_a_wide_window_in_paged_steps():
    m = zoo.SlidingWindow().eval()  # a window of 100 keys
    c = torch.compile(m, backend="pagedattn", options={"inner": "eager"}, dynamic=True)
    x = torch.randn(1, 128, zoo.C, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), compiled_graphs() as graphs:
        c(x[:, :8])
        assert [(s["mask"], s["window"]) for s in graphs[0].report] == [("sliding_window", 100)]
        torch.testing.assert_close(_paged_in_steps_of_8(c, x, graphs), m(x), atol=2e-5, rtol=1e-4)


def test_cross_attention_through_compile():
    m = zoo.CrossAttention().eval()
    c = torch.compile(m, backend="pagedattn", options={"inner": "eager"})
    with torch.no_grad(), compiled_graphs() as graphs:
        for B, T in [(2, 8), (3, 13)]:
            args = zoo.example_args("cross_attention", B, T, seed=T)
            torch.testing.assert_close(c(*args), m(*args), atol=2e-5, rtol=1e-4)
    sites = _sites(graphs)
    assert sites and all(s["status"] == "rewritten" and s["mask"] == "none" for s in sites), sites
    assert all(not g.cache_specs for g in graphs)  # its keys are not the step's tokens: nothing to page


def test_zoo_through_inductor():
    # three spellings (a masked buffer, GQA by expand, SDPA) in one graph: one Inductor compilation per shape
    names = ["nanogpt", "gqa_expand", "sdpa_causal"]
    m = torch.nn.Sequential(*(zoo.ATTENTION[n][0]() for n in names)).eval()
    c = torch.compile(m, backend="pagedattn")
    with torch.no_grad(), compiled_graphs() as graphs:
        for B, T in [(2, 8), (3, 13)]:
            (x,) = zoo.example_args("nanogpt", B, T, seed=T)
            torch.testing.assert_close(c(x), m(x), atol=2e-5, rtol=1e-4)
    assert graphs and all(g.inner == "inductor" for g in graphs)
    for g in graphs:
        assert [s["status"] for s in g.report] == ["rewritten"] * 3, g.report
        assert [s.num_kv_heads for s in g.cache_specs] == [zoo.H, 2, zoo.H]


@pytest.mark.parametrize("name", sorted(zoo.NOT_ATTENTION))
def test_counter_examples_through_compile(name):
    m = zoo.NOT_ATTENTION[name][0]().eval()
    c = torch.compile(m, backend="pagedattn", options={"inner": "eager"})
    with torch.no_grad(), compiled_graphs() as graphs:
        args = zoo.example_args(name, 2, 8)
        torch.testing.assert_close(c(*args), m(*args))
    sites = _sites(graphs)
    assert graphs and sites, "the softmax must reach the backend as a site, to be left alone there"
    assert all(s["status"] == "skipped" for s in sites), sites
    expect = zoo.NOT_ATTENTION[name][1]
    assert all(expect in s["reason"] for s in sites) if expect else all(not s["attention"] for s in sites), sites
    assert all(not g.cache_specs for g in graphs)


@pytest.mark.parametrize("arch, impl, every_graph", [
    ("llama", "sdpa", True), ("gpt2", "eager", True), ("bloom", "eager", True),
    # decode over a sliding-window cache keeps only the window's keys: those graphs are left as they are
    ("mistral", "eager", False),
])
def test_generate_on_compiled_model_matches(arch, impl, every_graph):
    ids, mask = example_inputs(2, 7, left_pad=(0, 3), seed=4)
    ref = tiny_model(arch, impl).generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                          pad_token_id=0)
    model = tiny_model(arch, impl)
    model.forward = torch.compile(model.forward, backend="pagedattn", options={"inner": "eager"})
    with torch.no_grad(), compiled_graphs() as graphs:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    reports = [g.report for g in graphs]
    assert reports and reports[0] and all(s["status"] == "rewritten" for s in reports[0]), reports
    if every_graph:
        assert all(s["status"] == "rewritten" for r in reports for s in r), reports


def test_entry_point_needs_no_import():
    code = ("import torch\n"
            "m = torch.nn.Linear(4, 4)\n"
            "c = torch.compile(m, backend='pagedattn', options={'inner': 'eager'})\n"
            "print(c(torch.randn(2, 4)).shape)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "torch.Size([2, 4])" in r.stdout, r.stderr[-2000:]


def test_unknown_option_is_a_clear_error():
    c = torch.compile(zoo.NanoGPT().eval(), backend="pagedattn", options={"innr": "eager"})
    with pytest.raises(Exception, match="unknown pagedattn options"):
        c(torch.randn(1, 4, zoo.C))


def _paged_decode_steps(c, caches, lengths, block_size=16):
    """One decode token for each sequence of the given context lengths, flattened into [1, B]."""
    seqs = []
    nxt = 0
    for L in lengths:
        n = -(-(L + 1) // block_size)
        seqs.append((L, 1, list(range(nxt, nxt + n))))
        nxt += n
    meta = build_metadata(seqs, block_size)
    x = torch.randn(1, len(lengths), zoo.C)
    with torch.no_grad(), pagedattn.paged_context(caches, meta):
        return c(x)


def test_no_recompile_per_decode_step():
    m = zoo.GQAExpand().eval()
    c = torch.compile(m, backend="pagedattn")
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        c(torch.randn(1, 8, zoo.C))  # drop-in warm-up
    caches = None
    g = torch.Generator().manual_seed(0)
    for _step in range(100):
        batch = int(torch.randint(2, 9, (1,), generator=g))
        lengths = torch.randint(1, 200, (batch,), generator=g).tolist()
        if caches is None:
            caches = [torch.zeros(2, 256, 16, 2, zoo.D)]
        _paged_decode_steps(c, caches, lengths)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames <= 3, f"{frames} graphs compiled over 100 decode steps"


def test_decode_time_does_not_grow_with_cache_size():
    """A functionalized write would clone the whole cache each step: time would grow with it."""
    m = zoo.GQAExpand().eval()
    # dynamic: a graph of static sizes proves its mask for those sizes only, and paged steps over longer
    # caches are refused (test_a_static_graph_refuses_paged_steps_past_its_sizes)
    c = torch.compile(m, backend="pagedattn", dynamic=True)
    lengths = [40, 75, 12, 130]
    small = [torch.zeros(2, 8192, 16, 2, zoo.D)]  # 16 MiB
    large = [torch.zeros(2, 65536, 16, 2, zoo.D)]  # 8x the blocks: 128 MiB
    for caches in (small, large) * 3:
        _paged_decode_steps(c, caches, lengths)
    times = {id(small): [], id(large): []}
    for _ in range(25):  # interleaved, so drift on a shared machine hits both alike
        for caches in (small, large):
            t0 = time.perf_counter()
            _paged_decode_steps(c, caches, lengths)
            times[id(caches)].append(time.perf_counter() - t0)
    t_small, t_large = (sorted(times[id(x)])[12] for x in (small, large))
    assert t_large < t_small * 1.10 + 2e-4, f"decode step {t_small * 1e3:.2f} ms -> {t_large * 1e3:.2f} ms with 8x blocks"


class ScanThenAttention(zoo.NanoGPT):
    """A parallel scan (Jamba's Mamba path under torch.compile) before the attention: pre-dispatch tracing
    runs the higher-order op in Python and would bake its intermediates into the graph as fake constants."""

    def forward(self, x):
        from torch._higher_order_ops.associative_scan import associative_scan

        def combine(left, right):
            return left[0] * right[0], right[0] * left[1] + right[1]

        _, h = associative_scan(combine, (torch.sigmoid(x), x), dim=1, combine_mode="generic")
        return super().forward(h)


def test_graph_with_a_scan_is_traced_below_dispatch():
    m = ScanThenAttention().eval()
    x = zoo.example_args("nanogpt")[0]
    c = torch.compile(m, backend="pagedattn", options={"inner": "eager"})
    with torch.no_grad(), compiled_graphs() as graphs:
        torch.testing.assert_close(c(x), m(x), atol=2e-5, rtol=0)
    reports = _sites(graphs)
    assert [s["status"] for s in reports] == ["rewritten"], reports  # the matmul below dispatch, matched


# ------------------------------------------------------------------------- the collector


def _compiled(name):
    return torch.compile(zoo.ATTENTION[name][0]().eval(), backend="pagedattn", options={"inner": "eager"})


def test_compiled_graphs_sees_only_the_graphs_that_run_inside():
    a, b = _compiled("nanogpt"), _compiled("gqa_expand")
    x = zoo.example_args("nanogpt")[0]
    with torch.no_grad():
        a(x)  # compiled and run outside any collector
        with compiled_graphs() as only_b:
            b(x)
            b(x)  # run twice, collected once
        with compiled_graphs() as only_a:
            a(x)  # compiled before, run inside
            with compiled_graphs() as inner:  # the innermost collector takes what runs in it
                b(x)
        a(x)
    assert len(only_b) == 1 and [s.num_kv_heads for s in only_b[0].cache_specs] == [2]
    assert len(only_a) == 1 and [s.num_kv_heads for s in only_a[0].cache_specs] == [zoo.H]
    assert inner == only_b


def test_two_compiled_models_keep_their_own_cache_specs():
    # the engine learns a compiled model's caches from its own graphs: compiling another model afterwards
    # (the last compiled graph, a process-wide global before) must not change them
    a, b = _compiled("gqa_expand"), _compiled("mqa_broadcast")
    x = zoo.example_args("nanogpt")[0]
    with torch.no_grad(), compiled_graphs() as graphs_a:
        a(x)
    with torch.no_grad(), compiled_graphs() as graphs_b:
        b(x)
    (ga,), (gb,) = graphs_a, graphs_b
    assert [s.num_kv_heads for s in ga.cache_specs] == [2] and [s.num_kv_heads for s in gb.cache_specs] == [1]
    assert ga.report[0]["num_kv_heads"] == 2 and gb.report[0]["num_kv_heads"] == 1
    assert ga.report[0]["name"] == ga.cache_specs[0].site


class XlaLike(AttentionBackend):
    """Stands for an XLA backend instance (no torch_xla needed): only its device type matters here."""

    device_type = "xla"


def test_options_resolve_with_defaults_and_refuse_unknown_ones():
    assert resolve_options(None) == {"inner": "inductor", "target": "auto", "block_size": 16}
    xla = XlaLike()
    assert resolve_options({"target": xla})["inner"] == "openxla"  # torch_xla's compiler for XLA targets
    assert resolve_options({"target": xla, "inner": "eager"})["inner"] == "eager"
    assert resolve_options({"target": "cpu"})["inner"] == "inductor"
    with pytest.raises(ValueError, match="unknown pagedattn options"):
        resolve_options({"innr": "eager"})
    with pytest.raises(ValueError, match="must be 'inductor', 'eager' or 'openxla'"):
        resolve_options({"inner": "tvm"})
