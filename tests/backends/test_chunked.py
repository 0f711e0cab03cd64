"""Chunked local attention (Llama 4's ``attention_chunk_size``) on every backend path testable on a CPU.

A query at position ``q`` sees a key at position ``k`` iff ``k <= q and q // C == k // C`` (and, with a
sliding window too, ``q - k < w``). The reference (``backends/reference.py``) is checked against plain
loops over ``(q, k)`` written here; everything else against the reference in float64: the CPU ops (the
per-sequence path and flash-decoding), the xFormers backend through its emulated operator, and the
drop-in op with its gradients. ONNX: tests/rewriter/test_onnx_chunked.py; XLA: test_pallas_xla.py.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from pagedattn.backends import AttentionConfig, AttentionParams, get_backend, reference, sdpa_cpu
from pagedattn.backends.params import params_schema

from ..support import SHAPES, TOL, feature_id, feature_kwargs, make_batch, record_decode_masks

# ------------------------------------------------------------------------------ helpers


def _params(b, chunk, *, scale=None, causal=True, window=0, softcap=0.0, alibi=None,
            sinks=None) -> AttentionParams:
    """A site over batch ``b`` with chunks of ``chunk`` positions (scale ``1/sqrt(D)`` unless given)."""
    d = b.query.shape[-1]
    return AttentionParams(1 / math.sqrt(d) if scale is None else scale, causal, window, softcap, alibi,
                           b.key.shape[1], b.value.shape[2], sinks, chunk)


def _run(b, p: AttentionParams, pass_kv=True) -> torch.Tensor:
    """Write the step's K/V and attend through the ops (the CPU backend for CPU tensors)."""
    m = b.meta
    torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, m.slot_mapping)
    key, value = (b.key, b.value) if pass_kv else (None, None)
    return torch.ops.pagedattn.paged_attention(b.query, key, value, b.kv_cache, m.block_tables, m.seq_lens,
                                               m.query_start_loc, *p.args())


def _expected(b, p: AttentionParams) -> torch.Tensor:
    """``[real tokens, Hq, Dv]`` in float64: each sequence's new queries over its whole K/V, by the
    reference."""
    p = dataclasses.replace(p, alibi_slopes=None if p.alibi_slopes is None else p.alibi_slopes.double(),
                            sinks=None if p.sinks is None else p.sinks.double())
    outs, row = [], 0
    for n, k, v in zip(b.q_lens, b.full_k, b.full_v):
        q = b.query[row:row + n].double().transpose(0, 1)[None]  # [1, Hq, n, D]: the last n positions
        k, v = k.double().transpose(0, 1)[None], v.double().transpose(0, 1)[None]  # [1, Hkv, L, D]
        o = reference.dense_attention(q, k, v, p, exact=True)
        outs.append(o[0].transpose(0, 1))
        row += n
    return torch.cat(outs)


