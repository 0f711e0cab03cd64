import pytest
import torch

from pagedattn.backends import AttentionParams, set_validation
from pagedattn.backends.reference import dense_attention

from ..support import TOL, batch_params, make_batch, reference_step, run_step


def _attn_args(b, window=0, softcap=0.0, alibi=None, sinks=None):
    p = batch_params(b, 0.125, True, window, softcap, alibi, sinks)
    return (b.query, b.key, b.value, b.kv_cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc,
            *p.args())


@pytest.mark.parametrize("feature", [{}, {"window": 6}, {"softcap": 4.0}, {"alibi": torch.tensor([0.5, 0.25, 0.125, 0.0625])},
                                     {"sinks": torch.tensor([-1.0, 0.0, 1.0, 2.0])}],
                         ids=["plain", "window", "softcap", "alibi", "sinks"])
def test_opcheck_paged_attention(feature):
    b = make_batch([(0, 6), (9, 1), (20, 4)], num_heads=4, num_kv_heads=2, head_size=16, block_size=4)
    torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    torch.library.opcheck(torch.ops.pagedattn.paged_attention.default, _attn_args(b, **feature))


def test_opcheck_writes():
    b = make_batch([(0, 6), (9, 1)], head_size=16, block_size=4, pad_tokens=2)
    args = (b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    torch.library.opcheck(torch.ops.pagedattn.write_kv_cache.default, args)
    torch.library.opcheck(torch.ops.pagedattn.write_kv_cache_functional.default, args)


def _step(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc):
    torch.ops.pagedattn.write_kv_cache(key, value, kv_cache, slot_mapping)
    p = AttentionParams(0.125, True, 0, 0.0, None, key.shape[1], value.shape[2])
    return torch.ops.pagedattn.paged_attention(query, key, value, kv_cache, block_tables, seq_lens,
                                               query_start_loc, *p.args())


def test_fake_kernels_under_symbolic_shapes():
    # compiled with dynamic shapes, fed batches of different token and sequence counts
    fn = torch.compile(_step, backend="aot_eager", dynamic=True, fullgraph=True)
    for seqs in ([(0, 5), (3, 1)], [(0, 9), (7, 1), (2, 3)], [(11, 1)] * 4):
        b = make_batch(seqs, head_size=16, block_size=4)
        ref_cache = b.kv_cache.clone()
        args = (b.query, b.key, b.value)
        meta = (b.meta.slot_mapping, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc)
        out = fn(*args, b.kv_cache, *meta)
        ref = _step(*args, ref_cache, *meta)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(b.kv_cache, ref_cache)


def test_export_with_dynamic_tokens():
    class Step(torch.nn.Module):
        def forward(self, query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc):
            return _step(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc)

    b = make_batch([(0, 5), (3, 2)], head_size=16, block_size=4)
    args = (b.query, b.key, b.value, b.kv_cache, b.meta.slot_mapping, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc)
    T = torch.export.Dim("tokens", min=2)
    S = torch.export.Dim("seqs")
    shapes = ({0: T}, {0: T}, {0: T}, {1: torch.export.Dim("blocks")}, {0: T},
              {0: S, 1: torch.export.Dim("max_blocks")}, {0: S}, {0: S + 1})
    ep = torch.export.export(Step(), args, dynamic_shapes=shapes)
    b2 = make_batch([(0, 9), (7, 1), (2, 3)], head_size=16, block_size=4)
    args2 = (b2.query, b2.key, b2.value, b2.kv_cache.clone(), b2.meta.slot_mapping, b2.meta.block_tables, b2.meta.seq_lens, b2.meta.query_start_loc)
    torch.testing.assert_close(ep.module()(*args2), _step(*args2[:3], b2.kv_cache, *args2[4:]))


def _dense_operands(head_size_v=12):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g)  # [B, Hq, S, D]
    k = torch.randn(2, 2, 7, 8, generator=g)  # [B, Hkv, L, D]
    v = torch.randn(2, 2, 7, head_size_v, generator=g)
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[1, :3] = 0  # the second row's first keys are left padding
    return q, k, v, padding


@pytest.mark.parametrize("params", [
    AttentionParams(0.3, True, 0, 0.0, None, 2, 12),
    AttentionParams(0.3, True, 3, 2.0, torch.tensor([0.5, 0.25, 0.125, 0.0625]), 2, 12, torch.tensor([0., 1, 2, 3])),
    AttentionParams(0.3, False, 0, 0.0, None, 2, 12),
], ids=["causal", "everything", "bidirectional"])
def test_opcheck_dropin_attention(params):
    # the drop-in op: value head size 12 differs from the key's 8, and key padding from a model input
    q, k, v, padding = _dense_operands()
    args = (q, k, v, padding, *params.args())
    torch.library.opcheck(torch.ops.pagedattn.attention.default, args)
    out = torch.ops.pagedattn.attention.default(*args)
    assert out.shape == (2, 4, 5, 12)
    torch.testing.assert_close(out, dense_attention(q, k, v, params, key_present=padding != 0))


