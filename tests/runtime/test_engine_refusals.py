"""PagedEngine refuses models whose tokens influence each other outside attention."""

import pytest
import torch
from torch import nn

from pagedattn import PagedEngine

from ..rewriter import zoo


class _LM(nn.Module):
    def __init__(self, conv: bool, positions: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos = nn.Embedding(64, zoo.C), nn.Embedding(128, zoo.C)
        self.conv = nn.Conv1d(zoo.C, zoo.C, 2) if conv else None
        self.attn = zoo.NanoGPT()
        self.head = nn.Linear(zoo.C, 64)
        self.positions = positions

    def logits(self, input_ids, position_ids):
        x = self.emb(input_ids) + self.pos(position_ids)
        if self.conv is not None:  # a causal convolution along the row: state outside attention
            x = x + self.conv(nn.functional.pad(x.transpose(1, 2), (1, 0))).transpose(1, 2)
        return self.head(self.attn(x))


class ConvLM(_LM):
    def __init__(self):
        super().__init__(conv=True, positions=True)

    def forward(self, input_ids, position_ids):
        return self.logits(input_ids, position_ids)


class IndexPositionsLM(_LM):
    """Positions from the token's index in the row; no position_ids input."""

    def __init__(self):
        super().__init__(conv=False, positions=False)

    def forward(self, input_ids):
        return self.logits(input_ids, torch.arange(input_ids.shape[1])[None])


class PlainLM(ConvLM):
    def __init__(self):
        _LM.__init__(self, conv=False, positions=True)


def test_state_outside_attention_is_refused():
    with pytest.raises(ValueError, match="outside attention"):
        PagedEngine(ConvLM().eval())


def test_positions_from_the_row_index_are_made_per_sequence():
    # the rewrite turns arange(T) feeding the position embedding into each packed sequence's positions
    m = IndexPositionsLM().eval()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5]]
    got = PagedEngine(m, block_size=4).generate(prompts, max_new_tokens=4)
    want = []
    for p in prompts:
        ids = list(p)
        for _ in range(4):
            with torch.no_grad():
                ids.append(int(m(torch.tensor([ids]))[0, -1].argmax()))
        want.append(ids[len(p):])
    assert got == want


def test_plain_model_is_served():
    PagedEngine(PlainLM().eval())


class KwargsPositionsLM(_LM):
    """Positions arrive through ``**kwargs`` (Hugging Face's decoder-only wrappers pass them on that way)."""

    def __init__(self, honour=True):
        super().__init__(conv=False, positions=True)
        self.honour = honour

    def forward(self, input_ids, **kwargs):
        pos = kwargs.get("position_ids") if self.honour else None
        return self.logits(input_ids, pos if pos is not None else torch.arange(input_ids.shape[1])[None])


def _greedy(m, prompts, n):
    out = []
    for p in prompts:
        ids = list(p)
        for _ in range(n):
            with torch.no_grad():
                ids.append(int(m(torch.tensor([ids]))[0, -1].argmax()))
        out.append(ids[len(p):])
    return out


def test_positions_through_kwargs_are_passed():
    m = KwargsPositionsLM().eval()
    engine = PagedEngine(m, block_size=4)
    assert "position_ids" in engine._kwargs  # found by probing: shifted positions change the logits
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5]]
    assert engine.generate(prompts, max_new_tokens=4) == _greedy(m, prompts, 4)


def test_kwargs_that_ignore_positions_are_not_passed():
    engine = PagedEngine(KwargsPositionsLM(honour=False).eval(), block_size=4)
    assert "position_ids" not in engine._kwargs
