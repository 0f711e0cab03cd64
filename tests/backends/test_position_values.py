"""Position programs that read per-request values (a prefix-LM's token types, a prefix length), on every
backend against the reference (``backends/reference.py``), and the values' own rules
(``position_mod.values_from_input``, ``spans``)."""

import math

import pytest
import torch

from pagedattn.backends import AttentionParams, position_mod
from pagedattn.backends import reference as ref_mod

from ..support import (
    PREFIX_LEN_MOD,
    SHAPES,
    TOL,
    make_batch,
    prefix_lm_mod,
    reference_step,
    run_step,
    span_values,
)

RUNS = 3


def _spans(seqs) -> list[list[tuple[int, int]]]:
    """Spans for each ``(context, new)`` sequence: one from near its start, a second further on where it
    has room; spans cross the step's chunk boundaries, and some sequences have none."""
    out = []
    for i, (c, n) in enumerate(seqs):
        L = c + n
        spans = [] if i % 4 == 3 else [(1, max(2, L // 3))]
        if L > 12 and spans:
            spans.append((L // 2, L // 2 + 4))
        out.append(spans)
    return out


def _program(kind: str, seqs):
    if kind == "runs":
        return prefix_lm_mod(RUNS), None, span_values(RUNS, _spans(seqs))
    lens = torch.tensor([[(c + n) // 2 + (i % 3)] for i, (c, n) in enumerate(seqs)])  # prefix lengths
    return PREFIX_LEN_MOD, None, lens


def _check(b, dtype, mod):
    scale = 1 / math.sqrt(b.query.shape[-1])
    out = run_step(b, scale, causal=False, mod=mod)
    want = reference_step(b, scale, causal=False, mod=mod)
    n = want.shape[0]
    torch.testing.assert_close(out[:n].double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.all(out[n:] == 0)
    return out[:n]


# ------------------------------------------------------------------------------- the values


def test_values_from_token_types_and_their_spans():
    spec = position_mod.ValueSpec("tt", "runs", 1, 0, 3)
    tt = torch.tensor([[0, 1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    v = position_mod.values_from_input(spec, tt)
    big = position_mod.NO_RUN
    assert v.tolist() == [[1, 3, 5, 6, big + 4, big + 5], [0, 4, big + 2, big + 3, big + 4, big + 5],
                          [big + i for i in range(6)]]
    assert [position_mod.spans(spec, r) for r in v.tolist()] == [[(1, 3), (5, 6)], [(0, 4)], []]
    assert torch.equal(position_mod.default_values(spec, 1), v[2:])
    scalar = position_mod.ValueSpec("plen", "scalar")
    assert position_mod.values_from_input(scalar, torch.tensor([3, 0])).tolist() == [[3], [0]]
    assert position_mod.spans(scalar, [3]) == [(0, 3)] and position_mod.spans(scalar, [0]) == []


@pytest.mark.parametrize("data, match", [
    (torch.tensor([[0, 1, 0, 1, 0, 1, 0, 1]]), "4 runs of 1s"),
    (torch.tensor([[0, 2, 1]]), "values other than 0 and 1"),
    (torch.tensor([0, 1]), r"\[batch, tokens\]"),
])
def test_token_types_of_another_shape_are_refused_naming_the_input(data, match):
    with pytest.raises(ValueError, match=match) as e:
        position_mod.values_from_input(position_mod.ValueSpec("token_type_ids", "runs", 1, 0, 3), data)
    assert "token_type_ids" in str(e.value)


def test_a_negative_prefix_length_is_refused():
    with pytest.raises(ValueError, match="negative"):
        position_mod.values_from_input(position_mod.ValueSpec("plen", "scalar"), torch.tensor([2, -1]))


def test_a_program_that_reads_values_needs_them():
    params = AttentionParams(1.0, False, 0, 0.0, None, 1, 4, position_mod=prefix_lm_mod(1))
    with pytest.raises(ValueError, match="per-sequence values"):
        ref_mod.score_terms(torch.arange(3), torch.arange(3), params, 1)


def test_the_program_reads_each_rows_values():
    # two rows, two span layouts: the same positions see different keys
    params = AttentionParams(1.0, False, 0, 0.0, None, 1, 4, position_mod=prefix_lm_mod(2))
    values = span_values(2, [[(0, 4)], [(2, 3), (5, 8)]])
    pos = torch.arange(8)[None]
    allowed, bias = ref_mod.score_terms(pos, pos, params, 1, values=values)
    want = torch.ones(2, 8, 8, dtype=torch.bool).tril()
    want[0, :4, :4] = True
    want[1, 5:8, 5:8] = True
    assert bias is None and torch.equal(allowed, want)


# ----------------------------------------------------------------------------- the CPU backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["mixed", "all_decode", "chunked", "many_blocks", "cached_prefix"])
@pytest.mark.parametrize("kind", ["runs", "scalar"])
def test_cpu_prefills_chunks_and_decodes_equal_the_reference(kind, shape, dtype):
    b = make_batch(SHAPES[shape], num_heads=4, num_kv_heads=2, dtype=dtype, pad_tokens=2)
    _check(b, dtype, _program(kind, SHAPES[shape]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mod", ["prefix_lm", "sinks_window"])
def test_a_mask_of_one_run_a_query_prefills_in_the_native_kernel(monkeypatch, mod, dtype):
    # a prefix-LM's query sees its causal keys and its own span's, one run of keys: the native prefill takes each
    # row's run (checked on the step's mask); sink keys beside a window are two runs a query, left to SDPA's kernel
    from pagedattn.backends import native

    from ..support import SINKS_WINDOW_MOD, skip_unless_missing_prerequisite

    if native.load() is None:
        skip_unless_missing_prerequisite()
    calls = []
    real = native.prefill
    monkeypatch.setattr(native, "prefill", lambda *a, **k: calls.append(k.get("bounds")) or real(*a, **k))
    seqs = SHAPES["chunked"] + [(0, 40)]
    b = make_batch(seqs, num_heads=4, num_kv_heads=2, dtype=dtype)
    program = _program("runs", seqs) if mod == "prefix_lm" else (SINKS_WINDOW_MOD, None)
    _check(b, dtype, program)
    with_runs = [c for c in calls if c is not None]
    assert len(with_runs) == (4 if mod == "prefix_lm" else 0)  # one call a sequence's run of queries


def test_a_steps_layers_evaluate_a_mask_only_program_once(monkeypatch):
    # the mask of each sequence's prefill is the same at every layer of a step: evaluated at the first, its runs of
    # keys kept for the rest; other values for the same step's metadata are evaluated afresh (and served right)
    calls = []
    real = ref_mod.score_terms
    monkeypatch.setattr(ref_mod, "score_terms", lambda *a, **k: calls.append(1) or real(*a, **k))
    seqs = SHAPES["chunked"] + [(0, 40)]  # four sequences, each one run of queries
    b = make_batch(seqs, num_heads=4, num_kv_heads=2)
    first = _program("runs", seqs)
    scale = 1 / math.sqrt(b.query.shape[-1])
    outs = [run_step(b, scale, causal=False, mod=first) for _ in range(3)]  # three layers of one step
    assert len(calls) == len(seqs)
    assert all(torch.equal(o, outs[0]) for o in outs)
    other = (first[0], None, span_values(RUNS, [[(0, 3)]] * len(seqs)))
    run_step(b, scale, causal=False, mod=other)
    assert len(calls) == 2 * len(seqs)
    _check(b, torch.float32, other)
    _check(b, torch.float32, first)


def test_a_block_table_updated_in_place_for_another_steps_layout_gets_each_sequences_own_mask():
    # the step's memo lives with its block table tensor: a table updated in place for the next step, whose sequences
    # sit at other rows, must not be served a mask kept for the sequence that sat there before (same positions and
    # step values, another sequence's spans); a memo keyed by the row alone gave 4.5 off here
    import dataclasses

    first = make_batch([(0, 10), (0, 5), (0, 5)], num_heads=4, num_kv_heads=2)
    second = make_batch([(0, 5), (0, 5), (0, 5)], num_heads=4, num_kv_heads=2,
                        generator=torch.Generator().manual_seed(7))
    mod = (prefix_lm_mod(RUNS), None, span_values(RUNS, [[(0, 4)], [(1, 2)], [(0, 4)]]))
    _check(first, torch.float32, mod)  # rows 10-14: the second sequence, spans (1, 2)
    first.meta.block_tables.copy_(second.meta.block_tables)
    reused = dataclasses.replace(second, meta=dataclasses.replace(second.meta, block_tables=first.meta.block_tables))
    _check(reused, torch.float32, mod)  # rows 10-14: the third sequence, spans (0, 4)


def test_the_values_change_the_result():
    # the checks above can fail: other spans (or none) give other outputs
    seqs = SHAPES["many_blocks"]
    b = make_batch(seqs, num_heads=4, num_kv_heads=2)
    text, tables, values = _program("runs", seqs)
    out = run_step(b, 0.125, causal=False, mod=(text, tables, values))
    none = reference_step(b, 0.125, causal=False, mod=(text, tables, position_mod.default_values(
        position_mod.value_spec(text), len(seqs))))
    assert not torch.allclose(out.double()[:none.shape[0]], none, atol=1e-3)


def test_decode_plans_are_kept_apart_by_the_steps_values():
    # the same block tables (one step's metadata reused) with other values: the CPU decode plan, memoised
    # per block table, must not serve the first values' mask and bias
    seqs = SHAPES["all_decode"]
    b = make_batch(seqs, num_heads=4, num_kv_heads=2)
    first = _check(b, torch.float32, (PREFIX_LEN_MOD, None, torch.tensor([[c // 2] for c, _ in seqs])))
    second = _check(b, torch.float32, (PREFIX_LEN_MOD, None, torch.tensor([[c] for c, _ in seqs])))
    assert not torch.allclose(first, second)


# ----------------------------------------------------------------- xFormers (emulated on the CPU)


@pytest.mark.parametrize("kind", ["runs", "scalar"])
@pytest.mark.parametrize("shape", ["mixed", "chunked", "many_blocks"])
def test_xformers_runs_values_through_a_tensor_bias(monkeypatch, kind, shape):
    pytest.importorskip("xformers", reason="xformers is not installed")
    import dataclasses

    from pagedattn.backends import xformers_cuda

    from .xformers_emulation import install

    op = install(monkeypatch)
    backend = xformers_cuda.XFormersCudaBackend()
    seqs = SHAPES[shape]
    b = make_batch(seqs, num_heads=4, num_kv_heads=2, dtype=torch.float16)
    mod = _program(kind, seqs)
    backend.write(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    from ..support import batch_params

    params = batch_params(b, 0.125, False, mod=mod)
    out = backend.attend(b.query, b.key, b.value, b.kv_cache, dataclasses.replace(b.meta, slot_mapping=None), params)
    want = reference_step(b, 0.125, causal=False, mod=mod)
    n = want.shape[0]
    torch.testing.assert_close(out[:n].double(), want, atol=TOL[torch.float16], rtol=TOL[torch.float16])
    assert op.calls and all(isinstance(c["bias"], torch.Tensor) for c in op.calls)
    assert backend.paths[("program", "emulated")] >= 1
