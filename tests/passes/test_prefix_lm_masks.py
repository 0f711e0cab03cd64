"""Prefix-LM masks over per-request values: proven from token types (or a prefix length) for every length
and every input of the proven shape, served by their position program, or left with the reason.

The drop-in checks run at 300+ tokens, past the 8-token trace, with spans of several lengths per row.
"""

import pytest
import torch
from torch import nn

import pagedattn

from ..rewriter import zoo

C, H, D = zoo.C, zoo.H, zoo.D


def _groups(tt: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token group ids (-1: none) as the models build them."""
    if kind == "prefix":  # PaliGemma: every 0 (image and prompt) is one bidirectional group
        return torch.where(tt == 0, 0, -1)
    is_img = tt == 1  # Gemma-3: each run of 1s (an image) a group of its own, numbered by a running count
    prev = nn.functional.pad(is_img, (1, 0), value=0)[:, :-1]
    return torch.where(is_img, torch.cumsum((is_img & ~prev).int(), 1) - 1, -1)


class TokenTypeMask(zoo._Base):
    """Causal attention, bidirectional inside each group of ``_groups(token_type_ids, kind)``; ``extra``
    (query types, key types, query pos, key pos) -> more keys to see, for counter-examples."""

    def __init__(self, kind="prefix", extra=None, window=None):
        super().__init__()
        self.kind, self.extra, self.window = kind, extra, window

    def forward(self, x, token_type_ids):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        grp = _groups(token_type_ids, self.kind)
        keep = (j <= i)[None] | ((grp[:, :, None] == grp[:, None, :]) & (grp[:, :, None] >= 0))
        if self.extra is not None:
            keep = keep | self.extra(token_type_ids[:, :, None], token_type_ids[:, None, :], i, j)
        if self.window is not None:  # Gemma-3's sliding layers: window AND (causal OR block)
            keep = keep & (j > i - self.window)[None]
        s = (q @ k.transpose(-1, -2)) * D ** -0.5
        return self.merge(torch.softmax(s.masked_fill(~keep[:, None], float("-inf")), -1) @ v)


class PrefixLength(zoo._Base):
    """Every key before the row's prefix length is seen (and biased by +0.5); causal after."""

    def forward(self, x, prefix_len):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        prefix = j[None] < prefix_len[:, None, None]
        keep = (j <= i)[None] | prefix
        s = (q @ k.transpose(-1, -2)) * D ** -0.5 + 0.5 * prefix[:, None].float()
        return self.merge(torch.softmax(s.masked_fill(~keep[:, None], float("-inf")), -1) @ v)


def _site(rm):
    (site,) = [r for r in rm.report if r["attention"]]
    return site


def _types(T: int, spans_per_row, inside: int) -> torch.Tensor:
    tt = torch.full((len(spans_per_row), T), 1 - inside, dtype=torch.long)
    for row, spans in enumerate(spans_per_row):
        for a, b in spans:
            tt[row, a:b] = inside
    return tt


def _dropin_matches(m, rm, *inputs):
    with torch.no_grad():
        got, want = rm(*inputs), m(*inputs)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    return want


def _example_prefix():
    return torch.randn(2, 8, C), torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1]])


def test_paligemma_prefix_is_proven_for_every_length_and_served_by_its_program():
    m = TokenTypeMask("prefix").eval()
    rm = pagedattn.rewrite(m, _example_prefix())
    site = _site(rm)
    assert (site["status"], site["mask"], site["position_values"]) == ("rewritten", "positional", "token_type_ids")
    assert site["mask_up_to"] is None and site["mask_established"] == "proof (position program)"
    spec = rm.value_spec  # all 0s (image and prompt) are one group: one span of 0s, generated tokens are 1s
    assert (spec.kind, spec.inside, spec.outside, spec.runs) == ("runs", 0, 1, 1)
    T = 320
    tt = _types(T, [[], [(0, 17)], [(0, 150)], [(0, T)]], inside=0)
    x = torch.randn(4, T, C, generator=torch.Generator().manual_seed(1))
    want = _dropin_matches(m, rm, x, tt)
    # the check can fail: the prefix changes what its tokens compute
    with torch.no_grad():
        causal = m(x, torch.ones_like(tt))
    assert (want[1:] - causal[1:]).abs().max() > 1e-2


def test_gemma3_image_blocks_are_proven_for_up_to_four_images_per_sequence():
    m = TokenTypeMask("blocks").eval()
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, C), torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0, 0]])))
    site = _site(rm)
    assert (site["status"], site["mask"]) == ("rewritten", "positional"), site
    spec = rm.value_spec
    assert (spec.inside, spec.outside, spec.runs) == (1, 0, 4)
    T = 330
    tt = _types(T, [[], [(0, 64)], [(5, 40), (41, 42), (100, 190), (250, 300)], [(290, 330)]], inside=1)
    x = torch.randn(4, T, C, generator=torch.Generator().manual_seed(2))
    _dropin_matches(m, rm, x, tt)
    # a fifth image, or a type the proof did not cover, is refused in one line naming the input
    five = _types(T, [[(1, 3), (5, 7), (9, 11), (13, 15), (17, 19)]], inside=1)
    with pytest.raises(ValueError, match="'token_type_ids' has 5 runs of 1s"):
        rm(x[:1], five)
    with pytest.raises(ValueError, match="'token_type_ids' holds values other than 0 and 1"):
        rm(x[:1], tt[2:3] * 2)


