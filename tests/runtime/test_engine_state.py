"""Models with recurrent state beside attention: a state slot per request next to the paged KV cache."""

import pytest
import torch

from pagedattn import PagedEngine
from pagedattn.adapter import prepare_model
from pagedattn.hf_state import StateLayout, find_recurrent_state, get_state, set_state, state_tensors
from pagedattn.runtime.state import StatePool, StateSlot

from ..support import hf_generate, prompts, tiny_lfm2, tiny_mamba, tiny_model, tiny_rwkv

NEW = 8


@pytest.fixture(scope="module")
def lfm2():
    """LFM2 (conv state beside a full attention layer), its HF greedy tokens, and the model prepared for the
    engine with 4-token blocks (tracing its state steps once for the tests that only serve it)."""
    m = tiny_lfm2()
    return m, hf_generate(m, prompts(), NEW), prepare_model(m, block_size=4)


def test_layout_names_the_conv_states(lfm2):
    m, _, _ = lfm2
    layout = find_recurrent_state(m)
    kinds = m.config.layer_types
    assert layout is not None and layout.cache_arg == "past_key_values"
    assert [s.path for s in layout.slots] == [("layers", i, "conv_states", 0) for i, k in enumerate(kinds) if k == "conv"]
    assert layout.bytes_per_sequence == sum(torch.Size(s.shape).numel() * 4 for s in layout.slots)


def test_models_without_state_have_no_layout():
    assert find_recurrent_state(tiny_model("llama")) is None


@pytest.mark.parametrize("settings", [
    {},
    {"max_num_tokens": 6},  # prompts in chunks: each chunk continues the state
    {"num_blocks": 14, "block_size": 4},  # preempted and recomputed from a fresh state
    {"num_blocks": 14, "block_size": 4, "preemption_mode": "swap"},  # the state slot waits while blocks are out
], ids=["default", "chunked", "recompute", "swap"])
def test_generation_equals_hf(lfm2, settings):
    m, ref, servable = lfm2
    # the default setting takes the model itself; the others serve the same preparation (4-token blocks)
    engine = PagedEngine(servable, compile=False, **settings) if settings else PagedEngine(m, compile=False, block_size=4)
    assert engine.servable.state is not None and engine.blocks.enable_prefix_caching is False
    assert engine.block_size == engine.blocks.block_size == 4  # the servable's, whatever block_size says
    assert engine.generate(prompts(), max_new_tokens=NEW) == ref
    if "num_blocks" in settings:
        assert engine.stats["preemptions"] > 0
    assert engine.states.slot_of == {}  # finished requests give their slots back


def test_decode_steps_batch_the_sequences(lfm2, monkeypatch):
    engine = PagedEngine(lfm2[2], compile=False)
    calls = []
    inner = engine.model.forward

    def spy(**kw):
        calls.append(tuple(kw["input_ids"].shape))
        return inner(**kw)

    monkeypatch.setattr(engine.model, "forward", spy)  # the step is shared: put it back afterwards
    engine.generate(prompts()[:3], max_new_tokens=3)
    assert (3, 1) in calls  # the three sequences' decode tokens as one batch of rows
    prefill = [b for b, t in calls if t > 1]
    assert len(prefill) == 3 and set(prefill) == {1}  # a prefill chunk runs alone in its row


def test_state_outside_the_cache_is_refused(lfm2, monkeypatch):
    m, _, _ = lfm2
    from pagedattn import hf_state

    # a step that drops the carried state: the engine's check against the model's own forward catches it
    real = hf_state.set_state
    monkeypatch.setattr(hf_state, "set_state", lambda cache, path, t: real(cache, path, torch.zeros_like(t)))
    with pytest.raises(ValueError, match="differ from the model's own forward"):
        PagedEngine(m, compile=False, block_size=4)


@pytest.fixture(scope="module")
def mamba():
    """Mamba-1 (its selective scan reads the carried state on single-token steps only) and its HF tokens."""
    m = tiny_mamba()
    return m, hf_generate(m, prompts(), NEW)


