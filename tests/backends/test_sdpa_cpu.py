import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedattn.backends import AttentionConfig, AttentionParams, get_backend

from ..support import (
    BUCKET_BIAS_MOD,
    BUCKET_TABLE,
    FEATURES,
    SHAPES,
    SINKS_WINDOW_MOD,
    TOL,
    check_copy_and_swap,
    feature_id,
    feature_kwargs,
    make_batch,
    record_decode_masks,
    reference_step,
    run_step,
)

pytestmark = pytest.mark.usefixtures("decode_path")


def _check(batch, dtype, **kw):
    scale = kw.pop("scale", 1 / math.sqrt(batch.query.shape[-1]))
    out = run_step(batch, scale, pass_kv=kw.pop("pass_kv", True), **kw)
    ref = reference_step(batch, scale, **kw)
    n = ref.shape[0]
    torch.testing.assert_close(out[:n].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.all(out[n:] == 0), "padding rows must be zero"


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_batch_shapes(shape, dtype):
    _check(make_batch(SHAPES[shape], dtype=dtype, pad_tokens=3), dtype)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (8, 4), (16, 2), (8, 1)], ids=["mha", "gqa2", "gqa8", "mqa"])
@pytest.mark.parametrize("head_size", [64, 80, 128])
def test_layouts(block_size, heads, head_size):
    nh, nkv = heads
    b = make_batch(SHAPES["mixed"], num_heads=nh, num_kv_heads=nkv, head_size=head_size, block_size=block_size)
    _check(b, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("feature", FEATURES, ids=feature_id)
def test_features(feature, dtype):
    b = make_batch(SHAPES["mixed"], num_heads=8, num_kv_heads=2, dtype=dtype)
    _check(b, dtype, **feature_kwargs(feature))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["mixed", "all_decode", "many_blocks"])
@pytest.mark.parametrize("mod", ["sinks_window", "bucket_bias"])
def test_position_programs(mod, shape, dtype):
    # a mask no fast kind expresses (sink tokens plus a window) and a per-head bias by distance bucket,
    # evaluated for each step's positions: decodes, prefills and continued prefills
    b = make_batch(SHAPES[shape], num_heads=4, num_kv_heads=2, dtype=dtype)
    program = (SINKS_WINDOW_MOD, None) if mod == "sinks_window" else (BUCKET_BIAS_MOD, BUCKET_TABLE)
    _check(b, dtype, causal=False, mod=program)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("feature", [{}, {"window": 9}, {"window": 40}, {"sinks": True}, {"alibi": True}],
                         ids=["causal", "window9", "window40", "sinks", "alibi"])
def test_a_program_read_by_distance_with_the_sites_other_terms(feature, dtype):
    # a program that reads positions only through k - q (served from one evaluation per distance, each decode's keys
    # and each prefill's pairs reading theirs) together with causality, a window (a decode's keys from the window's
    # start), sinks or ALiBi (whose bias the program's joins), at lengths past one grid of distances (256)
    b = make_batch(SHAPES["many_blocks"] + [(700, 1), (255, 1), (256, 1)], num_heads=4, num_kv_heads=2, dtype=dtype)
    kw = {"window": feature.get("window", 0)}
    if feature.get("sinks"):
        kw["sinks"] = torch.linspace(-2.0, 3.0, 4)
    if feature.get("alibi"):
        kw["alibi"] = torch.linspace(0.05, 0.5, 4)
    _check(b, dtype, causal=True, mod=(BUCKET_BIAS_MOD, BUCKET_TABLE), **kw)


def test_a_position_program_differs_from_the_causal_reading():
    # the check above can fail: the program's mask is not what causal attention computes
    b = make_batch(SHAPES["many_blocks"], num_heads=4, num_kv_heads=2)
    out = run_step(b, 0.125, causal=False, mod=(SINKS_WINDOW_MOD, None))
    n = sum(b.q_lens)
    assert not torch.allclose(out[:n].double(), reference_step(b, 0.125), atol=1e-3)


