"""Models with recurrent state beside attention: a state slot per request next to the paged KV cache."""

import pytest
import torch

from pagedattn import PagedEngine
from pagedattn.runtime.state import StatePool, StateLayout, StateSlot, find_recurrent_state

from .test_engine import _prompts, _reference

NEW = 8


@pytest.fixture(scope="module")
def lfm2():
    """LFM2: a short-convolution layer (conv state) and a full attention layer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("lfm2", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               layer_types=["conv", "full_attention", "conv"])
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    return m, _reference(m, _prompts(), NEW)


def test_layout_names_the_conv_states(lfm2):
    m, _ = lfm2
    layout = find_recurrent_state(m)
    kinds = m.config.layer_types
    assert layout is not None and layout.cache_arg == "past_key_values"
    assert [s.path for s in layout.slots] == [("layers", i, "conv_states", 0) for i, k in enumerate(kinds) if k == "conv"]
    assert layout.bytes_per_sequence == sum(torch.Size(s.shape).numel() * 4 for s in layout.slots)


def test_models_without_state_have_no_layout():
    from ..rewriter.hf_models import tiny_model as plain

    assert find_recurrent_state(plain("llama")) is None


@pytest.mark.parametrize("settings", [
    {},
    {"max_num_tokens": 6},  # prompts in chunks: each chunk continues the state
    {"num_blocks": 14, "block_size": 4},  # preempted and recomputed from a fresh state
    {"num_blocks": 14, "block_size": 4, "preemption_mode": "swap"},  # the state slot waits while blocks are out
], ids=["default", "chunked", "recompute", "swap"])
def test_generation_equals_hf(lfm2, settings):
    m, ref = lfm2
    engine = PagedEngine(m, **{"block_size": 4, **settings})
    assert engine.state_layout is not None and engine.blocks.enable_prefix_caching is False
    assert engine.generate(_prompts(), max_new_tokens=NEW) == ref
    if "num_blocks" in settings:
        assert engine.stats["preemptions"] > 0
    assert engine.states.slot_of == {}  # finished requests give their slots back


def test_decode_steps_batch_the_sequences(lfm2):
    m, _ = lfm2
    engine = PagedEngine(m, block_size=4)
    calls = []
    inner = engine.model.forward

    def spy(**kw):
        calls.append(tuple(kw["input_ids"].shape))
        return inner(**kw)

    engine.model.forward = spy
    engine.generate(_prompts()[:3], max_new_tokens=3)
    assert (3, 1) in calls  # the three sequences' decode tokens as one batch of rows
    assert all(b == 1 for b, t in calls if t > 1)  # a prefill chunk runs alone in its row


def test_state_outside_the_cache_is_refused(lfm2, monkeypatch):
    m, _ = lfm2
    from pagedattn.runtime import state

    # a step that drops the carried state: the engine's check against the model's own forward catches it
    real = state._set_state
    monkeypatch.setattr(state, "_set_state", lambda cache, path, t: real(cache, path, torch.zeros_like(t)))
    with pytest.raises(ValueError, match="differ from the model's own forward"):
        PagedEngine(m, block_size=4)


@pytest.fixture(scope="module")
def mamba():
    """Mamba-1: its selective scan reads the carried state on single-token steps only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("mamba", vocab_size=128, hidden_size=32, state_size=4, num_hidden_layers=2,
                               expand=2, conv_kernel=3, time_step_rank=4)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    return m, _reference(m, _prompts(), NEW)


def test_state_read_one_token_at_a_time(mamba):
    m, ref = mamba
    engine = PagedEngine(m, block_size=4, num_blocks=20)  # 20 blocks: preemptions too
    assert engine._token_steps and engine.cache_specs == []  # no attention at all: state alone
    shapes, inner = [], engine.model.forward

    def spy(**kw):
        shapes.append(tuple(kw["input_ids"].shape))
        return inner(**kw)

    engine.model.forward = spy
    assert engine.generate(_prompts(), max_new_tokens=NEW) == ref
    assert engine.stats["preemptions"] > 0
    assert {t for _, t in shapes} == {1} and max(b for b, _ in shapes) > 1  # rows of one token, batched