def _check(b, p: AttentionParams, dtype, out=None) -> torch.Tensor:
    """The step's output (through the CPU ops unless given) against the reference; padding rows zero."""
    out = _run(b, p) if out is None else out
    ref = _expected(b, p)
    n = ref.shape[0]
    torch.testing.assert_close(out[:n].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.all(out[n:] == 0), "padding rows must be zero"
    return out


def _poison_out_of_reach(b, p: AttentionParams) -> None:
    """NaN into every cached block wholly before the first key a sequence's first new query can see: a
    path that reads such a block (even masked) gives NaN. Block 0 is spared: block tables are padded
    with it, and padded gathers read it as filler whose keys never exist."""
    bs = b.kv_cache.shape[2]
    for i, ctx in enumerate(b.contexts):
        blocks = b.meta.block_tables[i, :reference.earliest_visible_key(ctx, p) // bs].long()
        b.kv_cache[:, blocks[blocks != 0]] = float("nan")


FEW_FEATURES = [{}, {"window": 9}, {"alibi": True}, {"sinks": True}, {"softcap": 4.0}]
FEATURES = [{}, {"window": 5}, {"window": 40}, {"alibi": True}, {"sinks": True}, {"softcap": 4.0},
            {"alibi": True, "window": 9}, {"sinks": True, "window": 6}, {"softcap": 3.0, "window": 7},
            {"scale": 0.3}]

# ------------------------------------------------------------------------------ the reference


def _sees(q: int, k: int, causal: bool, window: int, chunk: int) -> bool:
    """The semantics, written plainly: causal, within the window, in the query's own chunk."""
    if not causal:
        return True
    if k > q:
        return False
    if window > 0 and q - k >= window:
        return False
    if chunk > 0 and q // chunk != k // chunk:
        return False
    return True


def _loop_attention(q, k, v, p: AttentionParams, q_pos: list[int], k_pos: list[int]) -> torch.Tensor:
    """``[Hq, Q, Dv]`` by a loop over every (head, query, key): score, cap, bias, visibility, softmax with the
    sink as one more logit, weighted sum. ``q [Hq, Q, D]``, ``k`` / ``v [Hkv, L, D]``, float64."""
    hq, hkv = q.shape[0], k.shape[0]
    out = torch.zeros(hq, q.shape[1], v.shape[2], dtype=torch.float64)
    for h in range(hq):
        kh = h // (hq // hkv)
        for i, qi in enumerate(q_pos):
            logits, values = [], []
            for j, kj in enumerate(k_pos):
                if not _sees(qi, kj, p.causal, p.sliding_window, p.chunk_size):
                    continue
                s = p.scale * float(q[h, i] @ k[kh, j])
                if p.softcap > 0:
                    s = p.softcap * math.tanh(s / p.softcap)
                if p.alibi_slopes is not None:
                    s += float(p.alibi_slopes[h]) * (kj - qi)
                logits.append(s)
                values.append(v[kh, j])
            sink = [] if p.sinks is None else [float(p.sinks.detach()[h])]
            if not logits:
                continue  # a query that sees nothing gives zeros
            m = max(logits + sink)
            weights = [math.exp(s - m) for s in logits]
            total = sum(weights) + sum(math.exp(s - m) for s in sink)
            out[h, i] = sum(w * x for w, x in zip(weights, values)) / total
    return out


@pytest.mark.parametrize("window", [0, 1, 5])
@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 7, 16])
def test_visibility_matches_a_plain_loop(chunk, window):
    p = AttentionParams(1.0, True, window, 0.0, None, 1, 8, None, chunk)
    pos = torch.arange(41)
    vis = reference.visible(pos, pos, p)  # [Q, L]
    for q in range(41):
        seen = [k for k in range(41) if _sees(q, k, True, window, chunk)]
        assert vis[q].nonzero().flatten().tolist() == seen
        # one run of keys ending at the query, starting at earliest_visible_key (int and tensor forms)
        assert seen == list(range(seen[0], q + 1))
        assert reference.earliest_visible_key(q, p) == seen[0]
    firsts = [reference.earliest_visible_key(q, p) for q in range(41)]
    assert reference.earliest_visible_key(pos, p).tolist() == firsts