def test_state_read_one_token_at_a_time(mamba):
    m, ref = mamba
    engine = PagedEngine(m, compile=False, block_size=4, num_blocks=20)  # 20 blocks: preemptions too
    assert engine.servable.token_steps and engine.cache_specs == []  # no attention at all: state alone
    shapes, inner = [], engine.model.forward

    def spy(**kw):
        shapes.append(tuple(kw["input_ids"].shape))
        return inner(**kw)

    engine.model.forward = spy
    assert engine.generate(prompts(), max_new_tokens=NEW) == ref
    assert engine.stats["preemptions"] > 0
    assert {t for _, t in shapes} == {1} and max(b for b, _ in shapes) > 1  # rows of one token, batched


@pytest.fixture(scope="module")
def rwkv():
    """RWKV (a state list that does not start from zeros, a single-token path mixing rows) and its HF tokens."""
    m = tiny_rwkv()
    return m, hf_generate(m, prompts()[:3], 4)


def test_state_list_with_its_own_start_runs_a_row_per_call(rwkv):
    m, ref = rwkv
    engine = PagedEngine(m, compile=False, block_size=4)
    sv = engine.servable
    layout = sv.state
    assert layout.cache_arg == "state" and layout.cache_class is list and not layout.starts_from_zeros
    assert sv.fresh_step is not None and sv.token_steps and sv.one_row
    assert engine.generate(prompts()[:3], max_new_tokens=4) == ref


def test_state_paths_through_nested_containers():
    class Own:  # xLSTM's cache: a dict of per-layer tuples beside a counter
        def __init__(self):
            self.rnn_state = {0: (torch.zeros(1, 2), torch.zeros(1, 3)), 1: (torch.zeros(1, 2), torch.zeros(1, 3))}
            self.seqlen_offset = torch.tensor([0])
            self._private = torch.ones(1)

    cache = Own()
    paths = [p for p, _ in state_tensors(cache)]
    assert paths == [("rnn_state", 0, 0), ("rnn_state", 0, 1), ("rnn_state", 1, 0), ("rnn_state", 1, 1),
                     ("seqlen_offset",)]
    set_state(cache, ("rnn_state", 1, 1), torch.ones(4, 3))  # a tuple member: the tuple is rebuilt
    assert torch.equal(get_state(cache, ("rnn_state", 1, 1)), torch.ones(4, 3))
    assert isinstance(cache.rnn_state[1], tuple) and cache.rnn_state[1][0].shape == (1, 2)
    lst = [[], torch.zeros(1)]  # MiniMax's linear_cache: empty entries for layers without state
    set_state(lst, (3,), torch.ones(2))
    assert len(lst) == 4 and lst[2] == [] and torch.equal(lst[3], torch.ones(2))


def _slots():
    return (StateSlot(("layers", 0, "conv_states", 0), (3, 2), torch.float32),
            StateSlot(("linear_cache", 1), (4,), torch.float32))


def test_layout_sizes_and_starts():
    layout = StateLayout(_slots(), "past_key_values", object)
    assert layout.bytes_per_sequence == (3 * 2 + 4) * 4
    assert not layout.starts_from_zeros  # only LinearAttention layers ("layers", ...) start from zeros
    assert StateLayout(_slots()[:1], "past_key_values", object).starts_from_zeros


def test_pool_starts_zeroed_and_round_trips():
    pool = StatePool(_slots(), torch.device("cpu"), capacity=2)
    pool.start(7), pool.start(9)
    new = [torch.ones(2, 3, 2), torch.arange(8.).reshape(2, 4)]
    pool.scatter([9, 7], new)
    got = pool.gather([7, 9])
    assert torch.equal(got[1], torch.arange(8.).reshape(2, 4)[[1, 0]])
    pool.start(7)  # recomputed from its first token: a fresh state
    assert pool.gather([7])[0].abs().sum() == 0 and pool.gather([9])[0].sum() == 6


def test_pool_grows_and_reuses_slots():
    pool = StatePool(_slots(), torch.device("cpu"), capacity=1)
    for rid in range(5):
        pool.start(rid)
    assert pool.capacity >= 5 and len(set(pool.slot_of.values())) == 5
    pool.release(2)
    pool.start(11)
    assert pool.slot_of[11] not in {pool.slot_of[r] for r in (0, 1, 3, 4)}
    with pytest.raises(RuntimeError, match="never started"):
        pool.gather([2])
