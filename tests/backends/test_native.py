"""The CPU's native paged decode kernel (backends/native.py, backends/csrc/paged_decode.c): its results against the
reference, its parts and threads, its refusals of out-of-bounds metadata, its build cache and its fallbacks.
The sdpa_cpu tests run every CPU step through it as well (tests/backends/conftest.py's ``decode_path``)."""

import ctypes
import functools
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedattn.backends import native, native_ops, sdpa_cpu

from ..support import TOL, batch_params, make_batch, reference_step, skip_unless_missing_prerequisite


@pytest.fixture(autouse=True)
def _built():
    if native.load() is None:
        skip_unless_missing_prerequisite()


def _call(b, part_keys, threads, params, lib=None):
    """The batch's decodes (every sequence has one new token) straight through the kernel (``lib``, else the one
    serving uses): ``[T, Hq, D]``."""
    torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    lens = b.meta.seq_lens.tolist()
    from pagedattn.backends import reference

    items = torch.tensor([(i, i, reference.earliest_visible_key(n - 1, params), n) for i, n in enumerate(lens)])
    call = native.DecodeCall(lib or native.load(), items, part_keys, threads)
    out = torch.zeros_like(b.query)
    call(out, b.query, b.kv_cache, b.meta.block_tables, params.scale, params.softcap, params.alibi_slopes,
         params.sinks)
    return out


def _feature_params(feature: dict, num_heads: int) -> dict:
    """A feature of the strategies below as ``batch_params`` / ``reference_step`` keywords, for ``num_heads``."""
    kw = dict(window=feature.get("window", 0), softcap=feature.get("softcap", 0.0), causal=feature.get("causal", True))
    if feature.get("alibi"):
        kw["alibi"] = torch.linspace(0.05, 0.8, num_heads)
    if feature.get("sinks"):
        kw["sinks"] = torch.linspace(-2.0, 3.0, num_heads)
    return kw


@functools.lru_cache(maxsize=1)
def _widening_build():
    """The library with bfloat16 scores by widening, as CPUs without AVX512-BF16 build it."""
    return native.build_library(("PAGEDATTN_NO_DPBF16",))


def _cpu_flags() -> set:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


@functools.lru_cache(maxsize=1)
def _avx2_build():
    """The library with its AVX2 paths (pagedattn_abi.h's PAGEDATTN_AVX2_PATHS): a CPU with AVX2 but not AVX-512 builds
    them by default; one with both builds them for the tests too. The default build where the CPU has no AVX2."""
    flags = _cpu_flags()
    if "avx512f" in flags and {"avx2", "fma", "f16c"} <= flags:
        return native.build_library(("PAGEDATTN_AVX2",))
    return native.load()


def _build(avx2: bool):
    return _avx2_build() if avx2 else native.load()


@functools.lru_cache(maxsize=1)
def _pairs_build():
    """The library with bfloat16 prefill scores by pair dot products wherever the CPU has them (the default only
    where they pay): the tests of that path run on every CPU with AVX512-BF16."""
    return native.build_library(("PAGEDATTN_PREFILL_PAIRS",))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(1, 300), min_size=1, max_size=6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    head_size=st.sampled_from([8, 32, 40, 64, 80, 128, 256]),
    group=st.sampled_from([1, 2, 3, 4, 6, 8]),  # the kernel's constant group sizes and one it takes at run time (6)
    block_size=st.sampled_from([1, 5, 16, 32]),
    part_keys=st.sampled_from([1, 7, 64, 4096]),
    threads=st.integers(1, 3),
    feature=st.sampled_from([{}, {"window": 9}, {"softcap": 3.0}, {"alibi": True}, {"sinks": True},
                             {"causal": False}, {"softcap": 2.0, "alibi": True, "sinks": True, "window": 40}]),
    avx2=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_decodes_match_the_reference(lens, dtype, head_size, group, block_size, part_keys, threads, feature, avx2,
                                     seed):
    # through this CPU's build and the one with the AVX2 paths (the same where it has no AVX-512)
    b = make_batch([(n - 1, 1) for n in lens], num_heads=2 * group, num_kv_heads=2, head_size=head_size,
                   block_size=block_size, dtype=dtype, generator=torch.Generator().manual_seed(seed))
    kw = _feature_params(feature, 2 * group)
    scale = 1 / math.sqrt(head_size)
    out = _call(b, part_keys, threads, batch_params(b, scale, **kw), lib=_build(avx2))
    ref = reference_step(b, scale, **kw)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def _cpu_has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def test_bfloat16_scores_take_the_cpus_pair_dot_products_where_it_has_them():
    # the fast path must not be lost silently to a macro the compiler stops defining
    has = bool(native.features(native.load()) & native.FEATURE_DPBF16)
    assert has == _cpu_has_avx512_bf16()
    assert not native.features(_widening_build()) & native.FEATURE_DPBF16
    # prefills take them where they pay (AMD's CPUs); a build may ask for them anywhere (the tests of that path)
    try:
        amd = "AuthenticAMD" in Path("/proc/cpuinfo").read_text()
    except OSError:
        amd = False
    assert bool(native.features(native.load()) & native.FEATURE_PREFILL_DPBF16) == (has and amd)
    assert bool(native.features(_pairs_build()) & native.FEATURE_PREFILL_DPBF16) == has
    assert not native.features(_widening_build()) & native.FEATURE_PREFILL_DPBF16


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # up to 600 keys in one unit (part_keys 4096): several chunks of 8 tiles with whole blocks of 16, as with 5
    lens=st.lists(st.integers(1, 600), min_size=1, max_size=4),
    head_size=st.sampled_from([32, 64, 128, 256]),  # the vector path's
    group=st.sampled_from([1, 3, 8]),
    block_size=st.sampled_from([5, 16]),
    part_keys=st.sampled_from([7, 64, 4096]),
    widening=st.booleans(),
    feature=st.sampled_from([{}, {"window": 9}, {"softcap": 3.0, "alibi": True, "sinks": True}]),
    seed=st.integers(0, 2**16),
)
def test_bfloat16_decodes_match_the_reference_with_and_without_pair_dot_products(lens, head_size, group, block_size,
                                                                                  part_keys, widening, feature, seed):
    b = make_batch([(n - 1, 1) for n in lens], num_heads=2 * group, num_kv_heads=2, head_size=head_size,
                   block_size=block_size, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(seed))
    kw = _feature_params(feature, 2 * group)
    scale = 1 / math.sqrt(head_size)
    lib = _widening_build() if widening else native.load()
    out = _call(b, part_keys, 2, batch_params(b, scale, **kw), lib=lib)
    torch.testing.assert_close(out.double(), reference_step(b, scale, **kw), atol=TOL[torch.bfloat16],
                               rtol=TOL[torch.bfloat16])


