"""A serving step's linears on the CPU (backends/cpu_linear.py, backends/csrc/small_linear.c): the native kernel in
both weight layouts against float64, the proof of a oneDNN-packed weight's layout and its counter-examples, the
op's refusals and its fallback to oneDNN, and the Inductor pass that puts the op in place."""

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch._inductor.freezing_utils import is_frozen_param

from pagedattn.backends import cpu_linear, native, native_ops, set_validation

from ..support import skip_unless_missing_prerequisite

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.fixture(autouse=True)
def _built():
    if native.load() is None:
        skip_unless_missing_prerequisite()


def _flags() -> set:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def _lib_for(dtype):
    lib = native.load()
    if dtype not in native.linear_dtypes(lib):
        pytest.skip(f"no native {dtype} linear on this CPU")
    return lib


def _kernel_dtypes() -> list:
    """The dtypes the native linear kernel takes on this CPU (float32 by AVX-512 or AVX2, bfloat16 by AVX512-BF16)."""
    dtypes = [d for d in (torch.float32, torch.bfloat16) if d in native.linear_dtypes(native.load())]
    if not dtypes:
        pytest.skip("no native linear kernel on this CPU (small_linear.c needs AVX-512, or AVX2 and FMA)")
    return dtypes


def _kernel_dtype() -> torch.dtype:
    """The narrowest dtype the kernel takes here."""
    return _kernel_dtypes()[-1]


def _linear_target():
    """The op the pass puts in: the C++ operator where it is built here, else the Python kernel's."""
    return native_ops.linear_op() or torch.ops.pagedattn.linear.default


def _packed(w: torch.Tensor, rows: int = 16) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.clone(), rows)


_PANELS = (native.LINEAR_PANELS, native.LINEAR_PANELS32)


def _packed_as(w: torch.Tensor, layout: int):
    """``w`` packed by oneDNN so that its buffer holds ``layout``, trying the row counts it packs differently for
    (a CPU with AMX packs bfloat16 for AMX at most of them); None where none does here."""
    for rows in (16, 1, None, 128):
        packed = _packed(w, rows)
        if cpu_linear.proven_layout(packed) == layout:
            return packed
    return None


def _panel_layouts(dtype) -> list:
    """The panel layouts the kernel takes for ``dtype`` here and oneDNN packs into: each test runs on every one."""
    lib = _lib_for(dtype)
    w = torch.randn(70, 40).to(dtype)
    found = [p for p in _PANELS if p in native.linear_layouts(lib, dtype) and _packed_as(w, p) is not None]
    assert found, f"no panel layout of {dtype} here"  # the fast path must not be lost silently
    return found


def _reference(x, w, b, dtype):
    out = x.double() @ w.double().t()
    return (out if b is None else out + b.double()).to(dtype)


def _assert_close(out, x, w, b):
    # float32 sums in another order than float64's, then one rounding to the dtype: within a few units of the
    # last place of the largest term's sum
    ref = _reference(x, w, b, out.dtype)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if not out.numel():
        return
    scale = (x.double().abs() @ w.double().abs().t()).max().item() + (0 if b is None else b.double().abs().max().item())
    eps = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8}[out.dtype]
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= 4 * eps * max(scale, 1e-30) + 1e-30, (err, scale)


