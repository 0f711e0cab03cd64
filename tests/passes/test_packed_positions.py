"""``packed_positions``: positions a model numbers itself (``arange`` over the tokens) follow each packed sequence."""

import pytest
import torch
from torch import nn

from pagedattn.backends import build_metadata
from pagedattn.passes import (
    CANONICAL_PIPELINE,
    PAGED_PIPELINE,
    insert_paged,
    packed_positions,
    remove_dead_code,
    run_pipeline,
)

from ..rewriter import zoo
from ..support import aten_graph


class LearnedPositions(zoo.NanoGPT):
    """A position embedding looked up with ``arange(T)``: no position input."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(64, zoo.C)

    def forward(self, x):
        return super().forward(x + self.pos(torch.arange(x.shape[1])))


class RotaryPositions(zoo.NanoGPT):
    """Rotary-style cos/sin of ``arange(T)`` mixed into the input."""

    def forward(self, x):
        half = zoo.C // 2
        freq = 1.0 / (100 ** (torch.arange(half) / half))
        angle = torch.arange(x.shape[1])[:, None] * freq[None]  # [T, C/2]
        a, b = x[..., :half], x[..., half:]
        x = torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1)
        return super().forward(x)


def _paged_graph(module, passes):
    gm, ctx = aten_graph(module, (torch.randn(2, 8, zoo.C),))
    run_pipeline(gm, ctx, CANONICAL_PIPELINE)
    return gm, run_pipeline(gm, ctx, passes)


def _packed(gm, seqs, block_size=4):
    """Fresh sequences ``[1, T_i, C]`` packed in one paged step; per-sequence outputs."""
    tables, start = [], 0
    for x in seqs:
        n = -(-x.shape[1] // block_size)
        tables.append((0, x.shape[1], list(range(start, start + n))))
        start += n
    cache = torch.zeros(2, start, block_size, zoo.H, zoo.D)
    with torch.no_grad():
        (out,) = gm(torch.cat(seqs, 1), cache, *build_metadata(tables, block_size).tensors())
    return out.split([x.shape[1] for x in seqs], 1)


@pytest.mark.parametrize("cls", [LearnedPositions, RotaryPositions])
def test_each_packed_sequence_counts_from_its_own_start(cls):
    m = cls().eval()
    a, b = torch.randn(1, 7, zoo.C), torch.randn(1, 5, zoo.C)
    with torch.no_grad():
        want = m(a), m(b)
    gm, reports = _paged_graph(m, PAGED_PIPELINE)
    (report,) = [r for r in reports if r.name == "packed_positions"]
    assert report.changed and "step indices made positions" in report.detail
    pa, pb = _packed(gm, [a, b])
    torch.testing.assert_close(pa, want[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pb, want[1], atol=2e-5, rtol=1e-4)  # positions 0..4, not 7..11
    # without the pass the second sequence continues the first one's positions
    gm, _ = _paged_graph(m, (insert_paged, remove_dead_code))
    _, pb = _packed(gm, [a, b])
    assert not torch.allclose(pb, want[1], atol=1e-3)


def test_models_without_such_ranges_are_left_alone():
    gm, reports = _paged_graph(zoo.NanoGPT().eval(), PAGED_PIPELINE)
    (report,) = [r for r in reports if r.name == "packed_positions"]
    assert not report.changed and report.detail == "no step indices"
    gm, ctx = aten_graph(zoo.CrossAttention().eval(), zoo.example_args("cross_attention"))
    run_pipeline(gm, ctx, CANONICAL_PIPELINE + (insert_paged,))
    assert packed_positions(gm, ctx).detail == "no paged sites"
