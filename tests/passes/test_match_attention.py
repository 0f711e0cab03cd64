import pytest
import torch

from pagedattn.passes import match_attention

from ..rewriter import zoo
from ..support import aten_graph


def matched(module, args):
    """``module``'s sites after ``match_attention``, with the pass's report and the graph's code before."""
    gm, ctx = aten_graph(module, args)
    before = gm.code
    report = match_attention(gm, ctx)
    return ctx.sites, report, before == gm.code


@pytest.mark.parametrize("name", ["nanogpt", "einsum_bshd", "bmm_3d", "baddbmm", "gqa_expand", "mqa_broadcast",
                                  "softcap", "split_scale", "sdpa_mask", "cross_attention"])
def test_matches_and_recovers_layout(name):
    sites, report, unchanged = matched(zoo.ATTENTION[name][0](), zoo.example_args(name))
    assert not report.changed and unchanged  # matching only records what it found
    (site,) = sites
    assert site.status == "matched", site.reason
    expect = zoo.ATTENTION[name][1]
    assert (site.num_heads, site.head_dim) == (zoo.H, zoo.D)
    assert site.num_kv_heads == expect.get("num_kv_heads", zoo.H)
    assert site.scale == pytest.approx(expect.get("scale", zoo.D**-0.5))
    assert site.softcap == expect.get("softcap")
    q, k = site.query.meta["val"], site.key.meta["val"]
    assert q.dim() == 4 and k.dim() == 4 and k.shape[1] == site.num_kv_heads


def test_mask_terms_collected():
    (site,), _, _ = matched(zoo.ALiBi(), zoo.example_args("alibi"))
    assert len(site.biases) == 1 and len(site.conds) == 1


@pytest.mark.parametrize("module, reason", [
    (zoo.Router(), "not attention"),
])
def test_not_attention(module, reason):
    sites, _, unchanged = matched(module, zoo.example_args("router"))
    assert sites and all(s.status == "skipped" and reason in s.reason for s in sites), sites
    assert unchanged


class ReturnsWeights(zoo._Base):
    def forward(self, x):
        q, k, v = self.qkv(x)
        p = torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1)
        return self.merge(p @ v), p


class TrainingDropout(zoo._Base):
    def forward(self, x):
        q, k, v = self.qkv(x)
        p = torch.nn.functional.dropout(torch.softmax(q @ k.transpose(-1, -2), -1), 0.5, training=True)
        return self.merge(p @ v)


class SoftmaxOverQueries(zoo._Base):
    def forward(self, x):
        q, k, v = self.qkv(x)
        return self.merge(torch.softmax(q @ k.transpose(-1, -2), -2) @ v)


def _causal_scores(q, k, x):
    T = x.shape[1]
    return q @ k.transpose(-1, -2), torch.ones(T, T, dtype=torch.bool).tril()


class MaskThenSoftcap(zoo._Base):
    """The mask inside the cap: tanh(-inf) is -1, so every masked key stays visible with a logit of -5."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        s, keep = _causal_scores(q, k, x)
        s = s.masked_fill(~keep, float("-inf"))
        return self.merge(torch.softmax(5.0 * torch.tanh(s * 0.25 / 5.0), -1) @ v)


class WhereThenSoftcap(zoo._Base):
    def forward(self, x):
        q, k, v = self.qkv(x)
        s, keep = _causal_scores(q, k, x)
        s = torch.where(keep, s, torch.finfo(s.dtype).min)
        return self.merge(torch.softmax(5.0 * torch.tanh(s * 0.25 / 5.0), -1) @ v)


class SinksBeforeTheScale(zoo._Base):
    """gpt-oss's sinks, concatenated before the scale (or the cap): the model scales its sink logits too."""

    cap = False

    def __init__(self):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.linspace(-1.0, 3.0, zoo.H))

    def forward(self, x):
        q, k, v = self.qkv(x)
        s, keep = _causal_scores(q, k, x)
        s = s.masked_fill(~keep, float("-inf"))
        B, H, T, _ = s.shape
        s = torch.cat([s, self.sinks.reshape(1, H, 1, 1).expand(B, H, T, 1)], -1)
        s = 5.0 * torch.tanh(s / 5.0) if self.cap else s * 0.25
        return self.merge(torch.softmax(s, -1)[..., :-1] @ v)


class SinksBeforeTheCap(SinksBeforeTheScale):
    cap = True


@pytest.mark.parametrize("cls, reason", [
    (ReturnsWeights, "used elsewhere"),
    (TrainingDropout, "dropout"),
    (SoftmaxOverQueries, "last dimension"),
    (MaskThenSoftcap, "a mask applied before the soft-cap"),
    (WhereThenSoftcap, "a mask applied before the soft-cap"),
    (SinksBeforeTheScale, "sinks concatenated before the scores are scaled"),
    (SinksBeforeTheCap, "sinks concatenated before the scores are scaled or soft-capped"),
])
def test_counter_examples(cls, reason):
    (site,), _, _ = matched(cls(), zoo.example_args("nanogpt"))
    assert site.status == "skipped" and reason in site.reason


class ScoresMetadataRead(zoo._Base):
    """XLM's spelling: the mask expanded to the scores' shape, the probabilities cast to their dtype."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        s = q @ k.transpose(-1, -2) * 0.25
        T = x.shape[1]
        mask = (torch.arange(T)[None, :] > torch.arange(T)[:, None]).expand_as(s)
        s = s.masked_fill(mask, float("-inf"))
        p = torch.softmax(s.float(), -1).type_as(s)
        return self.merge(p @ v)


class ScoresValueRead(zoo._Base):
    """Counter-example: the scores' values leave the softmax path (their row sums feed the output)."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        s = q @ k.transpose(-1, -2) * 0.25
        p = torch.softmax(s, -1)
        return self.merge(p @ v) + s.sum(-1, keepdim=True).transpose(1, 2).mean()


def test_scores_read_for_their_shape_or_dtype_only_still_match():
    (site,), _, _ = matched(ScoresMetadataRead(), zoo.example_args("nanogpt"))
    assert site.status == "matched", site.reason


def test_scores_read_for_their_values_are_refused():
    (site,), _, _ = matched(ScoresValueRead(), zoo.example_args("nanogpt"))
    assert site.status == "skipped" and "outside the softmax" in site.reason
