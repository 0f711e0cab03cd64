"""The XLA backend (torch_xla) on XLA:CPU, against the CPU backend, the reference semantics
(``pagedattn.backends.reference``), an independent float64 computation and Hugging Face generate.

Runs in the XLA environment only (``.ci/xla-tests``); elsewhere every test skips.
"""

import contextlib
import dataclasses
import os

import pytest
import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch_xla = pytest.importorskip(
    "torch_xla", reason="torch_xla is not installed: run the XLA tests with .ci/xla-tests (README 'XLA (torch_xla)')")

import torch_xla.debug.metrics as met  # noqa: E402

import pagedattn  # noqa: E402
from pagedattn.backends import (  # noqa: E402
    AttentionConfig,
    AttentionParams,
    active_backend,
    build_metadata,
    get_backend,
    set_validation,
    use_backend,
)
from pagedattn.backends.pallas_xla import PallasXlaBackend, StepBuckets, bucket, pad_step  # noqa: E402
from pagedattn.xla import to_xla  # noqa: E402

from ..support import BUCKET_BIAS_MOD, BUCKET_TABLE, SINKS_WINDOW_MOD  # noqa: E402
from .xla_helpers import (  # noqa: E402
    cpu_layout,
    cpu_step,
    eos_ids,
    example,
    float64_step,
    hf_greedy,
    make_batch,
    on,
    params_for,
    reference_step,
    serve_greedy,
    tiny_model,
    xla_layout,
)

pytestmark = pytest.mark.xla

DEV = torch_xla.device()
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}

SHAPES = {
    "prefill": [(0, 7), (0, 19), (0, 1)],
    "decode": [(5, 1), (40, 1), (16, 1), (63, 1)],
    "mixed": [(0, 12), (30, 1), (17, 5), (0, 1), (64, 1), (3, 9)],
    "chunked": [(32, 16), (47, 3), (15, 17)],
}


