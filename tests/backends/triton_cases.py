"""The Triton paged attention kernel (backends/triton_paged.py) against the reference's exact math.

Not collected by itself: Triton's interpreter must be on when Triton is imported, for the whole process, so
``test_triton_paged.py`` runs this file in a process started with ``TRITON_INTERPRET=1`` (CPU tensors), and
``test_triton_paged_gpu.py`` collects the same cases on CUDA, compiled."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedattn.backends import AttentionParams, static_paged, triton_paged

from ..support import (
    FEATURES,
    SHAPES,
    SINKS8,
    TOL,
    batch_params,
    feature_id,
    feature_kwargs,
    make_batch,
    reference_step,
)

pytest.importorskip("triton", reason="Triton is not installed (the CUDA static path's kernel)")

# the interpreter runs a kernel program by program in numpy: long rows of many tokens take it seconds, so there it
# checks the same features on shorter sequences (still several splits a row) and fewer layouts
INTERPRETED = triton_paged.available("cpu")
SHORT = [(100, 1), (40, 3), (33, 1), (0, 5), (5, 1)]


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter patches ``triton.language`` when a kernel launches, and again at every call of a
    ``@triton.jit`` function inside it (ours and ``tl.sum``, ``tl.zeros`` ...: ~2 ms each, over half of this
    file's time, as the kernels call them per program). Within a launch a second patch of the same language modules
    changes nothing (what it would replace is replaced already), so a call is skipped when the modules its function
    sees were patched in this launch. Only the interpreter's bookkeeping changes: every op still runs interpreted."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None:  # another Triton: leave its interpreter as it is
        return
    launch = interpreter.GridExecutor.__call__
    languages = (tl, tl.core)
    patched: set[int] = set()  # ids of the language modules patched in the running launch

    modules_of: dict[int, frozenset[int]] = {}  # id of a function's globals -> the language modules they hold

    def seen(fn) -> frozenset[int]:
        key = id(fn.__globals__)  # module dicts: they live as long as the process
        if key not in modules_of:
            modules_of[key] = frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in languages))
        return modules_of[key]

    def patch_once(fn):
        modules = seen(fn)
        if modules and modules <= patched:
            return interpreter._LangPatchScope()  # nothing to restore
        scope = patch_lang(fn)
        patched.update(modules)
        return scope

    def launch_once(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_once, launch_once


if INTERPRETED:
    _patch_language_once_per_launch()


def long_in_interpreter(*values, id: str | None = None, long: bool = True):
    """One parametrization; ``slow`` in the interpreter where ``long`` (``pytest -m slow`` runs it there), so the
    main suite's interpreted run covers every feature and layout once and the cross products stay whole on CUDA."""
    return pytest.param(*values, id=id, marks=pytest.mark.slow if INTERPRETED and long else ())


@pytest.fixture
def device():
    """CPU tensors, for Triton's interpreter (``test_triton_paged_gpu.py`` overrides it)."""
    if not triton_paged.available("cpu"):
        pytest.skip("Triton's interpreter is off: test_triton_paged.py runs this file with TRITON_INTERPRET=1")
    return "cpu"