def test_bfloat16_decode_scores_agree_across_builds_to_a_unit_of_the_weights():
    # as for prefills (test_bfloat16_prefill_scores_agree_across_builds_to_a_unit_of_the_weights): a check the
    # reference's bfloat16 tolerance is too loose to make
    if not native.features(native.load()) & native.FEATURE_DPBF16:
        pytest.skip("the CPU has no AVX512-BF16: both builds widen")
    b = make_batch([(n - 1, 1) for n in (600, 170, 33, 1)], num_heads=6, num_kv_heads=2, head_size=64,
                   block_size=16, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5))
    b.query.mul_(3)  # sharp softmax: scale errors show
    params = batch_params(b, 0.125)
    outs = [_call(b, 64, 2, params, lib=lib).float() for lib in (native.load(), _widening_build())]
    b.kv_cache[1].abs_()  # [2, blocks, block, KV heads, D]: the values' magnitudes, for the bound
    b.value = b.value.abs()
    weighted = _call(b, 64, 2, params, lib=_widening_build()).float()
    diff = (outs[0] - outs[1]).abs()
    assert (diff <= 2.0 ** -6 * weighted).all()
    assert (diff > 0).float().mean() < 0.01


def test_a_query_that_sees_no_key_gets_zeros():
    # an empty cross-attention source: zero keys, with and without sinks (the sink takes the whole weight)
    b = make_batch([(3, 1), (0, 1)], num_heads=4, num_kv_heads=2, head_size=64)
    items = torch.tensor([(0, 0, 0, 4), (1, 1, 0, 0)])
    for sinks in (None, torch.ones(4)):
        out = torch.full_like(b.query, float("nan"))
        native.DecodeCall(native.load(), items, 64, 1)(out, b.query, b.kv_cache, b.meta.block_tables, 0.125, 0.0,
                                                      None, sinks)
        assert torch.all(out[1] == 0) and torch.isfinite(out[0]).all()


def _bias_reference(b, items, scale, softcap, sinks, bias) -> torch.Tensor:
    """Each item's decode over keys ``[first, keys)`` in float64 with ``bias [items, Hq or 1, W]`` added to the
    scores (``-inf``: not seen), as reference.dense_attention computes it: ``[items, Hq, D]``."""
    outs = []
    hq = b.query.shape[1]
    for i, (row, seq, first, keys) in enumerate(items.tolist()):
        k = b.full_k[seq][first:keys].double().transpose(0, 1)  # [Hkv, L, D]
        v = b.full_v[seq][first:keys].double().transpose(0, 1)
        g = hq // k.shape[0]
        q = b.query[row].double()  # [Hq, D]
        s = torch.einsum("hd,hld->hl", q, k.repeat_interleave(g, 0)) * scale  # [Hq, L]
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        s = s + bias[i, :, :keys - first].double()
        m = s.amax(-1, keepdim=True)
        if sinks is not None:
            m = torch.maximum(m, sinks.double()[:, None])
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = (s - m).exp()
        den = e.sum(-1, keepdim=True) + (0 if sinks is None else (sinks.double()[:, None] - m).exp())
        outs.append(torch.einsum("hl,hld->hd", e / torch.where(den > 0, den, torch.ones_like(den)),
                                 v.repeat_interleave(g, 0)))
    return torch.stack(outs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(1, 300), min_size=1, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    head_size=st.sampled_from([40, 64, 128]),  # the scalar path and two vector ones
    group=st.sampled_from([1, 2, 3]),
    per_head=st.booleans(),
    hidden=st.sampled_from([0.0, 0.3, 0.9, 1.0]),  # the share of keys the bias hides (1.0: every key of a query)
    part_keys=st.sampled_from([1, 16, 64, 4096]),
    threads=st.integers(1, 3),
    feature=st.sampled_from([{}, {"softcap": 3.0}, {"sinks": True}, {"window": 20}]),
    seed=st.integers(0, 2**16),
)
def test_decodes_with_a_bias_match_the_reference(lens, dtype, head_size, group, per_head, hidden, part_keys,
                                                 threads, feature, seed):
    # a position program's term: any bias, -inf wherever it hides a key, runs of hidden keys as long as whole
    # parts and chunks (a part that sees nothing adds nothing), and queries that see no key at all (zeros)
    g = torch.Generator().manual_seed(seed)
    hq = 2 * group
    b = make_batch([(n - 1, 1) for n in lens], num_heads=hq, num_kv_heads=2, head_size=head_size, block_size=16,
                   dtype=dtype, generator=g)
    torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    window = feature.get("window", 0)
    items = torch.tensor([(i, i, max(0, n - window) if window else 0, n) for i, n in enumerate(lens)])
    width = int((items[:, 3] - items[:, 2]).max())
    bias = torch.randn(len(lens), hq if per_head else 1, width, generator=g) * 2
    hide = torch.rand(len(lens), 1, width, generator=g) < hidden
    if hidden and width > 40:  # a long run of hidden keys inside the row as well
        hide[:, :, width // 4:width // 4 + 40] = True
    bias = bias.masked_fill(hide, float("-inf")).contiguous()
    softcap = feature.get("softcap", 0.0)
    sinks = torch.linspace(-2.0, 3.0, hq) if feature.get("sinks") else None
    scale = 1 / math.sqrt(head_size)
    out = torch.full_like(b.query, float("nan"))
    native.DecodeCall(native.load(), items, part_keys, threads)(out, b.query, b.kv_cache, b.meta.block_tables, scale,
                                                               softcap, None, sinks, bias)
    ref = _bias_reference(b, items, scale, softcap, sinks, bias.expand(-1, hq, -1))
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [40, 64])
def test_a_key_the_bias_hides_weighs_exactly_nothing(dtype, head_size):
    # the keys a query sees hold zero values, the one it does not see a huge one: any weight the hidden key kept
    # (e^-87 from a clamped exponent) would show in the output
    b = make_batch([(47, 1)], num_heads=2, num_kv_heads=2, head_size=head_size, dtype=dtype)
    k, v = b.kv_cache[0], b.kv_cache[1]
    v.zero_()
    slot = b.meta.block_tables[0, 0]
    v[slot, 3] = 1e30 if dtype == torch.float32 else 1e36
    k[slot, 3] = 0  # a score no larger than the others'
    bias = torch.zeros(1, 1, 48)
    bias[0, 0, 3] = float("-inf")
    out = torch.full_like(b.query, float("nan"))
    b_query = b.query
    native.DecodeCall(native.load(), torch.tensor([(0, 0, 0, 48)]), 16, 1)(out, b_query, b.kv_cache,
                                                                          b.meta.block_tables, 0.125, 0.0, None,
                                                                          None, bias)
    assert torch.all(out == 0)