@pytest.mark.parametrize("decode_path", ["sdpa"], indirect=True)  # the SDPA path's own workings
@pytest.mark.parametrize("mod", ["bucket_bias", "alibi"])
def test_sites_sharing_a_program_share_the_step_plan_with_their_own_tables(monkeypatch, mod):
    # layers whose parameters differ only in tensors (a program's learned tables, ALiBi slopes) build the
    # decode plan once a step; each still gets the bias of its own tensors
    from pagedattn.backends import sdpa_cpu

    builds = []
    real = sdpa_cpu._build_decode_plan
    monkeypatch.setattr(sdpa_cpu, "_build_decode_plan", lambda *a: builds.append(1) or real(*a))
    b = make_batch(SHAPES["all_decode"], num_heads=4, num_kv_heads=2)
    tables = (BUCKET_TABLE, BUCKET_TABLE.flip(0) * 2, BUCKET_TABLE)
    for t in tables:
        feature = {"mod": (BUCKET_BIAS_MOD, t)} if mod == "bucket_bias" else {"alibi": t[:4].abs()}
        _check(b, torch.float32, causal=mod == "alibi", **feature)
    assert len(builds) == 1


@pytest.mark.parametrize("decode_path", ["sdpa"], indirect=True)  # the SDPA path's own workings
def test_steps_alternating_two_block_tables_keep_both_plans(monkeypatch):
    # an encoder-decoder's step: self-attention and cross-attention layers alternate between two block
    # tables; each keeps its plan for the whole step
    from pagedattn.backends import sdpa_cpu

    builds = []
    real = sdpa_cpu._build_decode_plan
    monkeypatch.setattr(sdpa_cpu, "_build_decode_plan", lambda *a: builds.append(1) or real(*a))
    one = make_batch(SHAPES["all_decode"], num_heads=4, num_kv_heads=2, generator=torch.Generator().manual_seed(1))
    two = make_batch(SHAPES["all_decode"], num_heads=4, num_kv_heads=2, generator=torch.Generator().manual_seed(2))
    for b in (one, two, one, two, one):
        _check(b, torch.float32)
    assert len(builds) == 2


@pytest.mark.parametrize("shape", ["all_decode", "many_blocks", "chunked"])
def test_sinks_over_split_decode(shape, monkeypatch):
    # long decodes are attended in chunks merged by log-sum-exp: the sink joins that merge
    from pagedattn.backends import sdpa_cpu

    monkeypatch.setattr(sdpa_cpu, "_GATHER_BUDGET_BYTES", 16 * 2 * 4 * 2 * 64 * 4)  # 16 blocks per group
    b = make_batch(SHAPES[shape], num_heads=8, num_kv_heads=2, block_size=4)
    _check(b, torch.float32, sinks=torch.linspace(-1.0, 3.0, 8))


def test_cross_attention_over_filled_cache():
    # decoder tokens attend, non-causally, to an encoder cache written once; no new K/V
    b = make_batch([(20, 3), (9, 1), (33, 6)], num_heads=4, num_kv_heads=4)
    torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    enc_lens = torch.tensor([c + n for c, n in zip(b.contexts, b.q_lens)], dtype=torch.int32)
    out = torch.ops.pagedattn.paged_attention(
        b.query, None, None, b.kv_cache, b.meta.block_tables, enc_lens, b.meta.query_start_loc,
        *AttentionParams(0.125, False, 0, 0.0, None, 4, 64).args(),
    )
    ref = reference_step(b, 0.125, causal=False)
    torch.testing.assert_close(out.double(), ref, atol=2e-4, rtol=2e-4)