# --- prepared calls: a step's later layers reuse what its first derived, never a stale or unchecked one. Only with
# validation off (the default a user runs with; full validation never prepares)


@pytest.fixture
def hot_path():
    set_validation(False)
    yield
    set_validation(None)


def _decode_batch(**kw):
    return make_batch([(9, 1), (20, 1), (0, 1), (33, 1)], num_heads=4, num_kv_heads=2, head_size=16, block_size=4,
                      **kw)


def _close(out, b, **params):
    expected = reference_step(b, 0.125, **params)
    tol = TOL[b.query.dtype]
    assert torch.allclose(out[:expected.shape[0]].double(), expected, atol=tol, rtol=tol)
    assert torch.all(out[expected.shape[0]:] == 0)  # padding rows


@pytest.mark.parametrize("pad_tokens", [0, 2])
def test_a_decode_steps_layers_reuse_the_prepared_call_and_match_the_reference(hot_path, monkeypatch, pad_tokens):
    from pagedattn.backends import native, sdpa_cpu

    b = _decode_batch(pad_tokens=pad_tokens)
    if pad_tokens:
        b.query[-1] = float("nan")  # a padding row's query never reaches its (zero) output
    prepared = []
    original = sdpa_cpu.SdpaCpuBackend.prepare_attend
    monkeypatch.setattr(sdpa_cpu.SdpaCpuBackend, "prepare_attend",
                        lambda self, *a: prepared.append(original(self, *a)) or prepared[-1])
    for _ in range(3):  # the same metadata, as every layer of a step passes it
        _close(run_step(b, 0.125), b)
    _close(run_step(b, 0.125, window=5), b, window=5)  # other parameters: prepared afresh
    if native.library() is not None:
        assert len(prepared) == 2 and all(prepared)


def test_metadata_changed_in_place_is_never_served_a_stale_prepared_call(hot_path):
    b = _decode_batch()
    _close(run_step(b, 0.125), b)
    # the last sequence now sees one key fewer: the same tensors, updated in place (as a persistent buffer is)
    b.meta.seq_lens[3] -= 1
    b.meta.slot_mapping[3] -= 1
    b.full_k[3], b.full_v[3] = b.full_k[3][:-1].clone(), b.full_v[3][:-1].clone()
    b.full_k[3][-1], b.full_v[3][-1] = b.key[3], b.value[3]
    _close(run_step(b, 0.125), b)


def test_a_prepared_call_still_refuses_what_the_checks_refuse(hot_path):
    b = _decode_batch()
    run_step(b, 0.125)
    args = _attn_args(b)
    with pytest.raises(ValueError, match="dtype"):
        torch.ops.pagedattn.paged_attention(args[0].double(), *args[1:])
    with pytest.raises(ValueError, match="kv heads"):
        torch.ops.pagedattn.paged_attention(*args[:3], b.kv_cache[:, :, :, :1], *args[4:])
    b.meta.seq_lens[1] = 10_000  # the same tensor, changed in place: checked again
    with pytest.raises(ValueError, match="seq_len"):
        torch.ops.pagedattn.paged_attention(*args)
    bad = b.meta.slot_mapping.clone()
    torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, bad)
    bad[0] = 10_000
    with pytest.raises(ValueError, match="slot"):
        torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, bad)


def test_parameters_holding_tensors_are_not_prepared_and_stay_exact(hot_path):
    b = _decode_batch()
    alibi = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    _close(run_step(b, 0.125, alibi=alibi), b, alibi=alibi)
    _close(run_step(b, 0.125, alibi=alibi * 2), b, alibi=alibi * 2)  # other slopes, the same metadata


def test_a_backend_whose_attend_or_write_is_wrapped_is_never_bypassed(hot_path):
    from pagedattn.backends import use_backend
    from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

    calls = []

    class Counting(SdpaCpuBackend):
        def attend(self, *a):
            calls.append("attend")
            return super().attend(*a)

    b = _decode_batch()
    with use_backend(Counting()):
        for _ in range(3):
            _close(run_step(b, 0.125), b)
    assert calls == ["attend"] * 3
    backend = SdpaCpuBackend()
    backend.write = lambda *a: calls.append("write") or SdpaCpuBackend.write(backend, *a)
    with use_backend(backend):
        run_step(b, 0.125)
        run_step(b, 0.125)
    assert calls.count("write") == 2


@pytest.mark.parametrize("given", ["key", "value"])
def test_a_key_without_its_value_is_one_clear_refusal(given):
    # the step's new K/V come together or not at all (it gave an AttributeError deep in the CPU backend)
    b = make_batch([(20, 1), (0, 9)], num_heads=4, num_kv_heads=2)
    m = b.meta
    key, value = (b.key, None) if given == "key" else (None, b.value)
    with pytest.raises(ValueError, match="key and value .* both given or both None"):
        torch.ops.pagedattn.paged_attention(b.query, key, value, b.kv_cache, m.block_tables, m.seq_lens,
                                            m.query_start_loc, *batch_params(b, 0.125).args())
