"""The reference semantics (``backends/reference.py``) against first principles.

Every backend's fast path is tested against ``dense_attention``; here ``dense_attention`` itself is
tested against a per-query, per-key Python loop that spells the semantics out one rule at a time,
plus properties that pin the sign conventions (ALiBi favours near keys, a sink only takes probability).
"""

import dataclasses
import math

import pytest
import torch

from pagedattn.backends import AttentionParams
from pagedattn.backends.reference import alibi_bias, dense_attention, earliest_visible_key, visible

B, HQ, HKV, Q, L, D, DV = 2, 4, 2, 3, 9, 5, 6
SLOPES = torch.tensor([0.5, 0.25, -0.125, 1.0], dtype=torch.float64)
SINKS = torch.tensor([-1.0, 0.5, 2.0, 3.0], dtype=torch.float64)


def brute_force(q, k, v, p: AttentionParams, q_pos, k_pos, present):
    """``q [Hq, Q, D]``, ``k [Hkv, L, D]``, ``v [Hkv, L, Dv]`` of one batch row, in float64, a query at a time.

    Query head ``h`` reads KV head ``h // (Hq // Hkv)``; a key is seen when it is present and, for causal
    attention, at or before the query (and fewer than ``window`` positions back, and in the query's own
    chunk of ``chunk_size`` positions); its logit is the scaled dot product, soft-capped, plus
    ``slope * (key position - query position)``; the sink is one more logit of the normalisation; a query
    that sees no key gives zeros.
    """
    q, k, v = q.double(), k.double(), v.double()
    hq, nq, _ = q.shape
    group = hq // k.shape[0]
    out = torch.zeros(hq, nq, v.shape[-1], dtype=torch.float64)
    for h in range(hq):
        kv = h // group
        for i in range(nq):
            logits, values = [], []
            for j in range(k.shape[1]):
                back = int(q_pos[i]) - int(k_pos[j])
                if not present[j]:
                    continue
                if p.causal and (back < 0 or (p.sliding_window > 0 and back >= p.sliding_window)):
                    continue
                if p.causal and p.chunk_size > 0 and int(q_pos[i]) // p.chunk_size != int(k_pos[j]) // p.chunk_size:
                    continue
                s = p.scale * float(q[h, i] @ k[kv, j])
                if p.softcap > 0:
                    s = p.softcap * math.tanh(s / p.softcap)
                if p.alibi_slopes is not None:
                    s += float(p.alibi_slopes[h]) * (int(k_pos[j]) - int(q_pos[i]))
                logits.append(s)
                values.append(v[kv, j])
            if not logits:
                continue
            sink = [float(p.sinks[h])] if p.sinks is not None else []
            m = max(logits + sink)
            weights = [math.exp(s - m) for s in logits]
            denom = sum(weights) + sum(math.exp(s - m) for s in sink)
            out[h, i] = sum(w * x for w, x in zip(weights, values)) / denom
    return out


