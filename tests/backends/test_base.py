import pytest
import torch

from pagedattn.backends import build_metadata, get_backend
from pagedattn.backends.base import AttentionMetadata

from .paged_batch import make_batch


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
    with pytest.raises(Exception):
        m.max_seq_len = 3  # type: ignore[misc]
    assert isinstance(m.to("cpu"), AttentionMetadata)


@pytest.mark.parametrize(
    "seqs, match",
    [([], "no sequences"), ([(0, 0, [0])], "0 new tokens"), ([(10, 1, [0])], "needs 3 blocks")],
)
def test_build_metadata_rejects(seqs, match):
    with pytest.raises(ValueError, match=match):
        build_metadata(seqs, block_size=4)


def _attend(b, **over):
    a = dict(query=b.query, key=b.key, value=b.value, kv_cache=b.kv_cache, block_tables=b.meta.block_tables,
             seq_lens=b.meta.seq_lens, query_start_loc=b.meta.query_start_loc, num_kv_heads=b.key.shape[1])
    a.update(over)
    return torch.ops.pagedattn.paged_attention(
        a["query"], a["key"], a["value"], a["kv_cache"], a["block_tables"], a["seq_lens"], a["query_start_loc"],
        0.125, True, 0, 0.0, None, a["num_kv_heads"], a["value"].shape[2])


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
