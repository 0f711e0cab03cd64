"""Naive attention written the many ways people write it, and softmaxes that are not attention.

Every module maps ``x [B, T, C]`` to ``[B, T, C]`` (cross-attention also takes ``memory``).
``EXPECT`` says what the rewriter must report for each.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

C, H = 32, 4
D = C // H


class _Base(nn.Module):
    kv_heads = H

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(C, H * D)
        self.k = nn.Linear(C, self.kv_heads * D)
        self.v = nn.Linear(C, self.kv_heads * D)
        self.o = nn.Linear(H * D, C)

    def heads(self, x, n):  # [B, T, n*D] -> [B, n, T, D]
        B, T, _ = x.shape
        return x.view(B, T, n, D).transpose(1, 2)

    def qkv(self, x):
        return self.heads(self.q(x), H), self.heads(self.k(x), self.kv_heads), self.heads(self.v(x), self.kv_heads)

    def merge(self, y):  # [B, H, T, D] -> [B, T, C]
        B, _, T, _ = y.shape
        return self.o(y.transpose(1, 2).reshape(B, T, H * D))


def _causal(T, device=None):
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


class NanoGPT(_Base):
    def __init__(self, block=128):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.qkv(x)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        return self.merge(F.softmax(att, dim=-1) @ v)


class Einsum(_Base):
    def forward(self, x):
        q, k, v = self.qkv(x)
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(D)
        T = x.shape[1]
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        return self.merge(torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v))


class EinsumBSHD(_Base):
    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, H, D)
        k = self.k(x).view(B, T, H, D)
        v = self.v(x).view(B, T, H, D)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * D**-0.5
        s = s + torch.full((T, T), float("-inf")).triu(1)
        y = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
        return self.o(y.reshape(B, T, C))


class Baddbmm(_Base):
    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.reshape(B * H, T, D) for t in self.qkv(x))
        mask = torch.zeros(T, T).masked_fill(~_causal(T), -1e4).expand(B * H, T, T)
        s = torch.baddbmm(mask, q, k.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(D))
        y = torch.bmm(torch.softmax(s, -1), v)
        return self.merge(y.view(B, H, T, D))


class Bmm3D(_Base):
    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.reshape(B * H, T, D) for t in self.qkv(x))
        s = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(D)
        s = s + torch.triu(torch.full((T, T), -10000.0), 1)
        y = torch.bmm(s.softmax(-1), v)
        return self.merge(y.view(B, H, T, D))


class SplitScale(_Base):
    def forward(self, x):
        q, k, v = self.qkv(x)
        q, k = q * D**-0.25, k * D**-0.25
        s = q @ k.transpose(-1, -2)
        T = x.shape[1]
        s = torch.where(_causal(T), s, torch.finfo(s.dtype).min)
        return self.merge(s.softmax(-1) @ v)


class Fp32Softmax(_Base):
    def forward(self, x):
        q, k, v = self.qkv(x)
        s = torch.matmul(q, k.transpose(2, 3)).float() / math.sqrt(D)
        T = x.shape[1]
        s = s.masked_fill(~_causal(T), float("-inf"))
        p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.merge(torch.matmul(F.dropout(p, 0.1, training=False), v))


class WhereMask(_Base):
    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        i = torch.arange(T)
        s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(D))
        s = torch.where(i[:, None] >= i[None, :], s, float("-inf"))
        return self.merge(s.softmax(-1) @ v)


class GQAExpand(_Base):
    kv_heads = 2

    def forward(self, x):
        q, k, v = self.qkv(x)
        B, _, T, _ = k.shape
        g = H // self.kv_heads
        k = k[:, :, None].expand(B, self.kv_heads, g, T, D).reshape(B, H, T, D)
        v = v[:, :, None].expand(B, self.kv_heads, g, T, D).reshape(B, H, T, D)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        s = s.masked_fill(~_causal(T), float("-inf"))
        return self.merge(s.softmax(-1) @ v)


class GQARepeatInterleave(_Base):
    kv_heads = 1

    def forward(self, x):
        q, k, v = self.qkv(x)
        k = k.repeat_interleave(H // self.kv_heads, dim=1)
        v = v.repeat_interleave(H // self.kv_heads, dim=1)
        T = x.shape[1]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        s = s.masked_fill(~_causal(T), float("-inf"))
        return self.merge(s.softmax(-1) @ v)


class MQABroadcast(_Base):
    kv_heads = 1

    def forward(self, x):
        q, k, v = self.qkv(x)  # k, v: [B, 1, T, D], broadcast by matmul
        T = x.shape[1]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        s = s.masked_fill(~_causal(T), float("-inf"))
        return self.merge(s.softmax(-1) @ v)


class SoftCap(_Base):
    cap = 5.0

    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        s = (q @ k.transpose(-1, -2)) * D**-0.5
        s = torch.tanh(s / self.cap) * self.cap
        s = s.masked_fill(~_causal(T), float("-inf"))
        return self.merge(s.softmax(-1) @ v)


def alibi_slopes(n):
    return torch.tensor([2 ** (-8 * (h + 1) / n) for h in range(n)])


class ALiBi(_Base):
    def __init__(self):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(H))

    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        i = torch.arange(T)
        bias = self.slopes[:, None, None] * (i[None, :] - i[:, None])[None]  # [H, T, T]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D) + bias
        s = s.masked_fill(~_causal(T), float("-inf"))
        return self.merge(s.softmax(-1) @ v)


class SlidingWindow(_Base):
    window = 100  # wider than the traced example: must still be found

    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        i = torch.arange(T)
        d = i[:, None] - i[None, :]
        allowed = (d >= 0) & (d < self.window)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        s = s.masked_fill(~allowed, float("-inf"))
        return self.merge(s.softmax(-1) @ v)


class SDPACausal(_Base):
    def forward(self, x):
        q, k, v = self.qkv(x)
        return self.merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class SDPAMask(_Base):
    kv_heads = 2

    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(T), scale=0.2, enable_gqa=True))


class Bidirectional(_Base):
    def forward(self, x):
        q, k, v = self.qkv(x)
        return self.merge(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1) @ v)


class CrossAttention(_Base):
    def forward(self, x, memory):
        q = self.heads(self.q(x), H)
        k, v = self.heads(self.k(memory), H), self.heads(self.v(memory), H)
        return self.merge(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1) @ v)


# ------------------------------------------------------------------ must not match


class Router(nn.Module):
    """Mixture-of-experts gate: a softmax over expert logits."""

    def __init__(self, experts=4):
        super().__init__()
        torch.manual_seed(0)
        self.gate = nn.Linear(C, experts)
        self.experts = nn.ModuleList(nn.Linear(C, C) for _ in range(experts))

    def forward(self, x):
        w = torch.softmax(self.gate(x), -1)  # [B, T, E]
        return sum(w[..., e:e + 1] * f(x) for e, f in enumerate(self.experts))


class LearnedRelativeBias(_Base):
    def __init__(self, block=128):
        super().__init__()
        self.rel = nn.Parameter(torch.randn(H, block, block))

    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D) + self.rel[:, :T, :T]
        s = s.masked_fill(~_causal(T), float("-inf"))
        return self.merge(s.softmax(-1) @ v)


class T5RelativeBias(_Base):
    """T5's decoder self-attention: no scaling, a learned bias per head looked up by a log-spaced bucket
    of the key-query distance (causal: keys at or before the query), and the causal mask."""

    buckets, max_distance = 32, 128

    def __init__(self):
        super().__init__()
        self.rel = nn.Embedding(self.buckets, H)

    def bucket(self, rel):  # rel = key - query
        n = -torch.min(rel, torch.zeros_like(rel))  # distance back to the key, >= 0
        exact = self.buckets // 2
        large = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(self.max_distance / exact)
                         * (self.buckets - exact)).to(torch.long)
        return torch.where(n < exact, n, torch.min(large, torch.full_like(large, self.buckets - 1)))

    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        rel = torch.arange(T)[None, :] - torch.arange(T)[:, None]  # [T, T]
        bias = self.rel(self.bucket(rel)).permute(2, 0, 1)  # [H, T, T]
        s = q @ k.transpose(-1, -2) + bias
        s = s.masked_fill(~_causal(T), float("-inf"))
        return self.merge(s.softmax(-1) @ v)


class CallerMask(_Base):
    def forward(self, x, mask):
        q, k, v = self.qkv(x)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D) + mask
        return self.merge(s.softmax(-1) @ v)


class CallerBoolMask(_Base):
    def forward(self, x, mask):
        q, k, v = self.qkv(x)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        return self.merge(s.masked_fill(~mask, float("-inf")).softmax(-1) @ v)


ATTENTION = {
    "nanogpt": (NanoGPT, dict(mask="causal")),
    "einsum": (Einsum, dict(mask="causal")),
    "einsum_bshd": (EinsumBSHD, dict(mask="causal")),
    "baddbmm": (Baddbmm, dict(mask="causal")),
    "bmm_3d": (Bmm3D, dict(mask="causal")),
    "split_scale": (SplitScale, dict(mask="causal", scale=D**-0.5)),
    "fp32_softmax": (Fp32Softmax, dict(mask="causal")),
    "where_mask": (WhereMask, dict(mask="causal")),
    "gqa_expand": (GQAExpand, dict(mask="causal", num_kv_heads=2)),
    "gqa_repeat_interleave": (GQARepeatInterleave, dict(mask="causal", num_kv_heads=1)),
    "mqa_broadcast": (MQABroadcast, dict(mask="causal", num_kv_heads=1)),
    "softcap": (SoftCap, dict(mask="causal", softcap=5.0)),
    "alibi": (ALiBi, dict(mask="causal", alibi=True)),
    "sliding_window": (SlidingWindow, dict(mask="sliding_window", window=100)),
    "sdpa_causal": (SDPACausal, dict(mask="causal")),
    "sdpa_mask": (SDPAMask, dict(mask="causal", num_kv_heads=2, scale=0.2)),
    "bidirectional": (Bidirectional, dict(mask="none")),
    "cross_attention": (CrossAttention, dict(mask="none")),
    # position-only biases no fast kind expresses: served by their own program (position_mod)
    "t5_relative_bias": (T5RelativeBias, dict(mask="positional", scale=1.0)),
    "learned_relative_bias": (LearnedRelativeBias, dict(mask="positional", up_to=128)),
}

NOT_ATTENTION = {
    "router": (Router, None),
    "caller_mask": (CallerMask, "caller-provided"),
    "caller_bool_mask": (CallerBoolMask, "caller-provided"),
}


def example_args(name, B=2, T=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g)
    if name == "cross_attention":
        return (x, torch.randn(B, T + 3, C, generator=g))
    if name == "caller_mask":
        return (x, torch.randn(B, 1, T, T, generator=g))
    if name == "caller_bool_mask":
        return (x, (torch.rand(B, 1, T, T, generator=g) > 0.3) | torch.eye(T, dtype=torch.bool))
    return (x,)