def _operands(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, Q, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, L, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, L, DV, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _params(causal=True, window=0, softcap=0.0, alibi=False, sinks=False, scale=0.7, chunk=0):
    return AttentionParams(scale, causal, window, softcap, SLOPES if alibi else None, HKV, DV,
                           SINKS if sinks else None, chunk_size=chunk)


def _check(p: AttentionParams, dtype, exact, q_pos=None, k_pos=None, present=None):
    """``dense_attention`` against the loop, every batch row; positions default to the last Q of L."""
    q, k, v = _operands(dtype)
    p = dataclasses.replace(p, alibi_slopes=None if p.alibi_slopes is None else p.alibi_slopes.to(dtype),
                            sinks=None if p.sinks is None else p.sinks.to(dtype))
    got = dense_attention(q, k, v, p, q_pos, k_pos, present, exact=exact)
    assert got.shape == (B, HQ, Q, DV) and got.dtype == dtype
    qp = q_pos if q_pos is not None else torch.arange(L - Q, L)[None].expand(B, Q)
    kp = k_pos if k_pos is not None else torch.arange(L)[None].expand(B, L)
    pr = present if present is not None else torch.ones(B, L, dtype=torch.bool)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for b in range(B):
        want = brute_force(q[b], k[b], v[b], p, qp[b % qp.shape[0]], kp[b % kp.shape[0]], pr[b % pr.shape[0]])
        torch.testing.assert_close(got[b].double(), want, atol=tol, rtol=tol)
    return got


FEATURES = {
    "causal": dict(),
    "window": dict(window=3),
    "window_1": dict(window=1),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "chunked": dict(chunk=4),
    "chunked_window": dict(chunk=4, window=3),
    "bidirectional": dict(causal=False),
    "bidirectional_window_ignored": dict(causal=False, window=2),
    "bidirectional_chunk_ignored": dict(causal=False, chunk=3),
    "everything": dict(window=4, softcap=2.0, alibi=True, sinks=True, chunk=5),
}


@pytest.mark.parametrize("exact", [False, True], ids=["sdpa_path", "math_path"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_matches_the_loop(feature, dtype, exact):
    _check(_params(**FEATURES[feature]), dtype, exact)


@pytest.mark.parametrize("exact", [False, True], ids=["sdpa_path", "math_path"])
@pytest.mark.parametrize("feature", ["causal", "window", "chunked", "everything", "bidirectional"])
def test_key_padding_and_explicit_positions(feature, exact):
    # row 0: its queries at positions 10..12 over keys numbered 4..12, two keys absent;
    # row 1: every key absent, so every query sees nothing and gives zeros (also with a sink)
    q_pos = torch.tensor([[10, 11, 12], [6, 7, 8]])
    k_pos = torch.arange(4, 4 + L)[None].expand(B, L)
    present = torch.ones(B, L, dtype=torch.bool)
    present[0, [1, 7]] = False
    present[1] = False
    got = _check(_params(**FEATURES[feature]), torch.float64, exact, q_pos, k_pos, present)
    assert torch.all(got[1] == 0)


@pytest.mark.parametrize("exact", [False, True], ids=["sdpa_path", "math_path"])
def test_a_query_before_every_key_sees_nothing(exact):
    # causal, queries at positions 0..2 but keys at 5..13: no key is at or before any query
    q_pos = torch.arange(Q)[None]
    k_pos = torch.arange(5, 5 + L)[None]
    got = _check(_params(), torch.float64, exact, q_pos, k_pos)
    assert torch.all(got == 0) and not torch.isnan(got).any()


@pytest.mark.parametrize("exact", [False, True], ids=["sdpa_path", "math_path"])
def test_a_program_reads_each_rows_length_from_its_keys_present(exact):
    # positions shared by the rows, keys present per row: a program that reads the sequence's length n (keys among
    # the last 3 positions) reads each row's own (it raised on the rows' shapes); the same as one row at a time
    import json

    last = json.dumps({"version": 1, "float": "float32", "nodes": [
        ["q"], ["k"], ["n"], ["int", 3], ["sub", 2, 3], ["ge", 1, 4]], "allowed": 5, "bias": None})
    p = AttentionParams(0.5, False, 0, 0.0, None, HKV, DV, position_mod=last)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(B, HQ, Q, D, generator=g, dtype=torch.float64), torch.randn(B, HKV, L, D, generator=g,
                                                                                  dtype=torch.float64)
    v = torch.randn(B, HKV, L, DV, generator=g, dtype=torch.float64)
    present = torch.ones(B, L, dtype=torch.bool)
    present[1, 6:] = False  # row 1 ends after position 5
    both = dense_attention(q, k, v, p, key_present=present, exact=exact)
    rows = [dense_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], p, key_present=present[i:i + 1], exact=exact)
            for i in range(B)]
    torch.testing.assert_close(both, torch.cat(rows))


def test_causal_aligns_bottom_right():
    # Q < L: the queries are the last Q positions, so the first query already sees L - Q + 1 keys
    p = _params()
    allowed = visible(torch.arange(L - Q, L), torch.arange(L), p)  # [Q, L]
    assert allowed.sum(-1).tolist() == [L - Q + 1, L - Q + 2, L]
    assert visible(torch.arange(Q), torch.arange(L), _params(causal=False)) is None


def test_grouped_query_heads_read_their_kv_head():
    # GQA is K/V repeated per group of consecutive query heads (Hugging Face's repeat_kv)
    q, k, v = _operands(torch.float64)
    p = _params(softcap=1.5, sinks=True)
    mha = dataclasses.replace(p, num_kv_heads=HQ)
    got = dense_attention(q, k, v, p, exact=True)
    group = HQ // HKV
    want = dense_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), mha, exact=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_alibi_favours_near_keys():
    # equal scores: the probabilities alone come from ALiBi; a positive slope must weigh earlier keys less
    p = AttentionParams(1.0, True, 0, 0.0, torch.tensor([0.5], dtype=torch.float64), 1, L)
    q = torch.zeros(1, 1, 1, 4, dtype=torch.float64)
    k = torch.randn(1, 1, L, 4, dtype=torch.float64)
    v = torch.eye(L, dtype=torch.float64)[None, None]  # the output is each key's probability
    probs = dense_attention(q, k, v, p, exact=True)[0, 0, 0]
    assert torch.all(probs[1:] > probs[:-1])
    want = torch.softmax(0.5 * (torch.arange(L) - (L - 1)).double(), -1)
    torch.testing.assert_close(probs, want)
    bias = alibi_bias(torch.tensor([0.5]), torch.tensor([L - 1]), torch.arange(L))  # [1, 1, L]
    assert float(bias[0, 0, -1]) == 0 and float(bias[0, 0, 0]) == -0.5 * (L - 1)


def test_a_sink_only_takes_probability():
    # the output without a sink, scaled by the share the sink leaves: 1 / (1 + exp(sink - logsumexp(scores)))
    q, k, v = _operands(torch.float64)
    plain = dense_attention(q, k, v, _params(), exact=True)
    sunk = dense_attention(q, k, v, _params(sinks=True), exact=True)
    group = HQ // HKV
    s = 0.7 * q @ k.repeat_interleave(group, 1).transpose(-1, -2)  # [B, Hq, Q, L]
    s = s.masked_fill(~visible(torch.arange(L - Q, L), torch.arange(L), _params()), float("-inf"))
    share = torch.sigmoid(s.logsumexp(-1) - SINKS.view(1, -1, 1))  # [B, Hq, Q]
    torch.testing.assert_close(sunk, plain * share[..., None], atol=1e-12, rtol=0)


def test_earliest_visible_key():
    assert earliest_visible_key(10, _params(window=4)) == 7
    assert earliest_visible_key(2, _params(window=4)) == 0
    assert earliest_visible_key(10, _params()) == 0
    assert earliest_visible_key(10, _params(causal=False, window=4)) == 0  # a window needs causal attention
    assert earliest_visible_key(torch.tensor([10, 2]), _params(window=4)).tolist() == [7, 0]
    assert earliest_visible_key(10, _params(chunk=4)) == 8  # the start of its chunk
    assert earliest_visible_key(10, _params(chunk=4, window=2)) == 9  # the later of the two starts
    assert earliest_visible_key(torch.tensor([10, 3]), _params(chunk=4)).tolist() == [8, 0]
