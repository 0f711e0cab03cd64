"""pagedattn's C++ operators (backends/native_ops.py, backends/csrc/linear_op.cpp, paged_ops.cpp):
``pagedattn_native::linear`` gives the Python kernel's results bit for bit (same native kernel, same row limit, same
oneDNN fallback), defers to it under validation (set in Python or in the environment), and is left out where it cannot
be built. The paged ops' stand-ins write and attend decode steps in C++ under the plain CPU backend, bit for bit as the
Python path does, and send every other call (prefills, ALiBi, sinks, int64 tables, another backend or a replaced
method, validation, no backend bound) and bad metadata to the ``pagedattn::`` ops, which refuse it in their words.
``pagedattn_native::silu_mul`` computes a gated MLP's SiLU(gate) * up rounded once, and ``SiluMul`` puts it in place of
exactly that product in a decomposed graph."""

import dataclasses
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedattn.backends import cpu_linear, native, native_ops, set_validation

from ..support import batch_params, make_batch, skip_unless_missing_prerequisite

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.fixture(autouse=True)
def _built():
    if native.load() is None:
        skip_unless_missing_prerequisite()
    if not native_ops.load():
        if native_ops.cxx_compiler() is not None:
            pytest.fail("the C++ operators did not build (run with --log-level=DEBUG for the compiler's output)")
        pytest.skip("no C++ compiler")
    set_validation(False)  # the fast path; the tests run with validation on otherwise (tests/conftest.py)
    yield
    set_validation(True)


def _dtypes():
    lib = native.load()
    return [d for d in (torch.float32, torch.bfloat16) if d in native.linear_dtypes(lib)]


def _native_dtypes():
    """:func:`_dtypes`, skipping the test where the kernel takes none (every call then goes to oneDNN, and the pass
    swaps nothing)."""
    if not _dtypes():
        pytest.skip("no native linear kernel on this CPU (small_linear.c needs AVX-512)")
    return _dtypes()


def _onednn_dtypes():
    """The dtypes oneDNN packs and multiplies here: bfloat16 only where torch's own check allows it (its bfloat16 ops
    refuse otherwise; passes/fp32_matmuls.py asks the same)."""
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (torch.bfloat16, torch.float32) if bf16 else (torch.float32,)


def _python(x, w, b, layout):
    return torch.ops.pagedattn.linear(x, w, b, layout)


def _cpp(x, w, b, layout):
    return torch.ops.pagedattn_native.linear(x, w, b, layout)


@pytest.mark.parametrize("rows", [0, 1, 5, 16, 128, 129, 300])
def test_the_operator_gives_the_python_kernels_results_bit_for_bit(rows):
    # few rows through small_linear.c in both layouts, many through oneDNN, with and without a bias, x of 2 and 3
    # dimensions and rows that are not contiguous
    torch.manual_seed(rows)
    for dtype in _native_dtypes():
        w = torch.randn(200, 96).to(dtype)
        bias = torch.randn(200).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w.clone(), 16)
        weights = [(packed, cpu_linear.proven_layout(packed)), (w, native.LINEAR_PLAIN)]
        wide = torch.randn(rows, 160).to(dtype)
        for weight, layout in weights:
            assert layout is not None
            for x in (wide[:, :96], wide[:, :96].contiguous().view(1, rows, 96)):
                for b in (None, bias):
                    got, want = _cpp(x, weight, b, layout), _python(x, weight, b, layout)
                    assert got.shape == want.shape == (*x.shape[:-1], 200)
                    assert torch.equal(got, want)
                    if rows:
                        ref = x.double() @ w.double().T + (0 if b is None else b.double())
                        torch.testing.assert_close(got.double(), ref, atol=0.05 if dtype == torch.bfloat16 else 1e-4,
                                                   rtol=0.02 if dtype == torch.bfloat16 else 1e-4)


def test_the_row_limit_is_the_python_kernels():
    # up to SMALL_ROWS rows the native kernel's result, beyond it oneDNN's (their sums run in other orders)
    dtype = _native_dtypes()[0]
    limit = cpu_linear.SMALL_ROWS[dtype]
    w = torch.randn(256, 512).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w.clone(), 16)
    layout = cpu_linear.proven_layout(packed)
    lib = native.load()
    for rows in (limit, limit + 1):
        x = torch.randn(rows, 512).to(dtype)
        got = _cpp(x, packed, None, layout)
        if rows <= limit:
            assert torch.equal(got, native.linear(lib, x, packed, None, torch.get_num_threads(), layout))
        else:
            assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))


def test_calls_the_kernel_refuses_go_to_onednn():
    # a layout the buffer's size does not fit, a layout the kernel does not know, a bias with gaps: oneDNN
    w = torch.randn(64, 32)
    x = torch.randn(3, 32)
    ref = x.double() @ w.double().T
    torch.testing.assert_close(_cpp(x, w, None, native.LINEAR_PANELS).double(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_cpp(x, w, None, 7).double(), ref, atol=1e-4, rtol=1e-4)
    bias = torch.randn(128)[::2]  # not contiguous
    for op in (_cpp, _python):
        torch.testing.assert_close(op(x, w, bias, 0).double(), ref + bias.double(), atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError):
        _cpp(torch.randn(3, 31), w, None, 0)  # oneDNN refuses mismatched shapes, as it does for the Python kernel


def test_the_operator_pads_onednns_rows_as_the_python_kernel_does():
    # linear_op.cpp keeps its own copy of cpu_linear.onednn_rows: the rows oneDNN is called with, as the profiler
    # records them, are the Python rule's for bfloat16 (and unpadded for float32), across several octaves
    for dtype in _onednn_dtypes():
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(48, 32).to(dtype), 16)
        sizes = [1, 64, 65, 129, 200, 255, 257, 1000, 1025, 3000]
        with torch.profiler.profile(record_shapes=True) as prof:
            for m in sizes:
                # more rows than the native kernel takes: the operator goes to oneDNN itself
                _cpp(torch.randn(m + cpu_linear.SMALL_ROWS[dtype], 32).to(dtype), packed, None, 0)
        seen = [e.input_shapes[0][0] for e in prof.events() if e.name == "mkldnn::_linear_pointwise"]
        want = [m + cpu_linear.SMALL_ROWS[dtype] for m in sizes]
        assert seen == ([cpu_linear.onednn_rows(m) for m in want] if dtype == torch.bfloat16 else want), dtype


