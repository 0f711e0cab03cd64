"""The XLA backend (torch_xla) on XLA:CPU, against the CPU backend and Hugging Face generate.

Runs in the XLA environment only (``.ci/xla-tests``); elsewhere every test skips.
"""

import math
import os

import pytest
import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch_xla = pytest.importorskip(
    "torch_xla", reason="torch_xla is not installed: run the XLA tests with .ci/xla-tests (README 'XLA (torch_xla)')")

import torch_xla.debug.metrics as met  # noqa: E402

from pagedattn.backends import build_metadata, get_backend, set_validation  # noqa: E402
from pagedattn.backends.base import AttentionConfig  # noqa: E402
from pagedattn.backends.pallas_xla import PallasXlaBackend, StepBuckets, bucket, pad_step, to_xla  # noqa: E402

from .paged_batch import make_batch, reference_step, run_step  # noqa: E402
from .xla_helpers import cpu_layout, serve_greedy, xla_layout  # noqa: E402

pytestmark = pytest.mark.xla

DEV = torch_xla.device()
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}

SHAPES = {
    "prefill": [(0, 7), (0, 19), (0, 1)],
    "decode": [(5, 1), (40, 1), (16, 1), (63, 1)],
    "mixed": [(0, 12), (30, 1), (17, 5), (0, 1), (64, 1), (3, 9)],
    "chunked": [(32, 16), (47, 3), (15, 17)],
}


def _compiles() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def _xla_step(backend, b, scale, causal=True, window=0, softcap=0.0, alibi=None, head_align=1, via_ops=False,
              sinks=None):
    """Write the step's K/V and attend on XLA; returns (output, cache) on the CPU."""
    cache = xla_layout(b.kv_cache, head_align).to(DEV)
    m = b.meta.to(DEV)
    q, k, v = b.query.to(DEV), b.key.to(DEV), b.value.to(DEV)
    slopes = alibi.to(DEV) if alibi is not None else None
    sinks = sinks.to(DEV) if sinks is not None else None
    if via_ops:  # the ops as a rewritten graph calls them after to_xla()
        cache.copy_(torch.ops.pagedattn.write_kv_cache_functional(k, v, cache, m.slot_mapping))
        out = torch.ops.pagedattn.paged_attention(q, k, v, cache, m.block_tables, m.seq_lens, m.query_start_loc,
                                                  scale, causal, window, softcap, slopes, k.shape[1], v.shape[2],
                                                  sinks)
    else:
        backend.write(k, v, cache, m.slot_mapping)
        out = backend.attend(q, k, v, cache, m.block_tables, m.seq_lens, m.query_start_loc, scale, causal,
                             window, softcap, slopes, k.shape[1], **({} if sinks is None else {"sinks": sinks}))
    return out.cpu(), cpu_layout(cache, b.key.shape[2])


def _check(b, backend=None, dtype=torch.float32, head_align=1, via_ops=False, **kw):
    """XLA against the CPU backend on the same batch: output, padding rows, written cache."""
    scale = kw.pop("scale", 1 / math.sqrt(b.query.shape[-1]))
    out, cache = _xla_step(backend, b, scale, head_align=head_align, via_ops=via_ops, **kw)
    ref = run_step(b, scale, **kw)  # writes b.kv_cache on the CPU
    n = int(b.meta.query_start_loc[-1])
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out[:n].double(), reference_step(b, scale, **kw), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.all(out[n:] == 0), "padding rows must be zero"
    assert torch.equal(cache, b.kv_cache), "the XLA cache must hold what the CPU backend wrote"


# ---------------------------------------------------------------- layout and ops


def test_registry_gives_the_xla_backend():
    backend = get_backend("xla")
    assert isinstance(backend, PallasXlaBackend) and backend.mode == "static"  # XLA:CPU has no TPU
    assert get_backend(DEV) is backend


def test_cache_shape():
    assert PallasXlaBackend("static").kv_cache_shape(10, 16, 8, 64) == (10, 16, 16, 64)
    assert PallasXlaBackend("kernel").kv_cache_shape(10, 16, 8, 64) == (10, 16, 16, 128)  # lanes of 128
    assert PallasXlaBackend("kernel").kv_cache_shape(10, 16, 8, 256) == (10, 16, 16, 256)
    cache = PallasXlaBackend("static", head_align=128).allocate_kv_cache(3, 4, 2, 80, torch.bfloat16)
    assert cache.device.type == "xla" and cache.shape == (3, 4, 4, 128) and cache.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_batches_through_the_ops(shape):
    # the registered kernels (mode chosen by the registry: static on XLA:CPU), GQA 8/2, padding tokens
    b = make_batch(SHAPES[shape], num_heads=8, num_kv_heads=2, pad_tokens=3)
    _check(b, via_ops=True)


