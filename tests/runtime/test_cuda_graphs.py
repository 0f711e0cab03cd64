"""The CUDA-graph decode path checked on the CPU: capture sizes, persistent buffers padded to them, and a decode
step over those buffers that reads no tensor value on the host (what capture needs), equal to the model's own
greedy tokens (Hugging Face generate). The capture and replay themselves need a GPU (``tests/runtime/test_engine_gpu.py``)."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedattn.adapter import prepare_model
from pagedattn.backends import build_metadata, metadata, set_validation, static_paged
from pagedattn.runtime.cuda_graphs import (
    DecodeBuffers,
    DecodeGraphs,
    HostRead,
    bucket,
    capture_sizes,
    no_host_reads,
    reproduces,
    width_buckets,
)

from ..support import VOCAB, _from_config, hf_generate, make_batch, prompts


@pytest.fixture
def checks_as_on_cuda(monkeypatch):
    """Value checks as CUDA runs them (``torch._assert_async``: no host read), not ``bool()`` as on the CPU; no
    full validation (it reads metadata on the host, so the graphs run eagerly under it)."""
    monkeypatch.setattr(metadata, "_value_check", lambda op, cond, msg: torch._assert_async(cond, f"{op}: {msg}"))
    monkeypatch.setattr(metadata, "_values_on_host", lambda t: False)
    set_validation(False)
    yield
    set_validation(True)  # as tests/conftest.py keeps it


def test_a_replay_reproduces_the_step_up_to_rounding_not_up_to_stale_inputs():
    """bf16 logits an ulp or two apart (cuBLAS picks other algorithms under capture: seen on an H100, 0.07 on
    logits of about 5) are the same step; a row from another step's inputs, or a non-finite one, is not."""
    g = torch.Generator().manual_seed(0)
    eager = (torch.randn(64, 1000, generator=g) * 2).to(torch.bfloat16)
    ulp = torch.finfo(torch.bfloat16).eps * eager.float().abs().max()
    assert reproduces(eager.clone(), eager)
    assert reproduces((eager.float() + 2 * ulp * torch.sign(torch.randn(64, 1000, generator=g))).to(torch.bfloat16),
                      eager)
    stale = eager.clone()
    stale[3] = (torch.randn(1000, generator=g) * 2).to(torch.bfloat16)  # one row computed from other inputs
    assert not reproduces(stale, eager)
    broken = eager.clone()
    broken[0, 0] = float("nan")
    assert not reproduces(broken, eager)
    assert not reproduces(eager[:32], eager)
    fp32 = torch.randn(8, 100, generator=g)
    assert reproduces(fp32 + 1e-5, fp32) and not reproduces(fp32 + 1e-2, fp32)


def test_capture_sizes_hold_every_batch_up_to_max_num_seqs():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 8)
    assert capture_sizes(24) == (1, 2, 4, 8, 16, 24)
    assert capture_sizes(1000)[-1] == 256 and len(capture_sizes(1000)) == 35


def test_width_buckets_are_powers_of_two_then_the_widest_never_one_column():
    # a compiled step specialises a size of 1: the engine's steps have 2 columns or more, and so do the graphs'
    assert width_buckets(1) == (2,) and width_buckets(2) == (2,) and width_buckets(8) == (2, 4, 8)
    assert width_buckets(13) == (2, 4, 8, 13)


@given(st.integers(1, 300), st.integers(1, 300))
def test_a_batch_runs_in_the_smallest_size_that_holds_it(n, max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    size = bucket(n, sizes)
    if n > sizes[-1]:
        assert size is None
    else:
        assert size >= n and all(s < n for s in sizes if s < size)
    assert bucket(min(max_num_seqs, 256), sizes) is not None


def test_buffers_hold_the_step_and_pad_with_empty_sequences():
    b = DecodeBuffers.allocate(8, 3, 4, "cpu")
    b.load([5, 6, 7], [9, 2, 0], [37, 10, 0], [[4, 7, 9], [2], [0]], [10, 3, 1], 4)
    assert b.ids[:4].tolist() == [5, 6, 7, 0] and b.positions[:4].tolist() == [9, 2, 0, 0]
    assert b.slots[:4].tolist() == [37, 10, 0, -1] and b.seq_lens[:4].tolist() == [10, 3, 1, 0]
    assert b.tables[:4].tolist() == [[4, 7, 9], [2, 0, 0], [0, 0, 0], [0, 0, 0]]
    meta = b.metadata(4)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 3] and meta.block_tables.data_ptr() == b.tables.data_ptr()
    b.load([1], [0], [3], [[5]], [1], 1)  # a later, smaller step writes the same storage
    assert b.ids[0] == 1 and meta.block_tables[0, 0] == 5
    with pytest.raises(ValueError, match="wider than the captured 3"):
        b.load([1], [0], [3], [[5, 6, 7, 8]], [13], 1)