def test_under_validation_calls_go_to_the_python_kernel(monkeypatch):
    # float32 packed for one row keeps oneDNN's plain layout here, of the same size as the panels at 64 x 32: only the
    # bytes tell them apart, and only the Python kernel's proof reads them
    w = torch.randn(64, 32)
    packed = torch.ops.mkldnn._reorder_linear_weight(w.clone(), 1)
    if torch.float32 not in _dtypes() or cpu_linear.proven_layout(packed) != native.LINEAR_PLAIN:
        pytest.skip("oneDNN packs float32 for one row in another layout here")
    x = torch.randn(2, 32)
    _cpp(x, packed, None, native.LINEAR_PANELS)  # validation off: no proof (the pass proved the layout it gives)
    set_validation(True)
    with pytest.raises(ValueError, match="does not hold layout"):
        _cpp(x, packed, None, native.LINEAR_PANELS)
    set_validation(None)  # the environment decides, in C++ as in Python
    monkeypatch.setenv("PAGEDATTN_VALIDATE", "on")
    with pytest.raises(ValueError, match="does not hold layout"):
        _cpp(x, packed, None, native.LINEAR_PANELS)
    monkeypatch.setenv("PAGEDATTN_VALIDATE", "0")
    _cpp(x, packed, None, native.LINEAR_PANELS)


def test_the_pass_puts_in_the_operator_and_the_python_op_without_it(monkeypatch):
    w = torch.randn(96, 64).to(_native_dtypes()[0])
    for available, target in ((True, torch.ops.pagedattn_native.linear.default),
                              (False, torch.ops.pagedattn.linear.default)):
        if not available:
            monkeypatch.setattr(native_ops, "linear_op", lambda: None)
        gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
        gm.register_buffer("w", torch.ops.mkldnn._reorder_linear_weight(w.clone(), 16))
        x = gm.graph.placeholder("x")
        gm.graph.output(gm.graph.call_function(torch.ops.mkldnn._linear_pointwise.default,
                                               (x, gm.graph.get_attr("w"), None, "none", [], "")))
        gm.recompile()
        cpu_linear.SmallLinears()(gm.graph)
        assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [target]


def test_without_a_cxx_compiler_or_with_a_failed_build_it_is_off(monkeypatch, tmp_path):
    try:
        native_ops.load.cache_clear()
        with monkeypatch.context() as m:
            m.setattr(native_ops, "cxx_compiler", lambda: None)
            assert native_ops.load() is False and native_ops.linear_op() is None
        native_ops.load.cache_clear()
        with monkeypatch.context() as m:
            m.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path))  # nothing cached there: the load builds
            m.setattr(native_ops, "_flags", lambda: ("-fno-such-flag",))
            assert native_ops.load() is False and not list(tmp_path.glob("native_ops-*.so"))
        native_ops.load.cache_clear()
        with monkeypatch.context() as m:
            m.setenv("PAGEDATTN_NATIVE", "0")
            assert native_ops.linear_op() is None
    finally:
        native_ops.load.cache_clear()
    assert native_ops.load()  # loaded again for the tests after this one


# ---------------------------------------------------------------- the paged ops' C++ stand-ins


def _paged(namespace, b, params):
    """The step's write and attention through the ops of ``namespace`` (``pagedattn_native``: the C++ stand-ins)."""
    ops, m = getattr(torch.ops, namespace), b.meta
    ops.write_kv_cache(b.key, b.value, b.kv_cache, m.slot_mapping)
    return ops.paged_attention(b.query, b.key, b.value, b.kv_cache, m.block_tables, m.seq_lens, m.query_start_loc,
                               *params.args())


def _paged_from_cache(namespace, b, params):
    """As :func:`_paged`, the attention given no K/V (it reads the step's from the cache)."""
    ops, m = getattr(torch.ops, namespace), b.meta
    ops.write_kv_cache(b.key, b.value, b.kv_cache, m.slot_mapping)
    return ops.paged_attention(b.query, None, None, b.kv_cache, m.block_tables, m.seq_lens, m.query_start_loc,
                               *params.args())


_native_paged = functools.partial(_paged, "pagedattn_native")
_python_paged = functools.partial(_paged, "pagedattn")


@pytest.fixture
def python_calls(monkeypatch):
    """How many calls reached the Python paged ops (their checks run on every path they take)."""
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    calls = []
    for name in ("check_write", "check_attend"):
        real = getattr(SdpaCpuBackend, name)
        monkeypatch.setattr(SdpaCpuBackend, name, lambda self, *a, _r=real, _n=name, **k: calls.append(_n) or
                            _r(self, *a, **k))
    return calls


def test_the_stand_ins_have_the_paged_ops_schemas():
    for name in ("write_kv_cache", "paged_attention"):
        native = str(getattr(torch.ops.pagedattn_native, name).default._schema)
        assert native.replace("pagedattn_native::", "pagedattn::") == str(getattr(torch.ops.pagedattn, name).default._schema)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("site", ["plain", "window", "chunk", "softcap", "bidirectional", "padded"])
def test_the_stand_ins_run_decodes_as_the_python_path_does(dtype, site, python_calls):
    # a decode step under the plain CPU backend: written and attended in C++, bit for bit what the Python path gives
    from pagedattn.backends import use_backend
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    seqs = [(37, 1), (5, 1), (130, 1), (0, 1)]
    kw = dict(num_heads=6, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype, pad_tokens=3 if site == "padded" else 0)
    args = dict(scale=0.125, causal=site != "bidirectional", window=20 if site == "window" else 0,
                softcap=30.0 if site == "softcap" else 0.0)
    outs, caches = [], []
    for run in (_native_paged, _python_paged):
        b = make_batch(seqs, **kw)
        params = batch_params(b, **args)
        if site == "chunk":
            params = dataclasses.replace(params, chunk_size=32)
        with use_backend(SdpaCpuBackend()):
            before = len(python_calls)
            outs.append(run(b, params))
            if run is _native_paged:
                assert len(python_calls) == before  # no Python kernel ran
        caches.append(b.kv_cache)
    assert torch.equal(caches[0], caches[1])
    assert torch.equal(outs[0], outs[1])