@pytest.fixture(scope="module")
def rwkv():
    """RWKV: a ``state`` list in and out of the forward, its running maximum starting at -1e30 (not zeros),
    and a single-token path that broadcasts the rows of a batch into each other."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("rwkv", vocab_size=128, hidden_size=32, attention_hidden_size=32,
                               intermediate_size=64, num_hidden_layers=2, context_length=256)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    return m, _reference(m, _prompts()[:3], 4)


def test_state_list_with_its_own_start_runs_a_row_per_call(rwkv):
    m, ref = rwkv
    engine = PagedEngine(m, block_size=4)
    layout = engine.state_layout
    assert layout.cache_arg == "state" and layout.cache_class is list and not layout.starts_from_zeros
    assert engine.fresh_model is not None and engine._token_steps and engine._one_row
    assert engine.generate(_prompts()[:3], max_new_tokens=4) == ref


def test_state_paths_through_nested_containers():
    from pagedattn.runtime.state import _get_state, _set_state, _state_tensors

    class Own:  # xLSTM's cache: a dict of per-layer tuples beside a counter
        def __init__(self):
            self.rnn_state = {0: (torch.zeros(1, 2), torch.zeros(1, 3)), 1: (torch.zeros(1, 2), torch.zeros(1, 3))}
            self.seqlen_offset = torch.tensor([0])
            self._private = torch.ones(1)

    cache = Own()
    paths = [p for p, _ in _state_tensors(cache)]
    assert paths == [("rnn_state", 0, 0), ("rnn_state", 0, 1), ("rnn_state", 1, 0), ("rnn_state", 1, 1),
                     ("seqlen_offset",)]
    _set_state(cache, ("rnn_state", 1, 1), torch.ones(4, 3))  # a tuple member: the tuple is rebuilt
    assert torch.equal(_get_state(cache, ("rnn_state", 1, 1)), torch.ones(4, 3))
    assert isinstance(cache.rnn_state[1], tuple) and cache.rnn_state[1][0].shape == (1, 2)
    lst = [[], torch.zeros(1)]  # MiniMax's linear_cache: empty entries for layers without state
    _set_state(lst, (3,), torch.ones(2))
    assert len(lst) == 4 and lst[2] == [] and torch.equal(lst[3], torch.ones(2))


def _layout():
    return StateLayout((StateSlot(("layers", 0, "conv_states", 0), (3, 2), torch.float32),
                        StateSlot(("linear_cache", 1), (4,), torch.float32)), "past_key_values", object)


def test_pool_starts_zeroed_and_round_trips():
    pool = StatePool(_layout(), torch.device("cpu"), capacity=2)
    pool.start(7), pool.start(9)
    new = [torch.ones(2, 3, 2), torch.arange(8.).reshape(2, 4)]
    pool.scatter([9, 7], new)
    got = pool.gather([7, 9])
    assert torch.equal(got[1], torch.arange(8.).reshape(2, 4)[[1, 0]])
    pool.start(7)  # recomputed from its first token: a fresh state
    assert pool.gather([7])[0].abs().sum() == 0 and pool.gather([9])[0].sum() == 6


def test_pool_grows_and_reuses_slots():
    pool = StatePool(_layout(), torch.device("cpu"), capacity=1)
    for rid in range(5):
        pool.start(rid)
    assert pool.capacity >= 5 and len(set(pool.slot_of.values())) == 5
    pool.release(2)
    pool.start(11)
    assert pool.slot_of[11] not in {pool.slot_of[r] for r in (0, 1, 3, 4)}
    with pytest.raises(RuntimeError, match="never started"):
        pool.gather([2])
