"""Metadata checks that are always on (no PAGEDATTN_VALIDATE): bad metadata is refused, never misread."""

import pytest
import torch

from pagedattn.backends import build_metadata, set_validation

from ..support import make_batch


@pytest.fixture(autouse=True)
def _validation_off():
    set_validation(False)  # the default a user runs with
    yield
    set_validation(None)


def _write(b, slots):
    torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, slots)


def _attend(b, seq_lens=None, qsl=None, tables=None, causal=True):
    m = b.meta
    return torch.ops.pagedattn.paged_attention(
        b.query, b.key, b.value, b.kv_cache, m.block_tables if tables is None else tables,
        m.seq_lens if seq_lens is None else seq_lens, m.query_start_loc if qsl is None else qsl,
        0.125, causal, 0, 0.0, None, b.key.shape[1], b.value.shape[2])


@pytest.mark.parametrize("bad, match", [
    (lambda s: torch.where(s == s[1], -2, s), "negative other than -1"),
    (lambda s: s.float(), "int64 or int32"),
    (lambda s: s + 10_000, "outside the cache"),
    (lambda s: s[:-1], "slot_mapping has shape"),
])
def test_bad_slots_are_refused(bad, match):
    b = make_batch([(0, 4), (3, 1)], head_size=16, block_size=4)
    before = b.kv_cache.clone()
    with pytest.raises(ValueError, match=match):
        _write(b, bad(b.meta.slot_mapping))
    assert torch.equal(b.kv_cache, before)  # nothing written


def test_a_refused_slot_mapping_is_refused_again():
    # the checks run once per step's tensors; a failed check must not mark them as checked
    b = make_batch([(0, 4)], head_size=16, block_size=4)
    slots = b.meta.slot_mapping.clone()
    slots[1] = -2
    for _ in range(2):
        with pytest.raises(ValueError, match="negative"):
            _write(b, slots)
    slots[1] = b.meta.slot_mapping[1]  # fixed in place: its version changes, so it is checked again
    _write(b, slots)


def test_seq_lens_shorter_than_the_query_are_refused():
    b = make_batch([(0, 4), (5, 3)], head_size=16, block_size=4)
    _write(b, b.meta.slot_mapping)
    with pytest.raises(ValueError, match="shorter than its new tokens"):
        _attend(b, seq_lens=torch.tensor([4, 2], dtype=torch.int32))


def test_seq_lens_past_the_block_table_are_refused():
    b = make_batch([(0, 4), (5, 3)], head_size=16, block_size=4)
    _write(b, b.meta.slot_mapping)
    too_long = b.meta.seq_lens.clone()
    too_long[0] = b.meta.block_tables.shape[1] * 4 + 1
    with pytest.raises(ValueError, match="longer than its block table covers"):
        _attend(b, seq_lens=too_long)


@pytest.mark.parametrize("field, bad, match", [
    ("qsl", lambda m: m.query_start_loc.flip(0), "query_start_loc must start at 0"),
    ("qsl", lambda m: m.query_start_loc[:-1], "describe the same sequences"),
    ("tables", lambda m: m.block_tables.float(), "integer tensor"),
    ("seq_lens", lambda m: m.seq_lens[:1], "describe the same sequences"),
])
def test_inconsistent_metadata_is_refused(field, bad, match):
    b = make_batch([(0, 4), (5, 3)], head_size=16, block_size=4)
    _write(b, b.meta.slot_mapping)
    with pytest.raises(ValueError, match=match):
        _attend(b, **{field: bad(b.meta)})


def test_head_counts_and_dtypes_are_checked():
    b = make_batch([(0, 4)], head_size=16, block_size=4)
    with pytest.raises(ValueError, match="dtype"):
        torch.ops.pagedattn.write_kv_cache(b.key.double(), b.value.double(), b.kv_cache, b.meta.slot_mapping)
    with pytest.raises(ValueError, match="kv heads"):
        torch.ops.pagedattn.paged_attention(
            b.query, b.key, b.value, b.kv_cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc,
            0.125, True, 0, 0.0, None, 1, 16)


def test_good_metadata_is_checked_once_per_step(monkeypatch):
    from pagedattn.backends import metadata

    b = make_batch([(0, 4), (9, 1)], head_size=16, block_size=4)
    calls = []
    inner = metadata._value_check
    monkeypatch.setattr(metadata, "_value_check", lambda *a: (calls.append(a[0]), inner(*a))[1])
    meta = build_metadata([(0, 4, b.meta.block_tables[0].tolist()), (9, 1, b.meta.block_tables[1].tolist())], 4)
    for _layer in range(3):  # the same step's tensors, as every layer of a model passes them
        torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, meta.slot_mapping)
        torch.ops.pagedattn.paged_attention(
            b.query, b.key, b.value, b.kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            0.125, True, 0, 0.0, None, b.key.shape[1], b.value.shape[2])
    # one step: the write's two value checks and the attend's three, not one set per layer; none for the write where
    # its kernel reads every slot before it writes any (the native one)
    from pagedattn.backends import active_backend

    kernel_checks = active_backend(b.kv_cache.device).write_checks_slots(b.key, b.value, b.kv_cache, meta.slot_mapping)
    assert calls.count("write_kv_cache") == (0 if kernel_checks else 2) and calls.count("paged_attention") == 3


