"""CPU-side tests of the xFormers CUDA backend: metadata -> bias conversion, layouts, cache writes.

The attention itself is checked through an emulated operator that applies each xFormers bias as
xFormers itself materializes it (xformers_emulation.py), against the float64 reference; the GPU
tests (test_xformers_cuda_gpu.py) run the real kernels.
"""

import dataclasses
import logging
import math

import pytest
import torch

pytest.importorskip("xformers", reason="xformers is not installed (pip install 'pagedattn[cuda]')")

from pagedattn.backends import (  # noqa: E402
    AttentionConfig,
    AttentionParams,
    build_metadata,
    get_backend,
    xformers_cuda,  # noqa: E402
)

from ..support import (  # noqa: E402
    ALIBI8,
    BUCKET_BIAS_MOD,
    BUCKET_TABLE,
    SHAPES,
    SINKS8,
    SINKS_WINDOW_MOD,
    TOL,
    batch_params,
    check_copy_and_swap,
    make_batch,
    reference_step,
)
from .xformers_emulation import install  # noqa: E402


@pytest.fixture
def backend():
    return xformers_cuda.XFormersCudaBackend()


def _attend(backend, b, scale, causal=True, window=0, softcap=0.0, alibi=None, pass_kv=True, sinks=None, mod=None):
    backend.write(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    params = batch_params(b, scale, causal, window, softcap, alibi, sinks, mod)
    meta = dataclasses.replace(b.meta, slot_mapping=None)
    return backend.attend(b.query, b.key if pass_kv else None, b.value if pass_kv else None, b.kv_cache, meta, params)


def _check(backend, b, dtype, **kw):
    scale = kw.pop("scale", 1 / math.sqrt(b.query.shape[-1]))
    out = _attend(backend, b, scale, **kw)
    kw.pop("pass_kv", None)
    ref = reference_step(b, scale, **kw)
    n = ref.shape[0]
    torch.testing.assert_close(out[:n].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.all(out[n:] == 0), "padding rows must be zero"
    return out


def _bias_types(op):
    return {type(c["bias"]).__name__ for c in op.calls}


# ------------------------------------------------------------------- bias conversion


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("paged_ok", [True, False], ids=["paged", "gathered"])
def test_shapes_through_emulated_xformers(monkeypatch, backend, shape, dtype, paged_ok):
    refuse = () if paged_ok else ("PagedBlockDiagonalCausalWithOffsetPaddedKeysMask",)
    op = install(monkeypatch, refuse)
    _check(backend, make_batch(SHAPES[shape], dtype=dtype, pad_tokens=3), dtype)
    assert op.calls, "the fused path must have run"


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (8, 4), (16, 2), (8, 1)], ids=["mha", "gqa2", "gqa8", "mqa"])
def test_layouts(monkeypatch, backend, block_size, heads):
    install(monkeypatch)
    nh, nkv = heads
    b = make_batch(SHAPES["mixed"], num_heads=nh, num_kv_heads=nkv, head_size=64, block_size=block_size,
                   dtype=torch.float16)
    _check(backend, b, torch.float16)


@pytest.mark.parametrize(
    "feature",
    [{"window": 8}, {"window": 1}, {"causal": False}, {"scale": 0.3}, {"alibi": True},
     {"alibi": True, "window": 10}, {"alibi": True, "causal": False}, {"softcap": 5.0},
     {"softcap": 3.0, "window": 13}, {"sinks": True}, {"sinks": True, "window": 8},
     {"sinks": True, "alibi": True}],
    ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()),
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_features(monkeypatch, backend, feature, dtype):
    install(monkeypatch)
    feature = dict(feature)
    if feature.pop("alibi", False):
        feature["alibi"] = ALIBI8
    if feature.pop("sinks", False):
        feature["sinks"] = SINKS8
    _check(backend, make_batch(SHAPES["mixed"], num_heads=8, num_kv_heads=2, dtype=dtype), dtype, **feature)