def test_a_bias_that_does_not_cover_the_keys_is_refused_before_anything_is_written():
    b = make_batch([(20, 1), (5, 1)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    items = torch.tensor([(0, 0, 0, 21), (1, 1, 0, 6)])
    call = native.DecodeCall(native.load(), items, 64, 1)
    out = torch.zeros_like(b.query)
    with pytest.raises(ValueError, match=r"^paged_attention: the bias does not cover .*metadata\)$"):
        call(out, b.query, b.kv_cache, b.meta.block_tables, 0.125, 0.0, None, None, torch.zeros(2, 4, 20))
    for bad in (torch.zeros(2, 4, 21, dtype=torch.float64), torch.zeros(2, 4, 42)[..., ::2], torch.zeros(2, 2, 21),
                torch.zeros(3, 4, 21)):
        with pytest.raises(ValueError, match=r"^paged_attention: the native kernel reads a contiguous float32 bias"):
            call(out, b.query, b.kv_cache, b.meta.block_tables, 0.125, 0.0, None, None, bad)
    assert torch.all(out == 0)


def test_parts_and_threads_change_nothing_but_rounding():
    b = make_batch([(999, 1), (17, 1), (400, 1)], num_heads=8, num_kv_heads=2, head_size=64, block_size=16)
    p = batch_params(b, 0.125)
    one = _call(b, 4096, 1, p)
    for part_keys, threads in ((16, 1), (64, 2), (100, 3), (1, 2)):
        torch.testing.assert_close(_call(b, part_keys, threads, p), one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", ["block", "row", "width"])
def test_out_of_bounds_metadata_is_refused_before_anything_is_read(bad):
    b = make_batch([(20, 1), (5, 1)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    tables = b.meta.block_tables.clone()
    items = torch.tensor([(0, 0, 0, 21), (1, 1, 0, 6)])
    if bad == "block":
        tables[0, 1] = b.kv_cache.shape[1]
    elif bad == "row":
        items[1, 0] = 7
    else:
        items[1, 3] = 16 * tables.shape[1] + 1
    out = torch.zeros_like(b.query)
    call = native.DecodeCall(native.load(), items, 64, 1)
    with pytest.raises(ValueError, match=r"^paged_attention: .*check the step's metadata\)$"):
        call(out, b.query, b.kv_cache, tables, 0.125, 0.0, None, None)
    assert torch.all(out == 0)


def test_an_unknown_block_through_the_op_is_one_clear_error():
    from pagedattn.backends import set_validation

    b = make_batch([(20, 1), (5, 1)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    b.meta.block_tables[1, 0] = 10_000
    set_validation(False)  # the kernel's own check, not the ops' full validation
    with pytest.raises(ValueError, match="not a block of the cache"):
        torch.ops.pagedattn.paged_attention(b.query, None, None, b.kv_cache, b.meta.block_tables, b.meta.seq_lens,
                                            b.meta.query_start_loc, *batch_params(b, 0.125).args())


def test_the_kernel_runs_on_torchs_own_openmp():
    # its libgomp.so.1 is the one torch loaded: one OpenMP runtime, one pool of threads on the cores
    maps = Path("/proc/self/maps").read_text()
    assert len(set(re.findall(r"\S*libgomp[^\s]*", maps))) == 1


_CHILD = """
import os, sys, torch
from unittest import mock
from pagedattn.backends import native
with mock.patch.object(native.subprocess, "run", wraps=native.subprocess.run) as run:
    assert native.load() is not None
    print("compiles", sum(1 for c in run.call_args_list if "-shared" in c.args[0]))
"""


def test_a_second_process_loads_the_built_kernel_without_compiling(tmp_path):
    # a cache folder as a first process leaves it: the library this one built or found, under its key's name
    # (building the kernels again here takes ~20 s; a build into the cache: test_a_build_lands_in_the_cache_once)
    lib = native.load()
    if lib is None:
        pytest.skip(f"the native kernel is off here: {native.missing_prerequisite()}")
    built = Path(lib._name)
    shutil.copy2(built, tmp_path / built.name)
    env = {**os.environ, "PAGEDATTN_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, check=True)
    assert run.stdout.split()[-1] == "0"
    assert [p.name for p in tmp_path.iterdir()] == [built.name]


def test_without_a_compiler_the_sdpa_path_serves(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: None)
    native.load.cache_clear()
    try:
        assert native.load() is None
        calls = []
        real = sdpa_cpu._build_decode_plan
        monkeypatch.setattr(sdpa_cpu, "_build_decode_plan", lambda *a: calls.append(1) or real(*a))
        b = make_batch([(30, 1), (7, 1)], num_heads=4, num_kv_heads=2)
        p = batch_params(b, 0.125)
        torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
        out = torch.ops.pagedattn.paged_attention(b.query, None, None, b.kv_cache, b.meta.block_tables,
                                                  b.meta.seq_lens, b.meta.query_start_loc, *p.args())
        torch.testing.assert_close(out.double(), reference_step(b, 0.125), atol=2e-4, rtol=2e-4)
        assert calls  # the SDPA decode path ran
    finally:
        native.load.cache_clear()


def test_a_compiler_error_leaves_the_kernel_off(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_FLAGS", (*native._FLAGS, "-fno-such-flag"))
    native.load.cache_clear()
    try:
        assert native.load() is None and not list(tmp_path.glob("*.so"))
    finally:
        native.load.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_the_write_puts_each_row_in_its_slot_and_skips_padding(dtype, slot_dtype):
    cache = torch.randn(2, 5, 4, 3, 8).to(dtype)
    key, value = torch.randn(6, 3, 8).to(dtype), torch.randn(6, 3, 8).to(dtype)
    slots = torch.tensor([19, -1, 0, 7, -1, 12], dtype=slot_dtype)
    expected = cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[0, s // 4, s % 4], expected[1, s // 4, s % 4] = key[t], value[t]
    assert native.write(native.load(), key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_the_write_refuses_a_slot_outside_the_cache_and_writes_nothing():
    cache = torch.zeros(2, 5, 4, 3, 8)
    slots = torch.tensor([3, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^write_kv_cache: a slot is outside the cache's 20 slots"):
        native.write(native.load(), torch.ones(2, 3, 8), torch.ones(2, 3, 8), cache, slots)
    assert torch.all(cache == 0)


def test_the_write_leaves_tensors_it_does_not_read_as_they_are_to_the_generic_write():
    cache = torch.zeros(2, 5, 4, 3, 8)
    key = torch.randn(2, 8, 3).transpose(1, 2)  # head size not contiguous
    slots = torch.tensor([1, 2])
    assert not native.write(native.load(), key, key, cache, slots)
    assert torch.all(cache == 0)
    torch.ops.pagedattn.write_kv_cache(key, key, cache, slots)  # the backend falls back
    assert torch.equal(cache[0, 0, 1], key[0]) and torch.equal(cache[1, 0, 2], key[1])


def _answer_library() -> Optional[Path]:
    sources = {"answer.c": b"int answer(void) { return 42; }\n"}
    return native.build_shared(sources, shutil.which("cc") or shutil.which("gcc"), ("-O2", "-shared", "-fPIC"),
                               "answer")


def test_a_build_lands_in_the_cache_once(monkeypatch, tmp_path):
    # the library's build goes through build_shared: a small source shows the rule without the kernels' long build
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path))
    built = _answer_library()
    assert built is not None and built.parent == tmp_path and ctypes.CDLL(str(built)).answer() == 42
    # under its key's name, its unit kept beside it, no temporary files left
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([built.name, "objects"])
    assert [p.suffix for p in (tmp_path / "objects").iterdir()] == [".o"]
    calls = []
    monkeypatch.setattr(native, "_compile_units", lambda *a: calls.append(a))
    assert _answer_library() == built and not calls  # found, not compiled again


def test_a_build_is_found_again_under_a_umask_that_lets_the_group_write(monkeypatch, tmp_path):
    # a umask of 002 (Ubuntu's for users with a group of their own) made the library and its objects group-writable,
    # which the cache refuses to load: every process then built them again
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path))
    old = os.umask(0o002)
    try:
        built = _answer_library()
        calls = []
        monkeypatch.setattr(native, "_compile_units", lambda *a: calls.append(a))
        assert _answer_library() == built and not calls
        assert all(not p.stat().st_mode & 0o022 for p in [built, *tmp_path.glob("objects/*")])
    finally:
        os.umask(old)


_BUILDER = """
import os, sys, time
from pathlib import Path
from pagedattn.backends import native
ready = Path(sys.argv[2])
(ready / str(os.getpid())).touch()
while len(list(ready.iterdir())) < int(sys.argv[3]):  # every process imported: they ask at once
    time.sleep(0.01)
built = native.build_shared({"answer.c": b"int answer(void) { return 42; }\\n"}, sys.argv[1], ("-O2", "-shared", "-fPIC"),
                            "answer")
print(built)
"""


def test_processes_starting_at_once_build_once(tmp_path):
    # a compiler that notes each compile and takes its time; the processes ask together, while the first builds
    cc = shutil.which("cc") or shutil.which("gcc")
    log, cache = tmp_path / "compiles", tmp_path / "cache"
    slow = tmp_path / "slow-cc"
    slow.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo x >> "{log}"; sleep 1;; esac\nexec "{cc}" "$@"\n')
    slow.chmod(0o755)
    env = {**os.environ, "PAGEDATTN_CACHE_DIR": str(cache)}
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _BUILDER, str(slow), str(ready), "2"], stdout=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    paths = {p.communicate(timeout=300)[0].split()[-1] for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(paths) == 1
    assert log.read_text().count("x") == 1  # one build; the others waited for it and loaded it
    built = Path(paths.pop())
    assert ctypes.CDLL(str(built)).answer() == 42
    assert sorted(p.name for p in cache.iterdir()) == sorted([built.name, "objects"])


_UNITS = {"value.h": b"#define VALUE 1\n",
          "a.c": b'#include "value.h"\n#ifdef TWICE\nint a(void) { return 2 * VALUE; }\n#else\n'
                 b"int a(void) { return VALUE; }\n#endif\n",
          "b.c": b"int b(void) { return 7; }\n"}


def test_a_build_with_another_macro_or_header_compiles_only_the_units_they_change(monkeypatch, tmp_path):
    # the library's variant builds (PAGEDATTN_PREFILL_PAIRS, PAGEDATTN_NO_DPBF16) compile only the units the macro
    # reaches; the counter-example: a unit whose header changed is compiled again, never taken stale from the cache
    cc = shutil.which("cc") or shutil.which("gcc")
    log = tmp_path / "compiles"
    noting = tmp_path / "noting-cc"
    noting.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) for a; do case "$a" in *.c) basename "$a" >> "{log}";; '
                      f'esac; done;; esac\nexec "{cc}" "$@"\n')
    noting.chmod(0o755)
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path / "cache"))

    def build(sources, *defines):
        log.write_text("")
        built = native.build_shared(sources, str(noting), ("-O2", "-shared", "-fPIC", *defines), "units")
        lib = ctypes.CDLL(str(built))
        return sorted(log.read_text().split()), lib.a(), lib.b()

    assert build(_UNITS) == (["a.c", "b.c"], 1, 7)
    assert build(_UNITS, "-DTWICE") == (["a.c"], 2, 7)  # b.c's text is the same with the macro: its object is kept
    assert build(_UNITS, "-DUNUSED") == ([], 1, 7)  # a macro no unit reads: both objects kept, a new library
    assert build({**_UNITS, "value.h": b"#define VALUE 5\n"}, "-DTWICE") == (["a.c"], 10, 7)


def test_units_whose_text_names_their_build_folder_are_not_kept(monkeypatch, tmp_path):
    # __FILE__ (torch's headers, in the C++ operators) names the temporary folder each build compiles in: such a unit
    # has a key of its own at every build, so it is not kept at all; and a build may leave the cache off
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path))
    cc = shutil.which("cc") or shutil.which("gcc")
    named = {"named.c": b"const char *named(void) { return __FILE__; }\n"}
    for flags in (("-O2",), ("-O1",)):
        assert native.build_shared(named, cc, (*flags, "-shared", "-fPIC"), "named") is not None
    assert not list(tmp_path.glob("objects/*"))
    assert native.build_shared({"b.c": _UNITS["b.c"]}, cc, ("-O2", "-shared", "-fPIC"), "plain", unit_cache=False)
    assert not list(tmp_path.glob("objects/*"))


def test_a_build_held_up_elsewhere_past_the_wait_is_made_here(monkeypatch, tmp_path, caplog):
    # counter-example to waiting for ever: a lock some other process never lets go of
    from filelock import FileLock

    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_BUILD_WAIT_S", 0.2)
    held = []
    real = native._compile_into
    monkeypatch.setattr(native, "_compile_into", lambda *a: held.append(1) or real(*a))
    first = _answer_library()  # its name, so that the lock can be taken before the second asks
    first.unlink()
    held.clear()
    with FileLock(f"{first}.lock"), caplog.at_level(logging.DEBUG, logger="pagedattn"):
        built = _answer_library()
    assert built == first and held == [1] and ctypes.CDLL(str(built)).answer() == 42
    assert "still being built elsewhere" in caplog.text


def test_a_folder_that_takes_no_locks_still_gets_its_build(monkeypatch, tmp_path):
    # some network file systems refuse flock: the object is built without the lock, as before there was one
    import filelock

    def refuse(self, *a, **k):
        raise OSError(37, "No locks available")

    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(filelock.FileLock, "acquire", refuse)
    built = _answer_library()
    assert built is not None and ctypes.CDLL(str(built)).answer() == 42


def test_a_cache_folder_others_may_write_is_not_loaded_from(monkeypatch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(shared))
    built = _answer_library()
    assert built is not None and not list(shared.iterdir())  # built elsewhere
    assert not built.is_relative_to(shared) and ctypes.CDLL(str(built)).answer() == 42
    # an object someone else may have put there under the very name is never what is returned
    (shared / built.name).write_bytes(b"not a shared object")
    again = _answer_library()
    assert again is not None and not again.is_relative_to(shared) and ctypes.CDLL(str(again)).answer() == 42


def test_a_private_build_is_removed_as_the_process_exits(monkeypatch, tmp_path):
    # a process that cannot use the cache builds in a folder of its own: left behind, every such process would add one
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(shared))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    at_exit = []
    monkeypatch.setattr(native.atexit, "register", lambda fn, *args, **kw: at_exit.append((fn, args, kw)))
    built = _answer_library()
    assert built is not None and built.parent.parent == tmp_path and ctypes.CDLL(str(built)).answer() == 42
    assert len(at_exit) == 1
    fn, args, kw = at_exit[0]
    fn(*args, **kw)  # what the interpreter runs as it exits
    assert not built.parent.exists()


def test_block_tables_of_another_dtype_are_refused():
    b = make_batch([(20, 1)], num_heads=4, num_kv_heads=2, head_size=64)
    call = native.DecodeCall(native.load(), torch.tensor([(0, 0, 0, 21)]), 64, 1)
    with pytest.raises(ValueError, match="int32 block tables"):
        call(torch.zeros_like(b.query), b.query, b.kv_cache, b.meta.block_tables.long(), 0.125, 0.0, None, None)


def _dense_prefill(q, k, v, q_pos0, k_pos0, scale, causal, window):
    """The reference over one item's rows: ``q [Q, Hq, D]``, ``k``/``v [L, Hkv, D]`` at the given positions."""
    from pagedattn.backends import AttentionParams, reference

    p = AttentionParams(scale, causal, window, 0.0, None, k.shape[1], v.shape[2])
    q_pos = torch.arange(q_pos0, q_pos0 + q.shape[0])[None]
    k_pos = torch.arange(k_pos0, k_pos0 + k.shape[0])[None]
    o = reference.dense_attention(q.transpose(0, 1)[None].double(), k.transpose(0, 1)[None].double(),
                                  v.transpose(0, 1)[None].double(), p, q_pos, k_pos, exact=True)
    return o[0].transpose(0, 1)  # [Q, Hq, D]


def _prefill_runs(runs, hq, hkv, head_size, dtype, g):
    """Rows for ``native.prefill``'s items, one per ``(queries, cached keys before them)`` of ``runs``: each item's
    queries the last of its keys. ``(query [Tq, Hq, D], key, value [Tk, Hkv, D], items)``."""
    nq, nk = sum(q for q, _ in runs), sum(q + c for q, c in runs)
    query = torch.randn(nq, hq, head_size, generator=g).to(dtype)
    key = torch.randn(nk, hkv, head_size, generator=g).to(dtype)
    value = torch.randn(nk, hkv, head_size, generator=g).to(dtype)
    items, qr, kr = [], 0, 0
    for q, c in runs:
        items.append((qr, q, c, kr, q + c, 0))
        qr, kr = qr + q, kr + q + c
    return query, key, value, items


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    runs=st.lists(st.tuples(st.integers(1, 90), st.integers(0, 70)), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    head_size=st.sampled_from([16, 48, 64, 128, 256]),
    group=st.sampled_from([1, 2, 3, 5, 8, 30]),
    feature=st.sampled_from([{}, {"window": 7}, {"window": 40}, {"causal": False}]),
    threads=st.integers(1, 3),
    build=st.sampled_from(["widening", "pairs", "avx2"]),
    seed=st.integers(0, 2**16),
)
def test_prefills_match_the_reference(runs, dtype, head_size, group, feature, threads, build, seed):
    # items of (queries, cached keys before them): each item's queries are the last of its keys, as a fresh prefill
    # (no cached keys) or a chunk after cached ones; a group of 30 heads is more rows than a unit holds (24);
    # bfloat16 through both builds (pair dot products where the CPU has them, widening), and the AVX2 paths' build
    g = torch.Generator().manual_seed(seed)
    hkv, causal, window = 2, feature.get("causal", True), feature.get("window", 0)
    query, key, value, items = _prefill_runs(runs, group * hkv, hkv, head_size, dtype, g)
    out = torch.full_like(query, float("nan"))
    scale = head_size ** -0.5
    assert native.prefill_usable(query, key, value, hkv)
    lib = {"widening": _widening_build, "pairs": _pairs_build, "avx2": _avx2_build}[build]()
    native.prefill(lib, out, query, key, value, torch.tensor(items), scale=scale, causal=causal, window=window,
                   num_threads=threads)
    for q0, q, c, k0, n, _ in items:
        ref = _dense_prefill(query[q0:q0 + q], key[k0:k0 + n], value[k0:k0 + n], c, 0, scale, causal, window)
        torch.testing.assert_close(out[q0:q0 + q].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def _prefill_with_term(q, k, v, q_pos0, scale, causal, window, rel):
    """One item's rows in float64 with its term by distance ``rel [Hq or 1, W]`` (keys from position 0; -inf hides
    a key; a query that sees none gets zeros): ``[Q, Hq, D]``."""
    nq, nk, hq = q.shape[0], k.shape[0], q.shape[1]
    g = hq // k.shape[1]
    kk = k.double().repeat_interleave(g, 1).transpose(0, 1)  # [Hq, L, D]
    vv = v.double().repeat_interleave(g, 1).transpose(0, 1)
    s = torch.einsum("qhd,hkd->hqk", q.double(), kk) * scale  # [Hq, Q, L]
    t = torch.arange(nk)[None, :] - torch.arange(nq)[:, None] + nq - 1  # [Q, L]
    s = s + rel.double().expand(hq, -1)[:, t]
    if causal:
        back = (q_pos0 + torch.arange(nq))[:, None] - torch.arange(nk)[None, :]
        seen = (back >= 0) & ((back < window) if window else True)
        s = s.masked_fill(~seen, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = (s - m).exp()
    den = e.sum(-1, keepdim=True)
    return torch.einsum("hqk,hkd->qhd", e / torch.where(den > 0, den, torch.ones_like(den)), vv)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    runs=st.lists(st.tuples(st.integers(1, 90), st.integers(0, 70)), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    head_size=st.sampled_from([16, 64, 128]),
    group=st.sampled_from([1, 2, 3, 30]),
    per_head=st.booleans(),
    hidden=st.sampled_from([0.0, 0.3, 1.0]),  # the share of distances the term hides (1.0: every key)
    feature=st.sampled_from([{}, {"window": 7}, {"causal": False}]),
    threads=st.integers(1, 3),
    build=st.sampled_from(["widening", "pairs", "avx2"]),
    seed=st.integers(0, 2**16),
)
def test_prefills_with_a_term_by_distance_match_the_reference(runs, dtype, head_size, group, per_head, hidden,
                                                              feature, threads, build, seed):
    # a position program read by distance: any bias per (head, distance), -inf at the distances it hides (runs of
    # them as long as whole chunks of keys; every distance, and queries that see nothing get zeros)
    g = torch.Generator().manual_seed(seed)
    hkv, causal, window = 2, feature.get("causal", True), feature.get("window", 0)
    hq = group * hkv
    query, key, value, items = _prefill_runs(runs, hq, hkv, head_size, dtype, g)
    width = max(q + q + c - 1 for q, c in runs) + native.REL_PAD
    rel = torch.randn(len(runs), hq if per_head else 1, width, generator=g)
    hide = torch.rand(len(runs), 1, width, generator=g) < hidden
    if hidden and width > 60:
        hide[..., 10:50] = True
    rel = rel.masked_fill(hide, float("-inf"))
    out = torch.full_like(query, float("nan"))
    scale = head_size ** -0.5
    lib = {"widening": _widening_build, "pairs": _pairs_build, "avx2": _avx2_build}[build]()
    native.prefill(lib, out, query, key, value, torch.tensor(items), scale=scale, causal=causal, window=window,
                   num_threads=threads, rel=rel)
    for i, (q0, q, c, k0, n, _) in enumerate(items):
        ref = _prefill_with_term(query[q0:q0 + q], key[k0:k0 + n], value[k0:k0 + n], c, scale, causal, window,
                                 rel[i])
        torch.testing.assert_close(out[q0:q0 + q].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_key_the_prefill_term_hides_weighs_exactly_nothing(dtype):
    # every key but the first holds a zero value; the first a huge one, hidden from the last query by the term at
    # its distance (-19: that pair alone); any weight the hidden key kept (e^-87 from a clamped exponent) would show
    q = torch.randn(20, 2, 64).to(dtype)
    k = torch.randn(20, 2, 64).to(dtype)
    k[0] = 0  # a score no larger than the others'
    v = torch.zeros(20, 2, 64, dtype=dtype)
    v[0] = 1e30 if dtype == torch.float32 else 1e36
    rel = torch.zeros(1, 1, 20 + 20 - 1 + native.REL_PAD)
    rel[0, 0, 0] = float("-inf")  # entry j - r + 19 = 0: query 19 over key 0
    out = torch.full_like(q, float("nan"))
    native.prefill(native.load(), out, q, k, v, torch.tensor([(0, 20, 0, 0, 20, 0)]), scale=0.125, causal=True,
                   window=0, num_threads=1, rel=rel)
    assert torch.all(out[19] == 0)
    assert torch.all(out[:19].abs().amax((1, 2)) > 1e20)  # the other queries see it


def test_a_prefill_term_that_does_not_cover_the_items_is_refused():
    q, k, v = torch.randn(4, 2, 32), torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    out = torch.zeros_like(q)
    items = torch.tensor([(0, 4, 0, 0, 4, 0)])
    for bad in (torch.zeros(1, 2, 4 + 4 - 1 + native.REL_PAD - 1), torch.zeros(1, 3, 30), torch.zeros(2, 2, 30),
                torch.zeros(1, 2, 30, dtype=torch.float64), torch.zeros(1, 2, 60)[..., ::2]):
        with pytest.raises(ValueError, match="term by distance"):
            native.prefill(native.load(), out, q, k, v, items, scale=0.2, causal=True, window=0, num_threads=1,
                           rel=bad)
    assert torch.all(out == 0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    runs=st.lists(st.tuples(st.integers(1, 90), st.integers(0, 70)), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    head_size=st.sampled_from([16, 64]),
    group=st.sampled_from([1, 3]),
    causal=st.booleans(),  # the runs stand in for causality and the window either way
    empty=st.sampled_from([0.0, 0.2, 1.0]),  # the share of rows that see no key
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_prefill_rows_over_runs_of_their_own_match_the_reference(runs, dtype, head_size, group, causal, empty, threads,
                                                                 seed):
    # a position program's mask with one run of keys a row (a prefix-LM's): any run, later keys included; rows that
    # see none are left as they were
    g = torch.Generator().manual_seed(seed)
    hkv = 2
    query, key, value, items = _prefill_runs(runs, group * hkv, hkv, head_size, dtype, g)
    bounds = torch.zeros(query.shape[0], 2, dtype=torch.int64)
    for q0, q, _, _, n, _ in items:
        a = torch.randint(0, n, (q,), generator=g)
        b = torch.randint(0, n + 1, (q,), generator=g)
        lo, hi = torch.minimum(a, b), torch.maximum(a, b)
        hi = torch.where(torch.rand(q, generator=g) < empty, lo, hi)
        bounds[q0:q0 + q, 0], bounds[q0:q0 + q, 1] = lo, hi
    out = torch.full_like(query, float("nan"))
    scale = head_size ** -0.5
    native.prefill(native.load(), out, query, key, value, torch.tensor(items), scale=scale, causal=causal, window=3,
                   num_threads=threads, bounds=bounds)
    for q0, q, _, k0, n, _ in items:
        lo, hi = bounds[q0:q0 + q, 0], bounds[q0:q0 + q, 1]
        j = torch.arange(n)
        seen = (j[None] >= lo[:, None]) & (j[None] < hi[:, None])  # [Q, L]
        kk = key[k0:k0 + n].double().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, L, D]
        vv = value[k0:k0 + n].double().repeat_interleave(group, 1).transpose(0, 1)
        s = torch.einsum("qhd,hkd->hqk", query[q0:q0 + q].double(), kk) * scale
        p = s.masked_fill(~seen, float("-inf")).softmax(-1)
        ref = torch.einsum("hqk,hkd->qhd", p, vv)
        live = hi > lo
        torch.testing.assert_close(out[q0:q0 + q][live].double(), ref[live], atol=TOL[dtype], rtol=TOL[dtype])
        assert out[q0:q0 + q][~live].isnan().all()


def test_prefill_runs_that_do_not_cover_the_rows_are_refused():
    q, k, v = torch.randn(4, 2, 32), torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    out = torch.zeros_like(q)
    items = torch.tensor([(0, 4, 0, 0, 4, 0)])
    with pytest.raises(ValueError, match="runs of keys do not cover"):
        native.prefill(native.load(), out, q, k, v, items, scale=0.2, causal=True, window=0, num_threads=1,
                       bounds=torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="runs of keys are a contiguous int64"):
        native.prefill(native.load(), out, q, k, v, items, scale=0.2, causal=True, window=0, num_threads=1,
                       bounds=torch.zeros(4, 2, dtype=torch.int32))
    assert torch.all(out == 0)


def test_a_prefill_item_with_keys_from_a_later_position_sees_only_them():
    # keys gathered from a window's first block on: positions start at k_pos0, not 0
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 32, generator=g) for n in (5, 45, 45))
    out = torch.zeros_like(q)
    native.prefill(native.load(), out, q, k, v, torch.tensor([(0, 5, 100, 0, 45, 60)]), scale=0.2, causal=True,
                   window=30, num_threads=2)
    ref = _dense_prefill(q, k, v, 100, 60, 0.2, True, 30)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_prefill_rows_outside_the_tensors_are_refused_and_nothing_is_written():
    q, k, v = torch.randn(4, 2, 32), torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    out = torch.zeros_like(q)
    for bad in ((0, 5, 0, 0, 4, 0), (0, 4, 0, 1, 4, 0), (-1, 2, 0, 0, 2, 0)):
        with pytest.raises(ValueError, match=r"^paged_attention: the native prefill refused the call \(an item's"):
            native.prefill(native.load(), out, q, k, v, torch.tensor([bad]), scale=0.2, causal=True, window=0,
                           num_threads=1)
    assert torch.all(out == 0)


def test_prefill_takes_only_tensors_it_reads_as_they_are():
    q, k, v = torch.randn(4, 4, 32), torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    assert native.prefill_usable(q, k, v, 2)
    assert not native.prefill_usable(q[..., :24], k[..., :24], v[..., :24], 2)  # not a multiple of 16
    assert not native.prefill_usable(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, 2)  # D not contiguous
    assert not native.prefill_usable(q, k.double(), v, 2)
    assert not native.prefill_usable(q, k, v[..., :16], 2)  # values of another head size
    assert not native.prefill_usable(torch.randn(4, 3, 32), k, v, 2)  # not whole groups


def test_prefill_refuses_tensors_that_do_not_match_before_running():
    q, k, v = torch.randn(4, 4, 32), torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    items = torch.tensor([(0, 4, 0, 0, 4, 0)])
    for out in (torch.zeros(4, 2, 32), torch.zeros(4, 4, 32, dtype=torch.float64), torch.zeros(4, 4, 16)):
        with pytest.raises(ValueError, match=r"^paged_attention: the native prefill takes query/out"):
            native.prefill(native.load(), out, q, k, v, items, scale=0.2, causal=True, window=0, num_threads=1)
    with pytest.raises(ValueError, match=r"items are \[n, 6\]"):
        native.prefill(native.load(), torch.zeros_like(q), q, k, v, items[:, :5], scale=0.2, causal=True, window=0,
                       num_threads=1)


def test_bfloat16_prefill_scores_agree_across_builds_to_a_unit_of_the_weights():
    # the reference's tolerance for bfloat16 (3e-2) would pass a scale off by a percent; the pair dot products and
    # the widening build compute the same float32 scores in another order and round the same weights to bfloat16,
    # so a weight next to a rounding boundary may round one unit apart, moving an output by 2^-7 of that key's share
    # of the weighted |V| at most (the outputs' own rounding adds as much): bounded by the weighted average of |V|
    # (the same call over |V|), not by the output, which cancelling terms can leave near zero
    dp = _pairs_build()
    if not native.features(dp) & native.FEATURE_PREFILL_DPBF16:
        pytest.skip("the CPU has no AVX512-BF16: both builds widen")
    g = torch.Generator().manual_seed(3)
    hkv, group, d = 2, 3, 64
    query = (3 * torch.randn(700, group * hkv, d, generator=g)).bfloat16()  # sharp softmax: scale errors show
    key = torch.randn(900, hkv, d, generator=g).bfloat16()
    value = torch.randn(900, hkv, d, generator=g).bfloat16()
    items = torch.tensor([(0, 300, 0, 0, 300, 0), (300, 200, 200, 300, 400, 0), (500, 200, 0, 700, 200, 0)])
    outs = []
    for lib, v in ((dp, value), (_widening_build(), value), (_widening_build(), value.abs())):
        out = torch.full_like(query, float("nan"))
        native.prefill(lib, out, query, key, v, items, scale=d ** -0.5, causal=True, window=0, num_threads=2)
        outs.append(out.float())
    diff = (outs[0] - outs[1]).abs()
    assert (diff <= 2.0 ** -6 * outs[2]).all()
    assert (diff > 0).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 256])
def test_long_prefills_match_the_reference(dtype, window):
    # lengths well past the hypothesis test's: a 1000-token prompt, and a 300-token chunk after 700 cached keys
    g = torch.Generator().manual_seed(1)
    hkv, group, d = 2, 3, 64
    query = torch.randn(1300, group * hkv, d, generator=g).to(dtype)
    key = torch.randn(2000, hkv, d, generator=g).to(dtype)
    value = torch.randn(2000, hkv, d, generator=g).to(dtype)
    items = [(0, 1000, 0, 0, 1000, 0), (1000, 300, 700, 1000, 1000, 0)]
    out = torch.full_like(query, float("nan"))
    native.prefill(native.load(), out, query, key, value, torch.tensor(items), scale=d ** -0.5, causal=True,
                   window=window, num_threads=2)
    for q0, q, c, k0, n, _ in items:
        ref = _dense_prefill(query[q0:q0 + q], key[k0:k0 + n], value[k0:k0 + n], c, 0, d ** -0.5, True, window)
        torch.testing.assert_close(out[q0:q0 + q].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


_SPECIALS = st.sampled_from([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), 3.5, 1e-30])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(0, 5),
    cols=st.integers(1, 70),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    specials=st.lists(st.tuples(st.integers(0, 10**6), _SPECIALS), max_size=12),
    pad=st.integers(0, 3),
    seed=st.integers(0, 2**16),
    into=st.booleans(),
    avx2=st.booleans(),
)
def test_argmax_rows_is_torchs_argmax(rows, cols, dtype, specials, pad, seed, into, avx2):
    # ties (few distinct values), NaNs, infinities and signed zeros anywhere, every width around the 16-lane body,
    # rows further apart than their width: the first maximum, or the first NaN, as torch.argmax
    g = torch.Generator().manual_seed(seed)
    wide = torch.randint(-3, 4, (rows, cols + pad), generator=g).to(dtype)
    flat = wide.view(-1)
    for at, value in specials if flat.numel() else ():
        flat[at % flat.numel()] = value
    logits = wide[:, :cols]
    expected = logits.float().argmax(-1).tolist()
    lib = _build(avx2)  # this CPU's build and the AVX2 paths' (the same where it has no AVX-512)
    if not into:
        assert native.argmax_rows(lib, logits) == expected
        return
    out = torch.full((rows,), -1, dtype=torch.long)  # the answer written here as well (a step's next input ids)
    assert native.argmax_rows(lib, logits, out) == expected and out.tolist() == expected