def test_sliding_layers_over_image_blocks():
    # Gemma-3's local layers: a window, and within it bidirectional image blocks
    m = TokenTypeMask("blocks", window=6).eval()
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, C), torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0, 0]])))
    assert _site(rm)["status"] == "rewritten"
    T = 300
    tt = _types(T, [[(10, 40), (200, 203)], [(0, 5)]], inside=1)
    _dropin_matches(m, rm, torch.randn(2, T, C), tt)


def test_a_prefix_length_input_is_proven_and_checked_at_call_time():
    m = PrefixLength().eval()
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, C), torch.tensor([3, 5])))
    site = _site(rm)
    assert (site["status"], site["mask"], site["position_values"]) == ("rewritten", "positional", "prefix_len")
    assert rm.value_spec.kind == "scalar"
    x = torch.randn(3, 300, C)
    _dropin_matches(m, rm, x, torch.tensor([0, 17, 150]))
    with pytest.raises(ValueError, match="'prefix_len' holds a negative length"):
        rm(x, torch.tensor([0, -1, 3]))


# ------------------------------------------------------------------------ counter-examples


@pytest.mark.parametrize("extra, why", [
    # every query sees every image token, also the later ones (text before an image sees the image)
    (lambda tq, tk, i, j: tk == 1, "later key outside its own span"),
    # prefix queries see the suffix after them: bidirectional over the wrong part
    (lambda tq, tk, i, j: (tq == 0) & (tk == 1), "later key outside its own span"),
    # a query sees the token after it whenever that one is an image token
    (lambda tq, tk, i, j: (j == i + 1) & (tk == 1), "later key outside its own span"),
], ids=["images_seen_by_all", "prefix_sees_suffix", "next_image_token"])
def test_masks_that_see_later_keys_outside_a_span_are_left(extra, why):
    m = TokenTypeMask("blocks", extra=extra).eval()
    site = _site(pagedattn.rewrite(m, (torch.randn(2, 8, C), torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0],
                                                                           [0, 0, 1, 1, 1, 0, 0, 0]]))))
    assert site["status"] == "skipped" and why in site["reason"], site


def test_token_types_of_more_than_two_values_are_token_values():
    m = TokenTypeMask("blocks").eval()
    site = _site(pagedattn.rewrite(m, (torch.randn(2, 8, C), torch.tensor([[0, 1, 2, 0, 1, 1, 1, 0],
                                                                           [0, 0, 1, 1, 1, 0, 0, 0]]))))
    assert site["status"] == "skipped" and "token values" in site["reason"], site


def test_pad_token_masks_beside_token_types_stay_refused():
    class PadTokenAndTypes(TokenTypeMask):
        def forward(self, x, token_type_ids, ids):
            q, k, v = self.qkv(x)
            T = x.shape[1]
            i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
            grp = _groups(token_type_ids, "prefix")
            keep = ((j <= i)[None] | ((grp[:, :, None] == grp[:, None, :]) & (grp[:, :, None] >= 0))) \
                & (ids != 0)[:, None, :]
            s = (q @ k.transpose(-1, -2)) * D ** -0.5
            return self.merge(torch.softmax(s.masked_fill(~keep[:, None], float("-inf")), -1) @ v)

    x, tt = _example_prefix()
    site = _site(pagedattn.rewrite(PadTokenAndTypes().eval(), (x, tt, torch.randint(1, 50, (2, 8)))))
    assert site["status"] == "skipped" and "token values of input 'ids'" in site["reason"], site


def test_a_mask_named_as_padding_is_never_read_as_token_types():
    class QueryMask(zoo._Base):  # masks queries by attention_mask: not key padding, and not token types
        def forward(self, x, attention_mask):
            q, k, v = self.qkv(x)
            T = x.shape[1]
            keep = torch.ones(T, T, dtype=torch.bool).tril()[None, None] | attention_mask[:, None, :, None].bool()
            s = (q @ k.transpose(-1, -2)) * D ** -0.5
            return self.merge(s.masked_fill(~keep, -1e9).softmax(-1) @ v)

    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1]])
    site = _site(pagedattn.rewrite(QueryMask().eval(), (torch.randn(2, 8, C), mask)))
    assert site["status"] == "skipped" and "token types" not in site["reason"], site


def test_sites_reading_token_types_differently_are_not_both_served():
    class TwoLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = TokenTypeMask("blocks"), TokenTypeMask("prefix")

        def forward(self, x, token_type_ids):
            return self.b(self.a(x, token_type_ids), token_type_ids)

    x = torch.randn(2, 8, C)
    tt = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]])
    rm = pagedattn.rewrite(TwoLayers().eval(), (x, tt))
    status = [(r["status"], r["reason"]) for r in rm.report if r["attention"]]
    assert status[0][0] == "rewritten" and status[1][0] == "skipped" and "another site" in status[1][1], status