def test_decode_uses_paged_bias_over_the_cache_without_copies(monkeypatch, backend):
    op = install(monkeypatch)
    b = make_batch(SHAPES["all_decode"], num_heads=8, num_kv_heads=2, dtype=torch.float16)
    _check(backend, b, torch.float16)
    (call,) = op.calls
    assert type(call["bias"]).__name__ == "PagedBlockDiagonalPaddedKeysMask"
    k = call["key"]  # [1, num_blocks * block_size, Hkv, G, D], G expanded with stride 0
    assert k.shape[:4] == (1, b.kv_cache.shape[1] * b.kv_cache.shape[2], 2, 4) and k.stride(3) == 0
    assert k.data_ptr() == b.kv_cache[0].data_ptr() and call["value"].data_ptr() == b.kv_cache[1].data_ptr()
    assert torch.equal(call["bias"].block_tables, b.meta.block_tables)


def test_sliding_window_decode_uses_gappy_keys(monkeypatch, backend):
    op = install(monkeypatch)
    _check(backend, make_batch(SHAPES["all_decode"], dtype=torch.float16), torch.float16, window=7)
    assert _bias_types(op) == {"PagedBlockDiagonalCausalWithOffsetGappyKeysMask"}


def test_fresh_prefill_reads_new_keys_with_block_diagonal_masks(monkeypatch, backend):
    op = install(monkeypatch)
    b = make_batch(SHAPES["all_prefill"], num_heads=8, num_kv_heads=2, dtype=torch.float16)
    _check(backend, b, torch.float16)
    assert _bias_types(op) == {"BlockDiagonalCausalMask"}
    assert op.calls[0]["key"].stride(3) == 0  # GQA without copying K/V
    op.calls.clear()
    _check(backend, b, torch.float16, window=5)
    assert _bias_types(op) == {"BlockDiagonalCausalLocalAttentionMask"}


def test_chunked_prefill_paged_or_gathered(monkeypatch, backend):
    op = install(monkeypatch)
    b = make_batch(SHAPES["chunked"], dtype=torch.float16)
    _check(backend, b, torch.float16)
    assert _bias_types(op) == {"PagedBlockDiagonalCausalWithOffsetPaddedKeysMask"}
    op = install(monkeypatch, refuse=("PagedBlockDiagonalCausalWithOffsetPaddedKeysMask",))
    xformers_cuda._LOCAL.plan = None
    _check(backend, b, torch.float16)
    assert _bias_types(op) == {"BlockDiagonalCausalFromBottomRightMask"}
    op.calls.clear()
    _check(backend, b, torch.float16, window=6)  # paged biases have no window: keys in reach are gathered
    assert _bias_types(op) == {"BlockDiagonalCausalLocalAttentionFromBottomRightMask"}
    # only the keys a window reaches are gathered
    assert op.calls[0]["key"].shape[1] <= sum(q + 5 for q in b.q_lens)


def test_cross_attention_over_filled_cache(monkeypatch, backend):
    op = install(monkeypatch)
    b = make_batch([(20, 3), (9, 1), (33, 6)], num_heads=4, num_kv_heads=4, dtype=torch.float16)
    backend.write(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    enc_lens = torch.tensor([c + n for c, n in zip(b.contexts, b.q_lens)], dtype=torch.int32)
    meta = dataclasses.replace(b.meta, slot_mapping=None, seq_lens=enc_lens)
    out = backend.attend(b.query, None, None, b.kv_cache, meta, AttentionParams(0.125, False, 0, 0.0, None, 4, 64))
    ref = reference_step(b, 0.125, causal=False)
    torch.testing.assert_close(out.double(), ref, atol=4e-3, rtol=4e-3)
    assert _bias_types(op) == {"PagedBlockDiagonalPaddedKeysMask"}


def test_alibi_goes_through_a_tensor_bias(monkeypatch, backend):
    op = install(monkeypatch)
    _check(backend, make_batch(SHAPES["mixed"], num_heads=8, num_kv_heads=2, dtype=torch.float16),
           torch.float16, alibi=ALIBI8)
    (call,) = op.calls
    assert isinstance(call["bias"], torch.Tensor) and call["bias"].shape[:3] == (6, 2, 4)


# -------------------------------------------------------------------------- fallbacks


@pytest.mark.parametrize("mod", ["sinks_window", "bucket_bias"])
def test_position_programs_run_as_a_tensor_bias_outside_the_fused_kernels(monkeypatch, backend, mod):
    op = install(monkeypatch)
    program = (SINKS_WINDOW_MOD, None) if mod == "sinks_window" else (BUCKET_BIAS_MOD, BUCKET_TABLE)
    b = make_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, dtype=torch.float16)
    _check(backend, b, torch.float16, causal=False, mod=program)
    assert op.calls and all(isinstance(c["bias"], torch.Tensor) for c in op.calls)
    assert backend.paths[("program", "emulated")] == 1 and not backend.paths[("all", "sdpa")]
    params = batch_params(b, 0.125, causal=False, mod=program)
    assert any("position program" in r for r in backend.fallback_reasons(AttentionConfig(params, 4, 64)))