def _to(b, device):
    meta = b.meta
    fields = {f: getattr(meta, f) for f in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")}
    moved = type(meta)(**{k: v.to(device) for k, v in fields.items()}, block_size=meta.block_size)
    return b.query.to(device), b.key.to(device), b.value.to(device), b.kv_cache.to(device), moved


def _check(b, device, dtype, only=None, **kw):
    scale = kw.pop("scale", 1 / math.sqrt(b.query.shape[-1]))
    q, k, v, cache, meta = _to(b, device)
    torch.ops.pagedattn.write_kv_cache(k, v, cache, meta.slot_mapping)
    p = batch_params(b, scale, **kw)
    moved = {f: getattr(p, f).to(device) for f in ("alibi_slopes", "sinks") if getattr(p, f) is not None}
    p = AttentionParams(**{**p.__dict__, **moved}) if moved else p
    assert triton_paged.usable(q, cache, p), triton_paged.unusable_reasons(q, cache, p)
    ref = reference_step(b, scale, **kw)
    n = ref.shape[0]
    # both kernels on every case: a token per program (decode steps) and tiles of 3 queries (prefills' kernel,
    # with tiles that cut sequences anywhere), besides the one the shape picks; in the interpreter the one it picks
    # and the other kernel (tiles of 3 where it picks the decode kernel); ``only``: that one of them alone
    default = triton_paged.queries_per_tile(q.shape[0], meta.seq_lens.shape[0], q.shape[1] // cache.shape[3])
    chosen = (default, 3 if default == 1 else 1) if INTERPRETED else tuple(dict.fromkeys((default, 1, 3)))
    for queries in chosen if only is None else chosen[only:only + 1]:
        out = triton_paged.attend(q, cache, meta, p, queries=queries).cpu()
        torch.testing.assert_close(out[:n].double(), ref, atol=TOL[dtype], rtol=TOL[dtype], msg=f"queries={queries}")
        assert torch.all(out[n:] == 0), "padding rows must be zero"


@pytest.mark.parametrize("shape, dtype", [
    long_in_interpreter(shape, dtype, long=shape == "mixed" and dtype != torch.bfloat16)
    for shape in ["all_decode", "mixed"] + ([] if INTERPRETED else ["many_blocks"])
    for dtype in (torch.float32, torch.bfloat16, torch.float16)])
def test_batch_shapes(device, shape, dtype):
    _check(make_batch(SHAPES[shape], dtype=dtype, pad_tokens=3), device, dtype)


HEADS = {"mha": (4, 4), "gqa4": (8, 2), "gqa8": (16, 2), "mqa8": (8, 1), "mqa24": (24, 1)}


@pytest.mark.parametrize("heads, head_size, block_size", [
    long_in_interpreter(heads, head_size, block_size, id=f"{block_size}-{head_size}-{name}",
                        long=name != "mha" and (block_size == 32 or (head_size == 64 and name != "gqa8")))
    for block_size in (16, 32) for head_size in ([64, 80, 256] if INTERPRETED else [64, 80, 128, 256])
    for name, heads in HEADS.items()])
def test_layouts(device, heads, head_size, block_size):
    nh, nkv = heads
    b = make_batch(SHAPES["all_decode"], num_heads=nh, num_kv_heads=nkv, head_size=head_size, block_size=block_size)
    _check(b, device, torch.float32)


# plus a window that starts inside a block, in a split after the row's first; in the interpreter's main run each
# feature at one dtype and through one of the two kernels, taking turns (both in the slow run and on CUDA)
@pytest.mark.parametrize("feature, dtype, only", [
    long_in_interpreter(feature, dtype, i % 2 if INTERPRETED and (i + j) % 2 == 0 else None,
                        id=f"{feature_id(feature)}-{str(dtype)[6:]}", long=(i + j) % 2 == 1)
    for i, feature in enumerate([*FEATURES, {"window": 20}])
    for j, dtype in enumerate((torch.float32, torch.bfloat16))])
def test_features(device, feature, dtype, only):
    seqs = SHORT if INTERPRETED else SHAPES["many_blocks"] + SHAPES["all_decode"]
    b = make_batch(seqs, num_heads=8, num_kv_heads=2, dtype=dtype, pad_tokens=2)
    _check(b, device, dtype, only=only, **feature_kwargs(feature))


def test_chunked_local_attention(device):
    # Llama 4's chunks: a query sees only keys of its own chunk, from the chunk's first block on
    b = make_batch([(300, 1), (47, 3), (64, 1), (15, 17)], num_heads=4, num_kv_heads=2)
    q, k, v, cache, meta = _to(b, device)
    torch.ops.pagedattn.write_kv_cache(k, v, cache, meta.slot_mapping)
    p = AttentionParams(0.125, True, 0, 0.0, None, 2, 64, chunk_size=48)
    out = triton_paged.attend(q, cache, meta, p).cpu()
    ref = static_paged.attend(b.query, cache.cpu(), b.meta, p)  # the cache as written on the device
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_sequences_of_length_zero_and_padding_tokens_get_zeros(device):
    # a captured step's padding: sequences with no token and length 0, tokens past the last sequence
    b = make_batch(SHAPES["all_decode"], num_heads=4, num_kv_heads=2, pad_tokens=5)
    q, k, v, cache, meta = _to(b, device)
    torch.ops.pagedattn.write_kv_cache(k, v, cache, meta.slot_mapping)
    S = meta.seq_lens.shape[0]
    padded = type(meta)(meta.slot_mapping, torch.cat([meta.block_tables, meta.block_tables[:2]]),
                        torch.cat([meta.seq_lens, meta.seq_lens.new_zeros(2)]),
                        torch.cat([meta.query_start_loc, meta.query_start_loc[-1:].repeat(2)]), meta.block_size)
    p = AttentionParams(0.125, True, 0, 0.0, None, 2, 64, sinks=SINKS8[:4].to(device))
    out = triton_paged.attend(q, cache, padded, p).cpu()
    n = int(meta.query_start_loc[-1])
    assert S == n and torch.all(out[n:] == 0) and torch.isfinite(out).all()
    torch.testing.assert_close(out, static_paged.attend(b.query, cache.cpu(), b.meta, p.__class__(
        **{**p.__dict__, "sinks": SINKS8[:4]})), atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_a_wrong_kernel_would_be_seen(device):
    # the comparison above can fail: another scale gives another answer
    b = make_batch(SHAPES["all_decode"], num_heads=4, num_kv_heads=2)
    q, k, v, cache, meta = _to(b, device)
    torch.ops.pagedattn.write_kv_cache(k, v, cache, meta.slot_mapping)
    out = triton_paged.attend(q, cache, meta, batch_params(b, 0.2)).cpu()
    assert not torch.allclose(out.double(), reference_step(b, 0.125), atol=1e-3)




def test_the_captured_steps_backend_checks_the_kernel_and_uses_it(device, monkeypatch, caplog):
    from pagedattn.backends import get_backend

    calls, writes = [], []
    real, real_write = triton_paged.attend, triton_paged.write
    monkeypatch.setattr(triton_paged, "attend", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(triton_paged, "write", lambda *a: writes.append(1) or real_write(*a))
    b = make_batch(SHAPES["all_decode"], num_heads=8, num_kv_heads=2, dtype=torch.bfloat16, pad_tokens=1)
    q, k, v, cache, meta = _to(b, device)
    backend = static_paged.StaticPagedBackend(get_backend(device))
    backend.write(k, v, cache, meta.slot_mapping)
    p = batch_params(b, 0.125, window=30)
    with caplog.at_level("WARNING", logger="pagedattn"):
        outs = [backend.attend(q, None, None, cache, meta, p).cpu() for _ in range(2)]
    assert len(calls) == 2 and len(writes) == 1 and not caplog.text  # each run once: a first call is checked on its own result
    ref = reference_step(b, 0.125, window=30)
    for out in outs:
        torch.testing.assert_close(out[:ref.shape[0]].double(), ref, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


def test_decode_steps_through_the_kernel_equal_hf_generate(device, monkeypatch, caplog):
    # a tiny Llama's decode steps over the capture path's padded buffers (captured as graphs on CUDA), the
    # attention through the kernel: Hugging Face generate's tokens
    import contextlib

    from pagedattn.adapter import prepare_model
    from pagedattn.backends import set_validation

    from ..runtime.test_cuda_graphs import greedy_through_graphs, tiny_llama
    from ..support import hf_generate, prompts

    calls = []
    real = triton_paged.attend
    monkeypatch.setattr(triton_paged, "attend", lambda *a: calls.append(1) or real(*a))
    model = tiny_llama(device, torch.float16 if device == "cuda" else torch.float32)
    sv = prepare_model(model, target=device, block_size=16)
    # the interpreter: two prompts, one of them past a block, and four tokens (each step there takes seconds)
    ps, new = (prompts(lengths=(5, 30)), 4) if INTERPRETED else (prompts(lengths=(5, 17, 9, 30)), 6)
    set_validation(False)  # as the engine's captured steps run
    try:
        with caplog.at_level("WARNING", logger="pagedattn"):
            out, _ = greedy_through_graphs(sv, sv.allocate_kv_caches(16), ps, new, contextlib.nullcontext,
                                           capture=device == "cuda", block_size=16)
    finally:
        set_validation(True)
    # used past each kind's first call (checked there): on CUDA once more per layer, as the graph is captured
    # (replays call no Python); in the interpreter at every step
    layers = model.config.num_hidden_layers
    assert len(calls) >= (2 * layers if device == "cuda" else (new - 1) * layers), len(calls)
    assert "Triton kernel" not in caplog.text, caplog.text
    assert out == hf_generate(model, ps, new)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, head_size", [(2, 64), (4, 80), (1, 8)])
def test_the_write_stores_each_real_token_and_skips_padding(device, dtype, heads, head_size):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 16, heads, head_size, generator=g).to(dtype)
    key = torch.randn(7, heads, head_size, generator=g).to(dtype)
    value = torch.randn(7, heads, head_size, generator=g).to(dtype)
    slots = torch.tensor([5, 17, -1, 40, 95, -1, 0])
    want = cache.clone()
    static_paged.write(key, value, want, slots)
    got = cache.to(device)
    assert triton_paged.write_usable(key.to(device), value.to(device), got)
    triton_paged.write(key.to(device), value.to(device), got, slots.to(device))
    assert torch.equal(got.cpu(), want)
    strided = torch.randn(7, heads, 2 * head_size, generator=g).to(dtype)[..., :head_size]  # rows not contiguous
    triton_paged.write(strided.to(device), value.to(device), got, slots.to(device))
    static_paged.write(strided, value, want, slots)
    assert torch.equal(got.cpu(), want)


def test_an_encoder_decoders_decode_steps_through_the_kernels_equal_hf_generate(device, monkeypatch):
    # BART's decode steps over the capture path's buffers (captured on CUDA): self-attention causal, cross-attention
    # bidirectional over the blocks filled at admission, both through the kernel
    from pagedattn import PagedEngine
    from pagedattn.runtime.cuda_graphs import DecodeGraphs

    from ..rewriter.seq2seq_models import hf_seq2seq_generate, sources, tiny_seq2seq

    kinds = []
    real = triton_paged.attend
    monkeypatch.setattr(triton_paged, "attend", lambda q, c, m, p: kinds.append(p.causal) or real(q, c, m, p))
    model = tiny_seq2seq("bart").to(device)
    engine = PagedEngine(model, target=device, block_size=16, num_blocks=64, max_num_seqs=8, compile=False,
                         progress=False, cuda_graphs=False)
    engine.decode_graphs = DecodeGraphs(engine.servable, engine.kv_caches, 8, engine.num_blocks,
                                        capture=device == "cuda")
    srcs, new = (sources()[1:3], 4) if INTERPRETED else (sources()[:3], 5)  # the interpreter: 17 and 9 tokens
    assert engine.generate(srcs, max_new_tokens=new) == hf_seq2seq_generate(tiny_seq2seq("bart"), srcs, new)
    assert kinds.count(True) > 2 and kinds.count(False) > 2  # both kinds used past their first call's check


def test_strided_metadata_is_read_as_its_values(device):
    # slot mappings, lengths and starts that are views with strides (every other element of a longer tensor)
    b = make_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, pad_tokens=2)
    q, k, v, cache, meta = _to(b, device)

    def strided(t):
        wide = torch.stack([t, torch.full_like(t, 7)], -1)  # [n, 2]: the values, then junk
        return wide[..., 0]

    triton_paged.write(k, v, cache, strided(meta.slot_mapping))
    tables = torch.stack([meta.block_tables, meta.block_tables + 1], -1)[..., 0]  # a row's blocks at stride 2
    moved = type(meta)(meta.slot_mapping, tables, strided(meta.seq_lens), strided(meta.query_start_loc),
                       meta.block_size)
    out = triton_paged.attend(q, cache, moved, batch_params(b, 0.125)).cpu()
    ref = reference_step(b, 0.125)
    torch.testing.assert_close(out[:ref.shape[0]].double(), ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("shape", ["mixed", "chunked", "all_decode"])
def test_the_xformers_backend_takes_the_kernels_for_every_step_when_asked(device, shape, monkeypatch):
    # XFormersCudaBackend(triton=True): prefills, chunked prefills and decodes through the kernels once their first
    # call agreed with the xFormers path (emulated on the CPU, real on CUDA); triton=False never calls them
    pytest.importorskip("xformers", reason="xformers is not installed")
    from pagedattn.backends.xformers_cuda import XFormersCudaBackend

    if device == "cpu":
        from .xformers_emulation import install

        install(monkeypatch)
    calls = []
    real = triton_paged.attend
    monkeypatch.setattr(triton_paged, "attend", lambda *a, **k: calls.append(1) or real(*a, **k))
    b = make_batch(SHAPES[shape], num_heads=8, num_kv_heads=2, dtype=torch.float16 if device == "cuda" else
                   torch.float32)
    q, k, v, cache, meta = _to(b, device)
    torch.ops.pagedattn.write_kv_cache(k, v, cache, meta.slot_mapping)
    p = batch_params(b, 0.125)
    ref = reference_step(b, 0.125)
    for triton, want_calls in ((False, 0), (True, 3)):
        calls.clear()
        backend = XFormersCudaBackend(triton=triton)
        for _ in range(3):  # the first call checked on its own result, the next two used
            out = backend.attend(q, k, v, cache, meta, p).cpu()
            torch.testing.assert_close(out.double(), ref, atol=TOL[q.dtype], rtol=TOL[q.dtype])
        assert len(calls) == want_calls, triton


@settings(max_examples=12 if INTERPRETED else 25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seqs=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 20)), min_size=1, max_size=5),
       group=st.sampled_from([1, 2, 3, 4]), kv_heads=st.sampled_from([1, 2]), head_size=st.sampled_from([8, 24, 64]),
       block_size=st.sampled_from([16, 32]), visibility=st.sampled_from(["causal", "window", "chunk", "all"]),
       reach=st.integers(1, 40), queries=st.sampled_from([None, 1, 2, 3, 5]), pad=st.integers(0, 3),
       programs=st.sampled_from([1, 8, triton_paged.TARGET_PROGRAMS]))
def test_any_batch_through_either_kernel_matches_the_portable_path(device, seqs, group, kv_heads, head_size,
                                                                    block_size, visibility, reach, queries, pad,
                                                                    programs):
    # random steps (sequences with or without cached keys, padding tokens), GQA groups that are not powers of
    # two, windows and chunks of any reach, tiles of any number of queries that cut sequences anywhere, and few
    # programs (one split a row: a program's loop runs over several tiles of keys, its online softmax rescaling):
    # both kernels against the portable path (itself checked against the reference)
    b = make_batch(seqs, num_heads=group * kv_heads, num_kv_heads=kv_heads, head_size=head_size,
                   block_size=block_size, pad_tokens=pad)
    q, k, v, cache, meta = _to(b, device)
    torch.ops.pagedattn.write_kv_cache(k, v, cache, meta.slot_mapping)
    p = AttentionParams(0.3, visibility != "all", reach if visibility == "window" else 0, 0.0, None, kv_heads,
                        head_size, chunk_size=reach if visibility == "chunk" else 0)
    out = triton_paged.attend(q, cache, meta, p, queries=queries, programs=programs).cpu()
    want = static_paged.attend(b.query, cache.cpu(), b.meta, p)
    torch.testing.assert_close(out, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])