def test_features_follow_the_cpus_instruction_sets():
    # the fast paths must not be lost silently to a macro the compiler stops defining
    f, flags = native.features(native.load()), _flags()
    assert bool(f & native.FEATURE_LINEAR_F32) == ("avx512f" in flags or {"avx2", "fma", "f16c"} <= flags)
    assert bool(f & native.FEATURE_LINEAR_BF16) == ({"avx512_bf16", "avx512bw"} <= flags)
    assert bool(f & native.FEATURE_LINEAR_AMX) == ({"avx512_bf16", "avx512bw", "amx_tile", "amx_bf16"} <= flags)
    amx = native.LINEAR_PANELS32 in native.linear_layouts(native.load(), torch.bfloat16)
    assert amx == bool(f & native.FEATURE_LINEAR_AMX)
    assert native.LINEAR_PANELS32 not in native.linear_layouts(native.load(), torch.float32)  # AMX: bfloat16 only


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    rows=st.sampled_from([0, 1, 2, 5, 6, 7, 16, 33, 128]),
    # K and N past llama16m's too: many steps with an odd remainder, and many panels with a partial last one
    k=st.sampled_from([1, 2, 15, 16, 17, 31, 32, 33, 63, 384, 1025]),
    n=st.sampled_from([1, 3, 4, 13, 64, 65, 130, 384, 1000]),
    bias=st.booleans(),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_both_layouts_match_float64(dtype, rows, k, n, bias, threads, seed):
    assume(dtype in _kernel_dtypes())
    lib = native.load()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    _assert_close(native.linear(lib, x, w, b, threads, native.LINEAR_PLAIN), x, w, b)
    for layout in _panel_layouts(dtype):
        packed = _packed_as(w, layout)
        if packed is not None:  # oneDNN may pack a small weight plainly
            _assert_close(native.linear(lib, x, packed, b, threads, layout), x, w, b)


def test_a_decode_batch_takes_k_in_chunks_with_each_rows_sums_unchanged():
    # 7-24 rows (a decode step's batch) run K in chunks, each row group's sums kept between chunks (AVX-512), or in
    # tiles of 16 rows, the last one read from a padded copy (AMX): every row's result is the one it gets alone, bit
    # for bit, across chunk, step, tile and panel boundaries
    for dtype in _kernel_dtypes():
        lib = native.load()
        for layout in _panel_layouts(dtype):
            for rows, k, n in ((7, 1025, 130), (16, 384, 1000), (24, 200, 65), (13, 33, 64), (40, 64, 96)):
                x = torch.randn(rows, k).to(dtype)
                w, b = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
                packed = _packed_as(w, layout)
                assert packed is not None
                for threads in (1, 2):
                    out = native.linear(lib, x, packed, b, threads, layout)
                    alone = torch.cat([native.linear(lib, x[i:i + 1], packed, b, threads, layout)
                                       for i in range(rows)])
                    assert torch.equal(out, alone), (dtype, layout, rows, k, n, threads)
                    _assert_close(out, x, w, b)


def _avx2_build():
    """The library with small_linear_avx2.h's kernels: this CPU's own where it has no AVX-512, else one built so."""
    flags = _flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("no AVX2, FMA and F16C on this CPU")
    lib = native.load() if "avx512f" not in flags else native.build_library(("PAGEDATTN_AVX2",))
    assert lib is not None
    return lib


def test_the_avx2_kernels_match_float64_and_give_the_avx512_kernels_bits():
    # float32 only; every (rows, K, N) shape class of the blocking: one row (four lines a pass), two or three (two),
    # groups of six and a remainder, several chunks of K and a partial last step, partial last panels, more rows than
    # the sums' buffer holds. The panels' sums take each k in order as the AVX-512 kernel's do: the same bits, and
    # each row's alone
    lib = _avx2_build()
    assert native.linear_dtypes(lib) == {torch.float32: 0}
    assert native.linear_layouts(lib, torch.float32) == {native.LINEAR_PLAIN, native.LINEAR_PANELS}
    wide = native.load() if "avx512f" in _flags() and lib is not native.load() else None
    g = torch.Generator().manual_seed(3)
    for rows, k, n in ((1, 384, 1000), (2, 33, 130), (3, 17, 65), (4, 200, 64), (7, 1025, 130), (16, 384, 1000),
                       (24, 200, 65), (40, 64, 96), (130, 40, 70), (5, 1, 3)):
        x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        _assert_close(native.linear(lib, x, w, b, 2, native.LINEAR_PLAIN), x, w, b)
        packed = _packed_as(w, native.LINEAR_PANELS)
        if packed is None:  # oneDNN may pack a small weight plainly
            continue
        for threads in (1, 2):
            out = native.linear(lib, x, packed, b, threads, native.LINEAR_PANELS)
            _assert_close(out, x, w, b)
            alone = torch.cat([native.linear(lib, x[i:i + 1], packed, b, threads, native.LINEAR_PANELS)
                               for i in range(rows)])
            assert torch.equal(out, alone), (rows, k, n, threads)
            if wide is not None:
                assert torch.equal(out, native.linear(wide, x, packed, b, threads, native.LINEAR_PANELS))
    # SiLU(gate) * up: the AVX-512 kernel's arithmetic on 8 lanes, its scaling by 2^n in two exact halves
    gate = torch.cat([torch.tensor(_SILU_ARGUMENTS), torch.linspace(-110, 95, 997)]).view(1, -1).repeat(3, 1)
    up = torch.rand(gate.shape, generator=g) * 4 - 2
    out = native.silu_mul(lib, gate, up, 2)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-37, equal_nan=True)
    if wide is not None:
        assert torch.equal(out.view(torch.int32), native.silu_mul(wide, gate, up, 2).view(torch.int32))
    assert native.silu_mul(lib, gate.bfloat16(), up.bfloat16(), 2) is None  # float32 only