def test_reads_cache_when_no_new_kv_given():
    b = make_batch(SHAPES["mixed"])
    _check(b, torch.float32, pass_kv=False)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(
        st.tuples(st.integers(0, 70), st.integers(1, 24)).map(lambda t: (t[0], t[1] if t[0] else max(t[1], 1))),
        min_size=1, max_size=6,
    ),
    block_size=st.sampled_from([1, 4, 16, 32]),
    group=st.sampled_from([1, 2, 4]),
    window=st.sampled_from([0, 0, 5, 33]),
    softcap=st.sampled_from([0.0, 0.0, 4.0]),
    pad=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_batches(seqs, block_size, group, window, softcap, pad, seed):
    b = make_batch(seqs, num_heads=2 * group, num_kv_heads=2, head_size=32, block_size=block_size,
                   pad_tokens=pad, generator=torch.Generator().manual_seed(seed))
    _check(b, torch.float32, window=window, softcap=softcap)


def test_padding_slots_are_skipped():
    b = make_batch([(0, 4)], pad_tokens=2)
    before = b.kv_cache.clone()
    torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    changed = (b.kv_cache != before).flatten(3).any(-1)  # [2, blocks, block_size]
    assert int(changed[0].sum()) == 4


def test_functional_write_leaves_input_alone():
    b = make_batch([(0, 5), (3, 1)])
    before = b.kv_cache.clone()
    new = torch.ops.pagedattn.write_kv_cache_functional(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    assert torch.equal(b.kv_cache, before)
    torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    assert torch.equal(new, b.kv_cache)


def test_copy_and_swap_blocks():
    backend = get_backend("cpu")
    check_copy_and_swap(backend)


def _config(num_heads, num_kv_heads, head_size, dtype=torch.float32, **params):
    p = dict(scale=0.1, causal=True, sliding_window=0, softcap=0.0, alibi_slopes=None, num_kv_heads=num_kv_heads,
             head_size_v=head_size)
    p.update(params)
    return AttentionConfig(AttentionParams(**p), num_heads, head_size, dtype)


def test_supports_gives_reasons():
    backend = get_backend("cpu")
    ok = _config(8, 2, 64)
    assert backend.supports(ok) == [] and ok.group_size == 4
    bad = _config(6, 4, 64, torch.float64)
    reasons = backend.supports(bad)
    assert any("float64" in r for r in reasons) and any("multiple" in r for r in reasons)
    reasons = backend.supports(_config(8, 2, 64, causal=False, sliding_window=8, head_size_v=32))
    assert any("needs causal" in r for r in reasons) and any("value head size" in r for r in reasons)


def test_cache_shape():
    assert get_backend("cpu").kv_cache_shape(10, 16, 8, 128) == (2, 10, 16, 8, 128)


@pytest.mark.parametrize("feature", [{}, {"window": 21}, {"softcap": 4.0}, {"alibi": True}], ids=["plain", "window", "softcap", "alibi"])
def test_split_decode_merges_chunks(monkeypatch, feature):
    # a tiny gather budget forces long decodes into several key chunks merged by log-sum-exp
    from pagedattn.backends import sdpa_cpu

    monkeypatch.setattr(sdpa_cpu, "_GATHER_BUDGET_BYTES", 4 * 2 * 2 * 64 * 4 * 3)
    feature = dict(feature)
    if feature.pop("alibi", False):
        feature["alibi"] = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    b = make_batch([(100, 1), (3, 1), (57, 1), (0, 9), (40, 1)], num_heads=4, num_kv_heads=2, block_size=4)
    _check(b, torch.float32, **feature)


@pytest.mark.parametrize("decode_path", ["sdpa"], indirect=True)  # the SDPA path's own workings
@pytest.mark.parametrize("budget_blocks", [3, 8, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_without_mask_when_every_key_is_visible(monkeypatch, budget_blocks, dtype):
    # equal, block-aligned lengths: every gathered key is visible, so no group needs a mask,
    # whether a sequence is one chunk or several merged ones
    from pagedattn.backends import sdpa_cpu

    monkeypatch.setattr(sdpa_cpu, "_GATHER_BUDGET_BYTES", budget_blocks * 4 * 2 * 2 * 64 * dtype.itemsize)
    seen = record_decode_masks(monkeypatch)
    b = make_batch([(63, 1)] * 4, num_heads=8, num_kv_heads=2, block_size=4, dtype=dtype)
    _check(b, dtype)
    assert seen and all(m is None for m in seen)


@pytest.mark.parametrize("decode_path", ["sdpa"], indirect=True)  # the SDPA path's own workings
def test_decode_masks_only_groups_with_hidden_keys(monkeypatch):
    from pagedattn.backends import sdpa_cpu

    monkeypatch.setattr(sdpa_cpu, "_GATHER_BUDGET_BYTES", 4 * 4 * 2 * 2 * 64 * 4)  # 4 blocks a group
    seen = record_decode_masks(monkeypatch)
    b = make_batch([(63, 1), (29, 1), (2, 1)], num_heads=4, num_kv_heads=2, block_size=4)
    _check(b, torch.float32)
    assert any(m is None for m in seen) and any(m is not None for m in seen)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("feature", [{}, {"window": 21}, {"alibi": True}], ids=["plain", "window", "alibi"])
def test_decode_chunking_follows_thread_count(monkeypatch, threads, feature):
    # chunks are a thread's share of a group; results must not depend on how many threads there are
    from pagedattn.backends import sdpa_cpu

    monkeypatch.setattr(sdpa_cpu, "_GATHER_BUDGET_BYTES", 6 * 4 * 2 * 2 * 64 * 4)
    feature = dict(feature)
    if feature.pop("alibi", False):
        feature["alibi"] = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    b = make_batch([(100, 1), (3, 1), (57, 1), (0, 9), (40, 1), (23, 1)], num_heads=4, num_kv_heads=2, block_size=4)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(b, torch.float32, **feature)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("split", [False, True])
def test_decode_from_a_cache_view(monkeypatch, split):
    # a cache that is a slice of a larger buffer cannot be seen as [2 * num_blocks, ...] blocks:
    # K and V are then gathered separately
    from pagedattn.backends import sdpa_cpu

    if split:
        monkeypatch.setattr(sdpa_cpu, "_GATHER_BUDGET_BYTES", 3 * 4 * 2 * 2 * 64 * 4)
    b = make_batch([(50, 1), (0, 4), (17, 1), (33, 1)], num_heads=4, num_kv_heads=2, block_size=4)
    nb = b.kv_cache.shape[1]
    big = torch.full((2, nb + 5, *b.kv_cache.shape[2:]), float("nan"))
    big[:, :nb] = b.kv_cache
    b.kv_cache = big[:, :nb]
    assert b.kv_cache.stride(0) != nb * b.kv_cache.stride(1)
    _check(b, torch.float32)


def _greedy_groups(sizes, budget):
    # one group while the budget allows: every chunk padded to the longest of its group
    bounds, start = [], 0
    for i in range(1, len(sizes) + 1):
        if i == len(sizes) or (i - start + 1) * sizes[start] > budget:
            bounds.append((start, i, sizes[start]))
            start = i
    return bounds


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=80), st.integers(1, 300), st.integers(1, 16))
def test_decode_groups_cover_chunks_within_budget_at_least_as_cheaply_as_one_greedy_group(sizes, budget, overhead):
    from pagedattn.backends.sdpa_cpu import _groups

    sizes = tuple(sorted(sizes, reverse=True))
    bounds = _groups(sizes, budget, overhead)
    assert [a for a, _, _ in bounds] == [0] + [b for _, b, _ in bounds[:-1]] and bounds[-1][1] == len(sizes)
    for a, b, n in bounds:
        assert n == max(sizes[a:b]) and ((b - a) * n <= budget or b - a == 1)

    def cost(groups):
        return sum(overhead + (b - a) * n for a, b, n in groups)

    assert cost(bounds) <= cost(_greedy_groups(sizes, budget))


@pytest.mark.parametrize("decode_path", ["sdpa"], indirect=True)  # the SDPA path's own workings
def test_ragged_decodes_gather_in_groups_of_similar_lengths(monkeypatch):
    # lengths from 1 to 30 blocks: one group would pad every chunk to 30 blocks; groups of similar
    # lengths gather far fewer, and the result is the reference's
    from pagedattn.backends import sdpa_cpu

    gathered = []
    real = sdpa_cpu._kv_views
    monkeypatch.setattr(sdpa_cpu, "_kv_views", lambda ws, g, span, *a: gathered.append(g * span) or real(ws, g, span, *a))
    lens = [4 * n - 1 - (n % 3) for n in range(1, 31)]
    b = make_batch([(n - 1, 1) for n in lens], num_heads=4, num_kv_heads=2, block_size=4)
    _check(b, torch.float32)
    assert 1 < len(gathered) and sum(gathered) < 0.7 * len(lens) * 4 * 30


@pytest.mark.parametrize("decode_path", ["sdpa"], indirect=True)  # the SDPA path's own workings
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
def test_decodes_over_unwritten_caches_reuse_their_gather_until_the_cache_changes(monkeypatch, alibi):
    # cross-attention (key=None) over the same blocks, step after step, gathers once; a write anywhere in the
    # cache (a new request's cross K/V, a swap-in) is seen at the next call, never the stale gather. With a
    # tensor parameter (ALiBi slopes) each call's plan is a copy with its own bias: the same gather still holds
    import gc
    import weakref

    from pagedattn.backends import build_cross_metadata, sdpa_cpu

    gathers = []
    real = torch.index_select
    monkeypatch.setattr(sdpa_cpu.torch, "index_select", lambda *a, **k: gathers.append(1) or real(*a, **k))
    cache = torch.randn(2, 10, 8, 2, 16)
    meta = build_cross_metadata([[0, 1], [2, 3, 4, 5], [6, 7, 8]], [5, 23, 17], 8)
    qsl = torch.arange(4, dtype=torch.int32)
    p = AttentionParams(0.25, False, 0, 0.0, torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None, 2, 16)
    q = torch.randn(3, 4, 16)

    def attend(c):
        before = len(gathers)
        out = torch.ops.pagedattn.paged_attention(q, None, None, c, meta.block_tables, meta.seq_lens, qsl, *p.args())
        return out, len(gathers) - before

    first, n = attend(cache)
    again, m = attend(cache)
    assert n > 0 and m == 0 and torch.equal(again, first)
    cache[1, 3] += 1.0  # sequence 1's second block changes
    changed, m = attend(cache)
    assert m == n and not torch.allclose(changed[1], first[1]) and torch.equal(changed[0], first[0])
    # a write through the op (as a new request's cross K/V are written) is seen too, by the native write where it is
    # built (an in-place write through ctypes: the op bumps the version itself)
    monkeypatch.setenv("PAGEDATTN_NATIVE", "1")
    torch.ops.pagedattn.write_kv_cache(torch.randn(1, 2, 16), torch.randn(1, 2, 16), cache,
                                       torch.tensor([6 * 8 + 2]))  # sequence 2's block 6, slot 2
    monkeypatch.setenv("PAGEDATTN_NATIVE", "0")
    written, m = attend(cache)
    assert m == n and not torch.allclose(written[2], changed[2]) and torch.equal(written[0], changed[0])
    changed = written
    monkeypatch.setattr(sdpa_cpu, "_gathered", lambda c, plan: None)  # the same call, gathered afresh
    torch.testing.assert_close(attend(cache)[0], changed)
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None  # the memo does not keep a cache alive, and lets its buffers go with it
    assert not sdpa_cpu._LOCAL.__dict__.get("kept")


@pytest.mark.parametrize("decode_path", ["sdpa"], indirect=True)  # the SDPA path's reused buffers
def test_buffers_made_in_inference_mode_serve_later_calls_outside_it():
    # the engine's CPU step runs under torch.inference_mode; the same thread may then attend outside it (onnx
    # verification, eager checks, a query that requires grad): the gather workspace made in the first call is
    # written again by the second, and cross-attention's kept gathers are read by it
    from pagedattn.backends import build_cross_metadata

    b = make_batch(SHAPES["all_decode"], num_heads=4, num_kv_heads=2)
    with torch.inference_mode():
        run_step(b, 0.25)
    b.query.requires_grad_()
    out = run_step(b, 0.25)
    assert not torch.is_inference(out) and out.requires_grad
    n = sum(b.q_lens)
    torch.testing.assert_close(out[:n].detach().double(), reference_step(b, 0.25), atol=TOL[torch.float32],
                               rtol=TOL[torch.float32])

    cache = torch.randn(2, 10, 8, 2, 16)
    meta = build_cross_metadata([[0, 1], [2, 3, 4, 5], [6, 7, 8]], [5, 23, 17], 8)
    qsl = torch.arange(4, dtype=torch.int32)
    p = AttentionParams(0.25, False, 0, 0.0, None, 2, 16)
    q = torch.randn(3, 4, 16)

    def cross(query):
        return torch.ops.pagedattn.paged_attention(query, None, None, cache, meta.block_tables, meta.seq_lens, qsl,
                                                   *p.args())

    with torch.inference_mode():
        first = cross(q)
    again = cross(q.clone().requires_grad_())
    assert not torch.is_inference(again) and torch.equal(again.detach(), first)


def _spy_prefill_paths(monkeypatch):
    """Which prompts and chunks (their lengths) went through SDPA's kernel (fresh prompts, chunks after cached keys)
    and which through the native prefill kernel."""
    from pagedattn.backends import native, sdpa_cpu

    seen = {"sdpa": [], "chunk": [], "native": []}
    one, chunk, prefill = sdpa_cpu.SdpaCpuBackend._one, sdpa_cpu._chunk_by_sdpa, native.prefill

    def spy_one(self, out, query, s, k, v, k0, params, *rest):
        seen["sdpa"].append(s.q_len)
        return one(self, out, query, s, k, v, k0, params, *rest)

    def spy_chunk(out, query, s, k, v, scale):
        seen["chunk"].append(s.q_len)
        return chunk(out, query, s, k, v, scale)

    def spy_prefill(lib, out, query, key, value, items, **kw):
        seen["native"] += [int(n) for n in items[:, 1]]
        return prefill(lib, out, query, key, value, items, **kw)

    monkeypatch.setattr(sdpa_cpu.SdpaCpuBackend, "_one", spy_one)
    monkeypatch.setattr(sdpa_cpu, "_chunk_by_sdpa", spy_chunk)
    monkeypatch.setattr(native, "prefill", spy_prefill)
    return seen


@pytest.mark.parametrize("decode_path", ["native"], indirect=True)
@pytest.mark.parametrize("case", ["bf16_amx", "bf16_amx_d128", "bf16_amx_not_causal", "fp32", "no_amx", "window"])
def test_long_prompts_and_chunks_take_sdpa_in_bfloat16_with_amx(monkeypatch, case):
    # bfloat16 prompts of SDPA_PREFILL_TOKENS or more, and causal chunks after cached keys of enough work (64 queries
    # after 2048 keys: yes; 200 after 300, or 5 after 17: no), go to SDPA's kernel where the CPU has AMX tiles (a chunk
    # as two calls, over the cached keys and over its own, merged), the step's other prefills to the native kernel;
    # float32, a CPU without AMX and a window keep the native kernel for every one, and a bidirectional chunk the
    # native kernel. Each case agrees with the reference.
    from pagedattn.backends import sdpa_cpu

    monkeypatch.setattr(sdpa_cpu, "_amx_tiles", lambda: case != "no_amx")
    n = sdpa_cpu.SDPA_PREFILL_TOKENS
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    b = make_batch([(0, n + 37), (0, 40), (30, 1), (0, n - 1), (17, 5), (0, n), (600, n + 8), (2048, 64), (300, 200)],
                   num_heads=6, num_kv_heads=2, head_size=128 if case.endswith("d128") else 64, dtype=dtype)
    seen = _spy_prefill_paths(monkeypatch)
    kw = {"window": 100} if case == "window" else {"causal": False} if case == "bf16_amx_not_causal" else {}
    _check(b, dtype, **kw)
    native = [5, 40, 200, n - 1]  # (the chunks of 5 and 200 among them)
    if case in ("bf16_amx", "bf16_amx_d128"):
        assert sorted(seen["sdpa"]) == [n, n + 37] and sorted(seen["chunk"]) == [64, n + 8]
        assert sorted(seen["native"]) == native
    elif case == "bf16_amx_not_causal":
        assert sorted(seen["sdpa"]) == [n, n + 37] and seen["chunk"] == []
        assert sorted(seen["native"]) == sorted(native + [64, n + 8])
    else:
        assert seen["sdpa"] == seen["chunk"] == [] and sorted(seen["native"]) == sorted(native + [64, n, n + 8, n + 37])


@pytest.mark.parametrize("decode_path", ["native"], indirect=True)
@pytest.mark.parametrize("batch_bytes", [None, 1], ids=["one_batch", "a_batch_each"])
@pytest.mark.parametrize("kw", [{}, {"window": 20}, {"causal": False}], ids=["causal", "window", "bidirectional"])
def test_chunks_over_cached_keys_share_native_calls(monkeypatch, batch_bytes, kw):
    # chunks after cached keys (prefix-cache hits, chunked prefills) go to the native prefill in batches, one gather
    # and one call a batch, each chunk's keys a run of the gathered rows (from a window's block on): the reference's
    # result, whether the chunks share one batch or the budget puts each in its own; fresh prompts keep their call
    from pagedattn.backends import sdpa_cpu

    if batch_bytes is not None:
        monkeypatch.setattr(sdpa_cpu, "REST_BATCH_BYTES", batch_bytes)
    calls = []
    prefill = sdpa_cpu._prefill
    monkeypatch.setattr(sdpa_cpu, "_prefill", lambda *a: calls.append(a[5][:, 1].tolist()) or prefill(*a))
    chunks = [(16, 20), (47, 3), (100, 16), (5, 9)]
    b = make_batch([(0, 12), (30, 1)] + chunks, num_heads=8, num_kv_heads=2, dtype=torch.float32)
    _check(b, torch.float32, **kw)
    fresh, rest = calls[0], calls[1:]
    assert fresh == [12]
    assert rest == ([[20, 3, 16, 9]] if batch_bytes is None else [[20], [3], [16], [9]])


@pytest.mark.parametrize("decode_path", ["native"], indirect=True)
def test_sites_with_other_windows_over_one_steps_chunks_take_their_own_batches():
    # the batches are memoised for the step's layers by the site's window too: a windowed layer's batch gathers from
    # its window's first block, so a global layer after it over the same metadata must not take that batch (it would
    # miss the keys before); each agrees with the reference
    b = make_batch([(40, 7), (64, 30), (3, 2)], num_heads=4, num_kv_heads=2, dtype=torch.float32)
    for window in (9, 0, 9):
        _check(b, torch.float32, window=window)


@pytest.mark.parametrize("row", [0, 1], ids=["decode", "chunk"])
def test_a_block_outside_the_cache_is_one_clear_error(row):
    # decodes and chunks over cached keys gather their blocks by index: with validation off (the serving path: its
    # full checks name the entry too), an entry past the cache's blocks is refused by name, on the native path (its
    # decode kernel; batched chunk gathers) and on SDPA's (its decode groups; a gather a chunk), not an IndexError
    # from deep in a gather
    from pagedattn.backends import set_validation

    b = make_batch([(20, 1), (40, 30)], num_heads=4, num_kv_heads=2, dtype=torch.float32)
    b.meta.block_tables[row, 1] = b.kv_cache.shape[1]
    set_validation(False)
    try:
        with pytest.raises(ValueError, match="not a block of the cache"):
            run_step(b, 0.125)
    finally:
        set_validation(True)