@pytest.mark.parametrize("chunk", [0, 1, 3, 8])
@pytest.mark.parametrize("span", [(0, 20), (5, 6), (7, 8), (8, 17), (13, 40), (4, 4)])
def test_chunk_runs_cut_where_chunks_begin(chunk, span):
    p = AttentionParams(1.0, True, 0, 0.0, None, 1, 8, None, chunk)
    runs = reference.chunk_runs(*span, p)
    positions = [q for a, b in runs for q in range(a, b)]
    assert positions == list(range(*span))  # every query once, in order
    for a, b in runs:
        assert b > a
        if chunk:
            assert len({q // chunk for q in range(a, b)}) == 1  # within one chunk
    if chunk:  # and cut at every chunk start, nowhere else
        assert [a for a, _ in runs[1:]] == [q for q in range(span[0] + 1, span[1]) if q % chunk == 0]
    else:
        assert len(runs) == (1 if span[1] > span[0] else 0)


def test_chunks_apply_to_causal_attention_only():
    bidir = AttentionParams(1.0, False, 0, 0.0, None, 1, 8, None, 4)
    assert bidir.chunk == 0 and reference.visible(torch.arange(5), torch.arange(9), bidir) is None
    assert reference.earliest_visible_key(7, bidir) == 0 and reference.chunk_runs(3, 9, bidir) == [(3, 9)]
    assert AttentionParams(1.0, True, 0, 0.0, None, 1, 8, None, -3).chunk == 0  # <= 0: none
    assert "chunk 4" in dataclasses.replace(bidir, causal=True).describe() and "chunk" not in bidir.describe()
    reasons = get_backend("cpu").supports(AttentionConfig(bidir, 4, 8))
    assert any("chunked local attention needs causal" in r for r in reasons)
    assert get_backend("cpu").supports(AttentionConfig(dataclasses.replace(bidir, causal=True), 4, 8)) == []


def test_schema_appends_the_chunk_size():
    # saved programs call the ops with the fields up to sinks: the new field is last, with its default
    assert "Tensor? sinks=None, int chunk_size=0, int max_seq_len=0, bool positions_from_first_key=False" \
        in params_schema()
    old = AttentionParams.from_args((0.5, True, 0, 0.0, None, 2, 8, None))
    assert old.chunk_size == 0 and old.chunk == 0
    assert AttentionParams.from_args(dataclasses.replace(old, chunk_size=6).args()).chunk == 6


@pytest.mark.parametrize("feature", [{}, {"window": 3}, {"alibi": True}, {"sinks": True}, {"softcap": 2.0},
                                     {"alibi": True, "sinks": True, "window": 4}], ids=feature_id)
@pytest.mark.parametrize("chunk", [1, 4, 5])
def test_dense_attention_matches_a_plain_loop(chunk, feature):
    g = torch.Generator().manual_seed(7)
    f = feature_kwargs(feature)
    alibi = None if "alibi" not in f else torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    sinks = None if "sinks" not in f else torch.tensor([-1.0, 0.5, 2.0, 3.0], dtype=torch.float64)
    p = AttentionParams(0.4, True, f.get("window", 0), f.get("softcap", 0.0), alibi, 2, 8, sinks, chunk)
    q = torch.randn(1, 4, 9, 8, generator=g, dtype=torch.float64)  # the last 9 of 14 positions
    k = torch.randn(1, 2, 14, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 14, 8, generator=g, dtype=torch.float64)
    want = _loop_attention(q[0], k[0], v[0], p, list(range(5, 14)), list(range(14)))
    for exact in (True, False):  # exact math, and SDPA where the site is a mask only
        got = reference.dense_attention(q, k, v, p, exact=exact)[0]
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


# ------------------------------------------------------------------------------ CPU: through the ops

CHUNKS = [1, 3, 8, 13, 16, 40, 1000]  # block 16: smaller, dividing, not dividing, equal, larger, all of it
MIXED = SHAPES["mixed"] + SHAPES["chunked"]  # every kind of step at once


@pytest.mark.usefixtures("decode_path")
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_cpu_steps(shape, chunk):
    b = make_batch(SHAPES[shape], num_heads=8, num_kv_heads=2, pad_tokens=3)
    _check(b, _params(b, chunk), torch.float32)


@pytest.mark.usefixtures("decode_path")
@pytest.mark.parametrize("block_size", [1, 5, 8, 32])
@pytest.mark.parametrize("chunk", [4, 7, 24])
def test_cpu_block_sizes(block_size, chunk):
    b = make_batch(MIXED, block_size=block_size, pad_tokens=2)
    _check(b, _params(b, chunk), torch.float32)


@pytest.mark.usefixtures("decode_path")
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
def test_cpu_head_layouts(heads):
    b = make_batch(SHAPES["mixed"], num_heads=heads[0], num_kv_heads=heads[1])
    _check(b, _params(b, 6), torch.float32)


@pytest.mark.usefixtures("decode_path")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("feature", FEATURES, ids=feature_id)
def test_cpu_features(feature, dtype):
    b = make_batch(MIXED, num_heads=8, num_kv_heads=2, dtype=dtype, pad_tokens=2)
    _check(b, _params(b, 12, **feature_kwargs(feature)), dtype)


# programs that read the sequence's length n: keys among its last 40 positions (a mask), and the same mask with a
# bias by distance (the exact math's path)
LAST_KEYS_MOD = json.dumps({"version": 1, "float": "float32", "nodes": [
    ["q"], ["k"], ["n"], ["int", 40], ["sub", 2, 3], ["ge", 1, 4]], "allowed": 5, "bias": None})
LAST_KEYS_BIAS_MOD = json.dumps({"version": 1, "float": "float32", "nodes": [
    ["q"], ["k"], ["n"], ["int", 40], ["sub", 2, 3], ["ge", 1, 4], ["sub", 1, 0], ["to_real", 6], ["real", 0.1],
    ["mul", 7, 8]], "allowed": 5, "bias": 9})


@pytest.mark.usefixtures("decode_path")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("program", [LAST_KEYS_MOD, LAST_KEYS_BIAS_MOD], ids=["mask", "mask_and_bias"])
def test_cpu_programs_read_the_sequences_length_in_every_chunk(program, dtype):
    # a run of queries within a chunk reads keys up to its own end, but the program reads the sequence's length: a
    # chunk that is not the sequence's last gave 3.8 off when the length was taken from the keys handed in
    b = make_batch([(0, 50), (20, 30), (70, 1), (0, 9)], num_heads=4, num_kv_heads=2, dtype=dtype, pad_tokens=2)
    p = dataclasses.replace(_params(b, 16), position_mod=program)
    _check(b, p, dtype)
    assert not torch.allclose(_run(b, p)[:50].double(), _expected(b, dataclasses.replace(p, position_mod=""))[:50],
                              atol=1e-3)  # the program hides keys the chunks alone would show


@pytest.mark.usefixtures("decode_path")
def test_cpu_cross_steps_without_new_keys():
    # key=None: the per-sequence path gathers every sequence from the cache, chunk by chunk
    b = make_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, pad_tokens=1)
    p = _params(b, 7)
    _check(b, p, torch.float32, out=_run(b, p, pass_kv=False))


@pytest.mark.usefixtures("decode_path")
@pytest.mark.parametrize("feature", FEW_FEATURES, ids=feature_id)
def test_cpu_reads_nothing_before_the_first_visible_block(feature):
    # blocks before a sequence's first visible key hold NaN: reading them at all (even masked) shows
    b = make_batch([(70, 1), (45, 9), (33, 1), (0, 20), (64, 17)], num_heads=8, num_kv_heads=2, block_size=4)
    p = _params(b, 10, **feature_kwargs(feature))
    _poison_out_of_reach(b, p)
    assert torch.isnan(b.kv_cache).any()
    _check(b, p, torch.float32)


def _record_sdpa(monkeypatch) -> list[dict]:
    """Wraps SDPA as the CPU backend calls it; returns per call the key length, is_causal and the mask."""
    calls = []
    inner = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append({"keys": k.shape[-2], "is_causal": is_causal, "mask": attn_mask})
        return inner(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(sdpa_cpu.F, "scaled_dot_product_attention", spy)
    return calls


def test_cpu_fresh_prefill_runs_each_chunk_as_plain_causal_attention(monkeypatch):
    calls = _record_sdpa(monkeypatch)
    b = make_batch([(0, 19)], num_heads=4, num_kv_heads=2)
    _check(b, _params(b, 8), torch.float32)
    assert [c["keys"] for c in calls] == [8, 8, 3]
    assert all(c["is_causal"] and c["mask"] is None for c in calls)


def test_cpu_chunked_prefill_masks_only_the_run_that_starts_inside_a_chunk(monkeypatch):
    calls = _record_sdpa(monkeypatch)
    b = make_batch([(13, 10)], num_heads=4, num_kv_heads=2, block_size=4)  # queries at 13..22, chunks of 8
    _check(b, _params(b, 8), torch.float32)
    # 13..15 over keys 8..15 (a mask: bottom-right causal), 16..22 over keys 16..22 (SDPA's own causal mask)
    got = [(c["keys"], c["is_causal"], c["mask"] is not None) for c in calls]
    assert got == [(8, False, True), (7, True, False)]


# ------------------------------------------------------------------------------ CPU: flash-decoding

DECODES = [(100, 1), (3, 1), (57, 1), (0, 9), (40, 1), (23, 1), (47, 1)]


@pytest.mark.usefixtures("decode_path")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("feature", FEW_FEATURES, ids=feature_id)
@pytest.mark.parametrize("chunk", [5, 12, 24, 64])
def test_decode_split_under_a_small_gather_budget(monkeypatch, chunk, feature, threads):
    # 3 blocks of 4 tokens a group: long chunks of keys split in several, merged by log-sum-exp; chunk
    # starts inside blocks (5, 12 with blocks of 4: 12 is aligned, 5 is not) and across several groups
    monkeypatch.setattr(sdpa_cpu, "_GATHER_BUDGET_BYTES", 3 * 4 * 2 * 2 * 64 * 4)
    b = make_batch(DECODES, num_heads=8, num_kv_heads=2, block_size=4)
    p = _params(b, chunk, **feature_kwargs(feature))
    _poison_out_of_reach(b, p)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(b, p, torch.float32)
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("decode_path")
@pytest.mark.parametrize("decode_path", ["sdpa"], indirect=True)  # the SDPA path's own workings
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget_blocks", [2, 1000])
def test_decode_without_mask_when_every_key_in_reach_is_visible(monkeypatch, budget_blocks, dtype):
    # chunks of 32 over blocks of 16, decodes on a chunk's last position: the keys gathered (the chunk's
    # two blocks, all sequences alike, so no chunk of keys is padded) are all visible: no mask
    monkeypatch.setattr(sdpa_cpu, "_GATHER_BUDGET_BYTES", budget_blocks * 16 * 2 * 2 * 64 * dtype.itemsize)
    seen = record_decode_masks(monkeypatch)
    b = make_batch([(63, 1), (31, 1), (127, 1), (95, 1)], num_heads=8, num_kv_heads=2, dtype=dtype)
    _check(b, _params(b, 32), dtype)
    assert seen and all(m is None for m in seen)


@pytest.mark.usefixtures("decode_path")
@pytest.mark.parametrize("decode_path", ["sdpa"], indirect=True)  # the SDPA path's own workings
def test_decode_masks_a_chunk_that_starts_inside_a_block(monkeypatch):
    seen = record_decode_masks(monkeypatch)
    b = make_batch([(55, 1)], num_heads=4, num_kv_heads=2)  # chunk 40..59: block 2 holds keys 32..47
    p = _params(b, 20)
    _poison_out_of_reach(b, p)
    _check(b, p, torch.float32)
    (mask,) = seen
    assert mask is not None and torch.isinf(mask[0, 0, 0, :8]).all()  # keys 32..39: before the chunk
    assert not torch.isinf(mask[0, 0, 0, 8:24]).any()  # keys 40..55


# ------------------------------------------------------------------------------ xFormers (emulated operator)


@pytest.fixture
def xformers_backend():
    pytest.importorskip("xformers", reason="xformers is not installed (pip install 'pagedattn[cuda]')")
    from pagedattn.backends import xformers_cuda

    xformers_cuda._LOCAL.plan = None  # a fresh backend and plan per test
    return xformers_cuda.XFormersCudaBackend()


def _emulate(monkeypatch, refuse=()):
    from .xformers_emulation import install

    return install(monkeypatch, refuse)


def _xf_attend(backend, b, p: AttentionParams, pass_kv=True) -> torch.Tensor:
    backend.write(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    meta = dataclasses.replace(b.meta, slot_mapping=None)
    key, value = (b.key, b.value) if pass_kv else (None, None)
    return backend.attend(b.query, key, value, b.kv_cache, meta, p)


def _xf_check(backend, b, p: AttentionParams, dtype=torch.float16):
    return _check(b, p, dtype, out=_xf_attend(backend, b, p))


def _bias_types(op) -> set[str]:
    return {type(c["bias"]).__name__ for c in op.calls}


def _q_lens(bias) -> list[int]:
    """The query block lengths of a block-diagonal bias."""
    return [b - a for a, b in bias.q_seqinfo.intervals()]


@pytest.mark.parametrize("paged_ok", [True, False], ids=["paged", "gathered"])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_xformers_steps(monkeypatch, xformers_backend, shape, chunk, paged_ok):
    refuse = () if paged_ok else ("PagedBlockDiagonalCausalWithOffsetGappyKeysMask",)
    op = _emulate(monkeypatch, refuse)
    b = make_batch(SHAPES[shape], num_heads=8, num_kv_heads=2, dtype=torch.float16, pad_tokens=3)
    _xf_check(xformers_backend, b, _params(b, chunk))
    assert op.calls, "the fused path must have run"


@pytest.mark.parametrize("block_size", [1, 8, 32])
@pytest.mark.parametrize("chunk", [5, 16, 24])
def test_xformers_block_sizes(monkeypatch, xformers_backend, block_size, chunk):
    _emulate(monkeypatch)
    b = make_batch(MIXED, block_size=block_size, dtype=torch.bfloat16)
    _xf_check(xformers_backend, b, _params(b, chunk), torch.bfloat16)


def test_xformers_fresh_prefill_cuts_sequences_into_chunks(monkeypatch, xformers_backend):
    op = _emulate(monkeypatch)
    # 7, 19, 1 and 33 tokens
    b = make_batch(SHAPES["all_prefill"], num_heads=8, num_kv_heads=2, dtype=torch.float16)
    _xf_check(xformers_backend, b, _params(b, 8))
    (call,) = op.calls
    assert type(call["bias"]).__name__ == "BlockDiagonalCausalMask"
    assert _q_lens(call["bias"]) == [7, 8, 8, 3, 1, 8, 8, 8, 8, 1]
    assert call["key"].stride(3) == 0  # GQA without copying K/V
    op.calls.clear()
    _xf_check(xformers_backend, b, _params(b, 8, window=5))
    assert _bias_types(op) == {"BlockDiagonalCausalLocalAttentionMask"}


def test_xformers_decode_starts_each_sequence_at_its_chunk(monkeypatch, xformers_backend):
    op = _emulate(monkeypatch)
    # decodes at positions 5, 40, 16, 1 and 63
    b = make_batch(SHAPES["all_decode"], num_heads=8, num_kv_heads=2, dtype=torch.float16)
    p = _params(b, 12)
    _xf_check(xformers_backend, b, p)
    (call,) = op.calls
    bias = call["bias"]
    assert type(bias).__name__ == "PagedBlockDiagonalCausalWithOffsetGappyKeysMask"
    assert bias.k_seqinfo.seqstart_py[:-1] == [0, 36, 12, 0, 60]  # each decode's chunk start, within its row
    assert call["key"].data_ptr() == b.kv_cache[0].data_ptr()  # read in place from the cache


def test_xformers_chunked_prefill_paged_then_gathered(monkeypatch, xformers_backend):
    from pagedattn.backends import xformers_cuda

    op = _emulate(monkeypatch)
    b = make_batch([(13, 10), (40, 1), (3, 30)], num_heads=8, num_kv_heads=2, dtype=torch.float16)
    p = _params(b, 8)
    _xf_check(xformers_backend, b, p)
    # one gappy-keys bias for the chunked prefills, cut where chunks begin; one for the decode
    assert _bias_types(op) == {"PagedBlockDiagonalCausalWithOffsetGappyKeysMask"}
    chunked = next(c["bias"] for c in op.calls if _q_lens(c["bias"]) != [1])
    assert _q_lens(chunked) == [3, 7, 5, 8, 8, 8, 1]
    op = _emulate(monkeypatch, refuse=("PagedBlockDiagonalCausalWithOffsetGappyKeysMask",))
    xformers_cuda._LOCAL.plan = None
    _xf_check(xformers_backend, b, p)
    assert _bias_types(op) == {"BlockDiagonalCausalFromBottomRightMask"}
    # each run of queries gathers only the keys from its chunk's start: 8..22, 40 alone, 0..32
    assert sum(c["key"].shape[1] for c in op.calls) == 15 + 1 + 33
    op.calls.clear()
    _xf_check(xformers_backend, b, _params(b, 8, window=3))  # paged biases have no window: gathered
    assert _bias_types(op) == {"BlockDiagonalCausalLocalAttentionFromBottomRightMask"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("feature", FEATURES, ids=feature_id)
def test_xformers_features(monkeypatch, xformers_backend, feature, dtype):
    _emulate(monkeypatch)
    b = make_batch(MIXED, num_heads=8, num_kv_heads=2, dtype=dtype, pad_tokens=2)
    _xf_check(xformers_backend, b, _params(b, 12, **feature_kwargs(feature)), dtype)


@pytest.mark.parametrize("program", [LAST_KEYS_MOD, LAST_KEYS_BIAS_MOD], ids=["mask", "mask_and_bias"])
def test_xformers_programs_read_the_sequences_length_in_every_chunk(monkeypatch, xformers_backend, program):
    _emulate(monkeypatch)
    b = make_batch([(0, 50), (20, 30), (70, 1), (0, 9)], num_heads=4, num_kv_heads=2, dtype=torch.float16)
    _xf_check(xformers_backend, b, dataclasses.replace(_params(b, 16), position_mod=program))


@pytest.mark.parametrize("feature", [{"alibi": True}, {"sinks": True}, {"softcap": 4.0}], ids=feature_id)
def test_xformers_padded_paths_read_from_the_chunks_first_block(monkeypatch, xformers_backend, feature):
    op = _emulate(monkeypatch)
    b = make_batch([(70, 1), (45, 9), (33, 1), (0, 20), (64, 17)], num_heads=8, num_kv_heads=2, block_size=4,
                   dtype=torch.float16)
    p = _params(b, 10, **feature_kwargs(feature))
    _poison_out_of_reach(b, p)
    _xf_check(xformers_backend, b, p)
    assert bool(op.calls) == ("alibi" in feature)  # ALiBi: a tensor bias to an operator; else exact math
    if "alibi" not in feature:
        assert not op.calls and xformers_backend.paths


def test_xformers_float32_runs_exactly(monkeypatch, xformers_backend):
    op = _emulate(monkeypatch)
    b = make_batch(MIXED, num_heads=8, num_kv_heads=2)
    _xf_check(xformers_backend, b, _params(b, 12), torch.float32)
    assert not op.calls and xformers_backend.paths[("all", "sdpa")] == 1


def test_xformers_layers_with_and_without_chunks_share_a_step(monkeypatch, xformers_backend):
    # Llama 4 interleaves chunked layers with global ones: one step plan, biases prepared per kind of layer
    _emulate(monkeypatch)
    b = make_batch(MIXED, num_heads=8, num_kv_heads=2, dtype=torch.float16)
    for chunk in (8, 0, 8, 5, 0):
        _xf_check(xformers_backend, b, _params(b, chunk))


def test_xformers_without_any_operator_falls_back_exactly(xformers_backend):
    # the real operator choice on CPU tensors: every xFormers operator refuses (device cpu)
    b = make_batch(MIXED, num_heads=8, num_kv_heads=2, dtype=torch.float16)
    _xf_check(xformers_backend, b, _params(b, 8))
    _xf_check(xformers_backend, b, _params(b, 8, window=5))
    assert xformers_backend.paths and all(path == "sdpa" for _, path in xformers_backend.paths)


def test_xformers_supports_and_fallback_reasons(xformers_backend):
    def config(chunk, dtype=torch.float16, **kw):
        params = AttentionParams(0.1, kw.get("causal", True), kw.get("window", 0), kw.get("softcap", 0.0),
                                 None, 2, 64, None, chunk)
        return AttentionConfig(params, 8, 64, dtype)

    assert xformers_backend.supports(config(16)) == [] and xformers_backend.fallback_reasons(config(16)) == []
    assert any("needs causal" in r for r in xformers_backend.supports(config(16, causal=False)))
    windowed = " ".join(xformers_backend.fallback_reasons(config(16, window=8)))
    assert "chunked local attention with a sliding window" in windowed and "gather" in windowed
    capped = " ".join(xformers_backend.fallback_reasons(config(16, softcap=30.0)))
    assert "soft-cap" in capped and "chunk's first block" in capped


# ------------------------------------------------------------------------------ the drop-in op


def _dropin_inputs(chunk, sinks: bool, g):
    q = torch.randn(2, 4, 11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    s = torch.tensor([-1.0, 0.5, 2.0, 3.0], dtype=torch.float64, requires_grad=True) if sinks else None
    pad = torch.ones(2, 11, dtype=torch.long)
    pad[1, :3] = 0  # the second batch row's first three keys are padding
    return q, k, v, pad, AttentionParams(0.35, True, 0, 0.0, None, 2, 8, s, chunk)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 5])
def test_dropin_op_and_its_gradients(chunk, sinks):
    g = torch.Generator().manual_seed(3)
    q, k, v, pad, p = _dropin_inputs(chunk, sinks, g)
    out = torch.ops.pagedattn.attention(q, k, v, pad, *p.args())
    for b in range(2):  # the loop sees only the keys that exist
        keep = pad[b].nonzero().flatten().tolist()
        kb, vb = k[b, :, keep].detach(), v[b, :, keep].detach()
        want = _loop_attention(q[b].detach(), kb, vb, p, list(range(11)), keep)
        torch.testing.assert_close(out[b].detach(), want, atol=1e-10, rtol=1e-10)
    # one gradient per input (the new field included), equal to autograd through the reference itself
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    wrt = [t for t in (q, k, v, p.sinks) if t is not None]
    got = torch.autograd.grad(out, wrt, grad)
    ref = reference.dense_attention(q, k, v, p, key_present=pad != 0, exact=True)
    want = torch.autograd.grad(ref, wrt, grad)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=1e-10, rtol=1e-10)
    small = [t.detach()[:1, :, :5, :4].clone().requires_grad_() for t in (q, k, v)]
    sink = None if p.sinks is None else p.sinks.detach().clone().requires_grad_()
    small_p = dataclasses.replace(p, head_size_v=4, sinks=sink)
    assert torch.autograd.gradcheck(
        lambda *t: torch.ops.pagedattn.attention(t[0], t[1], t[2], None, *dataclasses.replace(
            small_p, sinks=t[3] if len(t) > 3 else None).args()),
        (*small, *([sink] if sink is not None else [])))