def test_no_host_reads_refuses_what_capture_cannot_take():
    t = torch.tensor([1, 0, 2])
    for read in (lambda: t.tolist(), lambda: bool(t[0]), lambda: t[0].item(), lambda: int(t[1]),
                 lambda: t[t > 0], lambda: torch.nonzero(t), lambda: range(t[0])):
        with no_host_reads(), pytest.raises(HostRead):
            read()
    with no_host_reads():
        assert (t * 2 + 1).shape == (3,)  # shape arithmetic and value-free ops pass
    assert t.tolist() == [1, 0, 2]  # restored


@pytest.mark.parametrize("feature", [{}, {"window": 5}, {"alibi": True}, {"softcap": 5.0}],
                         ids=["plain", "window", "alibi", "softcap"])
def test_static_write_and_attend_equal_the_reference_without_host_reads(feature, checks_as_on_cuda):
    from ..support import reference_step

    feature = dict(feature)
    if feature.pop("alibi", False):
        feature["alibi"] = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    b = make_batch([(13, 1), (0, 1), (30, 1), (7, 3)], num_heads=4, num_kv_heads=2, block_size=4, pad_tokens=3)
    p = _params(b, **feature)
    with no_host_reads():
        static_paged.write(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
        out = static_paged.attend(b.query, b.kv_cache, b.meta, p)
    ref = reference_step(b, p.scale, **feature)
    torch.testing.assert_close(out[:ref.shape[0]].double(), ref, atol=2e-4, rtol=2e-4)
    assert torch.all(out[ref.shape[0]:] == 0)


def test_static_backend_keeps_its_bases_layout_and_refuses_another():
    from pagedattn.backends import AttentionBackend, get_backend

    static = static_paged.StaticPagedBackend(get_backend("cpu"))
    assert static.device_type == "cpu" and static.kv_cache_shape(3, 4, 2, 8) == (2, 3, 4, 2, 8)

    class Interleaved(AttentionBackend):  # another layout (as pallas_xla keeps K and V)
        name, device_type = "interleaved", "cpu"

    with pytest.raises(ValueError, match="split-KV"):
        static_paged.StaticPagedBackend(Interleaved())


def test_the_cpu_backend_itself_reads_the_host_a_capture_would_refuse(checks_as_on_cuda):
    b = make_batch([(13, 1), (5, 1)], num_heads=4, num_kv_heads=2, block_size=4)
    with no_host_reads(), pytest.raises(HostRead):
        torch.ops.pagedattn.paged_attention(b.query, None, None, b.kv_cache, b.meta.block_tables, b.meta.seq_lens,
                                            b.meta.query_start_loc, *_params(b).args())


def _params(b, window=0, softcap=0.0, alibi=None):
    from ..support import batch_params

    return batch_params(b, 0.125, window=window, softcap=softcap, alibi=alibi)


def tiny_llama(device="cpu", dtype=torch.float32):
    model = _from_config("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return model.to(device, dtype)


def greedy_through_graphs(sv, caches, ps, new: int, inside_step, capture: bool, block_size: int = 4
                          ) -> tuple[list, DecodeGraphs]:
    """Prompts prefilled in one eager packed step (the CPU or CUDA backend), then every decode step through
    :class:`DecodeGraphs` (buffers of the next capture size), ``inside_step`` around each step's run."""
    bs = block_size
    tables, start = [], 0
    for p in ps:
        need = -(-(len(p) + new) // bs)
        tables.append(list(range(start, start + need)))
        start += need
    meta = build_metadata([(0, len(p), t) for p, t in zip(ps, tables)], bs, device=sv.device)
    ids = [t for p in ps for t in p]
    pos = [i for p in ps for i in range(len(p))]
    rows = list(itertools.accumulate(len(p) for p in ps))
    with torch.no_grad():
        last = sv.run_packed(caches, meta, ids, pos, [r - 1 for r in rows]).argmax(-1).tolist()
    graphs = DecodeGraphs(sv, caches, max_num_seqs=8, width=max(map(len, tables)), capture=capture)
    out = [[t] for t in last]
    lens = [len(p) for p in ps]
    for _ in range(new - 1):
        slots = [t[L // bs] * bs + L % bs for t, L in zip(tables, lens)]
        with inside_step():
            logits = graphs.run([o[-1] for o in out], lens, slots, tables, [L + 1 for L in lens])
        assert logits.shape == (len(ps), VOCAB)
        for o, tok in zip(out, logits.argmax(-1).tolist()):
            o.append(tok)
        lens = [L + 1 for L in lens]
    return out, graphs


@pytest.mark.parametrize("n", [3, 5])
def test_decode_steps_over_padded_buffers_equal_hf_generate(n, checks_as_on_cuda):
    """Every decode step through the buffers of the next capture size (3 -> 4, 5 -> 8 sequences) with the static
    write and attention: no host read inside a step, and the greedy tokens of Hugging Face generate."""
    model = tiny_llama()
    sv = prepare_model(model, target="cpu", block_size=4)
    ps = prompts(lengths=(5, 17, 9, 30, 2))[:n]
    out, graphs = greedy_through_graphs(sv, sv.allocate_kv_caches(64), ps, 6, no_host_reads, capture=False)
    assert out == hf_generate(model, ps, 6)
    assert graphs.stats["eager"] == 5 and graphs.buffers.size == 8


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA is not available)")
def test_captured_decode_steps_replay_without_host_syncs_and_equal_hf_generate():
    """On a GPU: each size is captured once (its first step runs eagerly), later steps replay the graph with no
    host synchronisation (``torch.cuda.set_sync_debug_mode("error")`` around them), same tokens as generate."""
    pytest.importorskip("xformers", reason="xformers is not installed (pip install 'pagedattn[cuda]')")
    set_validation(False)
    try:
        model = tiny_llama("cuda", torch.float16)
        sv = prepare_model(model, target="cuda", block_size=4)
        ps = prompts(lengths=(5, 17, 9))

        steps = itertools.count()

        @contextlib.contextmanager
        def no_sync():  # the first step captures (it may synchronise); every later one only replays
            torch.cuda.set_sync_debug_mode("error" if next(steps) else "default")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")

        out, graphs = greedy_through_graphs(sv, sv.allocate_kv_caches(64), ps, 8, no_sync, capture=True)
    finally:
        set_validation(True)
    assert out == hf_generate(model, ps, 8)
    assert graphs.stats["captures"] == 1 and graphs.stats["replays"] == 6


def test_the_engine_runs_its_decode_steps_through_the_graphs_buffers():
    """PagedEngine's decode-only steps go through ``decode_graphs`` (here the capture path's buffers run eagerly,
    as off CUDA): greedy tokens equal generate's, prefills and mixed steps still run the packed step."""
    from pagedattn import PagedEngine

    model = tiny_llama()
    engine = PagedEngine(model, block_size=4, num_blocks=96, max_num_seqs=8, compile=False, progress=False)
    assert engine.decode_graphs is None  # the CPU has no CUDA graphs
    with pytest.raises(ValueError, match="cuda_graphs=True: the device is not CUDA"):
        PagedEngine(model, block_size=4, num_blocks=96, compile=False, progress=False, cuda_graphs=True)
    engine.decode_graphs = DecodeGraphs(engine.servable, engine.kv_caches, 8, engine.num_blocks, capture=False)
    ps = prompts(lengths=(5, 17, 9, 30, 2))
    assert engine.generate(ps, max_new_tokens=8) == hf_generate(model, ps, 8)
    assert engine.decode_graphs.stats["eager"] >= 6
    assert engine.blocks.num_free == engine.num_blocks


def test_a_failed_capture_leaves_the_engine_on_its_eager_steps(caplog):
    """A capture that fails (or a graph that does not reproduce its step) is reported once, and that step and
    every later one run the eager packed step: same tokens."""
    from pagedattn import PagedEngine
    from pagedattn.runtime.cuda_graphs import CaptureFailed

    class Failing(DecodeGraphs):
        def run(self, *args, **kwargs):
            raise CaptureFailed("capturing the decode step at 8 sequences failed: RuntimeError: for the test")

    model = tiny_llama()
    engine = PagedEngine(model, block_size=4, num_blocks=96, max_num_seqs=8, compile=False, progress=False)
    engine.decode_graphs = Failing(engine.servable, engine.kv_caches, 8, engine.num_blocks, capture=False)
    ps = prompts(lengths=(5, 17, 9))
    with caplog.at_level("WARNING", logger="pagedattn.runtime"):
        assert engine.generate(ps, max_new_tokens=6) == hf_generate(model, ps, 6)
    assert engine.decode_graphs is None
    assert [r.message for r in caplog.records].count(
        "decode steps run without CUDA graphs: capturing the decode step at 8 sequences failed: RuntimeError: "
        "for the test") == 1


@pytest.mark.parametrize("arch", ["bart", "t5"])
def test_encoder_decoder_decode_steps_through_the_graphs_buffers_equal_hf_generate(arch, checks_as_on_cuda):
    """An encoder-decoder's decode steps over the capture path's buffers (cross-attention blocks and encoder
    lengths loaded with the step; T5's relative bias through its position program): no host read inside a step,
    Hugging Face generate's tokens, every block freed."""
    from pagedattn import PagedEngine

    from ..rewriter.seq2seq_models import hf_seq2seq_generate, sources, tiny_seq2seq

    model = tiny_seq2seq(arch)
    engine = PagedEngine(model, block_size=4, num_blocks=400, max_num_seqs=8, max_num_tokens=64, compile=False,
                         progress=False)
    assert engine.decode_graphs is None  # the CPU has no CUDA graphs
    graphs = engine.decode_graphs = DecodeGraphs(engine.servable, engine.kv_caches, 8, engine.num_blocks,
                                                 capture=False)
    step = graphs._step

    def guarded(shape):
        assert shape[2] > 0  # cross-attention columns loaded
        with no_host_reads():
            return step(shape)

    graphs._step = guarded
    assert engine.generate(sources(), max_new_tokens=8) == hf_seq2seq_generate(model, sources(), 8)
    assert graphs.stats["eager"] >= 6 and engine.blocks.num_free == engine.num_blocks


# the encoder-decoder's compilation (~20 s) runs with the slow tests, to keep the main suite within its 8 minutes
@pytest.mark.parametrize("arch", ["llama", pytest.param("t5", marks=pytest.mark.slow)])
def test_compiled_decode_steps_through_the_graphs_buffers_compile_nothing_after_start_up(arch):
    """The buffers give a step the shapes and grad mode of the engine's own steps (2 block-table columns at
    least, tables contiguous, sizes of 1 only in the single-token step): a compiled step serves every capture size
    with the graphs compiled at start-up. (Each mismatch compiled again on the GPU: a T5 engine compiled 3 graphs
    while serving, for a table of 1 column and for the tables' row stride.)"""
    from pagedattn import PagedEngine
    from pagedattn.runtime.shapes import graph_count

    from ..rewriter.seq2seq_models import hf_seq2seq_generate, sources, tiny_seq2seq

    model = tiny_llama() if arch == "llama" else tiny_seq2seq(arch)
    engine = PagedEngine(model, block_size=4, num_blocks=96, max_num_seqs=8, max_num_tokens=64, compile=True,
                         progress=False)
    before = graph_count()
    engine.decode_graphs = DecodeGraphs(engine.servable, engine.kv_caches, 8, engine.num_blocks, capture=False)
    if arch == "llama":
        ps = prompts(lengths=(5, 17, 9, 30, 2))
        assert engine.generate(ps[:1], max_new_tokens=6) == hf_generate(model, ps[:1], 6)  # single-token steps
        assert engine.generate(ps, max_new_tokens=8) == hf_generate(model, ps, 8)
    else:
        srcs = sources()
        assert engine.generate(srcs[:1], max_new_tokens=6) == hf_seq2seq_generate(model, srcs[:1], 6)
        assert engine.generate(srcs, max_new_tokens=8) == hf_seq2seq_generate(model, srcs, 8)
    assert graph_count() == before and engine.decode_graphs.stats["eager"] >= 10


def test_a_decoder_only_step_and_an_encoder_decoder_step_load_what_their_buffers_hold():
    buffers = DecodeBuffers.allocate(4, 3, 4, "cpu", cross=True)
    buffers.load([7, 8], [3, 9], [12, 37], [[3], [9, 2, 5]], [4, 10], 4, 3, [[1, 2], [4]], [6, 3], 2)
    cross = buffers.cross_metadata(4, 2)
    assert cross.block_tables.tolist() == [[1, 2], [4, 0], [0, 0], [0, 0]] and cross.seq_lens.tolist() == [6, 3, 0, 0]
    assert buffers.metadata(4, 3).query_start_loc.tolist() == [0, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="cross blocks"):
        buffers.load([7], [3], [12], [[3]], [4], 1, 1)
    with pytest.raises(ValueError, match="cross blocks"):
        DecodeBuffers.allocate(4, 3, 4, "cpu").load([7], [3], [12], [[3]], [4], 1, 1, [[1]], [2], 1)
    with pytest.raises(ValueError, match="wider"):
        buffers.load([7], [3], [12], [[3]], [4], 1, 1, [[1, 2, 3]], [9], 2)