def test_argmax_rows_on_a_long_row_finds_a_maximum_in_every_lane_and_the_tail():
    for lib in (native.load(), _avx2_build()):  # the AVX2 paths' 8 lanes too
        for col in (0, 5, 15, 16, 31, 4095, 4096, 4100):
            logits = torch.zeros(2, 4101)
            logits[1, col] = logits[1, -1] = 1.0  # the tail's equal maximum comes later: the earlier one wins
            logits[0, col] = float("-inf")
            assert native.argmax_rows(lib, logits) == [0 if col else 1, col]
        assert native.argmax_rows(lib, torch.full((1, 40), float("-inf"))) == [0]


def test_argmax_writer_binds_the_kernel_to_the_first_logits_and_checks_any_other_again():
    lib = native.load()
    out = torch.full((4, 3), -1, dtype=torch.long)  # a run's input ids: step i - 1's tokens into row i
    fell_back = []
    write = native.ArgmaxWriter(lib, out, lambda logits, i: fell_back.append(i) or [-5])
    g = torch.Generator().manual_seed(0)
    for i in (1, 3, 2):  # the first call binds, the others take the kernel straight
        logits = torch.randint(-3, 4, (3, 100), generator=g).to(torch.bfloat16)  # ties: the first maximum
        assert write(logits, i) == logits.float().argmax(-1).tolist() == out[i].tolist()
    assert out[0].tolist() == [-1] * 3 and not fell_back
    wide = torch.randn(3, 120)
    wide[1, 40] = float("nan")
    assert write(wide[:, :100], 1) == wide[:, :100].argmax(-1).tolist() == out[1].tolist()  # another layout
    wide[:, 100:] = 1e9  # past the rows' 100 columns: a stride taken as the width would read these
    for i in (2, 3):  # that layout again: the kernel straight, with the rows 120 elements apart
        wide[2, 7 * i] = 50.0
        assert write(wide[:, :100], i) == wide[:, :100].argmax(-1).tolist() == out[i].tolist()
    assert write(torch.zeros(3, 5, dtype=torch.float64), 2) == [-5] and fell_back == [2]  # one the kernel cannot read
    with pytest.raises(ValueError, match="int64 CPU matrix"):
        native.ArgmaxWriter(lib, torch.zeros(3, dtype=torch.long), fell_back.append)
    cpu = sdpa_cpu.SdpaCpuBackend()
    assert isinstance(cpu.argmax_writer(out), native.ArgmaxWriter)
    assert not isinstance(cpu.argmax_writer(out.t()), native.ArgmaxWriter)  # not one it writes into: torch's
    assert cpu.argmax_writer(out.t())(torch.tensor([[0.0, 2.0, 1.0]] * 4), 0) == [1] * 4 and out[:, 0].tolist() == [1] * 4