# arguments where e^-x leaves float's normal range, overflows or is not a number
_SILU_ARGUMENTS = [0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0, 88.9, -88.9, 89.5, -95.0, -103.0, -104.5, 104.0, 150.0,
                   float("inf"), float("-inf"), float("nan")]


def test_panels_read_no_value_of_x_past_k():
    # the padding of K holds zero weights; x past K is never read (a NaN there would make 0 * NaN = NaN)
    for dtype in _kernel_dtypes():
        lib = native.load()
        for layout in _panel_layouts(dtype):
            for rows in (4, 16, 17):
                wide = torch.full((rows, 48), float("nan"), dtype=dtype)
                wide[:, :33] = torch.randn(rows, 33).to(dtype)
                x = wide[:, :33]  # rows of 33 values inside rows of 48: the rest is NaN
                w = torch.randn(70, 33).to(dtype)
                packed = _packed_as(w, layout)
                _assert_close(native.linear(lib, x, packed, None, 2, layout), x.contiguous(), w, None)


def test_rows_of_x_may_be_strided_and_batched():
    dtype = _kernel_dtype()
    lib = native.load()
    for layout in _panel_layouts(dtype):
        for k in (40, 64):  # a padded last step; whole steps, read in place
            w = torch.randn(64, k).to(dtype)
            packed = _packed_as(w, layout)
            x = torch.randn(3, 6, 2 * k).to(dtype)[..., ::2]  # rows not contiguous
            out = native.linear(lib, x, packed, None, 2, layout)
            _assert_close(out.reshape(18, 64), x.reshape(18, k), w, None)
            x = torch.randn(3, 6, 2 * k).to(dtype)[..., :k]  # contiguous elements, strided rows
            out = native.linear(lib, x, packed, None, 2, layout)
            assert out.shape == (3, 6, 64)
            _assert_close(out.reshape(18, 64), x.reshape(18, k), w, None)


_TO_PANELS = native.to_panels


def _wrong_panels(weight, columns=64):
    """A wrong guess at the panels: columns and slices swapped within each step."""
    flat = _TO_PANELS(weight, columns)
    inner = 1 if weight.dtype == torch.float32 else 2
    return flat.view(-1, 16, columns, inner).transpose(1, 2).reshape(-1)


def test_a_packed_weight_proves_its_layout_and_a_wrong_guess_does_not(monkeypatch):
    for dtype in _kernel_dtypes():
        w = torch.randn(130, 70).to(dtype)
        for layout in _panel_layouts(dtype):
            packed = _packed_as(w, layout)
            assert cpu_linear.proven_layout(packed) == layout
            with monkeypatch.context() as m:  # counter-example: the bytes do not read as the guessed layout
                m.setattr(native, "to_panels", _wrong_panels)
                assert cpu_linear.proven_layout(packed) is None
        assert cpu_linear.proven_layout(w) is None  # not a oneDNN tensor