def test_a_binding_inside_one_of_the_same_backend_binds_nothing(python_calls, monkeypatch):
    # a serving loop binds its backend once (PagedEngine.bound): the steps' own bindings inside it tell the C++ ops
    # nothing, and the stand-ins run natively inside them and after them; another backend still binds and restores
    from pagedattn.backends import native_ops, use_backend
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    binds = []
    real = native_ops.bind_backend
    monkeypatch.setattr(native_ops, "bind_backend", lambda backend, outer=None: binds.append(backend) or real(backend, outer))
    backend = SdpaCpuBackend()
    b = make_batch([(20, 1), (33, 1)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    params = batch_params(b, 0.125)
    with use_backend(backend):
        for _ in range(2):
            with use_backend(backend):
                before = len(python_calls)
                _native_paged(b, params)
                assert len(python_calls) == before
        before = len(python_calls)
        _native_paged(b, params)
        assert len(python_calls) == before  # still bound
        with use_backend(None):  # the defaults: the Python ops
            before = len(python_calls)
            _native_paged(b, params)
            assert len(python_calls) > before
        before = len(python_calls)
        _native_paged(b, params)
        assert len(python_calls) == before  # bound again as it was
    assert binds == [backend, None]


def _case(kind):
    """A step, its parameters and a description of why the stand-ins leave it to the Python op."""
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    seqs = ([(20, 1), (0, 5), (40, 30)] if kind.startswith("chunk") else [(20, 1), (0, 5), (0, 40)]
            if kind.startswith("prompt") else [(20, 1), (33, 1)])
    b = make_batch(seqs, num_heads=4, num_kv_heads=2, head_size=72 if kind == "prompt_head_72" else 64, block_size=16,
                   dtype=torch.bfloat16 if kind.endswith("sdpa") else torch.float32)
    params = batch_params(b, 0.125, softcap=20.0 if kind == "prompt_softcap" else 0.0)
    backend = SdpaCpuBackend()
    if kind in ("prompt_chunked", "chunk_of_a_chunked_site"):
        params = dataclasses.replace(params, chunk_size=16)
    if kind == "alibi":
        params = dataclasses.replace(params, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    elif kind == "sinks":
        params = dataclasses.replace(params, sinks=torch.tensor([0.1, -0.2, 0.3, 0.0]))
    elif kind == "int64_tables":
        b = dataclasses.replace(b, meta=dataclasses.replace(b.meta, block_tables=b.meta.block_tables.long()))
    elif kind == "subclass":
        backend = type("Sub", (SdpaCpuBackend,), {})()
    elif kind == "instance_override":
        backend.attend = lambda *a, _real=backend.attend: _real(*a)
    return b, params, backend


@pytest.mark.parametrize("kind", ["prompt_softcap", "prompt_chunked", "prompt_head_72", "prompt_sdpa",
                                  "chunk_of_a_chunked_site", "chunk_sdpa", "alibi", "sinks", "int64_tables", "subclass",
                                  "instance_override", "validation", "no_backend_bound"])
def test_what_the_stand_ins_do_not_run_goes_to_the_python_op(kind, python_calls, monkeypatch):
    # prompts and chunks over cached keys the native prefill does not take (soft-cap, chunked attention, a head size
    # it lacks) or that SDPA's kernel takes on this machine go to the Python op
    from pagedattn.backends import native_ops, sdpa_cpu

    if kind.endswith("sdpa"):  # as on a CPU with AMX tiles, with bounds the step's 40-token prompt or chunk reaches
        monkeypatch.setattr(sdpa_cpu, "SDPA_PREFILL_TOKENS", 40)
        monkeypatch.setattr(sdpa_cpu, "SDPA_CHUNK_TOKENS", 30)
        monkeypatch.setattr(sdpa_cpu, "SDPA_CHUNK_WORK", 30 * 70)
        monkeypatch.setattr(sdpa_cpu, "_amx_tiles", lambda: True)
        native_ops.bind_paged_kernels(40, (30, 30 * 70))
    try:
        _python_op_takes(kind, python_calls)
    finally:
        native_ops.bind_paged_kernels()


def _python_op_takes(kind, python_calls):
    from pagedattn.backends import use_backend

    outs, caches = [], []
    for run in (_native_paged, _python_paged):
        b, params, backend = _case(kind)
        if kind == "validation":
            set_validation(True)
        bound = use_backend(None) if kind == "no_backend_bound" else use_backend(backend)
        with bound:
            before = len(python_calls)
            outs.append(run(b, params))
            assert len(python_calls) > before
        caches.append(b.kv_cache)
    assert torch.equal(caches[0], caches[1]) and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("site", ["plain", "window", "bidirectional", "bidirectional_window", "padded", "prompts_only",
                                  "long_prompt", "chunks", "chunks_window", "chunks_without_keys", "chunks_a_batch_each",
                                  "long_chunk"])
def test_the_stand_ins_run_prompts_beside_decodes_as_the_python_path_does(dtype, site, python_calls):
    # a step of fresh prompts, chunks over cached keys and decodes under the plain CPU backend: its prompts and chunks
    # through the native prefill (the chunks' blocks gathered) and its decodes through the decode kernel from C++, bit
    # for bit what the Python path gives; the step's keys not given, its sequences all go through the cache; a prompt
    # or chunk at least as large as SDPA's bounds too where SDPA's kernel does not pay (the bounds are 0 off AMX); the
    # chunks in one gathered batch or, with a batch budget every chunk passes, in a batch each
    from pagedattn.backends import native_ops, sdpa_cpu, use_backend
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    seqs = {"prompts_only": [(0, 7), (0, 33)],
            "long_prompt": [(0, sdpa_cpu.SDPA_PREFILL_TOKENS + 3), (12, 1)],
            "chunks": [(37, 1), (16, 9), (0, 12), (100, 40), (5, 2)],
            "long_chunk": [(2048, 64), (3, 1)]}.get(site, [(37, 1), (0, 9), (5, 1), (0, 20)])
    kw = dict(num_heads=6, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype,
              pad_tokens=3 if site == "padded" else 0)
    if site.startswith("chunks_"):
        seqs = [(37, 1), (16, 9), (0, 12), (100, 40), (5, 2)]
    # a window applies to causal attention only: a bidirectional site's is none, on both paths
    args = dict(scale=0.125, causal=not site.startswith("bidirectional"), window=5 if site.endswith("window") else 0)
    native_ops.bind_paged_kernels(0, (0, 0), 1 if site == "chunks_a_batch_each" else None)
    try:
        outs, caches = [], []
        for run in (_native_paged, _python_paged):
            b = make_batch(seqs, **kw)
            stand_ins = run is _native_paged
            if site == "chunks_without_keys":  # K/V written first, then attended from the cache alone
                run = functools.partial(_paged_from_cache, run.args[0])
            params = batch_params(b, **args)
            with use_backend(SdpaCpuBackend()):
                before = len(python_calls)
                if stand_ins:
                    outs.append(run(b, params))
                    assert len(python_calls) == before  # no Python kernel ran
                else:
                    with pytest.MonkeyPatch.context() as m:
                        m.setattr(sdpa_cpu, "_amx_tiles", lambda: False)
                        outs.append(run(b, params))
            caches.append(b.kv_cache)
    finally:
        native_ops.bind_paged_kernels()
    assert torch.equal(caches[0], caches[1])
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("bad, match", [
    ("slot", "outside the cache's"),
    ("negative_slot", "negative other than -1"),
    ("seq_len", "longer than its block table"),
    ("max_seq_len", "longer than"),
    ("chunk_block", "not a block of the cache"),
    ("short_prompt", "shorter than its new tokens"),
])
def test_the_stand_ins_refuse_bad_metadata_as_the_python_op_does(bad, match):
    from pagedattn.backends import use_backend
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    extra = {"chunk_block": [(40, 30)], "short_prompt": [(0, 8)]}.get(bad, [])
    b = make_batch([(20, 1), (33, 1)] + extra, num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    params = batch_params(b, 0.125)
    m = b.meta
    with use_backend(SdpaCpuBackend()):
        if bad in ("slot", "negative_slot"):
            slots = m.slot_mapping.clone()
            slots[1] = 10_000 if bad == "slot" else -3
            before = b.kv_cache.clone()
            with pytest.raises(ValueError, match=match):
                torch.ops.pagedattn_native.write_kv_cache(b.key, b.value, b.kv_cache, slots)
            assert torch.equal(b.kv_cache, before)
            return
        lens, tables = m.seq_lens.clone(), m.block_tables.clone()
        if bad == "seq_len":
            lens[1] = m.block_tables.shape[1] * 16 + 1
        elif bad == "chunk_block":
            tables[2, 1] = b.kv_cache.shape[1]  # one past the cache's last block
        elif bad == "short_prompt":  # 8 new tokens of a causal sequence of 5 (the C++ op gave rows of stale memory)
            lens[2] = 5
        else:
            params = dataclasses.replace(params, max_seq_len=30)
        for op in (torch.ops.pagedattn_native, torch.ops.pagedattn):
            with pytest.raises(ValueError, match=match):
                op.paged_attention(b.query, b.key, b.value, b.kv_cache, tables, lens, m.query_start_loc,
                                   *params.args())


@pytest.mark.parametrize("window", [-1, 2**32 + 3], ids=["negative", "past_int32"])
def test_the_stand_ins_read_a_sites_window_as_the_python_op_does(window, python_calls, monkeypatch):
    # a window that is none (negative) or wider than int32 (every key): prompts, chunks and decodes as the Python op
    # gives them, equal to the reference; on a machine with AMX tiles a bf16 prompt past SDPA's bound goes to SDPA's
    # kernel on both paths (the C++ op read the raw window there); the wide window was cut to int32 (3) on both
    from pagedattn.backends import native_ops, sdpa_cpu, use_backend
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    from ..support import TOL, reference_step

    monkeypatch.setattr(sdpa_cpu, "_amx_tiles", lambda: True)
    native_ops.bind_paged_kernels()  # SDPA's bounds as on a machine with AMX tiles
    seqs = [(0, sdpa_cpu.SDPA_PREFILL_TOKENS + 3), (40, 9), (12, 1)]
    try:
        outs = []
        for run in (_native_paged, _python_paged):
            b = make_batch(seqs, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.bfloat16)
            with use_backend(SdpaCpuBackend()):
                outs.append(run(b, dataclasses.replace(batch_params(b, 0.125), sliding_window=window)))
    finally:
        monkeypatch.undo()
        native_ops.bind_paged_kernels()
    assert torch.equal(outs[0], outs[1])
    ref = reference_step(b, 0.125)
    torch.testing.assert_close(outs[0][:ref.shape[0]].double(), ref, atol=TOL[torch.bfloat16],
                               rtol=TOL[torch.bfloat16])


def test_a_backward_through_the_stand_in_raises():
    # inference only, as the pagedattn:: op (which says so at backward): without its autograd kernel a backward left
    # the query without a gradient, with a warning
    b = make_batch([(20, 1), (0, 9)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    q = b.query.clone().requires_grad_()
    m = b.meta
    out = torch.ops.pagedattn_native.paged_attention(q, b.key, b.value, b.kv_cache, m.block_tables, m.seq_lens,
                                                     m.query_start_loc, *batch_params(b, 0.125).args())
    with pytest.raises(RuntimeError, match="not implemented"):
        out.sum().backward()
    with torch.inference_mode():  # serving: no autograd in the way
        torch.ops.pagedattn_native.paged_attention(b.query, b.key, b.value, b.kv_cache, m.block_tables, m.seq_lens,
                                                   m.query_start_loc, *batch_params(b, 0.125).args())


def test_a_method_wrapped_on_the_bound_backend_takes_its_calls_from_the_stand_ins(python_calls):
    # ops.forget_prepared_calls, for instrumentation that wraps a bound backend's method mid-run: the C++ stand-ins
    # then leave that backend's calls to it (they ran the plain kernels regardless)
    from pagedattn.backends import ops, use_backend
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    b = make_batch([(20, 1), (33, 1)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    params, backend, seen = batch_params(b, 0.125), SdpaCpuBackend(), []
    with use_backend(backend):
        plain = _native_paged(b, params)
        real = backend.attend
        backend.attend = lambda *a, **k: seen.append(1) or real(*a, **k) * 0
        ops.forget_prepared_calls()
        wrapped = _native_paged(b, params)
    assert seen and torch.all(wrapped == 0) and plain.abs().sum() > 0


def _marked_backend():
    """A backend other than the plain CPU one, whose output says it ran (7 everywhere)."""
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    class Marked(SdpaCpuBackend):
        def attend(self, *a, **k):
            return super().attend(*a, **k) * 0 + 7.0

    return Marked()


def test_asyncio_tasks_binding_backends_on_one_thread_each_get_their_own():
    # use_backend binds per task, the C++ stand-ins' setting is per thread: while another task on the thread binds the
    # plain backend, a task bound to another backend must still get that backend's result (the stand-ins ran the
    # plain kernels for it); once no task binds anything the stand-ins are off again
    import asyncio

    from pagedattn.backends import use_backend
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    b = make_batch([(20, 1), (33, 1)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    params, outs = batch_params(b, 0.125), {}

    async def marked(bound, plain, done):
        with use_backend(_marked_backend()):
            bound.set()
            await plain.wait()  # the other task has bound the plain backend meanwhile
            outs["marked"] = _native_paged(b, params)
        done.set()

    async def plain(bound, plain_bound, done):
        await bound.wait()
        with use_backend(SdpaCpuBackend()):
            plain_bound.set()
            await done.wait()
            outs["plain"] = _native_paged(b, params)

    async def main():
        events = [asyncio.Event() for _ in range(3)]
        await asyncio.gather(marked(*events), plain(*events))

    asyncio.run(main())
    assert torch.all(outs["marked"] == 7.0)
    torch.testing.assert_close(outs["plain"], _python_paged(b, params))
    assert torch.ops.pagedattn_native.set_plain_backend(False) is False  # nothing left on


def test_the_stand_ins_fakes_give_the_ops_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    b = make_batch([(20, 1), (33, 1)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    params = batch_params(b, 0.125)
    m = b.meta
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) for t in (b.query, b.key, b.value, b.kv_cache, m.block_tables, m.seq_lens,
                                              m.query_start_loc)]
        out = torch.ops.pagedattn_native.paged_attention(*fake, *params.args()[:7],
                                                         **dict(zip(("sinks", "chunk_size", "max_seq_len"),
                                                                    params.args()[7:10])))
        assert out.shape == b.query.shape and out.dtype == b.query.dtype
        assert torch.ops.pagedattn_native.write_kv_cache(fake[1], fake[2], fake[3], mode.from_tensor(m.slot_mapping)) \
            is None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 300), min_size=1, max_size=9), st.sampled_from([8, 16, 32]),
       st.sampled_from([(4, 4), (6, 2), (8, 1), (12, 4)]), st.sampled_from([32, 64, 128]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 3), st.integers(0, 2), st.integers(0, 1000))
def test_random_decode_steps_through_the_stand_ins_are_the_python_paths(contexts, block_size, heads, head_size, dtype,
                                                                       pad, limits, seed):
    # any decode step the stand-ins take (contexts, block sizes, GQA groups, head sizes, padding rows, windows or
    # chunks of any reach): the cache and the output bit for bit what the Python path gives
    from pagedattn.backends import use_backend
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    seqs = [(c, 1) for c in contexts]
    outs, caches = [], []
    for run in (_native_paged, _python_paged):
        b = make_batch(seqs, num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size, block_size=block_size,
                       dtype=dtype, pad_tokens=pad, generator=torch.Generator().manual_seed(seed))
        params = batch_params(b, head_size ** -0.5, window=[0, 1 + seed % 97, 0][limits])
        if limits == 2:
            params = dataclasses.replace(params, chunk_size=1 + seed % 50)
        with use_backend(SdpaCpuBackend()):
            outs.append(run(b, params))
        caches.append(b.kv_cache)
    assert torch.equal(caches[0], caches[1]) and torch.equal(outs[0], outs[1])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(2, 90), st.integers(0, 200)), min_size=1, max_size=6),
       st.sampled_from([16, 32]), st.sampled_from([(4, 4), (6, 2), (8, 1)]), st.sampled_from([32, 64, 128]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 3), st.integers(0, 2), st.integers(0, 1000))
def test_random_steps_of_prompts_chunks_and_decodes_through_the_stand_ins_are_the_python_paths(
        python_calls, seqs, block_size, heads, head_size, dtype, pad, site, seed):
    # any step of fresh prompts (2-90 tokens), chunks of 2-90 tokens after 1-201 cached ones and decodes (contexts
    # 0-200) the stand-ins take, causal with or without a window or bidirectional: the cache and the output bit for bit
    # what the Python path gives
    from pagedattn.backends import native_ops, use_backend
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    steps = [[(c, 1), (0, n), (c + 1, n)][kind] for kind, n, c in seqs]
    outs, caches = [], []
    native_ops.bind_paged_kernels(0, (0, 0))
    try:
        for run in (_native_paged, _python_paged):
            b = make_batch(steps, num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                           block_size=block_size, dtype=dtype, pad_tokens=pad,
                           generator=torch.Generator().manual_seed(seed))
            params = batch_params(b, head_size ** -0.5, causal=site != 2, window=1 + seed % 40 if site == 1 else 0)
            with use_backend(SdpaCpuBackend()), pytest.MonkeyPatch.context() as m:
                m.setattr("pagedattn.backends.sdpa_cpu._amx_tiles", lambda: False)
                before = len(python_calls)
                outs.append(run(b, params))
                assert run is _python_paged or len(python_calls) == before  # the stand-ins ran it all
            caches.append(b.kv_cache)
    finally:
        native_ops.bind_paged_kernels()
    assert torch.equal(caches[0], caches[1]) and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("op", ["pagedattn", "pagedattn_native"])
def test_a_write_bumps_the_caches_version(op):
    # memos keyed on a cache's version (the kept cross-attention gathers) must see every write, in either op
    from pagedattn.backends import use_backend
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    b = make_batch([(5, 1), (9, 1)], head_size=64, block_size=16)
    write = getattr(torch.ops, op).write_kv_cache
    for mode in (torch.enable_grad(), torch.no_grad(), torch.inference_mode()):
        before = b.kv_cache._version
        with mode, use_backend(SdpaCpuBackend()):
            write(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
        assert b.kv_cache._version > before


# ---------------------------------------------------------------- a gated MLP's SiLU(gate) * up


def _silu_times(gate, up):
    """SiLU(gate) * up in float32, rounded once to the inputs' dtype (what Inductor's fused kernel computes)."""
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


def _flushed(x):
    """``x`` with bfloat16 subnormals as zeros of their sign (the native kernel's AVX512-BF16 rounding flushes them;
    the linear after it reads them as zeros anyway)."""
    if x.dtype != torch.bfloat16:
        return x
    tiny = (x.float().abs() < torch.finfo(torch.bfloat16).tiny) & (x != 0)
    return torch.where(tiny, torch.zeros_like(x).copysign(x), x)


_SILU_SPECIALS = [0.0, -0.0, 1.0, -1.0, 3.0, 88.9, -88.9, 89.5, -95.0, 100.0, -100.0, 1e-30, -1e-30,
                  float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 1024), (1, 16, 1000), (2, 3, 40), (5, 17), (3, 1), (0, 33)])
def test_silu_mul_is_silu_times_up_rounded_once(dtype, shape):
    # gate and up as the halves of a joint projection's output (rows apart by twice their width), any width (whole
    # vectors, a masked tail, both); bfloat16 bit for bit, float32 to the exponential's last bits; inf, NaN and huge
    # arguments as the formula gives them
    g = torch.Generator().manual_seed(sum(shape))
    joint = (torch.rand(*shape[:-1], 2 * shape[-1], generator=g) * 24 - 12).to(dtype)
    gate, up = joint[..., :shape[-1]], joint[..., shape[-1]:]
    if gate.numel() >= len(_SILU_SPECIALS):
        gate.view(-1, shape[-1])[0].flatten()[:len(_SILU_SPECIALS)] = torch.tensor(_SILU_SPECIALS)[:shape[-1]]
    out = torch.ops.pagedattn_native.silu_mul(gate, up)
    ref = _silu_times(gate, up)
    assert out.shape == ref.shape and out.is_contiguous()
    if dtype == torch.bfloat16:
        assert torch.equal(out.isnan(), ref.isnan())  # NaNs of either sign and payload
        bits = [torch.where(x.isnan(), torch.zeros_like(x), _flushed(x)).view(torch.int16) for x in (out, ref)]
        assert torch.equal(*bits)  # signed zeros too
    else:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=0, equal_nan=True)


def test_silu_mul_off_its_kernel_computes_the_same():
    # rows that do not flatten into one stride, float16, mismatched dtypes: ATen's arithmetic, rounded once
    a = torch.randn(4, 6, 5).to(torch.bfloat16).transpose(0, 1)
    b = torch.randn(6, 4, 5).to(torch.bfloat16)
    assert torch.equal(torch.ops.pagedattn_native.silu_mul(a, b), _silu_times(a, b))
    h = torch.randn(3, 7).half()
    assert torch.equal(torch.ops.pagedattn_native.silu_mul(h, h), _silu_times(h, h))


def _decomposed(fn, *args, decompose=True, sizes="real"):
    """``fn``'s graph as Inductor's post-grad passes see it (its decompositions: SiLU as convert, neg, exp, add,
    div, convert), or with ``aten.silu`` kept (``decompose=False``); ``sizes="symbolic"``: its sizes symbols, as in
    a step compiled for every number of tokens."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, decomposition_table=select_decomp_table() if decompose else None, tracing_mode=sizes)(*args)


def _fused(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.pagedattn_native.silu_mul.default]


@pytest.mark.parametrize("decompose, sizes", [(True, "real"), (False, "real"), (True, "symbolic")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pass_fuses_silu_times_up_and_drops_what_only_it_used(dtype, decompose, sizes):
    if dtype not in native.linear_dtypes(native.load()):
        pytest.skip(f"no native {dtype} kernel on this CPU (the pass leaves such products to Inductor)")
    silu = torch.nn.functional.silu
    x = torch.randn(7, 2 * 40).to(dtype)
    gm = _decomposed(lambda x: silu(x[:, :40]) * x[:, 40:] + silu(x[:, 40:]), x,  # the second SiLU stays
                     decompose=decompose, sizes=sizes)
    native_ops.SiluMul()(gm.graph)
    gm.recompile()
    assert len(_fused(gm)) == 1
    silu_nodes = torch.ops.aten.exp.default if decompose else torch.ops.aten.silu.default
    assert sum(n.target is silu_nodes for n in gm.graph.nodes) == 1
    # the product rounded once, as Inductor's fused kernel computes it (the decomposed graph rounds SiLU's result too)
    expected = _silu_times(x[:, :40], x[:, 40:]) + silu(x[:, 40:])
    torch.testing.assert_close(gm(x), expected, rtol=0 if dtype == torch.bfloat16 else 1e-6,
                               atol=0 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("spelling", ["broadcast_up", "sum_not_product", "sigmoid", "other_exponent", "promoted",
                                      "float16"])
def test_the_pass_leaves_other_products_alone(spelling):
    if torch.bfloat16 not in native.linear_dtypes(native.load()):
        pytest.skip("no native bfloat16 kernel on this CPU: the pass fuses no bfloat16 product at all")
    silu = torch.nn.functional.silu
    a, b = torch.randn(5, 8).bfloat16(), torch.randn(5, 8).bfloat16()
    fn, args = {
        "broadcast_up": (lambda a, b: silu(a) * b[:1], (a, b)),  # up of another shape
        "sum_not_product": (lambda a, b: silu(a) + b, (a, b)),
        "sigmoid": (lambda a, b: torch.sigmoid(a) * b, (a, b)),
        "other_exponent": (lambda a, b: a / (1 + torch.exp(-b)) * b, (a, b)),
        "promoted": (lambda a, b: silu(a) * b, (a, b.float())),  # a float32 product
        "float16": (lambda a, b: silu(a) * b, (a.half(), b.half())),  # no kernel for it
    }[spelling]
    gm = _decomposed(fn, *args)
    native_ops.SiluMul()(gm.graph)
    assert not _fused(gm)


def test_a_onednn_tensor_over_a_buffer_is_refused_past_the_buffers_end():
    # bfloat16 where oneDNN takes it, float32 elsewhere: the descriptor, not the dtype, places the buffer's bytes
    w = torch.randn(64, 128).to(_onednn_dtypes()[0])
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    size = torch.ops.mkldnn._nbytes(packed)
    buffer = torch.zeros(size + 64, dtype=torch.uint8)
    native.onednn_bytes(packed, out=buffer[64:])
    with pytest.raises(ValueError, match="uint8 bytes"):
        native.onednn_bytes(packed, out=buffer[65:])  # one byte short: nothing copied
    view = native_ops.onednn_from_buffer(buffer, 64, packed)
    assert torch.equal(view.to_dense(), packed.to_dense())  # the buffer's bytes in the weight's layout
    with pytest.raises(RuntimeError, match="pass the buffer's end"):
        native_ops.onednn_from_buffer(buffer, 65, packed)
    with pytest.raises(RuntimeError, match="outside the buffer"):
        native_ops.onednn_from_buffer(buffer, size + 65, packed)
    with pytest.raises(RuntimeError, match="contiguous uint8"):
        native_ops.onednn_from_buffer(buffer.view(torch.int16), 0, packed)




STAND_IN = b"""
extern "C" {
int calls;
static int stand_in(const void *args) { (void)args; return ++calls, 0; }
int pagedattn_linear(const void *a) { return stand_in(a); }
int pagedattn_silu_mul(const void *a) { return stand_in(a); }
int pagedattn_paged_decode(const void *a) { return stand_in(a); }
int pagedattn_write_kv(const void *a) { return stand_in(a); }
int pagedattn_prefill(const void *a) { return stand_in(a); }
}
"""


def test_bind_kernels_stands_another_librarys_kernels_in_and_takes_the_c_librarys_back():
    # what benchmarks/host_step.py does to time a step's own work: every kernel the operators call (a linear, SiLU x
    # up, a step's cache write, its decodes and its prompt) is the stand-in's, each call counted and nothing computed;
    # then the C library's again, whose results the operators give
    import ctypes

    from pagedattn.backends import use_backend
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    path = native.build_shared({"stand_in.cpp": STAND_IN}, native_ops.cxx_compiler(), ("-O2", "-shared", "-fPIC"),
                               "test_stand_in", unit_cache=False)
    calls = ctypes.c_int.in_dll(ctypes.CDLL(str(path)), "calls")
    # which calls reach a kernel stays the C library's policy: a linear only in a dtype it has a kernel for here
    dtype = (_dtypes() or [torch.float32])[0]
    kernels = 5 if dtype in _dtypes() else 4
    x, w = torch.randn(4, 64).to(dtype), torch.randn(32, 64).to(dtype)
    gate, up = torch.randn(4, 48).to(dtype), torch.randn(4, 48).to(dtype)

    def run():
        b = make_batch([(20, 1), (33, 1), (0, 9)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
        with use_backend(SdpaCpuBackend()):
            out = _native_paged(b, batch_params(b, 0.125))
        return (torch.ops.pagedattn_native.linear(x, w, None, native.LINEAR_PLAIN),
                torch.ops.pagedattn_native.silu_mul(gate, up), out, b.kv_cache)

    expected = run()
    try:
        native_ops.bind_kernels(ctypes.CDLL(str(path)))
        run()
        assert calls.value == kernels  # one call of each kernel, from the operators
    finally:
        native_ops.bind_kernels()
    got = run()
    assert calls.value == kernels
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


# ---- the serving scope's CPU allocator (csrc/step_allocator.cpp)


def _scope():
    from pagedattn.backends import use_backend
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    return use_backend(SdpaCpuBackend())


def test_the_serving_scope_makes_cpu_tensors_from_the_blocks_of_freed_ones():
    # inside the plain CPU backend's scope a freed tensor's block is kept and handed to the next tensor of its size
    # class (64-byte aligned); outside it torch's allocator makes tensors and the counts do not move
    native_ops.release_step_memory()
    assert not native_ops.step_memory().active
    with _scope():
        assert native_ops.step_memory().active
        a = torch.empty(3000)  # 12,000 bytes: the class of 12,288 (8 to an octave past 4 KiB)
        first, kept = a.data_ptr(), native_ops.step_memory()
        del a
        freed = native_ops.step_memory()
        assert freed.kept_bytes == kept.kept_bytes + 12288
        b = torch.empty(2990, dtype=torch.float32)  # 11,960 bytes: the same class
        got = native_ops.step_memory()
        assert b.data_ptr() == first and b.data_ptr() % 64 == 0
        assert (got.reused, got.made, got.kept_bytes) == (freed.reused + 1, freed.made, kept.kept_bytes)
        c = torch.empty(5000)  # another class: a new block
        assert native_ops.step_memory().made == freed.made + 1 and c.data_ptr() != first
    outside = native_ops.step_memory()
    assert not outside.active
    d = torch.empty(3000)
    del b  # made inside, freed outside: kept all the same
    assert native_ops.step_memory().kept_bytes == outside.kept_bytes + 12288
    with _scope():
        del d  # made by torch's allocator: freed by its own deleter, not kept
        e = torch.ones(2990)
        assert native_ops.step_memory().reused == outside.reused + 1  # b's block
    assert torch.equal(e, torch.ones(2990)) and torch.equal(c.fill_(2.0), torch.full((5000,), 2.0))
    native_ops.release_step_memory()
    assert native_ops.step_memory().kept_bytes == 0


def _class_edges():
    """Request sizes at every size class's edges up to the largest kept (4 MiB): 64-byte steps to 4 KiB, then 8 to an
    octave; each class's size, one byte over it, and one under the next."""
    classes = list(range(64, 4097, 64))
    octave = 4096
    while octave < 4 << 20:
        classes += [octave + i * (octave // 8) for i in range(1, 9)]
        octave *= 2
    return sorted({n + d for n in classes for d in (-1, 0, 1) if 0 < n + d <= 4 << 20})


def _reused_at(nbytes: int) -> None:
    with _scope():
        a = torch.empty(nbytes, dtype=torch.uint8)
        first = a.data_ptr()
        del a
        b = torch.empty(nbytes, dtype=torch.uint8)
        assert b.data_ptr() == first, nbytes
        b.fill_(7)  # the whole request lies in the block
        assert int(b[-1]) == 7


def test_a_freed_block_is_the_next_one_of_its_size_at_every_class_edge():
    # a block's class is read back from its usable size at its free: at every class's edges up to 4 MiB (heap chunks
    # and mapped ones) the next tensor of the same size takes the block, which holds it
    for nbytes in _class_edges():
        _reused_at(nbytes)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4 << 20))
def test_a_freed_block_is_the_next_one_of_its_size_at_any_size_kept(nbytes):
    _reused_at(nbytes)


def test_the_step_allocator_stays_until_the_last_thread_leaves_the_scope_and_can_be_turned_off_inside_it():
    import threading

    entered, leave = threading.Event(), threading.Event()

    def other():
        with _scope():
            entered.set()
            leave.wait(30)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert entered.wait(30)
        with _scope():
            assert native_ops.step_memory().active
            assert native_ops.set_step_allocator(False) is True  # at once, inside the scope
            assert not native_ops.step_memory().active
            assert native_ops.set_step_allocator(True) is False
            assert native_ops.step_memory().active
        assert native_ops.step_memory().active  # the other thread is still inside
    finally:
        leave.set()
        t.join(30)
    assert not native_ops.step_memory().active


def test_memory_made_on_one_side_of_the_scopes_edge_and_freed_on_the_other():
    # oneDNN's tensors take their buffers by the raw interface, which frees by the current allocator: made in the scope
    # and freed outside it, or the other way round (a frozen step's packed weights, its GEMMs' buffers), each is freed
    # rightly (an allocator whose blocks the other cannot free aborts the process here), and tensors the same
    import gc

    dense_inside, dense_outside = torch.randn(256, 256), torch.randn(256, 256)
    with _scope():
        made_inside = dense_inside.to_mkldnn()
        packed_inside = torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 96), 16)
        plain_inside = torch.arange(300.0)
    made_outside = dense_outside.to_mkldnn()
    plain_outside = torch.randn(300)
    with _scope():
        assert torch.equal(made_outside.to_dense(), dense_outside)  # made outside, read inside
        del made_outside, plain_outside
        gc.collect()
    assert torch.equal(made_inside.to_dense(), dense_inside) and torch.equal(plain_inside, torch.arange(300.0))
    del made_inside, packed_inside, plain_inside
    gc.collect()
    with _scope():
        again = dense_outside.to_mkldnn()
        assert torch.equal(again.to_dense(), dense_outside)


