import pytest
import torch

from pagedattn.passes import classify_mask, match_attention

from ..rewriter import zoo
from ..support import aten_graph


def classified(module, args, mask_hints=None):
    """The sites of ``module`` after matching and mask classification."""
    gm, ctx = aten_graph(module, args)
    ctx.mask_hints = mask_hints
    match_attention(gm, ctx)
    classify_mask(gm, ctx)
    return ctx.sites


@pytest.mark.parametrize("name, kind, window", [
    ("nanogpt", "causal", None), ("where_mask", "causal", None), ("bmm_3d", "causal", None),
    ("sliding_window", "sliding_window", 100), ("bidirectional", "none", None), ("sdpa_causal", "causal", None),
])
def test_kinds(name, kind, window):
    (site,) = classified(zoo.ATTENTION[name][0](), zoo.example_args(name))
    assert (site.status, site.mask_kind, site.window) == ("matched", kind, window)


class WideWindow(zoo.SlidingWindow):
    window = 4096  # Mistral's default: wider than the example and most probes


def test_window_wider_than_every_short_probe():
    (site,) = classified(WideWindow(), zoo.example_args("sliding_window"))
    assert (site.mask_kind, site.window) == ("sliding_window", 4096)


def test_alibi_slopes():
    (site,) = classified(zoo.ALiBi(), zoo.example_args("alibi"))
    torch.testing.assert_close(site.alibi_slopes, zoo.alibi_slopes(zoo.H))


class PaddedCausal(zoo._Base):
    """Causal plus key padding from a model input, spelled by hand."""

    def forward(self, x, attention_mask):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        keep = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & attention_mask[:, None, None, :].bool()
        s = (q @ k.transpose(-1, -2)) * zoo.D**-0.5
        return self.merge(s.masked_fill(~keep, torch.finfo(s.dtype).min).softmax(-1) @ v)


class NotPadding(zoo._Base):
    """A model input used as something other than key padding (it masks queries)."""

    def forward(self, x, attention_mask):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        keep = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & attention_mask[:, None, :, None].bool()
        s = (q @ k.transpose(-1, -2)) * zoo.D**-0.5
        return self.merge(s.masked_fill(~keep, -1e9).softmax(-1) @ v)


def test_key_padding_from_input():
    x, mask = torch.randn(2, 8, zoo.C), torch.ones(2, 8, dtype=torch.long)
    (site,) = classified(PaddedCausal(), (x, mask))
    assert site.mask_kind == "causal" and site.key_padding is not None and site.key_padding.name == "attention_mask"


def test_input_that_is_not_key_padding():
    x, mask = torch.randn(2, 8, zoo.C), torch.ones(2, 8, dtype=torch.long)
    (site,) = classified(NotPadding(), (x, mask))
    assert site.status == "skipped" and "not key padding" in site.reason


@pytest.mark.parametrize("name, reason", [
    ("caller_mask", "caller-provided"), ("caller_bool_mask", "caller-provided"),
])
def test_left_alone(name, reason):
    (site,) = classified(zoo.NOT_ATTENTION[name][0](), zoo.example_args(name))
    assert site.status == "skipped" and reason in site.reason


class Strided(zoo._Base):
    """Keeps every other key: neither causal, windowed nor absent."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        i = torch.arange(T)
        keep = (i[:, None] >= i[None, :]) & (i[None, :] % 2 == 0) | (i[:, None] == i[None, :])
        s = (q @ k.transpose(-1, -2)) * zoo.D**-0.5
        return self.merge(s.masked_fill(~keep, float("-inf")).softmax(-1) @ v)


def test_a_mask_of_no_fast_kind_over_positions_gets_its_program():
    (site,) = classified(Strided(), zoo.example_args("nanogpt"))
    assert site.status == "matched" and site.mask_kind == "positional" and site.position_mod, site.reason
    assert site.mask_how == "proof (position program)" and site.mask_up_to is None


def _single_token(name, hints):
    # one query, one key: T static
    return classified(zoo.ATTENTION[name][0](), zoo.example_args(name, T=1), hints)


def test_single_token_graph_takes_the_mask_of_its_hint():
    # one query against one key shows no window: the multi-token trace's site says what it is
    (long,) = classified(zoo.ATTENTION["sliding_window"][0](), zoo.example_args("sliding_window"))
    hint = {"status": "rewritten", "mask": long.mask_kind, "window": long.window, "alibi": False}
    (site,) = _single_token("sliding_window", [hint])
    assert (site.status, site.mask_kind, site.window) == ("matched", "sliding_window", 100)


@pytest.mark.parametrize("hints, reason", [
    ([], "has 0 attention sites, not 1"),
    ([{"status": "skipped", "reason": "arbitrary mask"}], "left this site (arbitrary mask)"),
    ([{"status": "rewritten", "mask": "causal", "window": None, "alibi": True}], "ALiBi"),
])
def test_single_token_graph_without_a_usable_hint_is_left(hints, reason):
    (site,) = _single_token("sliding_window", hints)
    assert site.status == "skipped" and reason in site.reason