def test_to_panels_places_each_weight_where_the_kernel_reads_it():
    w = torch.arange(70 * 33, dtype=torch.float32).reshape(70, 33)
    flat = native.to_panels(w)
    assert flat.numel() * 4 == native.linear_panel_bytes(w) == 2 * 64 * 48 * 4  # N to 128, K to 48
    # panel 1, step 1, slice 3 (k = 16 + 3), column 2 of the panel (n = 66)
    assert flat[((1 * 3 + 1) * 16 + 3) * 64 + 2] == w[66, 19]
    assert flat.view(2, 3, 16, 64)[1, :, :, 6:].eq(0).all()  # columns past N are zero
    b = torch.randn(70, 40).bfloat16()
    pairs = native.to_panels(b).view(2, 2, 16, 64, 2)  # K to 64 in steps of 32 (pairs)
    assert pairs[0, 1, 0, 5, 1] == b[5, 33] and pairs[0, 1, 0, 5, 0] == b[5, 32]
    narrow = native.to_panels(b, 32)  # oneDNN's AMX layout: panels of 32 columns, N to 96
    assert narrow.numel() * 2 == native.linear_panel_bytes(b, 32) == 3 * 32 * 64 * 2
    pairs = narrow.view(3, 2, 16, 32, 2)
    assert pairs[2, 1, 3, 5, 1] == b[69, 39] and pairs[1, 0, 0, 31, 0] == b[63, 0]
    assert pairs[2, :, :, 6:].eq(0).all() and pairs[:, 1, 4:].eq(0).all()  # past N and past K: zero


def test_the_kernel_refuses_what_it_cannot_read():
    # None, nothing computed: the op then takes oneDNN
    dtype = _kernel_dtype()
    other = torch.float64 if dtype == torch.float32 else torch.float32
    lib = native.load()
    w = torch.randn(64, 32).to(dtype)
    x = torch.randn(4, 32).to(dtype)
    L = native.LINEAR_PLAIN
    for P in _panel_layouts(dtype):
        packed = _packed_as(w, P)
        assert native.linear(lib, x, packed, None, 2, P) is not None
        assert native.linear(lib, x.to(other), packed, None, 2, P) is None  # dtypes differ
        assert native.linear(lib, x[:, :16], packed, None, 2, P) is None  # K differs
        assert native.linear(lib, x, w, None, 2, P) is None  # a plain tensor read as panels
        odd = _packed_as(torch.randn(13, 32).to(dtype), P)  # padded to whole panels: not 13 plain rows
        assert native.linear(lib, x, odd, None, 2, P) is not None
        assert native.linear(lib, x, odd, None, 2, L) is None
        assert native.linear(lib, x, packed, torch.zeros(63).to(dtype), 2, P) is None  # bias of another length
    packed = _packed_as(w, native.LINEAR_PANELS)
    if packed is not None and native.LINEAR_PANELS32 in native.linear_layouts(lib, torch.bfloat16):
        narrow = _packed_as(torch.randn(13, 32).bfloat16(), native.LINEAR_PANELS)
        assert native.linear(lib, x, narrow, None, 2, native.LINEAR_PANELS32) is None  # 64 columns' size, not 32's
    wf = torch.randn(64, 32)
    for rows in (16, 1, None):  # no float32 AMX kernel: layout 2 refused whatever the buffer
        assert native.linear(lib, x.float(), _packed(wf, rows), None, 2, native.LINEAR_PANELS32) is None
    assert native.linear(lib, x, w.t().contiguous().t(), None, 2, L) is None  # not contiguous
    assert native.linear(lib, x, _packed(w), None, 2, 7) is None  # no such layout
    assert native.linear(lib, x.half(), w.half(), None, 2, L) is None  # no float16 kernel
    assert native.linear(lib, torch.tensor(1.0).to(dtype), w, None, 2, L) is None  # x without a K dimension


