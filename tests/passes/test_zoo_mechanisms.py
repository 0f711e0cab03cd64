"""Mechanisms the model-zoo sweep needed, on small hand-written modules."""

import math

import pytest
import torch
from torch import nn

import pagedattn

from ..rewriter import zoo
from ..support import run_packed

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


def _rewritten_matches_eager(m):
    """Rewrite ``m`` (one site), then compare drop-in and packed paged outputs with eager; the site's report."""
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, C),), block_size=4)
    (site,) = rm.report
    assert site["status"] == "rewritten", site
    x = torch.randn(2, 11, C)
    a, b = torch.randn(1, 9, C), torch.randn(1, 4, C)
    pa, pb = run_packed(rm, [a, b])
    with torch.no_grad():
        torch.testing.assert_close(rm(x), m(x), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(pa, m(a), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(pb, m(b), atol=2e-5, rtol=1e-4)
    return site


def test_value_head_size_differs_from_key():
    m = LatentHeads().eval()
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, C),), block_size=4)
    (site,) = rm.report
    assert site["status"] == "rewritten" and site["head_dim"] == 12  # values zero-padded to the key size
    x = torch.randn(3, 11, C)
    with torch.no_grad():
        torch.testing.assert_close(rm(x), m(x), atol=2e-5, rtol=1e-4)
    a, b = torch.randn(1, 5, C), torch.randn(1, 9, C)
    pa, pb = run_packed(rm, [a, b])
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
    pa, pb = run_packed(rm, [a, b])
    with torch.no_grad():
        torch.testing.assert_close(pa, m(a), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(pb, m(b), atol=2e-5, rtol=1e-4)


def test_positions_numbered_in_the_model_follow_each_packed_sequence():
    m = LearnedPositions().eval()
    rm = pagedattn.rewrite(m, (torch.randn(1, 8, C),), block_size=4)
    assert rm.report[0]["status"] == "rewritten"
    a, b = torch.randn(1, 7, C), torch.randn(1, 5, C)
    pa, pb = run_packed(rm, [a, b])
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


class Sinks(zoo._Base):
    """gpt-oss attention: one learned sink logit per head joins the softmax, its column is dropped."""

    def __init__(self, order="last", from_state=True, drop=True, minus_max=True):
        super().__init__()
        self.sinks = nn.Parameter(torch.linspace(-1.0, 2.0, H))
        self.order, self.from_state, self.drop, self.minus_max = order, from_state, drop, minus_max

    def forward(self, x):
        q, k, v = self.qkv(x)
        B, T = x.shape[:2]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        s = s + torch.zeros(T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        logit = self.sinks if self.from_state else q.mean((0, 2, 3))  # counter-example: computed from tokens
        col = logit.reshape(1, -1, 1, 1).expand(B, -1, T, -1)
        s = torch.cat([s, col] if self.order == "last" else [col, s], dim=-1)
        if self.minus_max:
            s = s - s.max(dim=-1, keepdim=True).values
        p = s.softmax(-1)
        if not self.drop:  # counter-example: the sink column kept, weighting a padded value
            return self.merge(p @ torch.cat([v, v[:, :, :1]], 2))
        p = p[..., :-1] if self.order == "last" else p[..., 1:]
        return self.merge(p @ v)


def test_attention_sinks_become_a_paged_argument():
    site = _rewritten_matches_eager(Sinks().eval())
    assert site["sinks"] and site["mask"] == "causal"


@pytest.mark.parametrize("kw, reason", [
    ({"order": "first"}, "attention sinks in a form"),
    ({"from_state": False}, "attention sinks in a form"),
    ({"drop": False}, "sink column is not sliced off"),
])
def test_sinks_counter_examples(kw, reason):
    m = Sinks(**kw).eval()
    sites = [r for r in pagedattn.rewrite(m, (torch.randn(1, 8, C),), block_size=4).report
             if r["attention"]]
    assert sites and all(r["status"] == "skipped" for r in sites), sites
    assert reason in sites[0]["reason"], sites[0]["reason"]


class LseSinks(zoo._Base):
    """Granite-style sinks applied after the fact: softmax·V rescaled by sigmoid(logsumexp(s) - sink)."""

    def __init__(self, with_sink=True):
        super().__init__()
        self.sinks = nn.Parameter(torch.linspace(-1.0, 2.0, H))
        self.with_sink = with_sink

    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        s = s + torch.zeros(T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [B, H, T]
        o = s.softmax(-1) @ v
        if self.with_sink:
            return self.merge(o * (lse - self.sinks.view(1, -1, 1)).float().sigmoid().unsqueeze(-1))
        return self.merge(o) + lse.mean()  # counter-example: a dense function of the scores leaves the site


def test_sinks_applied_by_logsumexp():
    assert _rewritten_matches_eager(LseSinks().eval())["sinks"]


def test_scores_read_outside_the_softmax_are_not_rewritten():
    (site,) = pagedattn.rewrite(LseSinks(with_sink=False).eval(), (torch.randn(2, 8, C),)).report
    assert site["status"] == "skipped" and "outside the softmax" in site["reason"], site


class MultiplicativeMask(zoo._Base):
    """GPT-1: ``w * b + -1e4 * (1 - b)`` with ``b`` a 0/1 causal buffer."""

    def __init__(self, variant="gpt1"):
        super().__init__()
        self.register_buffer("b", torch.ones(64, 64).tril()[None, None])
        self.variant = variant

    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        w = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        b = self.b[:, :, :T, :T]
        if self.variant == "gpt1":
            w = w * b + -1e4 * (1 - b)
        elif self.variant == "zero_only":  # counter-example: zeroed scores still take probability
            w = w * b
        elif self.variant == "mask_then_zero":  # counter-example: the factor undoes the mask before it
            w = (w + -1e4 * (1 - b)) * b
        else:  # counter-example: a learned scale, not a mask
            w = w * (b + 0.5) + -1e4 * (1 - b)
        return self.merge(w.softmax(-1) @ v)


def test_multiplicative_mask():
    assert _rewritten_matches_eager(MultiplicativeMask().eval())["mask"] == "causal"


@pytest.mark.parametrize("variant, reason", [
    ("zero_only", "zero is a score, not a mask"),
    ("mask_then_zero", "zero is a score, not a mask"),
    ("scale", "not a 0/1 mask"),
])
def test_multiplicative_mask_counter_examples(variant, reason):
    (site,) = pagedattn.rewrite(MultiplicativeMask(variant).eval(), (torch.randn(2, 8, C),)).report
    assert site["status"] == "skipped" and reason in site["reason"], site