@pytest.mark.parametrize("heads", [(4, 4), (8, 1), (16, 2)], ids=["mha", "mqa", "gqa8"])
def test_head_layouts(heads):
    b = make_batch(SHAPES["mixed"], num_heads=heads[0], num_kv_heads=heads[1], head_size=32, block_size=4)
    _check(b, PallasXlaBackend("static"))


@pytest.mark.parametrize(
    "feature",
    [{"window": 8}, {"window": 1}, {"softcap": 5.0}, {"softcap": 3.0, "window": 13}, {"scale": 0.3},
     {"alibi": True}, {"alibi": True, "window": 10}, {"causal": False}, {"sinks": True},
     {"sinks": True, "window": 8}],
    ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()),
)
def test_features_static(feature):
    feature = dict(feature)
    b = make_batch(SHAPES["mixed"], num_heads=8, num_kv_heads=2, pad_tokens=2)
    if feature.pop("alibi", False):
        feature["alibi"] = torch.tensor([2 ** (-8 * (h + 1) / 8) for h in range(8)])
    if feature.pop("sinks", False):
        feature["sinks"] = torch.linspace(-2.0, 4.0, 8)
    _check(b, PallasXlaBackend("static"), **feature)


def test_bfloat16_with_padded_heads():
    b = make_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, head_size=48, dtype=torch.bfloat16)
    _check(b, PallasXlaBackend("static", head_align=128), dtype=torch.bfloat16, head_align=128, window=9, softcap=4.0)


def test_ragged_paged_attention_reference_path():
    # torch.ops.xla.ragged_paged_attention(use_kernel=False): prefill, decode and chunked prefill in
    # one call, GQA, sliding window, soft-cap, head size padded as the kernel needs, padding tokens
    b = make_batch([(0, 6), (21, 1), (9, 4)], num_heads=4, num_kv_heads=2, head_size=32, block_size=8, pad_tokens=2)
    _check(b, PallasXlaBackend("reference", head_align=128), head_align=128, window=7, softcap=5.0)


def _pad(b, buckets):
    """``b`` padded to bucket sizes, with garbage in the padding rows of q/k/v."""
    b.meta = pad_step(b.meta, buckets)
    T = b.meta.num_tokens
    for name in ("query", "key", "value"):
        t = getattr(b, name)
        setattr(b, name, torch.cat((t, torch.randn(T - t.shape[0], *t.shape[1:]))))
    return b


def test_reference_path_ignores_padded_sequences():
    b = make_batch([(0, 3), (5, 1)], num_heads=2, num_kv_heads=1, head_size=16, block_size=4, pad_tokens=1)
    _check(_pad(b, StepBuckets((8,), (4,), (4,))), PallasXlaBackend("reference"))


def test_write_skips_padding_slots():
    backend = PallasXlaBackend("static")
    cache = backend.allocate_kv_cache(4, 4, 2, 8)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([-1, 6, -1, 9, -1])  # padding first, between and last
    backend.write(key.to(DEV), value.to(DEV), cache, slots.to(DEV))
    got = cache.cpu().reshape(16, 2, 2, 8)  # [slot, head, K|V, D]
    expect = torch.zeros(16, 2, 2, 8)
    expect[[6, 9], :, 0], expect[[6, 9], :, 1] = key[[1, 3]], value[[1, 3]]
    assert torch.equal(got, expect)
    before = cache.cpu()
    backend.write(key.to(DEV), value.to(DEV), cache, torch.full((5,), -1, device=DEV))  # all padding
    assert torch.equal(cache.cpu(), before)