def test_the_op_takes_few_rows_natively_and_many_with_onednn(monkeypatch):
    dtype = _kernel_dtype()
    w = torch.randn(64, 32).to(dtype)
    packed = _packed(w)
    layout = cpu_linear.proven_layout(packed)
    calls = []
    real = native.linear
    monkeypatch.setattr(native, "linear", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    for rows in (1, cpu_linear.SMALL_ROWS[dtype], cpu_linear.SMALL_ROWS[dtype] + 1):
        x = torch.randn(rows, 32).to(dtype)
        out = torch.ops.pagedattn.linear(x, packed, None, layout)
        _assert_close(out, x, w, None)
    assert calls == [1, cpu_linear.SMALL_ROWS[dtype]]


def test_under_validation_the_op_rechecks_the_layout_it_is_told():
    # float32 packed for one row keeps oneDNN's plain layout here, of the same size as the panels at 64 x 32: only
    # the bytes tell them apart
    _lib_for(torch.float32)
    w = torch.randn(64, 32)
    packed = _packed(w, rows=1)
    if cpu_linear.proven_layout(packed) != native.LINEAR_PLAIN:
        pytest.skip("oneDNN packs float32 for one row in another layout here")
    x = torch.randn(2, 32)
    assert native.linear(native.load(), x, packed, None, 2, native.LINEAR_PLAIN) is not None  # read natively
    _assert_close(torch.ops.pagedattn.linear(x, packed, None, native.LINEAR_PLAIN), x, w, None)
    set_validation(True)
    with pytest.raises(ValueError, match="does not hold layout"):
        torch.ops.pagedattn.linear(x, packed, None, native.LINEAR_PANELS)


def _graph(weight: torch.Tensor, attr: str = "none"):
    """``x -> mkldnn._linear_pointwise(x, weight, None, attr)`` as Inductor's post-grad graph holds it."""
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    gm.register_buffer("w", weight)
    g = gm.graph
    x = g.placeholder("x")
    out = g.call_function(torch.ops.mkldnn._linear_pointwise.default, (x, g.get_attr("w"), None, attr, [], ""))
    g.output(out)
    gm.recompile()
    return gm


def test_the_pass_swaps_plain_linears_over_proven_weights_only(monkeypatch):
    for dtype in _kernel_dtypes():
        w = torch.randn(96, 64).to(dtype)
        gm = _graph(_packed(w))
        cpu_linear.SmallLinears()(gm.graph)
        assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [_linear_target()]
        gm.recompile()
        x = torch.randn(5, 64).to(dtype)
        _assert_close(gm(x), x, w, None)
    # counter-examples: a fused activation; a weight whose buffer holds another layout
    fused = _graph(_packed(torch.randn(96, 64)), attr="relu")
    cpu_linear.SmallLinears()(fused.graph)
    assert [n.target for n in fused.graph.nodes if n.op == "call_function"] == [
        torch.ops.mkldnn._linear_pointwise.default]
    other = _graph(_packed(torch.randn(96, 64)))
    with monkeypatch.context() as m:
        m.setattr(native, "to_panels", _wrong_panels)
        cpu_linear.SmallLinears()(other.graph)
    assert [n.target for n in other.graph.nodes if n.op == "call_function"] == [
        torch.ops.mkldnn._linear_pointwise.default]
    # a proven layout this machine's kernel does not read (AMX's panels without AMX) keeps oneDNN
    dtype = _kernel_dtype()
    for layout in _panel_layouts(dtype):
        gm = _graph(_packed_as(torch.randn(96, 64).to(dtype), layout))
        monkeypatch.setattr(native, "linear_layouts", lambda lib, dtype, gone=layout: frozenset({0, 1, 2}) - {gone})
        cpu_linear.SmallLinears()(gm.graph)
        assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [
            torch.ops.mkldnn._linear_pointwise.default]


def _mkl_graph(original: torch.Tensor, rows: int):
    """``x -> mkl._mkl_linear(x, packed, original, None, rows)``, Inductor's float32 linear at a static row count."""
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    gm.register_buffer("packed", torch.ops.mkl._mkl_reorder_linear_weight(original, rows))
    gm.register_buffer("original", original)
    g = gm.graph
    x = g.placeholder("x")
    out = g.call_function(torch.ops.mkl._mkl_linear, (x, g.get_attr("packed"), g.get_attr("original"), None, rows))
    g.output(out)
    gm.recompile()
    return gm


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="needs MKL")
def test_the_pass_swaps_mkls_linears_at_few_static_rows_over_their_plain_weight():
    # Inductor keeps a merged weight transposed: the pass makes it contiguous once and drops MKL's packed copy
    _lib_for(torch.float32)
    w = torch.randn(96, 64)
    gm = _mkl_graph(w.t().contiguous().t(), rows=1)
    cpu_linear.SmallLinears()(gm.graph)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [_linear_target()]
    assert not hasattr(gm, "packed") and not hasattr(gm, "original")
    rows = getattr(gm, cpu_linear.plain_rows_name("original"))
    assert rows.is_contiguous() and torch.equal(rows, w) and is_frozen_param(rows)  # cached by name, not by value
    gm.recompile()
    x = torch.randn(1, 64)
    _assert_close(gm(x), x, w, None)
    # counter-example: more static rows than the kernel takes
    many = _mkl_graph(w, rows=cpu_linear.SMALL_ROWS[torch.float32] + 1)
    cpu_linear.SmallLinears()(many.graph)
    assert [n.target for n in many.graph.nodes if n.op == "call_function"] == [torch.ops.mkl._mkl_linear]


