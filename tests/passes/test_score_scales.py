"""Scales and biases folded from ``add(alpha=...)`` and ``baddbmm``: once silently wrong, now exact."""

import torch

import pagedattn

from ..rewriter import zoo


def _causal_bias(T):
    return torch.zeros(T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))


class AddAlpha(zoo._Base):
    """``mask + alpha * scores``: alpha scales the scores, not the mask."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        s = torch.add(_causal_bias(x.shape[1]), q @ k.transpose(-1, -2), alpha=0.125)
        return self.merge(torch.softmax(s, -1) @ v)


class BaddbmmThenScale(zoo._Base):
    """``baddbmm(bias, q, kᵀ, alpha=a) / c``: the bias is divided by ``c`` too (an ALiBi-like bias)."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        B, H, T, D = q.shape
        bias = (_causal_bias(T)[None] + torch.arange(T)[None, None, :] * 0.1).expand(B * H, T, T)
        s = torch.baddbmm(bias, q.reshape(B * H, T, D), k.reshape(B * H, T, D).transpose(1, 2), alpha=0.3) / 2.0
        p = torch.softmax(s, -1)
        return self.merge((p @ v.reshape(B * H, T, D)).view(B, H, T, D))


class ImplicitEinsum(zoo._Base):
    """An einsum without ``->``: refused with a reason, not a crash of the pass."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        s = torch.einsum("bhqd,bhkd", q, k) * 0.25
        return self.merge(torch.softmax(s, -1) @ v)


def test_add_alpha_scales_the_scores():
    m = AddAlpha().eval()
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, zoo.C),))
    assert rm.report[0]["status"] == "rewritten" and rm.report[0]["scale"] == 0.125
    x = torch.randn(3, 11, zoo.C)
    torch.testing.assert_close(rm(x), m(x))


def test_baddbmm_bias_takes_the_scale_applied_after_it():
    m = BaddbmmThenScale().eval()
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, zoo.C),))
    assert rm.report[0]["status"] == "rewritten" and rm.report[0]["alibi"]
    x = torch.randn(3, 11, zoo.C)
    torch.testing.assert_close(rm(x), m(x))


def test_an_einsum_without_explicit_output_is_left_with_a_reason():
    m = ImplicitEinsum().eval()
    x = torch.randn(2, 8, zoo.C)
    rm = pagedattn.rewrite(m, (x,))
    assert rm.report[0]["status"] == "skipped" and "no explicit output" in rm.report[0]["reason"]
    torch.testing.assert_close(rm(x), m(x))