def test_copy_and_swap_blocks():
    backend = PallasXlaBackend("static")
    orig = torch.randn(6, 4, 4, 8)
    cache = orig.to(DEV)
    backend.copy_blocks(cache, torch.tensor([[0, 3], [2, 5]]))
    got = cache.cpu()
    assert torch.equal(got[3], orig[0]) and torch.equal(got[5], orig[2]) and torch.equal(got[1], orig[1])
    host = torch.zeros(6, 4, 4, 8)
    backend.swap_blocks(cache, host, torch.tensor([[1, 0], [4, 2]]))  # device -> host
    assert torch.equal(host[0], got[1]) and torch.equal(host[2], got[4]) and torch.all(host[1] == 0)
    back = torch.zeros(6, 4, 4, 8, device=DEV)
    backend.swap_blocks(host, back, torch.tensor([[0, 5]]))  # host -> device
    assert torch.equal(back.cpu()[5], got[1])


def test_supports_gives_reasons():
    ok = AttentionConfig(num_heads=8, num_kv_heads=2, head_size=64, scale=0.1, sliding_window=32, softcap=30.0)
    alibi = AttentionConfig(num_heads=8, num_kv_heads=2, head_size=64, scale=0.1, alibi=True)
    bidir = AttentionConfig(num_heads=8, num_kv_heads=2, head_size=64, scale=0.1, causal=False)
    sinks = AttentionConfig(num_heads=8, num_kv_heads=2, head_size=64, scale=0.1, sinks=True)
    bad = AttentionConfig(num_heads=6, num_kv_heads=4, head_size=64, scale=0.1, dtype=torch.float64, head_size_v=32)
    for mode in ("kernel", "reference"):
        backend = PallasXlaBackend(mode)
        assert backend.supports(ok) == []
        assert any("ALiBi" in r for r in backend.supports(alibi))
        assert any("non-causal" in r for r in backend.supports(bidir))
        assert any("sinks" in r for r in backend.supports(sinks))
    static = PallasXlaBackend("static")
    assert static.supports(ok) == static.supports(alibi) == static.supports(bidir) == static.supports(sinks) == []
    reasons = static.supports(bad)
    assert any("float64" in r for r in reasons) and any("multiple" in r for r in reasons)
    assert any("value head size" in r for r in reasons)


def test_kernel_path_refuses_what_it_cannot_compute():
    b = make_batch([(0, 3)], num_heads=2, num_kv_heads=2, head_size=16, block_size=4)
    with pytest.raises(ValueError, match="neither ALiBi nor non-causal"):
        _xla_step(PallasXlaBackend("reference"), b, 0.25, alibi=torch.tensor([0.5, 0.25]))


def test_mismatched_cache_is_named():
    backend = PallasXlaBackend("static")
    with pytest.raises(ValueError, match="K and V interleaved"):
        backend.cache_geometry(torch.zeros(2, 4, 4, 3, 8))
    b = make_batch([(0, 3)], num_heads=2, num_kv_heads=2, head_size=16, block_size=4)
    with pytest.raises(ValueError, match="head size 16"):
        _xla_step(PallasXlaBackend("static", head_align=128), b, 0.25, head_align=1)


def test_to_xla_openxla_needs_a_rewritten_model():
    with pytest.raises(TypeError, match="RewrittenModel"):
        to_xla(torch.nn.Linear(2, 2), openxla=True)


# ---------------------------------------------------------------- static shapes


def test_buckets_and_pad_step():
    b = StepBuckets.up_to(max_num_tokens=100, max_num_seqs=6, max_blocks_per_seq=8)
    assert b.tokens == (16, 32, 64, 100) and b.seqs == (1, 2, 4, 6) and b.blocks == (1, 2, 4, 8)
    assert b.num_shapes == 64 and bucket(17, b.tokens) == 32
    with pytest.raises(ValueError, match="largest bucket"):
        bucket(101, b.tokens)
    meta = build_metadata([(0, 3, [4]), (5, 1, [2, 7]), (2, 4, [1, 3, 5])], block_size=4)
    p = pad_step(meta, b)
    assert p.slot_mapping.tolist() == meta.slot_mapping.tolist() + [-1] * 8
    assert p.seq_lens.tolist() == [3, 6, 6, 0] and p.query_start_loc.tolist() == [0, 3, 4, 8, 8]
    assert p.block_tables.tolist() == [[4, 0, 0, 0], [2, 7, 0, 0], [1, 3, 5, 0], [0, 0, 0, 0]]


def test_padded_step_gives_the_same_rows():
    b = make_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, head_size=16, block_size=8)
    backend = PallasXlaBackend("static")
    out, _ = _xla_step(backend, b, 0.25, window=11)
    padded, _ = _xla_step(backend, _pad(b, StepBuckets((64,), (8,), (16,))), 0.25, window=11)
    torch.testing.assert_close(padded[:out.shape[0]], out)
    assert torch.all(padded[out.shape[0]:] == 0)