def test_argmax_rows_leaves_tensors_it_does_not_read_to_torch():
    lib = native.load()
    assert native.argmax_rows(lib, torch.zeros(3, 4).t()) is None  # columns not contiguous
    assert native.argmax_rows(lib, torch.zeros(3, 4, dtype=torch.float64)) is None
    assert native.argmax_rows(lib, torch.zeros(3)) is None
    assert native.argmax_rows(lib, torch.zeros(3, 0)) is None
    assert sdpa_cpu.SdpaCpuBackend().argmax_rows(torch.tensor([[1.0, 3.0], [2.0, 0.0]], dtype=torch.float64)) == [1, 0]
    logits = torch.tensor([[1.0, 3.0], [2.0, 0.0]])
    for out in (torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.long),
                torch.zeros(2, 2, dtype=torch.long)[:, 0]):  # another dtype, size, a strided buffer: nothing written
        kept = out.clone()
        assert native.argmax_rows(lib, logits, out) is None and torch.equal(out, kept)
    out = torch.zeros(2, dtype=torch.long)
    assert sdpa_cpu.SdpaCpuBackend().argmax_rows_into(logits.double(), out) == [1, 0] and out.tolist() == [1, 0]


def test_the_kernel_clock_counts_each_entry_points_calls_while_it_is_on():
    # benchmarks' breakdowns take each kernel's time from it (roofline.decode_breakdown): every call of a kind once,
    # none before or after the block, a new block from zero, the time within the block's own
    lib = native.load()
    b = make_batch([(5, 1), (20, 1)], num_heads=4, num_kv_heads=2, dtype=torch.float32)
    p = batch_params(b, 0.125)
    x, w = torch.randn(3, 64), torch.randn(8, 64)
    logits = torch.randn(3, 50)
    q, k, v = torch.randn(5, 4, 64), torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    gate, up = torch.randn(3, 40), torch.randn(3, 40)
    silu = native_ops.silu_mul_op()  # the C++ operator: the library's kernel by address (None without a C++ compiler)
    _call(b, 64, 2, p, lib=lib)  # before the block: not counted
    with native.kernel_clock(lib) as first:
        assert first == {}  # filled on leaving the block
        t0 = time.perf_counter()
        for _ in range(2):
            native.write(lib, b.key, b.value, b.kv_cache, b.meta.slot_mapping)
            _call(b, 64, 2, p, lib=lib)
        native.argmax_rows(lib, logits)
        linear = native.linear(lib, x, w, None, 2) if torch.float32 in native.linear_dtypes(lib) else None
        native.prefill(lib, torch.empty_like(q), q, k, v, torch.tensor([(0, 5, 0, 0, 5, 0)]), scale=0.2,
                       causal=True, window=0, num_threads=2)
        if silu is not None:
            torch.testing.assert_close(silu(gate, up), torch.nn.functional.silu(gate) * up)
        took = time.perf_counter() - t0
    native.argmax_rows(lib, logits)  # after it: not counted
    assert set(first) == set(native.CLOCK_KINDS)
    assert first["decode"][0] == 2 and first["argmax"][0] == 1 and first["prefill"][0] == 1
    assert first["write"][0] == 4  # two of its own, two of _call's (the Python op's kernel)
    assert first["linear"][0] == (linear is not None) and first["silu_mul"][0] == (silu is not None)
    assert 0 < sum(s for _, s in first.values()) < took
    with native.kernel_clock(lib) as second:
        native.argmax_rows(lib, logits)
    assert second["argmax"][0] == 1 and second["decode"] == (0, 0.0)