def test_position_programs_with_a_softcap_run_exactly(monkeypatch, backend):
    op = install(monkeypatch)
    b = make_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, dtype=torch.float16)
    _check(backend, b, torch.float16, causal=False, softcap=5.0, mod=(BUCKET_BIAS_MOD, BUCKET_TABLE))
    assert not op.calls and backend.paths[("all", "softcap_math")] == 1


def test_position_programs_fall_back_exactly_when_no_operator_takes_the_bias(monkeypatch, backend):
    install(monkeypatch, refuse=("Tensor",))
    b = make_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, dtype=torch.float16)
    _check(backend, b, torch.float16, causal=False, mod=(SINKS_WINDOW_MOD, None))
    assert backend.paths[("all", "sdpa")] == 1



def test_float32_and_softcap_never_call_xformers(monkeypatch, backend):
    op = install(monkeypatch)
    _check(backend, make_batch(SHAPES["mixed"]), torch.float32)
    _check(backend, make_batch(SHAPES["mixed"], dtype=torch.bfloat16), torch.bfloat16, softcap=4.0)
    assert not op.calls
    assert backend.paths[("all", "sdpa")] == 1 and backend.paths[("all", "softcap_math")] == 1


def test_without_any_operator_falls_back_exactly_and_says_why(monkeypatch, backend, caplog):
    # the real operator choice on CPU tensors: every xFormers operator refuses (device cpu)
    xformers_cuda._NOTED.clear()
    with caplog.at_level(logging.WARNING, logger="pagedattn.backends.xformers_cuda"):
        _check(backend, make_batch(SHAPES["mixed"], num_heads=8, num_kv_heads=2, dtype=torch.float16),
               torch.float16)
        _check(backend, make_batch(SHAPES["mixed"], num_heads=8, num_kv_heads=2, dtype=torch.float16),
               torch.float16, alibi=ALIBI8)
    text = caplog.text
    assert "no xFormers operator takes it" in text and "device=cpu" in text
    assert "ALiBi attention runs through PyTorch SDPA" in text
    assert backend.paths and all(path == "sdpa" for _, path in backend.paths), backend.paths


def _config(num_heads, num_kv_heads, head_size, dtype, softcap=0.0, alibi=None):
    return AttentionConfig(AttentionParams(0.1, True, 0, softcap, alibi, num_kv_heads, head_size), num_heads,
                           head_size, dtype)


def test_supports_and_fallback_reasons(backend):
    ok = _config(8, 2, 64, torch.float16)
    assert backend.supports(ok) == [] and backend.fallback_reasons(ok) == []
    bad = _config(6, 4, 64, torch.float64)
    assert len(backend.supports(bad)) == 2
    slow = _config(8, 2, 72, torch.float32, softcap=30.0, alibi=ALIBI8)
    reasons = " ".join(backend.fallback_reasons(slow, block_size=8))
    for word in ("float32", "soft-cap", "ALiBi", "head size 72", "block size 8"):
        assert word in reasons


# ----------------------------------------------------------------- plans and caching