# ------------------------------------------------------------- a model on XLA


@pytest.fixture(scope="module")
def llama():
    import pagedattn

    from ..rewriter.hf_models import tiny_model
    from ..runtime.test_engine import _example

    model = tiny_model("llama")
    # rewritten on the CPU (the target only picks the backend's supports()), then moved
    return model, to_xla(pagedattn.rewrite(model, (), _example(model), target="xla"))


def _eos(model):
    eos = model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def _hf_greedy(model, prompts, new):
    from ..runtime.test_engine import _reference

    return [r[:n] for r, n in zip(_reference(model, prompts, max(new)), new)]


def test_serving_loop_matches_hf_generate_and_compiles_once_per_shape(llama):
    model, rewritten = llama
    set_validation(False)  # validation reads metadata on the host: extra graphs
    g = torch.Generator().manual_seed(3)
    buckets = StepBuckets.up_to(max_num_tokens=64, max_num_seqs=4, max_blocks_per_seq=4)
    # prefill together, decode, join mid-run (steps mixing prefill and decode), finish at different steps
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    new, arrivals = [6, 3, 8, 4], [0, 0, 2, 3]
    before = _compiles()
    out, shapes = serve_greedy(rewritten, prompts, new, arrivals=arrivals, buckets=buckets,
                               num_blocks=32, device=DEV, eos=_eos(model))
    first = _compiles() - before
    assert out == _hf_greedy(model, prompts, new)
    # one graph per distinct step shape (plus at most the cache allocation), not one per step
    assert len(set(shapes)) < len(shapes)
    assert len(set(shapes)) <= first <= len(set(shapes)) + 1
    # other prompts, lengths and contexts: only step shapes not seen before compile
    prompts2 = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 12, 3, 25)]
    before = _compiles()
    out2, shapes2 = serve_greedy(rewritten, prompts2, new, arrivals=arrivals, buckets=buckets,
                                 num_blocks=32, device=DEV, eos=_eos(model))
    assert _compiles() - before == len(set(shapes2) - set(shapes))
    assert out2 == _hf_greedy(model, prompts2, new)
    print(f"\ncompilations: run 1 {first} for {len(shapes)} steps / {len(set(shapes))} shapes; "
          f"run 2 {_compiles() - before} for {len(shapes2)} steps / {len(set(shapes2) - set(shapes))} new shapes")


def test_sliding_window_model_matches_hf_generate():
    import pagedattn

    from ..rewriter.hf_models import tiny_model
    from ..runtime.test_engine import _example

    model = tiny_model("mistral")  # sliding window 6: decodes past it read only the window
    rewritten = to_xla(pagedattn.rewrite(model, (), _example(model), target="xla", block_size=4))
    assert all(r["status"] == "rewritten" for r in rewritten.report)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 4)]
    new = [5, 5]
    out, _ = serve_greedy(rewritten, prompts, new, arrivals=[0, 0], buckets=StepBuckets.up_to(16, 2, 4),
                          num_blocks=12, device=DEV, eos=_eos(model))
    assert out == _hf_greedy(model, prompts, new)


def test_paged_engine_on_xla(llama):
    # the engine pads every step to the backend's buckets and syncs once a step: a bounded number of
    # graphs, and the tokens of Hugging Face generate
    from pagedattn import PagedEngine

    model, rewritten = llama
    set_validation(False)  # validation reads metadata on the host: extra graphs
    prompts = [[5, 9, 3, 1], [7, 2], [4, 4, 8, 1, 9, 2, 6]]
    engine = PagedEngine(rewritten, target="xla", num_blocks=8, max_num_tokens=16, max_num_seqs=4)
    before = _compiles()
    assert engine.generate(prompts, 4) == _hf_greedy(model, prompts, [4, 4, 4])
    first = _compiles() - before
    print("engine on XLA: steps", engine.stats["steps"], "compilations", first)
    assert first <= engine.stats["steps"]
    before = _compiles()
    assert engine.generate([[3, 1, 4], [1, 5]], 3) == _hf_greedy(model, [[3, 1, 4], [1, 5]], [3, 3])
    assert _compiles() - before <= 2, "step shapes seen before must not compile again"