def test_a_block_past_the_largest_kept_goes_back_to_the_system():
    native_ops.release_step_memory()
    with _scope():
        made = native_ops.step_memory().made
        big = torch.empty(5 << 20, dtype=torch.uint8)  # past STEP_BLOCK_MAX (4 MiB)
        del big
        assert native_ops.step_memory().kept_bytes == 0 and native_ops.step_memory().made == made


def test_the_environment_turns_the_step_allocator_off():
    import subprocess
    import sys

    code = ("import torch\nfrom pagedattn.backends import native_ops, use_backend\n"
            "from pagedattn.backends.sdpa_cpu import SdpaCpuBackend\nassert native_ops.load()\n"
            "with use_backend(SdpaCpuBackend()):\n    print(native_ops.step_memory().active)\n")
    for value, active in (("0", "False"), ("1", "True")):
        env = {**__import__("os").environ, "PAGEDATTN_STEP_ALLOCATOR": value}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.strip() == active


def test_an_engine_generates_the_same_tokens_with_and_without_the_step_allocator():
    # every CPU tensor of its steps from kept blocks, or from torch's allocator: nothing they compute changes
    import pagedattn

    from ..support import prompts, tiny_model

    engine = pagedattn.PagedEngine(tiny_model("llama", "eager"), compile=False, progress=False)
    try:
        out, handed = {}, {}
        for on in (False, True, False, True):
            native_ops.set_step_allocator(on)
            before = native_ops.step_memory()
            out.setdefault(on, []).append(engine.generate(prompts(), max_new_tokens=8))
            after = native_ops.step_memory()
            handed.setdefault(on, []).append(after.made + after.reused - before.made - before.reused)
        assert out[True][0] == out[True][1] == out[False][0] == out[False][1]
        assert min(handed[True]) > 0 and handed[False] == [0, 0]  # its steps' tensors came from it, or not at all
    finally:
        native_ops.set_step_allocator(True)
