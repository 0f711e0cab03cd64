import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedattn.backends import (
    AttentionMetadata,
    AttentionParams,
    CacheSpec,
    active_backend,
    build_decode_metadata,
    build_metadata,
    get_backend,
    use_backend,
)
from pagedattn.backends.params import params_schema
from pagedattn.backends.sdpa_cpu import SdpaCpuBackend

from ..support import make_batch


@settings(max_examples=200, deadline=None)
@given(block_size=st.sampled_from([1, 2, 3, 5, 16, 32]),
       seqs=st.lists(st.tuples(st.integers(0, 70), st.integers(1, 90), st.integers(0, 2)), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_every_slot_is_its_tokens_block_entry(block_size, seqs, seed):
    # slot of the token at position p: table[p // block_size] * block_size + p % block_size, for chunks that start
    # and end anywhere in a block (build_metadata writes them a block's run at a time)
    g = torch.Generator().manual_seed(seed)
    rows = [(ctx, n, torch.randperm(1000, generator=g)[:-(-(ctx + n) // block_size) + extra].tolist())
            for ctx, n, extra in seqs]
    want = [t[p // block_size] * block_size + p % block_size for ctx, n, t in rows for p in range(ctx, ctx + n)]
    assert build_metadata(rows, block_size).slot_mapping.tolist() == want


def test_build_metadata_fields():
    m = build_metadata([(0, 3, [4]), (5, 1, [2, 7]), (2, 4, [1, 3])], block_size=4, pad_tokens_to=10)
    assert m.slot_mapping.tolist() == [16, 17, 18, 29, 6, 7, 12, 13, -1, -1]
    assert m.block_tables.tolist() == [[4, 0], [2, 7], [1, 3]]
    assert m.seq_lens.tolist() == [3, 6, 6]
    assert m.query_start_loc.tolist() == [0, 3, 4, 8]
    assert (m.num_prefills, m.num_prefill_tokens, m.num_decode_tokens) == (2, 7, 1)
    assert (m.max_query_len, m.max_seq_len, m.num_seqs, m.num_tokens) == (4, 6, 3, 10)
    assert m.block_tables.dtype == torch.int32 and m.slot_mapping.dtype == torch.int64


def test_metadata_is_frozen():
    m = build_metadata([(0, 2, [0])], block_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.block_size = 8  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.seq_lens = torch.tensor([3])  # type: ignore[misc]
    moved = m.to("cpu")
    assert isinstance(moved, AttentionMetadata) and moved.block_size == 4
    assert [t.tolist() for t in moved.tensors()] == [t.tolist() for t in m.tensors()]


@pytest.mark.parametrize(
    "seqs, match",
    [([], "no sequences"), ([(0, 0, [0])], "0 new tokens"), ([(10, 1, [0])], "needs 3 blocks"),
     ([(0, 1, [2**40])], "does not fit in 32 bits")],
)
def test_build_metadata_rejects(seqs, match):
    with pytest.raises(ValueError, match=match):
        build_metadata(seqs, block_size=4)


@settings(max_examples=100, deadline=None)
@given(block_size=st.sampled_from([1, 2, 3, 16]), steps=st.integers(1, 20),
       seqs=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 2)), min_size=1, max_size=5),
       seed=st.integers(0, 2**16))
def test_decode_runs_metadata_is_each_steps_own(block_size, steps, seqs, seed):
    # step j of a run is build_metadata's decode step at starts + j; the steps share their block tables and query
    # start offsets (one tensor each), and have slot mappings and lengths of their own
    g = torch.Generator().manual_seed(seed)
    starts = [ctx for ctx, _ in seqs]
    tables = [torch.randperm(1000, generator=g)[:-(-(ctx + steps) // block_size) + extra].tolist()
              for ctx, extra in seqs]
    metas = build_decode_metadata(starts, tables, block_size, steps)
    assert len(metas) == steps
    for j, m in enumerate(metas):
        want = build_metadata([(c + j, 1, t) for c, t in zip(starts, tables)], block_size)
        assert [t.tolist() for t in m.tensors()] == [t.tolist() for t in want.tensors()]
        assert [t.dtype for t in m.tensors()] == [t.dtype for t in want.tensors()]
        assert m.block_tables is metas[0].block_tables and m.query_start_loc is metas[0].query_start_loc
    assert len({m.slot_mapping.data_ptr() for m in metas}) == steps


@pytest.mark.parametrize(
    "starts, tables, steps, match",
    [([], [], 2, "need >= 1"), ([0], [[1], [2]], 2, "one per sequence"), ([3], [[1]], 0, "steps must be >= 1"),
     ([-1], [[1]], 1, "negative"), ([3], [[1]], 2, "needs 2 blocks"), ([0], [[2**40]], 1, "does not fit in 32 bits")],
)
def test_build_decode_metadata_rejects(starts, tables, steps, match):
    with pytest.raises(ValueError, match=match):
        build_decode_metadata(starts, tables, 4, steps)


def _attend(b, **over):
    a = dict(query=b.query, key=b.key, value=b.value, kv_cache=b.kv_cache, block_tables=b.meta.block_tables,
             seq_lens=b.meta.seq_lens, query_start_loc=b.meta.query_start_loc, num_kv_heads=b.key.shape[1])
    a.update(over)
    p = AttentionParams(0.125, True, 0, 0.0, None, a["num_kv_heads"], a["value"].shape[2])
    return torch.ops.pagedattn.paged_attention(
        a["query"], a["key"], a["value"], a["kv_cache"], a["block_tables"], a["seq_lens"], a["query_start_loc"],
        *p.args())


def test_bad_slot_names_the_problem():
    b = make_batch([(0, 3)], block_size=4)
    bad = b.meta.slot_mapping.clone()
    bad[1] = b.kv_cache.shape[1] * 4
    with pytest.raises(ValueError, match="outside the cache"):
        torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, bad)
    bad[1] = -5
    with pytest.raises(ValueError, match="negative"):
        torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, bad)


def test_bad_write_dtype_and_heads():
    b = make_batch([(0, 3)])
    with pytest.raises(ValueError, match="dtype"):
        torch.ops.pagedattn.write_kv_cache(b.key.double(), b.value.double(), b.kv_cache, b.meta.slot_mapping)
    with pytest.raises(ValueError, match="kv heads"):
        torch.ops.pagedattn.write_kv_cache(b.key[:, :1], b.value[:, :1], b.kv_cache, b.meta.slot_mapping)


def test_bad_attention_metadata():
    b = make_batch([(4, 2), (0, 3)], block_size=4)
    tables = b.meta.block_tables.clone()
    tables[0, 0] = 999
    with pytest.raises(ValueError, match="outside the cache"):
        _attend(b, block_tables=tables)
    with pytest.raises(ValueError, match="shorter than"):
        _attend(b, seq_lens=torch.tensor([1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="num_kv_heads"):
        _attend(b, num_kv_heads=1)
    with pytest.raises(ValueError, match="dtype"):
        _attend(b, query=b.query.bfloat16())
    with pytest.raises(ValueError, match="query_start_loc"):
        _attend(b, query_start_loc=torch.tensor([0, 2], dtype=torch.int32))


def test_validation_can_be_switched_off(monkeypatch):
    from pagedattn.backends import set_validation, validation_enabled

    set_validation(None)
    monkeypatch.setenv("PAGEDATTN_VALIDATE", "0")
    assert not validation_enabled()
    monkeypatch.setenv("PAGEDATTN_VALIDATE", "1")
    assert validation_enabled()


def test_registry():
    assert get_backend("cpu").name == "sdpa_cpu"
    assert get_backend(torch.device("cpu")) is get_backend("cpu")
    with pytest.raises(ValueError, match="unknown target|no pagedattn backend"):
        get_backend("tpu9")


def test_registry_takes_a_backend_instance():
    mine = SdpaCpuBackend()
    assert get_backend(mine) is mine and get_backend("cpu") is not mine
    with pytest.raises(ValueError, match="unknown target"):
        get_backend("not a device")


def test_use_backend_binds_the_ops_to_an_instance():
    mine, default = SdpaCpuBackend(), get_backend("cpu")
    cpu = torch.device("cpu")
    assert active_backend(cpu) is default
    with use_backend(mine):
        assert active_backend(cpu) is mine
        with use_backend(None):  # nested: back to the defaults
            assert active_backend(cpu) is default
        assert active_backend(cpu) is mine
    assert active_backend(cpu) is default


def test_params_schema_follows_the_dataclass():
    # the ops' flat schema is generated from AttentionParams: its fields, in order, with their defaults
    names = [f.name for f in dataclasses.fields(AttentionParams)]
    schema = params_schema()
    assert [part.split()[1].split("=")[0] for part in schema.split(", ")] == names
    assert "Tensor? sinks=None" in schema.split(", ") and "Tensor? alibi_slopes" in schema.split(", ")
    p = AttentionParams(0.5, True, 4, 2.0, None, 2, 8)
    assert AttentionParams.from_args(p.args()) == p and p.window == 4
    assert dataclasses.replace(p, causal=False).window == 0  # a window applies to causal attention only
    assert p.describe() == "scale 0.5, causal, window 4, softcap 2"
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.scale = 1.0  # type: ignore[misc]


def test_cache_spec_round_trips_through_json():
    spec = CacheSpec("attn_0", 2, 8, torch.bfloat16)
    assert spec.to_json() == {"site": "attn_0", "num_kv_heads": 2, "head_size": 8, "dtype": "bfloat16"}
    assert CacheSpec.from_json(spec.to_json()) == spec
    assert spec.bytes_per_block(16) == 2 * 16 * 2 * 8 * 2
    assert spec.bytes_per_block(16, torch.float32) == 2 * 16 * 2 * 8 * 4
    with pytest.raises(ValueError, match="unknown dtype 'float7'"):
        CacheSpec.from_json({**spec.to_json(), "dtype": "float7"})


def test_allocate_caches_from_specs():
    specs = [CacheSpec("a", 2, 8, torch.float32), CacheSpec("b", 1, 4, torch.bfloat16)]
    caches = get_backend("cpu").allocate_kv_caches(specs, num_blocks=3, block_size=4)
    assert [(tuple(c.shape), c.dtype) for c in caches] == [((2, 3, 4, 2, 8), torch.float32),
                                                          ((2, 3, 4, 1, 4), torch.bfloat16)]
    (c,) = get_backend("cpu").allocate_kv_caches(specs[1:], 3, 4, dtype=torch.float16)
    assert c.dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_are_torchs_with_ties_to_the_first(dtype):
    from pagedattn.backends.base import AttentionBackend, argmax_rows

    logits = torch.randn(5, 300).to(dtype)
    logits[2, 7] = logits[2, 200] = logits[2].max() + 1  # a tie: the first index wins, as argmax's
    assert argmax_rows(logits) == logits.argmax(-1).tolist() and argmax_rows(logits)[2] == 7
    assert argmax_rows(logits[:0]) == []
    assert AttentionBackend().argmax_rows(logits) == argmax_rows(logits)
    out = torch.full((5,), -1, dtype=torch.long)
    assert AttentionBackend().argmax_rows_into(logits, out) == argmax_rows(logits) == out.tolist()
    runs = torch.full((3, 5), -1, dtype=torch.long)  # a run's input ids: row i written, the others left
    write = AttentionBackend().argmax_writer(runs)
    assert write(logits, 2) == argmax_rows(logits) == runs[2].tolist() and (runs[:2] == -1).all()