def test_the_native_write_refuses_bad_slots_as_the_checks_word_it(monkeypatch):
    # the checks leave the values to a kernel that reads them all first; its refusal names the slot's fault
    from pagedattn.backends import active_backend

    b = make_batch([(0, 4)], head_size=16, block_size=4)
    if not active_backend(b.kv_cache.device).write_checks_slots(b.key, b.value, b.kv_cache, b.meta.slot_mapping):
        pytest.skip("no native write here")
    for bad, match in ((-2, "negative other than -1"), (10_000, "outside the cache's 16 slots")):
        slots = b.meta.slot_mapping.clone()
        slots[2] = bad
        before = b.kv_cache.clone()
        with pytest.raises(ValueError, match=match):
            _write(b, slots)
        assert torch.equal(b.kv_cache, before)


def test_alternating_metadata_is_checked_once_per_step(monkeypatch):
    """An encoder-decoder step alternates its own metadata and the cross-attention metadata layer by
    layer: each set is checked once, and a set whose tensor changed in place is checked again."""
    from pagedattn.backends import metadata

    b = make_batch([(0, 4), (9, 1)], head_size=16, block_size=4)
    calls = []
    inner = metadata._value_check
    monkeypatch.setattr(metadata, "_value_check", lambda *a: (calls.append(a[0]), inner(*a))[1])
    tables = [b.meta.block_tables[0].tolist(), b.meta.block_tables[1].tolist()]
    own = build_metadata([(0, 4, tables[0]), (9, 1, tables[1])], 4)
    cross = build_metadata([(0, 4, tables[0]), (9, 1, tables[1])], 4)

    def layer(meta):
        torch.ops.pagedattn.paged_attention(
            b.query, b.key, b.value, b.kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            0.125, True, 0, 0.0, None, b.key.shape[1], b.value.shape[2])

    for _layer in range(3):
        layer(own)
        layer(cross)
    assert calls.count("paged_attention") == 6  # three checks for each of the two sets
    cross.seq_lens[1] = 100  # longer than its block table: found although these tensors passed before
    with pytest.raises(ValueError, match="longer than its block table"):
        layer(cross)


@pytest.mark.parametrize("on_host", [True, False], ids=["host_lists", "tensor_ops"])
@pytest.mark.parametrize("field, bad, match", [
    ("qsl", lambda m: torch.tensor([0, 5, 4], dtype=torch.int32), "never decrease"),
    ("qsl", lambda m: torch.tensor([0, 4, 99], dtype=torch.int32), "end at most at the 7 tokens"),
    ("qsl", lambda m: torch.tensor([1, 4, 7], dtype=torch.int32), "start at 0"),
    ("seq_lens", lambda m: torch.tensor([4, 2], dtype=torch.int32), "shorter than its new tokens"),
    ("bidirectional_seq_lens", lambda m: torch.tensor([-1, 8], dtype=torch.int32), "negative"),
])
def test_the_value_checks_refuse_alike_on_the_host_and_as_tensor_ops(monkeypatch, on_host, field, bad, match):
    # the CPU reads the step's metadata as lists (metadata._values_on_host); other devices keep tensor ops: the
    # same refusals either way
    from pagedattn.backends import metadata

    monkeypatch.setattr(metadata, "_values_on_host", lambda t: on_host)
    b = make_batch([(0, 4), (5, 3)], head_size=16, block_size=4)
    _write(b, b.meta.slot_mapping)
    causal = not field.startswith("bidirectional_")  # a causal call refuses a short seq_len first
    with pytest.raises(ValueError, match=match):
        _attend(b, causal=causal, **{field.removeprefix("bidirectional_"): bad(b.meta)})
    _attend(b, causal=causal)  # good metadata passes either way


@pytest.mark.parametrize("on_host", [True, False], ids=["host_lists", "tensor_ops"])
def test_a_sequence_past_the_sites_length_is_refused_on_the_host_and_as_tensor_ops(monkeypatch, on_host):
    from pagedattn.backends import metadata

    monkeypatch.setattr(metadata, "_values_on_host", lambda t: on_host)
    b = make_batch([(0, 4), (5, 3)], head_size=16, block_size=4)
    _write(b, b.meta.slot_mapping)
    m = b.meta
    args = (b.query, b.key, b.value, b.kv_cache, m.block_tables, m.seq_lens, m.query_start_loc, 0.125, True, 0, 0.0,
            None, b.key.shape[1], b.value.shape[2], None, 0)
    with pytest.raises(ValueError, match="established for"):
        torch.ops.pagedattn.paged_attention(*args, 7)  # the longest sequence holds 8 keys
    torch.ops.pagedattn.paged_attention(*args, 8)