class _Counting(PallasXlaBackend):
    """A backend instance that counts the paged ops it runs: shows which instance ran a step."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.writes = self.attends = 0

    def write(self, *args):
        self.writes += 1
        return super().write(*args)

    def attend(self, *args):
        self.attends += 1
        return super().attend(*args)


def _compiles() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def _xla_step(backend, b, params, head_align=1, via_ops=False):
    """Write the step's K/V and attend on XLA; returns (output, cache) on the CPU.

    ``via_ops``: through ``torch.ops.pagedattn.*`` as a graph after ``to_xla`` calls them (the
    functional write plus a copy back), with ``backend`` bound by ``use_backend`` (``None``: the
    default backend of the device); else the backend's own ``write``/``attend``.
    """
    cache = xla_layout(b.kv_cache, head_align).to(DEV)
    m = b.meta.to(DEV)
    q, k, v = b.query.to(DEV), b.key.to(DEV), b.value.to(DEV)
    p = on(params, DEV)
    if via_ops:
        with use_backend(backend) if backend is not None else contextlib.nullcontext():
            cache.copy_(torch.ops.pagedattn.write_kv_cache_functional(k, v, cache, m.slot_mapping))
            out = torch.ops.pagedattn.paged_attention(q, k, v, cache, m.block_tables, m.seq_lens,
                                                      m.query_start_loc, *p.args())
    else:
        backend.write(k, v, cache, m.slot_mapping)
        out = backend.attend(q, k, v, cache, dataclasses.replace(m, slot_mapping=None), p)
    return out.cpu(), cpu_layout(cache, b.key.shape[2])


def _check(b, backend=None, dtype=torch.float32, head_align=1, via_ops=False, **features):
    """XLA against the CPU ops on the same batch (output, padding rows, written cache), and its real
    rows against ``reference.dense_attention`` and an independent float64 computation."""
    params = params_for(b, **features)
    out, cache = _xla_step(backend, b, params, head_align=head_align, via_ops=via_ops)
    ref = cpu_step(b, params)  # writes b.kv_cache on the CPU
    n = int(b.meta.query_start_loc[-1])
    tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(out[:n], reference_step(b, params), **tol)
    torch.testing.assert_close(out[:n].double(), float64_step(b, params), **tol)
    assert torch.all(out[n:] == 0), "padding rows must be zero"
    assert torch.equal(cache, b.kv_cache), "the XLA cache must hold what the CPU backend wrote"


def _features(feature: dict, num_heads: int) -> dict:
    """A parametrised feature set with ``alibi=True`` / ``sinks=True`` made tensors."""
    feature = dict(feature)
    if feature.pop("alibi", False):
        feature["alibi"] = torch.tensor([2 ** (-8 * (h + 1) / num_heads) for h in range(num_heads)])
    if feature.pop("sinks", False):
        feature["sinks"] = torch.linspace(-2.0, 4.0, num_heads)
    return feature


FEATURES = [{"window": 8}, {"window": 1}, {"softcap": 5.0}, {"softcap": 3.0, "window": 13}, {"scale": 0.3},
            {"alibi": True}, {"alibi": True, "window": 10}, {"causal": False}, {"sinks": True},
            {"sinks": True, "window": 8}]


def _ids(f):
    return "-".join(f"{k}={v}" for k, v in f.items())


# ---------------------------------------------------------------- layout and ops


def test_registry_gives_the_xla_backend():
    backend = get_backend("xla")
    assert isinstance(backend, PallasXlaBackend) and backend.mode == "static"  # XLA:CPU has no TPU
    assert get_backend(DEV) is backend
    assert active_backend(DEV) is backend  # nothing bound: the device's default


def test_one_default_kernel_serves_xla():
    # no per-device kernels: each op's Python body is its CompositeExplicitAutograd kernel, which the
    # dispatcher computes for the XLA key too (the calls on XLA tensors below run it)
    for op in ("write_kv_cache", "write_kv_cache_functional", "paged_attention", "attention"):
        name = f"pagedattn::{op}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "XLA")
        assert torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, "XLA")
    # the drop-in op on XLA tensors: the reference semantics, computed on the device
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[0, :2] = 0
    p = AttentionParams(0.3, True, 4, 0.0, None, 2, 8)
    out = torch.ops.pagedattn.attention(q.to(DEV), k.to(DEV), v.to(DEV), padding.to(DEV), *p.args())
    assert out.device.type == "xla"
    torch.testing.assert_close(out.cpu(), torch.ops.pagedattn.attention(q, k, v, padding, *p.args()),
                               atol=1e-5, rtol=1e-5)


def test_cache_shape():
    assert PallasXlaBackend("static").kv_cache_shape(10, 16, 8, 64) == (10, 16, 16, 64)
    assert PallasXlaBackend("kernel").kv_cache_shape(10, 16, 8, 64) == (10, 16, 16, 128)  # lanes of 128
    assert PallasXlaBackend("kernel").kv_cache_shape(10, 16, 8, 256) == (10, 16, 16, 256)
    cache = PallasXlaBackend("static", head_align=128).allocate_kv_cache(3, 4, 2, 80, torch.bfloat16)
    assert cache.device.type == "xla" and cache.shape == (3, 4, 4, 128) and cache.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_batches_through_the_ops(shape):
    # the ops' one default kernel (CompositeExplicitAutograd) on XLA tensors, nothing bound: the
    # registered default backend (static on XLA:CPU); GQA 8/2, padding tokens
    b = make_batch(SHAPES[shape], num_heads=8, num_kv_heads=2, pad_tokens=3)
    _check(b, via_ops=True)


@pytest.mark.parametrize("feature", FEATURES, ids=_ids)
def test_features_through_the_ops(feature):
    # every feature of the static mode through the ops on XLA, as a rewritten graph runs them
    b = make_batch(SHAPES["mixed"], num_heads=8, num_kv_heads=2, head_size=32, block_size=8, pad_tokens=2)
    _check(b, via_ops=True, **_features(feature, 8))


def test_ops_use_the_bound_backend():
    # use_backend(instance) reaches the ops' kernel on XLA: a ragged-reference backend bound, with a
    # head size padded to 128 as the kernel wants, computes the step...
    b = make_batch([(0, 6), (21, 1), (9, 4)], num_heads=4, num_kv_heads=2, head_size=32, block_size=8, pad_tokens=2)
    bound = _Counting("reference", head_align=128)
    _check(b, bound, head_align=128, via_ops=True, window=7)
    assert bound.writes == bound.attends == 1
    # ... and refuses what only the default (static) backend computes: the bound instance ran
    b = make_batch([(0, 3)], num_heads=2, num_kv_heads=2, head_size=16, block_size=4)
    alibi = params_for(b, alibi=torch.tensor([0.5, 0.25]))
    with pytest.raises(ValueError, match="neither ALiBi nor non-causal"):
        _xla_step(PallasXlaBackend("reference"), b, alibi, via_ops=True)
    _xla_step(None, b, alibi, via_ops=True)  # the default computes it
    # a backend bound for another device type does not capture XLA tensors
    cpu = get_backend("cpu")
    with use_backend(cpu):
        assert active_backend(DEV) is get_backend("xla") and active_backend(torch.device("cpu")) is cpu
    with use_backend(bound):
        assert active_backend(DEV) is bound and active_backend(torch.device("cpu")) is cpu


@pytest.mark.parametrize("heads", [(4, 4), (8, 1), (16, 2)], ids=["mha", "mqa", "gqa8"])
def test_head_layouts(heads):
    b = make_batch(SHAPES["mixed"], num_heads=heads[0], num_kv_heads=heads[1], head_size=32, block_size=4)
    _check(b, PallasXlaBackend("static"))


@pytest.mark.parametrize("feature", FEATURES, ids=_ids)
def test_features_static(feature):
    b = make_batch(SHAPES["mixed"], num_heads=8, num_kv_heads=2, pad_tokens=2)
    _check(b, PallasXlaBackend("static"), **_features(feature, 8))


@pytest.mark.parametrize("mod", ["sinks_window", "bucket_bias"])
def test_position_programs_static(mod):
    # a mask and a per-head bias over positions, evaluated on the XLA device for the padded step's positions
    b = make_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, pad_tokens=2)
    program = (SINKS_WINDOW_MOD, None) if mod == "sinks_window" else (BUCKET_BIAS_MOD, BUCKET_TABLE)
    params = params_for(b, causal=False, mod=program)
    out, _ = _xla_step(PallasXlaBackend("static"), b, params)
    n = int(b.meta.query_start_loc[-1])
    torch.testing.assert_close(out[:n], reference_step(b, params), atol=TOL[torch.float32], rtol=TOL[torch.float32])
    torch.testing.assert_close(out, cpu_step(b, params), atol=TOL[torch.float32], rtol=TOL[torch.float32])
    assert any("position program" in r for r in PallasXlaBackend("reference").supports(AttentionConfig(params, 4, 64)))


@pytest.mark.parametrize("kind", ["runs", "scalar"])
def test_position_programs_over_per_request_values_static(kind):
    # a prefix-LM's spans (token types) and a prefix length with a bias, per sequence of the step
    from ..support import PREFIX_LEN_MOD, prefix_lm_mod, span_values

    seqs = SHAPES["mixed"]
    b = make_batch(seqs, num_heads=4, num_kv_heads=2, pad_tokens=2)
    if kind == "runs":
        program = (prefix_lm_mod(2), None, span_values(2, [[(1, max(2, (c + n) // 2))] for c, n in seqs]))
    else:
        program = (PREFIX_LEN_MOD, None, torch.tensor([[(c + n) // 2] for c, n in seqs]))
    params = params_for(b, causal=False, mod=program)
    out, _ = _xla_step(PallasXlaBackend("static"), b, params)
    n = int(b.meta.query_start_loc[-1])
    torch.testing.assert_close(out[:n], reference_step(b, params), atol=TOL[torch.float32], rtol=TOL[torch.float32])
    torch.testing.assert_close(out, cpu_step(b, params), atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_bfloat16_with_padded_heads():
    b = make_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, head_size=48, dtype=torch.bfloat16)
    _check(b, PallasXlaBackend("static", head_align=128), dtype=torch.bfloat16, head_align=128, window=9, softcap=4.0)


@pytest.mark.parametrize("feature", [{"window": 7, "softcap": 5.0}, {"scale": 0.3}, {}], ids=_ids)
def test_ragged_paged_attention_reference_path(feature):
    # torch.ops.xla.ragged_paged_attention(use_kernel=False): prefill, decode and chunked prefill in
    # one call, GQA, sliding window, soft-cap, head size padded as the kernel needs, padding tokens
    b = make_batch([(0, 6), (21, 1), (9, 4)], num_heads=4, num_kv_heads=2, head_size=32, block_size=8, pad_tokens=2)
    _check(b, PallasXlaBackend("reference", head_align=128), head_align=128, **feature)


def test_static_and_ragged_reference_agree():
    # the two XLA:CPU modes on one padded step (the batch and features of the reference-path test, so
    # the ragged path's per-length graphs are compiled already): the same rows, zeros after them
    b = make_batch([(0, 6), (21, 1), (9, 4)], num_heads=4, num_kv_heads=2, head_size=32, block_size=8, pad_tokens=2)
    p = params_for(b, window=7, softcap=5.0)
    static, cache_s = _xla_step(PallasXlaBackend("static"), b, p)
    ragged, cache_r = _xla_step(PallasXlaBackend("reference", head_align=128), b, p, head_align=128)
    torch.testing.assert_close(static, ragged, atol=2e-5, rtol=2e-5)
    assert torch.all(static[int(b.meta.query_start_loc[-1]):] == 0)
    assert torch.equal(cache_s, cache_r)


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


def test_static_path_ignores_padded_sequences():
    b = make_batch([(0, 3), (5, 1)], num_heads=2, num_kv_heads=1, head_size=16, block_size=4, pad_tokens=1)
    _check(_pad(b, StepBuckets((8,), (4,), (4,))), PallasXlaBackend("static"), sinks=torch.tensor([0.5, -1.0]))


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


def _config(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float32, **over):
    params = dict(scale=0.1, causal=True, sliding_window=0, softcap=0.0, alibi_slopes=None,
                  num_kv_heads=num_kv_heads, head_size_v=head_size, sinks=None)
    params.update(over)
    return AttentionConfig(AttentionParams(**params), num_heads, head_size, dtype)


def test_supports_gives_reasons():
    ok = _config(sliding_window=32, softcap=30.0)
    alibi = _config(alibi_slopes=torch.ones(8))
    bidir = _config(causal=False)
    sinks = _config(sinks=torch.zeros(8))
    bad = _config(num_heads=6, num_kv_heads=4, dtype=torch.float64, head_size_v=32)
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
    for features in ({"alibi": torch.tensor([0.5, 0.25])}, {"causal": False}, {"sinks": torch.tensor([0.0, 1.0])}):
        with pytest.raises(ValueError, match="neither ALiBi nor non-causal"):
            _xla_step(PallasXlaBackend("reference"), b, params_for(b, scale=0.25, **features))


def test_mismatched_cache_is_named():
    backend = PallasXlaBackend("static")
    with pytest.raises(ValueError, match="K and V interleaved"):
        backend.cache_geometry(torch.zeros(2, 4, 4, 3, 8))
    b = make_batch([(0, 3)], num_heads=2, num_kv_heads=2, head_size=16, block_size=4)
    padded = PallasXlaBackend("static", head_align=128)  # expects head size 128 in the cache, which holds 16
    with pytest.raises(ValueError, match="write_kv_cache: head size 16"):  # validation is on in the tests
        _xla_step(padded, b, params_for(b, scale=0.25), head_align=1, via_ops=True)
    cache, m = xla_layout(b.kv_cache).to(DEV), b.meta.to(DEV)
    with pytest.raises(ValueError, match="paged_attention: head size 16"):
        padded.check_attend(b.query.to(DEV), cache, m, params_for(b))


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
    assert p.block_size == meta.block_size


def test_padded_step_gives_the_same_rows():
    b = make_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, head_size=16, block_size=8)
    backend = PallasXlaBackend("static")
    p = params_for(b, scale=0.25, window=11)
    out, _ = _xla_step(backend, b, p)
    padded, _ = _xla_step(backend, _pad(b, StepBuckets((64,), (8,), (16,))), p)
    torch.testing.assert_close(padded[:out.shape[0]], out)
    assert torch.all(padded[out.shape[0]:] == 0)


# ------------------------------------------------------------- a model on XLA


@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama")
    # rewritten on the CPU (the target picks the backend: its supports() and the paged graph's), then moved
    return model, to_xla(pagedattn.rewrite(model, (), example(model), target="xla"))


def test_to_xla_makes_cache_writes_functional(llama):
    _, rewritten = llama
    targets = [n.target for n in rewritten.graph_module.graph.nodes if n.op == "call_function"]
    assert torch.ops.pagedattn.write_kv_cache.default not in targets
    writes = targets.count(torch.ops.pagedattn.write_kv_cache_functional.default)
    assert writes == rewritten.num_sites == targets.count(torch.ops.pagedattn.paged_attention.default)
    assert isinstance(rewritten.backend, PallasXlaBackend)
    assert all(p.device.type == "xla" for p in rewritten.parameters())


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
                               num_blocks=32, device=DEV, eos=eos_ids(model))
    first = _compiles() - before
    assert out == hf_greedy(model, prompts, new)
    # one graph per distinct step shape (plus at most the cache allocation), not one per step
    assert len(set(shapes)) < len(shapes)
    assert len(set(shapes)) <= first <= len(set(shapes)) + 1
    # other prompts, lengths and contexts: only step shapes not seen before compile
    prompts2 = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 12, 3, 25)]
    before = _compiles()
    out2, shapes2 = serve_greedy(rewritten, prompts2, new, arrivals=arrivals, buckets=buckets,
                                 num_blocks=32, device=DEV, eos=eos_ids(model))
    assert _compiles() - before == len(set(shapes2) - set(shapes))
    assert out2 == hf_greedy(model, prompts2, new)
    print(f"\ncompilations: run 1 {first} for {len(shapes)} steps / {len(set(shapes))} shapes; "
          f"run 2 {_compiles() - before} for {len(shapes2)} steps / {len(set(shapes2) - set(shapes))} new shapes")


def test_serving_loop_with_a_bound_backend_instance(llama):
    # the same program run by another backend instance (paged_context(..., backend=)): the ragged
    # reference mode; the tokens of Hugging Face generate again, and the bound instance ran every op
    model, rewritten = llama
    set_validation(False)
    ragged = _Counting("reference")
    prompts, new = [[5, 9, 3, 1, 7], [2, 8, 6]], [4, 4]
    out, shapes = serve_greedy(rewritten, prompts, new, arrivals=[0, 1], buckets=StepBuckets.up_to(16, 2, 2),
                               num_blocks=8, device=DEV, eos=eos_ids(model), backend=ragged)
    assert out == hf_greedy(model, prompts, new)
    assert ragged.writes == ragged.attends == len(shapes) * rewritten.num_sites


def test_sliding_window_model_matches_hf_generate():
    model = tiny_model("mistral")  # sliding window 6: decodes past it read only the window
    rewritten = to_xla(pagedattn.rewrite(model, (), example(model), target="xla", block_size=4))
    assert all(r["status"] == "rewritten" for r in rewritten.report)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 4)]
    new = [5, 5]
    out, _ = serve_greedy(rewritten, prompts, new, arrivals=[0, 0], buckets=StepBuckets.up_to(16, 2, 4),
                          num_blocks=12, device=DEV, eos=eos_ids(model))
    assert out == hf_greedy(model, prompts, new)


def test_paged_engine_on_xla(llama):
    # the engine pads every step to the backend's buckets and syncs once a step: a bounded number of
    # graphs, and the tokens of Hugging Face generate
    from pagedattn import PagedEngine

    model, rewritten = llama
    set_validation(False)  # validation reads metadata on the host: extra graphs
    prompts = [[5, 9, 3, 1], [7, 2], [4, 4, 8, 1, 9, 2, 6]]
    engine = PagedEngine(rewritten, target="xla", num_blocks=8, max_num_tokens=16, max_num_seqs=4)
    before = _compiles()
    assert engine.generate(prompts, 4) == hf_greedy(model, prompts, [4, 4, 4])
    first = _compiles() - before
    print("engine on XLA: steps", engine.stats["steps"], "compilations", first)
    assert first <= engine.stats["steps"]
    before = _compiles()
    assert engine.generate([[3, 1, 4], [1, 5]], 3) == hf_greedy(model, [[3, 1, 4], [1, 5]], [3, 3])
    assert _compiles() - before <= 2, "step shapes seen before must not compile again"


def test_paged_engine_rewrites_a_model_on_the_xla_device_itself():
    # a plain model moved to XLA and handed to the engine: the rewrite for the XLA backend makes the
    # cache writes functional itself (eager torch_xla rejects the in-place write)
    from pagedattn import PagedEngine

    set_validation(False)
    model = tiny_model("llama")
    engine = PagedEngine(tiny_model("llama").to(DEV), target="xla", num_blocks=8, max_num_tokens=16, max_num_seqs=4)
    assert not any(n.target is torch.ops.pagedattn.write_kv_cache.default
                   for n in engine.model.graph_module.graph.nodes)
    prompts = [[5, 9, 3, 1], [7, 2]]
    assert engine.generate(prompts, 3) == hf_greedy(model, prompts, [3, 3])


def test_paged_engine_takes_a_backend_instance(llama):
    # target=<instance>: the engine allocates and runs with that instance (a static one whose cache pads
    # the head size to 128), not the registered default; the default stays as it was
    from pagedattn import PagedEngine

    model, rewritten = llama
    set_validation(False)
    default = get_backend("xla")
    padded = _Counting("static", head_align=128)
    engine = PagedEngine(rewritten, target=padded, num_blocks=8, max_num_tokens=16, max_num_seqs=4)
    assert engine.backend is padded
    assert all(c.shape[-1] == 128 for c in engine.kv_caches)
    prompts = [[5, 9, 3, 1], [7, 2]]
    assert engine.generate(prompts, 3) == hf_greedy(model, prompts, [3, 3])
    assert padded.attends >= engine.stats["steps"] * rewritten.num_sites
    assert get_backend("xla") is default and default.mode == "static" and default.head_align == 1


def test_openxla_compiles_the_paged_graph_once_per_shape():
    # the rewritten graph handed to torch_xla's compiler (torch.compile(backend="openxla")); the
    # in-place cache writes go through AOT functionalization there, and the ops' default kernel
    # is what openxla traces on XLA tensors
    set_validation(False)
    model = tiny_model("llama")
    rewritten = to_xla(pagedattn.rewrite(model, (), example(model), target="xla"), openxla=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (6, 19, 11)]
    new, arrivals = [5, 3, 4], [0, 0, 1]
    buckets = StepBuckets.up_to(max_num_tokens=32, max_num_seqs=4, max_blocks_per_seq=2)
    kw = dict(arrivals=arrivals, buckets=buckets, num_blocks=16, device=DEV, eos=eos_ids(model))
    before = _compiles()
    out, shapes = serve_greedy(rewritten, prompts, new, **kw)
    first = _compiles() - before
    assert out == hf_greedy(model, prompts, new)
    before = _compiles()
    prompts2 = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 5, 2)]  # one block each
    out2, shapes2 = serve_greedy(rewritten, prompts2, new, **kw)
    assert out2 == hf_greedy(model, prompts2, new)
    new_shapes = set(shapes2) - set(shapes)
    # Dynamo guards on shapes: a seen step shape reuses its graph (openxla also compiles the
    # sampling step apart, hence up to two XLA graphs per new shape)
    assert new_shapes and _compiles() - before <= 2 * len(new_shapes)
    assert first <= 2 * len(set(shapes)) + 1
    print(f"\nopenxla: run 1 {first} compilations for {len(shapes)} steps / {len(set(shapes))} shapes; "
          f"run 2 {_compiles() - before} for {len(shapes2)} steps / {len(new_shapes)} new shapes")
    # another backend instance bound (paged_context(..., backend=)) on a step shape compiled already:
    # its own graph, traced through that instance, not the graph the default backend was built into
    counting = _Counting("static")
    out3, shapes3 = serve_greedy(rewritten, prompts2[:2], [2, 2], backend=counting, **{**kw, "arrivals": [0, 0]})
    assert out3 == hf_greedy(model, prompts2[:2], [2, 2])
    assert set(shapes3) <= set(shapes) | set(shapes2) and counting.attends >= rewritten.num_sites


def test_torch_compile_backend_on_xla_hands_the_graphs_to_openxla():
    # torch.compile(model on XLA, backend="pagedattn", options={"target": "xla"}): rewritten on the
    # XLA device, inner compiler openxla; drop-in mode outside a context, paged mode inside one
    from pagedattn.compile import compiled_graphs, resolve_options
    from pagedattn.runtime.context import paged_context

    assert resolve_options({"target": "xla"})["inner"] == "openxla"
    assert resolve_options({"target": "xla", "inner": "eager"})["inner"] == "eager"
    assert resolve_options(None)["inner"] == "inductor"
    model = tiny_model("llama")
    cpu = pagedattn.rewrite(model, (), example(model), target="cpu")
    compiled = torch.compile(tiny_model("llama").to(DEV), backend="pagedattn", options={"target": "xla"})
    ids, pos = torch.randint(0, 128, (1, 12)), torch.tensor([list(range(7)) + list(range(5))])
    before = met.counter_value("CachedCompile") or 0
    with torch.no_grad():
        with compiled_graphs() as graphs:
            dense = compiled(input_ids=ids[:, :7].to(DEV)).logits.cpu()
        torch.testing.assert_close(dense, model(input_ids=ids[:, :7]).logits, atol=1e-5, rtol=1e-5)
        specs = [s for g in graphs for s in g.cache_specs]
        assert [g.inner for g in graphs] == ["openxla"] * len(graphs)
        assert all(isinstance(g.backend, PallasXlaBackend) for g in graphs)
        assert [(s.num_kv_heads, s.head_size, s.dtype) for s in specs] == \
            [(s.num_kv_heads, s.head_size, s.dtype) for s in cpu.cache_specs]

        def kw(d):
            return dict(input_ids=ids.to(d), position_ids=pos.to(d), use_cache=False,
                        logits_to_keep=torch.tensor([6, 11], device=d))

        meta = build_metadata([(0, 7, [0]), (0, 5, [1])], cpu.block_size)
        caches = cpu.allocate_kv_caches(4, device="cpu")
        with paged_context(caches, meta):
            ref = cpu(**kw("cpu")).logits
        backend = get_backend("xla")
        xcaches = [backend.allocate_kv_cache(4, cpu.block_size, s.num_kv_heads, s.head_size, s.dtype)
                   for s in specs]
        with paged_context(xcaches, meta.to(DEV)):
            out = compiled(**kw(DEV)).logits.cpu()
            out_again = compiled(**kw(DEV)).logits.cpu()  # same shapes: the compiled graph again
        counting = _Counting("static")  # another instance bound: compiled again for it, and run by it
        with paged_context([c.clone() for c in xcaches], meta.to(DEV), backend=counting):
            out_bound = compiled(**kw(DEV)).logits.cpu()
        assert counting.attends >= len(specs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_again, ref, atol=1e-5, rtol=1e-5)  # the same tokens written again: same cache
    torch.testing.assert_close(out_bound, ref, atol=1e-5, rtol=1e-5)
    for c, x in zip(caches, xcaches):
        torch.testing.assert_close(cpu_layout(x, c.shape[-1]), c, atol=1e-6, rtol=1e-6)
    assert (met.counter_value("CachedCompile") or 0) > before  # the second paged call reused a graph


# ---------------------------------------------------------------- chunked local attention
# A query at position q sees a key at k iff k <= q and q // C == k // C: the static mode computes it
# through the reference; ragged_paged_attention has no chunk parameter and refuses it.


def _chunked(b, chunk, **features) -> AttentionParams:
    return dataclasses.replace(params_for(b, **features), chunk_size=chunk)


def _check_chunked(b, params: AttentionParams, backend=None, dtype=torch.float32, via_ops=False):
    """XLA against the CPU ops, the reference and the float64 loop-free check, as ``_check`` does."""
    out, cache = _xla_step(backend, b, params, via_ops=via_ops)
    ref = cpu_step(b, params)
    n = int(b.meta.query_start_loc[-1])
    tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(out[:n], reference_step(b, params), **tol)
    torch.testing.assert_close(out[:n].double(), float64_step(b, params), **tol)
    assert torch.all(out[n:] == 0), "padding rows must be zero"
    assert torch.equal(cache, b.kv_cache)


@pytest.mark.parametrize("chunk", [5, 16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_chunked_through_the_ops(shape, chunk):
    # chunks smaller than, not dividing, and equal to the 16-token blocks; GQA, padding tokens
    b = make_batch(SHAPES[shape], num_heads=8, num_kv_heads=2, pad_tokens=3)
    _check_chunked(b, _chunked(b, chunk), via_ops=True)


@pytest.mark.parametrize("feature", [{"window": 4}, {"alibi": True}, {"sinks": True}, {"softcap": 4.0},
                                     {"sinks": True, "window": 9}], ids=_ids)
def test_chunked_features_static(feature):
    b = make_batch(SHAPES["mixed"] + SHAPES["chunked"], num_heads=8, num_kv_heads=2, block_size=8,
                   pad_tokens=2)
    _check_chunked(b, _chunked(b, 12, **_features(feature, 8)), PallasXlaBackend("static"))


def test_chunked_bfloat16_static():
    b = make_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    _check_chunked(b, _chunked(b, 7), PallasXlaBackend("static"), dtype=torch.bfloat16)


def test_chunked_refused_by_ragged_paged_attention():
    chunked = _config(chunk_size=8)
    for mode in ("kernel", "reference"):
        reasons = PallasXlaBackend(mode).supports(chunked)
        assert any("chunked local attention" in r and "PallasXlaBackend(mode='static')" in r for r in reasons)
    assert PallasXlaBackend("static").supports(chunked) == []
    b = make_batch([(0, 3)], num_heads=2, num_kv_heads=2, head_size=16, block_size=4)
    with pytest.raises(ValueError, match="chunked local attention"):
        _xla_step(PallasXlaBackend("reference"), b, _chunked(b, 2, scale=0.25))