def test_one_plan_per_step_rebuilt_when_metadata_changes(monkeypatch, backend):
    op = install(monkeypatch)
    b = make_batch(SHAPES["mixed"], dtype=torch.float16)
    _attend(backend, b, 0.125)
    plan = xformers_cuda._LOCAL.plan
    first = [c["bias"] for c in op.calls]
    _attend(backend, b, 0.125)  # the next layer of the same step: same plan, same bias objects
    assert xformers_cuda._LOCAL.plan is plan
    assert [c["bias"] for c in op.calls[len(first):]] == first
    assert all(x is y for x, y in zip(first, [c["bias"] for c in op.calls[len(first):]]))
    b.meta.seq_lens.add_(0)  # an in-place edit is a new step
    _attend(backend, b, 0.125)
    assert xformers_cuda._LOCAL.plan is not plan


# ----------------------------------------------------------------------- cache upkeep


def test_cache_shape_and_geometry(backend):
    assert backend.kv_cache_shape(10, 16, 8, 128) == (2, 10, 16, 8, 128)
    cache = backend.allocate_kv_cache(3, 4, 2, 8, device="cpu")
    assert backend.cache_geometry(cache) == (3, 4, 2, 8)
    with pytest.raises(ValueError, match="kv_cache must be"):
        backend.cache_geometry(torch.zeros(3, 4, 2, 8))
    with pytest.raises(ValueError, match="contiguous"):
        backend.cache_geometry(torch.zeros(2, 3, 2, 4, 8).transpose(2, 3))


def test_write_matches_cpu_backend_and_skips_padding(backend):
    b = make_batch([(0, 4), (5, 1), (17, 3)], pad_tokens=2, dtype=torch.float16)
    mine = b.kv_cache.clone()
    backend.write(b.key, b.value, mine, b.meta.slot_mapping)
    get_backend("cpu").write(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    assert torch.equal(mine, b.kv_cache)
    before = mine.clone()
    meta = build_metadata([(0, 3, [1])], 16, pad_tokens_to=5)
    backend.write(torch.ones(5, 2, 64, dtype=torch.float16), torch.ones(5, 2, 64, dtype=torch.float16), mine,
                  meta.slot_mapping)
    changed = (mine != before).flatten(3).any(-1)  # [2, blocks, block_size]
    assert int(changed[0].sum()) == 3 and int(changed[1].sum()) == 3


def test_copy_and_swap_blocks(backend):
    check_copy_and_swap(backend)


def test_registered_for_cuda():
    assert get_backend("cuda").name == "xformers_cuda"


# ------------------------------------------------------------------ operator choice


def test_operators_that_need_no_cpp_extension_are_let_through():
    # xFormers refuses every CUDA operator when its C++ extension did not load; flash (through
    # PyTorch's kernel) and triton_splitk never use it, cutlass does
    from xformers.ops.fmha import cutlass, triton_splitk

    reason = xformers_cuda._NO_CPP_REASON

    def refusing(base):
        return type("Refusing", (base,), {"not_supported_reasons": classmethod(lambda cls, inp: [reason, "other"])})

    xf = dataclasses.replace(xformers_cuda._xformers(), cpp_loaded=False)
    assert xformers_cuda._op_reasons(refusing(triton_splitk.FwOp), None, xf) == ["other"]
    assert xformers_cuda._op_reasons(refusing(cutlass.FwOp), None, xf) == [reason, "other"]
    loaded = dataclasses.replace(xf, cpp_loaded=True)
    assert xformers_cuda._op_reasons(refusing(triton_splitk.FwOp), None, loaded) == [reason, "other"]


def test_splitk_operator_tile_divides_the_page():
    from xformers.ops.fmha import triton_splitk

    assert xformers_cuda._splitk_op(64) is triton_splitk.FwOp
    assert xformers_cuda._splitk_op(256) is triton_splitk.FwOp
    for bs, tile in ((16, 16), (32, 32), (48, 16), (96, 32)):
        op = xformers_cuda._splitk_op(bs)
        assert issubclass(op, triton_splitk.FwOp) and op.BLOCK_N == tile and bs % op.BLOCK_N == 0
    assert xformers_cuda._splitk_op(8) is None and xformers_cuda._splitk_op(1) is None
