"""``torch.compile(model, backend="pagedattn")``: zoo and Hugging Face models, recompiles, cache copies."""

import subprocess
import sys
import time

import pytest
import torch
import torch._dynamo

import pagedattn
from pagedattn.backends import build_metadata
from pagedattn.compile import compile_reports

from . import zoo
from .hf_models import example_inputs, tiny_model


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", sorted(zoo.ATTENTION))
def test_zoo_through_compile(name):
    m = zoo.ATTENTION[name][0]().eval()
    c = torch.compile(m, backend="pagedattn", options={"inner": "eager"})
    before = len(compile_reports())
    with torch.no_grad():
        for B, T in [(2, 8), (3, 13)]:
            args = zoo.example_args(name, B, T, seed=T)
            torch.testing.assert_close(c(*args), m(*args), atol=2e-5, rtol=1e-4)
    reports = compile_reports()[before:]
    assert reports and all(s["status"] == "rewritten" for r in reports for s in r), reports


@pytest.mark.parametrize("name", ["nanogpt", "gqa_expand", "sdpa_causal"])
def test_zoo_through_inductor(name):
    m = zoo.ATTENTION[name][0]().eval()
    c = torch.compile(m, backend="pagedattn")
    with torch.no_grad():
        for B, T in [(2, 8), (3, 13)]:
            args = zoo.example_args(name, B, T, seed=T)
            torch.testing.assert_close(c(*args), m(*args), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(zoo.NOT_ATTENTION))
def test_counter_examples_through_compile(name):
    m = zoo.NOT_ATTENTION[name][0]().eval()
    c = torch.compile(m, backend="pagedattn", options={"inner": "eager"})
    before = len(compile_reports())
    with torch.no_grad():
        args = zoo.example_args(name, 2, 8)
        torch.testing.assert_close(c(*args), m(*args))
    assert all(s["status"] == "skipped" for r in compile_reports()[before:] for s in r)


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
    before = len(compile_reports())
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    reports = compile_reports()[before:]
    assert reports and all(s["status"] == "rewritten" for s in reports[0]), reports[0]
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
    for step in range(100):
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
    c = torch.compile(m, backend="pagedattn")
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
    torch._dynamo.reset()
    m = ScanThenAttention().eval()
    x = zoo.example_args("nanogpt")[0]
    before = len(compile_reports())
    c = torch.compile(m, backend="pagedattn", options={"inner": "eager"})
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x), atol=2e-5, rtol=0)
    reports = [s for r in compile_reports()[before:] for s in r]
    assert [s["status"] for s in reports] == ["rewritten"], reports  # the matmul below dispatch, matched
    torch._dynamo.reset()