def test_openxla_compiles_the_paged_graph_once_per_shape():
    # the rewritten graph handed to torch_xla's compiler (torch.compile(backend="openxla")); the
    # in-place cache writes go through AOT functionalization there
    import pagedattn

    from ..rewriter.hf_models import tiny_model
    from ..runtime.test_engine import _example

    set_validation(False)
    model = tiny_model("llama")
    rewritten = to_xla(pagedattn.rewrite(model, (), _example(model), target="xla"), openxla=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (6, 19, 11)]
    new, arrivals = [5, 3, 4], [0, 0, 1]
    buckets = StepBuckets.up_to(max_num_tokens=32, max_num_seqs=4, max_blocks_per_seq=2)
    kw = dict(arrivals=arrivals, buckets=buckets, num_blocks=16, device=DEV, eos=_eos(model))
    before = _compiles()
    out, shapes = serve_greedy(rewritten, prompts, new, **kw)
    first = _compiles() - before
    assert out == _hf_greedy(model, prompts, new)
    before = _compiles()
    prompts2 = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 5, 2)]  # one block each
    out2, shapes2 = serve_greedy(rewritten, prompts2, new, **kw)
    assert out2 == _hf_greedy(model, prompts2, new)
    new_shapes = set(shapes2) - set(shapes)
    # Dynamo guards on shapes: a seen step shape reuses its graph (openxla also compiles the
    # sampling step apart, hence up to two XLA graphs per new shape)
    assert new_shapes and _compiles() - before <= 2 * len(new_shapes)
    assert first <= 2 * len(set(shapes)) + 1
    print(f"\nopenxla: run 1 {first} compilations for {len(shapes)} steps / {len(set(shapes))} shapes; "
          f"run 2 {_compiles() - before} for {len(shapes2)} steps / {len(new_shapes)} new shapes")


def test_torch_compile_backend_on_xla_hands_the_graphs_to_openxla():
    # torch.compile(model on XLA, backend="pagedattn", options={"target": "xla"}): rewritten on the
    # XLA device, inner compiler openxla; drop-in mode outside a context, paged mode inside one
    import pagedattn
    from pagedattn.compile import _options, last_cache_specs
    from pagedattn.runtime.context import paged_context

    from ..rewriter.hf_models import tiny_model
    from ..runtime.test_engine import _example

    assert _options({"target": "xla"})["inner"] == "openxla"
    assert _options({"target": "xla", "inner": "eager"})["inner"] == "eager"
    assert _options(None)["inner"] == "inductor"
    model = tiny_model("llama")
    cpu = pagedattn.rewrite(model, (), _example(model), target="cpu")
    compiled = torch.compile(tiny_model("llama").to(DEV), backend="pagedattn", options={"target": "xla"})
    ids, pos = torch.randint(0, 128, (1, 12)), torch.tensor([list(range(7)) + list(range(5))])
    before = met.counter_value("CachedCompile") or 0
    with torch.no_grad():
        dense = compiled(input_ids=ids[:, :7].to(DEV)).logits.cpu()
        torch.testing.assert_close(dense, model(input_ids=ids[:, :7]).logits, atol=1e-5, rtol=1e-5)

        def kw(d):
            return dict(input_ids=ids.to(d), position_ids=pos.to(d), use_cache=False,
                        logits_to_keep=torch.tensor([6, 11], device=d))

        meta = build_metadata([(0, 7, [0]), (0, 5, [1])], cpu.block_size)
        caches = cpu.allocate_kv_caches(4, device="cpu")
        with paged_context(caches, meta):
            ref = cpu(**kw("cpu")).logits
        backend = get_backend("xla")
        xcaches = [backend.allocate_kv_cache(4, cpu.block_size, s["num_kv_heads"], s["head_size"])
                   for s in last_cache_specs()]
        with paged_context(xcaches, meta.to(DEV)):
            out = compiled(**kw(DEV)).logits.cpu()
            out_again = compiled(**kw(DEV)).logits.cpu()  # same shapes: the compiled graph again
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_again, ref, atol=1e-5, rtol=1e-5)  # the same tokens written again: same cache
    for c, x in zip(caches, xcaches):
        torch.testing.assert_close(cpu_layout(x, c.shape[-1]), c, atol=1e-6, rtol=1e-6)
    assert (met.counter_value("CachedCompile") or 0) > before  # the second paged call reused a graph
