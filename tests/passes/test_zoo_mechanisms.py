"""Mechanisms the model-zoo sweep needed, on small hand-written modules."""

import math

import torch
from torch import nn

import pagedattn
from pagedattn.backends import build_metadata

from ..rewriter import zoo

C, H, D = zoo.C, zoo.H, zoo.D


class LatentHeads(nn.Module):
    """Query/key heads of 12 and value heads of 6 (multi-head latent attention's shape)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = nn.Linear(C, H * 12), nn.Linear(C, H * 12), nn.Linear(C, H * 6)
        self.o = nn.Linear(H * 6, C)

    def forward(self, x):
        B, T, _ = x.shape
        q, k = (p(x).view(B, T, H, 12).transpose(1, 2) for p in (self.q, self.k))
        v = self.v(x).view(B, T, H, 6).transpose(1, 2)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(12)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * 6))


class WithRouter(zoo.NanoGPT):
    """Attention followed by a mixture-of-experts gate (a softmax that is no attention)."""

    def __init__(self):
        super().__init__()
        self.router = zoo.Router()

    def forward(self, x):
        return self.router(super().forward(x))


class LearnedPositions(zoo.NanoGPT):
    """Positions numbered inside the model from ``arange(T)``: no position input."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(128, C)

    def forward(self, x):
        return super().forward(x + self.pos(torch.arange(x.shape[1])))


class ClampedScores(zoo._Base):
    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), torch.finfo(s.dtype).min)
        s = torch.max(s, torch.tensor(torch.finfo(s.dtype).min))
        return self.merge(s.softmax(-1) @ v)


def _paged(rm, seqs, block_size=4):
    """Run sequences packed in one [1, T] row, each in fresh blocks; per-sequence outputs."""
    tables, start = [], 0
    for x in seqs:
        n = -(-x.shape[1] // block_size)
        tables.append((0, x.shape[1], list(range(start, start + n))))
        start += n
    caches = rm.allocate_kv_caches(start + 1)
    with torch.no_grad(), pagedattn.paged_context(caches, build_metadata(tables, block_size)):
        out = rm(torch.cat(seqs, 1))
    return out.split([x.shape[1] for x in seqs], 1)


def test_value_head_size_differs_from_key():
    m = LatentHeads().eval()
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, C),), block_size=4)
    (site,) = rm.report
    assert site["status"] == "rewritten" and site["head_dim"] == 12  # values zero-padded to the key size
    x = torch.randn(3, 11, C)
    with torch.no_grad():
        torch.testing.assert_close(rm(x), m(x), atol=2e-5, rtol=1e-4)
    a, b = torch.randn(1, 5, C), torch.randn(1, 9, C)
    pa, pb = _paged(rm, [a, b])
    with torch.no_grad():
        torch.testing.assert_close(pa, m(a), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(pb, m(b), atol=2e-5, rtol=1e-4)


def test_router_softmax_does_not_block_paged_mode():
    m = WithRouter().eval()
    rm = pagedattn.rewrite(m, (torch.randn(1, 8, C),), block_size=4)
    attn = [r for r in rm.report if r["attention"]]
    other = [r for r in rm.report if not r["attention"]]
    assert len(attn) == 1 and attn[0]["status"] == "rewritten"
    assert len(other) == 1 and other[0]["status"] == "skipped" and "not attention" in other[0]["reason"]
    a, b = torch.randn(1, 6, C), torch.randn(1, 3, C)
    pa, pb = _paged(rm, [a, b])
    with torch.no_grad():
        torch.testing.assert_close(pb, m(b), atol=2e-5, rtol=1e-4)


def test_positions_numbered_in_the_model_follow_each_packed_sequence():
    m = LearnedPositions().eval()
    rm = pagedattn.rewrite(m, (torch.randn(1, 8, C),), block_size=4)
    assert rm.report[0]["status"] == "rewritten"
    a, b = torch.randn(1, 7, C), torch.randn(1, 5, C)
    pa, pb = _paged(rm, [a, b])
    with torch.no_grad():
        torch.testing.assert_close(pa, m(a), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(pb, m(b), atol=2e-5, rtol=1e-4)  # positions 0..4, not 7..11


def test_scores_clamped_at_dtype_minimum():
    m = ClampedScores().eval()
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, C),))
    assert rm.report[0]["status"] == "rewritten" and rm.report[0]["mask"] == "causal"
    x = torch.randn(3, 13, C)
    with torch.no_grad():
        torch.testing.assert_close(rm(x), m(x), atol=2e-5, rtol=1e-4)