def test_plain_rows_missing_from_a_module_are_made_from_the_weights_they_copy():
    # what a step loaded from Inductor's cache reads: the copy the pass would have made, from this module's weight
    w = torch.randn(96, 64)
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    gm.register_buffer("weight", w.t().contiguous().t())
    gm.register_buffer("other", torch.randn(3, 3))
    name = cpu_linear.plain_rows_name("weight")
    cpu_linear.restore_plain_rows(gm, [name, "other", cpu_linear.plain_rows_name("missing"), "_frozen_param7"])
    rows = getattr(gm, name)
    assert rows.is_contiguous() and torch.equal(rows, w) and is_frozen_param(rows)
    # counter-examples: names of other kinds, a copy of a weight the module lacks, one already there
    assert not hasattr(gm, cpu_linear.plain_rows_name("missing")) and not hasattr(gm, "_frozen_param7")
    kept = torch.zeros(96, 64)
    gm.register_buffer(name, kept)
    cpu_linear.restore_plain_rows(gm, [name])
    assert getattr(gm, name) is kept


def test_onednn_rows_are_few_sizes_an_octave_never_fewer_and_at_most_an_eighth_more():
    assert [cpu_linear.onednn_rows(m) for m in (0, 1, 64)] == [0, 1, 64]
    sizes = {cpu_linear.onednn_rows(m) for m in range(257, 513)}
    assert len(sizes) == 8 and max(sizes) == 512
    for m in range(65, 5000):
        p = cpu_linear.onednn_rows(m)
        assert m <= p <= m * 9 / 8 and cpu_linear.onednn_rows(p) == p


def test_many_reduced_precision_rows_go_to_onednn_padded_and_come_back_unpadded(monkeypatch):
    # oneDNN builds a GEMM for every new number of rows: bfloat16 calls reach it in a few sizes, float32 ones as they are
    real, seen = torch.ops.mkldnn._linear_pointwise, []
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: seen.append(tuple(x.shape)) or real(x, *a))
    # oneDNN packs bfloat16 only where torch's own check allows it (passes/fp32_matmuls.py asks the same)
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    for dtype in (torch.bfloat16, torch.float32) if bf16 else (torch.float32,):
        w, b = torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype)
        packed = _packed(w)
        for shape in ((1000, 64), (1, 200, 64)):
            seen.clear()
            x = torch.randn(*shape).to(dtype)
            out = cpu_linear.linear(x, packed, b, native.LINEAR_PANELS)
            rows = x.numel() // 64
            assert seen == [(1024 if rows == 1000 else 208, 64)] if dtype == torch.bfloat16 else [shape]
            assert out.shape == (*shape[:-1], 96) and out.is_contiguous()
            _assert_close(out.reshape(rows, 96), x.reshape(rows, 64), w, b)
